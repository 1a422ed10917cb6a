"""The flags of `ginr-eval`, read without importing torch: `--help` and a refused flag or number answer
before torch's import (about 2 s), which only the work in ginr_cifar.eval pays (memfit.system.parse_then_run).
"""

from __future__ import annotations

import argparse

from memfit.train.flags import Parser, add_eval_args, check_numbers, summary_of

from ginr_cifar.config import SPLITS, default_cache_dir


def eval_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`ginr-eval`'s flags (argv None: sys.argv[1:]), their numbers checked."""
    p = Parser(description=summary_of("ginr_cifar.eval"))
    p.add_argument("--data", default=None, help="dataset (default: the one the run trained on)")
    p.add_argument(
        "--split",
        default="auto",
        choices=["auto", *SPLITS],
        help="auto: the run's held-out images, or --data's test images, or all of --data's images",
    )
    p.add_argument(
        "--resolution", type=int, default=None, help="decode at R x R pixels (default: the image size)"
    )
    p.add_argument("--holdout", type=int, default=None, help="held-out count (default: the run's)")
    p.add_argument("--num_images", type=int, default=None, help="evaluate only the first N images")
    p.add_argument("--batch_size", type=int, default=100)
    p.add_argument("--grid", type=int, default=16, help="images in the PNG grid (spread across the set)")
    p.add_argument("--cache_dir", default=str(default_cache_dir()))
    p.add_argument("--no_cache", action="store_true")
    add_eval_args(p, "ginr-cifar")
    args = p.parse_args(argv)
    check_numbers(args, batch_size="[1, 2**20]", grid="[1, 1024]", num_images="[1, 2**31-1]",
                  resolution="[1, 2**14]", holdout="[0, 2**31-1]")  # fmt: skip
    return args
