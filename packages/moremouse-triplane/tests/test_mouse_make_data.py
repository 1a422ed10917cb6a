"""`make-data`: a non-empty OUT needs --overwrite, which replaces the old scenes (never mixes them with
the new ones) and removes only the scene folders make-data recorded writing there, never real renders or
what a link points at; an interrupted run leaves the old scenes or the new ones, and a killed one leaves
nothing that blocks the next run; a failed run leaves no folder it created."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from memfit.cli import load_system
from moremouse_triplane.data import FolderScenes, SyntheticScenes

MAKE_DATA = load_system("moremouse-triplane").command("make-data")


def _make(out: Path, *extra: str) -> int:
    return MAKE_DATA([str(out), "--image_size", "8", *extra])


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _visible(folder: Path) -> dict[str, bytes]:
    """What `ls -R` shows: the files outside hidden folders and files."""
    return {
        k: v for k, v in _files(folder).items() if not any(part.startswith(".") for part in Path(k).parts)
    }


def _hidden(folder: Path) -> list[str]:
    """The hidden files and folders in `folder` other than make-data's record of its scenes."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name != ".make-data.json")


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_non_empty_folder_is_refused_without_overwrite_and_replaced_whole_with_it(tmp_path, capsys):
    out = tmp_path / "mice"
    assert _make(out, "--num_scenes", "3") == 0
    (out / "NOTES.txt").write_text("mine")
    before = _files(out)
    capsys.readouterr()

    assert _make(out, "--num_scenes", "1", "--seed", "5") == 2
    line = _one_line(capsys)
    assert "not empty" in line and "--overwrite" in line
    assert _files(out) == before  # nothing written, nothing removed

    assert _make(out, "--num_scenes", "1", "--seed", "5", "--overwrite") == 0
    assert "replacing its 3 old scenes" in capsys.readouterr().out
    assert _names(out) == ["NOTES.txt", "scene_000"] and _hidden(out) == []  # no stale scene_001/002
    assert (out / "NOTES.txt").read_text() == "mine"  # not make-data's: kept
    fresh = tmp_path / "fresh"
    assert _make(fresh, "--num_scenes", "1", "--seed", "5") == 0
    assert _files(out / "scene_000") == _files(fresh / "scene_000")  # the new scene, not the old one
    assert len(FolderScenes(out, 8)) == 1


def test_overwrite_never_removes_a_scene_make_data_did_not_write(tmp_path, capsys):
    out = tmp_path / "mice"
    assert _make(out, "--num_scenes", "2") == 0
    (out / "scene_001" / "depth.exr").write_bytes(b"someone's render")
    before = _files(out)
    capsys.readouterr()
    assert _make(out, "--num_scenes", "1", "--overwrite") == 2
    line = _one_line(capsys)
    assert "scene_001" in line and "depth.exr" in line
    assert _files(out) == before
    (out / "scene_001" / "depth.exr").unlink()
    (out / "scene_001" / "cameras.json").unlink()  # no longer a scene, but still make-data's: replaced
    (out / "scene_002").mkdir()  # not on make-data's list, where a new scene would go
    (out / "scene_002" / "000.png").write_bytes(b"someone's render")
    before = _files(out)
    assert _make(out, "--num_scenes", "3", "--overwrite") == 2
    assert "scene_002 is in the way" in _one_line(capsys)
    assert _files(out) == before
    assert _make(out, "--num_scenes", "2", "--overwrite") == 0
    assert (out / "scene_001" / "cameras.json").is_file()
    assert (out / "scene_002" / "000.png").read_bytes() == b"someone's render"  # not in the way: kept


def test_a_failed_make_data_removes_the_folder_it_created_and_keeps_the_old_scenes(
    tmp_path, capsys, monkeypatch
):
    real = SyntheticScenes.eval_scene

    def interrupted(self, index):  # Ctrl-C while the second scene renders
        if index == 1:
            raise KeyboardInterrupt
        return real(self, index)

    out = tmp_path / "new" / "mice"
    monkeypatch.setattr(SyntheticScenes, "eval_scene", interrupted)
    assert _make(out, "--num_scenes", "2") == 130
    assert not (tmp_path / "new").exists()  # both folders were this command's

    empty = tmp_path / "empty"
    empty.mkdir()
    assert _make(empty, "--num_scenes", "2") == 130
    assert empty.is_dir() and not any(empty.iterdir())  # it existed before: kept, and left empty

    monkeypatch.setattr(SyntheticScenes, "eval_scene", real)
    old = tmp_path / "old"
    assert _make(old, "--num_scenes", "3") == 0
    before = _files(old)
    monkeypatch.setattr(SyntheticScenes, "eval_scene", interrupted)
    assert _make(old, "--num_scenes", "2", "--seed", "1", "--overwrite") == 130
    assert _files(old) == before  # the old scenes whole, and no hidden folder of new ones
    assert _names(old) == ["scene_000", "scene_001", "scene_002"]


def test_overwrite_never_removes_real_renders_or_what_a_link_points_at(tmp_path, capsys):
    real = tmp_path / "real"  # the --data layout: someone's renders, as make-data writes them
    assert _make(real, "--num_scenes", "2") == 0
    (real / ".make-data.json").unlink(missing_ok=True)
    kept = _files(real)
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(real / "scene_000", out / "lab_recording_7")
    (out / "scene_009").symlink_to(real / "scene_001")
    (out / "README.txt").write_text("notes")
    mine = _files(out)
    capsys.readouterr()

    status = _make(out, "--num_scenes", "1", "--overwrite")
    assert _files(real) == kept  # outside OUT: untouched
    assert {k: v for k, v in _files(out).items() if k in mine} == mine
    assert status == 0  # no record of make-data here: the new scene is written beside the rest
    assert (out / "scene_009").is_symlink() and (out / "scene_000").is_dir()

    before = _files(out)
    capsys.readouterr()
    assert _make(out, "--num_scenes", "10", "--overwrite") == 2  # scene_009 (a link) would be replaced
    line = _one_line(capsys)
    assert "scene_009 is in the way" in line
    assert _files(out) == before and _files(real) == kept

    # a listed scene folder swapped for a link to real renders is no longer make-data's
    shutil.rmtree(out / "scene_000")
    (out / "scene_000").symlink_to(real / "scene_000")
    assert _make(out, "--num_scenes", "1", "--overwrite") == 2
    assert "scene_000 is in the way" in _one_line(capsys)
    assert _files(real) == kept

    # an OUT an older make-data wrote (no record): its scenes are never removed
    older = tmp_path / "older"
    assert _make(older, "--num_scenes", "2") == 0
    (older / ".make-data.json").unlink(missing_ok=True)
    before = _files(older)
    capsys.readouterr()
    assert _make(older, "--num_scenes", "1", "--overwrite") == 2
    assert "scene_000 is in the way" in _one_line(capsys)
    assert _files(older) == before


@pytest.mark.parametrize("at", range(1, 9))
def test_an_interrupted_overwrite_leaves_exactly_the_old_scenes_or_the_new_ones(tmp_path, monkeypatch, at):
    """Ctrl-C at the at-th rename of the swap (the record, old scenes aside, new ones in, the record)."""
    new, old = tmp_path / "new", tmp_path / "old"
    assert _make(new, "--num_scenes", "2", "--seed", "1") == 0
    assert _make(old, "--num_scenes", "3") == 0
    (old / "NOTES.txt").write_text("mine")
    want_old, want_new = _visible(old), {**_visible(new), "NOTES.txt": b"mine"}

    calls = []
    for method in ("rename", "replace"):
        real = getattr(Path, method)

        def interrupted(self, target, real=real):
            calls.append(self.name)
            if len(calls) == at:
                raise KeyboardInterrupt
            return real(self, target)

        monkeypatch.setattr(Path, method, interrupted)
    status = _make(old, "--num_scenes", "2", "--seed", "1", "--overwrite")
    monkeypatch.undo()
    assert _visible(old) == (want_new if status == 0 else want_old)
    assert status in (0, 130) and (status == 0) == (at > 7)
    assert len(calls) >= min(at, 7), calls  # every step of the swap was reached
    assert _hidden(old) == []  # no hidden folder left behind
    # the record matches what is there: the next --overwrite replaces exactly those scenes
    assert _make(old, "--num_scenes", "1", "--overwrite") == 0
    assert _names(old) == ["NOTES.txt", "scene_000"]


@pytest.mark.parametrize("at", [1, 3, 5, 6, 7, 8])
def test_what_a_killed_make_data_left_is_put_right_by_the_next_one(tmp_path, monkeypatch, capsys, at):
    """A make-data killed at the at-th rename (no clean-up: SIGKILL) with --overwrite, then a new one;
    at 8, after the swap, before the old scenes moved aside were removed."""
    from moremouse_triplane import data

    old = tmp_path / "old"
    assert _make(old, "--num_scenes", "3") == 0
    want_old = _visible(old)
    new = tmp_path / "new"
    assert _make(new, "--num_scenes", "2", "--seed", "1") == 0
    want = want_old if at <= 7 else _visible(new)
    dead = _dead_pid()
    calls = []
    real = Path.rename

    def killed(self, target):
        calls.append(self.name)
        if len(calls) == at:
            raise SystemExit(137)
        return real(self, target)

    for method in ("rename", "replace"):
        monkeypatch.setattr(Path, method, killed)
    monkeypatch.setattr(data, "_clean_up", lambda out, pid: 0)  # SIGKILL: nothing cleaned up
    monkeypatch.setattr(os, "getpid", lambda: dead)
    assert _make(old, "--num_scenes", "2", "--seed", "1", "--overwrite") == (137 if at <= 7 else 0)
    monkeypatch.undo()
    capsys.readouterr()

    assert _make(old, "--num_scenes", "1") == 2  # the old scenes are back first, then: not empty
    err = capsys.readouterr().err.strip().splitlines()
    assert "not empty" in err[-1] and all(line.startswith("[memfit] ") for line in err[:-1]), err
    assert any("put back" in line for line in err) == (1 < at <= 7), err  # at 1: the swap had not begun
    assert _visible(old) == want
    assert _hidden(old) == []
    assert _make(old, "--num_scenes", "1", "--seed", "2", "--overwrite") == 0
    assert _names(old) == ["scene_000"]


def test_a_hidden_folder_left_by_a_killed_make_data_does_not_block_the_next_one(tmp_path, capsys):
    out = tmp_path / "mice"
    stale = out / f".make-data.tmp{_dead_pid()}" / "scene_000"
    stale.mkdir(parents=True)
    (stale / "000.png").write_bytes(b"half written")
    assert _make(out, "--num_scenes", "1") == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "removed" in err[0] and ".make-data.tmp" in err[0], err
    assert _names(out) == ["scene_000"]

    busy = tmp_path / "busy"  # a live make-data's folder stays
    (busy / f".make-data.tmp{os.getppid()}").mkdir(parents=True)
    assert _make(busy, "--num_scenes", "1") == 2
    assert "not empty" in _one_line(capsys)
    assert (busy / f".make-data.tmp{os.getppid()}").is_dir()
