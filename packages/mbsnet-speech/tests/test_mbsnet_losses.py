"""Each loss term against values computed by hand on tiny tensors."""

import math

import pytest
import torch
from mbsnet_speech.config import LossWeights, tiny_config
from mbsnet_speech.losses import (
    anti_wrapping,
    complex_loss,
    enhancement_loss,
    neg_si_sdr,
    phase_loss,
    stft_loss,
)
from mbsnet_speech.model import MBSNet

PI = math.pi


def test_anti_wrapping_folds_into_0_pi():
    x = torch.tensor([0.0, PI / 2, 2 * PI, -3 * PI / 2, 0.9 * PI, 2.5 * PI, -0.25 * PI])
    want = torch.tensor([0.0, PI / 2, 0.0, PI / 2, 0.9 * PI, PI / 2, 0.25 * PI])
    torch.testing.assert_close(anti_wrapping(x), want)


def test_phase_loss_by_hand():
    pha = torch.zeros(1, 2, 2)  # (B, F, T)
    # error pi/2 at (f0, t0), 2*pi (= no error) at (f1, t1), zero elsewhere
    hat = torch.tensor([[[PI / 2, 0.0], [0.0, 2 * PI]]])
    ip = (PI / 2) / 4  # the 2*pi error folds to 0
    # group delay: diff along F: [[-pi/2, 2*pi]] -> folded [pi/2, 0] -> mean pi/4
    gd = PI / 4
    # inst. frequency: diff along T: [[-pi/2], [2*pi]] -> [pi/2, 0] -> mean pi/4
    iaf = PI / 4
    torch.testing.assert_close(phase_loss(hat, pha), torch.tensor(ip + gd + iaf))


def test_complex_loss_by_hand():
    mag, pha = torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[0.0, PI / 2]]])  # spectra 1, 2i
    mag_hat, pha_hat = torch.tensor([[[1.0, 1.0]]]), torch.tensor([[[PI, PI / 2]]])  # -1, i
    # squared errors: real (-1 - 1)^2 = 4, (0 - 0)^2 = 0; imag (0 - 0)^2 = 0, (1 - 2)^2 = 1 -> mean 5/4
    torch.testing.assert_close(complex_loss(mag_hat, pha_hat, mag, pha), torch.tensor(2 * 5 / 4))


def test_stft_loss_by_hand():
    wav = torch.randn(2, 4000)
    assert float(stft_loss(wav, wav)) == pytest.approx(0.0, abs=1e-6)
    # twice the signal: spectral convergence ||2S - S|| / ||S|| = 1, log-magnitude L1 = log 2 (the
    # clamp at 1e-7 touches no bin of a random signal at these sizes)
    torch.testing.assert_close(stft_loss(2 * wav, wav), torch.tensor(1 + math.log(2)), rtol=1e-4, atol=1e-4)


def test_stft_loss_gradient_matches_a_plain_reference():
    """The same gradient for the estimate as the formula written out plainly (one STFT per signal, no
    no-grad region); none reaches the target, whose spectra are taken outside autograd. (The
    log-magnitude L1 has kinks, so a finite difference is no reference here.)"""
    g = torch.Generator().manual_seed(0)
    wav, noise = torch.randn(2, 4000, generator=g), torch.randn(2, 4000, generator=g)
    est = (wav + 0.3 * noise).requires_grad_(True)
    target = wav.clone().requires_grad_(True)
    stft_loss(est, target).backward()
    assert target.grad is None
    ref_est = est.detach().clone().requires_grad_(True)
    total = 0.0
    for n_fft, hop in ((256, 64), (512, 128), (1024, 256)):
        window = torch.hann_window(n_fft)
        m_hat, m = (
            torch.stft(x, n_fft, hop, window=window, return_complex=True).abs() for x in (ref_est, wav)
        )
        total = total + (m - m_hat).norm() / m.norm() + (m_hat.log() - m.log()).abs().mean()
    (total / 3).backward()
    torch.testing.assert_close(est.grad, ref_est.grad)


def test_neg_si_sdr_by_hand():
    ref = torch.tensor([[1.0, -1.0, 1.0, -1.0]])  # zero mean
    noise = torch.tensor([[1.0, 1.0, -1.0, -1.0]])  # zero mean, orthogonal to ref
    # est = 3 ref + noise: the projection is 3 ref (energy 36), the residual the noise (energy 4)
    torch.testing.assert_close(neg_si_sdr(3 * ref + noise, ref), torch.tensor(-10 * math.log10(36 / 4)))
    # scale- and offset-invariant: 0.5 ref + 2 scores as ref itself (a very large SI-SDR)
    assert float(neg_si_sdr(0.5 * ref + 2, ref)) < -60
    # batch mean
    two = neg_si_sdr(torch.cat([3 * ref + noise, ref + noise]), torch.cat([ref, ref]))
    torch.testing.assert_close(two, torch.tensor(-(10 * math.log10(9) + 10 * math.log10(1)) / 2))


def test_enhancement_loss_weights_and_terms():
    torch.manual_seed(0)
    model = MBSNet(tiny_config())
    noisy, clean = torch.randn(2, 1600) * 0.1, torch.randn(2, 1600) * 0.05
    w = LossWeights(mag=0.9, com=0.1, pha=0.3, time=0.2, stft=0.5, sisdr=0.01)
    loss, parts = enhancement_loss(model, (noisy, clean), w)
    assert set(parts) == {"mag", "com", "pha", "time", "stft", "sisdr"}
    want = sum(getattr(w, k) * float(v) for k, v in parts.items())
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    # each term is what its own function gives on the model's output
    with torch.no_grad():
        out = model(noisy)
        mag, pha = model.stft(clean)
    assert float(parts["mag"]) == pytest.approx(float(torch.mean((out.mag - mag) ** 2)), rel=1e-5)
    assert float(parts["time"]) == pytest.approx(float(torch.mean(torch.abs(out.wav - clean))), rel=1e-5)
    assert float(parts["sisdr"]) == pytest.approx(float(neg_si_sdr(out.wav, clean)), rel=1e-5)
    # a zero weight drops its term
    _, parts = enhancement_loss(model, (noisy, clean), LossWeights(stft=0.0, pha=0.0))
    assert set(parts) == {"mag", "com", "time"}


def test_pesq_loss_ranks_degradations_as_pesq_does_and_skips_silent_references():
    import numpy as np
    from mbsnet_speech.data import synth_speech
    from mbsnet_speech.losses import pesq_loss
    from mbsnet_speech.metrics import pesq_score

    g = torch.Generator().manual_seed(0)
    clean = torch.as_tensor(synth_speech(16000, np.random.default_rng(1)), dtype=torch.float32).unsqueeze(0)
    noise = torch.randn(1, 16000, generator=g)
    noise = noise / noise.norm() * clean.norm()  # 0 dB
    mixes = [clean + noise * 10 ** (-snr / 20) for snr in (0, 10, 20)]
    losses = [float(pesq_loss(m, clean)) for m in mixes]
    scores = [pesq_score(clean[0].numpy(), m[0].numpy()) for m in mixes]
    assert losses == sorted(losses, reverse=True) and scores == sorted(scores)  # less noise, lower loss
    assert float(pesq_loss(clean, clean)) < 0.2 * losses[-1]
    # a silent clean crop weighs nothing: the batch's loss is its other item's, with finite gradients
    deg = torch.cat([mixes[0], torch.randn(1, 16000) * 0.01]).requires_grad_()
    both = pesq_loss(deg, torch.cat([clean, torch.zeros(1, 16000)]))
    assert float(both.detach()) == pytest.approx(losses[0], rel=1e-4)
    both.backward()
    assert torch.isfinite(deg.grad).all() and float(deg.grad[1].abs().max()) == 0.0
    # an output that is exactly zero over whole frames (a zero-padded crop) still has finite gradients
    padded = mixes[0].clone()
    padded[:, 12000:] = 0
    padded.requires_grad_()
    pesq_loss(padded, clean).backward()
    assert torch.isfinite(padded.grad).all()


def test_fir_pesq_matches_torch_pesq_and_is_cheap_to_estimate():
    """The FIR filters give torch-pesq's own figures, and the term keeps the memory pre-flight quick."""
    import time

    import numpy as np
    from mbsnet_speech.data import synth_speech
    from mbsnet_speech.losses import _FirPesq
    from memfit.estimate.steps import estimate_training_step
    from memfit.step import TrainStep
    from torch_pesq import PesqLoss

    g = torch.Generator().manual_seed(0)
    clean = torch.as_tensor(np.stack([synth_speech(16000, np.random.default_rng(i)) for i in range(3)]))
    deg = clean.float() + 0.05 * torch.randn(3, 16000, generator=g)
    iir = PesqLoss(1.0, sample_rate=16000)(clean.float(), deg)
    fir = _FirPesq(1.0, sample_rate=16000)(clean.float(), deg)
    torch.testing.assert_close(fir, iir, rtol=1e-3, atol=0)
    model_step = TrainStep(
        build_model=lambda: MBSNet(tiny_config()),
        make_batch=lambda d: (torch.zeros(2, 8000), torch.zeros(2, 8000)),
        loss=lambda m, b: enhancement_loss(m, b, LossWeights(pesq=1.0))[0],
        optimizer=lambda params: torch.optim.AdamW(params),
    )
    t0 = time.perf_counter()
    assert estimate_training_step(model_step, device="cpu").peak_bytes > 0
    assert time.perf_counter() - t0 < 20  # torch-pesq's IIR loop alone took minutes under FakeTensorMode


def test_stoi_loss_follows_pystoi_and_traces_under_fake_tensors():
    """-loss is pystoi's STOI where no frame is silent (its voice-activity step then drops nothing), ranks
    speech mixes as STOI does, has finite gradients on silent and zero-padded crops, and the memory
    pre-flight traces it."""
    import numpy as np
    from mbsnet_speech.data import synth_speech
    from mbsnet_speech.losses import stoi_loss
    from mbsnet_speech.metrics import stoi_score
    from memfit.estimate.steps import estimate_training_step
    from memfit.step import TrainStep

    g = torch.Generator().manual_seed(0)
    t = torch.arange(32000) / 16000
    speech = torch.as_tensor(synth_speech(32000, np.random.default_rng(1)), dtype=torch.float32)[None]
    no_silence = 0.1 * torch.randn(1, 32000, generator=g) * (1.2 + torch.sin(2 * math.pi * 4 * t))
    for clean in (no_silence, speech):
        noise = torch.randn(1, 32000, generator=g)
        noise = noise / noise.norm() * clean.norm()  # 0 dB
        mixes = [clean + noise * 10 ** (-snr / 20) for snr in (-5, 0, 5, 10)]
        losses = [float(stoi_loss(m, clean)) for m in mixes]
        scores = [stoi_score(clean[0].numpy(), m[0].numpy()) for m in mixes]
        assert losses == sorted(losses, reverse=True) and scores == sorted(scores)  # less noise, lower
        if clean is no_silence:
            torch.testing.assert_close(torch.tensor(losses), -torch.tensor(scores), atol=5e-3, rtol=0)
        assert float(stoi_loss(clean, clean)) < -0.99
    # a silent reference and an output that is zero over whole frames keep finite gradients
    deg = torch.cat([mixes[1], torch.randn(1, 32000) * 0.01])
    deg[0, 24000:] = 0
    deg.requires_grad_()
    stoi_loss(deg, torch.cat([clean, torch.zeros(1, 32000)])).backward()
    assert torch.isfinite(deg.grad).all() and float(deg.grad[0].abs().max()) > 0
    model_step = TrainStep(
        build_model=lambda: MBSNet(tiny_config()),
        make_batch=lambda d: (torch.zeros(2, 16000), torch.zeros(2, 16000)),
        loss=lambda m, b: enhancement_loss(m, b, LossWeights(stoi=1.0))[0],
        optimizer=lambda params: torch.optim.AdamW(params),
    )
    assert estimate_training_step(model_step, device="cpu").peak_bytes > 0
