import csv
import json
import shutil

import numpy as np
import pytest
import soundfile as sf
import torch

pytest.importorskip("memfit.mamba", reason="memfit.mamba (the chunked Mamba block) is not installed yet")

from mbsnet_speech import enhance, eval, train  # noqa: E402
from mbsnet_speech.enhance import enhance_array  # noqa: E402

TINY = ["--config", "tiny", "--batch_size", "2", "--seconds", "0.5", "--no_progress", "--log_every", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained 3 steps on generated pairs, checkpoints at 2 and 3 (shared by later tests)."""
    runs = tmp_path_factory.mktemp("runs")
    out = train.main(
        [*TINY, "--steps", "3", "--save_every", "2", "--runs_dir", str(runs), "--run_name", "gen"]
    )
    return runs / "mbsnet-speech" / "gen", out


def test_train_on_generator_writes_checkpoint_and_metrics(trained):
    run_dir, out = trained
    assert np.isfinite(out["loss"]) and out["peak_memory_mib"] > 0
    assert (run_dir / "ckpt_0000002.pt").exists() and (run_dir / "ckpt_0000003.pt").exists()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert all(k in records[0] for k in ("mag", "pha", "com", "time"))


def test_resume_continues_exactly(trained, tmp_path):
    """Resuming from the step-2 checkpoint reproduces the uninterrupted run's step 3 bit for bit."""
    run_dir, _ = trained
    split = tmp_path / "mbsnet-speech" / "split"
    split.mkdir(parents=True)
    shutil.copy(run_dir / "ckpt_0000002.pt", split)
    train.main([*TINY, "--steps", "3", "--runs_dir", str(tmp_path), "--run_name", "split", "--resume"])
    a = torch.load(split / "ckpt_0000003.pt", weights_only=True)["model"]
    b = torch.load(run_dir / "ckpt_0000003.pt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_train_on_voicebank_folder(tmp_path, make_voicebank):
    root = make_voicebank(tmp_path / "vb")
    out = train.main(
        [*TINY, "--steps", "1", "--data", str(root), "--runs_dir", str(tmp_path), "--run_name", "vb"]
    )
    assert np.isfinite(out["loss"])
    with pytest.raises(SystemExit, match="clean_"):
        train.main(
            [
                *TINY,
                "--steps",
                "1",
                "--data",
                str(tmp_path / "runs_nothing_here"),
                "--runs_dir",
                str(tmp_path),
            ]
        )


def test_eval_writes_table_csv_and_spectrogram(trained, tmp_path, capsys):
    run_dir, _ = trained
    summary = eval.main(["--ckpt", str(run_dir), "--pairs", "2", "--seconds", "1.5", "--out", str(tmp_path)])
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["file"] for r in rows] == ["heldout_000.wav", "heldout_001.wav"]
    assert summary["n_ok"] == 2 and np.isfinite(summary["enhanced/pesq_wb"])
    png = (tmp_path / "spectrogram.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "mean (noisy -> enhanced)" in capsys.readouterr().out


def test_eval_on_folder_records_a_bad_file_and_goes_on(trained, tmp_path, make_voicebank):
    run_dir, _ = trained
    root = make_voicebank(tmp_path / "vb")
    sf.write(root / "clean_testset_wav" / "p001.wav", np.zeros(16000, np.float32), 16000)
    sf.write(root / "noisy_testset_wav" / "p001.wav", np.zeros(16000, np.float32), 16000)
    summary = eval.main(["--ckpt", str(run_dir), "--data", str(root), "--out", str(tmp_path / "ev")])
    with open(tmp_path / "ev" / "metrics.csv") as f:
        rows = {r["file"]: r for r in csv.DictReader(f)}
    assert "silent" in rows["p001.wav"]["error"] and rows["p000.wav"]["error"] == ""
    assert summary["n_ok"] == 2 and summary["n_failed"] == 1
    with pytest.raises(SystemExit, match="no checkpoint"):
        eval.main(["--ckpt", str(tmp_path), "--pairs", "1"])


def test_chunked_overlap_add_is_exact_for_identity_and_bounded():
    x = np.random.default_rng(0).standard_normal(50_000).astype(np.float32)
    lengths = []

    def ident(t):
        lengths.append(t.shape[1])
        return t

    y = enhance_array(ident, x, chunk=8000, overlap=1000)
    np.testing.assert_allclose(y, x, atol=1e-6)
    assert len(lengths) == 7 and max(lengths) == 8000


def test_enhance_long_file_in_chunks(trained, tmp_path, speech):
    run_dir, _ = trained
    clean, noisy, fs = speech
    long = np.tile(noisy, 3)  # ~9.3 s
    (tmp_path / "in").mkdir()
    sf.write(tmp_path / "in" / "long.wav", long, fs)
    sf.write(tmp_path / "in" / "short.wav", noisy[:8000], fs)
    written = enhance.main(
        [
            str(tmp_path / "in"),
            "--out",
            str(tmp_path / "out"),
            "--ckpt",
            str(run_dir),
            "--chunk_seconds",
            "2",
            "--overlap_seconds",
            "0.25",
        ]
    )
    assert sorted(p.name for p in written) == ["long.wav", "short.wav"]
    y, sr = sf.read(tmp_path / "out" / "long.wav")
    assert sr == 16000 and len(y) == len(long) and np.isfinite(y).all() and np.abs(y).max() > 0
    with pytest.raises(SystemExit, match="does not exist"):
        enhance.main([str(tmp_path / "nope.wav"), "--out", str(tmp_path), "--ckpt", str(run_dir)])
