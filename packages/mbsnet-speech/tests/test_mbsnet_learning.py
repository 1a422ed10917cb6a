"""Learning quality of the CPU recipe (slow): it must really enhance speech it never saw."""

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "memfit.ops.mamba", reason="memfit.ops.mamba (the chunked Mamba block) is not installed yet"
)

from mbsnet_speech import eval, train  # noqa: E402

SPEECH_TTS = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "speech-tts"
# the budget: 20 minutes of training on a 2-core CPU (the recipe trains on 1 thread);
# MBSNET_TEST_MINUTES shortens it for a try
MINUTES = float(os.environ.get("MBSNET_TEST_MINUTES", "20"))


def _report(name: str, t_train: float, s: dict) -> None:
    print(
        f"\n{name}: train {t_train / 60:.1f} min; "
        f"PESQ-wb {s['noisy/pesq_wb']:.3f} -> {s['enhanced/pesq_wb']:.3f} "
        f"(Wiener {s['classical/pesq_wb']:.3f}); STOI {s['noisy/stoi']:.3f} -> {s['enhanced/stoi']:.3f}; "
        f"SI-SDR {s['noisy/si_sdr']:.2f} -> {s['enhanced/si_sdr']:.2f} dB"
    )


@pytest.mark.slow
def test_cpu_recipe_on_generated_pairs_improves_pesq_and_keeps_stoi(tmp_path):
    """The default offline `train` (generated pairs, CPU recipe) improves held-out pairs without costing
    intelligibility."""
    t0 = time.perf_counter()
    train.main(
        ["--config", "cpu", "--steps", "400", "--no_progress", "--log_every", "50"]
        + ["--runs_dir", str(tmp_path), "--run_name", "gen"]
    )
    t_train = time.perf_counter() - t0
    s = eval.main(["--run", str(tmp_path / "mbsnet-speech" / "gen"), "--pairs", "12", "--seconds", "3"])
    _report("generated", t_train, s)
    assert s["n_failed"] == 0
    assert s["delta/pesq_wb"] > 0 and s["delta/si_sdr"] > 0
    assert s["delta/stoi"] >= 0


@pytest.mark.slow
def test_cpu_recipe_on_speech_tts_reaches_the_goal(tmp_path):
    """The corpus goal: `train --data speech-tts --max_minutes 20` (CPU recipe, 1 thread), then on the
    unseen test split: PESQ-wb +0.6 over noisy and every noise kind up, STOI +0.01, SI-SDR up, and
    +0.2 PESQ-wb over the classical Wiener baseline."""
    if not (SPEECH_TTS / "clean_train").is_dir():
        pytest.skip(f"speech-tts corpus not found at {SPEECH_TTS}")
    t0 = time.perf_counter()
    train.main(
        ["--config", "cpu", "--data", str(SPEECH_TTS), "--max_minutes", str(MINUTES)]
        + ["--no_progress", "--log_every", "100", "--runs_dir", str(tmp_path), "--run_name", "tts"]
    )
    t_train = time.perf_counter() - t0
    out = tmp_path / "eval"
    s = eval.main(
        ["--run", str(tmp_path / "mbsnet-speech" / "tts"), "--data", str(SPEECH_TTS), "--out", str(out)]
    )
    _report("speech-tts test split", t_train, s)
    per_kind = json.loads((out / "metrics.json").read_text())["per_noise_kind"]
    for kind, d in per_kind.items():
        print(
            f"{kind:>7} (n={d['n']}): PESQ-wb {d['noisy/pesq_wb']:.3f} -> {d['enhanced/pesq_wb']:.3f} "
            f"(Wiener {d['classical/pesq_wb']:.3f}); STOI {d['noisy/stoi']:.3f} -> {d['enhanced/stoi']:.3f} "
            f"(Wiener {d['classical/stoi']:.3f}); "
            f"SI-SDR {d['noisy/si_sdr']:.2f} -> {d['enhanced/si_sdr']:.2f}"
        )
    assert s["n_ok"] == 64 and s["n_failed"] == 0
    assert s["delta/pesq_wb"] >= 0.60
    assert s["delta/stoi"] >= 0.01
    assert s["delta/si_sdr"] > 0
    assert s["enhanced/pesq_wb"] >= s["classical/pesq_wb"] + 0.20
    assert len(per_kind) == 5 and all(
        d["enhanced/pesq_wb"] > d["noisy/pesq_wb"] for d in per_kind.values()
    ), per_kind


DATA = SPEECH_TTS.parent


@pytest.mark.slow
def test_generalising_recipe_reaches_the_heldout_goal(tmp_path):
    """The generalisation goal: the README's 20-minute command on several sources (speech-tts pairs,
    speech-voices, noise-real; `--config general`: hop 200, PESQ, STOI and -SI-SDR loss terms at 0.6, 10
    and 0.01, a weight average at 0.999; no contrast stretching and 4 shifted passes at inference), then
    eval on voices and noise recordings that neither trained nor chose the model (the recipe's test groups:
    Czech child krb, Finnish lj, Catalan ona; minetest, wordwarvi, extremetuxracer and heroes recordings)
    and on real recorded speech mixed with those noises at 0-10 dB: PESQ-wb +0.6 and +0.2 over the Wiener
    filter, STOI +0.01, on both; the corpus's own test split no worse than +0.75 less run-to-run spread."""
    if not (DATA / "speech-voices" / "clean").is_dir() or not (DATA / "noise-real").is_dir():
        pytest.skip(f"speech-voices / noise-real not found in {DATA}")
    t0 = time.perf_counter()
    train.main(
        ["--config", "general", "--data", str(SPEECH_TTS), "--clean", str(DATA / "speech-voices" / "clean")]
        + ["--noise", str(DATA / "noise-real"), "--max_minutes", str(MINUTES), "--no_progress"]
        + ["--log_every", "100", "--runs_dir", str(tmp_path), "--run_name", "gen"]
    )
    t_train = time.perf_counter() - t0
    run = str(tmp_path / "mbsnet-speech" / "gen")
    # PCS off, 4 shifted passes, nothing of the noisy input kept: the recipe's inference settings, chosen
    # on validation (docs/results.md)
    eval.main(["--run", run, "--out", str(tmp_path / "ev")])
    sets = json.loads((tmp_path / "ev" / "metrics.json").read_text())["sets"]
    eval.main(["--run", run, "--speech", str(DATA / "speech" / "speech.wav"), "--out", str(tmp_path / "sp")])
    sets += json.loads((tmp_path / "sp" / "metrics.json").read_text())["sets"]
    for x in sets:
        _report(x["data"], t_train, x["summary"])
    split, voices, recorded = (x["summary"] for x in sets)
    for s in (voices, recorded):
        assert s["n_failed"] == 0
        assert s["delta/pesq_wb"] >= 0.60
        assert s["enhanced/pesq_wb"] >= s["classical/pesq_wb"] + 0.20
        assert s["delta/stoi"] >= 0.01
        assert s["delta/si_sdr"] > 0  # not a goal of the issue; the recipe's floor: no worse a waveform
    assert split["delta/pesq_wb"] >= 0.70
