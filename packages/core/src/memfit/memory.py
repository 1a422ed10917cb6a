"""The name a step file of yours imports: ``from memfit.memory import TrainStep`` (see README, `memfit
estimate`).

The estimator lives in ``memfit.estimate``; this module is the public spelling of its step description,
which user files written for earlier versions import. memfit's own code imports ``memfit.estimate.memory``.
"""

from memfit.estimate.memory import TrainStep

__all__ = ["TrainStep"]
