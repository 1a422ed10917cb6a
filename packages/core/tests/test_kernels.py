"""memfit.estimate.rules: the CPU kernel corrections against the real kernels, and the CUDA target's rules
against
the ops' documented outputs and CUDA's own autocast dispatcher (fake CUDA tensors run forward, no GPU)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from memfit.estimate import rules
from memfit.estimate.steps import estimate_training_step, measure_training_step
from memfit.estimate.trace import SAVED, SHAPE, trace_step
from memfit.step import TrainStep
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode


class _Workspaces(TorchDispatchMode):
    """The real mkldnn_rnn_layer calls of a run: (input shape, hidden, dtype, workspace bytes)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mkldnn_rnn_layer.default:
            self.calls.append((tuple(args[0].shape), args[10], args[0].dtype, out[3].numel()))
        return out


@pytest.mark.parametrize(
    "inp,hidden,steps,batch,bidirectional,batch_first,amp",
    [
        (32, 64, 10, 2, False, False, None),
        (256, 64, 10, 2, False, False, None),  # input wider than hidden: the layer states' width
        (32, 200, 13, 5, False, False, None),  # hidden not a multiple of 16
        (40, 96, 7, 3, True, True, None),  # the second direction, batch_first
        (32, 128, 10, 2, False, False, torch.bfloat16),
        (512, 48, 9, 2, False, False, torch.bfloat16),
        (40, 96, 7, 3, True, False, torch.bfloat16),
    ],
)
def test_mkldnn_lstm_workspace_formula_matches_the_real_kernel(
    inp, hidden, steps, batch, bidirectional, batch_first, amp
):
    lstm = nn.LSTM(inp, hidden, 2, bidirectional=bidirectional, batch_first=batch_first)
    x = torch.randn((batch, steps, inp) if batch_first else (steps, batch, inp), requires_grad=True)
    seen = _Workspaces()
    with seen, torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        lstm(x)
    assert len(seen.calls) == 2 * (2 if bidirectional else 1)
    for shape, h, dtype, real in seen.calls:
        assert rules.mkldnn_lstm_workspace_bytes(*shape, h, dtype) == real, (shape, h, dtype)


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_lstm_estimate_equals_the_real_cpu_peak(amp):
    """Without the corrections the estimate was 17% low (0-byte workspaces) and 7% low in bf16 (the backward
    returns fp32 gradients)."""
    step = TrainStep(
        lambda: nn.LSTM(40, 64, 2, batch_first=True),
        lambda d: torch.randn(3, 20, 40, device=d),
        lambda m, x: m(x)[0].float().pow(2).mean(),
        amp_dtype=amp,
    )
    est, real = estimate_training_step(step).peak_bytes, measure_training_step(step).peak_bytes
    assert abs(est - real) <= 0.002 * real, (est, real)


# ----------------------------------------------------------------------------------------------------
# CUDA target
# ----------------------------------------------------------------------------------------------------


def _qkv(dtype, d=64, heads=4, kv_heads=4, length=100):
    return (
        torch.randn(2, heads, length, d, dtype=dtype),
        torch.randn(2, kv_heads, length, d, dtype=dtype),
        torch.randn(2, kv_heads, length, d, dtype=dtype),
    )


@pytest.mark.parametrize(
    "dtype,d,mask,kv_heads,expected",
    [
        (torch.bfloat16, 64, False, 4, "flash"),
        (torch.float16, 256, False, 4, "flash"),
        (torch.bfloat16, 64, True, 4, "efficient"),  # flash takes no explicit mask
        (torch.float32, 64, False, 4, "efficient"),  # flash is fp16/bf16 only
        (torch.float32, 30, False, 4, "math"),  # not a multiple of 4
        (torch.float32, 64, False, 2, "math"),  # grouped heads: flash (half) or math
        (torch.bfloat16, 64, False, 2, "flash"),
    ],
)
def test_sdpa_backend_follows_cuda_rules(dtype, d, mask, kv_heads, expected):
    q, k, v = _qkv(dtype, d, kv_heads=kv_heads)
    attn_mask = torch.zeros(100, 100, dtype=dtype) if mask else None
    assert rules.sdpa_backend(q, k, v, attn_mask, kv_heads != 4) == expected


def test_fused_attention_outputs_are_the_documented_ones():
    """What the CUDA target saves: flash returns (out, logsumexp fp32 (B, H, Lq), ..., rng state);
    memory-efficient attention (out, logsumexp fp32 (B, H, ceil(Lq / 32) * 32), philox seed, offset)."""
    with FakeTensorMode():
        q, k, v = _qkv(torch.bfloat16)
        out, lse, *_, rng, unused, debug = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.1, True, False
        )
        assert out.shape == q.shape and lse.shape == (2, 4, 100) and lse.dtype == torch.float32
        assert rng.numel() * rng.element_size() == 16 and debug.numel() == 0
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.float(), k.float(), v.float(), None, True, 0.1, True
        )
        assert lse.shape == (2, 4, 128) and lse.dtype == torch.float32 and seed.numel() == offset.numel() == 1


class _DropoutAttention(nn.Module):
    """GPT-2-style attention with dropout: CPU SDPA takes the math path and keeps (L, L) tensors."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, L, D))


def _attention_step(amp=torch.bfloat16):
    return TrainStep(
        lambda: nn.Sequential(_DropoutAttention(), _DropoutAttention()),
        lambda d: torch.randn(2, 256, 64, device=d),
        lambda m, x: m(x).float().pow(2).mean(),
        amp_dtype=amp,
    )


@pytest.mark.parametrize("amp", [torch.bfloat16, None])
def test_cuda_target_keeps_no_attention_scores(amp):
    cpu = trace_step(_attention_step(amp))
    cuda = trace_step(_attention_step(amp), device="cuda")

    def scores(trace):
        return [r for r in trace.at_peak() if r[SHAPE][-2:] == (256, 256)]

    assert scores(cpu), "the CPU math path keeps (L, L) scores and dropout masks"
    assert not scores(cuda)
    lse = [r for r in cuda.records if r[SHAPE] == (2, 4, 256) and r[SAVED]]
    # two attentions, in each of the two steps the CUDA target traces (the first makes the optimizer state)
    assert len(lse) == 2 * 2, "each fused attention saves its fp32 log-sum-exp (B, H, L) for backward"
    # the tensors (the CUDA peak adds the libraries' workspaces, tens of MiB: a tiny model's whole peak)
    assert cuda.report.by_category["activations"] < cpu.report.by_category["activations"]
    assert all(r[0] % rules.CUDA_BLOCK == 0 for r in cuda.records)  # the caching allocator's blocks


class _GroupedAttention(nn.Module):
    """LLaMA-style grouped-query attention (8 query heads, 2 key/value heads), causal, no mask: what
    transformers' sdpa_attention_forward hands SDPA (``enable_gqa=True``)."""

    def __init__(self, dim=64, heads=8, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.d, bias=False)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, L, 2, self.kv_heads, self.d).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return y.transpose(1, 2).reshape(B, L, -1)


class _Saved:
    """(shape, dtype) of every tensor autograd saves inside the block, sorted."""

    def __init__(self):
        self.seen = []

    def __enter__(self):
        def pack(t):
            self.seen.append((tuple(t.shape), t.dtype))
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        self.seen.sort(key=str)


def test_fp32_grouped_query_attention_takes_the_math_path_with_its_probabilities():
    """CUDA in torch 2.11 runs SDPA with fp32 and enable_gqa on the math backend (flash and cuDNN take
    fp16/bf16 only; memory-efficient attention rejects differing head counts): it keeps the (L, S)
    probabilities and the key/value repeated to every query head. The fake CPU tensors would take the CPU
    flash kernel (which takes fp32 and grouped heads) and keep neither: a fp32 LLaMA step read low on the
    H200. The CUDA target's saved tensors equal a real run of the math backend on the CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    block, x = _GroupedAttention(), torch.randn(2, 128, 64)
    q = torch.randn(2, 8, 128, 8)
    assert rules.sdpa_backend(q, q[:, :2], q[:, :2], None, True) == "math"
    with sdpa_kernel(SDPBackend.MATH), _Saved() as math_path:
        block(x).sum().backward()
    with _Saved() as cpu_default:
        block(x).sum().backward()
    with FakeTensorMode(allow_non_fake_inputs=True), rules.CudaRules(), _Saved() as cuda_target:
        block(x).sum().backward()
    probabilities = ((2, 8, 128, 128), torch.float32)
    assert probabilities in math_path.seen and probabilities not in cpu_default.seen
    assert cuda_target.seen == math_path.seen


OPS = {
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
    "group_norm": lambda x: F.group_norm(x.view(4, 8, 8), 2),
    "softmax": lambda x: F.softmax(x, -1),
    "tensor.softmax": lambda x: x.softmax(-1),
    "log_softmax": lambda x: F.log_softmax(x, -1),
    "exp": torch.exp,
    "pow": lambda x: x.pow(2),
    "sum": lambda x: x.sum(),
    "cumsum": lambda x: x.cumsum(-1),
    "mse_loss": lambda x: F.mse_loss(x, x),
    "gelu": F.gelu,
    "silu": F.silu,
    "mean": lambda x: x.mean(-1),
    "linear": lambda x: F.linear(x, x),
    "matmul": lambda x: x @ x.T,
    "tanh": torch.tanh,
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_cuda_autocast_policy_matches_cudas_own_dispatcher(monkeypatch, name):
    """The CUDA target's autocast emulation (on CPU tensors) against CUDA autocast itself, run on fake CUDA
    tensors (forward needs no GPU; only CUDA's availability check is bypassed)."""
    import torch.cuda.amp.common as amp_common

    monkeypatch.setattr(amp_common, "amp_definitely_not_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    fn = OPS[name]
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in (torch.bfloat16, torch.float32):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                want = fn(torch.randn(4, 64, device="cuda", dtype=dtype)).dtype
            with rules.CudaRules(), torch.autocast("cpu", dtype=torch.bfloat16):
                got = fn(torch.randn(4, 64, dtype=dtype)).dtype
            assert got == want, (name, dtype, got, want)


def test_cuda_block_rounding():
    assert [rules.cuda_block_bytes(n) for n in (0, 1, 512, 513, 4096 + 1)] == [0, 512, 512, 1024, 4608]


def test_cuda_rules_reach_activation_checkpointings_recompute():
    """Checkpoint recomputes its block inside backward, where a TorchFunctionMode is not seen: the CUDA
    target enters its rules around the recompute too, so the recomputed layer_norm is fp32 like the saved
    one (torch.utils.checkpoint refuses a mismatch) and the estimate runs; with a bf16 autocast block the
    CUDA target's fp32 layer norms make it larger than the CPU kernels' estimate."""
    from memfit.ops.layers import checkpointed

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = nn.LayerNorm(256), nn.Linear(256, 256)

        def forward(self, x):
            return checkpointed(lambda y: self.lin(self.norm(y)), x)

    step = TrainStep(
        build_model=lambda: nn.Sequential(*[Block() for _ in range(3)]),
        make_batch=lambda d: torch.randn(64, 128, 256, device=d),
        loss=lambda m, b: m(b).float().pow(2).mean(),
        amp_dtype=torch.bfloat16,
    )
    cpu = estimate_training_step(step).peak_bytes
    cuda = estimate_training_step(step, device="cuda").peak_bytes
    assert cuda > cpu
    assert torch.utils.checkpoint.checkpoint.__module__ == "torch.utils.checkpoint"  # restored after


# ----------------------------------------------------------------------------------------------------
# The cuda extra's Mamba kernels: with them (the default) or the torch-op path a GPU without them takes
# ----------------------------------------------------------------------------------------------------


def _mbsnet_chunked_200f():
    pytest.importorskip("mbsnet_speech")
    from memfit.system import load_system

    (entry,) = [e for e in load_system("mbsnet-speech").budgets() if e.variant == "chunked-200f"]
    return entry


def _cuda_report(step, kernels_=None):
    """The CUDA estimate of a step for a run with these optional kernels (None: the whole cuda extra)."""
    from memfit.estimate.rules import assume_kernels
    from memfit.ops import registry

    with assume_kernels(registry.extra_kernels() if kernels_ is None else kernels_):
        return estimate_training_step(step, device="cuda")


def _cuda_peak(step, kernels_=None):
    return _cuda_report(step, kernels_).peak_bytes


@pytest.fixture
def torch_op_scan_peak(monkeypatch):
    """mbsnet chunked-200f's CUDA estimate for a GPU with no scan or conv kernel at all (no cuda extra, the
    Triton scan switched off): the torch-op scan and conv."""
    entry = _mbsnet_chunked_200f()
    monkeypatch.setenv("MEMFIT_DISABLE", "triton")
    return _cuda_peak(entry.step, frozenset())


def test_no_cuda_kernels_estimates_the_torch_op_path_and_the_default_the_extra(
    torch_op_scan_peak, capsys, monkeypatch
):
    import dataclasses

    from memfit import cli

    assert not torch.cuda.is_available()  # the default below is the one for a machine without a GPU
    entry = _mbsnet_chunked_200f()
    # the command over this one row (the paper-size seed baseline's trace alone took half the test's time)
    system = dataclasses.replace(cli.load_system("mbsnet-speech"), budgets=lambda: [entry])
    monkeypatch.setattr(cli, "load_system", lambda name: system)
    default, without = _cuda_peak(entry.step), _cuda_peak(entry.step, frozenset())
    assert without == torch_op_scan_peak
    # the allocator peaks: the tensors (0.431 and 1.012 GiB as the trace sums them), the caching
    # allocator's blocks, and the CUDA libraries' workspaces (two cuBLAS, one cuBLASLt: 65 MiB)
    assert round(default / 2**30, 3) == 0.496 and round(without / 2**30, 3) == 1.080
    # the header names the kernels of the extra this step calls (it has no window attention: no flash-attn)
    cases = [((), default, "with causal-conv1d, mamba-ssm"), (("--no_cuda_kernels",), without,
             "without the cuda extra's causal-conv1d, mamba-ssm")]  # fmt: skip
    for flag, peak, said in cases:  # the command prints these figures and says which kernels it assumed
        with pytest.raises(SystemExit):
            cli.main(["budget", "--system", "mbsnet-speech", "--device", "cuda", *flag])
        out = capsys.readouterr().out
        assert said in out.splitlines()[0] and f"{peak / 2**30:.3f}" in out.splitlines()[3], out


def test_preflight_on_a_gpu_without_mamba_ssm_estimates_the_torch_op_path(monkeypatch, torch_op_scan_peak):
    """The pre-flight on a (faked) CUDA device asks memfit.ops.registry what the GPU has."""
    from memfit.estimate import preflight
    from memfit.ops import registry

    from tests.fake_kernels import install

    entry = _mbsnet_chunked_200f()
    registry.reset(probes=True)
    for name in ("mamba_ssm", "causal_conv1d", "flash"):  # the cuda extra not installed
        install(monkeypatch, name, None)
    cuda, make = torch.device("cuda", 0), lambda batch, checkpointing: entry.step
    needs = preflight._needs(make, entry.batch, False, cuda)
    without = _cuda_report(entry.step, frozenset())
    assert without.peak_bytes == torch_op_scan_peak
    assert needs == without.cuda.total == without.cuda.reserved + without.cuda.context  # the card total
    # installed and probed fine: the fused kernels' figure
    for name in ("mamba_ssm", "causal_conv1d", "flash"):
        install(monkeypatch, name, lambda *a, **k: None)
    monkeypatch.setattr(registry, "probe", lambda impl, device: registry.ProbeResult(True, "faked"))
    assert registry.kernels_on(cuda) == registry.extra_kernels()
    needs = preflight._needs(make, entry.batch, False, cuda)
    assert needs == _cuda_report(entry.step).cuda.total < without.cuda.total
    registry.reset(probes=True)
