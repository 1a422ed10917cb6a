"""One default model: wherever no run is named (enhance, eval, load(), enhance_file, enhance(array)) the
model shipped in the package is used, even beside a trained run; `--run shipped` names it; the quick start
trains into its own run folder; every command names the model it uses; nothing is written into the
package. And the in-memory API: arrays, tensors and batches at any sample rate."""

from __future__ import annotations

from pathlib import Path

import mbsnet_speech
import numpy as np
import pytest
import soundfile as sf
import torch
from mbsnet_speech import enhance, eval, train
from mbsnet_speech.data import SAMPLE_RATE, make_noise, mix, synth_speech
from mbsnet_speech.enhance import enhance_array, model_fn, shipped_model
from memfit.errors import UsageError
from memfit.system import load_system

TINY = [
    *("--config", "tiny", "--batch_size", "2", "--seconds", "0.5", "--no_progress", "--val_files", "0"),
    *("--no_preflight", "--device", "cpu"),
]
SHIPPED_LINE = "model: the weights shipped with mbsnet-speech (`general` preset, 4747 steps on "


def noisy_speech(seconds: float = 1.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE)
    return mix(synth_speech(n, rng), make_noise("babble", n, rng), 0.0).astype(np.float32)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def beside_a_run(tmp_path, monkeypatch):
    """A working folder with a trained run at runs/mbsnet-speech/run (where the old default looked) and a
    noisy recording."""
    monkeypatch.chdir(tmp_path)
    train.main([*TINY, "--steps", "1", "--run_name", "run"])
    sf.write("noisy.wav", noisy_speech(), SAMPLE_RATE)
    return tmp_path


def test_without_a_run_every_entry_point_uses_the_shipped_model(beside_a_run, capsys):
    system = load_system("mbsnet-speech")
    shipped = system.from_pretrained(shipped_model())
    assert same_weights(mbsnet_speech.load(), shipped) and same_weights(
        mbsnet_speech.load("shipped"), shipped
    )
    assert not same_weights(mbsnet_speech.load("run"), shipped)
    capsys.readouterr()
    enhance.main(["noisy.wav", "--out", "default"])
    assert capsys.readouterr().err.splitlines()[0].startswith(SHIPPED_LINE)
    enhance.main(["noisy.wav", "--out", "named", "--run", "shipped"])
    assert capsys.readouterr().err.splitlines()[0].startswith(SHIPPED_LINE)
    enhance.main(["noisy.wav", "--out", "trained", "--run", "run"])
    line = capsys.readouterr().err.splitlines()[0]
    checkpoint = Path("runs/mbsnet-speech/run/ckpt_0000001.pt")
    assert line == f"model: {checkpoint} (`tiny` preset, 1 step on the built-in data)"
    mbsnet_speech.enhance_file("noisy.wav", "file.wav")
    default, named, trained, file = (sf.read(p)[0] for p in ("default/noisy.wav", "named/noisy.wav",
                                                             "trained/noisy.wav", "file.wav"))  # fmt: skip
    assert np.array_equal(default, named) and np.array_equal(default, file)
    assert not np.allclose(default, trained)


def test_eval_of_the_shipped_model_writes_beside_the_runs_never_into_the_package(beside_a_run, capsys):
    package = {p.name: p.stat().st_mtime_ns for p in shipped_model().iterdir()}
    eval.main(["--pairs", "1", "--seconds", "0.5"])
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(SHIPPED_LINE)
    assert Path("runs/mbsnet-speech/shipped/eval/metrics.json").is_file()
    assert {p.name: p.stat().st_mtime_ns for p in shipped_model().iterdir()} == package
    with pytest.raises(UsageError, match="outputs never replace inputs"):
        eval.main(["--pairs", "1", "--seconds", "0.5", "--out", str(shipped_model() / "eval")])


def test_the_quick_start_trains_into_its_own_run_and_resumes_there(tmp_path):
    """`train` with the CPU recipe writes runs/mbsnet-speech/quickstart/ (never the shipped model's place
    nor a bare `run`), and `--resume` without a run name finds it; no run may be named `shipped`."""
    quick = ["--config", "cpu", "--batch_size", "2", "--seconds", "0.5", "--val_files", "0", "--no_progress"]
    quick += ["--no_preflight", "--device", "cpu", "--runs_dir", str(tmp_path)]
    train.main([*quick, "--steps", "1"])
    run = tmp_path / "mbsnet-speech" / "quickstart"
    assert (run / "ckpt_0000001.pt").is_file() and not (tmp_path / "mbsnet-speech" / "run").exists()
    train.main(["--resume", "--steps", "2", "--runs_dir", str(tmp_path), "--device", "cpu", "--no_progress"])
    assert (run / "ckpt_0000002.pt").is_file()
    general = train.build_parser().parse(["--config", "general", "--device", "cpu"]).settings.loop
    assert general.run_name == "general"
    with pytest.raises(UsageError, match="'shipped' is kept for a package's own weights"):
        train.main([*quick, "--steps", "1", "--run_name", "shipped"])


def test_enhance_takes_arrays_tensors_and_batches_at_any_rate():
    """mbsnet_speech.enhance(audio, sample_rate): the module is callable; an array gives an array of the
    same shape, a tensor a tensor; a batch is its rows enhanced one by one, and 16 kHz audio comes back
    exactly as the streaming path (enhance_file's) gives it."""
    model = mbsnet_speech.load()
    x, y = noisy_speech(1.0, 1), noisy_speech(1.0, 2)[:12000]
    one = mbsnet_speech.enhance(x, SAMPLE_RATE, model=model)
    assert isinstance(one, np.ndarray) and one.shape == x.shape and one.dtype == np.float32
    np.testing.assert_array_equal(one, enhance_array(model_fn(model), x))
    batch = torch.from_numpy(np.stack([x[:12000], y]))
    out = mbsnet_speech.enhance(batch, SAMPLE_RATE, model=model)
    assert isinstance(out, torch.Tensor) and out.shape == batch.shape
    torch.testing.assert_close(out[1], torch.from_numpy(mbsnet_speech.enhance(y, SAMPLE_RATE, model=model)))
    low = mbsnet_speech.enhance(x[::2], 8000, model=model)  # 8 kHz in, 8 kHz out
    assert low.shape == x[::2].shape and np.isfinite(low).all()
    assert np.array_equal(mbsnet_speech.enhance(x, SAMPLE_RATE), one)  # run None: the shipped model
    with pytest.raises(ValueError, match=r"audio must be \(n,\) or \(batch, n\)"):
        mbsnet_speech.enhance(np.zeros((2, 2, 100), np.float32), SAMPLE_RATE, model=model)
    with pytest.raises(ValueError, match="sample_rate must be a positive integer"):
        mbsnet_speech.enhance(x, 0, model=model)
