"""Nothing a user owns is overwritten or deleted, and a run that will not fit memory is refused first.

Every case runs against a temporary folder holding a file and another run that the command must not
touch; after it, every file outside the run folder is byte-identical.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import memfit.estimate.preflight
import pytest
import torch

from tests.systems import ALIASES, EVAL, TRAIN, console, evaluate, one_error_line, train

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


# ----------------------------------------------------------------------------------------------------
# The faults users meet: files they own, a full disk, SIGTERM, damaged run files, odd numbers, start-up.
# Each trial: no traceback, no file deleted, overwritten or left behind, no silent garbage output.
# ----------------------------------------------------------------------------------------------------

MBSNET = "mbsnet-speech"
TEMP_FILE = "*.tmp*"  # memfit.train.outputs' temporary files: .NAME.tmpPID


def memfit_cli(*argv: str) -> int:
    """The `memfit` console script's function, in-process (memfit.launch.memfit)."""
    from memfit.launch import memfit

    return memfit([str(a) for a in argv])


def files(root: Path) -> list[str]:
    """Every file under root, hidden ones included, relative."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Runs to copy: gpt2-window `run` (4 steps, checkpoints at 2 and 4) and mbsnet-speech `run` (tiny)."""
    root = tmp_path_factory.mktemp("trained")
    assert train(SYSTEM, root / "runs", "--steps", "4", "--save_every", "2", "--log_every", "1") == 0
    assert train(MBSNET, root / "runs", "--threads", "1") == 0
    return root / "runs"


@pytest.fixture
def runs(trained, tmp_path):
    """A fresh copy of the trained runs under tmp_path/runs."""
    shutil.copytree(trained, tmp_path / "runs")
    return tmp_path / "runs"


def wav(path: Path, seconds: float) -> Path:
    import numpy as np
    import soundfile as sf

    noise = np.random.default_rng(0).standard_normal(int(16000 * seconds)).astype("float32") * 0.1
    sf.write(str(path), noise, 16000)
    return path


# -- files a user owns --------------------------------------------------------------------------------


def test_plot_never_replaces_a_file_without_overwrite(runs, tmp_path, capsys):
    run = runs / SYSTEM / "run"
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"my holiday")
    assert memfit_cli("plot", run, "--out", photo) == 2
    assert "photo.png exists; pass --overwrite" in one_error_line(capsys)
    assert photo.read_bytes() == b"my holiday"
    assert memfit_cli("plot", run, "--out", photo, "--overwrite") == 0
    assert photo.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert memfit_cli("plot", run) == 0 and memfit_cli("plot", run) == 0  # the run's own curves.png
    assert not list(tmp_path.rglob(TEMP_FILE))


@pytest.mark.parametrize("target", ["ckpt_0000004.pt", "notes.txt"])
def test_plot_onto_a_checkpoint_or_a_text_file_is_one_line(runs, tmp_path, capsys, target):
    run = runs / SYSTEM / "run"
    (tmp_path / "notes.txt").write_text("mine")
    out = run / target if target.endswith(".pt") else tmp_path / target
    before = out.read_bytes()
    for extra in ([], ["--overwrite"]):
        assert memfit_cli("plot", run, "--out", out, *extra) == 2
        assert "plot writes a PNG; give a file name ending in .png" in one_error_line(capsys)
    assert out.read_bytes() == before


def test_the_report_never_writes_into_a_non_empty_folder_without_overwrite(tmp_path):
    from memfit.errors import UsageError
    from memfit_report.main import main as report

    (tmp_path / "notes.md").write_text("mine")
    with pytest.raises(UsageError, match="is not empty; pass --overwrite"):  # before minutes of estimates
        report(["--system", SYSTEM, "--no_bench", "--out", str(tmp_path)])
    assert files(tmp_path) == ["notes.md"]


def enhance_argv(src: Path, out: Path, run: Path) -> list[str]:
    return ["run", MBSNET, "enhance", str(src), "--out", str(out), "--run", str(run), "--threads", "1"]


def start_enhance(src: Path, out: Path, run: Path) -> tuple[subprocess.Popen, Path]:
    """`memfit run mbsnet-speech enhance` as a process, returned once its temporary output has data."""
    argv = [console_path("memfit"), *enhance_argv(src, out, run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        temps = list(out.glob(f".{src.stem}.wav.tmp*")) if out.is_dir() else []
        if temps and temps[0].stat().st_size > 64 * 1024:  # mid-write: blocks of samples are in it
            return proc, temps[0]
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"enhance never wrote its temporary file: {proc.communicate()}")


def test_sigterm_mid_enhance_leaves_no_file_and_a_later_run_removes_a_dead_ones(runs, tmp_path, capsys):
    run = runs / MBSNET / "run"
    src, out = wav(tmp_path / "long.wav", 120), tmp_path / "out"
    proc, temp = start_enhance(src, out, run)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1].endswith("stopped by SIGTERM") and "Traceback" not in err
    assert not out.exists()  # no partial long.wav, no temporary file, and the --out folder it made is gone
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = out / f".long.wav.tmp{dead.pid}"  # what a SIGKILL (nothing can clean up after it) leaves
    left.write_bytes(temp.read_bytes() if temp.exists() else b"RIFF half a wav")
    capsys.readouterr()
    assert memfit_cli(*enhance_argv(wav(tmp_path / "short.wav", 1), out, run)) == 0
    assert f"removed {left.name}, left by an interrupted write" in capsys.readouterr().err
    assert files(out) == ["short.wav"]


# -- a full disk ------------------------------------------------------------------------------------


@pytest.fixture(params=["full", "read-only"])
def small_disk(request, tmp_path):
    """A 1 MiB tmpfs, filled to the last page or mounted read-only (root only: mount). Yields (mount point,
    the files in it before a trial, which must be all the files after, what each trial's line says)."""
    if os.geteuid() != 0:
        pytest.skip("a full or read-only disk is a small tmpfs, and mounting one needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    full = request.param == "full"
    options = "size=1m" if full else "size=1m,ro"
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True,
                         text=True)  # fmt: skip
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        if full:
            fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
            try:
                for size in (1 << 16, 1 << 12, 1):
                    with contextlib.suppress(OSError):
                        while True:
                            os.write(fd, b"\0" * size)
            finally:
                os.close(fd)
        yield mnt, files(mnt), "no space left on the device" if full else "Read-only file system"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_or_read_only_disk_is_one_line_and_leaves_no_file(runs, tmp_path, small_disk, capsys):
    disk, before, says = small_disk
    gpt2, mbsnet = runs / SYSTEM / "run", runs / MBSNET / "run"
    src = wav(tmp_path / "speech.wav", 2)
    full = says.startswith("no space")  # then the line names the file that did not fit, else the folder
    trials = [
        (["plot", gpt2, "--out", disk / "curves.png"], "disk/curves.png"),
        (["export", gpt2, "--out", disk / "export"], "export (model.safetensors" if full else "disk/export"),
        (enhance_argv(src, disk / "enhanced", mbsnet), "enhanced/speech.wav" if full else "disk/enhanced"),
        (["eval", SYSTEM, "--run", gpt2, *EVAL[SYSTEM], "--out", disk / "eval"],
         "eval/eval_val.json" if full else "disk/eval"),
    ]  # fmt: skip
    for argv, name in trials:
        capsys.readouterr()
        assert memfit_cli(*argv) == 2, argv
        line = one_error_line(capsys)
        assert says in line and name in line and ".tmp" not in line, line
        assert files(disk) == before, argv  # no partial file, no temporary one


# -- damaged run files ------------------------------------------------------------------------------


def damage_metrics(run: Path) -> None:
    """A crash mid-write as the third line of run/metrics.jsonl: bytes that are not UTF-8, nor JSON."""
    lines = (run / "metrics.jsonl").read_bytes().split(b"\n")
    lines.insert(2, b'{"step": 2, "loss": \xff\xfe torn')
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines))


def test_a_damaged_metrics_line_is_skipped_naming_it_by_resume_plot_and_the_model_card(runs, capsys):
    run = runs / SYSTEM / "run"
    damage_metrics(run)
    assert memfit_cli("plot", run) == 0
    assert "metrics.jsonl: line 3 is not UTF-8 text" in capsys.readouterr().err
    assert train(SYSTEM, runs, "--resume", "--steps", "6", "--log_every", "1") == 0
    err = capsys.readouterr().err
    assert "line 3 is not UTF-8 text (a torn or damaged write?); dropped" in err and "Traceback" not in err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]  # whole again
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    damage_metrics(runs / MBSNET / "run")  # a run with a best step: its card quotes that step's figures
    assert memfit_cli("export", runs / MBSNET / "run", "--out", runs / "export") == 0
    assert "line 3 is not UTF-8 text" in capsys.readouterr().err
    assert "the run's best choice" in (runs / "export" / "README.md").read_text()


def test_resume_refuses_a_newer_checkpoint_format_and_deletes_nothing(runs, capsys):
    run = runs / SYSTEM / "run"
    newest = run / "ckpt_0000004.pt"
    state = torch.load(newest, weights_only=True)
    assert state["memfit_version"]  # the writer is recorded
    state.update(format=2, memfit_version="9.1.0")
    torch.save(state, newest)
    before = snapshot(run)
    assert train(SYSTEM, runs, "--resume", "--steps", "6") == 2
    line = one_error_line(capsys)
    assert f"{newest} is a checkpoint of format 2, written by memfit 9.1.0" in line, line
    assert "upgrade memfit" in line
    assert snapshot(run) == before  # the newer checkpoint and its metrics rows are all still there
    assert evaluate(SYSTEM, run) == 2  # eval refuses it too, rather than falling back to an older one
    assert "format 2, written by memfit 9.1.0" in one_error_line(capsys)


def test_a_truncated_or_newer_export_is_one_line(runs, capsys):
    out = runs / "export"
    assert memfit_cli("export", runs / SYSTEM / "run", "--out", out) == 0
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert evaluate(SYSTEM, out) == 2
    line = one_error_line(capsys)
    assert "model.safetensors is truncated or damaged" in line and "export the run again" in line, line
    doc = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**doc, "format": 2, "memfit_version": "9.1.0"}))
    assert evaluate(SYSTEM, out) == 2
    assert "model export of format 2, written by memfit 9.1.0" in one_error_line(capsys)


def test_weights_that_are_not_finite_are_refused_naming_the_parameter(runs, tmp_path, capsys):
    run = runs / MBSNET / "run"
    state = torch.load(run / "ckpt_0000001.pt", weights_only=True)
    name = next(k for k, v in state["model"].items() if v.is_floating_point() and v.dim() > 1)
    state["model"][name] = torch.full_like(state["model"][name], float("nan"))
    state.pop("ema_model", None)
    torch.save(state, tmp_path / "nan.pt")
    capsys.readouterr()
    assert evaluate(MBSNET, tmp_path / "nan.pt") == 2  # was exit 0: "0 evaluated, 2 failed"
    assert f"its weights are not finite ({name} holds NaN)" in one_error_line(capsys)
    out = tmp_path / "enhanced"
    assert memfit_cli(*enhance_argv(wav(tmp_path / "a.wav", 1), out, tmp_path / "nan.pt")) == 2
    assert f"{name} holds NaN" in one_error_line(capsys)  # was a constant -1.0 wav, exit 0
    assert files(out) == []


# -- numbers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "system, flags, says",
    [
        (MBSNET, ["--layers", "0"], "--layers must be >= 1, got 0"),
        (MBSNET, ["--layers", "-1"], "--layers must be >= 1, got -1"),
        (MBSNET, ["--channels", "0"], "--channels must be >= 1, got 0"),
        (MBSNET, ["--channels", "-1"], "--channels must be >= 1, got -1"),
        (SYSTEM, ["--seed", str(2**64)], "--seed must be in 0..2**63-1, got 1.84467e+19"),
        (SYSTEM, ["--seed", "-1"], "--seed must be in 0..2**63-1, got -1"),
        (SYSTEM, ["--lr", "nan"], "--lr must be > 0, got nan"),
        (
            SYSTEM,
            ["--steps", "3", "--num_iterations", "4"],
            "--steps both set loop.steps",
        ),
    ],
)
def test_bad_numbers_are_refused_at_parse_time_in_one_line(system, flags, says, tmp_path, capsys):
    assert train(system, tmp_path / "runs", *flags) == 2
    assert says in one_error_line(capsys)
    assert not (tmp_path / "runs").exists()  # refused before anything was made


def test_a_large_seed_trains(tmp_path):
    assert train(SYSTEM, tmp_path / "runs", "--seed", str(2**63 - 1)) == 0


def test_a_config_file_nested_200000_levels_deep_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    assert train(MBSNET, tmp_path / "runs", "--config", str(deep)) == 2
    assert "JSON nested too deeply" in one_error_line(capsys)


def test_generate_refuses_a_temperature_below_its_floor_and_samples_at_the_floor(runs, capsys):
    from gpt2_window.model import MIN_TEMPERATURE
    from gpt2_window.sample import main as generate

    run = runs / SYSTEM / "run"
    for bad in ("1e-45", "0", "nan", "inf"):
        assert memfit_cli("run", SYSTEM, "generate", "--run", run, "--temperature", bad) == 2
        end = "<= 1e4" if bad == "inf" else ">= 0.0001"
        assert f"--temperature must be {end}" in one_error_line(capsys)
    assert memfit_cli("run", SYSTEM, "generate", "--run", run, "--seed", str(2**70)) == 2
    assert "--seed must be in 0..2**63-1" in one_error_line(capsys)
    (text,) = generate(["--run", str(run), "--temperature", str(MIN_TEMPERATURE), "--max_new_tokens", "8"])
    assert len(text) > 1  # the prompt and 8 sampled characters: no NaN probabilities


def test_eval_refuses_run_and_run_name_together(runs, capsys):
    assert evaluate(SYSTEM, runs / SYSTEM / "run", "--run_name", "other") == 2
    assert "--run and --run_name both set run" in one_error_line(capsys)


# -- start-up ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum, status, says", [(signal.SIGINT, 130, "interrupted"),
                                                   (signal.SIGTERM, 143, "stopped by SIGTERM")])  # fmt: skip
def test_a_signal_during_the_start_up_imports_is_one_line(signum, status, says):
    """Ctrl-C (or SIGTERM) while the command still imports torch: its status, one line, no traceback.
    (`memfit --help` and the estimator's `--help` import no torch at all; `memfit doctor` does.)"""
    proc = subprocess.Popen([console_path("memfit"), "doctor"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if "libtorch" in maps.read_text():  # torch is being imported: start-up is under way
                break
        time.sleep(0.005)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (status, f"memfit: {says}\n"), (out, err)


def test_preflight_keeps_the_margin_on_a_shared_machine(monkeypatch):
    from memfit.errors import UsageError
    from memfit.estimate import fit, preflight
    from memfit.step import TrainStep
    from torch import nn

    """The pre-flight once passed a step needing 22.17 of 22.33 GiB available: now the margin refuses it,
    and the batch it names fits with the margin."""

    def make(batch, ckpt):
        return TrainStep(
            build_model=lambda: nn.Linear(256, 256),
            make_batch=lambda d: torch.randn(batch, 256, device=d),
            loss=lambda m, x: m(x).square().mean(),
            amp_dtype=None,
        )

    cpu = torch.device("cpu")
    needed = preflight._needs(make, 4096, False, cpu)
    monkeypatch.setattr(preflight, "available_bytes", lambda d: (int(needed * 22.33 / 22.17), "a test's RAM"))
    with pytest.raises(UsageError, match=r"--batch_size (\d+) fits") as info:
        preflight.preflight(make, 4096, False, cpu)
    named = int(str(info.value).split("--batch_size ")[2].split(" fits")[0])
    assert preflight._needs(make, named, False, cpu) <= fit.usable_bytes(needed * 22.33 / 22.17)
    monkeypatch.setattr(preflight, "available_bytes", lambda d: (int(needed / 0.89), "a test's RAM"))
    assert preflight.preflight(make, 4096, False, cpu).needed == needed


# -- every numeric flag, both ends --------------------------------------------------------------------

HOSTILE = ["0", "-1", "nan", "inf", "1e30", str(2**63 - 1)]
TRAIN_MODULES = {
    "ginr-cifar": "ginr_cifar.train",
    "gpt2-window": "gpt2_window.train",
    "mbsnet-speech": "mbsnet_speech.train",
    "moremouse-triplane": "moremouse_triplane.train",
}


def _numeric_flags(system):
    """(parser, flag, settings path, field owner class, field name, nargs) of every numeric train flag;
    an expanded flag (--loss mag=W) gives one row per field, spelt 'name='."""
    import dataclasses
    import importlib
    import typing

    p = importlib.import_module(TRAIN_MODULES[system]).build_parser()
    p._loop_flags()
    p._loop_added = True
    rows = []
    for dest, path in p.paths.items():
        flag = p.dest_flags[dest]
        *parents, name = path.split(".")
        owner = next(iter(p._preset_trees().values()))
        for part in parents:
            owner = getattr(owner, part)
        value = getattr(owner, name)
        if dest in p.expand:
            for f in dataclasses.fields(value):
                rows.append((p, flag, f"{path}.{f.name}", type(value), f.name, f"{f.name}="))
            continue
        hint = typing.get_type_hints(type(owner))[name]
        kinds = {h for h in typing.get_args(hint) or (hint,)} | {
            a for h in typing.get_args(hint) for a in typing.get_args(h)
        }
        if kinds & {int, float} and bool not in kinds:
            nargs = 2 if isinstance(value, tuple) or name == "snr" else 1
            rows.append((p, flag, path, type(owner), name, nargs))
    return rows


NUMERIC_FLAGS = [(s, row[1], row[2]) for s in TRAIN_MODULES for row in _numeric_flags(s)]


def test_every_numeric_setting_declares_a_range_with_both_ends():
    from memfit.train.config import rule_ends

    missing = []
    for system in TRAIN_MODULES:
        for _, flag, path, owner, name, _ in _numeric_flags(system):
            rule = getattr(owner, "RANGES", {}).get(name)
            if rule is None or not all(map(math.isfinite, rule_ends(rule))):
                missing.append(f"{system} {flag} ({path}): {rule}")
    assert not missing, missing


@pytest.mark.parametrize(
    "system, flag, path", NUMERIC_FLAGS, ids=[f"{s}{f}-{p}" for s, f, p in NUMERIC_FLAGS]
)
def test_every_numeric_flag_refuses_hostile_numbers_at_parse_time_in_one_line(
    system, flag, path, monkeypatch, tmp_path
):
    """0, -1, nan, inf, 1e30 and the largest int64 on every numeric train flag, parsed in-process: a
    one-line UsageError (exit 2), or a value inside the field's declared range (both ends finite)."""
    import memfit.train.cpu
    from memfit.errors import UsageError
    from memfit.train.config import rule_ends
    from memfit.train.settings import get_path

    monkeypatch.setattr(memfit.train.cpu, "set_threads", lambda n: n)  # --threads must not cap this process
    (row,) = [r for r in _numeric_flags(system) if r[1] == flag and r[2] == path]
    p, _, _, owner, name, nargs = row
    low, high = rule_ends(owner.RANGES[name])
    for value in HOSTILE:
        given = [f"{nargs}{value}"] if isinstance(nargs, str) else [value] * nargs
        steps = [] if flag in ("--steps", "--num_iterations") else ["--steps", "1"]
        try:
            run = p.parse([*TRAIN[system], *steps, "--runs_dir", str(tmp_path), flag, *given])
        except UsageError as e:
            text = str(e)
            assert text.startswith("error: ") and "\n" not in text, text
            assert "Traceback" not in text
            continue
        got = get_path(run.settings, path)
        for v in got if isinstance(got, tuple) else (got,):
            assert math.isfinite(v) and low <= v <= high, (flag, value, got)


@pytest.mark.parametrize(
    "system, flags, says",
    [
        (SYSTEM, ["--beta1", "1e30"], "--beta1 must be < 1, got 1e+30"),  # was torch's traceback
        (SYSTEM, ["--beta2", "1"], "--beta2 must be < 1, got 1"),
        (SYSTEM, ["--min_lr", "1e30"], "--min_lr must be <= 10, got 1e+30"),  # trained to nan, exit 0
        (SYSTEM, ["--lr", "0.001", "--min_lr", "0.01"], "--min_lr must be <= lr (0.001), got 0.01"),
        (MBSNET, ["--snr", "1e30", "1e30"], "--snr must be <= 100, got 1e+30"),  # OverflowError after ~40 s
        (MBSNET, ["--snr", "-1000", "0"], "--snr must be >= -100, got -1000"),
        (MBSNET, ["--loss", "mag=1e30"], "--loss mag must be <= 1e4, got 1e+30"),
        (MBSNET, ["--augment", "reverb=2"], "--augment reverb is a probability; give 0..1, got 2"),
        ("ginr-cifar", ["--jitter", "1e30"], "--jitter must be <= 32, got 1e+30"),  # was accepted silently
        ("moremouse-triplane", ["--lr", "11"], "--lr must be <= 10, got 11"),
        (SYSTEM, ["--ema", "1"], "--ema must be in [0, 1) (a decay per step"),
        (SYSTEM, ["--max_minutes", "1e30"], "--max_minutes must be <= 1e7, got 1e+30"),
    ],
)
def test_numbers_outside_either_end_or_a_relation_are_one_line_before_anything_is_made(
    system, flags, says, tmp_path, capsys
):
    assert train(system, tmp_path / "runs", *flags) == 2
    assert says in one_error_line(capsys)
    assert not (tmp_path / "runs").exists()


def test_a_warmup_longer_than_the_run_is_said_and_the_schedule_keeps_its_tenth(tmp_path, capsys):
    assert train(SYSTEM, tmp_path / "runs", "--warmup", "5") == 0
    assert "--warmup 5 is longer than the run (--steps 1): warming up over 0 steps" in capsys.readouterr().err


def test_numbers_at_the_ends_train_to_finite_numbers(tmp_path):
    """The ends themselves are computable: AdamW with beta1 0 and beta2 just below 1, min_lr = lr."""
    result = console("gpt2-train")([*TRAIN[SYSTEM], "--steps", "2", "--no_progress", "--runs_dir",
                                    str(tmp_path), "--beta1", "0", "--beta2", "0.999999", "--lr", "10",
                                    "--min_lr", "10", "--grad_clip", "1e6"])  # fmt: skip
    assert result in (0, None)
    log = (tmp_path / SYSTEM / "run" / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in log.splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses and all(math.isfinite(v) for v in losses)


# -- a hostile estimate target ------------------------------------------------------------------------

HOSTILE_TARGET = """
import os, signal, sys
from torch import nn

if os.environ.get("MEMFIT_TEST_EXIT_AT_IMPORT"):
    os._exit(5)


def fine():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def exits():
    os._exit(7)


def kills():
    os.kill(os.getpid(), signal.SIGKILL)


def calls_sys_exit():
    sys.exit(3)


class ExitsInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        os._exit(7)


def exits_in_forward():
    return ExitsInForward()
"""


@pytest.mark.parametrize(
    "func, says",
    [
        ("exits", "the target ended the process (exit 7) while building the model"),
        ("kills", "the target ended the process (killed by SIGKILL) while building the model"),
        ("calls_sys_exit", "the target ended the process (exit 3) while building the model"),
        ("exits_in_forward", "the target ended the process (exit 7) in the forward"),
        ("import", "the target ended the process (exit 5) while importing the target"),
    ],
)
def test_an_estimate_target_that_ends_the_process_is_one_line(func, says, tmp_path):
    """The real command (a fresh process, as a user runs it; a process that ran backward before, as
    pytest's, cannot fork a child that runs autograd, so there the target runs unguarded)."""
    target = tmp_path / "hostile.py"
    target.write_text(HOSTILE_TARGET)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if func == "import":
        env["MEMFIT_TEST_EXIT_AT_IMPORT"] = "1"
        func = "fine"
    argv = [console_path("memfit"), "estimate", f"{target}:{func}", "--input", "2x16"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("memfit estimate: error: ") and says in line


def test_the_estimate_child_hands_back_exactly_what_the_command_prints_in_process(
    tmp_path, capsys, monkeypatch
):
    """The normal path: the same output, status and errors from the command's child process as from
    the command run in this process."""
    target = tmp_path / "hostile.py"
    target.write_text(HOSTILE_TARGET)
    argv = ["estimate", f"{target}:fine", "--input", "2x16", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    forked = subprocess.run([console_path("memfit"), *argv], capture_output=True, text=True, env=env,
                            timeout=300)  # fmt: skip
    assert forked.returncode == 0, forked.stderr
    monkeypatch.delattr(os, "fork")  # as where there is no fork: the command runs in this process
    assert memfit_cli(*argv) == 0
    here = capsys.readouterr()
    assert json.loads(forked.stdout) == json.loads(here.out) and forked.stderr == here.err
    bad = subprocess.run([console_path("memfit"), "estimate", f"{target}:nothing", "--input", "2x16"],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [f"memfit estimate: error: {target} has no 'nothing'"]


# -- a user's speech data that cannot train -----------------------------------------------------------


def speech_folder(root: Path, names: list[str], seconds: float, kind: str = "speech") -> Path:
    """clean_trainset_wav/ and noisy_trainset_wav/ under root: `kind` speech (a chirp with a syllable
    rhythm), silent or constant clean files, each with its noisy copy."""
    import numpy as np
    import soundfile as sf

    rng = np.random.default_rng(0)
    n = int(16000 * seconds)
    t = np.arange(n) / 16000
    for sub in ("clean_trainset_wav", "noisy_trainset_wav"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(names):
        if kind == "silent":
            clean = np.zeros(n)
        elif kind == "constant":
            clean = np.full(n, 0.25)
        else:
            clean = 0.3 * np.sin(2 * np.pi * (150 + 20 * k) * t * (1 + t)) * (np.sin(2 * np.pi * 4 * t) > 0)
        noisy = clean + 0.05 * rng.standard_normal(n)
        sf.write(str(root / "clean_trainset_wav" / name), clean.astype("float32"), 16000)
        sf.write(str(root / "noisy_trainset_wav" / name), noisy.astype("float32"), 16000)
    return root


NAMES = [f"p{k:03d}_{i:03d}.wav" for k in range(2) for i in range(4)]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--noise", "NOISE"], "--noise is mixed into --clean speech; give --clean DIR too"),
        (["--builtin_noise", "0.5"], "--builtin_noise is the share of built-in noise beside --noise files"),
        (["--data", "DATA", "--no-remix", "--snr", "0", "10"], "--no_remix trains on --data's fixed pairs"),
        (["--augment", "reverb=0.5"], "--augment applies to --clean mixes"),
        (["--data_share", "0.5", "--data", "DATA"], "--data_share splits the mixes"),
    ],
)
def test_flags_that_only_mean_something_together_are_one_line(flags, says, tmp_path, capsys):
    data = speech_folder(tmp_path / "data", NAMES, 1.0)
    noise = tmp_path / "noise"
    noise.mkdir()
    wav(noise / "n.wav", 1.0)
    flags = [{"NOISE": str(noise), "DATA": str(data)}.get(f, f) for f in flags]
    assert train(MBSNET, tmp_path / "runs", *flags) == 2  # --noise alone once trained on generated pairs
    assert says in one_error_line(capsys)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "kind, seconds, extra, says",
    [
        ("speech", 0.1, [], "none of the 2 validation files can be scored"),
        ("speech", 0.1, ["--no-remix"], "signal too short"),
        ("silent", 1.0, [], "hold no speech: all 6 checked are silent or constant"),
        ("silent", 1.0, ["--no-remix"], "hold no speech"),
        ("constant", 1.0, [], "hold no speech"),
    ],
)
def test_speech_data_that_cannot_train_or_be_scored_is_refused_before_step_1(
    kind, seconds, extra, says, tmp_path, capsys
):
    """0.1 s pairs and silent pairs once trained to nan PESQ / STOI / SI-SDR, exit 0, no best.pt."""
    data = speech_folder(tmp_path / "data", NAMES, seconds, kind)
    assert train(MBSNET, tmp_path / "runs", "--data", str(data), "--val_files", "2", *extra) == 2
    line = one_error_line(capsys)
    assert says in line and "p0" in line  # the files are named
    assert not (tmp_path / "runs").exists()  # refused before the run folder is made


def test_silent_clean_speech_for_mixing_is_refused_naming_the_files(tmp_path, capsys):
    data = speech_folder(tmp_path / "data", NAMES, 1.0, "silent")
    assert train(MBSNET, tmp_path / "runs", "--clean", str(data / "clean_trainset_wav")) == 2
    line = one_error_line(capsys)
    assert "the files of --clean" in line and "hold no speech" in line and ".wav" in line


def test_user_speech_that_can_be_scored_trains_and_validates_to_numbers(tmp_path):
    data = speech_folder(tmp_path / "data", NAMES, 1.0)
    argv = [*TRAIN[MBSNET], "--steps", "1", "--no_progress", "--runs_dir", str(tmp_path / "runs")]
    result = console("mbsnet-train")([*argv, "--data", str(data), "--val_files", "2"])
    assert result in (0, None)
    rows = (tmp_path / "runs" / MBSNET / "run" / "metrics.jsonl").read_text().splitlines()
    scores = [json.loads(r) for r in rows if "eval/pesq" in r]
    assert scores and all(math.isfinite(s[f"eval/{k}"]) for s in scores for k in ("pesq", "stoi", "si_sdr"))
    assert (tmp_path / "runs" / MBSNET / "run" / "best.pt").is_file()


def test_a_validation_that_scores_nan_stops_the_run_in_one_line(tmp_path, capsys, monkeypatch):
    import mbsnet_speech.eval

    real = mbsnet_speech.eval.score_model
    nan = {"pesq": float("nan"), "stoi": float("nan"), "si_sdr": float("nan")}
    monkeypatch.setattr(
        mbsnet_speech.eval, "score_model", lambda m, items: nan if m is not None else real(m, items)
    )
    runs = tmp_path / "runs"
    assert (
        train(MBSNET, runs, "--steps", "4", "--save_every", "2", "--eval_every", "3", "--val_files", "1") == 2
    )
    line = one_error_line(capsys)
    assert "validation at step 3 scored nan (pesq, stoi, si_sdr, choice)" in line
    assert "ckpt_0000002.pt, is intact" in line
    run = runs / MBSNET / "run"
    assert not (run / ".lock").exists() and not (run / "best.pt").exists() and not list(run.glob(TEMP_FILE))


# -- FSDP units: said, and settable -------------------------------------------------------------------

BARE_LINEARS = """
from torch import nn


def Net():  # no repeated blocks with submodules: by default the whole model is one FSDP unit
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])
"""


def test_fsdp_units_are_said_and_named_by_a_regex_matching_two_real_gloo_ranks(tmp_path, capsys):
    import torch.distributed as dist
    from memfit.estimate.explain import measure_per_rank

    path = tmp_path / "bare.py"
    path.write_text(BARE_LINEARS)
    argv = [
        "estimate",
        f"{path}:Net",
        "--input",
        "4x32x512",
        "--target",
        "same",
        "--ranks",
        "2",
        "--shard",
        "fsdp",
    ]
    assert memfit_cli(*argv, "--json") == 0
    whole = json.loads(capsys.readouterr().out)["per_rank"]
    assert whole["fsdp_units"].startswith("the whole model is one unit")
    assert memfit_cli(*argv, "--json", "--fsdp_units", r"\d+") == 0
    each = json.loads(capsys.readouterr().out)["per_rank"]
    assert each["fsdp_units"].startswith(r"6 modules matching --fsdp_units '\d+'")
    assert each["peak_gib"] < whole["peak_gib"]
    assert memfit_cli(*argv, "--fsdp_units", r"\d+") == 0
    assert r"FSDP units assumed: 6 modules matching --fsdp_units '\d+'" in capsys.readouterr().out
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    real = measure_per_rank(f"{path}:Net", ["4x32x512"], "fsdp", ranks=2, loss_target="same", units=r"\d+")
    assert len(set(real)) == 1 and abs(each["peak_gib"] * 2**30 / real[0] - 1) <= 0.05, (each, real)


@pytest.mark.parametrize(
    "extra, says",
    [
        (
            ["--shard", "fsdp", "--ranks", "2", "--fsdp_units", "blocks"],
            r"--fsdp_units 'blocks' matches no module name (whole); give one that does, e.g. one of \d+",
        ),
        (
            ["--shard", "fsdp", "--ranks", "2", "--fsdp_units", "("],
            "--fsdp_units '(' is not a regular expression",
        ),
        (["--fsdp_units", r"\d+"], "--fsdp_units names FSDP's units; give it with --shard fsdp --ranks N"),
    ],
)
def test_fsdp_units_that_name_nothing_are_one_line(extra, says, tmp_path, capsys):
    path = tmp_path / "bare.py"
    path.write_text(BARE_LINEARS)
    assert memfit_cli("estimate", f"{path}:Net", "--input", "4x32x512", *extra) == 2
    assert says in one_error_line(capsys)


# -- DDP: a dead or mismatched rank in one line -------------------------------------------------------

DDP_TRAINER = """
import os, signal, sys, torch
from torch import nn
from memfit.errors import run_command
from memfit.train.distributed import dist_info
from memfit.train.loop import Trainer
from memfit.train.settings import LoopConfig, TrainRun

RUN_DIR, DIE_RANK, DIE_STEP, *WIDTHS = sys.argv[1:]


def main(argv):
    info = dist_info()
    width = int(WIDTHS[info.rank]) if WIDTHS else 8
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = LoopConfig(steps=20, amp="none", progress=False, grad_clip=0, device="cpu", save_every=2,
                     log_every=1, preflight=False)

    def batch(step, micro):
        if info.rank == int(DIE_RANK) and step == int(DIE_STEP):  # kill -9 of this rank, in step 6
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + info.rank))
        return x, x.sum(-1)

    loss = lambda m, b: (m(b[0]).squeeze(-1) - b[1]).pow(2).mean()
    Trainer(model, opt, loss, batch, TrainRun.of(cfg), run_dir=RUN_DIR).fit()


raise SystemExit(run_command("ddp-test", main))
"""


def torchrun_two(tmp_path, *args) -> tuple[int, dict[int, str]]:
    """Two gloo ranks on the CPU under torchrun: (its status, {rank: that rank's stderr})."""
    import socket

    script = tmp_path / "ddp_trainer.py"
    script.write_text(DDP_TRAINER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={port}", "--log-dir", str(logs), "--redirects", "3", str(script)]  # fmt: skip
    cmd += [str(a) for a in args]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    err = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    return res.returncode, err


@pytest.mark.parametrize("dies", [1, 0], ids=["rank-1-killed", "rank-0-killed"])
def test_a_ddp_rank_killed_mid_run_is_one_line_from_its_peer_naming_the_last_good_checkpoint(tmp_path, dies):
    run = tmp_path / "run"
    status, err = torchrun_two(tmp_path, run, dies, 5)
    survivor = 1 - dies
    assert status != 0 and err[dies] == ""
    (line,) = err[survivor].splitlines()  # was a 30-line gloo "Connection reset by peer" traceback
    assert line.startswith(f"ddp-test: error: rank {survivor} of 2 lost its peers in step 6 (")
    assert f"the last checkpoint, {run / 'ckpt_0000004.pt'}, is intact (--resume)" in line
    assert sorted(p.name for p in run.iterdir()) == ["ckpt_0000002.pt", "ckpt_0000004.pt", "metrics.jsonl"]
    assert torch.load(run / "ckpt_0000004.pt", weights_only=True)["step"] == 4  # no lock, no temp file left


def test_ddp_ranks_started_with_other_settings_are_refused_in_one_line_before_anything_is_made(tmp_path):
    run = tmp_path / "run"
    status, err = torchrun_two(tmp_path, run, -1, -1, 8, 12)  # rank 1 builds a wider model
    assert status != 0 and err[1] == ""
    assert err[0].splitlines() == [  # was a 20-line "DDP expects same model across all ranks" traceback each
        "ddp-test: error: rank 1 was started with other settings than rank 0 (parameter.0.weight "
        "'8x16 torch.float32' -> '12x16 torch.float32'); start every rank with the same flags and files"
    ]
    assert not run.exists()


def test_a_ddp_rendezvous_that_fails_is_one_line(tmp_path, monkeypatch, capsys):
    import socket

    with socket.socket() as taken:  # the master's port is taken: rank 0 cannot open the rendezvous
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        for k, v in {**env, "MASTER_PORT": str(taken.getsockname()[1])}.items():
            monkeypatch.setenv(k, v)
        assert train(SYSTEM, tmp_path / "runs", "--device", "cpu") == 2
    line = one_error_line(capsys)
    assert "error: rank 0 of 2 could not join the other ranks (" in line and "address already in use" in line
    assert not list((tmp_path / "runs").rglob(".lock"))


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--snr", "1e30", "1e30"], "--snr must be <= 100, got 1e+30"),  # the mixer overflowed at 1e30 dB
        (["--seconds", "1e30"], "--seconds must be <= 3600, got 1e+30"),  # was "Maximum allowed dimension"
        (["--mixes", str(2**63 - 1)], "--mixes must be <= 2**20"),
    ],
)
def test_eval_numbers_have_both_ends_too(flags, says, tmp_path, capsys):
    assert evaluate(MBSNET, "shipped", *flags, "--out", str(tmp_path / "ev")) == 2
    assert says in one_error_line(capsys)
    assert not (tmp_path / "ev").exists()


def test_some_silent_clean_files_are_named_and_the_run_trains_on_the_rest(tmp_path, capsys):
    data = speech_folder(tmp_path / "data", NAMES, 1.0)
    speech_folder(tmp_path / "quiet", ["p002_000.wav", "p002_001.wav"], 1.0, "silent")
    clean = data / "clean_trainset_wav"
    for p in (tmp_path / "quiet" / "clean_trainset_wav").iterdir():
        p.rename(clean / p.name)
    assert train(MBSNET, tmp_path / "runs", "--clean", str(clean), "--val_files", "2") == 0
    err = capsys.readouterr().err
    assert "--clean files hold no speech (silent or constant): " in err and "p002_00" in err


@pytest.mark.parametrize(
    "extra, says",
    [
        (
            ["--gpu_gib", "1e6", "--max_batch", str(2**63 - 1)],
            "--max_batch at most 2147483647",
        ),  # overflowed
        (["--gpu_gib", "1e30"], "--gpu_gib must be a positive number of GiB up to 1048576"),
        (["--ranks", str(2**63 - 1)], "--ranks is at most 1048576"),
    ],
)
def test_estimate_counts_have_both_ends(extra, says, tmp_path, capsys):
    target = tmp_path / "hostile.py"
    target.write_text(HOSTILE_TARGET)
    assert memfit_cli("estimate", f"{target}:fine", "--input", "2x16", *extra) == 2
    assert says in one_error_line(capsys)


EVAL_NUMBERS = [
    ("gpt2-eval", ["--batch_size", "--sequence_length", "--eval_iters"]),
    ("gpt2-generate", ["--max_new_tokens", "--num_samples", "--temperature", "--top_k", "--seed"]),
    ("ginr-eval", ["--resolution", "--holdout", "--num_images", "--batch_size", "--grid"]),
    ("mbsnet-eval", ["--mixes", "--snr", "--pairs", "--seconds", "--limit", "--keep_noisy", "--shifts"]),
    ("mouse-eval", ["--num_scenes", "--seed"]),
]


@pytest.mark.parametrize("command, flag", [(c, f) for c, flags in EVAL_NUMBERS for f in flags])
def test_every_numeric_eval_flag_refuses_hostile_numbers_naming_itself(command, flag, tmp_path, capsys):
    """-1, nan, inf, 1e30 and the largest int64 (a seed takes it) on the eval and generate commands: one
    line naming the flag, before any run is looked for (mbsnet-speech's shipped model: its inference
    flags are checked against the model)."""
    if command == "gpt2-generate":
        from gpt2_window.sample import main as generate

        def cli(argv):
            from memfit.errors import run_command

            return run_command("generate", generate, argv)
    else:
        cli = console(command)
    run = "shipped" if command == "mbsnet-eval" else str(tmp_path / "no-such-run")
    for value in ["-1", "nan", "inf", "1e30", str(2**63 - 1)]:
        if (flag, value) in (("--seed", str(2**63 - 1)), ("--snr", "-1")):
            continue  # torch.manual_seed's whole range; -1 dB is an SNR
        given = [value, value] if flag == "--snr" else [value]
        status = cli(["--run", run, flag, *given, "--out" if command != "gpt2-generate" else "--runs_dir",
                      str(tmp_path / "out")])  # fmt: skip
        line = one_error_line(capsys)
        assert status == 2 and flag.lstrip("-") in line, (value, line)
    assert not (tmp_path / "out").exists()


def test_two_gpt2_ranks_started_with_other_presets_are_one_line(tmp_path):
    """The trial as a user ran it: two ranks of `gpt2-train` by hand, rank 1 with another --model."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, model in enumerate(["nano", "tiny"]):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}  # fmt: skip
        argv = [console_path("gpt2-train"), *TRAIN[SYSTEM], "--model", model, "--steps", "2", "--no_progress",
                "--device", "cpu", "--runs_dir", str(tmp_path / "runs")]  # fmt: skip
        procs.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    out = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [2, 2] and out[1][1] == ""
    assert out[0][1].splitlines() == [
        "gpt2-train: error: rank 1 was started with other settings than rank 0 (settings.model.block_size "
        "32 -> 64); start every rank with the same flags and files"
    ]
    assert not (tmp_path / "runs").exists()


def test_every_numeric_field_of_every_settings_tree_declares_both_ends():
    """Not only the flags: a --config FILE or a checkpoint sets every field, each checked at its range."""
    import dataclasses
    import importlib
    import typing

    from memfit.train.config import rule_ends

    missing = set()
    for system, module in TRAIN_MODULES.items():
        p = importlib.import_module(module).build_parser()
        todo = list(p._preset_trees().values())
        while todo:
            node = todo.pop()
            hints = typing.get_type_hints(type(node))
            for f in dataclasses.fields(node):
                value = getattr(node, f.name)
                if dataclasses.is_dataclass(value):
                    todo.append(value)
                    continue
                kinds = set(typing.get_args(hints[f.name]) or (hints[f.name],))
                kinds |= {a for h in list(kinds) for a in typing.get_args(h)}
                if not kinds & {int, float} or bool in kinds:
                    continue
                rule = getattr(type(node), "RANGES", {}).get(f.name)
                if rule is None or not all(map(math.isfinite, rule_ends(rule))):
                    missing.add(f"{system}: {type(node).__name__}.{f.name} ({rule})")
    assert not missing, sorted(missing)


@pytest.mark.parametrize("system", sorted(ALIASES))
def test_eval_of_a_folder_with_no_run_says_error_once(system, tmp_path, capsys):
    """A missing run is already one `error:` line (memfit.errors.ModelFileMissing): eval passes it on as
    it is, where three systems' evals wrapped it in a second `error:`."""
    (tmp_path / "empty").mkdir()
    assert evaluate(system, tmp_path / "empty") == 2
    line = one_error_line(capsys)
    assert line.count("error:") == 1 and "no checkpoint in" in line, line


def test_a_ginr_holdout_larger_than_the_folder_names_both_numbers(tmp_path, capsys):
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (32, 32), (40, 80, 120)).save(tmp_path / "imgs" / "a.png")
    assert train("ginr-cifar", tmp_path / "runs", "--data", str(tmp_path / "imgs")) == 2
    line = one_error_line(capsys)
    assert "--holdout " in line and "the set has 1" in line and "below 1" in line, line
