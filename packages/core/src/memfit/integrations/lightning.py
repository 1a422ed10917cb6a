"""The memory pre-flight inside Lightning: ``L.Trainer(..., callbacks=[MemfitCallback()])``.

At ``on_fit_start`` (the optimizers configured, the dataloaders not built yet) the callback traces one
training step of the LightningModule on the first batch of its train dataloader
(``memfit.estimate.trainers``: fake tensors, nothing moved or computed): ``training_step(batch, 0)`` as the
loss (its ``loss``), the optimizer ``configure_optimizers`` made (same class and hyperparameters), the
trainer's precision (``bf16-mixed`` / ``16-mixed``: autocast). It prints one line, and raises
``memfit.DoesNotFit`` naming the batch that fits when the step will not fit: before any optimizer step.

``auto_batch=True``: a step that does not fit trains at the largest batch that fits and divides the
global batch (batch x ``accumulate_grad_batches``): the ``batch_size`` attribute of the module, its
hparams or its datamodule is set, as Lightning's ``BatchSizeFinder`` does, and ``accumulate_grad_batches``
raised to keep the global batch; the dataloader is built afterwards, at the new batch. No trial run.
A step the tracer cannot follow is said in one line, and training goes on unchanged.
"""

from __future__ import annotations

from typing import Any

from memfit.errors import UsageError

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the extra is installed in the dev environment
    raise UsageError(
        "error: memfit.integrations.lightning needs lightning: pip install 'memfit-core[lightning]'"
    ) from None

from memfit.estimate import trainers
from memfit.estimate.fit import MARGIN

_AMP = {"bf16-mixed": "bf16", "16-mixed": "fp16", "bf16": "bf16", "16": "fp16"}


def _first_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the fit's train dataloader(s), built the way the fit loop builds them."""
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
    from lightning.pytorch.utilities import CombinedLoader

    loaders = _request_dataloader(trainer.fit_loop._data_source)
    if isinstance(loaders, (list, tuple, dict)):
        got = trainers.first_batch(CombinedLoader(loaders, "max_size_cycle"), "the train dataloaders")
        return got[0] if isinstance(got, tuple) and len(got) == 3 else got
    return trainers.first_batch(loaders, "the LightningModule's train dataloader")


def _training_step_loss(module: pl.LightningModule, batch: Any) -> Any:
    out = module.training_step(batch, 0)
    if out is None:
        raise TypeError("training_step returned None (a skipped step): no loss to trace")
    return out


_training_step_loss.__name__ = "training_step"


class MemfitCallback(pl.Callback):
    """The memory pre-flight of a Lightning fit (see the module docstring). ``gpu_gib``: the GPU's memory
    (default: the visible GPU's); ``auto_batch``: shrink the batch to one that fits, raising
    ``accumulate_grad_batches``; ``device``: "cuda" or "cpu" kernels (default: "cuda" when ``gpu_gib`` is
    given or the trainer runs on a GPU); ``margin``: as ``memfit fit``. ``check`` holds the estimate."""

    def __init__(
        self,
        gpu_gib: float | None = None,
        auto_batch: bool = False,
        device: str | None = None,
        margin: float = MARGIN,
        batch_arg_name: str = "batch_size",
    ) -> None:
        if gpu_gib is not None:
            trainers.capacity("cuda", gpu_gib)  # a bad size is one line now
        self.gpu_gib, self.auto_batch, self.device, self.margin = gpu_gib, auto_batch, device, margin
        self.batch_arg_name = batch_arg_name
        self.check: trainers.Check | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            print("[memfit] pre-flight skipped, training unchanged: manual optimisation is not traced")
            return
        on_gpu = trainer.strategy.root_device.type == "cuda"
        device = self.device or ("cuda" if self.gpu_gib is not None or on_gpu else "cpu")
        batch = _first_batch(trainer)
        optimizers = trainer.optimizers
        if len(optimizers) > 1:
            print("[memfit] pre-flight skipped, training unchanged: more than one optimizer is not traced")
            return
        target = trainers.user_target(
            pl_module,
            batch,
            _training_step_loss,
            optimizers[0] if optimizers else None,
            _AMP.get(str(trainer.precision)),
            device,
            leave_out=(trainer,),
        )
        setup = f"{target.describe}, precision {trainer.precision}"
        from lightning.pytorch.strategies import DDPStrategy

        # DDP ranks each hold gradient buckets; sharded strategies are not modelled (judged as one process)
        ranks = trainer.world_size if isinstance(trainer.strategy, DDPStrategy) else 1
        try:
            c = trainers.check(target, self.gpu_gib, self.margin, ranks)
        except trainers.Untraceable as e:
            print(f"[memfit] pre-flight skipped, training unchanged: {str(e).removeprefix('error: ')}")
            return
        self.check = c
        print(c.line(setup))
        if c.fits:
            return
        fits = trainers.fitting_batch(c, target)
        accumulation = trainer.accumulate_grad_batches
        total = c.batch * accumulation
        b = trainers.shrink_for_accumulation(total, fits)
        if not (self.auto_batch and b):
            raise trainers.does_not_fit(c, target, fits)
        from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise UsageError(
                f"error: auto_batch sets the batch through a `{self.batch_arg_name}` attribute of the "
                f"LightningModule, its hparams or its datamodule, and there is none; add one that the train "
                f"dataloader reads (batch {b} with accumulate_grad_batches {total // b} fits)"
            )
        lightning_setattr(pl_module, self.batch_arg_name, b)
        trainer.accumulate_grad_batches = total // b
        print(
            f"[memfit] auto_batch: batch {c.batch} -> {b}, accumulate_grad_batches {accumulation} -> "
            f"{total // b} (global batch {total} unchanged; the largest batch that fits is {fits})"
        )
