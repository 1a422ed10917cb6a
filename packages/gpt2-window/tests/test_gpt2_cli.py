"""train / eval / generate commands: runs, checkpoints, exact resume, seed flags and clear errors."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from gpt2_window.eval import main as eval_run
from gpt2_window.sample import main as generate_run
from gpt2_window.train import run as train_run
from memfit.errors import UsageError

REPO = Path(__file__).resolve().parents[3]
SHAKESPEARE = REPO / ".." / "shared" / "data" / "text" / "tinyshakespeare.txt"

FAST = ["--model", "nano", "--batch_size", "4", "--no_progress", "--eval_iters", "2", "--warmup", "2"]


def test_train_default_corpus_checkpoint_eval_generate(tmp_path, capsys):
    runs = str(tmp_path)
    out = train_run([*FAST, "--num_iterations", "6", "--save_every", "3", "--runs_dir", runs])
    printed = capsys.readouterr().out
    assert "peak memory consumption:" in printed and "tokens/s:" in printed
    assert "default corpus" in printed
    run = tmp_path / "gpt2-window" / "run"
    assert sorted(p.name for p in run.glob("ckpt_*.pt")) == ["ckpt_0000003.pt", "ckpt_0000006.pt"]
    assert out["step"] == 6 and out["peak_memory_mib"] > 0 and out["tokens_per_s"] > 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/val_loss" in r for r in lines)

    ev = eval_run(["--run", str(run), "--eval_iters", "3", "--batch_size", "2"])
    assert (
        ev["step"] == 6
        and 0 < ev["loss"] < 10
        and abs(ev["perplexity"] - torch.tensor(ev["loss"]).exp()) < 1e-3
    )
    # the subcommand form and the registered extra command give the same sample for the same seed
    a = eval_run(["generate", "--run", str(run), "--prompt", "def ", "--max_new_tokens", "40", "--seed", "3"])
    b = generate_run(["--run", str(run), "--prompt", "def ", "--max_new_tokens", "40", "--seed", "3"])
    assert a == b and a[0].startswith("def ") and len(a[0]) == 44


def test_resume_is_exact(tmp_path):
    runs = str(tmp_path)
    args = [*FAST, "--num_iterations", "6", "--save_every", "3", "--runs_dir", runs, "--window", "4,none"]
    train_run(args)
    run = tmp_path / "gpt2-window" / "run"
    straight = torch.load(run / "ckpt_0000006.pt", weights_only=True)["model"]
    (run / "ckpt_0000006.pt").unlink()
    train_run([*args, "--resume"])
    resumed = torch.load(run / "ckpt_0000006.pt", weights_only=True)
    assert resumed["config"]["window"] == [4, None]
    for k in straight:
        assert torch.equal(straight[k], resumed["model"][k]), k


def test_resume_with_a_different_model_is_refused(tmp_path):
    runs = str(tmp_path)
    train_run([*FAST, "--num_iterations", "2", "--runs_dir", runs])
    with pytest.raises(UsageError, match=r"another model config \(window 8 -> 3\)"):
        train_run([*FAST, "--num_iterations", "4", "--runs_dir", runs, "--window", "3", "--resume"])


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason=f"{SHAKESPEARE} not present (shared test data)")
def test_train_on_tinyshakespeare_and_sample(tmp_path):
    runs = str(tmp_path)
    out = train_run([*FAST, "--model", "tiny_window", "--sequence_length", "32", "--num_iterations", "4",
                     "--data", str(SHAKESPEARE), "--runs_dir", runs])  # fmt: skip
    assert out["step"] == 4
    run = tmp_path / "gpt2-window" / "run"
    ckpt = torch.load(run / "ckpt_0000004.pt", weights_only=True)
    assert ckpt["config"]["vocab_size"] == 65  # nanoGPT's shakespeare_char vocabulary
    assert ckpt["config"]["window"] == 16
    ev = eval_run(["--run", str(run), "--eval_iters", "2"])  # data path comes from the checkpoint
    assert "tinyshakespeare" in ev["data"]
    text = generate_run(["--run", str(run), "--prompt", "ROMEO:", "--max_new_tokens", "20"])[0]
    assert text.startswith("ROMEO:") and len(text) == 26


def test_seed_flags_and_window_parsing():
    from gpt2_window.train import build_parser, parse_window

    run = build_parser().parse(
        ["--model", "d12_window", "--sequence_length", "1024", "--batch_size", "4", "--num_iterations", "5"]
    )
    s = run.settings
    got = (run.preset, s.train.sequence_length, s.train.batch_size, s.loop.steps)
    assert got == ("d12_window", 1024, 4, 5)
    assert s.model.window == 64  # --model is --config
    assert build_parser().parse(["--steps", "7"]).settings.loop.steps == 7
    assert build_parser().parse([]).settings.loop.steps == 2000
    assert parse_window("64") == 64 and parse_window("none") is None
    assert parse_window("8,none,16") == [8, None, 16]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt5"], "'gpt5' is neither a preset .*d12, d12_window, tiny, tiny_window, nano"),
        (["--sequence_length", "0"], "--sequence_length must be >= 1, got 0"),
        (["--window", "0"], "window must be > 0"),
        (["--window", "-3"], "window must be > 0"),
        (["--sequence_length", "33"], "longer than the context of --config nano.*<= 32"),
        (["--data", "/nonexistent/input.txt"], "does not exist"),
        (["--window", "4,4,4"], "one window"),
    ],
)
def test_bad_train_input_exits_with_a_message(tmp_path, capsys, argv, message):
    with pytest.raises(UsageError) as exc:
        train_run([*FAST, "--num_iterations", "1", "--runs_dir", str(tmp_path), *argv])
    text = f"{exc.value} {capsys.readouterr().err}"
    assert re.search(message, text, re.S), text


@pytest.mark.parametrize(
    "content, message",
    [(b"", "is empty"), ("caf\xe9".encode("latin-1") * 50, "not UTF-8")],
    ids=["empty", "latin-1"],
)
def test_bad_data_file_exits_with_a_message(tmp_path, content, message):
    path = tmp_path / "data.txt"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=message):
        train_run([*FAST, "--num_iterations", "1", "--runs_dir", str(tmp_path), "--data", str(path)])


def test_eval_without_a_run_and_bad_prompt(tmp_path):
    with pytest.raises(UsageError, match="no checkpoint"):
        eval_run(["--run", str(tmp_path)])
    train_run([*FAST, "--num_iterations", "1", "--runs_dir", str(tmp_path)])
    run = str(tmp_path / "gpt2-window" / "run")
    with pytest.raises(UsageError, match="not in this model's vocabulary"):
        generate_run(["--run", run, "--prompt", "\u2603 snowman"])
    with pytest.raises(UsageError, match="longer than the model's context"):
        eval_run(["--run", run, "--sequence_length", "64"])


def test_console_entry_point_returns_none(tmp_path, capsys):
    """Console scripts run sys.exit(main()): main must return None for exit status 0."""
    from gpt2_window.train import main

    assert main([*FAST, "--num_iterations", "1", "--runs_dir", str(tmp_path)]) is None
    assert "peak memory consumption:" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(not SHAKESPEARE.exists(), reason=f"{SHAKESPEARE} not present (shared test data)")
def test_nanogpt_cpu_char_model_side_by_side_with_nanogpt_equivalent(tmp_path):
    """nanoGPT's README CPU run (4x4x128, block 64, batch 12, 2000 iterations), judged side by side: our
    causal model's val loss (200 batches, mean of 2 seeds) <= an independent nanoGPT-equivalent's
    (tools/nanogpt_ref.py, same data, schedule and evaluation) + 0.01, and the window-16 (T/4) model's
    <= our causal one's + 0.02. One-sided: the window model may be *better* (it scored 0.044 below causal
    on 2026-11-22), and that is not a leak: on trained weights its eval loss equals the dense masked
    reference's and no logit sees a later token
    (test_gpt2_model.py::test_trained_window_model_eval_loss_equals_dense_reference_and_sees_no_future).
    (nanoGPT's README 1.88 is one 20-batch reading; tens of minutes.)"""
    sys.path.insert(0, str(REPO / "tools"))
    from bench_gpt2 import side_by_side

    out = side_by_side(SHAKESPEARE, str(tmp_path), [0, 1])
    assert out["causal_minus_ref"] <= 0.01, out
    assert out["window_minus_causal"] <= 0.02, out
    assert out["mean"]["causal"] < 2.2, out  # it learned: an untrained model scores ~4.2


def test_a_relative_data_is_kept_absolute_so_eval_elsewhere_reads_it(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(80))
    (a / "text.txt").write_text(text)
    monkeypatch.chdir(a)
    train_run([*FAST, "--num_iterations", "1", "--data", "text.txt", "--runs_dir", str(tmp_path)])
    run = tmp_path / "gpt2-window" / "run"
    assert json.loads((run / "config.json").read_text())["train"]["data"] == str(a / "text.txt")
    monkeypatch.chdir(b)  # eval reads the run's data: the same file, from anywhere
    assert eval_run(["--run", str(run), "--eval_iters", "1"])["data"] == str(a / "text.txt")
