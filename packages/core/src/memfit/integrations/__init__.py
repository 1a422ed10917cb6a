"""The memory pre-flight inside other trainers: ``memfit.integrations.hf.MemfitCallback`` (Hugging Face
``Trainer``) and ``memfit.integrations.lightning.MemfitCallback`` (Lightning). Each module imports its
library (an extra: ``memfit-core[hf]``, ``memfit-core[lightning]``); ``import memfit`` imports neither.
The plain-loop call they share is ``memfit.preflight`` (``memfit.estimate.trainers``)."""
