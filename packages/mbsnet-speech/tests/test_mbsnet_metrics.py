import numpy as np
import pytest
import torch
from mbsnet_speech.data import make_noise, mix, synth_speech
from mbsnet_speech.losses import neg_si_sdr
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


def _si_sdr_by_hand(est: torch.Tensor, ref: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula mbsnet computed itself before it used torchmetrics' (eps 1e-12 scoring, 1e-8 loss)."""
    est = est - est.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    target = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + eps) * ref
    return 10 * torch.log10(target.pow(2).sum(-1) / ((est - target).pow(2).sum(-1) + eps) + eps)


def test_si_sdr_is_the_formula_it_replaced():
    """torchmetrics' SI-SDR (zero mean) scores and trains as the hand-written one did: the same dB to
    1e-6 dB in float64 (eval's scores) and to float32 rounding in the loss, from -20 to +40 dB."""
    rng = np.random.default_rng(0)
    n = 16000
    clean = np.stack([synth_speech(n, rng) for _ in range(6)])
    noise = np.stack([make_noise(k, n, rng) for k in ("white", "pink", "babble", "brown", "hum", "white")])
    noisy = np.stack([mix(c, z, snr) for c, z, snr in zip(clean, noise, (-20, -5, 0, 10, 25, 40))])
    noisy[5] = 0.3 * noisy[5] + 0.1  # scale and offset: invariant
    for c, d in zip(clean, noisy):
        e64, r64 = (torch.from_numpy(x.astype(np.float64)) for x in (d, c))
        old = float(_si_sdr_by_hand(e64, r64, 1e-12))
        assert si_sdr(c, d) == pytest.approx(old, abs=1e-6)
    est, ref = torch.from_numpy(noisy).float(), torch.from_numpy(clean).float()
    torch.testing.assert_close(
        neg_si_sdr(est, ref), -_si_sdr_by_hand(est, ref, 1e-8).mean(), rtol=1e-5, atol=1e-4
    )
