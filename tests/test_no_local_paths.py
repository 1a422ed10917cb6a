"""Nothing the project ships names this workplace's own paths or locks."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ("/wo" + "rk/", "cpu0" + ".lock")  # spelled in parts, so this file does not name them


def test_tracked_files_name_no_machine_local_paths():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    bad = []
    for name in files.split():
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".toml", ".yml", ".cfg", ".txt") and name != ".ci/run":
            continue
        text = path.read_text(errors="replace")
        bad += [f"{name}: {word}" for word in LOCAL if word in text]
    assert not bad, bad
