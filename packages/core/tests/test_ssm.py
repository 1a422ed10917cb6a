"""selective_scan (chunked, recomputing) against selective_scan_ref (plain, materialising)."""

from __future__ import annotations

import itertools

import pytest
import torch
from memfit.estimate.steps import measure_peak
from memfit.ops.scan import auto_chunk_size, selective_scan, selective_scan_ref

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def make_inputs(
    batch=2,
    dim=6,
    L=13,
    N=4,
    layout="step",
    c_layout=None,
    groups=2,
    dtype=torch.float64,
    seed=0,
    channels_last=False,
):
    """Scan inputs; ``channels_last``: u, delta and z are (batch, dim, L) views of (batch, L, dim)
    tensors (channel stride 1), as a Mamba block passes them."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        if channels_last and len(shape) == 3 and shape == (batch, dim, L):
            return torch.randn(batch, L, dim, generator=g, dtype=dtype).transpose(1, 2)
        return torch.randn(*shape, generator=g, dtype=dtype)

    def bc(kind):
        return {"shared": (dim, N), "step": (batch, N, L), "group": (batch, groups, N, L)}[kind]

    return {
        "u": rnd(batch, dim, L),
        "delta": rnd(batch, dim, L) * 0.5,
        "A": -torch.exp(rnd(dim, N) * 0.5),
        "B": rnd(*bc(layout)),
        "C": rnd(*bc(c_layout or layout)),
        "D": rnd(dim),
        "z": rnd(batch, dim, L),
        "delta_bias": rnd(dim) * 0.3,
    }


def run(fn, inputs, use, softplus, last, **kw):
    """Forward + backward of a fixed random projection of the outputs; returns outputs and all grads."""
    # clone keeps the strides of a channels-last view (preserve_format on a dense tensor)
    ts = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    args = {k: (ts[k] if use[k] else None) for k in ("D", "z", "delta_bias")}
    res = fn(ts["u"], ts["delta"], ts["A"], ts["B"], ts["C"], **args, delta_softplus=softplus,
             return_last_state=last, **kw)  # fmt: skip
    outs = res if last else (res,)
    g = torch.Generator().manual_seed(1)
    loss = sum((o * _weights(o, g)).sum() for o in outs)
    loss.backward()
    grads = {k: ts[k].grad for k in NAMES if k in ("u", "delta", "A", "B", "C") or use[k]}
    return outs, grads


def run_threads(inputs, use, *counts, **kw):
    """run(selective_scan, inputs, use, True, True, **kw) once per torch thread count in counts (the
    process's count put back after); the results in that order."""
    threads = torch.get_num_threads()
    try:
        results = []
        for n in counts:
            torch.set_num_threads(n)
            results.append(run(selective_scan, inputs, use, True, True, **kw))
    finally:
        torch.set_num_threads(threads)
    return results


def _weights(o: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random weights for an output, laid out like it (so the output's gradient is too: a channel-stride-1
    output gets a channel-stride-1 gradient, as out_proj gives a Mamba block's scan)."""
    w = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype)
    if o.dim() == 3 and o.stride(1) == 1 and o.shape[1] > 1:
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    return w


def assert_close(outs_a, grads_a, outs_b, grads_b, rtol):
    for a, b in zip(outs_a, outs_b, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=rtol * b.abs().max().item())
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:
        a, b = grads_a[k], grads_b[k]
        assert a is not None and b is not None, k
        err = (a.double() - b.double()).abs().max().item() / max(b.abs().max().item(), 1e-30)
        assert err < rtol, f"grad of {k}: relative error {err:.2e}"


# the two CPU paths: the fused C kernel (default where a C compiler is found) and the torch-op path
PATHS = [pytest.param(True, id="fused"), pytest.param(False, id="torch-ops")]


def fused_kernel_available() -> bool:
    from memfit.ops import cpu_kernel as _scan_kernel

    return _scan_kernel.library() is not None


@pytest.fixture(params=PATHS)
def kernels(request):
    if request.param and not fused_kernel_available():
        pytest.skip("no C compiler here: the fused CPU kernel is not built (the torch-op path runs)")
    return request.param


@pytest.mark.parametrize("layout", ["shared", "step", "group"])
@pytest.mark.parametrize(("L", "chunk"), [(13, 4), (3, 8), (16, 4)])
def test_matches_reference_fp64_every_option(layout, L, chunk, kernels):
    """All 32 combinations of z / D / delta_bias / softplus / last_state, exact up to fp64 rounding."""
    inputs = make_inputs(L=L, layout=layout)
    for z, D, bias, softplus, last in itertools.product([False, True], repeat=5):
        use = {"z": z, "D": D, "delta_bias": bias}
        ref = run(selective_scan_ref, inputs, use, softplus, last)
        ours = run(selective_scan, inputs, use, softplus, last, chunk_size=chunk, use_kernels=kernels)
        assert_close(*ours, *ref, rtol=1e-10)


@pytest.mark.parametrize(("layout", "c_layout"), [("step", "shared"), ("shared", "group"), ("group", "step")])
def test_mixed_bc_layouts(layout, c_layout, kernels):
    inputs = make_inputs(L=11, layout=layout, c_layout=c_layout, groups=3)
    use = {"z": True, "D": True, "delta_bias": True}
    assert_close(*run(selective_scan, inputs, use, True, True, chunk_size=4, use_kernels=kernels),
                 *run(selective_scan_ref, inputs, use, True, True), rtol=1e-10)  # fmt: skip


@pytest.mark.parametrize("layout", ["shared", "step", "group"])
@pytest.mark.parametrize(("L", "chunk"), [(50, 16), (7, 64), (300, None)])
def test_fp32_matches_fp64_reference(layout, L, chunk, kernels):
    """fp32 chunked scan against the reference computed in fp64: forward and every gradient to ~1e-5
    (the fused kernel's fp32 exp2 is its own polynomial: this is its accuracy test)."""
    inputs = make_inputs(batch=3, dim=8, L=L, N=16, layout=layout, dtype=torch.float32, seed=3)
    use = {"z": True, "D": True, "delta_bias": True}
    ours = run(selective_scan, inputs, use, True, True, chunk_size=chunk, use_kernels=kernels)
    ref = run(selective_scan_ref, {k: v.double() for k, v in inputs.items()}, use, True, True)
    assert ours[0][0].dtype == torch.float32
    assert_close(*ours, *ref, rtol=2e-5)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records (name, lane path?) of every fused-kernel call."""
    from memfit.ops import cpu_kernel as _scan_kernel

    if not fused_kernel_available():
        pytest.skip("no C compiler here: the fused CPU kernel is not built")
    calls, orig = [], _scan_kernel.call
    monkeypatch.setattr(_scan_kernel, "call", lambda name, a: calls.append((name, a.lanes)) or orig(name, a))
    return calls


# (dim, N, L, chunk, B/C layout): dims below, at and above the lane count (16 fp32 / 8 fp64 lanes with
# AVX-512, half that without) with a tail, N = 1, 5 (no specialisation), 8 and 16, L = 1, L a multiple
# of the chunk and not; groups of 16 channels (whole blocks).
LANE_CASES = [
    (6, 4, 13, 4, "step"),
    (20, 8, 13, 4, "step"),
    (37, 16, 16, 4, "step"),
    (16, 1, 1, 8, "step"),
    (24, 5, 9, 64, "step"),
    (32, 8, 11, 4, "group"),
]


@pytest.mark.parametrize(("dim", "N", "L", "chunk", "layout"), LANE_CASES)
def test_lane_path_matches_reference_fp64_every_option(dim, N, L, chunk, layout, kernel_calls):
    """The kernel's channel-lane path (inputs laid out as a Mamba block passes them: channel stride 1,
    B/C per step or in groups of whole blocks): all 32 option combinations, exact up to fp64 rounding,
    and every call really ran on it."""
    inputs = make_inputs(dim=dim, N=N, L=L, layout=layout, groups=2, channels_last=True)
    for z, D, bias, softplus, last in itertools.product([False, True], repeat=5):
        use = {"z": z, "D": D, "delta_bias": bias}
        ref = run(selective_scan_ref, inputs, use, softplus, last)
        ours = run(selective_scan, inputs, use, softplus, last, chunk_size=chunk)
        assert_close(*ours, *ref, rtol=1e-10)
    assert kernel_calls == [("scan_fwd_f64", 1), ("scan_bwd_f64", 1)] * 32


@pytest.mark.parametrize(("dim", "N", "L", "chunk", "layout"), LANE_CASES)
def test_lane_path_fp32_matches_fp64_reference(dim, N, L, chunk, layout, kernel_calls):
    """The lane path's fp32 polynomials (exp2, softplus, sigmoid on lane vectors) to ~1e-5."""
    inputs = make_inputs(batch=3, dim=dim, L=L, N=N, layout=layout, dtype=torch.float32, seed=3,
                         channels_last=True)  # fmt: skip
    use = {"z": True, "D": True, "delta_bias": True}
    ours = run(selective_scan, inputs, use, True, True, chunk_size=chunk)
    ref = run(selective_scan_ref, {k: v.double() for k, v in inputs.items()}, use, True, True)
    assert_close(*ours, *ref, rtol=2e-5)
    assert kernel_calls == [("scan_fwd_f32", 1), ("scan_bwd_f32", 1)]


@pytest.mark.parametrize(("N", "gate", "tiny"), [(16, True, False), (16, True, True), (8, False, False)])
def test_lane_path_bf16_inputs_equal_fp32_inputs_then_rounded(monkeypatch, N, gate, tiny):
    """Under autocast a Mamba block passes bf16 u, delta, z and output gradient: the fp32 lane path reads
    them as they are and writes y, du, ddelta, dz in bf16 (no cast copies), which must give exactly what
    the same values in fp32 give, rounded to bf16 as torch's .to rounds (to nearest even; subnormal outputs
    too, with ``tiny`` u). N 16 with the gate is the kernel's compiled-in autocast case; N 8 without z
    takes its general bf16 branches."""
    from memfit.ops import cpu_kernel as _scan_kernel

    if not fused_kernel_available():
        pytest.skip("no C compiler here: the fused CPU kernel is not built")
    bits, orig = [], _scan_kernel.call
    record = lambda name, a: bits.append((name, a.bfm, a.lanes)) or orig(name, a)  # noqa: E731
    monkeypatch.setattr(_scan_kernel, "call", record)
    bf16 = torch.bfloat16
    inputs = make_inputs(batch=2, dim=37, L=19, N=N, dtype=torch.float32, seed=7, channels_last=True)
    if tiny:  # y ~ D * u + ... ~ 1e-39: subnormal in fp32 and in bf16
        inputs["u"] = inputs["u"] * 1e-39
    per_step = ("u", "delta", "z")
    low = {k: v.transpose(1, 2).to(bf16).transpose(1, 2) if k in per_step else v for k, v in inputs.items()}
    if not gate:
        del low["z"]
    gy = torch.randn(2, 19, 37, generator=torch.Generator().manual_seed(8)).to(bf16).transpose(1, 2)

    def fwd_bwd(ins, go):
        ts = {k: v.detach().clone().requires_grad_() for k, v in ins.items()}
        y, last = selective_scan(ts["u"], ts["delta"], ts["A"], ts["B"], ts["C"], ts["D"], z=ts.get("z"),
                                 delta_bias=ts["delta_bias"], delta_softplus=True, return_last_state=True,
                                 chunk_size=8)  # fmt: skip
        y.backward(go)
        return y, last, {k: t.grad for k, t in ts.items()}

    y16, last16, g16 = fwd_bwd(low, gy)
    y32, last32, g32 = fwd_bwd({k: v.float() for k, v in low.items()}, gy.float())
    if tiny:
        assert (y32.abs() < torch.finfo(torch.float32).tiny).float().mean() > 0.5  # mostly subnormal
    assert y16.dtype == bf16 and torch.equal(y16, y32.to(bf16))
    assert torch.equal(last16, last32)
    for k, g in g16.items():
        assert g.dtype == low[k].dtype and torch.equal(g, g32[k].to(g.dtype)), k
    # the lane path, with bf16 u, delta, z, y (forward) and u, delta, z, dout, du, ddelta, dz (backward)
    z_bits = 4 | 128 if gate else 0
    assert bits[:2] == [
        ("scan_fwd_f32", 1 | 2 | 16 | (z_bits & 4), 1),
        ("scan_bwd_f32", 1 | 2 | 8 | 32 | 64 | z_bits, 1),
    ]
    assert bits[2:] == [("scan_fwd_f32", 0, 1), ("scan_bwd_f32", 0, 1)]


@pytest.mark.parametrize("where", ["u", "delta", "z"])
def test_lane_path_propagates_nan(where, kernel_calls):
    """A NaN in an input reaches the output and the gradients as it does through torch ops (the exp2 and
    softplus polynomials clamp their argument, and must not clamp a NaN into a number)."""
    inputs = make_inputs(batch=1, dim=32, L=10, N=16, dtype=torch.float32, seed=2, channels_last=True)
    inputs[where] = inputs[where].clone()
    inputs[where][0, 3, 4] = float("nan")
    use = {"z": True, "D": True, "delta_bias": True}
    (y,), grads = run(selective_scan, inputs, use, True, False)
    (y_ref,), _ = run(selective_scan, inputs, use, True, False, use_kernels=False)
    assert torch.equal(y.isnan(), y_ref.isnan()) and y.isnan().any()
    assert grads["delta"].isnan().any()
    assert kernel_calls == [("scan_fwd_f32", 1), ("scan_bwd_f32", 1)]


def test_lane_path_fp32_long_sequence_and_wide_decays(kernel_calls):
    """fp32 over many chunks with dt * A from ~0 to ~-60 (the exp2 clamp and the polynomial's range)."""
    inputs = make_inputs(batch=2, dim=48, L=300, N=16, dtype=torch.float32, seed=5, channels_last=True)
    inputs["A"] = inputs["A"] * torch.logspace(-2, 1.5, 16)
    use = {"z": True, "D": True, "delta_bias": True}
    ours = run(selective_scan, inputs, use, True, True)
    ref = run(selective_scan_ref, {k: v.double() for k, v in inputs.items()}, use, True, True)
    assert_close(*ours, *ref, rtol=2e-5)
    assert kernel_calls == [("scan_fwd_f32", 1), ("scan_bwd_f32", 1)]


def test_lane_path_threads_agree(kernel_calls):
    """1 and 4 threads on the lane path: thread ranges that cut batch rows and B/C groups apart (the
    per-thread dB/dC/dA sums are added up) give the same result."""
    inputs = make_inputs(batch=3, dim=64, L=37, N=5, layout="group", groups=2, channels_last=True)
    use = {"z": True, "D": True, "delta_bias": True}
    one, four = run_threads(inputs, use, 1, 4, chunk_size=8)
    assert_close(*one, *four, rtol=1e-13)
    assert_close(*one, *run(selective_scan_ref, inputs, use, True, True), rtol=1e-10)
    assert {lanes for _, lanes in kernel_calls} == {1}


def test_sequence_path_where_lanes_do_not_fit(kernel_calls):
    """Shared (dim, N) B, groups smaller than a block, or (batch, dim, L)-contiguous inputs: the
    sequence path runs (still exact)."""
    use = {"z": True, "D": True, "delta_bias": True}
    for kw in ({"layout": "shared", "channels_last": True}, {"layout": "group", "groups": 3, "dim": 6},
               {"layout": "step", "channels_last": False}):  # fmt: skip
        inputs = make_inputs(L=9, **kw)
        kernel_calls.clear()
        ours = run(selective_scan, inputs, use, True, True, chunk_size=4)
        assert_close(*ours, *run(selective_scan_ref, inputs, use, True, True), rtol=1e-10)
        assert kernel_calls == [("scan_fwd_f64", 0), ("scan_bwd_f64", 0)], kw


def test_default_chunk_and_output_dtype_under_autocast():
    """bf16 inputs under autocast: the scan runs in fp32 inside, returns bf16, gradients keep input dtypes."""
    inputs = make_inputs(batch=2, dim=8, L=40, N=8, dtype=torch.float32)
    bf = {k: (v.bfloat16() if k in ("u", "delta", "z", "B", "C") else v) for k, v in inputs.items()}
    use = {"z": True, "D": True, "delta_bias": True}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs, grads = run(selective_scan, bf, use, True, False)
    assert outs[0].dtype == torch.bfloat16
    for k, g in grads.items():
        assert g.dtype == bf[k].dtype, k
    ref_outs, ref_grads = run(selective_scan_ref, {k: v.float() for k, v in bf.items()}, use, True, False)
    torch.testing.assert_close(
        outs[0].float(), ref_outs[0], rtol=2e-2, atol=2e-2 * ref_outs[0].abs().max().item()
    )
    for k in grads:
        err = (grads[k].float() - ref_grads[k]).abs().max() / ref_grads[k].abs().max()
        assert err < 3e-2, k


@pytest.mark.skipif(not fused_kernel_available(), reason="no C compiler: the fused kernel is not built")
def test_fused_kernel_threads_agree_and_are_used(monkeypatch):
    """1 and 3 threads (per-thread gradient accumulators summed) give the same result, and the default
    CPU path really is the fused kernel (a broken build would otherwise hide behind the fallback)."""
    from memfit.ops import registry

    registry.reset()
    inputs = make_inputs(batch=3, dim=10, L=37, N=5, layout="group", groups=2, dtype=torch.float64)
    use = {"z": True, "D": True, "delta_bias": True}
    one, three = run_threads(inputs, use, 1, 3, chunk_size=8)
    assert registry.ran("scan") == {"cpu_kernel": 2}
    assert_close(*one, *three, rtol=1e-13)


def test_runs_on_fake_tensors():
    """memfit.estimate.memory estimates training steps under FakeTensorMode: no data-dependent code
    allowed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        inputs = make_inputs(batch=4, dim=32, L=300, N=16, dtype=torch.float32)
        ts = {k: v.requires_grad_() for k, v in inputs.items()}
        out, last = selective_scan(*ts.values(), delta_softplus=True, return_last_state=True)
        (out.sum() + last.sum()).backward()
        assert out.shape == (4, 32, 300) and last.shape == (4, 32, 16)
        assert all(ts[k].grad.shape == ts[k].shape for k in NAMES)


def test_chunk_plan_runs_every_chunk_once_in_order():
    """The torch-op path runs chunks 0, 1 and the last itself and 2 .. n-2 in one op per direction
    (whose fake implementation skips them): together every chunk once, in order."""
    from memfit.ops.scan.chunked import _chunk_plan

    for n in range(1, 9):
        first, middle, last = _chunk_plan(n)
        assert [*first, *middle, *last] == list(range(n)), n
        assert len(middle) == max(0, n - 3) and (n < 2 or first[-1] == 1) and (n < 3 or last[0] == n - 1)


def test_training_step_memory_much_lower_than_reference():
    """Measured peak of forward + backward: the chunked scan holds states of one chunk, not of all L."""
    inputs = make_inputs(batch=8, dim=64, L=128, N=16, dtype=torch.float32)
    ts = [v.requires_grad_() for v in inputs.values()]

    def step(fn, **kw):
        with measure_peak("cpu", existing=ts) as m:
            fn(*ts, delta_softplus=True, **kw).square().mean().backward()
        out = [t.grad.clone() for t in ts]
        for t in ts:
            t.grad = None
        return m.peak_bytes, out

    ref_peak, ref_grads = step(selective_scan_ref)
    peak, grads = step(selective_scan, chunk_size=8)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    full = 8 * 64 * 128 * 16 * 4  # one (batch, dim, L, N) fp32 tensor
    assert ref_peak > 3 * full, "the reference should materialise several (batch, dim, L, N) tensors"
    assert peak * 4 < ref_peak, f"chunked {peak / 2**20:.1f} MiB vs reference {ref_peak / 2**20:.1f} MiB"
    assert peak < full


def test_auto_chunk_size():
    assert auto_chunk_size(2, 16, 64, 16) == 64  # tiny: memory does not matter
    assert auto_chunk_size(60, 256, 200, 16) == 8
    assert 16 <= auto_chunk_size(8, 1536, 4096, 16) <= 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"A": torch.zeros(5, 4)}, "A must be"),
        ({"B": torch.zeros(2, 4, 12)}, "B has shape"),
        ({"C": torch.zeros(2, 4, 4, 13)}, "groups dividing"),
        ({"delta": torch.zeros(2, 6, 12)}, "delta has shape"),
        ({"D": torch.zeros(5)}, "D must be"),
    ],
)
def test_bad_shapes_raise_clear_errors(change, message):
    inputs = {**make_inputs(L=13), **change}
    with pytest.raises(ValueError, match=message):
        selective_scan(*inputs.values())
    with pytest.raises(ValueError, match=message):
        selective_scan_ref(*inputs.values())


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        selective_scan(*make_inputs().values(), chunk_size=0)


@pytest.mark.cuda
def test_cuda_matches_reference():
    """On CUDA (the registry's choice: the Triton scan, or mamba_ssm's kernel with the cuda extra) against
    the reference, with every tensor of the call and its gradient weights on the GPU."""
    from memfit.ops import registry

    inputs = {k: v.float().cuda() for k, v in make_inputs(batch=2, dim=16, L=100, N=8).items()}
    use = {"z": True, "D": True, "delta_bias": True}
    registry.reset()
    ours = run(selective_scan, inputs, use, True, False)
    assert set(registry.ran("scan")) in ({"triton"}, {"mamba_ssm"}) and ours[0][0].is_cuda, registry.ran()
    ref = run(selective_scan_ref, inputs, use, True, False)
    assert_close(*ours, *ref, rtol=1e-3)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
@pytest.mark.parametrize("layout", ["shared", "step", "group"])
def test_fake_tensor_path_allocates_like_the_real_one(layout, channels_last, kernels):
    """On fake tensors the scan runs only 3 of its chunks and skips the in-place recurrences (memory
    estimates need allocations, not values): its peak must equal a real run's, and it must make every
    size of allocation the real run makes (the chunks it skips repeat the same ones). The fused CPU path
    runs on fake tensors too, skipping only its C calls: the same check holds for it, on either of its
    paths (channel-stride-1 inputs with per-step B/C take the channel-lane path)."""
    from memfit.estimate.tracker import _StorageTracker, fake_mode

    class Tracker(_StorageTracker):
        def __init__(self, fake):
            super().__init__(fake)
            self.sizes = set()

        def _new_entry(self, st, t, category):  # called once per storage the tracker starts counting
            self.sizes.add(st.nbytes())
            return super()._new_entry(st, t, category)

    def run_step(fake):
        inputs = make_inputs(batch=2, dim=16, L=70, N=8, layout=layout, dtype=torch.float32,
                             channels_last=channels_last)  # fmt: skip
        ts = [v.requires_grad_() for v in inputs.values()]
        tracker = Tracker(fake=fake)
        with tracker:
            out, last = selective_scan(
                *ts, delta_softplus=True, return_last_state=True, chunk_size=8, use_kernels=kernels
            )
            (out.sum() + last.sum()).backward()
        return tracker.peak, tracker.sizes

    real = run_step(False)
    with fake_mode():
        fake = run_step(True)
    assert fake[0] == real[0], f"fake peak {fake[0]} B != real {real[0]} B"
    assert fake[1] == real[1], f"allocation sizes differ: {sorted(fake[1] ^ real[1])}"
    assert len(real[1]) >= 5
    if not kernels:
        assert real[0] > 4 * 2 * 16 * 8 * 8  # it saw the chunk buffers
