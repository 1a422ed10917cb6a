"""The boundary of memfit's own kernels: the C kernel's argument structs checked field by field, its state
size limit enforced on the C side, and every memfit custom op passing torch.library.opcheck."""

from __future__ import annotations

import ctypes

import pytest
import torch
from memfit.errors import UsageError
from memfit.ops import cpu_kernel as K
from memfit.ops.conv import conv_silu
from memfit.ops.scan import selective_scan
from torch.utils._python_dispatch import TorchDispatchMode

needs_kernel = pytest.mark.skipif(K.library() is None, reason="no C compiler: the fused kernel is not built")


@needs_kernel
def test_the_c_side_names_every_field_nmax_and_the_flag_bits():
    theirs = K.library_abi(K.library())
    assert theirs == K.abi()
    for struct in (K.ScanArgs, K.ConvArgs, K.Strides):
        assert {f"{struct.__name__}.{name}" for name, _ in struct._fields_} <= theirs.keys()
    assert theirs["NMAX"] == K.NMAX and theirs["BF_DZ"] == 128 and theirs["E_STATE"] == K.E_STATE


@needs_kernel
def test_two_swapped_pointer_fields_are_refused(monkeypatch):
    fields = list(K.ScanArgs._fields_)
    i, j = fields.index(("delta", ctypes.c_void_p)), fields.index(("bias", ctypes.c_void_p))
    fields[i], fields[j] = fields[j], fields[i]  # same sizes, same offsets list: only the names differ

    class Swapped(ctypes.Structure):
        _fields_ = fields

    Swapped.__name__ = "ScanArgs"
    monkeypatch.setattr(K, "ScanArgs", Swapped)
    theirs = K.library_abi(K.library())
    assert theirs != K.abi()
    assert {k for k in theirs if theirs[k] != K.abi()[k]} == {"ScanArgs.delta", "ScanArgs.bias"}
    K.library.cache_clear()
    try:
        with pytest.raises(UsageError, match="disagree on ScanArgs.bias, ScanArgs.delta"):
            K.library()
    finally:
        monkeypatch.undo()
        K.library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("N", [0, K.NMAX + 1])
def test_the_c_kernel_refuses_a_state_size_outside_its_buffer(N):
    """The kernels keep the state in REAL h[NMAX]: the C side refuses a larger N before touching memory,
    whatever the Python side let through."""
    a = K.ScanArgs(batch=1, dim=1, L=1, N=N, T=1, nthreads=1)  # every pointer NULL: nothing may be read
    with pytest.raises(ValueError, match=f"N={N} is outside 1..{K.NMAX}"):
        K.call("scan_fwd_f32", a)
    with pytest.raises(ValueError, match="outside"):
        K.call("scan_bwd_f32", a)


class _Recorder(TorchDispatchMode):
    """Records the first call of every op in the memfit namespace, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "memfit" and func._overloadpacket not in self.calls:
            clone = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            self.calls[func._overloadpacket] = (clone, dict(kwargs))
        return func(*args, **kwargs)


def _record_every_op() -> dict:
    torch.manual_seed(0)
    b, d, L, N = 2, 16, 40, 4
    rec = _Recorder()
    with rec:
        for kernels in (True, False):  # the fused C ops, then the torch-op path's ops (6 chunks of 8)
            u = torch.randn(b, L, d).transpose(1, 2).requires_grad_(True)
            delta = torch.rand(b, d, L, requires_grad=True)
            A = (-torch.rand(d, N) - 0.5).requires_grad_(True)
            B, C = torch.randn(b, N, L, requires_grad=True), torch.randn(b, N, L, requires_grad=True)
            out, last = selective_scan(
                u, delta, A, B, C, torch.ones(d), torch.randn(b, d, L), torch.zeros(d), True, True,
                chunk_size=8, use_kernels=kernels,
            )  # fmt: skip
            (out.sum() + last.sum()).backward()
        x = torch.randn(b, L, 2 * d)[..., :d].transpose(1, 2).requires_grad_(True)
        conv_silu(
            x, torch.randn(d, 1, 4, requires_grad=True), torch.randn(d, requires_grad=True)
        ).sum().backward()
    return rec.calls


@needs_kernel
def test_every_memfit_op_passes_opcheck():
    calls = _record_every_op()
    names = {op.__name__ for op in calls}
    want = {"scan_fwd", "scan_bwd", "conv_fwd", "conv_bwd", "chunk_states_", "chunk_state_grads_",
            "chunked_scan_fwd_", "chunked_scan_bwd_"}  # fmt: skip
    assert want <= names, want - names
    for op, (args, kwargs) in calls.items():
        for overload in op.overloads():
            torch.library.opcheck(getattr(op, overload), args, kwargs)


def test_the_triton_ops_pass_opcheck():
    from memfit.ops.scan import triton as S

    if not S._interpreted():
        pytest.skip("Triton's interpreter is off here (a CUDA machine): its cuda tests cover the ops")
    torch.manual_seed(0)
    b, d, L, N = 2, 8, 11, 4
    u, delta, z = torch.randn(b, d, L), torch.rand(b, d, L), torch.randn(b, d, L)
    A, B, C = -torch.rand(d, N) - 0.5, torch.randn(b, N, L), torch.randn(b, N, L)
    D, bias = torch.randn(d), torch.randn(d)
    cfg = (True, 4, 4, 1)  # softplus, chunk, block_d, num_warps
    out, states, last = torch.ops.memfit.triton_scan_fwd(u, delta, A, B, C, D, z, bias, *cfg)
    torch.library.opcheck(torch.ops.memfit.triton_scan_fwd.default, (u, delta, A, B, C, D, z, bias, *cfg))
    bwd = (u, delta, A, B, C, D, z, bias, *cfg, states, torch.randn_like(out), torch.randn_like(last))
    torch.library.opcheck(torch.ops.memfit.triton_scan_bwd.default, bwd)
