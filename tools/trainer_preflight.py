"""What the pre-flight callbacks cost and what they save, on the CPU (docs/will-it-fit.md's figures).

    OMP_NUM_THREADS=1 uv run python tools/trainer_preflight.py overhead
        GPT-2 124M (transformers' GPT2Config defaults) in Hugging Face's Trainer, per-device batch 8 x 1024
        tokens: seconds from train() to the first training step without and with MemfitCallback
        (gpu_gib=80, a CUDA estimate), and the callback's own line; then gpu_gib=12 (it does not fit):
        seconds to the refusal, and with auto_batch to the first step. The first step is not run.
    OMP_NUM_THREADS=1 uv run python tools/trainer_preflight.py side-by-side [--cap_gib 3]
        A small GPT-2 under an address-space limit (ulimit -v: the CPU's "out of memory" is a real
        allocation failure there), starting at per-device batch 64: Hugging Face's auto_find_batch_size
        (halve after each out-of-memory), Lightning's Tuner.scale_batch_size (grow until one) and
        MemfitCallback(auto_batch=True, device="cpu"): the batch each trains at, the trials (steps run on
        the device before training), and the seconds to the first real training step.

Each case runs in a fresh process; every figure printed comes from this run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = 64  # the per-device batch every method of the side-by-side starts from
SMALL = dict(vocab_size=8192, n_positions=256, n_embd=256, n_layer=4, n_head=4)


class FirstStep(Exception):
    """Raised by the spy on the first real training step: the time to it is what is measured."""


def _dataset(n: int, seq: int, vocab: int):
    import torch

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    return Tokens()


def _hf_trainer(config: dict, seq: int, batch: int, callbacks: list, **kw):
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    args = transformers.TrainingArguments(
        tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=4, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True, **kw,
    )  # fmt: skip
    data = _dataset(4096, seq, config.get("vocab_size", 50257))
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def _spy_first_step(trainer, sizes: list) -> None:
    """Record each training step's batch; a step that completes ends the run (FirstStep)."""
    step = trainer.training_step

    def spy(model, inputs, *a, **k):
        sizes.append(int(inputs["input_ids"].shape[0]))
        step(model, inputs, *a, **k)
        raise FirstStep

    trainer.training_step = spy


def overhead(mode: str) -> dict:
    """mode 0: no callback; 1: MemfitCallback(gpu_gib=80), which fits; 2: gpu_gib=12, which refuses;
    3: gpu_gib=12 with auto_batch."""
    import torch

    torch.set_num_threads(1)
    callbacks = []
    if mode != "0":
        from memfit.integrations.hf import MemfitCallback

        callbacks = [MemfitCallback(gpu_gib=80 if mode == "1" else 12, auto_batch=mode == "3")]
    trainer = _hf_trainer({}, 1024, 8, callbacks)
    reached = []

    def stop(model, inputs, *a, **k):  # the first step is where the measurement ends
        reached.append((time.perf_counter(), int(inputs["input_ids"].shape[0])))
        raise FirstStep

    trainer.training_step = stop
    t0 = time.perf_counter()
    out = {}
    try:
        trainer.train()
    except FirstStep:
        out = {"seconds": reached[0][0] - t0, "batch": reached[0][1]}
    except Exception as e:  # DoesNotFit: the time to the refusal
        out = {"seconds": time.perf_counter() - t0, "refused": str(e)}
    if callbacks:
        out["line"] = callbacks[0].check.line()
        out["estimate_s"] = callbacks[0].check.seconds
        out["accumulation"] = trainer.args.gradient_accumulation_steps
    return out


def side(method: str, cap_gib: float) -> dict:
    """One method of the side-by-side, in this (capped) process."""
    import torch

    torch.set_num_threads(1)
    used = int(Path("/proc/self/status").read_text().split("VmSize:")[1].split()[0]) * 1024
    limit = used + int(cap_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    seq = SMALL["n_positions"]
    sizes: list[int] = []
    t0 = time.perf_counter()
    if method == "lightning":
        return _lightning_side(seq, t0)
    callbacks = []
    if method == "memfit":
        from memfit.integrations.hf import MemfitCallback

        callbacks = [MemfitCallback(auto_batch=True, device="cpu")]
    trainer = _hf_trainer(SMALL, seq, START, callbacks, auto_find_batch_size=method == "hf")
    _spy_first_step(trainer, sizes)
    with contextlib.suppress(FirstStep):
        trainer.train()
    return {"sizes": sizes, "seconds": time.perf_counter() - t0, "batch": sizes[-1],
            "line": callbacks[0].check.line() if callbacks and callbacks[0].check else ""}  # fmt: skip


def _lightning_side(seq: int, t0: float) -> dict:
    import lightning.pytorch as pl
    import torch
    import transformers
    from lightning.pytorch.tuner import Tuner

    transformers.logging.set_verbosity_error()
    sizes: list[int] = []

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 2  # scale_batch_size grows from its init_val
            self.net = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL))

        def training_step(self, batch, i):
            sizes.append(int(batch.shape[0]))
            return self.net(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            data = torch.randint(0, SMALL["vocab_size"], (4096, seq))
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

    module = LM()
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    found = Tuner(trainer).scale_batch_size(module, mode="binsearch", init_val=2, max_trials=8)
    trials = len(sizes)
    tuned = time.perf_counter()
    original = LM.training_step

    def first(self, batch, i):
        original(self, batch, i)
        raise FirstStep

    LM.training_step = first
    with contextlib.suppress(FirstStep):
        trainer.fit(module)
    return {"sizes": sizes, "seconds": time.perf_counter() - t0, "batch": found, "trials": trials,
            "tuning_s": tuned - t0}  # fmt: skip


def _child(*args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "child", *args], env=env, capture_output=True, text=True)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": tail[:200]}
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["overhead", "side-by-side", "child"])
    p.add_argument("--cap_gib", type=float, default=3.0, help="side-by-side: address space above start-up")
    p.add_argument("--repeats", type=int, default=3, help="overhead: alternating runs of each; medians")
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.what == "child":
        kind, *more = a.rest
        out = overhead(more[0]) if kind == "overhead" else side(more[0], float(more[1]))
        print(json.dumps(out))
        return
    if a.what == "overhead":
        runs = [(_child("overhead", "0"), _child("overhead", "1")) for _ in range(a.repeats)]
        bad = [r["error"] for pair in runs for r in pair if "error" in r]
        if bad:
            raise SystemExit(f"error: a run failed: {bad[0]}")
        plain = {"seconds": statistics.median(p["seconds"] for p, _ in runs)}
        memfit = {**runs[-1][1], "seconds": statistics.median(m["seconds"] for _, m in runs)}
        memfit["estimate_s"] = statistics.median(m["estimate_s"] for _, m in runs)
        print(f"GPT-2 124M, Trainer, per-device batch 8 x 1024, 1 thread: train() to the first step "
              f"(median of {a.repeats} alternating runs)")  # fmt: skip
        print(f"  without the callback: {plain.get('seconds', 0):.1f} s {plain.get('error', '')}")
        print(
            f"  with MemfitCallback(gpu_gib=80): {memfit.get('seconds', 0):.1f} s {memfit.get('error', '')}"
        )
        print(f"  added: {memfit.get('seconds', 0) - plain.get('seconds', 0):.1f} s "
              f"(the estimate itself {memfit.get('estimate_s', 0):.1f} s)")  # fmt: skip
        print(f"  {memfit.get('line', '')}")
        refused, auto = _child("overhead", "2"), _child("overhead", "3")
        print(f"  MemfitCallback(gpu_gib=12): refused after {refused.get('seconds', 0):.1f} s: "
              f"{refused.get('refused', refused.get('error'))}")  # fmt: skip
        print(f"  MemfitCallback(gpu_gib=12, auto_batch=True): first step after "
              f"{auto.get('seconds', 0):.1f} s "
              f"at per-device batch {auto.get('batch')}, accumulation {auto.get('accumulation')} "
              f"{auto.get('error', '')}")  # fmt: skip
        return
    print(f"small GPT-2 {SMALL}, address space capped {a.cap_gib:g} GiB above start-up, 1 thread, "
          f"per-device batch {START} to start")  # fmt: skip
    for method in ("hf", "lightning", "memfit"):
        r = _child("side", method, str(a.cap_gib))
        print(f"{method}: {json.dumps(r)}")


if __name__ == "__main__":
    main()
