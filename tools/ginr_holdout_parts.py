"""Score a ginr-cifar checkpoint on the two halves of its 500 held-out images.

`train` validates on the first ``--eval_images`` (cpu recipe: 250) held-out images and keeps the best
checkpoint by them, so only the rest are untouched by any choice. This prints the model, the 16x16 ->
bicubic baseline (the same 768 numbers as the cpu recipe's latent) and the mean colour on all of them,
on the validation part and on the untouched part, plus the super-resolution artefact figures.

    uv run python tools/ginr_holdout_parts.py --run RUN --data ../shared/data/cifar10-jpg/train
"""

from __future__ import annotations

import argparse

import torch
from ginr_cifar.data import load_split
from ginr_cifar.eval import bicubic_psnr, evaluate_psnr, load_model, mean_colour_psnr, superres_check


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="run name, run folder or checkpoint (best.pt by default)")
    p.add_argument("--data", required=True, help="the training data the run held its images out of")
    p.add_argument("--holdout", type=int, default=500)
    p.add_argument("--validation", type=int, default=250, help="held-out images train validated on")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, meta = load_model(args.run, torch.device("cpu"))
    model.eval()
    images = load_split(args.data, "holdout", holdout=args.holdout).images
    print(f"checkpoint {meta['path']} (step {meta['step']}), {images.shape[0]} held-out images")
    v = args.validation
    parts = [("all", images), (f"validation [:{v}]", images[:v]), (f"untouched [{v}:]", images[v:])]
    for name, part in parts:
        print(
            f"{name:>18}: n {part.shape[0]:4d}  model {evaluate_psnr(model, part):.2f} dB  "
            f"16x16 bicubic {bicubic_psnr(part):.2f} dB  mean colour {mean_colour_psnr(part):.2f} dB"
        )
    sr = superres_check(model, images[v : v + 100])
    print(
        f"64x64 decode on 100 untouched images: 32x32 {sr['psnr']:.2f} dB, 64x64 pooled to 32x32 "
        f"{sr['psnr_fine_pooled']:.2f} dB, high-frequency energy {sr['hf_ratio']:.3f}x a bicubic upsample's"
    )


if __name__ == "__main__":
    main()
