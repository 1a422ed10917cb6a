"""Learning (slow: the CPU recipe's full 20-minute budget, one torch thread): `train --max_minutes 20`
on generated mice, then `eval` on the `test` split, scenes the training never saw (it validated on the
`val` split to keep best.pt), rendered from held-out views: PSNR >= 20 dB and SSIM >= 0.80, the
issue-14 goal, far above the best constant colour."""

import pytest
from moremouse_triplane import eval as mouse_eval
from moremouse_triplane import train as mouse_train

MINUTES = 20


@pytest.mark.slow
def test_cpu_recipe_renders_held_out_views_of_held_out_scenes(tmp_path):
    out = mouse_train.main(
        ["--max_minutes", str(MINUTES), "--no_progress", "--runs_dir", str(tmp_path), "--run_name", "cpu"]
    )
    assert out["stopped_early"], "the recipe runs until its time budget"
    res = mouse_eval.main(
        ["--run", str(tmp_path / "moremouse-triplane" / "cpu"), "--num_scenes", "16", "--device", "cpu"]
    )
    print(
        f"{MINUTES} min, {out['step']} steps (best step {out.get('best_step')}): held-out test scenes "
        f"PSNR {res['psnr']:.2f} dB, SSIM {res['ssim']:.3f}; constant colour {res['psnr_constant']:.2f} dB, "
        f"SSIM {res['ssim_constant']:.3f}"
    )
    assert res["data"] == "generated test scenes" and res["checkpoint"].endswith("best.pt")
    assert res["psnr"] >= 20.0 and res["ssim"] >= 0.80, res
    assert res["psnr"] >= res["psnr_constant"] + 5.0, res
