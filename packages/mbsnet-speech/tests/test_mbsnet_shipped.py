"""The model shipped in the package: enhance works right after install, with no training, and it
enhances real recorded speech in noise it never heard."""

import json
import os
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from mbsnet_speech import enhance, enhance_file
from mbsnet_speech.classical import wiener_enhance
from mbsnet_speech.data import audio_files, heldout_mixes
from mbsnet_speech.enhance import shipped_model
from mbsnet_speech.metrics import pesq_score

ROOT = Path(__file__).resolve().parents[3]
NOISE = ROOT / ".." / "shared" / "data" / "noise-real"


def test_the_shipped_model_is_weights_and_config_within_5_mb():
    folder = shipped_model()
    files = {p.name: p.stat().st_size for p in folder.iterdir()}
    assert {"model.safetensors", "config.json"} <= set(files)
    assert sum(files.values()) <= 5 * 2**20
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["system"] == "mbsnet-speech"


def test_enhance_without_a_run_uses_the_shipped_model(tmp_path, speech, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no runs/ here: nothing trained
    sf.write(tmp_path / "noisy.wav", speech[1], 16000)
    written = enhance.main(["noisy.wav", "--out", "out"])
    assert written == [Path("out") / "noisy.wav"]
    assert "model: the weights shipped with mbsnet-speech (`general` preset" in capsys.readouterr().err
    y, sr = sf.read(tmp_path / "out" / "noisy.wav")
    assert sr == 16000 and len(y) == len(speech[1]) and np.isfinite(y).all()


def test_enhance_file_improves_recorded_speech_in_unheard_noise(tmp_path, speech):
    """speech.wav (a real recording) in recorded noises none of the shipped model's training used (the
    recipe's test noise groups), 0-10 dB: enhance_file raises PESQ-wb on average, and by more than the
    Wiener filter does on the same mixes."""
    if not NOISE.is_dir():
        pytest.skip(f"noise-real not found at {NOISE}")
    test_noise = [p for p in audio_files(NOISE, "--noise") if p.name.startswith(("minetest", "wordwarvi"))]
    sf.write(tmp_path / "speech.wav", speech[0], 16000)
    gains, wiener = [], []
    for name, noisy, clean in heldout_mixes([tmp_path / "speech.wav"], test_noise, 4, seed=11):
        sf.write(tmp_path / name, noisy, 16000, subtype="FLOAT")
        out = enhance_file(tmp_path / name, tmp_path / "enh" / name)
        enhanced, _ = sf.read(out, dtype="float32")
        gains.append(pesq_score(clean, enhanced) - pesq_score(clean, noisy))
        wiener.append(pesq_score(clean, wiener_enhance(noisy)) - pesq_score(clean, noisy))
    assert np.mean(gains) > 0.15 and np.mean(gains) > np.mean(wiener) + 0.1, (gains, wiener)


def test_the_wheel_carries_the_shipped_model(tmp_path):
    """A user who installs the wheel gets the weights (they are package data, not only in the clone)."""
    out = subprocess.run(
        ["uv", "build", "--wheel", "--package", "mbsnet-speech", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "UV_NO_PROGRESS": "1"},
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("mbsnet_speech-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mbsnet_speech/pretrained/model.safetensors" in names
    assert "mbsnet_speech/pretrained/config.json" in names
