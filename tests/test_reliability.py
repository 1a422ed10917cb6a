"""Nothing a user owns is overwritten or deleted, and a run that will not fit memory is refused first.

Every case runs against a temporary folder holding a file and another run that the command must not
touch; after it, every file outside the run folder is byte-identical.
"""

from __future__ import annotations

import io
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import memfit.estimate.preflight
import pytest
import torch

from tests.systems import ALIASES, TRAIN, evaluate, one_error_line, train

SYSTEM = "gpt2-window"  # the fastest to train; the run-folder rules live in core and are the same for all


def snapshot(root: Path, skip: Path | None = None) -> dict[str, bytes]:
    """Every file under root (outside `skip`) with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not (skip is not None and skip in p.parents)
    }


@pytest.fixture
def world(tmp_path):
    """tmp/victim.txt, tmp/runs/<system>/other/ (another run) and tmp/runs/<other system>/run/."""
    (tmp_path / "victim.txt").write_text("mine")
    assert train(SYSTEM, tmp_path / "runs", "--run_name", "other") == 0
    assert train("mbsnet-speech", tmp_path / "runs") == 0
    return tmp_path


@pytest.mark.parametrize("name", ["", ".", "..", "../../victim.txt", "/tmp/abs", "a/b", "x\\y", "-"])
def test_run_names_that_leave_the_runs_folder_are_one_line_and_touch_nothing(world, name, capsys):
    before = snapshot(world)
    capsys.readouterr()
    status = train(SYSTEM, world / "runs", "--run_name", name, "--overwrite")
    if name == "-":  # a plain (odd) name is fine: it stays inside runs/<system>/
        assert status == 0 and (world / "runs" / SYSTEM / "-").is_dir()
        assert snapshot(world, world / "runs" / SYSTEM / "-") == before
        return
    assert status == 2
    assert "--run_name must be one folder name" in one_error_line(capsys)
    assert snapshot(world) == before


def test_overwrite_moves_the_old_run_aside_and_deletes_nothing(world, capsys):
    run = world / "runs" / SYSTEM / "other"
    old = snapshot(run)
    before = snapshot(world, run)
    assert train(SYSTEM, world / "runs", "--run_name", "other", "--overwrite") == 0
    (aside,) = (world / "runs" / SYSTEM).glob("other.old-*")
    assert snapshot(aside) == old and "the previous run is now" in capsys.readouterr().err
    after = snapshot(world, run)
    assert {k: v for k, v in after.items() if ".old-" not in k} == before


def test_a_corrupt_newest_checkpoint_is_skipped_removed_and_never_kept_by_pruning(tmp_path, capsys):
    runs = tmp_path / "runs"
    run = runs / SYSTEM / "run"
    assert train(SYSTEM, runs, "--steps", "4", "--save_every", "2", "--keep_last", "3") == 0
    (run / "ckpt_0000004.pt").write_bytes((run / "ckpt_0000004.pt").read_bytes()[:1000])  # a torn save
    assert evaluate(SYSTEM, run / "ckpt_0000004.pt") == 2
    assert "truncated or damaged" in one_error_line(capsys)
    assert evaluate(SYSTEM, run) == 0  # a folder falls back to the newest intact checkpoint, as --resume does
    assert "skipped ckpt_0000004.pt" in capsys.readouterr().err
    assert train(SYSTEM, runs, "--resume", "--steps", "3", "--keep_last", "1") == 0
    assert "skipped ckpt_0000004.pt" in capsys.readouterr().err
    assert sorted(p.name for p in run.glob("ckpt_*.pt")) == ["ckpt_0000003.pt"]  # the corrupt one is gone
    assert train(SYSTEM, runs, "--resume", "--steps", "5") == 0  # and the next resume finds an intact one


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda s: s.pop("scaler"), "has no 'scaler' entry"),
        (lambda s: s.update(rng=torch.zeros(3)), "its 'rng' entry is not the RNG states"),
        (lambda s: s.update(model={"w": 1}), "its 'model' entry is not the model's weights"),
        (lambda s: s.update(step="7"), "its 'step' entry is not a step count"),
    ],
)
def test_checkpoints_with_missing_or_mistyped_entries_fall_back_in_one_line(tmp_path, capsys, damage, says):
    runs = tmp_path / "runs"
    run = runs / SYSTEM / "run"
    assert train(SYSTEM, runs, "--steps", "4", "--save_every", "2") == 0
    state = torch.load(run / "ckpt_0000004.pt", weights_only=True)
    damage(state)
    torch.save(state, run / "ckpt_0000004.pt")
    capsys.readouterr()
    assert train(SYSTEM, runs, "--resume", "--steps", "5") == 0
    err = capsys.readouterr().err
    assert says in err and "resumed from" in err and "ckpt_0000002.pt" in err and "Traceback" not in err
    for p in run.glob("ckpt_*.pt"):
        torch.save(state, p)  # every checkpoint broken alike: one line, nothing to fall back to
    assert train(SYSTEM, runs, "--resume", "--steps", "6") == 2
    assert says in one_error_line(capsys)


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/memfit-pwned",))


@pytest.mark.parametrize(
    "content, says",
    [
        (b"", "the file is empty"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt ", "not a PyTorch checkpoint"),
        (None, "holds objects other than tensors and plain data (refused"),
    ],
    ids=["empty", "a-wav", "pickled-code"],
)
def test_unreadable_checkpoints_are_one_line_never_advising_unsafe_loading(tmp_path, capsys, content, says):
    path = tmp_path / "x.pt"
    if content is None:
        buf = io.BytesIO()
        torch.save({"format": 1, "model": Payload()}, buf)
        content = buf.getvalue()
    path.write_bytes(content)
    assert evaluate(SYSTEM, path) == 2
    line = one_error_line(capsys)
    assert says in line and "weights_only=False" not in line and not Path("/tmp/memfit-pwned").exists()


def test_temp_files_of_a_killed_save_are_removed_at_the_next_start(tmp_path, capsys):
    runs = tmp_path / "runs"
    run = runs / SYSTEM / "run"
    assert train(SYSTEM, runs, "--steps", "2") == 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = run / f".ckpt_0000003.pt.tmp{dead.pid}"
    stale.write_bytes(b"half a checkpoint")
    assert train(SYSTEM, runs, "--resume", "--steps", "3") == 0
    assert not stale.exists() and "left by an interrupted save" in capsys.readouterr().err


def test_a_signal_repeated_within_a_second_still_saves(tmp_path):
    """uv forwards a terminal's Ctrl-C to the whole process group, so one press can arrive twice ~200 ms
    apart: the trainer finishes its step and saves, as for one signal."""
    script = tmp_path / "slow.py"
    script.write_text(
        textwrap.dedent(f"""
        import time, torch
        from memfit.train.loop import Trainer
        from memfit.train.settings import LoopConfig, TrainRun
        model = torch.nn.Linear(2, 1)
        def loss(m, b):
            print("step", flush=True)
            time.sleep(0.6)
            return m(b).pow(2).mean()
        cfg = LoopConfig(steps=100, amp="none", progress=False, device="cpu", save_every=0, preflight=False)
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, lambda s, m: torch.ones(4, 2),
                TrainRun.of(cfg), run_dir={str(tmp_path / "run")!r}).fit()
    """)
    )
    pipe = subprocess.PIPE
    proc = subprocess.Popen([sys.executable, str(script)], stdout=pipe, stderr=pipe, text=True)
    assert proc.stdout.readline() == "step\n"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # the duplicate
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "stopped by SIGINT at step 1 of 100; saved" in err
    assert (tmp_path / "run" / "ckpt_0000001.pt").exists()


@pytest.mark.parametrize("system", sorted(ALIASES))
def test_preflight_refuses_an_oversize_batch_naming_one_that_fits(system, tmp_path, monkeypatch, capsys):
    """With the device's memory set to a third of what the step needs, train refuses before writing
    anything, naming a batch; that batch then passes the same pre-flight and trains."""
    flags = TRAIN[system]
    batch = int(flags[flags.index("--batch_size") + 1]) * 8
    seen = {}

    def available(device):
        seen.setdefault("limit", seen["needed"] // 3)
        return seen["limit"], "a test's limit"

    real = memfit.estimate.preflight._needs

    def needs(make, b, ckpt, device):
        n = real(make, b, ckpt, device)
        seen.setdefault("needed", n)
        return n

    monkeypatch.setattr(memfit.estimate.preflight, "available_bytes", available)
    monkeypatch.setattr(memfit.estimate.preflight, "_needs", needs)
    runs = tmp_path / "runs"
    assert train(system, runs, "--batch_size", str(batch)) == 2
    line = one_error_line(capsys)
    assert f"at --batch_size {batch}" in line and "a test's limit" in line, line
    assert not (runs / system).exists()  # refused before the run folder was made
    fits = int(line.split("; --batch_size ")[1].split(" fits")[0])
    assert 1 <= fits < batch
    assert train(system, runs, "--batch_size", str(fits)) == 0
    assert "memory pre-flight: a training step needs" in capsys.readouterr().err


def test_an_oversize_batch_under_a_real_memory_limit_is_refused_fast(tmp_path):
    """mbsnet-train --batch_size 5000 in a process whose address space is capped at 6 GB (ulimit -v)."""
    limit = 6 * 10**9

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    argv = [console_path("mbsnet-train"), "--batch_size", "5000", "--steps", "2", "--no_progress",
            "--runs_dir", str(tmp_path), "--threads", "1"]  # fmt: skip
    t = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300, preexec_fn=cap)
    took = time.perf_counter() - t
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and "at --batch_size 5000" in lines[-1] and "ulimit -v" in lines[-1], lines
    assert " fits" in lines[-1] and took < 30  # ~9 s on a 2-core CPU


def console_path(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def test_real_out_of_memory_and_a_non_finite_loss_are_one_line_naming_the_intact_checkpoint(tmp_path):
    from memfit.errors import UsageError
    from memfit.train.loop import Trainer
    from memfit.train.settings import LoopConfig, TrainRun

    def run(fail_at, failure, name):
        model = torch.nn.Linear(2, 1)

        def loss(m, b):
            out = m(b).pow(2).mean()
            if t.step == fail_at:
                if isinstance(failure, BaseException):
                    raise failure
                return out * failure
            return out

        cfg = LoopConfig(steps=10, amp="none", progress=False, device="cpu", save_every=2, preflight=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        t = Trainer(
            model, opt, loss, lambda s, m: torch.ones(4, 2), TrainRun.of(cfg), run_dir=tmp_path / name
        )
        t.fit()

    oom = RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
    with pytest.raises(UsageError) as e:
        run(5, oom, "cpu-oom")
    msg = str(e.value)
    assert "out of memory in step 6" in msg and "ckpt_0000004.pt, is intact" in msg and "\n" not in msg
    with pytest.raises(UsageError, match="out of memory in step 4.*ckpt_0000002.pt"):
        run(3, torch.OutOfMemoryError("CUDA out of memory"), "cuda-oom")
    with pytest.raises(UsageError, match="the loss became nan in step 3.*ckpt_0000002.pt, is intact"):
        run(2, float("nan"), "nan")
    with pytest.raises(RuntimeError, match="a bug"):  # anything else is a bug to see, not a message
        run(1, RuntimeError("a bug"), "bug")


def test_threads_above_the_cpu_count_are_clamped_with_a_note(capsys):
    from memfit.train.cpu import cpu_count, set_threads

    before = torch.get_num_threads()
    try:
        assert set_threads(999) == cpu_count() and torch.get_num_threads() == cpu_count()
        assert f"this machine has {cpu_count()} CPUs" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_eval_outputs_never_replace_inputs_or_existing_files(world, capsys):
    run = world / "runs" / SYSTEM / "other"
    text = world / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    (world / "full").mkdir()
    (world / "full" / "mine.json").write_text("{}")
    before = snapshot(world, run)
    cases = [
        (["--data", str(text), "--out", str(text)], "outputs never replace inputs"),
        (["--out", str(world / "full")], "is not empty; pass --overwrite"),
        (["--out", str(world / "victim.txt" / "x")], "cannot create the output folder"),
    ]
    for extra, says in cases:
        assert evaluate(SYSTEM, run, *extra) == 2
        assert says in one_error_line(capsys)
    assert snapshot(world, run) == before
    assert evaluate(SYSTEM, run) == 0  # the run's own eval/ folder: a new eval replaces its results
    assert evaluate(SYSTEM, run) == 0
