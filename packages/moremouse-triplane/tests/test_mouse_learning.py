"""Learning (slow only: 40 steps, the most that fits ~40 s here, do not yet beat a constant colour):
after a fixed CPU budget the tiny preset renders held-out views of held-out scenes far better
than the best constant colour (the training scenes and the evaluated scenes are different splits)."""

import pytest
from moremouse_triplane import eval as mouse_eval
from moremouse_triplane import train as mouse_train


def _train_and_eval(tmp_path, steps: int) -> dict:
    mouse_train.main(
        [
            "--preset",
            "tiny",
            "--steps",
            str(steps),
            "--lr",
            "1e-3",
            "--save_every",
            "0",
            "--no_progress",
            "--runs_dir",
            str(tmp_path),
            "--run_name",
            "learn",
            "--seed",
            "0",
        ]
    )
    res = mouse_eval.main(
        ["--run", str(tmp_path / "moremouse-triplane" / "learn"), "--num_scenes", "8", "--device", "cpu"]
    )
    print(f"{steps} steps: PSNR {res['psnr']:.2f} dB vs constant colour {res['psnr_constant']:.2f} dB")
    return res


@pytest.mark.slow
def test_tiny_learns_novel_views_of_held_out_scenes(tmp_path):
    res = _train_and_eval(tmp_path, 300)
    assert res["psnr"] >= res["psnr_constant"] + 2.5, res
