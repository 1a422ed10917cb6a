"""What a CUDA training step allocates that a fake-tensor trace does not show: the CUDA libraries'
workspaces, keyed by what the trace does show (the aten op, its arguments, and which host thread runs it);
and the card an estimate is for (its compute capability and its CUDA context).

Every rule names its source. "2.11 source" is PyTorch's source of the 2.11 line; where the torch
2.11.0+cu130 wheel could confirm a number it was read from the wheel itself (its headers under
``torch/include``, or its ``libtorch_cuda.so`` disassembled). "Measured" is a reading on an NVIDIA H200
(torch 2.11.0+cu130, cuDNN 9.19.0, cuFFT 12.0, driver 580.159.04) on 2026-11-26, recorded in
``packages/core/tests/data/h200-2026-11-26``: a property of the library or the card, not of PyTorch's
source, that may change with either.

Sizes are the bytes requested from the caching allocator (``memfit.estimate.allocator`` rounds them). A
"persistent" allocation lives until the process ends; a "transient" one only while its op runs.

Modelled:

* **cuBLAS**: one workspace per (handle, stream), one handle per host thread: the forward/optimizer thread
  and the autograd engine's device thread each allocate one at their first matmul (32 MiB on compute
  capability 9.0, 8.125 MiB elsewhere);
* **cuBLASLt**: 1 MiB per thread at its first ``addmm`` that takes the Lt path (a Linear with a bias);
* **cuFFT**: the input clone every complex-to-real transform makes (``torch.istft``, ``irfft``), and the
  work area, 0 for the transform sizes measured (n <= 8192) and one complex signal above;
* **the CUDA context**: a measured constant per card (``Card.context_bytes``), outside the allocator.

* **cuDNN's RNN reserve and workspace**: the reserve by a formula exact on 192 recorded shapes, the
  workspace by a table measured on 128 shapes read as cuDNN's terms (8 MiB per layer and direction, the
  weights, a per-(T * B) slope); a shape outside the measured ones says so in the report's notes.

Not modelled, because no source decides them and a fake trace cannot ask the library (see
docs/your-own-model.md, "GPU accuracy"): cuDNN's convolution workspaces (chosen by cuDNN's heuristics at
run time; measured up to 12.7 MiB per call on ResNet-50; the report's notes bound them for the step),
flash and memory-efficient attention's internal temporaries, the context's growth as kernels load lazily
(+110-240 MiB measured after a few steps).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping

import torch

from memfit.errors import UsageError

KiB = 1024
MiB = 1024 * 1024

# ----------------------------------------------------------------------------------------------------
# The card
# ----------------------------------------------------------------------------------------------------

#: Device memory in use that PyTorch's allocator does not reserve: ``total - free`` (cudaMemGetInfo) minus
#: ``memory_reserved()``, right after ``torch.cuda.init()``. Measured on one NVIDIA H200, driver
#: 580.159.04, torch 2.11.0+cu130 (CUDA 13.0 runtime), 2026-11-26: 552,402,944 B = 526.8 MiB. What sets
#: it is the driver's (per-SM local memory for the default stack size, printf FIFO, device malloc heap),
#: so it is a measured constant of (card, driver, torch), not derived. It grows while a step first runs
#: its kernels (lazy module loading, the CUDA default on Linux since 12.2; cuBLAS/cuDNN/cuFFT handles):
#: 640-770 MiB after three steps of the recorded programs. The margin (``memfit.estimate.fit.MARGIN``)
#: covers that growth.
H200_CONTEXT_BYTES = 552_402_944
H200_CONTEXT_NOTE = (
    "measured right after torch.cuda.init() on an NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130, "
    "2026-11-26"
)


@dataclasses.dataclass(frozen=True)
class Card:
    """The GPU a CUDA estimate is for: the compute capability picks the libraries' workspace sizes; the
    context is the memory the CUDA context takes outside PyTorch's allocator."""

    name: str
    capability: tuple[int, int]
    context_bytes: int
    context_note: str

    @property
    def sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    def describe(self) -> str:
        return f"{self.name} ({self.sm})"


#: Cards by the names users type; capabilities from NVIDIA's CUDA GPU list (developer.nvidia.com/cuda-gpus).
#: The context was measured on the H200 only; other cards use that reading, and say so.
CARD_CAPABILITIES: dict[str, tuple[str, tuple[int, int]]] = {
    "h200": ("NVIDIA H200", (9, 0)),
    "h100": ("NVIDIA H100", (9, 0)),
    "gh200": ("NVIDIA GH200", (9, 0)),
    "a100": ("NVIDIA A100", (8, 0)),
    "a30": ("NVIDIA A30", (8, 0)),
    "a10": ("NVIDIA A10", (8, 6)),
    "a10g": ("NVIDIA A10G", (8, 6)),
    "a40": ("NVIDIA A40", (8, 6)),
    "rtx3090": ("NVIDIA GeForce RTX 3090", (8, 6)),
    "l4": ("NVIDIA L4", (8, 9)),
    "l40s": ("NVIDIA L40S", (8, 9)),
    "rtx4090": ("NVIDIA GeForce RTX 4090", (8, 9)),
    "b200": ("NVIDIA B200", (10, 0)),
    "v100": ("NVIDIA V100", (7, 0)),
    "t4": ("NVIDIA T4", (7, 5)),
}
DEFAULT_CARD = "h200"


def card(name: str | None = None) -> Card:
    """The card for ``--gpu NAME``: a name (h100, a100, l4, ...), a compute capability (``9.0``, ``sm90``);
    None: this machine's GPU when there is one, else an H200 (sm90, what the recorded measurements used)."""
    if name is None:
        if torch.cuda.is_available():
            return card_of_device(torch.device("cuda", torch.cuda.current_device()))
        name = DEFAULT_CARD
    key = name.strip().lower().replace(" ", "").replace("-", "").removeprefix("nvidia")
    if key in CARD_CAPABILITIES:
        full, cap = CARD_CAPABILITIES[key]
        return _card(full, cap)
    m = re.fullmatch(r"(?:sm_?)?(\d{1,2})\.?(\d)", key)
    if m is None:
        known = ", ".join(sorted(CARD_CAPABILITIES))
        raise UsageError(
            f"error: --gpu {name!r} is not a card this estimate knows; give one of {known}, or a compute "
            "capability such as 9.0 or sm86"
        )
    cap = (int(m.group(1)), int(m.group(2)))
    return _card(f"a compute capability {cap[0]}.{cap[1]} GPU", cap)


_card_var = contextvars.ContextVar[Card | None]("memfit_card", default=None)


@contextlib.contextmanager
def assume_card(c: Card | None) -> Iterator[None]:
    """CUDA estimates inside are for this card (the commands' ``--gpu``; None: ``card()``'s default)."""
    token = _card_var.set(c)
    try:
        yield
    finally:
        _card_var.reset(token)


def assumed_card() -> Card:
    """The card a CUDA estimate made now is for."""
    c = _card_var.get()
    return card() if c is None else c


def card_of_device(device: torch.device) -> Card:
    """The card of a CUDA device (its name and capability); the default card where CUDA is not there
    (a device named in a test)."""
    if not torch.cuda.is_available():
        return card(DEFAULT_CARD)
    return _card(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))


def _card(name: str, cap: tuple[int, int]) -> Card:
    note = H200_CONTEXT_NOTE
    if "H200" not in name:
        note += "; not measured on this card, the H200's reading stands in"
    return Card(name, (int(cap[0]), int(cap[1])), H200_CONTEXT_BYTES, note)


# ----------------------------------------------------------------------------------------------------
# cuBLAS / cuBLASLt workspaces
# ----------------------------------------------------------------------------------------------------

#: aten ops whose CUDA kernels call ``at::cuda::getCurrentCUDABlasHandle()`` (2.11 source,
#: aten/src/ATen/native/cuda/Blas.cpp: ``addmm_out_cuda_impl`` for mm/addmm/_addmm_activation,
#: ``baddbmm_out_cuda_impl`` for bmm/baddbmm, addbmm, addmv/mv, dot/vdot; ``_scaled_mm`` and ``_int_mm``
#: through CUDABlas.cpp). linear, matmul and einsum decompose into these before they reach the device.
CUBLAS_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_scaled_mm", "_int_mm",
     "_addmm_activation"}
)  # fmt: skip
LT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def parse_cublas_workspace_config(value: str) -> int | None:
    """CUBLAS_WORKSPACE_CONFIG=":SIZE:COUNT[:SIZE:COUNT...]" -> sum(SIZE KiB * COUNT) bytes, as
    CublasHandlePool.cpp ``parseChosenWorkspaceSize`` reads it (regex ``:([0-9]+):([0-9]+)``); None when
    it does not parse (PyTorch then warns and uses the default)."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", value)
    if not pairs:
        return None
    return sum(int(s) * 1024 * int(c) for s, c in pairs)


def cublas_workspace_bytes(capability: tuple[int, int] = (9, 0), env: Mapping[str, str] | None = None) -> int:
    """Bytes of the cuBLAS workspace PyTorch allocates per (cuBLAS handle, stream).

    2.11 source: aten/src/ATen/cuda/CublasHandlePool.cpp ``parseChosenWorkspaceSize``: without
    CUBLAS_WORKSPACE_CONFIG the default is ``sm90 ? 4096 * 8 * 1024 : 4096 * 1024 * 2 + 16 * 1024 * 8``
    where sm90 means compute capability exactly 9.0 (``major == 9 && minor == 0``): 32 MiB on H100/H200,
    8.125 MiB (8,519,680 B) on every other GPU (A100, L4, Blackwell 10.0 included). Confirmed in the 2.11
    wheel: ``parseChosenWorkspaceSize`` loads 0x820000 and 0x2000000 and compares (major, minor) with 9.
    ``getNewWorkspace`` takes it from ``c10::cuda::CUDACachingAllocator::get()->allocate(...)``: an
    ordinary allocator block, counted in ``memory_allocated``, kept in ``cublas_handle_stream_to_workspace()``
    until ``torch._C._cuda_clearCublasWorkspaces()`` (``empty_cache`` does not free it). Measured (H200): a
    33,554,432-byte allocation right after the first forward addmm's output, and another right after the
    first backward mm's output, on the autograd thread.
    """
    env = os.environ if env is None else env
    val = env.get("CUBLAS_WORKSPACE_CONFIG")
    if val is not None:
        parsed = parse_cublas_workspace_config(val)
        if parsed is not None:
            return parsed
    if tuple(capability) == (9, 0):
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


_TRUE = ("1", "true", "on", "yes", "y")
_FALSE = ("0", "false", "off", "no", "n")


def cublaslt_workspace_bytes(
    capability: tuple[int, int] = (9, 0), env: Mapping[str, str] | None = None
) -> int:
    """Bytes of the separate cuBLASLt workspace per (handle, stream); 0 when it shares cuBLAS's.

    2.11 source: CublasHandlePool.cpp ``parseCUDABlasLtWorkspaceSize``: CUBLASLT_WORKSPACE_SIZE in KiB,
    default 1024 KiB = 1 MiB (the 2.11 wheel loads 0x400; no per-GPU default), and
    ``getCUDABlasLtWorkspaceSize``: unless TORCH_CUBLASLT_UNIFIED_WORKSPACE is set false, capped at the
    cuBLAS workspace size. ``getCUDABlasLtWorkspace``: only with TORCH_CUBLASLT_UNIFIED_WORKSPACE set true
    does Lt reuse the cuBLAS workspace; by default it allocates its own block through the caching
    allocator, keyed by (handle, stream). 1 MiB is <= kSmallSize: a small-pool block. Measured (H200): one
    1,048,576-byte allocation right after the cuBLAS workspace of the first forward Linear.
    """
    env = os.environ if env is None else env
    unified = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if unified is not None and unified.strip().lower() in _TRUE:
        return 0
    size = 1024
    val = env.get("CUBLASLT_WORKSPACE_SIZE")
    if val is not None and val.strip().isdigit():
        size = int(val)
    size *= 1024
    if unified is None or unified.strip().lower() not in _FALSE:
        size = min(size, cublas_workspace_bytes(capability, env))
    return size


def addmm_takes_lt(args: tuple, kwargs: Mapping) -> bool:
    """Whether ``aten.addmm(self, mat1, mat2, beta=, alpha=)`` runs on cuBLASLt (and so allocates the Lt
    workspace). 2.11 source, aten/src/ATen/native/cuda/Blas.cpp ``isInputCompliesAddmmCudaLt``: beta == 1,
    a 2-D contiguous result (a new one: not ``self``), a contiguous bias that is 1-D (or squeezes to 1-D)
    with the output's column count, fp32/fp64/fp16/bf16, and both matrices larger than 1 in each dimension
    (CUDA >= 12.1 drops the leading-dimension rule). A Linear with a bias on 2-D or contiguous 3-D input
    is such a call (aten/src/ATen/native/Linear.cpp: ``addmm`` / ``_flatten_nd_linear``);
    DISABLE_ADDMM_CUDA_LT=1 turns it off (``isGloballyDisabledAddmmCudaLt``)."""
    if len(args) < 3 or os.environ.get("DISABLE_ADDMM_CUDA_LT") == "1":
        return False
    bias, mat1, mat2 = args[:3]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    if beta != 1 or not all(isinstance(t, torch.Tensor) for t in (bias, mat1, mat2)):
        return False
    if mat1.dim() != 2 or mat2.dim() != 2 or mat1.dtype not in LT_DTYPES:
        return False
    squeezed = [s for s in bias.shape if s != 1]
    bias_ok = (
        bias.is_contiguous() and bias.dim() >= 1 and len(squeezed) <= 1 and bias.shape[-1] == mat2.shape[1]
    )
    return bias_ok and min(mat1.shape) > 1 and min(mat2.shape) > 1


# ----------------------------------------------------------------------------------------------------
# cuFFT
# ----------------------------------------------------------------------------------------------------

#: the largest transform length measured to need no cuFFT work area (H200, cuFFT 12.0, fp32, 1-D)
CUFFT_NO_WORKAREA_MAX = 8192


def cufft_transients(op: str, args: tuple, out: torch.Tensor) -> list[tuple[int, str]]:
    """Transient allocations of one ``aten._fft_r2c / _fft_c2r / _fft_c2c`` call on CUDA, in order, as
    (bytes, what); each is freed when the op returns.

    2.11 source, aten/src/ATen/native/cuda/SpectralOps.cpp:
    * ``_fft_c2r_cufft``: "Complex to real FFTs may overwrite the input buffer, so must always clone
      (gh-34551)": ``temp = self.clone(MemoryFormat::Contiguous)``: one copy of the complex input.
    * ``_exec_fft``: ``workspace = at::empty({config->workspace_size()}, kByte)`` through the caching
      allocator; the size is cuFFT's (``cufftXtMakePlanMany`` with auto-allocation off, CuFFTPlanCache.h).
      The plan cache holds no allocator memory.
    cuFFT documents no formula for the work area and its size query needs a device. Measured (H200,
    cuFFT 12.0, fp32, batched 1-D R2C and C2R): 0 bytes for every n <= 8192 tried (256 ... 8192; batch 1,
    64, 2000), about one complex signal at n = 65536 (batch 1 and 64; 0 at batch 2000). So: 0 up to 8192,
    one complex signal above (outside the measured points, an upper reading).
    """
    x = args[0]
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        return []
    signal = max(x.numel() * x.element_size(), out.numel() * out.element_size())
    dims = args[1] if len(args) > 1 else ()
    dims = [dims] if isinstance(dims, int) else list(dims)
    if op == "_fft_c2r":
        n = args[3] if len(args) > 3 else out.shape[-1]
    else:
        n = max((x.shape[d] for d in dims), default=x.shape[-1] if x.dim() else 1)
    found = []
    if op == "_fft_c2r":
        found.append((x.numel() * x.element_size(), "cuFFT: complex-to-real input clone"))
    if n > CUFFT_NO_WORKAREA_MAX:
        complex_signal = signal if op != "_fft_r2c" else out.numel() * out.element_size()
        found.append((complex_signal, "cuFFT work area"))
    return found


# ----------------------------------------------------------------------------------------------------
# cuDNN RNN reserve (used where a step's GRU/LSTM runs cuDNN)
# ----------------------------------------------------------------------------------------------------


def cudnn_rnn_reserve_bytes(
    mode: str, hidden: int, seq: int, batch: int, layers: int, itemsize: int, bidirectional: bool = False
) -> int:
    """Bytes of the reserve ``_cudnn_rnn`` returns in training and autograd keeps for backward.

    2.11 source, aten/src/ATen/native/cudnn/RNN.cpp ``_cudnn_rnn``: with ``fn_train``,
    ``cudnnGetRNNTempSpaceSizes(..., CUDNN_FWD_MODE_TRAINING, ...)`` gives (workspace, reserve) and
    ``reserve = at::empty(reserve_size, kByte)`` is an output; the size is cuDNN's (torch's meta kernel
    returns 0 bytes: "TODO: Query cudnnGetRNNTrainingReserveSize"). Measured (H200, cuDNN 9.19.0, no
    projection), exact to the byte on 192 shapes (GRU and LSTM, input 64 and 256, hidden 128 and 512,
    T 50 and 200, batch 8 and 32, 1 and 2 layers, uni- and bidirectional, fp32 and bf16):
        GRU:  itemsize * T * B * H * D * (6 * L + (L - 1)) + 256
        LSTM: itemsize * T * B * H * D * (5 * L + (L - 1)) + 256
    D = 2 when bidirectional. RNN_TANH / RNN_RELU were not measured (2 values per unit is a guess)."""
    per_layer = {"gru": 6, "lstm": 5, "rnn_tanh": 2, "rnn_relu": 2}[mode]
    dirs = 2 if bidirectional else 1
    units = per_layer * layers + (layers - 1)
    return itemsize * seq * batch * hidden * units * dirs + 256


# cuDNN's RNN workspace: RNN.cpp's ``_cudnn_rnn`` (training), ``_cudnn_rnn_backward_input`` and
# ``_cudnn_rnn_backward_weight`` each ask cudnnGetRNNTempSpaceSizes(..., CUDNN_FWD_MODE_TRAINING, ...) for
# the same workspace size and allocate it (``at::empty(workspace_size, kByte)``) for the call only. cuDNN
# documents no formula and the query needs a GPU, so the size is a measured table: an H200, cuDNN 9.19.0,
# fp32, 2026-11-26, one line a + b * T * B (bytes) per (mode, directions, layers, hidden, input), fitted by
# tools/cudnn_rnn_table.py from packages/core/tests/data/h200-2026-11-26/rnn.json.gz (128 shapes, T 50/200,
# batch 8/32; every reading within 8.5% of its line, most within 2%).
CUDNN_RNN_WORKSPACE: dict[tuple, tuple[int, int]] = {
    ("gru", 1, 1, 128, 64): (8664747, 9786),
    ("gru", 1, 1, 128, 256): (9494693, 11691),
    ("gru", 1, 1, 512, 64): (12046084, 8739),
    ("gru", 1, 1, 512, 256): (13225732, 10275),
    ("gru", 1, 2, 128, 64): (17536668, 10261),
    ("gru", 1, 2, 128, 256): (18002386, 12275),
    ("gru", 1, 2, 512, 64): (26878788, 8511),
    ("gru", 1, 2, 512, 256): (28211168, 9248),
    ("gru", 2, 1, 128, 64): (17710575, 12773),
    ("gru", 2, 1, 128, 256): (17959077, 16479),
    ("gru", 2, 1, 512, 64): (24008085, 25086),
    ("gru", 2, 1, 512, 256): (26440909, 25789),
    ("gru", 2, 2, 128, 64): (36265458, 13742),
    ("gru", 2, 2, 128, 256): (36079468, 17457),
    ("gru", 2, 2, 512, 64): (60284115, 25331),
    ("gru", 2, 2, 512, 256): (62428088, 26906),
    ("lstm", 1, 1, 128, 64): (8829544, 11022),
    ("lstm", 1, 1, 128, 256): (9601281, 11715),
    ("lstm", 1, 1, 512, 64): (13151958, 10734),
    ("lstm", 1, 1, 512, 256): (14916617, 11333),
    ("lstm", 1, 2, 128, 64): (18239445, 10946),
    ("lstm", 1, 2, 128, 256): (18231345, 11830),
    ("lstm", 1, 2, 512, 64): (30357009, 10635),
    ("lstm", 1, 2, 512, 256): (31929873, 11403),
    ("lstm", 2, 1, 128, 64): (17670378, 15647),
    ("lstm", 2, 1, 128, 256): (18456810, 16415),
    ("lstm", 2, 1, 512, 64): (26781410, 29095),
    ("lstm", 2, 1, 512, 256): (30081652, 29832),
    ("lstm", 2, 2, 128, 64): (36126677, 15678),
    ("lstm", 2, 2, 128, 256): (37007525, 16474),
    ("lstm", 2, 2, 512, 64): (69290947, 29261),
    ("lstm", 2, 2, 512, 256): (72436675, 30029),
}


#: what cuDNN's RNN workspace takes per layer and direction whatever the shape: the constant of every line in
#: ``CUDNN_RNN_WORKSPACE`` is this times layers x directions plus the weight matrices' bytes
#: (``cudnn_rnn_weight_bytes``), to within 1.1 MiB on all 32 lines (the rest: allocator blocks, a small
#: per-batch-row term)
CUDNN_RNN_PER_LAYER = 8 * MiB
_GATES = {"gru": 3, "lstm": 4, "rnn_tanh": 1, "rnn_relu": 1}
#: the shapes the table was measured at; outside them the workspace is extrapolated and says so
CUDNN_RNN_MEASURED = {"hidden": (128, 512), "input": (64, 256), "batch": (8, 32), "seq": (50, 200),
                      "layers": (1, 2)}  # fmt: skip
TB_MEASURED = 200 * 32  # the largest T * B measured


def cudnn_rnn_weight_bytes(
    mode: str, input_size: int, hidden: int, layers: int, bidirectional: bool = False, itemsize: int = 4
) -> int:
    """Bytes of an RNN's weight matrices (no biases): gates x hidden x (layer input + hidden) per layer
    and direction, the first layer's input ``input_size``, the others' ``directions * hidden``."""
    dirs = 2 if bidirectional else 1
    total = 0
    for layer in range(layers):
        inp = input_size if layer == 0 else dirs * hidden
        total += dirs * _GATES[mode] * hidden * (inp + hidden) * itemsize
    return total


def _rnn_terms(mode: str, dirs: int, layers: int, hidden: int, inp: int) -> tuple[float, float]:
    """(residual constant, per-(T * B) bytes beyond 4 * input) of one table line: the line's constant less
    ``CUDNN_RNN_PER_LAYER`` x layers x directions and the weights; its slope less one fp32 input row."""
    a, b = CUDNN_RNN_WORKSPACE[(mode, dirs, layers, hidden, inp)]
    fixed = CUDNN_RNN_PER_LAYER * layers * dirs + cudnn_rnn_weight_bytes(mode, inp, hidden, layers, dirs == 2)
    return a - fixed, b - 4 * inp


def cudnn_rnn_workspace_bytes(
    mode: str, input_size: int, hidden: int, seq: int, batch: int, layers: int, bidirectional: bool = False
) -> int:
    """Bytes of cuDNN's RNN workspace for a training call (the forward and each of the backward's two),
    from the measured table ``CUDNN_RNN_WORKSPACE`` (H200, cuDNN 9.19.0, fp32) read as cuDNN's terms:

        8 MiB x layers x directions + the weight matrices' bytes + r + (4 * input + beta) * T * B

    The first two are what every line's constant is made of (``CUDNN_RNN_PER_LAYER``): exact for any
    shape, so hidden and input sizes between and beyond the measured ones no longer interpolate a constant
    that grows with hidden squared (the table read linearly in log2(hidden) put hidden 256 up to 10 MiB
    high per call for two bidirectional layers, the whole gap at small T * B). ``4 * input`` per (T * B)
    is the slope's part that follows the input size (the LSTM lines from input 64 to 256 add 600-900
    bytes per (T * B), 4 x 192 = 768, at every hidden size; the rest of that difference, large for
    bidirectional GRUs at hidden 128, stays in the interpolated beta).
    ``r`` (under 1.1 MiB) is interpolated in log2(hidden) and log2(input), ``beta`` (the per-(T * B)
    rest, 8-29 KiB: flat in hidden for one direction, about 35 bytes per hidden unit more for two) in
    log2(input) and linearly in hidden, both from the lines of the same mode and directions (one layer, or
    two for two or more; past the measured T * B never a smaller slope than one layer's). Outside the
    measured hidden sizes beta follows its slope between them (never down) and r the nearest measured
    size. ``rnn_workspace_note`` says when a shape
    is outside the measured ones. Other GPUs, cuDNN versions and half-precision RNNs were not measured:
    the H200's fp32 readings stand in."""
    table_mode = mode if mode in ("gru", "lstm") else "gru"
    dirs = 2 if bidirectional else 1
    tl = min(max(layers, 1), 2)

    def weight(x: float, lo: float, hi: float) -> float:
        return max(0.0, min(1.0, (x - lo) / (hi - lo)))

    th = weight(math.log2(max(hidden, 1)), 7, 9)
    ti = weight(math.log2(max(input_size, 1)), 6, 8)
    r = 0.0
    for h, wh in ((128, 1 - th), (512, th)):
        for i, wi in ((64, 1 - ti), (256, ti)):
            r += wh * wi * _rnn_terms(table_mode, dirs, tl, h, i)[0]

    def beta(layers_: int, h: int) -> float:  # between the two input sizes, as r is
        return sum(wi * _rnn_terms(table_mode, dirs, layers_, h, i)[1] for i, wi in ((64, 1 - ti), (256, ti)))

    def rest(layers_: int) -> float:  # linear in hidden; beyond 512 along its slope, never down
        lo, hi = beta(layers_, 128), beta(layers_, 512)
        slope = (hi - lo) / (512 - 128)
        if hidden <= 128:
            return lo
        if hidden <= 512:
            return lo + slope * (hidden - 128)
        return hi + max(0.0, slope) * (hidden - 512)

    tb = seq * batch
    per_tb = 4 * input_size + rest(tl)
    # past the measured T * B, two layers' slope never below one layer's (some two-layer lines are flatter)
    past = max(0.0, rest(1) - rest(tl)) * max(0, tb - TB_MEASURED)
    fixed = CUDNN_RNN_PER_LAYER * layers * dirs + cudnn_rnn_weight_bytes(mode, input_size, hidden, layers,
                                                                          bidirectional)  # fmt: skip
    return max(0, round(fixed + r + per_tb * tb + past))


def rnn_workspace_note(
    mode: str, input_size: int, hidden: int, seq: int, batch: int, layers: int, bidirectional: bool, dtype
) -> str | None:
    """One line for the report when this RNN's shape is outside the ones the workspace table was measured
    at (``CUDNN_RNN_MEASURED``, fp32): its size is then cuDNN's terms extrapolated, not a reading; None
    inside."""
    shape = {"hidden": hidden, "input": input_size, "batch": batch, "seq": seq, "layers": layers}
    outside = [
        f"{k} {v}" for k, v in shape.items() if not CUDNN_RNN_MEASURED[k][0] <= v <= CUDNN_RNN_MEASURED[k][1]
    ]
    if dtype != torch.float32:
        outside.append(str(dtype).removeprefix("torch."))
    if not outside:
        return None
    measured = ", ".join(f"{k} {lo}-{hi}" for k, (lo, hi) in CUDNN_RNN_MEASURED.items())
    size = cudnn_rnn_workspace_bytes(mode, input_size, hidden, seq, batch, layers, bidirectional)
    return (
        f"cuDNN {mode.upper()} workspace {size / MiB:.1f} MiB per call (input {input_size}, hidden "
        f"{hidden}, {layers} layer{'s' if layers > 1 else ''}{', bidirectional' if bidirectional else ''}, "
        f"{seq} steps x batch {batch}) extrapolated: {', '.join(outside)} outside the measured shapes "
        f"({measured}, fp32; H200, cuDNN 9.19)"
    )


# ----------------------------------------------------------------------------------------------------
# cuDNN convolutions: not modelled, bounded in a note
# ----------------------------------------------------------------------------------------------------

#: cuDNN convolution workspaces are cuDNN's heuristics' choice at run time (with ``benchmark=False``,
#: Conv_v8.cpp runs the first heuristic plan that executes, each with its own workspace size, allocated
#: through the caching allocator for the call): no source gives a size, so the estimate leaves them out and
#: its report bounds them. Measured (H200, cuDNN 9.19.0, ResNet-50 at batch 2 x 224 x 224, fp32, the
#: recorded step's 106 convolution calls): transients of 0-12.7 MiB per call, at most 3.7 times the
#: call's input + weight + output bytes; the bound is 4 times that, for the step's largest call, since
#: one call's workspace is alive at a time.
CONV_WORKSPACE_BOUND = 4


def conv_workspace_bound(func, args: tuple) -> int:
    """The note's bound on one ``aten.convolution`` / ``convolution_backward`` call's cuDNN workspace:
    ``CONV_WORKSPACE_BOUND`` x (input + weight + output) bytes."""
    if func.overloadpacket.__name__ == "convolution":
        x, w = args[0], args[1]
        out_bytes = 0
    else:  # convolution_backward(grad_output, input, weight, ...)
        x, w = args[1], args[2]
        out_bytes = args[0].numel() * args[0].element_size()
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return 0
    return CONV_WORKSPACE_BOUND * (x.numel() * x.element_size() + w.numel() * w.element_size() + out_bytes)


# ----------------------------------------------------------------------------------------------------
# Notes: what a CUDA estimate leaves out or extrapolates, one line each in its report
# ----------------------------------------------------------------------------------------------------

_notes_var = contextvars.ContextVar[dict[str, str] | None]("memfit_cuda_notes", default=None)


@contextlib.contextmanager
def noting() -> Iterator[dict[str, str]]:
    """The notes made inside (``note``), by key: a CUDA estimate's trace runs in one."""
    notes: dict[str, str] = {}
    token = _notes_var.set(notes)
    try:
        yield notes
    finally:
        _notes_var.reset(token)


def note(key: str, text: str) -> None:
    """One line for the report of the estimate being made (a later note of the same key replaces it)."""
    notes = _notes_var.get()
    if notes is not None:
        notes[key] = text


# ----------------------------------------------------------------------------------------------------
# The workspaces of one traced step
# ----------------------------------------------------------------------------------------------------


WORKSPACES = "workspaces"  # the CUDA target's fifth category: what the CUDA libraries allocate


@dataclasses.dataclass
class Extra:
    """An allocation the fake trace misses, made right after the outputs of the op that needs it."""

    nbytes: int
    what: str
    transient: bool  # freed when the op returns; else kept for the rest of the process
    category: str = WORKSPACES  # a CUDA library's workspace, else the category an op's temporary counts in


class CudaLibraries:
    """The library allocations of one traced CUDA step, decided op by op as the trace runs (``after_op``).

    Threads: cuBLAS handles come from ``DeviceThreadHandlePool`` (ATen/cuda/detail/DeviceThreadHandles.h:
    a ``thread_local`` PoolWindow, one handle per host thread), and CUDA backward runs on the autograd
    engine's device thread (torch/csrc/autograd/engine.cpp ``Engine::ready_queue``: non-CPU devices use
    ``device_ready_queues_``, served by the threads ``start_device_threads`` makes) on the forward's
    stream: a training step has two handles, so two workspaces. Measured (H200): a Linear step held
    segments [2, 2, 32, 32] MiB; with ``torch.autograd.set_multithreading_enabled(False)`` (backward on the
    calling thread) [2, 2, 32]."""

    def __init__(self, card: Card, env: Mapping[str, str] | None = None) -> None:
        self.card = card
        self.cublas = cublas_workspace_bytes(card.capability, env)
        self.cublaslt = cublaslt_workspace_bytes(card.capability, env)
        self.done: set[tuple[str, str]] = set()
        self.made: list[Extra] = []  # every extra, in order (what the report lists)
        self._handlers: dict = {}
        for name in CUBLAS_OPS:
            self._add_handler(name, self._blas)
        for name in ("_fft_r2c", "_fft_c2r", "_fft_c2c"):
            self._add_handler(name, self._fft)
        self._add_handler("_softmax_backward_data", self._softmax_backward)
        for name in ("convolution", "convolution_backward"):
            self._add_handler(name, self._conv)
        self.conv_bound = 0

    def _add_handler(self, name: str, fn: Callable) -> None:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            return
        for overload in packet.overloads():
            self._handlers[getattr(packet, overload)] = fn

    def after_op(self, func, args: tuple, kwargs: Mapping, out, backward: bool) -> list[Extra]:
        """The extras op ``func`` allocates on CUDA (run on the autograd thread when ``backward``)."""
        handler = self._handlers.get(func)
        if handler is None:
            return []
        found = handler(func, args, kwargs or {}, out, backward)
        self.made += found
        return found

    def _blas(self, func, args, kwargs, out, backward) -> list[Extra]:
        thread = "autograd" if backward and torch.autograd.is_multithreading_enabled() else "main"
        found = []
        if (thread, "cublas") not in self.done:
            self.done.add((thread, "cublas"))
            found.append(Extra(self.cublas, f"cuBLAS workspace ({thread} thread)", False))
        name = func.overloadpacket.__name__
        lt = name in ("addmm", "_addmm_activation") and addmm_takes_lt(args, kwargs)
        if self.cublaslt and lt and (thread, "cublaslt") not in self.done:
            self.done.add((thread, "cublaslt"))
            found.append(Extra(self.cublaslt, f"cuBLASLt workspace ({thread} thread)", False))
        return found

    def _fft(self, func, args, kwargs, out, backward) -> list[Extra]:
        return [
            Extra(n, what, True) for n, what in cufft_transients(func.overloadpacket.__name__, args, out) if n
        ]

    def _softmax_backward(self, func, args, kwargs, out, backward) -> list[Extra]:
        """aten/src/ATen/native/cuda/SoftMax.cu ``softmax_backward_cuda_out``: ``Tensor tmp = grad * output;``
        then ``host_softmax_backward(tmp, output, ...)`` into the (already allocated) grad_input, so a
        temporary the size of the gradient lives through the call, in the dtype grad * output promotes to.
        The CPU kernel has none, so a CPU trace misses it; log_softmax's CUDA backward has none either."""
        grad, output = args[0], args[1]
        dtype = torch.promote_types(grad.dtype, output.dtype)
        nbytes = grad.numel() * dtype.itemsize
        return [Extra(nbytes, "softmax backward's grad * output", True, "activations")] if nbytes else []

    def _conv(self, func, args, kwargs, out, backward) -> list[Extra]:
        """cuDNN's convolution workspace is not modelled (``CONV_WORKSPACE_BOUND``): the report says so,
        with the bound for the step's largest call."""
        bound = conv_workspace_bound(func, args)
        if bound > self.conv_bound:
            self.conv_bound = bound
            note(
                "conv",
                "cuDNN convolution workspaces not modelled (cuDNN's heuristics pick each at run time): "
                f"up to {bound / MiB:.1f} MiB more, one call's at a time ({CONV_WORKSPACE_BOUND}x the "
                "largest call's input, weight and output; ResNet-50's calls measured 0-12.7 MiB on an H200, "
                "at most 3.7x, with torch.backends.cudnn.benchmark off"
                + (
                    "; it is on here: benchmark mode's trials may take more)"
                    if torch.backends.cudnn.benchmark
                    else ")"
                ),
            )
        return []

    def summary(self) -> dict[str, int]:
        """Bytes per kind of extra: persistent ones once each, transient ones at their largest."""
        out: dict[str, int] = {}
        for e in self.made:
            if e.category != WORKSPACES:  # an op's own temporary, not a library's
                continue
            key = e.what.split(" (")[0]
            out[key] = out.get(key, 0) + e.nbytes if not e.transient else max(out.get(key, 0), e.nbytes)
        return out
