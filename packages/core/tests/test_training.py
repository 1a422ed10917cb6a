"""The loop toolkit: exact resume, atomic checkpoints, accumulation, AMP, DDP on CPU."""

import json
import math
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from memfit.train.checkpoint import (
    checkpoint_candidates,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from memfit.train.loop import Progress, Trainer, WarmupCosine, step_generator
from memfit.train.settings import LoopConfig, TrainRun
from torch import nn

TRUE_W = torch.linspace(-1, 1, 16)


def make_batch(step, micro, seed=0, batch=32, rank=0, world=1):
    g = step_generator(seed, step, micro)
    x = torch.randn(batch, 16, generator=g)
    y = x @ TRUE_W + 0.01 * torch.randn(batch, generator=g)
    lo = rank * batch // world
    return x[lo : lo + batch // world], y[lo : lo + batch // world]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.GELU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.body(x).squeeze(-1)


def loss_fn(model, batch):
    x, y = batch
    loss = (model(x).float() - y).pow(2).mean()
    return loss, {"mse": loss.item()}


def build(tmp_path, steps, resume=False, amp="none", grad_accum=1, save_every=3, ema=0.0, max_minutes=None):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = LoopConfig(
        steps=steps,
        amp=amp,
        grad_accum=grad_accum,
        save_every=save_every,
        keep_last=2,
        progress=False,
        log_every=1,
        device="cpu",
        ema=ema,
        max_minutes=max_minutes,
    )
    run = TrainRun.of(cfg, resume=resume)
    return Trainer(model, opt, loss_fn, make_batch, run, lr_schedule=WarmupCosine(2, total_steps=10),
                   config={"width": 32}, run_dir=tmp_path)  # fmt: skip


def test_resume_after_interruption_gives_identical_weights(tmp_path):
    full = build(tmp_path / "full", steps=10)
    full.fit()
    # The same run stopped at step 7 (as if killed after its step-6 checkpoint) then resumed.
    part = build(tmp_path / "part", steps=7, save_every=3)
    part.fit()
    for p in list_checkpoints(tmp_path / "part"):
        if p.name != "ckpt_0000006.pt":
            p.unlink()  # the kill came before the step-7 checkpoint was written
    resumed = build(tmp_path / "part", steps=10, resume=True)
    assert resumed.step == 6
    resumed.fit()
    for a, b in zip(full.raw_model.parameters(), resumed.raw_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    state = load_checkpoint(tmp_path / "part")
    assert state["step"] == 10 and state["config"] == {"width": 32} and state["format"] == 1
    # the learning-rate schedule continued too
    assert full.optimizer.param_groups[0]["lr"] == pytest.approx(resumed.optimizer.param_groups[0]["lr"])


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    t = build(tmp_path, steps=10, save_every=2)
    out = t.fit()
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["ckpt_0000008.pt", "ckpt_0000010.pt"]  # keep_last=2
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    assert out["peak_memory_mib"] > 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r for r in lines if "loss" in r]
    assert [r["step"] for r in losses] == list(range(1, 11))
    assert losses[-1]["loss"] < losses[0]["loss"]
    assert lines[-1]["peak_memory_mib"] == out["peak_memory_mib"]


def test_interrupted_save_leaves_previous_checkpoint_readable(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"x": torch.ones(3)})

    def broken_save(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, {"x": torch.zeros(3)})
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path).name == "ckpt_0000001.pt"
    torch.testing.assert_close(load_checkpoint(tmp_path)["x"], torch.ones(3))


def test_bad_checkpoint_and_missing_run_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path)
    (tmp_path / "ckpt_0000001.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="could not read checkpoint"):
        load_checkpoint(tmp_path)


def test_grad_accumulation_equals_bigger_batch(tmp_path):
    """Two micro-batches of 16 give the same step as one batch of 32 (no dropout: eval-free model)."""

    def run(accum, batch, sub):
        torch.manual_seed(0)
        model = nn.Linear(16, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def get(step, micro):
            x, y = make_batch(step, 0, batch=32)
            return x[micro * batch : (micro + 1) * batch], y[micro * batch : (micro + 1) * batch]

        cfg = LoopConfig(steps=3, grad_accum=accum, amp="none", progress=False, grad_clip=0, device="cpu")
        loss = lambda m, b: (m(b[0]).squeeze(-1) - b[1]).pow(2).mean()  # noqa: E731
        Trainer(model, opt, loss, get, TrainRun.of(cfg), run_dir=tmp_path / sub).fit()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    torch.testing.assert_close(run(2, 16, "a"), run(1, 32, "b"), atol=1e-6, rtol=0)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_modes_train(tmp_path, amp):
    """Autocast (and fp16's GradScaler) trains like fp32 on a small problem."""
    ref = build(tmp_path / "fp32", steps=10, amp="none").fit()
    out = build(tmp_path / amp, steps=10, amp=amp).fit()
    first = json.loads((tmp_path / amp / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert out["loss"] < 0.8 * first
    assert out["loss"] == pytest.approx(ref["loss"], rel=0.1)


def test_bad_loop_settings_are_clear():
    with pytest.raises(ValueError, match="amp must be"):
        LoopConfig(amp="fp8")
    with pytest.raises(ValueError, match="grad_accum"):
        LoopConfig(grad_accum=0)


DDP_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from memfit.train.distributed import dist_info
    from memfit.train.loop import Trainer
    from memfit.train.settings import LoopConfig, TrainRun
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    sys.path.insert(0, {testdir!r})
    from test_training import make_batch

    info = dist_info()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = LoopConfig(steps={steps}, amp="none", progress=False, grad_clip=0, device="cpu",
                     grad_accum={accum}, compile={compile})
    get = lambda s, m: make_batch(s, m, batch=32 // {accum}, rank=info.rank, world=info.world_size)
    loss = lambda m, b: (m(b[0]).squeeze(-1) - b[1]).pow(2).mean()
    t = Trainer(model, opt, loss, get, TrainRun.of(cfg), run_dir={run_dir!r})
    reduces = [0]

    def count(state, bucket):  # every gradient all-reduce DDP starts
        reduces[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    if t.ddp is not None:
        t.ddp.register_comm_hook(None, count)
    t.fit()
    # fit leaves the group it joined, with the DDP wrapper dropped first (an exit with both alive
    # can abort a rank)
    assert t.ddp is None and not torch.distributed.is_initialized()
    if info.rank == 0:
        params = [p.detach() for p in t.raw_model.parameters()]
        torch.save({{"params": params, "reduces": reduces[0]}}, {out!r})
    """
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ddp(tmp_path, nproc, steps=5, accum=1, compile=False):
    name = f"{nproc}-{accum}-{compile}"
    out = tmp_path / f"w{name}.pt"
    script = tmp_path / f"ddp{name}.py"
    script.write_text(
        DDP_SCRIPT.format(
            testdir=os.path.dirname(__file__),
            run_dir=str(tmp_path / f"r{name}"),
            out=str(out),
            steps=steps,
            accum=accum,
            compile=compile,
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        str(script),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out)


def test_ddp_two_processes_equal_one_process_with_double_batch(tmp_path):
    """torchrun, gloo, 2 ranks x 16 samples == 1 rank x 32 samples (DDP averages the gradients)."""
    two, one = _run_ddp(tmp_path, 2), _run_ddp(tmp_path, 1)
    assert two["reduces"] == 5  # one all-reduce per optimizer step (one bucket for this model)
    for a, b in zip(two["params"], one["params"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_compiled_ddp_accumulates_without_syncing_every_micro_batch(tmp_path):
    """--compile --grad_accum 2 under torchrun: torch.compile wraps the DDP model, and the micro-batches
    before the last still skip DDP's all-reduce (ddp.no_sync on the wrapped module): one per step."""
    out = _run_ddp(tmp_path, 2, steps=3, accum=2, compile=True)
    assert out["reduces"] == 3


def test_warmup_cosine_matches_nanogpt_get_lr():
    """The schedule nanoGPT's train.py computes (lr 1e-3, min 1e-4, warmup 100, decay over 2000 its)."""
    lr, min_lr, warmup, decay = 1e-3, 1e-4, 100, 2000

    def get_lr(it):
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / (decay - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

    f = WarmupCosine(warmup, min_ratio=min_lr / lr)
    for it in range(decay):
        assert lr * f(Progress(it, 0.0, decay, None)) == pytest.approx(get_lr(it), rel=1e-12, abs=1e-15)


class FakeClock:
    """memfit.train.loop.now for tests: `dt` seconds pass per reading (the Trainer reads it once per step
    boundary), and SIGINT arrives at reading number `interrupt_at` (0-based; None: never)."""

    def __init__(self, dt, interrupt_at=None):
        self.t, self.dt, self.calls, self.interrupt_at = 0.0, dt, 0, interrupt_at

    def __call__(self):
        if self.calls == self.interrupt_at:
            import signal

            os.kill(os.getpid(), signal.SIGINT)
        self.calls += 1
        self.t += self.dt
        return self.t


def test_max_minutes_is_the_runs_total_budget_and_resume_follows_the_same_lr(tmp_path, monkeypatch, capsys):
    """A 6-minute budget at a minute per step: 6 steps, stopped cleanly. The same run interrupted after
    step 2 and resumed with the same --max_minutes takes the same 6 steps with the same learning rates
    (the Trainer's clock is saved in the checkpoint), and a further resume has nothing left to train."""
    import memfit.train.loop

    def lrs(path):
        rows = map(json.loads, (path / "metrics.jsonl").read_text().splitlines())
        return [r["lr"] for r in rows if "lr" in r]

    monkeypatch.setattr(memfit.train.loop, "now", FakeClock(60.0))
    full = build(tmp_path / "full", steps=None, save_every=0, max_minutes=6)
    out = full.fit()
    assert out["stopped_early"] and full.step == 6
    err = capsys.readouterr().err
    assert "--max_minutes 6 spent" in err and "stopped at step 6;" in err and "larger --max_minutes" in err
    assert load_checkpoint(tmp_path / "full")["progress"]["seconds"] == pytest.approx(360.0)

    monkeypatch.setattr(memfit.train.loop, "now", FakeClock(60.0, interrupt_at=2))
    part = build(tmp_path / "part", steps=None, save_every=0, max_minutes=6)
    with pytest.raises(SystemExit) as e:
        part.fit()
    assert e.value.code == 130 and part.step == 2
    monkeypatch.setattr(memfit.train.loop, "now", FakeClock(60.0))
    resumed = build(tmp_path / "part", steps=None, save_every=0, max_minutes=6, resume=True)
    assert resumed.step == 2 and resumed.seconds == pytest.approx(120.0)
    assert resumed.fit()["stopped_early"] and resumed.step == 6
    assert lrs(tmp_path / "part") == pytest.approx(lrs(tmp_path / "full"), rel=1e-12)
    assert len(set(lrs(tmp_path / "full"))) == 6  # the rate moved every step: the test can tell them apart
    for a, b in zip(full.raw_model.parameters(), resumed.raw_model.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)

    capsys.readouterr()
    again = build(tmp_path / "part", steps=None, save_every=0, max_minutes=6, resume=True)
    again.fit()
    assert again.step == 6 and "nothing to train" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_minutes"):
        LoopConfig(max_minutes=0)
    with pytest.raises(ValueError, match="steps must be given"):
        LoopConfig(steps=None)


def test_learning_rate_follows_steps_or_the_time_budget_whichever_is_further():
    f = WarmupCosine(10, min_ratio=0.1)
    budget = Progress(0, 0.0, None, 120.0)
    assert f(budget) == pytest.approx(1 / 11) and f(Progress(9, 0.0, None, 120.0)) == pytest.approx(10 / 11)
    assert f(Progress(10, 0.0, None, 120.0)) == pytest.approx(1.0)
    assert f(Progress(500, 60.0, None, 120.0)) == pytest.approx(0.1 + 0.9 * 0.5)  # half the budget
    assert f(Progress(501, 120.0, None, 120.0)) == pytest.approx(0.1)
    assert f(Progress(60, 0.0, 110, None)) == pytest.approx(0.1 + 0.9 * 0.5)  # half the steps after warmup
    further = 0.1 + 0.9 * 0.5 * (1 + math.cos(0.75 * math.pi))  # 3/4 of the budget beats half the steps
    assert f(Progress(60, 90.0, 110, 120.0)) == pytest.approx(further)


def test_best_metric_writes_best_checkpoint_and_logs_best_step(tmp_path):
    """eval results 3, 5, 4, 1 (max): best.pt holds step 4's weights; metrics say best/score and best_step."""
    scores = iter([3.0, 5.0, 4.0, 1.0])
    weights = {}

    def eval_fn(model):
        weights[t.step] = model.body[0].weight.detach().clone()
        return {"score": next(scores)}

    t = build(tmp_path, steps=8, save_every=0)
    t.eval_fn, t.eval_every, t.best_metric = eval_fn, 2, "score"
    t.fit()
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["step"] == 4 and best["best"] == {"metric": "score", "value": 5.0, "step": 4}
    torch.testing.assert_close(best["model"]["body.0.weight"], weights[4])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/score" in r]
    assert [r["best/score"] for r in evals] == [3.0, 5.0, 5.0, 5.0]
    assert [r["best_step"] for r in evals] == [2, 4, 4, 4]
    assert checkpoint_candidates(tmp_path)[:2] == [tmp_path / "best.pt", tmp_path / "ckpt_0000008.pt"]
    assert checkpoint_candidates(tmp_path, "latest")[0].name == "ckpt_0000008.pt"


def test_ema_averages_the_weights_validates_on_them_and_resumes_exactly(tmp_path):
    """--ema 0.9: after the n-th step avg = d avg + (1 - d) w with d = min(0.9, n / (9 + n)) (the first
    step copies w). Validation sees the average, best.pt and checkpoints carry it, and a resumed run ends
    with the same average."""
    seen = {}

    def eval_fn(model):
        seen[t.step] = model.body[0].weight.detach().clone()
        return {"score": float(t.step)}

    t = build(tmp_path / "full", steps=6, save_every=3, ema=0.9)
    raw = t.raw_model.body[0].weight
    avg, hand = None, {}
    t.eval_fn, t.eval_every, t.best_metric = eval_fn, 3, "score"
    step = t._train_step

    def tracked():  # the average by hand, from the raw weights after every optimizer step
        nonlocal avg
        out = step()
        w = raw.detach().clone()
        n = t.step + 1
        d = min(0.9, n / (9 + n))
        avg = w if avg is None else d * avg + (1 - d) * w
        hand[t.step + 1] = avg
        return out

    t._train_step = tracked
    t.fit()
    for k in (3, 6):
        torch.testing.assert_close(seen[k], hand[k])
        assert not torch.allclose(seen[k], raw)  # the average, not the raw weights
    best = load_checkpoint(tmp_path / "full" / "best.pt")
    torch.testing.assert_close(best["ema_model"]["body.0.weight"], hand[6])
    torch.testing.assert_close(best["model"]["body.0.weight"], raw.detach())
    # stopped after its step-3 checkpoint, then resumed: the same average at step 6
    part = build(tmp_path / "part", steps=3, save_every=3, ema=0.9)
    part.fit()
    resumed = build(tmp_path / "part", steps=6, save_every=3, ema=0.9, resume=True)
    resumed.fit()
    torch.testing.assert_close(resumed.ema_model.module.body[0].weight, hand[6])
    with pytest.raises(ValueError, match="ema must be in"):
        LoopConfig(ema=1.0)


def test_best_mode_min_and_checkpoint_candidates_without_best(tmp_path):
    assert checkpoint_candidates(tmp_path) == []
    scores = iter([2.0, 1.0, 3.0])
    t = build(tmp_path, steps=6, save_every=0)
    t.eval_fn, t.eval_every, t.best_metric, t.best_mode = (lambda m: {"loss": next(scores)}), 2, "loss", "min"
    t.fit()
    assert load_checkpoint(tmp_path / "best.pt")["step"] == 4
    (tmp_path / "best.pt").unlink()
    assert checkpoint_candidates(tmp_path, "best")[0].name == "ckpt_0000006.pt"  # no best.pt: the newest
    with pytest.raises(ValueError, match="best_mode"):
        Trainer(nn.Linear(1, 1), None, None, None, TrainRun.of(LoopConfig(device="cpu")), best_mode="up")
