"""The memory pre-flight inside Lightning: ``L.Trainer(..., callbacks=[MemfitCallback()])``.

At ``on_fit_start`` (the optimizers configured, the dataloaders not built yet) the callback traces one
training step of the LightningModule on the first batch of its train dataloader
(``memfit.estimate.trainers``: fake tensors, nothing moved or computed): ``training_step(batch, 0)`` as the
loss (its ``loss``; the fake copy reads the trainer, its ``self.log`` does nothing), the optimizer
``configure_optimizers`` made (same class and hyperparameters), ``accumulate_grad_batches`` (the gradients
kept between micro-batches) and the trainer's precision (``bf16-mixed`` / ``16-mixed``: autocast;
``bf16-true`` / ``16-true``: the batch converted by the precision plugin, the step in its dtype). It prints
one line (rank 0), and raises ``memfit.DoesNotFit`` naming the batch that fits when the step will not fit:
before any optimizer step. One pre-flight per trainer, however many callbacks.

``auto_batch=True``: a step that does not fit trains at the largest batch that divides the global batch
(batch x ``accumulate_grad_batches``) and fits at the accumulation that keeps it: the ``batch_size``
attribute of the module, its hparams or its datamodule is set, as Lightning's ``BatchSizeFinder`` does,
and ``accumulate_grad_batches`` raised; the dataloader is built once more to check it follows the
attribute (when it does not, the attribute is put back and a one-line ``UsageError`` says so, the
accumulation unchanged). No trial run. A step the tracer cannot follow is said in one line, and training
goes on unchanged.
"""

from __future__ import annotations

import contextlib
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


def _no_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` / ``self.log_dict`` of the fake copy: nothing of the trace reaches the trainer's logs."""


def _step_loss(trainer: pl.Trainer) -> Any:
    """The loss of a traced step: ``training_step(batch, 0)`` of the fake copy, which reads the trainer as
    the module does (``self.trainer.accumulate_grad_batches``) but logs nothing (its ``log`` and
    ``log_dict`` do nothing), inside the precision's step context where it is not autocast (``-true``
    precisions: new tensors in the step's dtype), as ``Strategy.training_step`` runs it."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    precision = trainer.precision_plugin
    context = precision.train_step_context if isinstance(precision, HalfPrecision) else contextlib.nullcontext

    def training_step(module: pl.LightningModule, batch: Any) -> Any:
        module.trainer = trainer  # the copy, like a pickled module, has none
        module.log = module.log_dict = _no_log
        with context():
            out = module.training_step(batch, 0)
        if out is None:
            raise trainers.NoLoss("training_step returned None for batch 0 (Lightning skips such a step)")
        return out

    return training_step


def _batch_size(trainer: pl.Trainer) -> int:
    """The batch of the train dataloader as the fit loop will build it."""
    return trainers.BatchSpec.of(_first_batch(trainer)).size


def _first_in(trainer: pl.Trainer) -> MemfitCallback | None:
    return next((c for c in trainer.callbacks if isinstance(c, MemfitCallback)), None)


class MemfitCallback(pl.Callback):
    """The memory pre-flight of a Lightning fit (see the module docstring). ``gpu_gib``: the GPU's memory
    (default: the visible GPU's); ``auto_batch``: shrink the batch to one that fits, raising
    ``accumulate_grad_batches``; ``device``: "cuda" or "cpu" kernels (default: "cuda" when ``gpu_gib`` is
    given or the trainer runs on a GPU); ``margin``: the fraction of the memory kept free, as
    ``memfit estimate --margin`` (default 0.1). Bad settings are one line (``UsageError``) here, not at
    ``fit()``. ``check`` holds the estimate."""

    def __init__(
        self,
        gpu_gib: float | None = None,
        auto_batch: bool = False,
        device: str | None = None,
        margin: float = MARGIN,
        batch_arg_name: str = "batch_size",
    ) -> None:
        trainers.check_settings(gpu_gib, auto_batch, device, margin)  # one line now, not at fit()
        if not isinstance(batch_arg_name, str) or not batch_arg_name.isidentifier():
            raise UsageError(
                f"error: batch_arg_name is an attribute name, e.g. 'batch_size'; got {batch_arg_name!r}"
            )
        self.gpu_gib, self.auto_batch, self.device, self.margin = gpu_gib, auto_batch, device, margin
        self.batch_arg_name = batch_arg_name
        self.check: trainers.Check | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _first_in(trainer) is not self:  # a second MemfitCallback: the first one checks
            return
        say = print if trainer.is_global_zero else (lambda *a, **k: None)  # every rank checks; one prints
        if not pl_module.automatic_optimization:
            say("[memfit] pre-flight skipped, training unchanged: manual optimisation is not traced")
            return
        on_gpu = trainer.strategy.root_device.type == "cuda"
        device = self.device or ("cuda" if self.gpu_gib is not None or on_gpu else "cpu")
        # as the fit loop hands it to training_step: in a -true precision's dtype
        batch = trainer.precision_plugin.convert_input(_first_batch(trainer))
        optimizers = trainer.optimizers
        if len(optimizers) > 1:
            say("[memfit] pre-flight skipped, training unchanged: more than one optimizer is not traced")
            return
        target = trainers.user_target(
            pl_module,
            batch,
            _step_loss(trainer),
            optimizers[0] if optimizers else None,
            _AMP.get(str(trainer.precision)),
            device,
            accumulate=trainer.accumulate_grad_batches,
            leave_out=(trainer,),
        )
        setup = f"{target.describe}, precision {trainer.precision}"
        from lightning.pytorch.strategies import DDPStrategy

        # DDP ranks each hold gradient buckets; sharded strategies are not modelled (judged as one process)
        ranks = trainer.world_size if isinstance(trainer.strategy, DDPStrategy) else 1
        try:
            c = trainers.check(target, self.gpu_gib, self.margin, ranks)
        except trainers.Untraceable as e:
            say(f"[memfit] pre-flight skipped, training unchanged: {str(e).removeprefix('error: ')}")
            return
        self.check = c
        say(c.line(setup))
        if c.fits:
            return
        fits = trainers.fitting_batch(c, target)
        accumulation = trainer.accumulate_grad_batches
        total = c.batch * accumulation
        b = trainers.accumulated_batch(c, target, total, fits) if self.auto_batch else 0
        if not b:
            raise trainers.does_not_fit(c, target, fits)
        from lightning.pytorch.utilities import parsing

        name = self.batch_arg_name
        if not parsing.lightning_hasattr(pl_module, name):
            raise UsageError(
                f"error: auto_batch sets the batch through a `{name}` attribute of the LightningModule, its "
                f"hparams or its datamodule, and there is none; add one that the train dataloader reads "
                f"(batch {b} with accumulate_grad_batches {total // b} fits)"
            )
        before = parsing.lightning_getattr(pl_module, name)
        parsing.lightning_setattr(pl_module, name, b)
        got = _batch_size(trainer)  # the dataloader as the fit loop will build it, at the new batch?
        if got != b:
            parsing.lightning_setattr(pl_module, name, before)  # nothing changed, accumulation neither
            raise UsageError(
                f"error: auto_batch set `{name}` to {b}, but the train dataloader still makes batches of "
                f"{got}, so nothing was changed: build the DataLoader with batch_size=self.{name} (or "
                f"self.hparams.{name}, or the datamodule's) (batch {b} with accumulate_grad_batches "
                f"{total // b} fits)"
            )
        trainer.accumulate_grad_batches = total // b
        say(
            f"[memfit] auto_batch: batch {c.batch} -> {b}, accumulate_grad_batches {accumulation} -> "
            f"{total // b} (global batch {total} unchanged; the largest batch that divides it and fits at "
            "that accumulation, its gradients kept between micro-batches)"
        )
