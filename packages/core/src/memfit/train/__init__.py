"""The train wing: settings, the Trainer, run folders, checkpoints, export, DDP, metrics log and plots.

A new training feature goes here. This wing may use ``memfit.ops`` and ``memfit.estimate`` (the memory
pre-flight); neither imports it.
"""
