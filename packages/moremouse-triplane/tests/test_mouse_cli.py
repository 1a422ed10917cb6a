"""mouse-train / mouse-eval end to end on generated scenes: checkpoints, exact resume, PSNR and a PNG."""

import json

import pytest
import torch
from memfit.cli import load_system
from memfit.errors import UsageError
from memfit.train.checkpoint import load_checkpoint
from moremouse_triplane import eval as mouse_eval
from moremouse_triplane import train as mouse_train
from moremouse_triplane.data import export_scenes
from PIL import Image

FAST = [
    "--config",
    "tiny",
    "--batch_size",
    "2",
    "--rays_per_scene",
    "64",
    "--samples_per_ray",
    "16",
    "--val_scenes",
    "1",
    "--no_progress",
]


def _train(tmp_path, name, *extra):
    return mouse_train.main([*FAST, "--runs_dir", str(tmp_path), "--run_name", name, *extra])


def test_train_checkpoints_resumes_exactly_and_eval_writes_psnr_png(tmp_path):
    _train(tmp_path, "full", "--steps", "4", "--save_every", "2")
    _train(tmp_path, "cut", "--steps", "2", "--save_every", "2", "--schedule_steps", "4")  # interrupted at 2
    _train(tmp_path, "cut", "--steps", "4", "--save_every", "2", "--resume")
    run = tmp_path / "moremouse-triplane"
    assert sorted(p.name for p in (run / "full").glob("ckpt_*.pt")) == ["ckpt_0000002.pt", "ckpt_0000004.pt"]
    full, cut = load_checkpoint(run / "full"), load_checkpoint(run / "cut")
    assert full["step"] == cut["step"] == 4 and full["config"]["samples_per_ray"] == 16
    for k in full["model"]:
        torch.testing.assert_close(full["model"][k], cut["model"][k], msg=f"resumed run differs at {k}")
    assert (run / "full" / "metrics.jsonl").exists()

    res = mouse_eval.main(["--run", str(run / "full"), "--num_scenes", "2", "--device", "cpu"])
    assert res["views"] == 8 and 5.0 < res["psnr"] < 60.0 and -1.0 <= res["ssim"] <= 1.0
    assert res["data"] == "generated test scenes" and 5.0 < res["psnr_constant"] < 60.0
    out = run / "full" / "eval"
    for name in ("views.png", "orbit.png", "orbit.gif"):
        assert (out / name).stat().st_size > 0, name
    cell = 32 * mouse_eval.PNG_SCALE + 2  # 2 scenes x (truth, prediction) rows of input + 4 views
    with Image.open(out / "views.png") as im:
        assert im.size == (5 * cell + 2, 4 * cell + 2)
    with Image.open(out / "orbit.gif") as im:
        assert im.n_frames == mouse_eval.ORBIT_FRAMES
    assert json.loads((out / "eval.json").read_text())["psnr"] == pytest.approx(res["psnr"])


def test_validation_keeps_the_best_checkpoint_and_eval_uses_it(tmp_path):
    out = _train(
        tmp_path, "val", "--steps", "4", "--eval_every", "2", "--val_scenes", "2", "--save_every", "0"
    )
    run = tmp_path / "moremouse-triplane" / "val"
    best = load_checkpoint(run / "best.pt")
    assert out["best_step"] in (2, 4) and best["step"] == out["best_step"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: r["eval/psnr"] for r in records if "eval/psnr" in r}
    assert sorted(scored) == [2, 4] and scored[out["best_step"]] == max(scored.values())
    assert all(0.0 < r["eval/ssim"] <= 1.0 for r in records if "eval/ssim" in r)
    res = mouse_eval.main(["--run", str(run), "--num_scenes", "1", "--device", "cpu"])
    assert res["checkpoint"].endswith("best.pt") and res["step"] == out["best_step"]


def test_train_on_a_folder_of_renders_with_fp16_amp(tmp_path):
    export_scenes(tmp_path / "data", 2, 32, seed=0, split="train")
    out = _train(tmp_path, "folder", "--steps", "2", "--data", str(tmp_path / "data"), "--amp", "fp16")
    assert out["step"] == 2 and out["peak_memory_mib"] > 0
    res = mouse_eval.main(
        ["--run", str(tmp_path / "moremouse-triplane" / "folder"), "--data", str(tmp_path / "data")]
    )
    assert res["scenes"] == 2 and res["views"] == 8


def test_cli_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(UsageError, match="no such folder"):
        _train(tmp_path, "x", "--steps", "1", "--data", str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="no checkpoint"):
        mouse_eval.main(["--run", str(tmp_path)])


def test_cpu_recipe_renders_with_the_input_view_through_train_and_eval(tmp_path):
    out = _train(tmp_path, "cpu", "--config", "cpu", "--steps", "2", "--val_scenes", "1")
    run = tmp_path / "moremouse-triplane" / "cpu"
    cfg = load_checkpoint(run / "best.pt")["config"]
    assert out["step"] == 2 and cfg["pixel_features"] and cfg["global_context"]
    assert cfg["view_features"] == 32 and cfg["carve"] > 0
    res = mouse_eval.main(["--run", str(run), "--num_scenes", "1", "--device", "cpu"])
    assert res["views"] == 4 and 5.0 < res["psnr"] < 60.0


@pytest.mark.parametrize(
    "scenes, val, says",
    [
        (12, "4", "validation on 3 of --data's 12 scenes, held out of training (--val_scenes 4: a quarter at "
         "most), every 2 steps"),
        (3, "4", "no validation: --data has 3 scenes, too few to hold one out"),
        (None, "0", "no validation (--val_scenes 0), so no best.pt"),
        (None, "1", "validation on 1 held-out generated scene (the val split), every 2 steps"),
    ],
)  # fmt: skip
def test_the_first_line_says_how_many_scenes_validation_holds_out(tmp_path, capsys, scenes, val, says):
    data = ()
    if scenes:
        export_scenes(tmp_path / "data", scenes, 32, seed=0, split="train")
        data = ("--data", str(tmp_path / "data"))
    argv = [*FAST, "--val_scenes", val, "--eval_every", "2", "--steps", "1", "--runs_dir", str(tmp_path)]
    mouse_train.main([*argv, "--rays_per_scene", "8", *data])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("[mouse-train] preset"))
    assert says in line, line


def test_eval_checkpoint_best_of_a_run_without_best_pt_says_it_uses_the_latest(tmp_path, capsys):
    _train(tmp_path, "noval", "--steps", "2", "--save_every", "1", "--val_scenes", "0", "--keep_last", "2")
    run = tmp_path / "moremouse-triplane" / "noval"
    assert not (run / "best.pt").exists()
    capsys.readouterr()
    res = mouse_eval.main(["--run", str(run), "--num_scenes", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert res["checkpoint"].endswith("ckpt_0000002.pt")
    assert f"--checkpoint best: {run} has no best.pt" in err
    assert "using its latest checkpoint, ckpt_0000002.pt" in err
    mouse_eval.main(["--run", str(run), "--num_scenes", "1", "--checkpoint", "latest"])
    assert "best.pt" not in capsys.readouterr().err  # asked for the latest: nothing to say


def test_a_relative_data_is_kept_absolute_so_resume_elsewhere_trains_on_it(tmp_path, monkeypatch, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    export_scenes(a / "scenes", 4, 32, seed=0, split="train")
    b.mkdir()
    monkeypatch.chdir(a)
    _train(tmp_path, "rel", "--steps", "1", "--data", "scenes", "--val_scenes", "0")
    run = tmp_path / "moremouse-triplane" / "rel"
    assert json.loads((run / "config.json").read_text())["train"]["data"] == str(a / "scenes")
    monkeypatch.chdir(b)  # a bare --resume reads config.json: the same scenes, from anywhere
    capsys.readouterr()
    out = mouse_train.main(["--runs_dir", str(tmp_path), "--run_name", "rel", "--resume", "--steps", "2"])
    assert out["step"] == 2
    assert load_checkpoint(run)["settings"]["train"]["data"] == str(a / "scenes")


def test_a_file_given_as_data_is_said_to_be_a_file(tmp_path, capsys):
    afile = tmp_path / "scenes.zip"
    afile.write_bytes(b"PK")
    mouse = load_system("moremouse-triplane")
    assert (
        mouse.command("train")([*FAST, "--steps", "1", "--data", str(afile), "--runs_dir", str(tmp_path)])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--data {afile} is a file, not a folder" in err
    assert "scene_000/cameras.json" in err
    _train(tmp_path, "r", "--steps", "1", "--val_scenes", "0")
    capsys.readouterr()
    assert (
        mouse.command("eval")(["--run", str(tmp_path / "moremouse-triplane" / "r"), "--data", str(afile)])
        == 2
    )
    assert f"--data {afile} is a file, not a folder" in capsys.readouterr().err
