"""Every distribution carries its licence, authors, classifiers and readme, and says its version."""

from __future__ import annotations

import tomllib
from importlib import import_module
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTS = sorted(p.parent for where in ("packages", "apps") for p in ROOT.glob(f"{where}/*/pyproject.toml"))


@pytest.mark.parametrize("folder", DISTS, ids=[d.name for d in DISTS])
def test_every_distribution_has_its_metadata(folder):
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (folder / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    assert project["authors"] and project["classifiers"] and (folder / project["readme"]).is_file()
    assert version(project["name"]) == project["version"]


MODULES = ["memfit", "ginr_cifar", "gpt2_window", "mbsnet_speech", "moremouse_triplane"]


@pytest.mark.parametrize("module", MODULES)
def test_packages_say_their_version(module):
    assert import_module(module).__version__ == "0.1.0"
