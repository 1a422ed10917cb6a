"""The `memfit-report` console script: imports nothing heavy before Ctrl-C is one line (memfit.launch)."""

from __future__ import annotations

from memfit.launch import launch


def cli(argv: list[str] | None = None) -> int:
    return launch("memfit_report.main:main", "memfit-report", argv)
