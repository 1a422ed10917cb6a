"""`make-data`: a non-empty OUT needs --overwrite, which replaces the old scenes (never mixes them with
the new ones) and removes only what make-data writes; a failed run leaves no folder it created."""

from pathlib import Path

from memfit.cli import load_system
from moremouse_triplane.data import FolderScenes, SyntheticScenes

MAKE_DATA = load_system("moremouse-triplane").command("make-data")


def _make(out: Path, *extra: str) -> int:
    return MAKE_DATA([str(out), "--image_size", "8", *extra])


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


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
    assert sorted(p.name for p in out.iterdir()) == ["NOTES.txt", "scene_000"]  # no stale scene_001/002
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
    (out / "scene_001" / "cameras.json").unlink()  # no longer a scene, but where a new one would go
    before = _files(out)
    assert _make(out, "--num_scenes", "2", "--overwrite") == 2
    assert "scene_001 is in the way" in _one_line(capsys)
    assert _files(out) == before


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
    assert sorted(p.name for p in old.iterdir()) == ["scene_000", "scene_001", "scene_002"]
