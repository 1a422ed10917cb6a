"""Runs are never lost: run-folder refusal, lock, signals, metrics on resume, fallback, disk errors."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from memfit.errors import UsageError, run_command
from memfit.train.checkpoint import list_checkpoints
from memfit.train.loop import Trainer, step_generator
from memfit.train.settings import LoopConfig, TrainRun
from torch import nn


def make_batch(step, micro):
    g = step_generator(0, step, micro)
    x = torch.randn(16, 4, generator=g)
    return x, x.sum(1, keepdim=True)


def loss_fn(model, batch):
    return (model(batch[0]) - batch[1]).pow(2).mean()


def trainer(run_dir, steps=6, width=4, system="toy", loss=loss_fn, **loop):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = dict(steps=steps, save_every=3, keep_last=3, log_every=1, amp="none", progress=False, device="cpu")
    cfg.update(loop)
    run = {k: cfg.pop(k) for k in ("resume", "overwrite") if k in cfg}
    return Trainer(
        model, opt, loss, make_batch, TrainRun.of(LoopConfig(**cfg), system=system, **run), run_dir=run_dir
    )


def metric_steps(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


def test_existing_run_needs_resume_or_overwrite(tmp_path):
    trainer(tmp_path, steps=6).fit()
    before = {p.name: p.read_bytes() for p in list_checkpoints(tmp_path)}
    with pytest.raises(UsageError) as e:
        trainer(tmp_path, steps=3)
    msg = str(e.value)
    assert "\n" not in msg and all(f in msg for f in ("--resume", "--run_name", "--overwrite"))
    assert {p.name: p.read_bytes() for p in list_checkpoints(tmp_path)} == before  # nothing touched
    assert not (tmp_path / ".lock").exists()
    t = trainer(tmp_path, steps=3, overwrite=True)
    assert t.step == 0 and not list_checkpoints(tmp_path) and not (tmp_path / "metrics.jsonl").exists()
    t.fit()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_0000003.pt"]
    assert metric_steps(tmp_path) == [1, 2, 3]


def test_a_folder_that_holds_a_run_is_refused_before_the_memory_preflight(tmp_path, monkeypatch):
    """The user is not kept waiting for an estimate only to be refused: the refusal comes first."""
    import memfit.train.loop as loop_module

    trainer(tmp_path, steps=1).fit()
    estimated = []
    monkeypatch.setattr(loop_module, "preflight", lambda *args, **kwargs: estimated.append(args))

    def again(**run):
        cfg = LoopConfig(steps=2, amp="none", progress=False, device="cpu", preflight=True)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn, make_batch,
                       TrainRun.of(cfg, system="toy", **run), run_dir=tmp_path,
                       memory_step=lambda batch, checkpointing: None, batch_size=16)  # fmt: skip

    with pytest.raises(UsageError, match="already holds a run"):
        again()
    assert estimated == []
    again(resume=True).folder.release()
    assert len(estimated) == 1  # a run that may go on is estimated


def test_lock_refuses_a_live_trainer_and_takes_over_a_stale_lock(tmp_path, capsys):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tmp_path.mkdir(exist_ok=True)
        (tmp_path / ".lock").write_text(str(live.pid))
        with pytest.raises(UsageError, match=f"in use by another trainer \\(pid {live.pid}\\)"):
            trainer(tmp_path)
    finally:
        live.kill()
        live.wait()
    (tmp_path / ".lock").write_text(str(live.pid))  # that process is gone now: a stale lock
    t = trainer(tmp_path)
    assert (tmp_path / ".lock").read_text() == str(os.getpid())
    assert "stale lock" in capsys.readouterr().err
    t.fit()
    assert not (tmp_path / ".lock").exists()


@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_a_checkpoint_and_exits_with_128_plus_signal(tmp_path, capsys, signum, status):
    def interrupting_loss(model, batch):
        if t.step == 4:  # mid-step 5: the step finishes, then the loop saves and stops
            os.kill(os.getpid(), signum)
        return loss_fn(model, batch)

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # SIG_IGN under nohup
    t = trainer(tmp_path, steps=10, loss=interrupting_loss)
    with pytest.raises(SystemExit) as e:
        t.fit()
    assert e.value.code == status
    assert list_checkpoints(tmp_path)[-1].name == "ckpt_0000005.pt"
    err = capsys.readouterr().err.strip().splitlines()
    assert "step 5 of 10" in err[-1] and "--resume" in err[-1]
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers found are restored
    resumed = trainer(tmp_path, steps=10, resume=True)
    assert resumed.step == 5
    resumed.fit()
    assert metric_steps(tmp_path) == list(range(1, 11))


def test_resume_drops_later_metrics_and_falls_back_to_an_intact_checkpoint(tmp_path, capsys):
    trainer(tmp_path, steps=8).fit()  # checkpoints 3, 6, 8
    (tmp_path / "ckpt_0000008.pt").write_bytes(b"truncated")
    t = trainer(tmp_path, steps=8, resume=True)
    assert t.step == 6
    err = capsys.readouterr().err
    assert "skipped ckpt_0000008.pt: not a PyTorch checkpoint" in err
    assert metric_steps(tmp_path) == [1, 2, 3, 4, 5, 6]  # rows of steps 7, 8 (and the peak row) dropped
    t.fit()
    assert metric_steps(tmp_path) == list(range(1, 9))  # no duplicates
    for p in list_checkpoints(tmp_path):
        p.write_bytes(b"")
    with pytest.raises(UsageError, match="no intact checkpoint"):
        trainer(tmp_path, steps=8, resume=True)


def test_resume_with_another_system_or_config_is_one_line(tmp_path):
    trainer(tmp_path, steps=3).fit()
    with pytest.raises(UsageError, match="is a toy checkpoint, not other"):
        trainer(tmp_path, steps=6, system="other", resume=True)
    with pytest.raises(UsageError) as e:
        trainer(tmp_path, steps=6, width=8, resume=True)
    assert "weights do not fit the model (size mismatch" in str(e.value) and "--config" in str(e.value)
    assert "\n" not in str(e.value)


def test_full_disk_leaves_no_temp_file_and_is_one_line(tmp_path, monkeypatch):
    def full(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    t = trainer(tmp_path, steps=3)
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(UsageError, match="no space left"):
        t.fit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no .tmp, lock released


def test_unwritable_run_folder_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="cannot create the run folder"):
        trainer(tmp_path / "file" / "run")
    with pytest.raises(UsageError, match="cannot create the run folder"):
        trainer("/proc/memfit-no/run")


def test_run_command_exit_status_and_one_line(capsys):
    assert run_command("x", lambda argv: {"loss": 1.0}) == 0  # a result, not an exit status

    def bad(argv):
        raise UsageError("error: --lr must be > 0, got 0")

    assert run_command("x-train", bad) == 2
    assert capsys.readouterr().err == "x-train: error: --lr must be > 0, got 0\n"

    def unwritable(argv):
        Path("/proc/memfit-nope/out.json").write_text("{}")

    assert run_command("x-eval", unwritable) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/proc/memfit-nope/out.json" in err
    assert run_command("x", lambda argv: (_ for _ in ()).throw(SystemExit(130))) == 130


def test_a_failed_command_removes_the_empty_output_folders_it_made(tmp_path, capsys):
    """output_dir (every eval's --out, make-data's OUT, the report) makes its folder before the work, so
    an unwritable place fails first; if the command then fails, the folders it made that are still empty
    go again. A folder that was there before, or that holds a file, stays; a command that succeeds keeps
    them all."""
    from memfit.train.outputs import output_dir

    def fails_after(out, write=False):
        def main(argv):
            output_dir(out)
            if write:
                (out / "partial.txt").write_text("kept")
            raise UsageError("error: --data x is a file, not a folder")

        return main

    new = tmp_path / "new" / "sub"
    assert run_command("x-eval", fails_after(new)) == 2
    assert not (tmp_path / "new").exists()
    there = tmp_path / "there"
    there.mkdir()
    assert run_command("x-eval", fails_after(there / "a" / "b")) == 2
    assert sorted(tmp_path.iterdir()) == [there] and not any(there.iterdir())
    assert run_command("x-eval", fails_after(new, write=True)) == 2
    assert (new / "partial.txt").read_text() == "kept"  # something was written: nothing removed

    def interrupted(argv):
        output_dir(tmp_path / "ctrl-c")
        raise KeyboardInterrupt

    assert run_command("x-eval", interrupted) == 130 and not (tmp_path / "ctrl-c").exists()
    assert run_command("x-eval", lambda argv: output_dir(tmp_path / "ok")) == 0
    assert (tmp_path / "ok").is_dir()
    capsys.readouterr()
