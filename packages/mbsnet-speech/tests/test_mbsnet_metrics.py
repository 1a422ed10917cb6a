import numpy as np
import pytest
from mbsnet_speech.metrics import evaluate_pairs, pesq_score, si_sdr, stoi_score, summarise


def test_pesq_reproduces_the_pesq_package_reference_exactly(speech_int16):
    ref, deg, fs = speech_int16
    assert fs == 16000
    assert pesq_score(ref, deg, fs, "wb") == 1.0832337141036987
    assert pesq_score(ref, deg, fs, "nb") == 1.6072081327438354


def test_pesq_stoi_sisdr_rank_clean_above_noisy(speech_int16):
    ref, deg, fs = speech_int16
    r = ref.astype(np.float64) / 32768
    d = deg.astype(np.float64) / 32768
    assert pesq_score(r, r, fs) > 4.5 > pesq_score(r, d, fs)
    assert stoi_score(r, r, fs) > 0.99 > stoi_score(r, d, fs)
    assert si_sdr(r, 0.5 * r) > 100  # scale invariant
    assert si_sdr(r, d) == pytest.approx(0.0, abs=2.0)  # 0 dB babble


def test_bad_inputs_raise_clear_errors():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(16000) * 0.1
    with pytest.raises(ValueError, match="silent"):
        pesq_score(np.zeros(16000), x)
    with pytest.raises(ValueError, match="too short"):
        pesq_score(x[:1000], x[:1000])
    with pytest.raises(ValueError, match="sample rate"):
        pesq_score(x, x, fs=44100)
    with pytest.raises(ValueError, match="sample rate"):
        pesq_score(x, x, fs=8000, mode="wb")
    y = x.copy()
    y[5] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        stoi_score(x, y)
    with pytest.raises(ValueError, match="mono"):
        si_sdr(np.stack([x, x]), np.stack([x, x]))


def test_batch_evaluation_records_failures_and_continues(speech_int16):
    ref, deg, fs = speech_int16
    r = ref.astype(np.float32) / 32768
    d = deg.astype(np.float32) / 32768
    nan = d.copy()
    nan[100] = np.nan
    items = [
        ("good.wav", r, d, 0.5 * r + 0.5 * d),
        ("silent.wav", np.zeros_like(r), d, d),
        ("nan.wav", r, d, nan),
        ("short.wav", r[:800], d[:800], d[:800]),
    ]
    results = evaluate_pairs(items, fs)
    assert [x.error is None for x in results] == [True, False, False, False]
    assert "silent" in results[1].error and "NaN" in results[2].error and "short" in results[3].error
    s = summarise(results)
    assert s["n_ok"] == 1 and s["n_failed"] == 3
    assert s["delta/si_sdr"] > 0  # half-way to clean is better than noisy
