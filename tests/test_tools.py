"""The benchmark and analysis tools import our packages lazily (inside functions), so a renamed function
breaks a README command only when someone runs it: check every name they import from our packages."""

import ast
import importlib
from pathlib import Path

import pytest

TOOLS = sorted((Path(__file__).resolve().parents[1] / "tools").glob("*.py"))
OURS = ("memfit", "mbsnet_speech", "gpt2_window", "ginr_cifar", "moremouse_triplane")


def _imports(path: Path) -> list[tuple[str, str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
    return found


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.name)
def test_every_name_a_tool_imports_from_our_packages_exists(path):
    missing = []
    for module, name, line in _imports(path):
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"{path.name}:{line}: from {module} import {name}")
    assert not missing, missing


def test_bench_gpu_runs_every_part_at_toy_sizes(tmp_path):
    """tools/bench_gpu.py --smoke: each part runs on the CPU at toy sizes and lands in the JSON (a GPU is
    the place for its real figures; this keeps the one GPU command from failing on a renamed function)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "gpu.json"
    tool = Path(__file__).resolve().parents[1] / "tools" / "bench_gpu.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(tool), "--smoke", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {"scan", "systems", "attention", "d12", "memory", "paths"} <= report.keys()
    assert [r["variant"] for r in report["memory"]] == [
        "resnet50-fp32", "gru-3x512", "gru-tagger-4x100", "llama-fp32-gqa-2x256"
    ]  # fmt: skip
    assert all(r["estimate_gib"]["allocated"] > 0.05 for r in report["memory"])
    impls = {row["impl"] for row in report["scan"]}
    assert {"memfit torch-op chunked", "parallel scan (materialising)", "SSD reference (Mamba-2)"} <= impls
    assert {row["system"] for row in report["systems"]} == {"ginr-cifar", "gpt2-window", "mbsnet-speech",
                                                             "moremouse-triplane"}  # fmt: skip
    assert all(row["ms"] > 0 and row["estimate_gib"] > 0 for row in report["systems"])
    assert report["paths"]["scan/cpu_kernel"] > 0 or report["paths"]["scan/torch"] > 0
