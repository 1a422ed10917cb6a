"""The four systems' commands keep one contract, for every system:

aliases exit 0 after success; bad numbers, an existing run without --resume, an unwritable or missing
output location and another system's checkpoint are one line on stderr and exit status 2.
Each system trains one tiny step once (module fixture, through its console alias) for the eval checks.
"""

from __future__ import annotations

import pytest
from memfit.system import load_system

from tests.systems import ALIASES, TRAIN, console, evaluate, one_error_line, train


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module", params=sorted(ALIASES))
def trained(request, runs):
    """(system, run folder) after one training step through the system's console alias (exit 0)."""
    system = request.param
    assert train(system, runs) == 0
    return system, runs / system / "run"


def test_aliases_exit_zero_and_point_at_the_system(trained, capsys):
    system, run = trained
    assert (run / "ckpt_0000001.pt").exists()
    assert evaluate(system, run) == 0
    assert load_system(system).name == system


def test_train_into_an_existing_run_refuses_in_one_line(trained, runs, capsys):
    system, run = trained
    before = sorted(p.name for p in run.iterdir())
    capsys.readouterr()
    assert train(system, runs) == 2
    line = one_error_line(capsys)
    assert all(flag in line for flag in ("--resume", "--run_name", "--overwrite"))
    assert sorted(p.name for p in run.iterdir()) == before


@pytest.mark.parametrize("system", sorted(ALIASES))
@pytest.mark.parametrize("bad", [["--lr", "0"], ["--lr", "-1"], ["--batch_size", "0"], ["--log_every", "0"]])
def test_bad_numbers_are_one_line_exit_2(system, bad, tmp_path, capsys):
    assert train(system, tmp_path, *bad) == 2
    line = one_error_line(capsys)
    assert bad[0] in line, line
    assert not (tmp_path / system).exists()  # refused before anything was written


@pytest.mark.parametrize("system", sorted(ALIASES))
def test_unwritable_runs_dir_is_one_line_exit_2(system, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert train(system, tmp_path / "file") == 2
    assert "cannot create the run folder" in one_error_line(capsys)
    assert train(system, "/proc/memfit-test") == 2
    assert "cannot create the run folder" in one_error_line(capsys)


def test_eval_of_another_systems_checkpoint_or_a_missing_run_is_one_line(trained, tmp_path, capsys):
    system, run = trained
    other = "gpt2-window" if system != "gpt2-window" else "ginr-cifar"
    assert train(other, tmp_path / "other") == 0
    capsys.readouterr()
    assert evaluate(system, tmp_path / "other" / other / "run") == 2
    line = one_error_line(capsys)
    assert other in line or "not a" in line or "another system" in line, line
    assert evaluate(system, tmp_path / "missing") == 2
    assert "no run" in one_error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert evaluate(system, tmp_path / "empty") == 2
    assert "no checkpoint" in one_error_line(capsys)


def test_unwritable_outputs_of_eval_and_extra_commands_are_one_line(trained, tmp_path, capsys):
    system, run = trained
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    if system != "gpt2-window":  # gpt2's eval prints, it writes no file
        assert evaluate(system, run, "--out", str(blocker / "out")) == 2
        assert str(blocker) in one_error_line(capsys)
    extra = load_system(system).extra_commands
    if system == "mbsnet-speech":
        import numpy as np
        from mbsnet_speech.data import write_wav

        write_wav(tmp_path / "in.wav", np.zeros(8000, np.float32))
        argv = [str(tmp_path / "in.wav"), "--out", str(blocker / "out"), "--run", str(run)]
        assert load_system(system).command("enhance")(argv) == 2
        assert str(blocker) in one_error_line(capsys)
    if system == "moremouse-triplane":
        assert load_system(system).command("make-data")([str(blocker / "out"), "--num_scenes", "1"]) == 2
        assert str(blocker) in one_error_line(capsys)
    if system == "gpt2-window":
        assert load_system(system).command("generate")(["--run", str(tmp_path / "none")]) == 2
        assert "no run" in one_error_line(capsys)
    assert set(extra) <= {"enhance", "make-data", "generate"}


def test_enhance_says_when_it_resamples_or_downmixes(trained, tmp_path, capsys):
    system, run = trained
    if system != "mbsnet-speech":
        pytest.skip("enhance is mbsnet-speech's command")
    import numpy as np
    import soundfile as sf

    sf.write(tmp_path / "in.wav", np.zeros((4000, 2), np.float32), 8000)  # 8 kHz stereo
    argv = [str(tmp_path / "in.wav"), "--out", str(tmp_path / "out"), "--run", str(run)]
    assert load_system(system).command("enhance")(argv) == 0
    err = capsys.readouterr().err
    assert "8000 Hz files are resampled to 16 kHz" in err and "2-channel files are averaged to mono" in err
    assert sf.info(str(tmp_path / "out" / "in.wav")).samplerate == 16000


def test_installed_alias_script_exits_zero_after_success(tmp_path):
    """The real console script (what `uv run gpt2-train` runs): status 0, not sys.exit(dict) == 1."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "gpt2-train"
    if not script.exists():
        pytest.skip(f"{script} is not installed (uv sync --all-packages)")
    argv = [*TRAIN["gpt2-window"], "--steps", "1", "--no_progress", "--runs_dir", str(tmp_path)]
    res = subprocess.run([str(script), *argv, "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    res = subprocess.run([str(script), *argv, "--lr", "0"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "gpt2-train: error: --lr must be > 0, got 0"
    ]


RESIZE = {
    "ginr-cifar": ["--decoder_width", "32"],
    "gpt2-window": ["--window", "3"],
    "mbsnet-speech": ["--channels", "8"],
}


def test_resume_with_another_config_is_one_line(trained, runs, capsys):
    system, run = trained
    if system not in RESIZE:
        pytest.skip("no small size flag to change (the paper preset is too big to build in a test)")
    before = sorted(p.name for p in run.iterdir())
    capsys.readouterr()
    assert train(system, runs, "--resume", *RESIZE[system]) == 2
    line = one_error_line(capsys)
    assert "--resume" in line and ("another model config" in line or "different model" in line), line
    assert sorted(p.name for p in run.iterdir()) == before


class FakeClock:
    """memfit.train.loop.now: a minute passes per reading (the Trainer reads it once per step boundary), and
    SIGINT arrives at reading `interrupt_at` (0-based; None: never)."""

    def __init__(self, interrupt_at=None):
        self.t, self.calls, self.interrupt_at = 0.0, 0, interrupt_at

    def __call__(self):
        if self.calls == self.interrupt_at:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGINT)
        self.calls += 1
        self.t += 60.0
        return self.t


@pytest.mark.parametrize("system", sorted(ALIASES))
def test_budget_run_interrupted_and_resumed_follows_the_uninterrupted_lr_curve(system, tmp_path, monkeypatch):
    """`train --max_minutes 5` at a (fake) minute per step trains 5 steps. Interrupted after step 2 and
    continued with a bare `--resume`, the run takes the same learning rate at every step: the Trainer's
    clock and the budget belong to the run, and the schedule reads them."""
    import json

    import memfit.train.loop

    def lrs(run):
        rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return [r["lr"] for r in rows if "lr" in r]

    argv = [
        *TRAIN[system],
        "--warmup",
        "1",
        "--max_minutes",
        "5",
        "--log_every",
        "1",
        "--save_every",
        "0",
        "--no_progress",
        "--runs_dir",
        str(tmp_path),
    ]  # fmt: skip (a repeated --warmup: the last wins)
    train_cli = console(f"{ALIASES[system]}-train")
    monkeypatch.setattr(memfit.train.loop, "now", FakeClock())
    assert train_cli([*argv, "--run_name", "whole"]) == 0
    monkeypatch.setattr(memfit.train.loop, "now", FakeClock(interrupt_at=2))
    assert train_cli([*argv, "--run_name", "cut"]) == 130
    monkeypatch.setattr(memfit.train.loop, "now", FakeClock())
    assert train_cli(["--resume", "--run_name", "cut", "--runs_dir", str(tmp_path), "--no_progress"]) == 0
    whole, cut = lrs(tmp_path / system / "whole"), lrs(tmp_path / system / "cut")
    assert len(whole) == 5 and len(set(whole)) == 5
    assert cut == pytest.approx(whole, rel=1e-12)
