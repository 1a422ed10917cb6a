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


def test_every_local_hf_folder_the_docs_name_holds_a_config():
    """`hf:NAME` is a folder when one is there, else a Hub name: a doc that names a folder of this
    repository (or a bare lower-case name, which only a folder or a network lookup can answer) must ship
    it with its config.json, so the command runs offline from a clone. ORG/NAME placeholders and Hub
    names (one slash, not a folder of the repository) are not checked."""
    repo_dirs = {p.name for p in ROOT.iterdir() if p.is_dir()}
    named = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in re.findall(r"hf:([\w./~-]+)", doc.read_text()):
            name = name.rstrip(".:")
            parts = name.split("/")
            local = parts[0] in repo_dirs or (len(parts) == 1 and not name.isupper())
            if local:
                named.add((doc.name, name))
    missing = [(doc, n) for doc, n in sorted(named) if not (ROOT / n / "config.json").is_file()]
    assert named and not missing, f"docs name hf: folders the repository does not ship: {missing}"
