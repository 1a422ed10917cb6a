"""README.md and docs/*.md cannot go stale: every command they show is checked against the code.

Each shell command in a ```bash block, and each inline `uv run ...`, is run in this process up to the point
where its arguments are parsed, then stopped (`Parsed`), so a renamed flag, a removed preset, a missing tool
or a test that no longer exists fails here in seconds, and no training, benchmark or download ever starts.
``--help`` and ``--version`` run to the end. `uv run pytest ...` is checked against the test files (paths,
markers, -k). Python blocks must compile and import. Also: the README's size, its links, no work history
in user-facing docs, and .ci/run's test command as the README's "Tests" section states it.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import runpy
import shlex
import sys
import tomllib
import warnings
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from memfit.train.settings import TrainParser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
UV_RUN = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*uv run ")
WORK_HISTORY = re.compile(r"\b(?:sessions?|issues?)\s*#?\d+|\bthis session\b", re.I)


# ----------------------------------------------------------------------------------------------------
# what the docs show
# ----------------------------------------------------------------------------------------------------


def blocks(path: Path, langs: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line number, body) of each fenced block in one of `langs`."""
    text = path.read_text()
    return [
        (text[: m.start()].count("\n") + 2, m.group(2)) for m in FENCE.finditer(text) if m.group(1) in langs
    ]


def shell_commands(path: Path) -> list[tuple[str, list[str]]]:
    """(where, words) of every command in the file's bash blocks and inline `uv run ...` spans."""
    found = []
    for start, body in blocks(path, ("bash", "sh", "shell")):
        lines = body.replace("\\\n", " \n").splitlines()
        for i, line in enumerate(lines):
            for part in re.split(r"\s&&\s", line):
                words = shlex.split(part, comments=True)
                if words:
                    found.append((f"{path.name}:{start + i}", words))
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    for m in INLINE.finditer(text):
        span = " ".join(m.group(1).split())
        if UV_RUN.match(span):
            found.append((f"{path.name}:{text[: m.start()].count(chr(10)) + 1}", shlex.split(span)))
    return found


COMMANDS = [c for doc in DOCS for c in shell_commands(doc)]


# ----------------------------------------------------------------------------------------------------
# running a command up to its parsed arguments
# ----------------------------------------------------------------------------------------------------


class Parsed(BaseException):
    """Raised once a command's arguments are parsed, so its work never starts (BaseException: the commands'
    own error handling, which catches SystemExit and Exception subclasses, lets it through)."""


def _dispatches(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> bool:
    """True for a parser that hands the rest of the line to another one (`memfit run S CMD ...`)."""
    for action in parser._actions:
        if action.nargs == argparse.REMAINDER:
            return True
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(ns, action.dest, None))
            if chosen is not None and _dispatches(chosen, ns):
                return True
    return False


@pytest.fixture
def stop_after_parsing(monkeypatch):
    """argparse stops the command once its final parser has accepted the line; a system's `train` stops
    after TrainParser.parse has also built and validated the settings (presets, config files, values)."""
    parse_args = argparse.ArgumentParser.parse_args
    in_train = []

    def parse_then_stop(self, args=None, namespace=None):
        ns = parse_args(self, args, namespace)
        if in_train or _dispatches(self, ns):
            return ns
        raise Parsed(ns)

    train_parse = TrainParser.parse

    def train_parse_then_stop(self, argv=None):
        in_train.append(True)
        try:
            run = train_parse(self, argv)
        finally:
            in_train.pop()
        raise Parsed(run)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(TrainParser, "parse", train_parse_then_stop)
    monkeypatch.setattr(
        "memfit.train.cpu.set_threads", lambda n: n
    )  # --threads must not cap this test process
    environ = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environ)


def _call(where: str, words: list[str], fn, capsys) -> None:
    """Run fn(); pass when it stops at Parsed or exits 0 (--help, --version); fail with its error line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: a module already imported
            status = fn()
    except Parsed:
        return
    except SystemExit as e:
        status = e.code
    if status not in (0, None):
        err = capsys.readouterr().err.strip().splitlines()
        pytest.fail(f"{where}: `{shlex.join(words)}` exits {status}: {err[-1] if err else '(no message)'}")
    if "--help" not in words and "--version" not in words:
        pytest.fail(f"{where}: `{shlex.join(words)}` finished without parsing its arguments")


def _console(name: str):
    found = [e for e in entry_points(group="console_scripts") if e.name == name]
    return found[0].load() if found else None


def _packages() -> dict[str, dict]:
    """Workspace package name -> its pyproject's [project] table."""
    tables = {}
    for path in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]:
        project = tomllib.loads(path.read_text())["project"]
        tables[project["name"]] = project
    return tables


def _registered_markers() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return {m.split(":")[0].strip() for m in config["markers"]}


def _tests_in(path: Path) -> list[tuple[str, set[str]]]:
    """(file stem + test name, its pytest.mark names) of every test function in the file(s) under path."""
    files = [path] if path.is_file() else sorted(path.rglob("test_*.py"))
    found = []
    for file in files:
        tree = ast.parse(file.read_text())
        module_marks = {n.attr for node in tree.body if isinstance(node, ast.Assign)
                        and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
                        for n in ast.walk(node.value) if isinstance(n, ast.Attribute)}  # fmt: skip
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                marks = {
                    n.attr for d in node.decorator_list for n in ast.walk(d) if isinstance(n, ast.Attribute)
                }
                found.append((f"{file.stem} {node.name}", marks | module_marks))
    return found


def _matches(expr: str, truth) -> bool:
    """Evaluate a pytest -m / -k expression: `truth(word)` for each word, and / or / not as in Python."""
    values: list[bool] = []

    def placeholder(m: re.Match) -> str:
        if m.group(0) in ("and", "or", "not"):
            return m.group(0)
        values.append(truth(m.group(0)))
        return f"_{len(values) - 1}"

    python = re.sub(r"[\w.-]+", placeholder, expr)
    return bool(eval(python, {"__builtins__": {}}, {f"_{i}": v for i, v in enumerate(values)}))


def check_pytest(where: str, args: list[str]) -> None:
    paths, marker, keyword = [], None, None
    it = iter(args)
    for arg in it:
        if arg == "-m":
            marker = next(it)
        elif arg == "-k":
            keyword = next(it)
        elif arg == "-n":  # pytest-xdist's worker count
            n = next(it)
            assert n == "auto" or n.isdigit() and int(n) > 0, f"{where}: pytest -n {n} is not a worker count"
            assert importlib.util.find_spec("xdist"), f"{where}: pytest -n needs pytest-xdist (the dev group)"
        elif arg.startswith("-"):
            assert arg in ("-s", "-q", "-x", "-v", "-ra"), f"{where}: pytest flag {arg} is not checked here"
        else:
            paths.append(ROOT / arg.split("::")[0])
    for p in paths:
        assert p.exists(), f"{where}: pytest path {p.relative_to(ROOT)} does not exist"
    if marker:
        unknown = set(re.findall(r"[\w-]+", marker)) - {"and", "or", "not"} - _registered_markers()
        assert not unknown, f"{where}: pytest markers {unknown} are not registered in pyproject.toml"
    if marker or keyword:
        tests = [t for p in (paths or [ROOT / "tests", ROOT / "packages"]) for t in _tests_in(p)]
        chosen = [
            name
            for name, marks in tests
            if (not marker or _matches(marker, lambda w, m=marks: w in m))
            and (not keyword or _matches(keyword, lambda w, n=name: w.lower() in n.lower()))
        ]
        assert chosen, f"{where}: `pytest {shlex.join(args)}` selects no test"


def check_python_code(where: str, code: str) -> None:
    """Code compiles, its imports resolve, and `module.name` exists for every imported module it uses."""
    tree = compile(code, where, "exec", ast.PyCF_ONLY_AST)
    modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules[alias.asname or alias.name.split(".")[0]] = importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            assert hasattr(modules[node.value.id], node.attr), f"{where}: {node.value.id}.{node.attr} is gone"


def _strip_prefixes(words: list[str]) -> list[str]:
    """Drop `VAR=value`, `env`, `flock LOCK` and `taskset -c N` in front of the command."""
    while words:
        if ENV.match(words[0]) or words[0] == "env":
            words = words[1:]
        elif words[0] == "flock":
            words = words[2:]
        elif words[0] == "taskset":
            words = words[3:]
        else:
            return words
    return words


def check_command(where: str, words: list[str], monkeypatch, capsys) -> None:
    cmd = _strip_prefixes(words)
    assert cmd[:1] == ["uv"], f"{where}: `{shlex.join(words)}` is not a uv command; only those are checked"
    packages = _packages()
    if cmd[1] == "sync":
        extras = {e for p in packages.values() for e in p.get("optional-dependencies", {})}
        for i, w in enumerate(cmd):
            if w == "--extra":
                assert cmd[i + 1] in extras, f"{where}: no package has the extra {cmd[i + 1]!r}"
        return
    assert cmd[1] == "run", f"{where}: `uv {cmd[1]}` is not checked here"
    rest, package = cmd[2:], None
    while rest and rest[0].startswith("--"):
        if rest[0] in ("--package", "--extra"):
            if rest[0] == "--package":
                package = rest[1]
                assert package in packages, f"{where}: no workspace package {package!r}"
            rest = rest[2:]
        else:
            assert rest[0] in ("--frozen", "--all-packages"), f"{where}: uv run option {rest[0]} unchecked"
            rest = rest[1:]
    name, args = rest[0], rest[1:]
    if name == "pytest":
        check_pytest(where, args)
    elif name == "python":
        check_python(where, words, args, monkeypatch, capsys)
    elif name == "torchrun":
        from torch.distributed.run import get_args_parser

        ns = get_args_parser().parse_args(args)
        assert ns.module, f"{where}: torchrun is shown with -m PACKAGE.train"
        run_module(where, words, ns.training_script, ns.training_script_args, monkeypatch, capsys)
    else:
        entry = _console(name)
        assert entry is not None, f"{where}: `{name}` is not an installed command"
        if package is not None and name in ("train", "eval"):
            monkeypatch.setenv("MEMFIT_SYSTEM", package)  # what the parent `uv run --package` names
        monkeypatch.setattr(sys, "argv", [name])
        _call(where, words, lambda: entry(args), capsys)


def check_python(where: str, words: list[str], args: list[str], monkeypatch, capsys) -> None:
    if args[0] == "-c":
        check_python_code(where, args[1])
    elif args[0] == "-m":
        run_module(where, words, args[1], args[2:], monkeypatch, capsys)
    else:
        script = ROOT / args[0]
        assert script.is_file(), f"{where}: {args[0]} does not exist"
        text = script.read_text()
        assert "argparse" in text or "Parser(" in text, (  # memfit's Parser is an argparse parser
            f"{where}: {args[0]} has no parser to check without running it"
        )
        monkeypatch.setattr(sys, "argv", [str(script), *args[1:]])
        monkeypatch.syspath_prepend(str(script.parent))  # tools import their siblings
        _call(where, words, lambda: runpy.run_path(str(script), run_name="__main__"), capsys)


def run_module(where: str, words: list[str], module: str, args: list[str], monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", [module, *args])
    _call(where, words, lambda: runpy.run_module(module, run_name="__main__", alter_sys=True), capsys)


# ----------------------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------------------


def test_the_docs_show_commands():
    readme = [w for where, w in COMMANDS if where.startswith("README.md")]
    assert len(readme) >= 20, readme
    assert ["uv", "run", "pytest", "-n", "2"] in readme


@pytest.mark.parametrize(
    "where, words", COMMANDS, ids=[f"{w}:{c[2] if len(c) > 2 else c[0]}" for w, c in COMMANDS]
)
def test_every_command_parses(where, words, stop_after_parsing, monkeypatch, capsys):
    check_command(where, words, monkeypatch, capsys)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_python_blocks_compile_and_import(doc):
    for start, body in blocks(doc, ("python",)):
        check_python_code(f"{doc.name}:{start}", body)


def test_readme_fits_a_few_screens():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"
    long = [(i, len(line)) for i, line in enumerate(lines, 1) if len(line) > 200]
    assert not long, f"README.md lines over 200 characters (line, length): {long}"
    first_screen = "\n".join(lines[:45])
    assert "uv run pytest" in first_screen and "| system |" in first_screen, (
        "the first screen lost its essentials"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_work_history_in_user_facing_docs(doc):
    hits = [(i, m.group(0)) for i, line in enumerate(doc.read_text().splitlines(), 1)
            for m in WORK_HISTORY.finditer(line)]  # fmt: skip
    assert not hits, f"{doc.name}: work history (say what the code does, or give the date): {hits}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    text = INLINE.sub("", FENCE.sub("", doc.read_text()))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name}: link to {target} points at nothing"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", FENCE.sub("", file.read_text()), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{doc.name}: no heading for #{anchor} in {path}"


def test_ci_runs_the_command_the_readme_names():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    (i,) = [i for i, line in enumerate(ci) if re.match(r'# README\.md "(.+)":', line)]
    section = re.match(r'# README\.md "(.+)":', ci[i]).group(1)
    command = ci[i + 1].strip()
    text = README.read_text()
    m = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f'.ci/run names the README section "{section}", which README.md does not have'
    shown = [
        shlex.split(line, comments=True)
        for _, body in FENCE.findall(m.group(1))
        for line in body.splitlines()
    ]
    assert shlex.split(command) in shown, f'README.md "{section}" does not show .ci/run\'s `{command}`'


def test_the_readme_quotes_the_zoo_tables_summary():
    """The zoo count in the README is the one docs/estimate-zoo.md (written by tools/estimate_zoo.py) says."""
    zoo = (ROOT / "docs" / "estimate-zoo.md").read_text()
    within, measured = re.search(r"(\d+) of (\d+) measured are within 1%", zoo).groups()
    assert f"({within} of {measured} measured zoo estimates within 1%" in README.read_text()
