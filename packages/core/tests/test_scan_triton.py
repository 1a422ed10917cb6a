"""memfit's Triton selective scan (memfit.ops.scan.triton) against selective_scan_ref.

On a machine without CUDA the kernels run under Triton's interpreter on CPU tensors (the root conftest sets
TRITON_INTERPRET=1 there before anything imports triton): forward, the gradient of every input, the last
state, B/C in every form, several chunks, each dtype, strided views, the fake ops and torch.compile. The
same checks at real sizes, compiled on a GPU, carry the `cuda` mark (end of this file).
"""

from __future__ import annotations

import pytest
import torch
from memfit.ops.scan import triton as S
from memfit.ops.scan.ref import selective_scan_ref
from memfit.ops.scan.triton import selective_scan_triton

DEVICE = "cpu"
REF_SOURCE = "memfit.ops.scan"
pytestmark = pytest.mark.skipif(
    not S._interpreted(), reason="the Triton interpreter is off (a CUDA machine): see the cuda tests below"
)


NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def make_bc(form, batch, dim, N, L, G, dtype, gen, nonstd=False):
    if form == "shared":
        return torch.randn(dim, N, generator=gen).to(DEVICE, dtype)
    if form == "step":
        if nonstd:  # N contiguous and not dense: the B columns of a wider (batch, L, 3N) projection
            return (
                torch.randn(batch, L, 3 * N, generator=gen)[:, :, N : 2 * N].to(DEVICE, dtype).transpose(1, 2)
            )
        return torch.randn(batch, N, L, generator=gen).to(DEVICE, dtype)
    if nonstd:
        return torch.randn(batch, L, G, N, generator=gen).to(DEVICE, dtype).permute(0, 2, 3, 1)
    return torch.randn(batch, G, N, L, generator=gen).to(DEVICE, dtype)


def make_inputs(batch=2, dim=4, L=11, N=5, Bf="step", Cf="step", G=2, dtype=torch.float32, D=True, z=True,
                bias=True, transposed=False, seed=0):  # fmt: skip
    """The scan's arguments (None for absent optional ones); ``transposed``: u, delta, z are (batch, L, dim)
    tensors seen transposed (channel stride 1) and B/C per step have N contiguous and are not dense."""
    gen = torch.Generator().manual_seed(seed)

    def bdl(scale=1.0, shift=0.0):
        if transposed:
            x = torch.randn(batch, L, dim, generator=gen) * scale + shift
            return x.to(DEVICE, dtype).transpose(1, 2)
        return (torch.randn(batch, dim, L, generator=gen) * scale + shift).to(DEVICE, dtype)

    u = bdl()
    delta = bdl(0.5, -0.5)  # softplus of it ~ 0.2 .. 1; without softplus some negative steps: still finite
    A = (-torch.exp(torch.rand(dim, N, generator=gen) * 1.5 - 0.5)).to(DEVICE)
    B = make_bc(Bf, batch, dim, N, L, G, dtype, gen, transposed)
    C = make_bc(Cf, batch, dim, N, L, G, dtype, gen, transposed)
    Dv = torch.randn(dim, generator=gen).to(DEVICE) if D else None
    zz = bdl() if z else None
    bb = (torch.randn(dim, generator=gen) * 0.3).to(DEVICE) if bias else None
    return [u, delta, A, B, C, Dv, zz, bb]


def leaves(args):
    return [a.detach().clone().requires_grad_(True) if a is not None else None for a in args]


def fp32_leaves(args):
    """fp32 copies of the same values (the reference runs in fp32 from exactly what the kernel reads)."""
    return [a.detach().float().clone().requires_grad_(True) if a is not None else None for a in args]


def check(got, ref, tol, what):
    got, ref = got.detach().float(), ref.detach().float()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    scale = max(ref.abs().max().item(), 1e-3)
    err = (got - ref).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x scale {scale:.3g}"


def run_both(args, softplus=True, chunk=4, block_d=None, use_out=True, use_last=True, seed=1):
    """Forward and backward of the Triton scan and of the reference; compares out, last and every
    gradient. The loss is <out, go> + <last, gl> (either term can be left out)."""
    dtype = args[0].dtype
    tol = TOL[dtype]
    a_t, a_r = leaves(args), fp32_leaves(args)
    out, last = selective_scan_triton(
        *a_t, delta_softplus=softplus, return_last_state=True, chunk_size=chunk, block_d=block_d
    )
    rout, rlast = selective_scan_ref(*a_r, delta_softplus=softplus, return_last_state=True)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert last.dtype == torch.float32 and last.shape == rlast.shape
    check(out, rout, tol, "out")
    check(last, rlast, tol, "last state")
    gen = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=gen).to(DEVICE)
    gl = torch.randn(last.shape, generator=gen).to(DEVICE)

    def loss(o, h):
        terms = []
        if use_out:
            terms.append((o.float() * go).sum())
        if use_last:
            terms.append((h * gl).sum())
        return sum(terms)

    loss(out, last).backward()
    loss(rout, rlast).backward()
    for name, t, r in zip(NAMES, a_t, a_r):
        if t is None:
            continue
        if r.grad is None:  # not connected to the loss in the reference (e.g. C, D, z from the last state)
            assert t.grad is None or not t.grad.any(), f"d{name} should be zero"
            continue
        assert t.grad is not None, f"no gradient for {name}"
        assert t.grad.dtype == t.dtype, f"d{name} dtype {t.grad.dtype} != {t.dtype}"
        check(t.grad, r.grad, tol, f"d{name}")
    return out, last


# ----------------------------------------------------------------------------------------------------
# Forward and every gradient against the reference
# ----------------------------------------------------------------------------------------------------

BC_FORMS = [
    ("shared", "shared"),
    ("step", "step"),
    ("group", "group"),
    ("shared", "step"),
    ("step", "group"),
    ("group", "shared"),
]


@pytest.mark.parametrize("Bf,Cf", BC_FORMS)
@pytest.mark.parametrize("softplus", [True, False])
def test_bc_forms_and_softplus(Bf, Cf, softplus):
    """All B/C forms, softplus on and off, several chunks (chunk 4) and L = 11 not a multiple of it."""
    run_both(make_inputs(Bf=Bf, Cf=Cf), softplus=softplus, chunk=4)


@pytest.mark.parametrize("chunk", [1, 3, 11, 64])
def test_chunk_sizes(chunk):
    """One step per chunk, uneven chunks, one exact chunk, one chunk longer than L (single chunk)."""
    run_both(make_inputs(L=11), chunk=chunk)


@pytest.mark.parametrize("block_d", [1, 2, 8, 16])
def test_block_sizes(block_d):
    """Blocks of 1 to 16 channels over dim 20 (the last block partly masked), per-step and shared B/C."""
    run_both(make_inputs(dim=20, L=7, Bf="step", Cf="shared", G=1), chunk=3, block_d=block_d)


def test_default_chunk_and_block():
    run_both(make_inputs(dim=6, L=20), chunk=None, block_d=None)


def test_optional_inputs_absent():
    """No D, z or delta_bias: their gradients are None and the rest still match."""
    run_both(make_inputs(D=False, z=False, bias=False), softplus=False)
    run_both(make_inputs(D=True, z=False, bias=False, Bf="shared", Cf="group"), softplus=True)
    run_both(make_inputs(D=False, z=True, bias=True, Bf="group", Cf="step"), softplus=True)


def test_channel_masking_and_odd_groups():
    """dim not a multiple of the block (masked channels) and groups of 3 channels (BLOCK_D drops to 1)."""
    run_both(make_inputs(dim=6, Bf="step", Cf="shared"), block_d=4)
    run_both(make_inputs(dim=6, G=2, Bf="group", Cf="step"))


def test_power_of_two_state_and_single_step():
    run_both(make_inputs(N=8, L=1))
    run_both(make_inputs(N=1, L=6, Bf="group", Cf="shared"), chunk=2)


@pytest.mark.parametrize("use_out,use_last", [(False, True), (True, False)])
def test_last_state_gradient(use_out, use_last):
    """The gradient flows from the last state alone (no output gradient at all) and from the output
    alone (no last-state gradient)."""
    run_both(make_inputs(), chunk=4, use_out=use_out, use_last=use_last)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype):
    """bf16/fp16 u, delta, z, B, C (fp32 A, D, delta_bias): out and the per-step gradients in the inputs'
    dtypes, compared with the fp32 reference at a looser tolerance."""
    run_both(make_inputs(dtype=dtype, Bf="step", Cf="group"), chunk=4)


def test_half_inputs_shared_bc_transposed():
    run_both(make_inputs(dtype=torch.bfloat16, Bf="shared", Cf="shared", transposed=True), chunk=3)


@pytest.mark.parametrize("Bf,Cf", [("step", "step"), ("group", "shared")])
def test_transposed_views(Bf, Cf):
    """u, delta, z seen transposed from (batch, L, dim) and non-dense N-contiguous B/C: no copies, same
    result, and out / du / ddelta / dz keep the channel-stride-1 layout."""
    args = make_inputs(Bf=Bf, Cf=Cf, transposed=True)
    assert args[0].stride(1) == 1 and not args[0].is_contiguous()
    out, _ = run_both(args, chunk=4)
    assert out.stride(1) == 1
    a = leaves(args)
    selective_scan_triton(*a, delta_softplus=True, chunk_size=4).sum().backward()
    assert a[0].grad.stride(1) == 1 and a[1].grad.stride(1) == 1 and a[6].grad.stride(1) == 1


def test_contiguous_outputs_for_contiguous_inputs():
    args = make_inputs()
    a = leaves(args)
    out = selective_scan_triton(*a, chunk_size=4)
    assert out.is_contiguous()
    out.sum().backward()
    assert a[0].grad.is_contiguous() and a[1].grad.is_contiguous()


def test_return_value_and_autocast():
    """Only out without return_last_state; autocast does not change the computation (inputs used in
    their own dtype)."""
    args = make_inputs()
    out = selective_scan_triton(*args, delta_softplus=True, chunk_size=4)
    assert isinstance(out, torch.Tensor)
    with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
        out2 = selective_scan_triton(*args, delta_softplus=True, chunk_size=4)
    assert out2.dtype == torch.float32
    torch.testing.assert_close(out, out2, rtol=0, atol=0)


def test_argument_errors():
    args = make_inputs()
    with pytest.raises(TypeError):
        selective_scan_triton(*[a.double() if a is not None else None for a in args])
    with pytest.raises(ValueError):
        selective_scan_triton(*args, chunk_size=0)
    with pytest.raises(ValueError):
        selective_scan_triton(*make_inputs(Bf="group", G=2, dim=4), block_d=4)  # groups of 2 channels
    bad = list(args)
    bad[3] = args[3][:, :, :-1]
    with pytest.raises(ValueError):
        selective_scan_triton(*bad)


# ----------------------------------------------------------------------------------------------------
# Registration: fake implementations
# ----------------------------------------------------------------------------------------------------


def _meta(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype)


def test_fake_outputs_match_real_ops():
    """The ops' fake implementations allocate exactly what the real ops return (shape, strides, dtype),
    the backward's scratch included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = make_inputs(Bf="group", Cf="shared", transposed=True)
    cfg = (True, 4, 1, 1)
    real_f = torch.ops.memfit.triton_scan_fwd(*args, *cfg)
    states = real_f[1]
    dout = torch.randn_like(args[0]).transpose(1, 2).contiguous().transpose(1, 2)
    dlast = torch.randn_like(real_f[2])
    real_b = torch.ops.memfit.triton_scan_bwd(*args, *cfg, states, dout, dlast)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fargs = [mode.from_tensor(a) if a is not None else None for a in args]
        fake_f = torch.ops.memfit.triton_scan_fwd(*fargs, *cfg)
        fake_b = torch.ops.memfit.triton_scan_bwd(
            *fargs, *cfg, mode.from_tensor(states), mode.from_tensor(dout), mode.from_tensor(dlast)
        )
    assert [_meta(t) for t in fake_f] == [_meta(t) for t in real_f]
    assert [_meta(t) for t in fake_b] == [_meta(t) for t in real_b]
    b, dim, L = args[0].shape
    assert real_b[-1].shape == (b, dim, 4, 1, 8)  # scratch: (batch, cdiv(dim, BLOCK_D), chunk, BLOCK_D, NP)
    assert states.shape == (b, 2, dim, 5)  # L = 11, chunk 4: 3 chunks, 2 boundary states


def test_fake_tensor_mode_runs_nothing(monkeypatch):
    """Forward and backward under FakeTensorMode: right shapes and dtypes, and no kernel is launched."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    launches = []
    for k in (S._scan_fwd_kernel, S._scan_bwd_kernel):
        orig = k.run
        monkeypatch.setattr(k, "run", lambda *a, _o=orig, **kw: launches.append(1) or _o(*a, **kw))
    with FakeTensorMode():
        batch, dim, L, N = 3, 40, 300, 16  # sizes the interpreter would take a long time over
        u = torch.empty(batch, L, dim, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2).requires_grad_()
        delta = torch.empty(batch, dim, L, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
        A = torch.empty(dim, N, device=DEVICE, requires_grad=True)
        B = torch.empty(batch, N, L, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
        C = torch.empty(batch, 2, N, L, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
        D = torch.empty(dim, device=DEVICE, requires_grad=True)
        z = torch.empty(batch, dim, L, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
        bias = torch.empty(dim, device=DEVICE, requires_grad=True)
        ins = (u, delta, A, B, C, D, z, bias)
        out, last = selective_scan_triton(*ins, delta_softplus=True, return_last_state=True)
        assert isinstance(out, torch._subclasses.fake_tensor.FakeTensor)
        assert out.shape == (batch, dim, L) and out.dtype == torch.bfloat16 and out.stride(1) == 1
        assert last.shape == (batch, dim, N) and last.dtype == torch.float32
        (out.float().sum() + last.sum()).backward()
        for t in ins:
            assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype
    assert launches == []


def test_real_launch_is_counted(monkeypatch):
    """The launch counter used above does see real launches (so its emptiness means something)."""
    launches = []
    for k in (S._scan_fwd_kernel, S._scan_bwd_kernel):
        orig = k.run
        monkeypatch.setattr(k, "run", lambda *a, _o=orig, **kw: launches.append(1) or _o(*a, **kw))
    a = leaves(make_inputs(L=3))
    selective_scan_triton(*a).sum().backward()
    assert len(launches) == 2


def test_launch_config_and_chunk():
    assert S.default_chunk(2048) == 64 and S.default_chunk(200) == 16 and S.default_chunk(30) == 4
    assert S.default_chunk(5) == 4 and S.default_chunk(3) == 3
    bd, nw = S.launch_config(4, 1536, 16)
    assert bd in (4, 8, 16) and nw >= 1
    assert S.launch_config(2, 12, 16, group_size=6)[0] == 2
    assert S.launch_config(2, 6, 16, group_size=3)[0] == 1


def test_torch_compile_fullgraph():
    """dynamo traces the autograd.Function and the ops whole (fullgraph) and gives eager's gradients
    (aot_eager on the CPU: the ops run as opaque nodes, their fakes trace shapes; bench/GPU runs used
    inductor)."""
    args = make_inputs(Bf="step", Cf="group", transposed=True)

    def f(*xs):
        out, last = selective_scan_triton(*xs, delta_softplus=True, return_last_state=True, chunk_size=4)
        return (out * 1.5).sum() + last.square().sum()

    a, r = leaves(args), leaves(args)
    f(*a).backward()
    backend = "aot_eager"
    torch.compile(f, fullgraph=True, backend=backend)(*r).backward()
    for name, x, y in zip(NAMES, a, r):
        check(y.grad, x.grad, 1e-6, f"compiled d{name}")


# ----------------------------------------------------------------------------------------------------
# On a GPU, compiled: real sizes, and the registry's choice
# ----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("batch", "dim", "L", "N", "dtype", "bc"),
    [(2, 384, 300, 16, torch.float32, "step"), (4, 1536, 2048, 16, torch.bfloat16, "step"),
     (180, 64, 200, 16, torch.float32, "group"), (2, 256, 1000, 8, torch.float16, "shared")],
)  # fmt: skip
def test_cuda_matches_the_reference_at_real_sizes(batch, dim, L, N, dtype, bc):
    from memfit.ops import registry
    from memfit.ops.scan import selective_scan

    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, scale=1.0, shift=0.0, dt=dtype):
        return (torch.randn(*shape, generator=g, device="cuda") * scale + shift).to(dt)

    u = r(batch, L, dim).transpose(1, 2)
    delta = r(batch, L, dim, scale=0.5, shift=-0.5).transpose(1, 2)
    z = r(batch, L, dim).transpose(1, 2)
    A = -torch.exp(torch.rand(dim, N, generator=g, device="cuda"))
    shapes = {"step": (batch, N, L), "group": (batch, 2, N, L), "shared": (dim, N)}
    B = r(*shapes[bc], dt=dtype if bc != "shared" else torch.float32)
    C = r(*shapes[bc], dt=dtype if bc != "shared" else torch.float32)
    D, bias = r(dim, dt=torch.float32), r(dim, scale=0.3, dt=torch.float32)
    ins = [t.detach().requires_grad_(True) for t in (u, delta, A, B, C, D, z, bias)]
    ref = [t.detach().float().requires_grad_(True) for t in (u, delta, A, B, C, D, z, bias)]
    registry.reset()
    out, last = selective_scan(*ins, delta_softplus=True, return_last_state=True)
    assert "triton" in registry.ran("scan") or "mamba_ssm" in registry.ran("scan")
    rout, rlast = selective_scan_ref(*ref, delta_softplus=True, return_last_state=True)
    go = torch.randn(out.shape, generator=g, device="cuda")
    ((out.float() * go).sum() + last.sum()).backward()
    ((rout * go).sum() + rlast.sum()).backward()
    tol = TOL[dtype]
    check(out, rout, tol, "out")
    check(last, rlast, tol, "last")
    for name, t, w in zip(NAMES, ins, ref):
        check(t.grad, w.grad, tol * (4 if name in ("A", "B", "C") else 1), f"d{name}")
