"""An export is evaluated on its own run's split: the same named sets and the same figures as the run
folder it came from; results go beside the runs, never into the export; a model that records no split
gets its sets named as such, never "held-out"."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
from mbsnet_speech import eval, train
from mbsnet_speech.data import SAMPLE_RATE, make_noise, synth_speech
from memfit import cli
from memfit.train.flags import export_eval_name

VOICES = ("en_aa", "it_bb", "ru_cc", "fi_dd", "cs_ee", "ca_ff")
HELD = [
    *("--val_voices", "aa,bb", "--test_voices", "ff"),
    *("--val_noises", "white-rec", "--test_noises", "hum-rec"),
]


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory):
    """A tiny run trained on 6 generated voices x 5 noise recordings with a voice and a noise held out
    for test, and its export; (root, run folder, export folder)."""
    root = tmp_path_factory.mktemp("split")
    rng = np.random.default_rng(0)
    (root / "voices").mkdir()
    for voice in VOICES:
        for i in range(2):
            sf.write(root / "voices" / f"{voice}_{i:03d}.flac", synth_speech(16000, rng), SAMPLE_RATE)
    (root / "noise").mkdir()
    for k, kind in enumerate(("white", "pink", "brown", "hum", "babble")):
        sf.write(root / "noise" / f"{kind}-rec_{k:02d}.flac", 0.1 * make_noise(kind, 20000, rng), SAMPLE_RATE)
    train.main(
        ["--config", "tiny", "--batch_size", "2", "--seconds", "0.5", "--no_progress", "--no_preflight"]
        + ["--device", "cpu", "--steps", "1", "--val_files", "0", *HELD]
        + ["--clean", str(root / "voices"), "--noise", str(root / "noise")]
        + ["--runs_dir", str(root / "runs"), "--run_name", "mix"]
    )
    run = root / "runs" / "mbsnet-speech" / "mix"
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(run), "--out", str(root / "exported")])
    assert e.value.code == 0
    return root, run, root / "exported"


def sets(path) -> list[tuple[str, dict]]:
    return [(x["data"], x["summary"]) for x in json.loads((path / "metrics.json").read_text())["sets"]]


def test_a_run_and_its_export_score_the_same_sets_and_figures(run_and_export, monkeypatch):
    root, run, exported = run_and_export
    monkeypatch.chdir(root)  # the run's own data paths are relative to where it trained
    eval.main(["--run", str(run), "--mixes", "2", "--runs_dir", "runs"])
    before = sorted(p.name for p in exported.iterdir())
    eval.main(["--run", str(exported), "--mixes", "2", "--runs_dir", "runs"])
    from_run, from_export = (
        sets(run / "eval"),
        sets(root / "runs" / "mbsnet-speech" / "exported" / export_eval_name(exported) / "eval"),
    )
    assert [label for label, _ in from_run] == [label for label, _ in from_export]
    assert "held-out voices ca_ff x held-out noises hum-rec" in from_run[0][0]
    for (_, a), (_, b) in zip(from_run, from_export):
        assert a == b
    assert sorted(p.name for p in exported.iterdir()) == before  # nothing written into the export


def test_a_model_that_records_no_split_never_calls_its_data_held_out(run_and_export, monkeypatch, capsys):
    root, _, exported = run_and_export
    monkeypatch.chdir(root)
    bare = root / "bare"
    bare.mkdir()
    doc = json.loads((exported / "config.json").read_text())
    del doc["meta"]["settings"]
    (bare / "config.json").write_text(json.dumps(doc))
    (bare / "model.safetensors").write_bytes((exported / "model.safetensors").read_bytes())
    eval.main(["--run", str(bare), "--clean", "voices", "--noise", "noise", "--mixes", "2", "--out", "ev"])
    ((label, _),) = sets(root / "ev")
    assert "held-out" not in label and "the model records no training split" in label
    assert "data it does not record" in capsys.readouterr().out.splitlines()[0]
