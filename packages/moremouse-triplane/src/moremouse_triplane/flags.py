"""The flags of `mouse-eval` and `make-data`, read without importing torch: `--help` and a refused flag or
number answer before torch's import (about 2 s), which only the work in moremouse_triplane.eval and
moremouse_triplane.data pays (memfit.system.parse_then_run).
"""

from __future__ import annotations

import argparse

from memfit.train.flags import Parser, add_eval_args, check_numbers, summary_of

from moremouse_triplane.config import SPLIT_IDS


def eval_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`mouse-eval`'s flags (argv None: sys.argv[1:]), their numbers checked."""
    # eval.py's whole docstring is the --help text
    help_text = summary_of("moremouse_triplane.eval", whole=True)
    p = Parser(description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", default=None, help="folder of renders; default: held-out generated mice (see --split)"
    )
    p.add_argument(
        "--split",
        default="test",
        choices=["val", "test"],
        help="generated scenes to score: test (default; never seen in training) or val (the ones "
        "training validated on to choose best.pt)",
    )
    p.add_argument("--num_scenes", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint",
        default="best",
        choices=["best", "latest"],
        help="which checkpoint of a run folder: best (default) is best.pt, or the latest checkpoint, saying "
        "so, where the run kept no best.pt (it did not validate)",
    )
    add_eval_args(p, "moremouse-triplane")
    args = p.parse_args(argv)
    check_numbers(args, num_scenes="[1, 2**20]", seed="0..2**63-1")
    return args


def make_data_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`memfit run moremouse-triplane make-data`'s flags (argv None: sys.argv[1:]), their numbers checked."""
    p = Parser(
        prog="memfit run moremouse-triplane make-data",
        description="`make-data`: write generated mice as a folder of renders (the --data layout). OUT must "
        "be new or empty, or --overwrite given.",
    )
    p.add_argument("out", help="output folder")
    p.add_argument("--num_scenes", type=int, default=8)
    p.add_argument("--image_size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="val", choices=list(SPLIT_IDS))
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty OUT: the scene_NNN folders an earlier make-data wrote there (listed "
        "in OUT/.make-data.json, still real folders holding only its cameras.json and NNN.png) are "
        "removed, so no old scene mixes with the new ones; nothing else is removed (other files and "
        "folders, links, an OUT without that list); a new scene's name taken by anything else is refused",
    )
    args = p.parse_args(argv)
    check_numbers(args, num_scenes=">=1", image_size=">=1")
    return args
