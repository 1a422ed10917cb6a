"""Mamba / BiMamba: parameter count, causality, kwargs, and the chunked scan against the reference."""

from __future__ import annotations

import memfit.ops.scan
import pytest
import torch
import torch.nn.functional as F
from memfit.estimate.steps import estimate_training_step, measure_training_step
from memfit.ops.mamba import BiMamba, Mamba, MambaConfig
from memfit.step import TrainStep


def formula(cfg: MambaConfig) -> int:
    return cfg.d_inner * (3 * cfg.d_model + 2 * cfg.rank + 3 * cfg.d_state + cfg.d_conv + 3)


@pytest.mark.parametrize(
    "cfg",
    [
        MambaConfig(64),
        MambaConfig(96, d_state=8, d_conv=3, expand=3),
        MambaConfig(130, dt_rank=5),
        MambaConfig(128, expand=1.5),
    ],
)
def test_parameter_count_matches_formula(cfg):
    assert sum(p.numel() for p in Mamba(cfg).parameters()) == formula(cfg)
    assert cfg.rank == (5 if cfg.dt_rank == 5 else -(-cfg.d_model // 16))


def test_init_matches_mamba():
    cfg = MambaConfig(32, d_state=6, dt_min=0.002, dt_max=0.05)
    m = Mamba(cfg)
    torch.testing.assert_close(-torch.exp(m.A_log), -torch.arange(1, 7.0).repeat(cfg.d_inner, 1))
    dt = F.softplus(m.dt_proj.bias)
    assert dt.min() >= 0.002 * 0.999 and dt.max() <= 0.05 * 1.001
    assert torch.all(m.D == 1)


@pytest.mark.parametrize("make", [lambda c: Mamba(c), lambda c: BiMamba(c), lambda c: BiMamba(c, "concat")])
def test_shapes(make):
    x = torch.randn(3, 17, 24)
    assert make(MambaConfig(24, d_state=4)).eval()(x).shape == x.shape


def test_mamba_is_causal():
    torch.manual_seed(0)
    m = Mamba(MambaConfig(16, d_state=4, chunk_size=5))
    x = torch.randn(2, 23, 16, requires_grad=True)
    t = 11
    y = m(x)
    x2 = x.detach().clone()
    x2[:, t + 1 :] += torch.randn_like(x2[:, t + 1 :])
    y2 = m(x2)
    torch.testing.assert_close(y2[:, : t + 1], y[:, : t + 1].detach(), rtol=0, atol=1e-6)
    assert (y2[:, t + 1 :] - y[:, t + 1 :]).abs().max() > 1e-3  # the future does change later outputs
    (g,) = torch.autograd.grad(y[:, t].sum(), x)
    assert torch.all(g[:, t + 1 :] == 0)
    assert g[:, : t + 1].abs().sum() > 0


def test_bimamba_is_not_causal():
    torch.manual_seed(0)
    m = BiMamba(MambaConfig(16, d_state=4))
    x = torch.randn(2, 23, 16, requires_grad=True)
    (g,) = torch.autograd.grad(m(x)[:, 5].sum(), x)
    assert g[:, 6:].abs().sum() > 0 and g[:, :5].abs().sum() > 0


@pytest.mark.parametrize("combine", ["sum", "concat"])
def test_bimamba_passes_keywords_to_both_directions(combine):
    m = BiMamba(MambaConfig(8, d_state=4), combine=combine)
    seen = []
    for d in (m.fwd, m.bwd):
        d.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)
    y = m(torch.randn(2, 9, 8), inference_params=None, extra=1)
    assert y.shape == (2, 9, 8)
    assert seen == [["extra", "inference_params"]] * 2


def test_bimamba_combines_directions():
    torch.manual_seed(0)
    m = BiMamba(MambaConfig(8, d_state=4), combine="sum")
    x = torch.randn(2, 9, 8)
    torch.testing.assert_close(m(x), m.fwd(x) + m.bwd(x.flip(1)).flip(1))


def test_mamba_with_chunked_scan_equals_reference_scan(monkeypatch):
    torch.manual_seed(0)
    m = Mamba(MambaConfig(16, d_state=8, chunk_size=4)).double()
    x = torch.randn(2, 19, 16, dtype=torch.float64)

    def loss_and_grads():
        m.zero_grad()
        y = m(x)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    y, grads = loss_and_grads()

    def ref(*args, chunk_size=None, use_kernels=True, **kw):
        return memfit.ops.scan.selective_scan_ref(*args, **kw)

    monkeypatch.setattr(memfit.ops.scan, "selective_scan", ref)
    y_ref, grads_ref = loss_and_grads()
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-12)
    for n in grads:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=1e-9, atol=1e-12, msg=n)


def test_memory_estimate_matches_measured_peak():
    """The training-step estimate (fake tensors) of a small Mamba stack equals the measured CPU peak, on
    the fused CPU kernels' path (the default) and on the torch-op path, and the fused path needs less."""

    def step(use_kernels):
        def build():
            cfg = MambaConfig(32, d_state=8, chunk_size=16, use_kernels=use_kernels)
            return torch.nn.Sequential(*[Mamba(cfg) for _ in range(2)])

        return TrainStep(
            build_model=build,
            make_batch=lambda device: torch.randn(4, 100, 32, device=device),
            loss=lambda model, x: model(x).square().mean(),
            amp_dtype=None,
        )

    peaks = {}
    for kernels in (True, False):
        est, meas = estimate_training_step(step(kernels)), measure_training_step(step(kernels))
        assert abs(est.peak_bytes / meas.peak_bytes - 1) < 0.15, (kernels, est.peak_mib, meas.peak_mib)
        peaks[kernels] = meas.peak_bytes
    assert peaks[True] <= peaks[False]


def test_bad_config():
    with pytest.raises(ValueError, match="d_model"):
        MambaConfig(0)
    with pytest.raises(ValueError, match="combine"):
        BiMamba(MambaConfig(8), combine="mean")
    with pytest.raises(ValueError, match="d_model=8"):
        Mamba(MambaConfig(8))(torch.randn(2, 5, 9))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_cpu_conv_matches_torch_conv(dtype):
    """The block's depthwise causal conv + SiLU in C (memfit/cpu_kernel.c) against torch's conv1d:
    output and the gradients of input, weight and bias, on the strided input a Mamba block passes, with
    1 and 3 threads (per-thread weight-gradient accumulators summed)."""
    from memfit.ops import cpu_kernel as _scan_kernel
    from memfit.ops.conv import conv_silu

    if _scan_kernel.library() is None:
        pytest.skip("no C compiler: the fused CPU kernels are not built")
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            g = torch.Generator().manual_seed(n)
            xz = torch.randn(3, 11, 12, dtype=dtype, generator=g).requires_grad_()
            x = xz.transpose(1, 2)[:, :6]  # (batch, d, L) view of a (batch, L, 2d) projection
            w = torch.randn(6, 1, 4, dtype=dtype, generator=g).requires_grad_()
            b = torch.randn(6, dtype=dtype, generator=g).requires_grad_()
            ref = F.silu(F.conv1d(x, w, b, padding=3, groups=6)[..., :11])
            gy = torch.randn(ref.shape, dtype=dtype, generator=g)
            out = conv_silu(x, w, b)
            torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
            ours, theirs = (torch.autograd.grad(y, (xz, w, b), gy) for y in (out, ref))
            for a, r in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a, r, rtol=tol, atol=tol * r.abs().max().item())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mamba_block_runs_the_scan_kernels_lane_path(monkeypatch, dtype):
    """The layout a Mamba block passes its scan (channel-stride-1 u, delta, z and output gradient, per-step
    B/C shared by all channels) must reach the kernel's channel-lane path in both directions, a d_inner
    that is not a multiple of the lane count included: a layout change upstream must not silently send
    it back to the slower sequence path."""
    from memfit.ops import cpu_kernel as _scan_kernel

    if _scan_kernel.library() is None:
        pytest.skip("no C compiler: the fused CPU kernels are not built")
    calls, orig = [], _scan_kernel.call
    record = lambda name, a: calls.append((name, getattr(a, "lanes", None))) or orig(name, a)  # noqa: E731
    monkeypatch.setattr(_scan_kernel, "call", record)
    torch.manual_seed(0)
    m = Mamba(MambaConfig(20, d_state=8, expand=1.5)).to(dtype)  # d_inner 30
    m(torch.randn(2, 21, 20, dtype=dtype)).square().mean().backward()
    sfx = "f64" if dtype == torch.float64 else "f32"
    assert [c for c in calls if c[0].startswith("scan")] == [(f"scan_fwd_{sfx}", 1), (f"scan_bwd_{sfx}", 1)]


def test_bf16_autocast_runs_the_fused_kernels_and_matches_the_torch_ops(monkeypatch):
    """Under CPU bf16 autocast (the paper recipes' default) the Linear layers run bf16 and the conv and the
    scan take the fused fp32 kernels, the scan on its lane path (before, autocast sent the block to
    torch's conv and the scan's sequence path: 1.6x the step time). Output and gradients agree with the
    torch-op path under the same autocast to bf16 accuracy."""
    from memfit.ops import cpu_kernel as _scan_kernel

    if _scan_kernel.library() is None:
        pytest.skip("no C compiler: the fused CPU kernels are not built")
    calls, orig = [], _scan_kernel.call
    record = lambda name, a: calls.append((name, getattr(a, "lanes", None))) or orig(name, a)  # noqa: E731
    monkeypatch.setattr(_scan_kernel, "call", record)

    def run(use_kernels):
        torch.manual_seed(0)
        m = Mamba(MambaConfig(32, d_state=16, expand=1.5, use_kernels=use_kernels))
        x = torch.randn(3, 40, 32, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        assert y.dtype == torch.bfloat16
        y.float().square().mean().backward()
        return y.float(), x.grad, {n: p.grad for n, p in m.named_parameters()}

    y, gx, grads = run(True)
    names = [c[0] for c in calls]
    assert names == ["conv_fwd_f32", "scan_fwd_f32", "scan_bwd_f32", "conv_bwd_f32"], names
    assert [c[1] for c in calls if c[0].startswith("scan")] == [1, 1]  # the lane path, both directions
    calls.clear()
    y_ref, gx_ref, grads_ref = run(False)
    assert calls == []
    torch.testing.assert_close(y, y_ref, rtol=0.02, atol=0.02 * y_ref.abs().max().item())
    torch.testing.assert_close(gx, gx_ref, rtol=0.05, atol=0.05 * gx_ref.abs().max().item())
    for n, g in grads.items():
        atol = 0.05 * grads_ref[n].abs().max().item()
        torch.testing.assert_close(g, grads_ref[n], rtol=0.05, atol=atol, msg=n)


def test_torch_compile_of_a_mamba_block_runs_the_fused_kernels():
    """torch.compile traces a Mamba block on CPU through the fused kernels' torch ops (memfit::conv_fwd,
    memfit::scan_fwd and their backwards: a ctypes call would end the graph): the ops are in the graph
    dynamo captures, the kernels run in the compiled step, and output and gradients equal eager's (every
    parameter's: a forward returning ``y.to(same dtype)`` once made every gradient below out_proj zero)."""
    from memfit.ops import cpu_kernel as _scan_kernel

    if _scan_kernel.library() is None:
        pytest.skip("no C compiler: the fused CPU kernels are not built")
    torch.manual_seed(0)
    m = Mamba(MambaConfig(16, d_state=8, expand=2))
    x = torch.randn(2, 12, 16)

    def step(fn):
        xg = x.clone().requires_grad_()
        m.zero_grad()
        y = fn(xg)
        y.square().mean().backward()
        return y.detach(), xg.grad, {n: p.grad.clone() for n, p in m.named_parameters()}

    graphs, calls = [], []

    def backend(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    eager = step(m)
    torch._dynamo.reset()
    orig = _scan_kernel.call
    try:
        _scan_kernel.call = lambda name, a: calls.append(name) or orig(name, a)
        compiled = step(torch.compile(m, backend=backend, fullgraph=True))
    finally:
        _scan_kernel.call = orig
        torch._dynamo.reset()
    assert len(graphs) == 1 and "memfit.scan_fwd" in graphs[0] and "memfit.conv_fwd" in graphs[0]
    assert calls == ["conv_fwd_f32", "scan_fwd_f32", "scan_bwd_f32", "conv_bwd_f32"]
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-6, atol=1e-7)
    assert compiled[2].keys() == eager[2].keys()
    for name, g in eager[2].items():
        assert g.abs().max() > 0, name
        same = torch.allclose(compiled[2][name], g, rtol=1e-6, atol=1e-7)
        assert same, f"{name}: compiled {compiled[2][name].abs().max()} vs eager {g.abs().max()}"


def test_an_estimate_does_not_wait_for_the_kernel_build(tmp_path, monkeypatch, capsys):
    """A memory estimate takes the fused kernel's fake ops without building it (the first `train` pre-flight
    on a machine stays fast); the lane count it sizes buffers by is the one the built kernel reports, and
    the estimate is the same before and after the build."""
    from memfit.ops import cpu_kernel as K

    if not K.available():
        pytest.skip("no C compiler: the fused kernel is not used here")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    K.library.cache_clear()
    try:

        def step():
            cfg = MambaConfig(32, d_state=8, chunk_size=16)
            return TrainStep(
                build_model=lambda: Mamba(cfg),
                make_batch=lambda device: torch.randn(4, 100, 32, device=device),
                loss=lambda model, x: model(x).square().mean(),
                amp_dtype=None,
            )

        before = estimate_training_step(step()).peak_bytes
        assert not list(tmp_path.iterdir()) and K.library.cache_info().currsize == 0  # nothing built
        capsys.readouterr()
        assert K.library() is not None and list(
            tmp_path.glob("scan_kernel-*.so")
        )  # the first real use builds, and says where the kernel is kept
        assert f"[memfit] building the fused CPU kernel once into {tmp_path}" in capsys.readouterr().err
        assert all(K.lanes(s) == K._predefined_lanes(s) for s in ("f32", "f64"))
        assert estimate_training_step(step()).peak_bytes == before
    finally:
        K.library.cache_clear()
