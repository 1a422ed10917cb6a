"""Core's three wings import downwards only, and no package has an import circle.

Every import counts, a lazy one inside a function too, and in core so does a "module:attribute" string
(what ``memfit.ops.registry`` imports its implementations by, at run time): a circle that only closes at
run time is still a circle a reader has to hold in mind. (A system's command table in its ``system.py``
names its own ``train``/``eval`` the same way; those strings are the system's entry points, not counted.)
Floors, bottom up: ``memfit.errors`` and ``memfit.step``; ``memfit.ops``; ``memfit.estimate``
(may use ops); ``memfit.train`` (may use ops and estimate); the top (``memfit.system``, ``memfit.cli``,
``memfit.memory``, ``memfit``). A system package may import core, never another system.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = {p.name: p for p in (ROOT / "packages").glob("*/src/*") if (p / "__init__.py").is_file()}
FLOORS = ["memfit.errors", "memfit.ops", "memfit.estimate", "memfit.train", "memfit"]
# a "module:attribute" string, which memfit.ops.registry imports at run time
RUNTIME = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+:[A-Za-z_][A-Za-z0-9_.]*")


def module_name(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(pkg: str) -> dict[str, Path]:
    top = SRC[pkg]
    return {module_name(p, top): p for p in top.rglob("*.py")}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The known modules ``path`` imports anywhere in its body. ``from a import b`` counts as a.b when b is a
    module (importing a package's submodule runs the package first, but that is every submodule's import
    and no dependency on what the package's own file holds), else as a."""
    is_pkg = path.name == "__init__.py"
    core = name == "memfit" or name.startswith("memfit.")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            subs = {f"{base}.{a.name}" for a in node.names}
            found |= subs if subs <= known else {base, *subs}
        elif (
            core
            and isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and RUNTIME.fullmatch(node.value)
        ):
            found.add(node.value.partition(":")[0])  # "module:attribute", imported at run time (the registry)
    out = set()
    for f in found:
        while f and f not in known:
            f = f.rpartition(".")[0]
        if f and f != name:
            out.add(f)
    return out


def graph() -> dict[str, set[str]]:
    mods = {}
    for pkg in SRC:
        mods |= modules(pkg)
    known = set(mods)
    return {m: imports(p, m, known) for m, p in mods.items()}


GROUND = {"memfit.step": 0}  # modules beside memfit.errors on the ground floor (the step description)


def floor(mod: str) -> int:
    if mod in GROUND:
        return GROUND[mod]
    for i, f in enumerate(FLOORS[:-1]):
        if mod == f or mod.startswith(f + "."):
            return i
    return len(FLOORS) - 1


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_core_or_any_system():
    assert circles(graph()) == []


def test_core_imports_run_downwards_only():
    g = graph()
    up = sorted(
        f"{m} -> {d}"
        for m, deps in g.items()
        if m.startswith("memfit")
        for d in deps
        if d.startswith("memfit") and floor(d) > floor(m)
    )
    assert up == [], "imports running up a floor:\n" + "\n".join(up)


@pytest.mark.parametrize("pkg", sorted(p for p in SRC if p != "memfit"))
def test_a_system_imports_core_and_itself_only(pkg):
    g = graph()
    others = sorted(
        f"{m} -> {d}"
        for m, deps in g.items()
        if m.split(".")[0] == pkg
        for d in deps
        if d.split(".")[0] not in (pkg, "memfit")
    )
    assert others == []


def test_the_checker_sees_a_lazy_import_and_a_circle():
    """The checks can fail: a function-level import counts, and a two-module circle is found."""
    g = {"memfit.ops.a": {"memfit.train.b"}, "memfit.train.b": {"memfit.ops.a"}}
    assert circles(g) == [["memfit.ops.a", "memfit.train.b"]]
    assert floor("memfit.ops.a") < floor("memfit.train.b")
    tree = ROOT / "packages" / "core" / "src" / "memfit"
    lazy = imports(tree / "cli.py", "memfit.cli", set(modules("memfit")))
    assert "memfit.estimate" in lazy  # cli imports the estimator inside its command functions
