"""Kernel dispatch on a faked GPU: preconditions and probes choose the kernel or the PyTorch path, say so
once, and `memfit.ops.registry.ran()` tells which path ran (the GPU job's `cuda` tests assert the real
ones)."""

import warnings

import pytest
import torch
from memfit.ops import attention as A
from memfit.ops import mamba as M
from memfit.ops import registry as probes
from memfit.ops import scan as ssm
from memfit.ops.conv import conv_layout

from tests.fake_kernels import fake_conv, fake_flash, fake_gpu, fake_scan, install


@pytest.fixture(autouse=True)
def _fresh():
    probes.reset(probes=True)
    yield
    probes.reset(probes=True)


@pytest.fixture
def gpu(monkeypatch):
    """CPU tensors treated as CUDA tensors of an sm80 GPU; tests set the kernels they fake."""
    fake_gpu(monkeypatch)
    return monkeypatch


def warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if "memfit:" in str(w.message)]


# ----------------------------------------------------------------------------------------------------
# flash-attn
# ----------------------------------------------------------------------------------------------------


def qkv(dtype=torch.bfloat16, d=32, L=48):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 2, L, d, generator=g).to(dtype) for _ in range(3)]


def test_flash_runs_when_installed_probed_and_preconditions_hold(gpu):
    install(gpu, "flash", fake_flash)
    q, k, v = qkv()
    out, said = warnings_of(lambda: A.attention(q, k, v, window=8))
    assert said == []
    assert probes.ran("attention") == {"flash": 1}
    torch.testing.assert_close(out.float(), A.attention_ref(q, k, v, window=8).float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize(
    ("cap", "dtype", "d", "why"),
    [
        ((7, 5), torch.float16, 32, "compute capability 7.5 < 8.0"),  # a T4
        ((7, 0), torch.bfloat16, 32, "compute capability 7.0 < 8.0"),  # a V100
        ((8, 0), torch.float32, 32, "torch.float32"),
        ((9, 0), torch.bfloat16, 320, "head dim 320"),
    ],
)
def test_flash_preconditions_choose_the_timed_paths_and_say_so_once(gpu, cap, dtype, d, why):
    install(gpu, "flash", fake_flash)
    gpu.setattr(probes, "capability", lambda device: cap)
    q, k, v = qkv(dtype, d)
    paths, said = warnings_of(lambda: [A.select_backend(q, k, v, window=8) for _ in range(3)])
    assert len(paths) == 3 and all(probes.record_of("attention", p).timed for p in paths), paths
    assert len(said) == 1 and why in said[0] and "flash (attention) not used" in said[0], said
    assert sum(probes.fallbacks().values()) == 3


def test_forced_flash_refuses_what_it_cannot_run(gpu):
    install(gpu, "flash", fake_flash)
    gpu.setattr(probes, "capability", lambda device: (7, 5))
    q, k, v = qkv()
    with pytest.raises(ValueError, match="compute capability 7.5"):
        A.attention(q, k, v, window=8, backend="flash")


def test_a_flash_that_computes_something_else_fails_its_probe(gpu):
    install(gpu, "flash", lambda q, k, v, **kw: fake_flash(q, k, v, **kw) * 1.5)
    q, k, v = qkv()
    paths, said = warnings_of(lambda: [A.select_backend(q, k, v, window=8) for _ in range(2)])
    assert len(paths) == 2 and all(probes.record_of("attention", p).timed for p in paths), paths
    assert len(said) == 1 and "probe" in said[0] and "differs from the PyTorch path" in said[0]


def test_no_gpu_no_flash(monkeypatch):
    install(monkeypatch, "flash", fake_flash)
    q, k, v = qkv()
    assert A.select_backend(q, k, v, window=8) in ("blocks", "band")


# ----------------------------------------------------------------------------------------------------
# Mamba block: causal-conv1d and mamba_ssm's scan
# ----------------------------------------------------------------------------------------------------


def block(d_model=16, d_conv=4, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    m = M.Mamba(M.MambaConfig(d_model=d_model, d_state=8, d_conv=d_conv, **kw)).to(dtype)
    x = torch.randn(2, 24, d_model, dtype=dtype, requires_grad=True)
    return m, x


def run_block(m, x):
    y = m(x)
    y.sum().backward()
    return y, x.grad


def test_mamba_block_runs_both_kernels_and_matches_the_pytorch_path(gpu):
    install(gpu, "mamba_ssm", fake_scan)
    install(gpu, "causal_conv1d", fake_conv)
    m, x = block()
    (y, gx), said = warnings_of(lambda: run_block(m, x))
    assert said == []
    assert probes.ran() == {("conv", "causal_conv1d"): 1, ("scan", "mamba_ssm"): 1}
    m.config.use_kernels = False
    x2 = x.detach().requires_grad_(True)
    y2, gx2 = run_block(m, x2)
    torch.testing.assert_close(y, y2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, gx2, atol=1e-5, rtol=1e-5)


def test_conv_kernel_gets_the_layout_it_needs(gpu):
    seen = []

    def conv(x, weight, bias=None, activation=None):
        seen.append(x.stride())
        return fake_conv(x, weight, bias, activation)

    install(gpu, "causal_conv1d", conv)
    m, x = block(d_model=12)  # 24 channels: the in_proj half is channels-last with odd-multiple strides
    run_block(m, x)
    assert probes.ran("conv") == {"causal_conv1d": 1}
    # the block's channels-last view (strides (24*48, 1, 48)) is fine as it is
    assert seen[-1][1] == 1 and seen[-1][0] % 8 == 0 and seen[-1][2] % 8 == 0
    x = torch.randn(2, 10, 27)[..., :24].transpose(1, 2)  # channels-last, strides not multiples of 8
    y = conv_layout(x)
    assert y.stride(1) == 1 and y.stride(0) % 8 == 0 and y.stride(2) % 8 == 0 and torch.equal(x, y)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"d_conv": 5}, "width 5"),
        ({"d_conv": 1}, "width 1"),
        ({"d_model": 6}, "12 channels in channels-last layout"),
        ({"dtype": torch.float64}, "torch.float64"),
    ],
)
def test_conv_preconditions_choose_the_pytorch_path_and_say_so_once(gpu, kw, why):
    install(gpu, "causal_conv1d", fake_conv)
    m, x = block(**kw)
    _, said = warnings_of(lambda: [run_block(m, x) for _ in range(2)])
    assert probes.ran("conv") == {"torch": 2}
    assert len(said) == 1 and why in said[0] and "causal_conv1d (conv) not used" in said[0], said


def test_scan_preconditions_choose_the_pytorch_path(gpu):
    install(gpu, "mamba_ssm", fake_scan)
    m, x = block(dtype=torch.float64)
    _, said = warnings_of(lambda: run_block(m, x))
    assert probes.ran("scan") == {"torch": 1}
    assert len(said) == 1 and "torch.float64" in said[0] and "mamba_ssm (scan) not used" in said[0]


def scan_args(requires_grad=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    b, d, L, N = 2, 8, 20, 4
    u, delta = torch.randn(b, d, L, generator=g, dtype=dtype), torch.rand(b, d, L, generator=g, dtype=dtype)
    A_ = -torch.rand(d, N, generator=g) - 0.5
    B, C = torch.randn(b, N, L, generator=g, dtype=dtype), torch.randn(b, N, L, generator=g, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (u, delta, A_, B, C)]


def test_last_state_gradient_takes_the_path_that_propagates_it(gpu):
    install(gpu, "mamba_ssm", fake_scan)
    u, delta, A_, B, C = scan_args()
    (out, last), said = warnings_of(lambda: ssm.selective_scan(u, delta, A_, B, C, return_last_state=True))
    assert probes.ran("scan") == {"torch": 1}
    assert len(said) == 1 and "last state needs a gradient" in said[0]
    (out.sum() + last.sum()).backward()
    u2, delta2, A2, B2, C2 = (t.detach().requires_grad_(True) for t in (u, delta, A_, B, C))
    o2, l2 = ssm.selective_scan_ref(u2, delta2, A2, B2, C2, return_last_state=True)
    (o2.sum() + l2.sum()).backward()
    torch.testing.assert_close(u.grad, u2.grad, atol=1e-4, rtol=1e-4)
    # without a gradient to carry (inference, or only `out` differentiated), the kernel runs
    probes.reset()
    with torch.no_grad():
        ssm.selective_scan(u, delta, A_, B, C, return_last_state=True)
    ssm.selective_scan(u, delta, A_, B, C)
    assert probes.ran("scan") == {"mamba_ssm": 2}


def test_scan_mixed_dtypes_fall_back(gpu):
    install(gpu, "mamba_ssm", fake_scan)
    u, delta, A_, B, C = scan_args(requires_grad=False)
    _, said = warnings_of(lambda: ssm.selective_scan(u, delta.bfloat16(), A_, B, C))
    assert probes.ran("scan") == {"torch": 1} and "delta is torch.bfloat16" in said[0]


def test_a_mamba_ssm_without_its_compiled_kernel_is_unusable(gpu):
    # mamba_ssm after 2.3.2 imports without selective_scan_cuda and raises at the first call
    def no_kernel(*args, **kwargs):
        raise RuntimeError("selective_scan_cuda is not installed. To use Mamba-1, reinstall with: ...")

    install(gpu, "mamba_ssm", no_kernel)
    u, delta, A_, B, C = scan_args()
    _, said = warnings_of(lambda: [ssm.selective_scan(u, delta, A_, B, C) for _ in range(3)])
    assert probes.ran("scan") == {"torch": 3}
    assert len(said) == 1 and "RuntimeError: selective_scan_cuda is not installed" in said[0]
    res = probes.probe(probes.record_of("scan", "mamba_ssm"), "cpu")
    assert not res.ok


def test_probes_are_cached_and_leave_the_rng_alone(gpu):
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return fake_scan(*args, **kwargs)

    install(gpu, "mamba_ssm", counting)
    u, delta, A_, B, C = scan_args(requires_grad=False)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    for _ in range(3):
        ssm.selective_scan(u, delta, A_, B, C)
    assert torch.equal(torch.get_rng_state(), before)
    assert len(calls) == 1 + 3  # one probe call, then the three real ones


@pytest.mark.parametrize("kernel", ["mamba_ssm", "triton"])
def test_a_first_call_inside_activation_checkpointing_probes_apart(gpu, kernel):
    """A model's first scan often runs inside activation checkpointing (mbsnet's GPU recipe): the kernel's
    probe runs then, with its own graph. Given the checkpoint's, its backward would recompute the block in
    the middle of its forward (the probe fails), and the recomputation, probe cached, would save fewer
    tensors than the forward did (CheckpointError)."""
    from memfit.ops.layers import checkpointed

    install(gpu, kernel, fake_scan if kernel == "mamba_ssm" else lambda *a, chunk_size: fake_scan(*a))
    m, x = block()
    (y, gx), said = warnings_of(lambda: run_block(lambda t: checkpointed(m, t, enabled=True), x))
    assert said == []  # the probe passed: no warning, no fallback
    assert probes.ran("scan") == {kernel: 2}  # the forward and its recomputation
    x2 = x.detach().requires_grad_(True)
    y2, gx2 = run_block(m, x2)
    torch.testing.assert_close(y, y2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, gx2, atol=1e-5, rtol=1e-5)


def test_no_kernels_installed_is_quiet(gpu):
    m, x = block()
    _, said = warnings_of(lambda: run_block(m, x))
    assert said == []
    assert probes.ran() == {("conv", "torch"): 1, ("scan", "torch"): 1}


def test_cpu_never_takes_a_cuda_implementation(monkeypatch):
    for name in ("mamba_ssm", "causal_conv1d", "flash"):
        install(
            monkeypatch, name, {"mamba_ssm": fake_scan, "causal_conv1d": fake_conv, "flash": fake_flash}[name]
        )
    m, x = block()
    run_block(m, x)
    q, k, v = qkv()
    A.attention(q, k, v, window=8)
    cpu = {r.name for r in probes.RECORDS if r.device in ("cpu", "any")}
    assert {path for (_, path) in probes.ran()} <= cpu
