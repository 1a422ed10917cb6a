"""`memfit doctor`: what each op (scan, conv, window attention) uses on this machine, and why.

It asks the registry (``memfit.ops.registry``), the same records every call site reads: for each op and
device, each implementation from the highest priority down with its verdict (available, not installed,
switched off, probe passed or FAILED: one tiny call against the op's reference on the GPU), and which one
a call takes. ``--require_cuda`` exits 2 with one line unless CUDA works and every CUDA implementation that
is installed passes its probe (the GPU CI job, no optional kernels); ``--require_kernels`` also needs every
kernel of the ``cuda`` extra installed (the kernels CI job).
"""

from __future__ import annotations

import importlib.metadata

import torch

from memfit.errors import UsageError, first_line
from memfit.ops import registry


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


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


OP_TITLES = {"scan": "Mamba scan", "conv": "Mamba conv", "attention": "window attention"}


def report(require_kernels: bool = False) -> tuple[list[str], list[str]]:
    """(lines to print, problems that fail --require_cuda / --require_kernels)."""
    available, why = cuda_state()
    lines = [
        "memfit doctor: the paths this machine takes",
        f"CUDA: {why}" if available else f"CUDA: no ({why})",
    ]
    problems = [] if available else [f"CUDA is not available: {why}"]
    devices = [torch.device("cpu")]
    if available:
        for g in gpus():
            cap = "{}.{}".format(*g["capability"])
            lines.append(f"  cuda:{g['index']}  {g['name']}, compute capability {cap}, {g['gib']:.1f} GiB")
        devices.insert(0, torch.device("cuda", torch.cuda.current_device()))
    packages = sorted({r.package for r in registry.RECORDS if r.package})
    lines.append("optional kernels (the cuda extra: uv sync --all-packages --extra cuda):")
    for package in packages:
        v = version(package)
        lines.append(f"  {package:<14} {v + ' installed' if v else 'not installed'}")
        if require_kernels and v is None:
            problems.append(f"{package} is not installed")
    for device in devices:
        lines.append(f"on {device} (each op's implementations, first choice first):")
        for op in registry.OPS:
            verdicts = registry.usable(op, device)
            takes = next((impl for impl, v in verdicts if _usable(v)), None)
            # timed records (registry.choose): every usable one races, the fastest per shape runs
            racing = (
                {impl.name for impl, v in verdicts if _usable(v) and impl.timed}
                if takes and takes.timed
                else set()
            )
            for impl, verdict in verdicts:
                mark = "->" if impl is takes or impl.name in racing else "  "
                lines.append(f"  {mark} {OP_TITLES[op]:<17} {impl.name:<14} {impl.title}: {verdict}")
                if device.type == "cuda" and "probe FAILED" in verdict:
                    problems.append(f"{impl.name} ({OP_TITLES[op]}): {verdict}")
                elif require_kernels and device.type == "cuda" and impl.package and not _usable(verdict):
                    problems.append(f"{impl.package}: {verdict}")
    return lines, problems


def _usable(verdict: str) -> bool:
    return verdict == "available" or verdict.startswith("probe passed")


def run(require_cuda: bool = False, require_kernels: bool = False) -> int:
    lines, problems = report(require_kernels)
    flag = "--require_kernels" if require_kernels else "--require_cuda"
    if (require_cuda or require_kernels) and problems:
        raise UsageError(f"error: {flag}: " + "; ".join(dict.fromkeys(problems)))
    print("\n".join(lines))
    return 0
