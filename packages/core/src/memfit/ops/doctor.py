"""`memfit doctor`: what each compute path will use on this machine, and why.

It reports the GPU (name, compute capability, memory), each kernel of the ``cuda`` extra (installed
version, and on a GPU the result of its probe: one tiny call compared with the PyTorch path, see
memfit.ops.registry), which path the Mamba scan and conv and windowed attention take on CUDA and on the CPU,
and the C compiler of the CPU scan kernel. ``--require-cuda`` exits 2 with one line unless CUDA is
available and every kernel of the extra passes its probe (the GPU CI job's first step).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os

import torch

from memfit.errors import UsageError, first_line
from memfit.ops import registry as probes

# kernel -> (distribution, module, function): the imports memfit.ops.scan / mamba / attention make
EXTRA = {
    "selective_scan": ("mamba-ssm", "mamba_ssm.ops.selective_scan_interface", "selective_scan_fn"),
    "causal_conv1d": ("causal-conv1d", "causal_conv1d", "causal_conv1d_fn"),
    "flash_attn": ("flash-attn", "flash_attn", "flash_attn_func"),
}


@dataclasses.dataclass
class KernelStatus:
    kernel: str
    package: str
    version: str | None  # installed distribution version, None when not installed
    fn: object | None  # the imported function
    import_error: str | None
    probe: probes.ProbeResult | None  # None: not probed (no GPU)

    @property
    def usable(self) -> bool:
        return self.probe is not None and self.probe.ok


def gpus() -> list[dict]:
    """One dict per visible CUDA device: index, name, capability, memory (GiB)."""
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "capability": (p.major, p.minor),
                    "gib": p.total_memory / 2**30})  # fmt: skip
    return out


def cuda_state() -> tuple[bool, str]:
    """(available, one line saying why or why not)."""
    built = torch.version.cuda
    if built is None:
        return False, f"torch {torch.__version__} is a CPU-only build (install a CUDA torch: README, GPU)"
    try:
        ok = torch.cuda.is_available()
    except Exception as e:  # noqa: BLE001 - a broken driver can raise here
        return False, f"torch built for CUDA {built}, but CUDA failed to start: {first_line(e)}"
    if not ok:
        return False, (f"torch built for CUDA {built}, but no usable GPU (no device, or a driver older than "
                       f"CUDA {built} needs; check nvidia-smi)")  # fmt: skip
    return True, f"torch {torch.__version__}, CUDA {built}, {torch.cuda.device_count()} device(s)"


def kernel_status(kernel: str, device: torch.device | None) -> KernelStatus:
    package, module, name = EXTRA[kernel]
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = None
    fn, error = None, None
    if version is not None:
        try:
            fn = getattr(importlib.import_module(module), name)
        except Exception as e:  # noqa: BLE001 - ImportError, OSError (undefined symbol), RuntimeError
            error = f"{type(e).__name__}: {first_line(e)}"
    probe = probes.probe(kernel, fn, device) if device is not None and fn is not None else None
    return KernelStatus(kernel, package, version, fn, error, probe)


def cpu_scan() -> str:
    """Which path the CPU scan and conv take, and why."""
    from memfit.ops import cpu_kernel as K

    if os.environ.get("MEMFIT_SCAN_KERNEL", "1") == "0":
        return "torch-op path (MEMFIT_SCAN_KERNEL=0)"
    cc = K._compiler()
    if cc is None:
        return "torch-op path (no C compiler: install gcc or set CC for the fused kernel, several x faster)"
    if K.library() is None:
        return f"torch-op path (building the fused kernel with {cc} failed; see the warning above)"
    return f"fused C kernel (cpu_kernel.c, built with {cc})"


def _describe(st: KernelStatus) -> str:
    if st.version is None:
        return "not installed"
    if st.fn is None:
        return f"{st.version} installed, import fails: {st.import_error}"
    if st.probe is None:
        return f"{st.version} installed (not probed: no GPU)"
    verdict = "probe passed" if st.probe.ok else "probe FAILED"
    return f"{st.version}, {verdict}: {st.probe.detail}"


def report() -> tuple[list[str], list[str]]:
    """(lines to print, problems that fail --require-cuda)."""
    available, why = cuda_state()
    lines = [
        "memfit doctor: the paths this machine takes",
        f"CUDA: {why}" if available else f"CUDA: no ({why})",
    ]
    problems = [] if available else [f"CUDA is not available: {why}"]
    device = None
    if available:
        devs = gpus()
        for g in devs:
            cap = "{}.{}".format(*g["capability"])
            lines.append(f"  cuda:{g['index']}  {g['name']}, compute capability {cap}, {g['gib']:.1f} GiB")
        device = torch.device("cuda", torch.cuda.current_device())
    lines.append("kernels of the cuda extra (uv sync --all-packages --extra cuda):")
    status = {k: kernel_status(k, device) for k in EXTRA}
    for st in status.values():
        lines.append(f"  {st.package:<14} {_describe(st)}")
        if available and not st.usable:
            problems.append(f"{st.package} {_describe(st)}")
    if available:
        scan, conv, flash = (status[k].usable for k in ("selective_scan", "causal_conv1d", "flash_attn"))
        cap = probes.capability(device)
        lines.append(f"on {device}:")
        scan_path = "mamba_ssm's kernel (the torch-op path when the last state needs a gradient)"
        conv_path = "causal-conv1d (width 2-4, channels a multiple of 8; else PyTorch conv1d)"
        lines.append("  Mamba scan        " + (scan_path if scan else "torch-op chunked scan"))
        lines.append("  Mamba conv        " + (conv_path if conv else "PyTorch conv1d"))
        if flash:
            att = "flash-attn in fp16/bf16 (head dim <= 256), compiled FlexAttention in fp32"
        elif tuple(cap) < probes.FLASH_MIN_CAPABILITY and status["flash_attn"].fn is not None:
            att = f"compiled FlexAttention (flash-attn needs compute capability 8.0, not {cap[0]}.{cap[1]})"
        else:
            att = "compiled FlexAttention"
        lines.append("  window attention  " + att)
    lines.append("on the CPU:")
    lines.append("  Mamba scan, conv  " + cpu_scan())
    lines.append("  window attention  SDPA on query blocks, or the band path for long sequences")
    return lines, problems


def run(require_cuda: bool = False) -> int:
    lines, problems = report()
    if require_cuda and problems:
        raise UsageError("error: --require-cuda: " + "; ".join(problems))
    print("\n".join(lines))
    return 0
