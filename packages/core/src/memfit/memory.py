"""The name a step file of yours imports: ``from memfit.memory import TrainStep`` (see README, `memfit
estimate`).

This is the public spelling of the step description; it lives in ``memfit.step`` (with
``default_optimizer`` and ``AMP_DTYPES``), which memfit's own code imports.
"""

from memfit.step import AMP_DTYPES, TrainStep, default_optimizer

__all__ = ["AMP_DTYPES", "TrainStep", "default_optimizer"]
