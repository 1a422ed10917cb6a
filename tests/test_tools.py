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
