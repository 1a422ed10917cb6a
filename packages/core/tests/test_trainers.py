"""The memory pre-flight in other people's training loops: ``memfit.preflight`` (a plain loop), the Hugging
Face ``Trainer`` callback and the Lightning callback.

Every fit case picks its GPU size G between the estimated card totals of batch b and b + 1 (estimated here,
for the same model, loss and optimizer), so the step at the configured batch does not fit and b is the
answer; the references are independent: ``memfit estimate FILE:func`` on a TrainStep written out by hand,
and a real CPU step (``measure_training_step``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys

import memfit
import pytest
import torch
from memfit import cli
from memfit.errors import UsageError
from memfit.estimate import trainers
from memfit.estimate.fit import MARGIN
from memfit.estimate.steps import measure_training_step
from memfit.estimate.tracker import GIB
from memfit.step import TrainStep
from torch._subclasses.fake_tensor import is_fake

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SEQ, VOCAB = 64, 1024
CONFIG = dict(
    vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
)


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))


def wide_gpt2() -> torch.nn.Module:
    """A GPT-2 whose gradients (4.5 MiB) outweigh a sample's activations: what accumulation keeps shows."""
    torch.manual_seed(0)
    config = {**CONFIG, "vocab_size": 8192, "n_embd": 128, "n_layer": 1}
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))


def accumulation_gpu(needs) -> float:
    """A memory (GiB, on the CPU) where batch 2 fits at accumulation 1 but not at 2 (its gradients kept),
    and batch 1 at accumulation 4 fits: a global batch of 4 must train at batch 1, accumulation 4."""
    assert needs(2, 1) < needs(2, 2) and needs(1, 4) < needs(2, 2) < needs(4, 1)
    return (max(needs(2, 1), needs(1, 4)) + needs(2, 2)) / 2 / (1 - MARGIN) / GIB


def lm_batch(b: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (b, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}


def gpu_between(totals: dict[int, int], largest: int) -> tuple[int, float]:
    """(b, G): the largest b <= `largest` that divides it and whose card total is below batch b + 1's,
    and a GPU size whose usable part lies between the two."""
    b = max(b for b in range(1, largest) if largest % b == 0 and totals[b] < totals[b + 1])
    return b, (totals[b] + totals[b + 1]) / 2 / (1 - MARGIN) / GIB


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------------
# memfit.preflight in a plain loop
# ----------------------------------------------------------------------------------------------------


def test_plain_loop_refuses_the_batch_that_does_not_fit_and_names_the_one_that_does():
    model, batch = gpt2(), lm_batch(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    totals = {
        n: memfit.preflight(model, lm_batch(n), None, opt, gpu_gib=1000).total_bytes for n in range(1, 6)
    }
    b, gib = gpu_between(totals, 4)
    weights, ids = state(model), batch["input_ids"].clone()
    with pytest.raises(memfit.DoesNotFit) as e:
        memfit.preflight(model, batch, None, opt, gpu_gib=gib)
    assert e.value.fits_batch == b and e.value.batch == 4
    msg = str(e.value)
    assert "\n" not in msg and f"batch {b} fits" in msg and "try first:" in msg and "largest:" in msg
    assert same(state(model), weights) and torch.equal(batch["input_ids"], ids) and not opt.state
    assert memfit.largest_batch(model, batch, None, opt, gpu_gib=gib) == b
    one = memfit.preflight(model, lm_batch(1), None, opt, gpu_gib=1000)
    two = memfit.preflight(model, lm_batch(1), None, opt, gpu_gib=1000, ranks=2)  # DDP: + gradient buckets
    assert two.fits.needed_bytes == one.fits.needed_bytes + one.by_category["params"]
    # the loop then trains at b: the step at b passes the same pre-flight
    assert memfit.preflight(model, lm_batch(b), None, opt, gpu_gib=gib).total_bytes == totals[b]
    # not even batch 1 fits: a smaller batch is never what to try first
    with pytest.raises(memfit.DoesNotFit, match="not even batch 1 fits") as e:
        memfit.preflight(model, batch, None, opt, gpu_gib=totals[1] / 2 / GIB)
    assert "try first: batch" not in str(e.value), e.value


def test_plain_preflight_on_the_cpu_equals_a_real_step_and_keeps_the_optimizer_settings():
    model, batch = gpt2(), lm_batch(4)

    def loss_fn(m, b):
        return m(**b).loss

    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: no optimizer memory
    est = memfit.preflight(model, batch, loss_fn, sgd, device="cpu", gpu_gib=64)
    ref = TrainStep(gpt2, lambda d: lm_batch(4), loss_fn, lambda p: torch.optim.SGD(p, lr=0.1), None)
    real = measure_training_step(ref)
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes
    assert est.by_category["optimizer"] == 0
    adam = memfit.preflight(model, batch, loss_fn, None, device="cpu", gpu_gib=64)
    params = sum(p.numel() * 4 for p in model.parameters())
    steps = sum(4 for _ in model.parameters())  # and a float32 step count per parameter
    assert adam.by_category["optimizer"] == 2 * params + steps  # AdamW's two moments


def test_plain_preflight_bad_settings_are_one_line():
    model, batch = gpt2(), lm_batch(2)
    for gib in (0, -1.5, float("nan")):
        with pytest.raises(UsageError, match="gpu_gib must be a positive number"):
            memfit.preflight(model, batch, gpu_gib=gib)
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    with pytest.raises(UsageError, match="meta device"):
        memfit.preflight(meta, batch, gpu_gib=8)
    with pytest.raises(UsageError, match="holds no tensor"):
        memfit.preflight(model, {"text": "hello"}, gpu_gib=8)

    class DataDependent(torch.nn.Module):  # control flow on the batch's values: the tracer cannot follow
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).sum() if x.sum() > 0 else self.lin(x).mean()

    with pytest.raises(UsageError, match="the training step failed") as e:
        memfit.preflight(DataDependent(), torch.randn(4, 8), lambda m, x: m(x), gpu_gib=8)
    assert "\n" not in str(e.value) and "fake-tensor" in str(e.value)
    # the model's own loss needs labels: said as that, not as a step the tracer cannot follow
    with pytest.raises(UsageError, match="and no loss: with no loss_fn the step takes the model's own") as e:
        memfit.preflight(model, {"input_ids": batch["input_ids"]}, gpu_gib=8)
    assert "add the labels, or give a loss_fn" in str(e.value) and "fake-tensor" not in str(e.value)
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="give gpu_gib"):
            memfit.preflight(model, batch)
    with pytest.raises(UsageError, match=r"a tensor on the meta device \(2x64:int64\)"):
        memfit.preflight(model, {k: v.to("meta") for k, v in batch.items()}, gpu_gib=8)
    with pytest.raises(memfit.Untraceable, match=r"the loss ran the model itself \(GPT2LMHeadModel\)") as e:
        memfit.preflight(model, batch, lambda m, b: model(**b).loss, gpu_gib=8)  # `model`, not `m`
    assert "\n" not in str(e.value) and memfit.Untraceable is trainers.Untraceable
    assert issubclass(memfit.Untraceable, UsageError)


def test_import_memfit_imports_no_trainer_library_and_a_missing_extra_is_one_line(monkeypatch):
    probe = (
        "import sys, memfit; memfit.preflight; "
        "print([m for m in ('transformers', 'lightning') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    for module, library, extra in (("hf", "transformers", "hf"), ("lightning", "lightning", "lightning")):
        monkeypatch.setitem(sys.modules, library, None)  # as if not installed
        monkeypatch.delitem(sys.modules, f"memfit.integrations.{module}", raising=False)
        with pytest.raises(UsageError, match=rf"pip install 'memfit-core\[{extra}\]'"):
            importlib.import_module(f"memfit.integrations.{module}")
        monkeypatch.undo()


# ----------------------------------------------------------------------------------------------------
# Hugging Face Trainer
# ----------------------------------------------------------------------------------------------------


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def hf_args(tmp_path, batch=4, accumulation=1, **kw):
    return transformers.TrainingArguments(
        str(tmp_path),
        data_seed=0,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **kw,
    )


def hf_totals(model, args, upto: int) -> dict[int, int]:
    """Card totals of the Trainer's step (the model's own loss, the optimizer args.optim makes)."""
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    opt = cls(model.parameters(), **kwargs)
    return {
        n: memfit.preflight(model, lm_batch(n), None, opt, gpu_gib=1000).total_bytes
        for n in range(1, upto + 1)
    }


def batches_seen(trainer) -> list[int]:
    seen = []
    step = trainer.training_step

    def spy(model, inputs, *a, **k):
        seen.append(inputs["input_ids"].shape[0])
        return step(model, inputs, *a, **k)

    trainer.training_step = spy
    return seen


def test_hf_trainer_stops_before_any_optimizer_step_and_names_the_batch(tmp_path):
    from memfit.integrations.hf import MemfitCallback

    model, args = gpt2(), hf_args(tmp_path)
    callback = MemfitCallback(1000)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    b, gib = gpu_between(hf_totals(model, args, 5), 4)  # the model as the Trainer set it up
    callback.gpu_gib = gib
    weights = state(model)
    seen = batches_seen(trainer)
    with pytest.raises(memfit.DoesNotFit, match=f"batch {b} fits") as e:
        trainer.train()
    assert e.value.fits_batch == b and seen == [] and same(state(model), weights)
    assert "\n" not in str(e.value)
    with pytest.raises(memfit.DoesNotFit, match=f"batch {b} fits"):  # a retry is checked again
        trainer.train()
    assert seen == [] and same(state(model), weights)


def test_hf_trainer_auto_batch_trains_at_the_batch_that_fits_with_the_global_batch_kept(tmp_path):
    from memfit.integrations.hf import MemfitCallback

    model, args = gpt2(), hf_args(tmp_path)
    callback = MemfitCallback(1000, auto_batch=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    b, gib = gpu_between(hf_totals(model, args, 5), 4)
    callback.gpu_gib = gib
    seen = batches_seen(trainer)
    trainer.train()
    assert args.per_device_train_batch_size == b and args.gradient_accumulation_steps == 4 // b
    assert seen == [b] * (2 * 4 // b) and trainer.state.global_step == 2  # 2 optimizer steps of 4 samples
    assert not callback.check.fits and callback.check.batch == 4


def test_hf_auto_batch_judges_the_batch_at_the_accumulation_it_sets(tmp_path, capsys):
    from memfit.integrations.hf import MemfitCallback

    model, args = wide_gpt2(), hf_args(tmp_path, batch=4)
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    opt = cls(model.parameters(), **kwargs)

    def needs(n, accumulate):
        target = trainers.user_target(model, lm_batch(n), None, opt, device="cpu", accumulate=accumulate)
        return trainers.check(target, 1000).needed

    callback = MemfitCallback(accumulation_gpu(needs), auto_batch=True, device="cpu")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    seen = batches_seen(trainer)
    trainer.train()
    # batch 2 fits at accumulation 1 only: with 2 micro-batches its gradients no longer fit
    assert args.per_device_train_batch_size == 1 and args.gradient_accumulation_steps == 4
    out = capsys.readouterr().out
    assert seen == [1] * 8 and "per-device batch 4 -> 1, gradient accumulation 1 -> 4" in out


STEP_FILE = """
import torch, transformers
from memfit.step import TrainStep

def step(batch: int = {batch}):
    config = transformers.GPT2Config(**{config}, use_cache=False)  # as the Trainer trains it
    return TrainStep(
        build_model=lambda: transformers.GPT2LMHeadModel(config),
        make_batch=lambda d: (lambda ids: {{"input_ids": ids, "labels": ids.clone()}})(
            torch.randint(0, {vocab}, (batch, {seq}), device=d)),
        loss=lambda m, b: m(**b).loss,
        optimizer=lambda p: torch.optim.{optimizer},
        amp_dtype={amp},
    )
"""


@pytest.mark.parametrize(
    "optim,amp,accumulation", [("adamw_torch_fused", None, 1), ("sgd", "bf16", 1), ("adamw_torch", None, 2)]
)
def test_hf_callback_prints_what_memfit_estimate_says_and_on_the_cpu_a_real_step(
    tmp_path, capsys, optim, amp, accumulation
):
    """The callback's figure is `memfit estimate` of the same step, gradient accumulation included
    (`--accumulate N`: the gradients are kept between micro-batches)."""
    from memfit.integrations.hf import MemfitCallback

    precision = {"bf16": True} if amp else {}
    args = hf_args(tmp_path / "run", accumulation=accumulation, optim=optim, **precision)
    model = gpt2()
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    hyper = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    path = tmp_path / "ref.py"
    path.write_text(
        STEP_FILE.format(
            batch=4, config=CONFIG, vocab=VOCAB, seq=SEQ, optimizer=f"{cls.__name__}(p, {hyper})",
            amp="torch.bfloat16" if amp else None,
        )
    )  # fmt: skip
    for device in ("cuda", "cpu"):
        callback = MemfitCallback(gpu_gib=1000, device=device)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
        trainer.train()
        line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[memfit] pre-flight")]
        assert len(line) == 1 and f"{cls.__name__}" in line[0] and f"autocast {amp or 'none'}" in line[0]
        assert (f"{accumulation} micro-batches per optimizer step" in line[0]) == (accumulation > 1)
        got = callback.check.result
        assert (got.by_category.get("grads", 0) > 0) == (accumulation > 1)  # kept between micro-batches
        flags = ["--device", device, "--json", "--accumulate", str(accumulation)]
        with pytest.raises(SystemExit) as done:
            cli.main(["estimate", f"{path}:step", *flags])
        assert done.value.code == 0
        ref = json.loads(capsys.readouterr().out)
        assert got.peak_gib == ref["peak_gib"] and got.trace.report.category_gib() == ref["by_category_gib"]
        if device == "cuda":
            assert got.total_bytes / GIB == ref["total_gib"]
        else:
            spec = importlib.util.spec_from_file_location("ref_step", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            real = measure_training_step(dataclasses.replace(mod.step(), accumulate=accumulation))
            assert abs(got.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes


def test_hf_callback_that_passes_leaves_the_run_as_it_was(tmp_path):
    """The first batch is drawn with the random state kept: the run trains on the same shuffled batches,
    to the same weights, as without the callback."""
    from memfit.integrations.hf import MemfitCallback

    runs = []
    for callbacks in ([], [MemfitCallback(gpu_gib=1000)]):
        model = gpt2()
        trainer = transformers.Trainer(
            model=model, args=hf_args(tmp_path), train_dataset=Tokens(), callbacks=callbacks
        )
        seen = []
        step = trainer.training_step

        def spy(m, inputs, *a, _step=step, _seen=seen, **k):
            _seen.append(inputs["input_ids"].clone())
            return _step(m, inputs, *a, **k)

        trainer.training_step = spy
        trainer.train()
        runs.append((seen, state(model)))
    (plain, w0), (checked, w1) = runs
    assert len(plain) == 2 and all(torch.equal(a, b) for a, b in zip(plain, checked)) and same(w0, w1)


def test_hf_one_pre_flight_per_trainer_and_none_once_the_callback_is_removed(tmp_path, capsys):
    from memfit.integrations.hf import MemfitCallback

    trainer = transformers.Trainer(
        model=gpt2(), args=hf_args(tmp_path), train_dataset=Tokens(),
        callbacks=[MemfitCallback(gpu_gib=1000), MemfitCallback(gpu_gib=1000)],
    )  # fmt: skip
    trainer.train()
    assert capsys.readouterr().out.count("[memfit] pre-flight") == 1  # two callbacks, one check
    trainer = transformers.Trainer(
        model=gpt2(), args=hf_args(tmp_path), train_dataset=Tokens(), callbacks=[MemfitCallback(gpu_gib=1e-3)]
    )
    trainer.remove_callback(MemfitCallback)
    seen = batches_seen(trainer)
    trainer.train()  # nothing could fit 1 MiB: only a removed pre-flight lets it train
    assert seen == [4, 4] and "[memfit]" not in capsys.readouterr().out


def test_hf_batches_without_labels_are_refused_in_one_line(tmp_path):
    from memfit.integrations.hf import MemfitCallback

    class NoLabels(Tokens):
        def __getitem__(self, i):
            return {"input_ids": super().__getitem__(i)["input_ids"]}

    trainer = transformers.Trainer(
        model=gpt2(), args=hf_args(tmp_path), train_dataset=NoLabels(), callbacks=[MemfitCallback(1000)]
    )
    seen = batches_seen(trainer)
    with pytest.raises(
        UsageError, match="hold no labels .*add labels to the batch .*or override compute_loss"
    ):
        trainer.train()
    assert seen == []


class MaskingCollator:
    """Masks 15% of the ids at random, in the dataloader's workers."""

    def __call__(self, items):
        ids = torch.stack([x["input_ids"] for x in items])
        masked = torch.where(torch.rand(ids.shape) < 0.15, 0, ids)
        return {"input_ids": masked, "labels": ids}


def test_hf_persistent_workers_draw_the_same_masks_with_the_callback(tmp_path):
    """The first batch comes from a copy of the loader whose workers end with it: the persistent workers
    the run trains with start as they would without the callback, their random state untouched."""
    from memfit.integrations.hf import MemfitCallback

    runs = []
    for callbacks in ([], [MemfitCallback(gpu_gib=1000)]):
        seen: list[torch.Tensor] = []

        class Seeing(transformers.Trainer):  # no cycle through the trainer: its workers end with it
            def training_step(self, model, inputs, *a, _seen=seen, **k):
                _seen.append(inputs["input_ids"].clone())
                return super().training_step(model, inputs, *a, **k)

        args = hf_args(tmp_path, dataloader_num_workers=2, dataloader_persistent_workers=True)
        Seeing(
            model=gpt2(),
            args=args,
            train_dataset=Tokens(),
            data_collator=MaskingCollator(),
            callbacks=callbacks,
        ).train()
        runs.append(seen)
    plain, checked = runs
    assert len(plain) == 2 and all(torch.equal(a, b) for a, b in zip(plain, checked))


class Nothing(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


class ValueBranch(torch.nn.Module):
    """A model whose forward branches on the batch's values: the tracer cannot follow it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(SEQ, 1)

    def forward(self, input_ids, labels):
        x = self.lin(input_ids.float())
        return {"loss": x.sum() if input_ids.sum() > 0 else x.mean()}


def bad_settings_are_refused_as_the_callback_is_made(callback) -> None:
    for margin in (1.5, -0.1):
        with pytest.raises(UsageError, match="margin is the fraction of the memory kept free"):
            callback(margin=margin)
    with pytest.raises(UsageError, match="device 'gpu'"):
        callback(device="gpu")
    with pytest.raises(UsageError, match="auto_batch is True or False"):
        callback(auto_batch="yes")


def test_hf_callback_bad_settings_are_one_line_and_leave_training_unchanged(tmp_path, capsys):
    from memfit.integrations.hf import MemfitCallback

    for gib in (0, -2):
        with pytest.raises(UsageError, match="gpu_gib must be a positive number"):
            MemfitCallback(gpu_gib=gib)
    bad_settings_are_refused_as_the_callback_is_made(MemfitCallback)
    args = hf_args(tmp_path)
    trainer = transformers.Trainer(
        model=gpt2(), args=args, train_dataset=Nothing(), callbacks=[MemfitCallback(8)]
    )
    with pytest.raises(UsageError, match="gave no batch"):
        trainer.train()

    class OneShot(torch.utils.data.IterableDataset):  # a stream that cannot start over
        def __init__(self):
            self.items = iter(Tokens()[i] for i in range(8))

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.items)

    stream = OneShot()
    trainer = transformers.Trainer(
        model=gpt2(), args=args, train_dataset=stream, callbacks=[MemfitCallback(8)]
    )
    with pytest.raises(UsageError, match="one-shot iterator"):
        trainer.train()
    assert len(list(stream.items)) == 8  # nothing taken from it
    callback = MemfitCallback(gpu_gib=1e-3, auto_batch=True)  # nothing could fit: only the skip saves it
    trainer = transformers.Trainer(
        model=ValueBranch(), args=args, train_dataset=Tokens(), callbacks=[callback]
    )
    seen = batches_seen(trainer)
    trainer.train()
    out = capsys.readouterr().out
    assert "[memfit] pre-flight skipped, training unchanged: the training step failed" in out
    assert seen == [4, 4] and args.per_device_train_batch_size == 4 and callback.check is None


# ----------------------------------------------------------------------------------------------------
# Lightning
# ----------------------------------------------------------------------------------------------------


def lightning_module(
    batch_size: int = 4, branchy: bool = False, net=gpt2, reads_trainer=False, skips_0=False
):
    pl = pytest.importorskip("lightning.pytorch")

    class TinyLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = batch_size
            self.net = net()
            self.seen: list[int] = []

        def training_step(self, batch, i):
            self.seen.append(batch.shape[0])
            loss = self.net(input_ids=batch, labels=batch).loss
            self.log("loss", loss)
            if branchy and batch.sum() < 0:  # a branch on the batch's values: the trace cannot follow it
                return loss * 2
            if skips_0 and i == 0:  # Lightning skips a step that returns None
                return None
            return loss / self.trainer.accumulate_grad_batches if reads_trainer else loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            data = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

    return pl, TinyLM()


def lightning_totals(module, upto: int) -> dict[int, int]:
    def loss(m, x):
        return m.net(input_ids=x, labels=x).loss

    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    batches = {n: torch.randint(0, VOCAB, (n, SEQ)) for n in range(1, upto + 1)}
    return {n: memfit.preflight(module, x, loss, opt, gpu_gib=1000).total_bytes for n, x in batches.items()}


def lightning_trainer(pl, callback, **kw):
    return pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback], **kw,
    )  # fmt: skip


def test_lightning_stops_before_any_optimizer_step_and_auto_batch_keeps_the_global_batch():
    from memfit.integrations.lightning import MemfitCallback

    pl, module = lightning_module()
    b, gib = gpu_between(lightning_totals(module, 5), 4)
    weights = state(module)
    with pytest.raises(memfit.DoesNotFit, match=f"batch {b} fits"):
        lightning_trainer(pl, MemfitCallback(gib)).fit(module)
    assert module.seen == [] and same(state(module), weights)
    trainer = lightning_trainer(pl, MemfitCallback(gib, auto_batch=True))
    trainer.fit(module)
    assert module.batch_size == b and trainer.accumulate_grad_batches == 4 // b
    assert module.seen == [b] * (2 * 4 // b) and trainer.global_step == 2


def test_lightning_callback_estimate_is_memfit_estimate_of_the_same_step(capsys):
    from memfit.integrations.lightning import MemfitCallback

    pl, module = lightning_module()
    callback = MemfitCallback(gpu_gib=1000)
    lightning_trainer(pl, callback).fit(module)
    assert "[memfit] pre-flight" in capsys.readouterr().out
    ref = lightning_totals(module, 4)[4]
    assert callback.check.result.total_bytes == ref


def test_lightning_traces_accumulate_grad_batches_and_auto_batch_judges_at_the_accumulation_it_sets(capsys):
    from memfit.estimate import finetune
    from memfit.integrations.lightning import MemfitCallback

    pl, module = lightning_module(net=wide_gpt2)
    callback = MemfitCallback(gpu_gib=1000, device="cpu")
    lightning_trainer(pl, callback, accumulate_grad_batches=2).fit(module)
    assert "2 micro-batches per optimizer step" in capsys.readouterr().out

    def loss(m, x):
        return m.net(input_ids=x, labels=x).loss

    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def needs(n, accumulate):  # `memfit estimate --accumulate N`'s own path
        target = trainers.user_target(module, torch.randint(0, VOCAB, (n, SEQ)), loss, opt, device="cpu")
        return trainers.check(finetune.apply(target, finetune.FineTune(accumulate=accumulate)), 1000).needed

    assert callback.check.needed == needs(4, 2) > needs(4, 1)
    gib = accumulation_gpu(needs)
    pl, module = lightning_module(net=wide_gpt2)
    trainer = lightning_trainer(pl, MemfitCallback(gib, auto_batch=True, device="cpu"))
    trainer.fit(module)
    assert module.batch_size == 1 and trainer.accumulate_grad_batches == 4 and module.seen == [1] * 8


def test_lightning_auto_batch_refuses_a_dataloader_that_ignores_the_batch_size_and_changes_nothing():
    from memfit.integrations.lightning import MemfitCallback

    pl, module = lightning_module()
    b, gib = gpu_between(lightning_totals(module, 5), 4)
    data = torch.randint(0, VOCAB, (32, SEQ))
    module.train_dataloader = lambda: torch.utils.data.DataLoader(data, batch_size=4)  # a literal 4
    trainer = lightning_trainer(pl, MemfitCallback(gib, auto_batch=True), accumulate_grad_batches=1)
    with pytest.raises(
        UsageError, match=f"set `batch_size` to {b}, but the train dataloader still makes batches of 4"
    ):
        trainer.fit(module)
    assert module.batch_size == 4 and trainer.accumulate_grad_batches == 1 and module.seen == []


def test_lightning_step_that_reads_the_trainer_is_traced_and_a_skipped_step_is_said_as_that(capsys):
    from memfit.integrations.lightning import MemfitCallback

    pl, module = lightning_module(reads_trainer=True)  # reads self.trainer, as many steps do
    callback = MemfitCallback(gpu_gib=1000)
    lightning_trainer(pl, callback, accumulate_grad_batches=2).fit(module)
    assert callback.check is not None and "pre-flight skipped" not in capsys.readouterr().out
    pl, module = lightning_module(skips_0=True)
    callback = MemfitCallback(gpu_gib=1000)
    lightning_trainer(pl, callback).fit(module)
    out = capsys.readouterr().out
    assert callback.check is None and "training_step returned None for batch 0" in out
    assert "fails as written" not in out


def test_lightning_true_half_precision_traces_the_batch_as_the_step_gets_it():
    """bf16-true: the fit loop converts the batch to bfloat16 before training_step; so does the trace."""
    pl = pytest.importorskip("lightning.pytorch")
    from memfit.integrations.lightning import MemfitCallback

    class Regress(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

        def training_step(self, batch, i):
            return (self.net(batch) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(32, 64), batch_size=8)

    module = Regress()
    callback = MemfitCallback(gpu_gib=1000, device="cpu")
    lightning_trainer(pl, callback, precision="bf16-true").fit(module)
    assert "batch 8x64:bfloat16" in callback.check.result.target.describe
    net = Regress().to(torch.bfloat16)  # what the trainer trained: bf16 weights, a bf16 batch
    ref = memfit.preflight(
        net, torch.randn(8, 64, dtype=torch.bfloat16), lambda m, x: m.training_step(x, 0),
        torch.optim.SGD(net.parameters(), lr=0.1), device="cpu", gpu_gib=1000,
    )  # fmt: skip
    assert callback.check.result.peak_bytes == ref.peak_bytes


def test_shrink_for_accumulation_keeps_the_global_batch():
    assert trainers.shrink_for_accumulation(12, 5) == 4
    assert trainers.shrink_for_accumulation(8, 3) == 2
    assert trainers.shrink_for_accumulation(7, 6) == 1
    assert trainers.shrink_for_accumulation(8, 0) == 0


def test_hf_callback_added_late_still_refuses_before_any_step_and_hooks_no_step(tmp_path):
    from memfit.integrations.hf import MemfitCallback

    model, args = gpt2(), hf_args(tmp_path)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    b, gib = gpu_between(hf_totals(model, args, 5), 4)
    trainer.add_callback(MemfitCallback(gib))  # after __init__: runs at on_train_begin
    seen, weights = batches_seen(trainer), state(model)
    with pytest.raises(memfit.DoesNotFit, match=f"batch {b} fits"):
        trainer.train()
    assert seen == [] and same(state(model), weights)
    trainer.callback_handler.pop_callback(MemfitCallback)
    trainer.add_callback(MemfitCallback(gib, auto_batch=True))
    with pytest.raises(UsageError, match=r"pass MemfitCallback in Trainer\(callbacks="):
        trainer.train()  # too late to change the batch: said, not done
    assert seen == [] and args.per_device_train_batch_size == 4
    base = transformers.TrainerCallback
    hooks = {
        n for n in dir(base) if n.startswith("on_") and getattr(MemfitCallback, n) is not getattr(base, n)
    }
    assert hooks == {"on_init_end", "on_train_begin"}  # nothing per step


def test_a_tensor_on_another_device_becomes_a_fake_cpu_tensor_of_its_shape():
    """A GPU-resident model's tensors (here meta ones: not on the CPU either) are copied by shape, onto the
    fake CPU device the estimator runs on; no real memory is read or made."""
    from memfit.estimate.tracker import fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    p = torch.nn.Parameter(torch.empty(3, 5, device="meta", dtype=torch.bfloat16))
    with fake_mode() as mode:
        f = trainers._tensor_like(p, mode)
    assert isinstance(f, torch.nn.Parameter) and isinstance(f.data, FakeTensor) and f.requires_grad
    assert f.shape == (3, 5) and f.dtype == torch.bfloat16 and f.data.fake_device == torch.device("cpu")


def test_lightning_bad_settings_are_one_line_and_leave_training_unchanged(capsys):
    from memfit.integrations.lightning import MemfitCallback

    bad_settings_are_refused_as_the_callback_is_made(MemfitCallback)
    pl, module = lightning_module()
    module.train_dataloader = lambda: torch.utils.data.DataLoader(torch.zeros(0, SEQ, dtype=torch.long))
    with pytest.raises(UsageError, match="gave no batch"):
        lightning_trainer(pl, MemfitCallback(8)).fit(module)
    pl, module = lightning_module()
    b, gib = gpu_between(lightning_totals(module, 5), 4)
    del module.batch_size  # auto_batch has nothing to set: said, and nothing changed
    module.train_dataloader = lambda: torch.utils.data.DataLoader(
        torch.randint(0, VOCAB, (32, SEQ)), batch_size=4
    )
    with pytest.raises(UsageError, match="batch_size` attribute"):
        lightning_trainer(pl, MemfitCallback(gib, auto_batch=True)).fit(module)
    assert module.seen == []
    pl, module = lightning_module(branchy=True)
    trainer = lightning_trainer(pl, MemfitCallback(gpu_gib=1e-3, auto_batch=True))
    trainer.fit(module)
    assert "[memfit] pre-flight skipped, training unchanged" in capsys.readouterr().out
    assert module.seen == [4, 4] and module.batch_size == 4 and trainer.accumulate_grad_batches == 1


def test_hf_callback_traces_the_trainers_activation_checkpointing(tmp_path, capsys):
    from memfit.integrations.hf import MemfitCallback

    peaks = {}
    for on in (False, True):
        callback = MemfitCallback(gpu_gib=1000)
        args = hf_args(tmp_path, activation_checkpointing=on)
        transformers.Trainer(model=gpt2(), args=args, train_dataset=Tokens(), callbacks=[callback]).train()
        assert f"checkpointing {'on' if on else 'off'}" in capsys.readouterr().out
        peaks[on] = callback.check.result.by_category["activations"]
    assert peaks[True] < peaks[False]


def test_plain_preflight_of_a_tuple_batch_scales_every_tensor_that_shares_the_batch_axis():
    import torch.nn.functional as F

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(16 * 16 * 16, 10),
        )

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    def batch(n):
        return torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,))

    model = net()
    est = memfit.preflight(model, batch(8), loss_fn, device="cpu", amp="bf16", gpu_gib=64)
    real = measure_training_step(TrainStep(net, lambda d: batch(8), loss_fn, amp_dtype=torch.bfloat16))
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes
    totals = {n: memfit.preflight(model, batch(n), loss_fn, gpu_gib=1000).total_bytes for n in (8, 64, 65)}
    assert totals[8] < totals[64] < totals[65]
    gib = (totals[64] + totals[65]) / 2 / (1 - MARGIN) / GIB  # the largest that fits lies in [64, 65)
    assert memfit.largest_batch(model, batch(8), loss_fn, gpu_gib=gib) == 64


def test_a_lora_models_optimizer_holds_state_for_the_adapters_only():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    est = memfit.preflight(model, lm_batch(2), None, opt, device="cpu", gpu_gib=64)
    lora = sum(p.numel() * p.element_size() for p in trainable)
    assert est.by_category["optimizer"] == 2 * lora + 4 * len(trainable)  # two moments and a step each
    real = measure_training_step(trainers.user_target(model, lm_batch(2), None, opt, device="cpu").step())
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes  # the fake copy, run for real


def test_tensors_kept_in_a_modules_lists_and_dicts_are_copied_fake_too():
    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.tables = {"cos": torch.randn(16, 8)}  # not buffers: plain attributes in a dict and a list
            self.history = [torch.zeros(8)]

        def forward(self, x):
            return self.lin(x) * self.tables["cos"][: x.shape[0]] + self.history[0]

    def loss(m, x):
        return m(x).sum()

    model = Cached()
    est = memfit.preflight(model, torch.randn(4, 8), loss, device="cpu", gpu_gib=8)
    real = measure_training_step(trainers.user_target(model, torch.randn(4, 8), loss, device="cpu").step())
    # the real copy makes them inside the measurement; the estimate, like `memfit estimate`, counts
    # parameters and buffers as the model's state, not plain tensor attributes
    attributes = (16 * 8 + 8) * 4
    assert est.peak_bytes == real.peak_bytes - attributes and not is_fake(model.tables["cos"])


def test_hf_callback_reads_the_optimizer_args_optim_makes(tmp_path, capsys):
    from memfit.integrations.hf import MemfitCallback

    state_bytes = {}
    for optim, name in (("sgd", "SGD"), ("adafactor", "Adafactor"), ("adamw_torch", "AdamW")):
        callback = MemfitCallback(gpu_gib=1000, device="cpu")
        args = hf_args(tmp_path / optim, optim=optim)
        transformers.Trainer(model=gpt2(), args=args, train_dataset=Tokens(), callbacks=[callback]).train()
        assert f", {name}," in capsys.readouterr().out
        state_bytes[optim] = callback.check.result.by_category["optimizer"]
    params = sum(p.numel() * 4 for p in gpt2().parameters())
    # SGD without momentum keeps nothing, Adafactor its factored second moments, AdamW two full moments
    assert (
        state_bytes["sgd"] == 0 < state_bytes["adafactor"] < params < 2 * params < state_bytes["adamw_torch"]
    )


def test_a_batch_of_another_dtype_than_the_weights_is_said_as_a_step_that_cannot_run():
    """An fp32 batch into bf16 weights fails in a real step ("expected m1 and m2 to have the same dtype"),
    but the fake matmul returns a result: the trace checks the dtypes itself, so the step is not estimated
    as if it ran. The same batch cast to bf16, or the fp32 model under autocast, traces."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).to(torch.bfloat16)
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="same dtype"):  # the real step
        model(x)

    def loss(m, b):
        return (m(b[0]).float() - b[1]).pow(2).mean()

    with pytest.raises(memfit.Untraceable, match="addmm of bfloat16 and float32 tensors") as e:
        memfit.preflight(model, (x, y), loss, device="cpu", gpu_gib=10)
    assert e.value.own and "the step fails as written" in str(e.value)
    assert memfit.preflight(model, (x.bfloat16(), y), loss, device="cpu", gpu_gib=10).peak_bytes > 0
    fp32 = torch.nn.Sequential(torch.nn.Linear(8, 4))
    assert memfit.preflight(fp32, (x, y), loss, device="cpu", gpu_gib=10, amp="bf16").peak_bytes > 0
