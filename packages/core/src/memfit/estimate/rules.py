"""What real kernels keep that a fake-tensor trace does not show, and the CUDA target's kernel choices.

A trace under ``FakeTensorMode`` allocates what each op's fake (meta) implementation returns. Two things
make that differ from a real run:

* **CPU kernels whose fake implementation under-reports.** oneDNN's LSTM (``aten.mkldnn_rnn_layer``, what
  ``nn.LSTM`` runs on the CPU) returns a workspace that its meta function makes 0 bytes long; the real one
  holds every time step's gates and states for backward. ``cpu_fixes`` gives the real size (the formula
  below, checked against the real kernel over shapes and dtypes in ``tests/test_kernels.py``).
* **The device.** A CUDA run takes other kernels than the CPU trace. Fake CUDA tensors cannot be traced
  through backward without a GPU (PyTorch 2.11's autograd engine asks the CUDA driver for a context), so the
  CUDA target traces fake CPU tensors and applies CUDA's rules itself (``CudaRules``):

  - ``F.scaled_dot_product_attention`` takes the backend CUDA's dispatcher would pick (``sdpa_backend``):
    flash attention (fp16/bf16, no explicit mask, head dim <= 256), else memory-efficient attention
    (fp16/bf16/fp32, masks allowed, head dim a multiple of 8, or 4 in fp32, as many key/value heads as
    query heads), else the math path. The math path runs as ``_scaled_dot_product_attention_math``
    (the same composite on every device) with only the math backend allowed: left to itself, SDPA on the
    fake CPU tensors would take the CPU flash kernel, which takes fp32 and grouped heads and keeps no
    probabilities (a fp32 LLaMA with grouped key/value heads read low against the H200). The fused
    kernels are called directly (``aten._scaled_dot_product_flash_attention`` /
    ``_scaled_dot_product_efficient_attention``), so autograd saves what they return: the output, the fp32
    log-sum-exp (batch, heads, queries; padded to a multiple of 32 queries for memory-efficient attention)
    and the dropout RNG state, never the (queries x keys) scores. cuDNN attention, which PyTorch prefers
    on H100/B200 with a recent cuDNN, keeps the same tensors as flash attention.
  - autocast follows CUDA's policy: the ops CUDA autocast runs in fp32 (layer_norm, group_norm, softmax,
    log_softmax, exp, pow, sum, cumsum, the losses, ...; ``CUDA_FP32_OPS``) get fp32 inputs, where CPU
    autocast would leave them in bf16/fp16.
  - an optimizer given neither ``foreach`` nor ``fused`` takes its foreach implementation, as it does on
    CUDA tensors (``torch.optim.optimizer._default_to_fused_or_foreach``).
  - ``F.dropout`` takes CUDA's fused kernel (``native_dropout``: a bool mask kept for backward), where the
    CPU path keeps a noise tensor of the input's dtype (``_dropout``): eager attention's dropout over
    (batch, heads, L, L) probabilities was counted twice over (Hugging Face GPT-2, eager attention, batch
    8 x 1024, bf16: 21985 MiB estimated against 20755 measured on an H200; 20717 with this rule).
  - every allocation is rounded as the caching allocator rounds it: up to a multiple of 512 bytes; the
    CUDA libraries' workspaces (``memfit.estimate.workspaces``) are added op by op, and the caching
    allocator is simulated over the step (``memfit.estimate.allocator``, ``cuda_memory``).
  - the Mamba scan and conv take the kernels the run will have (``assumed_target``): with the ``cuda`` extra's
    mamba_ssm / causal-conv1d (the default; on a GPU machine, what their probes say) the fused CPU
    kernels' fake ops stand in for them (both save their inputs and recompute); without, the torch-op path
    a GPU run then takes (``memfit.ops.scan``'s chunked scan holds several (batch, chunk, N, dim) buffers:
    mbsnet-speech's chunked-200f step needs 1.01 GiB instead of 0.43).

  - ``nn.GRU`` / ``nn.LSTM`` run ``_cudnn_rnn`` (``_CudnnRNN``): cuDNN's reserve and workspace
    (``memfit.estimate.workspaces``) with the calls' contiguous copies.

  Not modelled (the margin, ``memfit.estimate.fit.MARGIN``, covers them): cuDNN's convolution workspaces
  (bounded in the report's notes), kernels' internal temporaries (embedding backward's sort), the math
  path's dropout inside SDPA (the CPU's noise tensor stands in for CUDA's bool mask).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from memfit.estimate import workspaces
from memfit.ops import registry

PAGE = 4096  # oneDNN page-aligns each part of an RNN workspace
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this


# ----------------------------------------------------------------------------------------------------
# CPU: oneDNN's LSTM workspace
# ----------------------------------------------------------------------------------------------------


def _good_ld(dim: int, itemsize: int) -> int:
    """oneDNN's leading dimension: rounded up to 64 bytes, and moved off multiples of 256 elements."""
    per = 64 // itemsize
    ld = -(-dim // per) * per
    return ld + per if ld % 256 == 0 else ld


def mkldnn_lstm_workspace_bytes(steps: int, batch: int, input_size: int, hidden: int, dtype) -> int:
    """Bytes of the workspace one ``aten.mkldnn_rnn_layer`` call (one LSTM layer, one direction) keeps for
    backward: oneDNN's gates, hidden states, layer and iteration states, cell states and diff states, each
    part starting on a 4 KiB page. Fitted to and tested against the real kernel (tests/test_kernels.py)."""
    low = 2 if dtype in (torch.bfloat16, torch.float16) else 4  # the states' dtype; gates too
    rows_gates = steps * batch
    rows_states = 2 * (steps + 1) * batch  # (layers + 1) x (steps + 1) x batch
    wide = max(input_size, hidden)
    parts = [
        rows_gates * _good_ld(4 * hidden, low) * low,  # gates
        rows_gates * _good_ld(hidden, low) * low,  # hidden output per step
        rows_states * _good_ld(wide, low) * low,  # layer states
        rows_states * hidden * low,  # iteration states
        rows_states * hidden * 4,  # cell states (fp32)
        rows_states * _good_ld(wide, 4) * 4,  # diff layer states (fp32)
        rows_states * _good_ld(wide, 4) * 4,  # diff iteration states (fp32)
    ]
    return sum(-(-p // PAGE) * PAGE for p in parts)


def _mkldnn_rnn_layer(args, out):
    """The real-size workspace in place of the 0-byte one (training calls only)."""
    x, hidden, train = args[0], args[10], args[15]
    ws = out[3]
    if not train or ws.numel():
        return out
    # the input is time-major here even for batch_first LSTMs (PyTorch transposes before the layer calls)
    n = mkldnn_lstm_workspace_bytes(x.shape[0], x.shape[1], x.shape[2], hidden, x.dtype)
    return (*out[:3], ws.new_empty((n,), dtype=torch.uint8))


def _mkldnn_rnn_layer_backward(args, out):
    """oneDNN's LSTM backward returns fp32 gradients for bf16/fp16 inputs (autograd then casts them to the
    inputs' dtype); the meta function returns them in the inputs' dtype, half the size."""
    return tuple(
        o.new_empty(o.shape, dtype=torch.float32)
        if isinstance(o, torch.Tensor) and o.dtype in (torch.bfloat16, torch.float16)
        else o
        for o in out
    )


# op -> fix(args, out) -> out, applied to the fake result of the op
cpu_fixes: dict[int, Callable] = {
    id(torch.ops.aten.mkldnn_rnn_layer.default): _mkldnn_rnn_layer,
    id(torch.ops.aten.mkldnn_rnn_layer_backward.default): _mkldnn_rnn_layer_backward,
}


# ----------------------------------------------------------------------------------------------------
# CUDA target
# ----------------------------------------------------------------------------------------------------


def cuda_block_bytes(nbytes: int) -> int:
    """What the CUDA caching allocator reserves for a tensor of `nbytes`: 512-byte blocks (0 for 0)."""
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, enable_gqa: bool) -> str:
    """The backend PyTorch's CUDA dispatcher picks for these (post-autocast) inputs on an sm80+ GPU:
    "flash", "efficient" or "math" (PyTorch's sdp_utils: flash first, then memory-efficient).

    Grouped heads (``enable_gqa``, fewer key/value heads than query heads): in torch 2.11 only flash (and
    cuDNN attention, fp16/bf16 too) accept them; memory-efficient attention checks
    ``check_batch_size_and_num_heads_dense`` without GQA support, so fp32 with grouped heads takes the
    math path, which repeats the keys and values to every head (``repeat_interleave``) and keeps the
    (L, S) fp32 probabilities for backward. Native GQA in memory-efficient attention came after 2.11
    (pytorch/pytorch#191085)."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    same_dtype = q.dtype == k.dtype == v.dtype
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if q.dim() != 4 or not same_dtype or q.is_nested:
        return "math"
    gqa = q.shape[1] != k.shape[1]
    if half and attn_mask is None and d_qk == d_v and d_qk <= 256:
        return "flash"
    align = 8 if half else 4
    aligned = d_qk % align == 0 and d_v % align == 0
    if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and aligned and not (gqa or enable_gqa):
        return "efficient"
    return "math"


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as a CUDA run executes it (see the module docstring)."""
    if torch.is_autocast_enabled("cpu"):  # CUDA autocast runs SDPA in the low dtype, masks included
        low = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(low) if t.is_floating_point() else t for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(low)
    backend = sdpa_backend(query, key, value, attn_mask, enable_gqa)
    with torch.autocast("cpu", enabled=False):
        if backend == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if backend == "efficient":
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # what sdpa converts it to
                attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, -math.inf)
            if attn_mask is not None:
                attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
            need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, need_grad, dropout_p, is_causal, scale=scale
            )[0]
        # the math path, as CUDA runs it: the fake tensors are CPU tensors, whose dispatcher would pick the
        # CPU flash kernel (fp32 included, grouped heads included), which keeps no scores; only the math
        # backend allowed, the same composite (``_scaled_dot_product_attention_math``) runs here
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )


# CUDA autocast's fp32 ops (aten/src/ATen/autocast_mode.cpp, KERNEL_CUDA ... fp32 and fp32_set_opt_dtype),
# by the name their Python function has; CPU autocast leaves most of these in the low dtype
CUDA_FP32_OPS = frozenset(
    """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow __pow__ __rpow__
    __ipow__ softplus layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss
    cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss
    mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
    multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
    upsample_nearest2d upsample_nearest3d upsample_linear1d upsample_bilinear2d upsample_trilinear3d
    upsample_bicubic2d interpolate softmax log_softmax cumprod cumsum prod sum norm cross_entropy
    linalg_vector_norm linalg_matrix_norm""".split()  # noqa: SIM905 - a list of names, one per word
)


# the optional CUDA kernels (names of ``memfit.ops.registry`` records with a package) a CUDA estimate assumes
# when none are given (``assume_kernels``; None: every kernel of the cuda extra)
_assumed = contextvars.ContextVar[frozenset[str] | None]("memfit_cuda_kernels", default=None)


@contextlib.contextmanager
def assume_kernels(kernels: frozenset[str]) -> Iterator[None]:
    """CUDA estimates inside assume the run has these optional kernels (the commands' ``--no_cuda_kernels``,
    the pre-flight: what the GPU at hand has)."""
    token = _assumed.set(frozenset(kernels))
    try:
        yield
    finally:
        _assumed.reset(token)


def assumed_target() -> registry.Target:
    """The CUDA run a CUDA estimate made now stands for."""
    kernels = _assumed.get()
    card = workspaces.assumed_card()  # its capability decides what the kernels take (flash-attn: sm80+)
    return registry.Target("cuda", registry.extra_kernels() if kernels is None else kernels, card.capability)


def _dropout(func, args, kwargs):
    """Dropout as a CUDA run executes it. ``at::dropout`` (aten/src/ATen/native/Dropout.cpp) takes the
    fused kernel, ``native_dropout``, only where ``is_fused_kernel_acceptable``: a CUDA (XPU, lazy,
    privateuse1) input, 0 < p < 1, non-empty. The fused kernel keeps a bool mask for backward (1 byte per
    element); the CPU path (``_dropout<false>``) keeps a noise tensor of the input's dtype (2 or 4 bytes per
    element: bf16 attention probabilities' dropout kept twice the bytes a CUDA run keeps). In-place dropout
    (``dropout_``) has no fused kernel on either device."""
    names = ("input", "p", "training" if func is F.dropout else "train", "inplace")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x, p = bound.get("input"), bound.get("p", 0.5)
    train = bound.get("training", bound.get("train", True))
    if bound.get("inplace") or not isinstance(x, torch.Tensor) or not (train and 0 < p < 1 and x.numel() > 0):
        return func(*args, **kwargs)
    return torch.native_dropout(x, p, True)[0]


_DROPOUTS = (F.dropout, torch.dropout)
_RNNS = {torch._C._VariableFunctions.gru: "gru", torch._C._VariableFunctions.lstm: "lstm"}  # what _VF calls


def _time_major(x: torch.Tensor, batch_first: bool) -> torch.Tensor | None:
    """RNN.cpp's ``input.transpose(0, 1).contiguous()`` of a batch-first tensor: a new (T, B, ...) copy;
    None when the input is time-major already (no copy made)."""
    return x.transpose(0, 1).contiguous() if batch_first else None


class _CudnnRNN(torch.autograd.Function):
    """What ``_cudnn_rnn`` and ``_cudnn_rnn_backward`` allocate (aten/src/ATen/native/cudnn/RNN.cpp), on
    fake tensors (the op's meta kernel returns a 0-byte reserve and its backward has no fake kernel).

    Forward: ``input.contiguous()`` of the time-major input (a transient copy for batch-first input), the
    output (T, B, D*H), hy (and cy for an LSTM), and the reserve, which autograd keeps for backward with
    the input, the hidden state and the output (derivatives.yaml ``_cudnn_rnn``: result3); its size is
    ``workspaces.cudnn_rnn_reserve_bytes`` (cuDNN's, measured exact on 192 shapes). Backward: dx, dhx
    (dcx) and one flat weight gradient the parameters' gradients are views of. cuDNN's workspace (one
    size, ``workspaces.cudnn_rnn_workspace_bytes``'s measured table, 8-250 MiB) lives through each of the
    three calls, with the calls' contiguous copies: the time-major input (forward and both backward calls,
    batch-first input) and the output gradient (backward input)."""

    @staticmethod
    def forward(ctx, mode, hidden, layers, bidirectional, batch_first, x, hx, cx, *weights):
        D = 2 if bidirectional else 1
        T, B = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
        copy = _time_major(x, batch_first)  # freed as the call returns
        out = x.new_empty((T, B, D * hidden))
        hy = x.new_empty((layers * D, B, hidden))
        cy = x.new_empty((layers * D, B, hidden)) if cx is not None else None
        nbytes = workspaces.cudnn_rnn_reserve_bytes(
            mode, hidden, T, B, layers, x.element_size(), bidirectional
        )
        ctx.workspace = workspaces.cudnn_rnn_workspace_bytes(
            mode, x.shape[-1], hidden, T, B, layers, bidirectional
        )
        shape = (mode, x.shape[-1], hidden, T, B, layers, bidirectional)
        outside = workspaces.rnn_workspace_note(*shape, x.dtype)
        if outside:
            workspaces.note(f"rnn {shape}", outside)
        workspace = x.new_empty((ctx.workspace,), dtype=torch.uint8)  # before the reserve, as RNN.cpp
        reserve = x.new_empty((nbytes,), dtype=torch.uint8)
        del workspace, copy  # cuDNN's workspace and the time-major input die with the call
        ctx.batch_first = batch_first
        # derivatives.yaml ``_cudnn_rnn`` keeps the weights too (autocast's fp16 copy lives until backward)
        ctx.save_for_backward(x, hx, cx, out, reserve, *weights)
        ctx.n_weights = len(weights)
        ctx.weights = [(w.shape, w.dtype) for w in weights]
        return (out.transpose(0, 1) if batch_first else out), hy, cy

    @staticmethod
    def backward(ctx, dout, dhy, dcy):
        x, hx, cx = ctx.saved_tensors[:3]
        # _cudnn_rnn_backward_input: dx, dhx (dcx); contiguous time-major copies of the output gradient and
        # (batch-first) the input, and the workspace, all freed as it returns
        dx = torch.empty_like(x)
        dhx = torch.empty_like(hx)
        dcx = None if cx is None else torch.empty_like(cx)
        first = ctx.batch_first
        dy = dout.transpose(0, 1).contiguous() if first else dout.contiguous()
        xt = _time_major(x, first)
        workspace = x.new_empty((ctx.workspace,), dtype=torch.uint8)
        del dy, xt, workspace
        # _cudnn_rnn_backward_weight: one flat weight gradient (the parameters' gradients are its views),
        # the input's copy again and the workspace
        xt = _time_major(x, first)
        total = sum(math.prod(shape) for shape, _ in ctx.weights)
        flat = x.new_zeros((total,), dtype=ctx.weights[0][1])
        workspace = x.new_empty((ctx.workspace,), dtype=torch.uint8)
        del xt, workspace
        grads, at = [], 0
        for shape, _ in ctx.weights:
            n = math.prod(shape)
            grads.append(flat[at : at + n].view(shape))
            at += n
        return None, None, None, None, None, dx, dhx, dcx, *grads


def _autocast_rnn_inputs(x, hx, cx, weights):
    """What CUDA autocast hands ``_cudnn_rnn`` (aten/src/ATen/cudnn/AutocastRNN.cpp
    ``_cudnn_rnn_cast_reflatten``, registered for the Autocast key): fp16 whatever autocast's dtype (bf16
    included): the input and hidden state cast (``cached_cast(at::kHalf, ...)``), and the weights copied
    into one new fp16 flat buffer whose views cuDNN takes (``copy_weights_to_flat_buf_views`` with
    ``allow_type_change``, autograd-exposed: the buffer is kept for backward and the weights' gradients are
    cast back to their dtype). The trace's CPU autocast would have run the RNN in fp32."""
    half = torch.float16
    total = sum(w.numel() for w in weights)
    flat = weights[0].new_empty((total,), dtype=half)
    at = 0
    for w in weights:
        flat[at : at + w.numel()].copy_(w.reshape(-1))
        at += w.numel()
    views, at = [], 0
    for w in weights:
        views.append(flat[at : at + w.numel()].view(w.shape))
        at += w.numel()
    return x.to(half), hx.to(half), None if cx is None else cx.to(half), views


def _rnn(name: str, args: tuple, kwargs: dict):
    """``_VF.gru`` / ``_VF.lstm`` as CUDA runs them: ``_cudnn_rnn`` whenever cuDNN takes the input
    (``cudnn_is_acceptable``: float, half or double; the default), with what it keeps (``_CudnnRNN``);
    under autocast in fp16 (``_autocast_rnn_inputs``). Packed sequences and LSTM projections keep the
    traced CPU path."""
    if kwargs or len(args) != 9 or not isinstance(args[3], bool):
        return None  # the packed-sequence signature (input, batch_sizes, hx, params, has_biases, ...)
    x, hx, weights, bias, layers, dropout, train, bidirectional, batch_first = args
    cx = None
    if name == "lstm":
        hx, cx = hx
        if hx.shape[-1] != cx.shape[-1]:
            return None  # proj_size
    if x.dtype not in (torch.float32, torch.float16, torch.float64, torch.bfloat16) or x.dim() != 3:
        return None
    hidden = hx.shape[-1]
    if torch.is_autocast_enabled("cpu") and x.dtype in (torch.float32, torch.bfloat16):
        x, hx, cx, weights = _autocast_rnn_inputs(x, hx, cx, weights)
    out, hy, cy = _CudnnRNN.apply(name, hidden, layers, bidirectional, batch_first, x, hx, cx, *weights)
    return (out, hy) if cx is None else (out, hy, cy)


class CudaRules(TorchFunctionMode):
    """The CUDA target's rules on a CPU fake-tensor trace: SDPA backends, dropout's fused kernel and
    CUDA's autocast policy."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func is torch._C._nn.scaled_dot_product_attention:
            return _sdpa(*args, **kwargs)
        if func in _DROPOUTS:
            return _dropout(func, args, kwargs)
        if func in _RNNS:
            out = _rnn(_RNNS[func], args, kwargs)
            if out is not None:
                return out
        if torch.is_autocast_enabled("cpu") and getattr(func, "__name__", "") in CUDA_FP32_OPS:
            low = torch.get_autocast_dtype("cpu")

            def up(a):
                if isinstance(a, torch.Tensor) and a.dtype == low:
                    return a.float()
                if isinstance(a, (list, tuple)):
                    return type(a)(up(x) for x in a)
                return a

            args, kwargs = up(args), {k: up(v) for k, v in kwargs.items()}
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_rules(target: registry.Target | None = None) -> Iterator[None]:
    """CudaRules for the whole step, activation checkpointing's recompute included: PyTorch runs that
    recompute inside backward, where a TorchFunctionMode is not seen, so every non-reentrant checkpoint
    gets a context_fn that enters the rules around it (the saved and recomputed tensors then agree). The
    hook is ``torch.utils.checkpoint._checkpoint_without_reentrant_generator``, which ``checkpoint`` looks
    up at each call: it also reaches callers that imported ``checkpoint`` itself before the estimate
    (transformers' ``gradient_checkpointing_enable``). ``target``: the CUDA run the trace stands for (None:
    ``assumed_target()``), which the ops' registry reads to choose each op's implementation as that run
    would."""
    module = torch.utils.checkpoint
    real = module._checkpoint_without_reentrant_generator

    def generator(fn, preserve_rng_state=True, context_fn=module.noop_context_fn, *args, **kwargs):
        def with_rules():
            forward, recompute = context_fn()

            @contextlib.contextmanager
            def recompute_with_rules() -> Iterator[None]:
                with recompute, CudaRules():
                    yield

            return forward, recompute_with_rules()

        return real(fn, preserve_rng_state, with_rules, *args, **kwargs)

    module._checkpoint_without_reentrant_generator = generator
    optimizers = _optimizers_default_to_cuda()
    try:
        with registry.traced_as(target if target is not None else assumed_target()), CudaRules():
            yield
    finally:
        module._checkpoint_without_reentrant_generator = real
        for mod, original in optimizers:
            mod._default_to_fused_or_foreach = original


def _default_to_fused_or_foreach_cuda(params, differentiable: bool, use_fused: bool = False):
    """``torch.optim.optimizer._default_to_fused_or_foreach`` for tensors that stand for CUDA tensors: an
    optimizer given neither ``foreach`` nor ``fused`` runs its foreach implementation on CUDA (one
    ``_foreach_*`` op over all parameters, whose intermediates are as large as the parameters), where the
    fake CPU tensors would take the per-parameter loop."""
    if torch.jit.is_scripting() or differentiable:
        return False, False
    tensors = all(p is None or isinstance(p, torch.Tensor) for p in params)
    fused = use_fused and tensors and all(p is None or torch.is_floating_point(p) for p in params)
    return fused, not fused and tensors


def _optimizers_default_to_cuda() -> list[tuple]:
    """Point every torch.optim module's imported ``_default_to_fused_or_foreach`` at the CUDA one; returns
    (module, original) pairs to restore."""
    swapped = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch.optim") and hasattr(mod, "_default_to_fused_or_foreach"):
            swapped.append((mod, mod._default_to_fused_or_foreach))
            mod._default_to_fused_or_foreach = _default_to_fused_or_foreach_cuda
    return swapped


# ----------------------------------------------------------------------------------------------------
# Libraries that take another path when they see a fake tensor
# ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def real_run_paths() -> Iterator[None]:
    """Make libraries that branch on ``isinstance(x, FakeTensor)`` take the path a real run takes.

    transformers (5.x) checks for packed sequences (several sequences in one row, found from the position
    ids) only when it is not tracing, and treats a fake tensor as tracing: under fake tensors every causal
    LM then builds a dense (batch, 1, T, T) mask and SDPA loses its `is_causal` fast path. A training step
    without explicit position ids has one sequence per row, which is what a real run finds."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    original = masking.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids):
        if isinstance(position_ids, FakeTensor):
            return None
        return original(position_ids)

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original
