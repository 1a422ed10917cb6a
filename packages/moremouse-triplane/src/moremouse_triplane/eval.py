"""`mouse-eval`: novel views of held-out scenes -> PSNR, SSIM and a PNG (input | predictions | truth).

    uv run mouse-eval --run run      (a run name, a run folder or a checkpoint file; writes <run>/eval/)

Held-out scenes are the `val` split of the generator (never seen in training), or every scene of
--data; held-out views are views other than the input. The baseline printed beside the model is the
best constant colour per image (its mean), which bounds what "predict the background" can score.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from memfit.flags import add_eval_args, apply_threads, check_numbers, eval_out_dir
from memfit.metrics import psnr_per_image
from memfit.run_dir import resolve_run
from memfit.training import resolve_device

from moremouse_triplane.data import make_source, save_image
from moremouse_triplane.model import TriplaneGenerator
from moremouse_triplane.render import image_rays


def psnr(pred: torch.Tensor, target: torch.Tensor) -> float:
    """PSNR in dB of one image in [0, 1] (any shape)."""
    return psnr_per_image(pred[None], target[None]).item()


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    return g[:, None] * g[None, :]


def ssim(x: torch.Tensor, y: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """SSIM (Wang et al. 2004; gaussian window 11, sigma 1.5, valid): (N, C, H, W) in [0, 1] -> (N,)."""
    C = x.shape[1]
    w = _gaussian_window(min(window, x.shape[-1], x.shape[-2]), sigma).to(x)[None, None].expand(C, 1, -1, -1)

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, w, groups=C)

    x, y = x.float(), y.float()
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return s.flatten(1).mean(1)


@torch.no_grad()
def render_views(
    model: TriplaneGenerator, image: torch.Tensor, K: torch.Tensor, c2w: torch.Tensor
) -> torch.Tensor:
    """Input image (3, H, W), cameras K (V, 3, 3), c2w (V, 4, 4) -> rendered views (V, 3, H, W)."""
    H = W = model.cfg.image_size
    planes = model(image[None])
    o, d = image_rays(K, c2w, H, W)  # (V, H*W, 3)
    V = len(K)
    rgb, _ = model.render(planes.expand(V, *planes.shape[1:]), o, d)
    return rgb.clamp(0, 1).transpose(1, 2).reshape(V, 3, H, W)


def load_model(run: str | Path | None, device: torch.device) -> TriplaneGenerator:
    """The generator of a run (name or folder: best.pt, else its newest checkpoint) or a checkpoint file."""
    from moremouse_triplane.system import SYSTEM

    return SYSTEM.load_model(run, device)[0]


def evaluate(
    model: TriplaneGenerator, source, num_scenes: int, device: torch.device, png: Path | None = None
) -> dict:
    """Mean PSNR / SSIM of the model and of the constant-colour baseline over held-out views."""
    num_scenes = min(num_scenes, len(source))
    p_model, p_const, s_model, rows = [], [], [], []
    for i in range(num_scenes):
        ev = source.eval_scene(i)
        gt = ev["images"].to(device)
        pred = render_views(model, ev["input"].to(device), ev["K"].to(device), ev["c2w"].to(device)).float()
        const = gt.mean(dim=(2, 3), keepdim=True).expand_as(gt)
        for v in range(len(gt)):
            p_model.append(psnr(pred[v], gt[v]))
            p_const.append(psnr(const[v], gt[v]))
        s_model.append(ssim(pred, gt).mean().item())
        if png is not None and i < 6:
            rows.append(torch.cat([ev["input"].to(device), *pred, *gt], dim=2))
    if png is not None and rows:
        png.parent.mkdir(parents=True, exist_ok=True)
        save_image(torch.cat(rows, dim=1).cpu(), png)
    return {
        "psnr": sum(p_model) / len(p_model),
        "psnr_constant": sum(p_const) / len(p_const),
        "ssim": sum(s_model) / len(s_model),
        "scenes": num_scenes,
        "views": len(p_model),
    }


def main(argv: list[str] | None = None) -> dict:
    """Evaluate a trained run; prints and returns {psnr, psnr_constant, ssim, ...}."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", default=None, help="folder of renders; default: held-out generated mice (val split)"
    )
    p.add_argument("--num_scenes", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    add_eval_args(p, "moremouse-triplane")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    apply_threads(args)
    check_numbers(args, num_scenes=">=1")
    device = resolve_device(args.device)
    run = resolve_run(args.run, "moremouse-triplane", args.runs_dir)
    out = eval_out_dir(args, run)
    try:
        model = load_model(run, device)
        source = make_source(args.data, model.cfg.image_size, seed=args.seed, split="val")
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    png = out / "eval.png"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        res = evaluate(model, source, args.num_scenes, device, png)
    res["png"] = str(png)
    print(
        f"held-out: {res['scenes']} scenes, {res['views']} views: PSNR {res['psnr']:.2f} dB "
        f"(constant colour {res['psnr_constant']:.2f} dB), SSIM {res['ssim']:.3f}; wrote {png}"
    )
    (out / "eval.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("mouse-eval", main))
