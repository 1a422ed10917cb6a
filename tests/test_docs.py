"""The docs name the code as it is: docs/architecture.md's file map against the tree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "packages" / "core" / "src" / "memfit"


def test_architecture_file_map_names_every_core_module_and_nothing_that_is_gone():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`memfit/((?:\w+/)*\w+\.(?:py|c|h))`", text))
    modules = {p.relative_to(CORE).as_posix() for p in CORE.rglob("*") if p.suffix in (".py", ".c", ".h")}
    assert modules - named == set(), f"core modules missing from docs/architecture.md: {modules - named}"
    assert named - modules == set(), f"docs/architecture.md names missing modules: {named - modules}"
    for pkg in (ROOT / "packages").glob("*/src/*"):
        if pkg.name == "memfit":
            continue
        for name in ["config", "model", "data", "train", "eval", "system", "flags", "baselines"]:
            name += ".py"
            assert (pkg / name).is_file(), f"{pkg.name} lacks {name}, which docs/architecture.md promises"
