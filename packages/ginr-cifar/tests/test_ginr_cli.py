"""train / eval CLIs: a few steps on the embedded set and the shared CIFAR folder, exact resume, eval."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from ginr_cifar import eval as ginr_eval
from ginr_cifar import train as ginr_train
from memfit.cli import load_system
from memfit.errors import UsageError
from memfit.train.checkpoint import list_checkpoints, load_checkpoint
from PIL import Image

SHARED = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "cifar10-jpg" / "train"
SMALL = [
    "--config",
    "tiny",
    "--batch_size",
    "4",
    "--num_sample_coords",
    "64",
    "--no_progress",
    "--warmup",
    "2",
]


def _train(tmp_path, name, *extra):
    argv = [*SMALL, "--runs_dir", str(tmp_path / "runs"), "--run_name", name, "--holdout", "100"]
    argv += ["--eval_images", "8", "--cache_dir", str(tmp_path / "cache"), *extra]
    return ginr_train.main(argv)


def test_ginr_train_checkpoints_resume_exactly_and_eval(tmp_path, capsys):
    res = _train(tmp_path, "a", "--steps", "4", "--save_every", "2", "--keep_last", "5")
    run_a = tmp_path / "runs" / "ginr-cifar" / "a"
    assert [p.name for p in list_checkpoints(run_a)] == ["ckpt_0000002.pt", "ckpt_0000004.pt"]
    assert res["step"] == 4 and torch.isfinite(torch.tensor(res["loss"]))
    assert "peak memory consumption" in capsys.readouterr().out

    # resume from the step-2 checkpoint in a fresh run folder: must land on the very same weights
    run_b = tmp_path / "runs" / "ginr-cifar" / "b"
    run_b.mkdir(parents=True)
    shutil.copy(run_a / "ckpt_0000002.pt", run_b / "ckpt_0000002.pt")
    _train(tmp_path, "b", "--steps", "4", "--save_every", "2", "--resume")
    wa, wb = load_checkpoint(run_a)["model"], load_checkpoint(run_b)["model"]
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k

    out = ginr_eval.main(["--run", str(run_a), "--num_images", "12", "--grid", "6", "--device", "cpu"])
    saved = json.loads((run_a / "eval" / "eval_holdout.json").read_text())
    assert saved["num_images"] == 12 and abs(saved["psnr"] - out["psnr"]) < 1e-9
    assert 0 < saved["psnr"] < 60 and saved["mean_colour_psnr"] > 0
    with Image.open(run_a / "eval" / "recon_holdout.png") as im:
        # 2 rows (truth, reconstruction) x 6 images of 32x32 upscaled 4x, with 2-pixel padding
        assert im.size == (6 * (128 + 2) + 2, 2 * (128 + 2) + 2)


def test_ginr_train_on_shared_cifar_folder(tmp_path):
    if not SHARED.exists():
        pytest.skip(f"shared CIFAR-10 JPEGs not found at {SHARED}")
    res = _train(
        tmp_path, "cifar", "--data", str(SHARED), "--steps", "2", "--max_images", "64", "--decoder", "xattn"
    )
    assert res["step"] == 2 and "eval/val_psnr" in res
    ckpt = load_checkpoint(tmp_path / "runs" / "ginr-cifar" / "cifar")
    assert ckpt["config"]["decoder"] == "xattn" and ckpt["meta"]["data"] == os.path.abspath(SHARED)


def test_ginr_profile_mode(tmp_path, capsys):
    res = _train(tmp_path, "p", "--profile", "--profile_iters", "2")
    assert res["encode_ms"] > 0 and res["decode_ms"] > 0 and res["backward_mib"] > 0
    assert "encode" in capsys.readouterr().out


def test_ginr_cli_errors_are_clear(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no images found"):
        _train(tmp_path, "x", "--data", str(tmp_path / "empty"), "--steps", "1")
    with pytest.raises(UsageError, match="num_sample_coords"):
        _train(tmp_path, "x", "--num_sample_coords", "5000", "--steps", "1")
    with pytest.raises(UsageError, match="no run .*nothing_here"):
        ginr_eval.main(["--run", str(tmp_path / "nothing_here"), "--device", "cpu"])


def test_ginr_time_budget_without_steps_trains_until_the_budget():
    budget = ginr_train.build_parser().parse(["--max_minutes", "20"]).settings.loop
    assert budget.steps is None and budget.max_minutes == 20
    assert ginr_train.build_parser().parse([]).settings.loop.steps == 1000  # the preset's


@pytest.fixture
def relative_run(tmp_path, monkeypatch):
    """A run trained from tmp_path/a on `--data imgs` (24 random 32x32 images), `--holdout 5`; the test
    then stands in tmp_path/b. (the run folder, a file beside it)."""
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "imgs" / "cls").mkdir(parents=True)
    b.mkdir()
    rng = np.random.default_rng(0)
    for i in range(24):
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(a / "imgs" / "cls" / f"{i}.png")
    monkeypatch.chdir(a)
    argv = [*SMALL, "--data", "imgs", "--holdout", "5", "--eval_images", "4", "--steps", "1", "--no_cache"]
    ginr_train.main([*argv, "--runs_dir", "runs", "--run_name", "rel"])
    monkeypatch.chdir(b)
    (b / "somefile").write_text("not a folder")
    return a / "runs" / "ginr-cifar" / "rel", b / "somefile"


def test_a_relative_data_is_kept_absolute_so_eval_elsewhere_reads_it(relative_run):
    run, _ = relative_run
    data = str(run.parents[2] / "imgs")
    assert json.loads((run / "config.json").read_text())["train"]["data"] == data
    res = ginr_eval.main(["--run", str(run), "--no_cache", "--device", "cpu"])  # from tmp_path/b
    assert res["data"] == data and res["split"] == "holdout" and res["num_images"] == 5


def test_eval_and_train_say_a_data_file_is_not_a_folder(relative_run, capsys):
    run, somefile = relative_run
    capsys.readouterr()
    ginr = load_system("ginr-cifar")
    assert ginr.command("eval")(["--run", str(run), "--data", str(somefile), "--no_cache"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--data {somefile} is a file, not a folder" in err
    assert "ImageFolder tree" in err
    assert ginr.command("train")([*SMALL, "--data", str(somefile), "--steps", "1"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_eval_split_test_without_a_test_folder_names_the_runs_own_holdout(relative_run, capsys):
    run, _ = relative_run  # trained with --holdout 5, not the default 500
    capsys.readouterr()
    ginr = load_system("ginr-cifar")
    assert ginr.command("eval")(["--run", str(run), "--split", "test", "--no_cache"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "use --split holdout (5 images held out of train)" in err
    assert ginr.command("eval")(["--run", str(run), "--split", "test", "--holdout", "0", "--no_cache"]) == 2
    assert "--holdout 0 held none of it out; use --split all" in capsys.readouterr().err
