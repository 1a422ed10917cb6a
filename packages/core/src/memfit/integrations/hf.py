"""The memory pre-flight inside Hugging Face's ``Trainer``: ``Trainer(..., callbacks=[MemfitCallback()])``.

Before the first step the callback traces one training step of the trainer's own model on the first batch
of its own train dataloader (``memfit.estimate.trainers``: fake tensors, nothing moved or computed), with
the trainer's loss (``Trainer.compute_loss``: the model's loss from its labels, or your override), its
optimizer (the one you passed, else the class and hyperparameters ``args.optim`` makes: AdamW, Adafactor,
SGD, fused or not), its precision (``args.bf16`` / ``args.fp16``: autocast), the model's gradient
checkpointing, the per-device batch and ``args.gradient_accumulation_steps`` (the gradients kept between
micro-batches, as ``memfit estimate --accumulate``). It prints one line (the main process), and raises
``memfit.DoesNotFit`` naming the batch that fits when the step will not fit: before any optimizer step,
the weights untouched; a ``train()`` after a refusal is checked again. Batches without labels, when the
model's own loss needs them, are refused in one line.

``auto_batch=True``: a step that does not fit trains at the largest per-device batch that divides the
global batch (per-device batch x gradient accumulation) and fits at the accumulation that keeps it, the
accumulation raised to that; no trial on the GPU. A step that fits is left as it is.

When: ``Trainer.train`` builds its train dataloader first, then counts its steps from the batch and the
accumulation, creates the optimizer and prepares everything, and only then calls ``on_train_begin``, too
late to change the batch. So the callback, from ``on_init_end``, wraps the trainer's
``get_train_dataloader``: the pre-flight runs as the dataloader is built (while a ``MemfitCallback`` is in
the trainer's callbacks; the first one runs it), and with ``auto_batch`` the dataloader is built again at
the new batch before anything reads it. Added later (``trainer.add_callback``), it runs at
``on_train_begin`` and can only refuse (with ``auto_batch``, a ``UsageError`` naming the batch that fits;
nothing is changed). The first batch is drawn with the random states kept, from a copy of the dataloader
whose workers end with it (persistent workers stay untouched). A step the tracer cannot follow (a
data-dependent shape, a custom CUDA kernel without a fake-tensor rule) is said in one line, and training
goes on unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from memfit.errors import UsageError, first_line

try:
    from transformers import Trainer, TrainerCallback
except ImportError:  # pragma: no cover - the extra is installed in the dev environment
    raise UsageError(
        "error: memfit.integrations.hf needs transformers and accelerate: pip install 'memfit-core[hf]'"
    ) from None

from memfit.estimate import trainers
from memfit.estimate.fit import MARGIN


def _calling_trainer() -> Trainer | None:
    """The Trainer whose method is calling the callback (its callback handler passes no trainer)."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        frame = frame.f_back
    return None


def _no_labels(trainer: Trainer, batch: Any, e: trainers.Untraceable) -> None:
    """One line, instead of step 1's traceback, when the step failed for want of labels: the Trainer's own
    loss (no ``compute_loss`` override, no ``compute_loss_func``) on a batch that holds none of its label
    names, a real step fails there too."""
    names = list(getattr(trainer, "label_names", None) or ["labels"])
    own_loss = type(trainer).compute_loss is Trainer.compute_loss and trainer.compute_loss_func is None
    if e.own and own_loss and isinstance(batch, Mapping) and not any(n in batch for n in names):
        raise UsageError(
            f"error: the train batches hold no labels (keys: {', '.join(map(str, batch))}; the model's loss "
            f"reads {', '.join(names) or 'labels'}), so the model returns no loss and step 1 would fail: add "
            "labels to the batch (e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False)), or override "
            "compute_loss"
        ) from None


def _optimizer(trainer: Trainer, model, say=print) -> Any:
    """The trainer's optimizer: the one passed or created, else what ``create_optimizer`` will make (its
    class and keyword arguments, on the trainable parameters; building one allocates no state)."""
    if trainer.optimizer is not None:
        return trainer.optimizer
    given = getattr(trainer, "optimizer_cls_and_kwargs", None)
    cls, kwargs = given if given is not None else trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
    try:
        return cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    except Exception as e:  # noqa: BLE001 - an optimizer that needs more than its class and keywords
        say(f"[memfit] pre-flight: {cls.__name__} not rebuilt ({first_line(e, 100)}); estimated with AdamW")
        return None


def _active(trainer: Trainer) -> MemfitCallback | None:
    """The trainer's MemfitCallback that runs the pre-flight: the first in its callbacks (a second one
    adds nothing; a removed one does nothing)."""
    return next((c for c in trainer.callback_handler.callbacks if isinstance(c, MemfitCallback)), None)


class MemfitCallback(TrainerCallback):
    """The memory pre-flight of a Hugging Face ``Trainer`` (see the module docstring).

    ``gpu_gib``: the GPU's memory (default: the visible GPU's); ``auto_batch``: shrink the per-device
    batch to one that fits, raising the gradient accumulation; ``device``: whose kernels to model, "cuda"
    or "cpu" (default: "cuda" when ``gpu_gib`` is given or the trainer is on a GPU); ``margin``: the
    fraction of the memory kept free, as ``memfit estimate --margin`` (default 0.1). Bad settings are one
    line (``UsageError``) here, not at ``train()``. After the check, ``check`` holds the estimate
    (``check.result``) and its figures."""

    def __init__(
        self,
        gpu_gib: float | None = None,
        auto_batch: bool = False,
        device: str | None = None,
        margin: float = MARGIN,
    ) -> None:
        trainers.check_settings(gpu_gib, auto_batch, device, margin)  # one line now, not at train()
        self.gpu_gib, self.auto_batch, self.device, self.margin = gpu_gib, auto_batch, device, margin
        self.check: trainers.Check | None = None
        self._ran = False  # the pre-flight ran as this train() built its dataloader

    def on_init_end(self, args, state, control, **kwargs):
        trainer = _calling_trainer()
        if trainer is not None and not getattr(trainer, "_memfit_wrapped", False):
            build = trainer.get_train_dataloader

            def get_train_dataloader(*a, **k):
                loader = build(*a, **k)
                callback = _active(trainer)
                if callback is None:  # removed with trainer.remove_callback: nothing to do
                    return loader
                changed = callback._run(trainer, loader, early=True)  # a refusal raises: a retry checks again
                callback._ran = True
                return build(*a, **k) if changed else loader

            trainer.get_train_dataloader = get_train_dataloader
            trainer._memfit_wrapped = True

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        ran, self._ran = self._ran, False
        trainer = _calling_trainer()
        if ran or trainer is None or _active(trainer) is not self:
            return
        # added after the trainer was built: only a refusal is possible now
        self._run(trainer, train_dataloader, early=False)

    def _run(self, trainer: Trainer, loader, early: bool) -> bool:
        """The pre-flight; True when it changed the batch (the dataloader must be built again). Every
        process runs it (each must refuse, or change its batch); the main one prints."""
        args, model = trainer.args, trainer.model
        say = print if trainer.is_world_process_zero() else (lambda *a, **k: None)
        device = self.device or ("cuda" if self.gpu_gib is not None or args.device.type == "cuda" else "cpu")
        batch = trainers.first_batch(
            getattr(loader, "base_dataloader", loader), "the Trainer's train dataloader"
        )
        amp = "bf16" if args.bf16 else ("fp16" if args.fp16 else None)

        def compute_loss(m, b):
            return trainer.compute_loss(m, b)

        compute_loss.__name__ = f"{type(trainer).__name__}.compute_loss"
        target = trainers.user_target(
            model,
            batch,
            compute_loss,
            _optimizer(trainer, model, say),
            amp,
            device,
            label=type(model).__name__,
            accumulate=args.gradient_accumulation_steps,
        )
        on = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5; before, gradient_
        on = getattr(model, "is_gradient_checkpointing", False) if on is None else on
        ckpt = "on" if on else "off"
        setup = f"{target.describe}, checkpointing {ckpt}"
        # DDP ranks each hold gradient buckets; FSDP and DeepSpeed shard, which this estimate does not model
        sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled
        ranks = 1 if sharded else max(1, args.world_size)
        try:
            c = trainers.check(target, self.gpu_gib, self.margin, ranks)
        except trainers.Untraceable as e:
            _no_labels(trainer, batch, e)
            say(f"[memfit] pre-flight skipped, training unchanged: {str(e).removeprefix('error: ')}")
            return False
        self.check = c
        say(c.line(setup))
        if c.fits:
            return False
        fits = trainers.fitting_batch(c, target)
        per_device = args.per_device_train_batch_size
        total = per_device * args.gradient_accumulation_steps
        b = trainers.accumulated_batch(c, target, total, fits) if self.auto_batch else 0
        if not b:
            raise trainers.does_not_fit(c, target, fits)
        if not early:
            raise UsageError(
                "error: auto_batch cannot change the batch at on_train_begin (the dataloader and step counts "
                f"are set): pass MemfitCallback in Trainer(callbacks=[...]); per-device batch {b} with "
                f"gradient_accumulation_steps {total // b} fits"
            )
        accumulation = args.gradient_accumulation_steps
        args.per_device_train_batch_size = b
        args.gradient_accumulation_steps = total // b
        trainer._train_batch_size = args.train_batch_size
        say(
            f"[memfit] auto_batch: per-device batch {per_device} -> {b}, gradient accumulation "
            f"{accumulation} -> {total // b} (global batch {total} per device unchanged; the largest batch "
            f"that divides it and fits at that accumulation, its gradients kept between micro-batches)"
        )
        return True
