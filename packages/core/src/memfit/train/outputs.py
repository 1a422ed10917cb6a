"""Outputs never replace inputs: the one check every command that writes files runs before writing.

``check_outputs(outputs, inputs, overwrite)`` refuses, in one line, an output path that is one of the
inputs or lies inside an input folder, and (without ``--overwrite``) an output file that already exists.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from memfit.errors import UsageError


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_outputs(
    outputs: Iterable[str | Path], inputs: Iterable[str | Path], overwrite: bool = False, flag: str = "--out"
) -> None:
    """UsageError when an output is an input or lies inside an input folder, or (without overwrite) is a
    file that exists already. Give the output files themselves (and their folder): a folder that merely
    holds an input is fine as long as no output lands on it. Paths are compared resolved, so links and
    `..` cannot slip past."""
    ins = [Path(p).resolve() for p in inputs]
    for out in outputs:
        o = Path(out).resolve()
        for i in ins:
            if _inside(o, i):
                raise UsageError(
                    f"error: {flag} {out} is {'an input' if o == i else f'inside the input {i}'}: outputs "
                    "never replace inputs; choose another output location"
                )
        if not overwrite and o.is_file():
            raise UsageError(f"error: {out} exists; pass --overwrite to replace it, or choose another {flag}")
