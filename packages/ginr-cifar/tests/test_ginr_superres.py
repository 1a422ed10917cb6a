"""Super-resolution and eval on any folder, on a model trained for a few seconds with the CPU recipe.

Measured (100 steps, batch 16, 128 coords, 50 held-out embedded images): the seed's coordinate setup
(finest Fourier band at the pixel Nyquist, max_freq 32, pixel centres only) gives a 64x64 decode with
2.10x the high-frequency energy of a bicubic upsample (the stripes); max_freq 16 with sub-pixel jitter,
the CPU preset's setup, gives 1.04x.
"""

import json

import pytest
import torch
from ginr_cifar import eval as ginr_eval
from ginr_cifar import train as ginr_train
from ginr_cifar.data import load_split
from PIL import Image

STEPS = ["--steps", "80", "--batch_size", "16", "--num_sample_coords", "128", "--warmup", "5"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sr")
    argv = ["--config", "cpu", *STEPS, "--runs_dir", str(root / "runs"), "--run_name", "sr", "--threads", "1"]
    argv += ["--holdout", "100", "--eval_images", "50", "--save_every", "0", "--no_progress"]
    ginr_train.main(argv)
    return root / "runs" / "ginr-cifar" / "sr"


@pytest.fixture(scope="module")
def model_and_images(run):
    model, _ = ginr_eval.load_model(run, torch.device("cpu"))
    return model, load_split(None, "holdout", holdout=100).images[:50]


def test_ginr_decodes_at_any_resolution(model_and_images):
    model, images = model_and_images
    x = images[:4]
    for res in (16, 45, 64):
        assert ginr_eval.reconstruct(model, x, resolution=res).shape == (4, 3, res, res)
    # A 96x96 grid holds the 32x32 pixel centres at rows/cols 1, 4, 7...: the same function, sampled finer.
    fine = ginr_eval.reconstruct(model, x, resolution=96, batch_size=3)
    coarse = ginr_eval.reconstruct(model, x)
    torch.testing.assert_close(fine[:, :, 1::3, 1::3], coarse, atol=1e-5, rtol=0)


def test_ginr_superres_has_no_stripes(model_and_images):
    model, images = model_and_images
    got = ginr_eval.superres_check(model, images)
    assert got["psnr"] > 14.5  # it learnt something: the mean colour gives ~13 dB on these images
    assert got["psnr_fine_pooled"] >= got["psnr"] - 0.5, got
    assert got["hf_ratio"] <= 1.10, got


def test_ginr_high_freq_energy_sees_stripes():
    flat = torch.full((2, 3, 64, 64), 0.5)
    stripes = flat.clone()
    stripes[..., ::2] += 0.1  # a vertical stripe every other column: energy at 32 cycles per image
    assert ginr_eval.high_freq_energy(flat, 16).max() < 1e-10
    assert ginr_eval.high_freq_energy(stripes, 16).min() > 1e-3


def _write_folder(root, per_class=6):
    g = torch.Generator().manual_seed(0)
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            arr = torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8).numpy()
            Image.fromarray(arr).save(root / cls / f"{i}.png")


def test_ginr_eval_on_a_plain_image_folder(run, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "pics"
    _write_folder(folder)
    monkeypatch.chdir(run.parents[2])  # the run by name, as `train --run_name sr` in this folder wrote it
    flags = ["--run", "sr", "--data", str(folder), "--no_cache", "--out", str(tmp_path / "o")]
    out = ginr_eval.main([*flags, "--grid", "4"])
    text = capsys.readouterr().out
    assert out["split"] == "all" and out["num_images"] == 12 and out["checkpoint"].endswith("best.pt")
    assert "12 all images" in text and "bicubic" in text and "mean colour" in text
    saved = json.loads((tmp_path / "o" / "eval_all.json").read_text())
    assert saved["bicubic16_psnr"] > saved["mean_colour_psnr"] and saved["latent_numbers"] == 16 * 48
    assert ginr_eval.spread(12, 4).tolist() == [0, 4, 7, 11]  # both classes (files 0-5 cat, 6-11 dog)
    with Image.open(tmp_path / "o" / "recon_all.png") as im:
        assert im.size == (4 * (128 + 2) + 2, 2 * (128 + 2) + 2)
    out64 = ginr_eval.main([*flags, "--resolution", "64", "--grid", "3", "--overwrite"])  # --out holds files
    assert out64["resolution"] == 64 and abs(out64["psnr"] - out["psnr"]) < 1.0
    assert (tmp_path / "o" / "recon_all_64.png").exists()
