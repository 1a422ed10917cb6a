import math

import pytest
import torch
from mbsnet_speech.baselines import SeedMamba, materialising_scan
from mbsnet_speech.config import band_widths, default_config, seed_config, tiny_config
from mbsnet_speech.model import BandSplit, MBSNet, count_params, overlap_add_istft

pytest.importorskip(
    "memfit.ops.mamba", reason="memfit.ops.mamba (the chunked Mamba block) is not installed yet"
)


def test_default_config_has_2_4_to_2_8_million_params_and_seed_is_bloated():
    n = count_params(MBSNet(default_config()))
    assert 2.4e6 <= n <= 2.8e6, n
    seed = count_params(MBSNet(seed_config()))
    assert abs(seed - 7.33e6) < 0.05e6, seed  # the seed's reported 7.33M


def test_band_split_covers_every_bin_once():
    for n_bins, k in ((257, 30), (257, 12), (129, 8), (257, 1)):
        w = band_widths(n_bins, k)
        assert len(w) == k and sum(w) == n_bins and min(w) >= 1
    assert band_widths(257, 30)[:10] == [3] * 10  # fine resolution at low frequencies
    for growth in (1.0, 4.0, 16.0):  # geometric widths, the last about `growth` times the first
        w = band_widths(257, 12, growth)
        assert sum(w) == 257 and min(w) >= 1 and growth / 1.5 <= w[-1] / w[0] <= growth * 1.5, (growth, w)
    with pytest.raises(ValueError, match="band_growth must be > 0"):
        tiny_config(band_growth=0.0)


def test_band_energy_gives_the_encoder_the_level_the_layernorm_removes():
    torch.manual_seed(0)
    widths = band_widths(257, 12)
    x = torch.randn(1, 257, 5, 2)
    louder = x.clone()
    louder[:, :, 2] *= 10  # frame 2 ten times louder, same spectral shape
    plain, energy = BandSplit(widths, 8), BandSplit(widths, 8, energy=True)
    torch.testing.assert_close(plain(louder), plain(x), rtol=1e-4, atol=1e-4)  # the level is lost
    a, b = energy(x), energy(louder)
    frames_differ = (a - b).abs().amax(dim=(0, 1, 3))
    assert frames_differ[2] > 1e-2 and frames_differ[[0, 1, 3, 4]].max() < 1e-5  # only frame 2, per frame


def test_forward_shapes_and_gradients():
    torch.manual_seed(0)
    m = MBSNet(tiny_config())
    x = 0.1 * torch.randn(2, 8000)
    out = m(x)
    assert out.wav.shape == x.shape and out.mag.shape == out.pha.shape == (2, 257, 81)
    out.wav.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    with pytest.raises(ValueError, match="shorter than one STFT window"):
        m(torch.randn(1, 100))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        m(torch.randn(8000))


def test_overlap_add_istft_matches_torch_istft():
    cfg = tiny_config()
    win = torch.hann_window(cfg.win)
    x = torch.randn(2, 5037, dtype=torch.float64)
    spec = torch.stft(x, cfg.n_fft, cfg.hop, cfg.win, win.double(), center=True, return_complex=True)
    ref = torch.istft(spec, cfg.n_fft, cfg.hop, cfg.win, win.double(), center=True, length=5037)
    ours = overlap_add_istft(spec, cfg, win.double(), 5037)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours, x)


def _perturb_after(t0, mag, pha):
    g = torch.Generator().manual_seed(1)
    mag2, pha2 = mag.clone(), pha.clone()
    mag2[..., t0:] = torch.rand(mag[..., t0:].shape, generator=g)
    pha2[..., t0:] = (torch.rand(pha[..., t0:].shape, generator=g) * 2 - 1) * math.pi
    return mag2, pha2


@pytest.mark.parametrize("scan", ["chunked", "materialise"])
def test_unidirectional_model_is_causal_in_frames(scan):
    """Mask and phase of frame t depend on input frames <= t only (streamable)."""
    torch.manual_seed(0)
    m = MBSNet(tiny_config(scan=scan)).eval()
    mag = torch.rand(2, 257, 40)
    pha = (torch.rand(2, 257, 40) * 2 - 1) * math.pi
    t0 = 23
    with torch.no_grad():
        mask, dpha = m.spec_forward(mag, pha)
        mask2, dpha2 = m.spec_forward(*_perturb_after(t0, mag, pha))
    torch.testing.assert_close(mask2[..., :t0], mask[..., :t0], rtol=0, atol=1e-6)
    torch.testing.assert_close(dpha2[..., :t0], dpha[..., :t0], rtol=0, atol=1e-6)
    assert (mask2[..., t0:] - mask[..., t0:]).abs().max() > 1e-3  # the future frames themselves do change


def test_bidirectional_temporal_mamba_sees_the_future():
    torch.manual_seed(0)
    m = MBSNet(tiny_config(temporal_bidirectional=True)).eval()
    mag, pha = torch.rand(1, 257, 30), torch.zeros(1, 257, 30)
    with torch.no_grad():
        mask = m.spec_forward(mag, pha)[0]
        mask2 = m.spec_forward(*_perturb_after(20, mag, pha))[0]
    assert (mask2[..., :20] - mask[..., :20]).abs().max() > 1e-4


def test_seed_materialising_scan_matches_memfit_reference_scan():
    from memfit.ops.scan import selective_scan, selective_scan_ref

    torch.manual_seed(0)
    b, L, d, n = 2, 37, 6, 4
    u, dt = torch.randn(b, L, d, dtype=torch.float64), torch.rand(b, L, d, dtype=torch.float64)
    A = -torch.rand(d, n, dtype=torch.float64)
    B, C = torch.randn(b, L, n, dtype=torch.float64), torch.randn(b, L, n, dtype=torch.float64)
    D = torch.randn(d, dtype=torch.float64)
    ours = materialising_scan(u, dt, A, B, C, D)
    args = (u.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D)
    torch.testing.assert_close(ours, selective_scan_ref(*args).transpose(1, 2))
    torch.testing.assert_close(ours, selective_scan(*args).transpose(1, 2))


def test_seed_mamba_has_mamba1_parameter_count():
    m = SeedMamba(128, d_state=16, d_conv=4, expand=2.0)
    d_inner, dt_rank = 256, 8
    assert count_params(m) == d_inner * (3 * 128 + 2 * dt_rank + 3 * 16 + 4 + 3)


def test_pcs_stretches_speech_band_at_inference_only():
    torch.manual_seed(0)
    cfg = tiny_config()
    plain, pcs = MBSNet(cfg).eval(), MBSNet(tiny_config(pcs=True)).eval()
    pcs.load_state_dict(plain.state_dict())
    x = 0.3 * torch.randn(1, 8000)
    with torch.no_grad():
        a, b = plain(x), pcs(x)
    ratio = (b.mag / a.mag)[0].mean(-1)
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(1.0)  # DC and Nyquist untouched
    assert ratio[32:100].min() > 1.0  # 1-3 kHz bins stretched
    pcs.train()
    torch.testing.assert_close(pcs(x).wav, plain.train()(x).wav)


def test_keep_noisy_mixes_the_input_back_at_inference_only():
    torch.manual_seed(0)
    x = 0.1 * torch.randn(2, 4000)
    plain = MBSNet(tiny_config()).eval()
    kept = MBSNet(tiny_config(keep_noisy=0.25)).eval()
    kept.load_state_dict(plain.state_dict())
    with torch.no_grad():
        y0, y1 = plain(x).wav, kept(x).wav
    torch.testing.assert_close(y1, 0.75 * y0 + 0.25 * x)
    kept.train()
    torch.testing.assert_close(kept(x).wav.detach(), plain.train()(x).wav.detach())  # training: no mix
    with pytest.raises(ValueError, match="keep_noisy"):
        tiny_config(keep_noisy=1.5)


def test_shifts_average_passes_over_delayed_inputs_at_inference_only():
    """shifts=N: the mean of the plain pass and N-1 passes over the input delayed by k * hop / N samples
    (zeros in front, the output moved back), each computed here on its own; training runs one pass."""
    torch.manual_seed(0)
    x = 0.1 * torch.randn(2, 4000)
    plain = MBSNet(tiny_config()).eval()
    hop = plain.cfg.hop
    avg = MBSNet(tiny_config(shifts=4)).eval()
    avg.load_state_dict(plain.state_dict())
    with torch.no_grad():
        want = plain(x).wav
        for k in (1, 2, 3):
            d = k * hop // 4
            want = want + plain(torch.nn.functional.pad(x, (d, 3 * hop // 4 - d))).wav[:, d : d + 4000]
        got = avg(x)
    torch.testing.assert_close(got.wav, want / 4, atol=1e-6, rtol=1e-5)
    assert got.wav.shape == x.shape and got.mag.shape == plain(x).mag.shape
    avg.train()
    torch.testing.assert_close(avg(x).wav.detach(), plain.train()(x).wav.detach())  # training: one pass
    for bad in (0, hop + 1):
        with pytest.raises(ValueError, match="shifts must be in 1..hop"):
            tiny_config(shifts=bad)


@pytest.mark.parametrize("shifts", [2, 3, 7])  # 3 and 7: delays that do not divide the hop evenly
def test_shifted_passes_of_an_identity_model_give_the_input_back(shifts, monkeypatch):
    """A model whose mask is 1 and phase offset 0 reconstructs its input in every pass; the average of the
    shifted passes equals the input only if each one is moved back by exactly its delay."""
    model = MBSNet(tiny_config(shifts=shifts)).eval()

    def identity(mag, pha):
        return torch.ones_like(mag), torch.zeros_like(pha)

    monkeypatch.setattr(model, "spec_forward", identity)
    x = 0.1 * torch.randn(2, 3000)
    with torch.no_grad():
        y = model(x).wav
    inner = slice(model.cfg.win, -model.cfg.win)  # away from the edges, where zeros were padded in
    torch.testing.assert_close(y[:, inner], x[:, inner], atol=1e-4, rtol=0)
