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
