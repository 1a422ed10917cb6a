"""Measure mbsnet-speech's augmentations one by one: short `train` runs of the CPU recipe on several
sources (speech-tts pairs, speech-voices, noise-real), each with one augmentation on, validated on whole
held-out voices and noise recordings (the recipe's val_voices / val_noises; the test groups are never
read). Prints one line per run: best validation PESQ-wb / STOI / SI-SDR and the step it came at.

    taskset -c 1 uv run python tools/mbsnet_augment_runs.py --minutes 6 [--only none,speed] [--seed 1]
        [--extra speed=0.5] [--out DIR]

Runs one after another (one thread each, the recipe's); wall-clock budgets, so keep the machine's other
work off the core it runs on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from memfit.train.flags import Parser

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
VARIANTS = {
    "none": "",
    "speed": "speed=0.5",
    "eq": "eq=0.5",
    "reverb": "reverb=0.3",
    "gain_clip": "gain=0.2,clip=0.1",
    "bandlimit": "bandlimit=0.2",
}


def best_eval(run_dir: Path) -> dict:
    """The validation record with the highest PESQ-wb in a run's metrics.jsonl."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in rows if "eval/pesq" in r]
    return max(evals, key=lambda r: r["eval/pesq"]) if evals else {}


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument(
        "--only", default=",".join(VARIANTS), help="comma-separated variants: " + ", ".join(VARIANTS)
    )
    ap.add_argument("--extra", default="", help="augmentations on in every run besides the variant's")
    ap.add_argument("--out", default="runs-augment")
    ap.add_argument("--eval_every", type=int, default=200)
    ap.add_argument(
        "--seed", type=int, default=0, help="training seed (run-to-run spread: repeat with another)"
    )
    args = ap.parse_args()
    for name in args.only.split(","):
        aug = ",".join(a for a in (args.extra, VARIANTS[name]) if a) or "speed=0"
        cmd = [
            sys.executable,
            "-m",
            "mbsnet_speech.train",
            "--config",
            "cpu",
            "--data",
            str(DATA / "speech-tts"),
            "--clean",
            str(DATA / "speech-voices" / "clean"),
            "--noise",
            str(DATA / "noise-real"),
            "--augment",
            aug,
            "--max_minutes",
            str(args.minutes),
            "--eval_every",
            str(args.eval_every),
            "--runs_dir",
            args.out,
            "--run_name",
            f"{name}-s{args.seed}",
            "--seed",
            str(args.seed),
            "--no_progress",
            "--overwrite",
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        b = best_eval(Path(args.out) / "mbsnet-speech" / f"{name}-s{args.seed}")
        print(
            f"RESULT {name:<10} seed {args.seed} augment {aug:<28} "
            f"best val PESQ-wb {b.get('eval/pesq', float('nan')):.3f} "
            f"STOI {b.get('eval/stoi', float('nan')):.3f} SI-SDR {b.get('eval/si_sdr', float('nan')):.2f} "
            f"at step {b.get('step')}",
            flush=True,
        )


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("mbsnet_augment_runs", lambda _argv: main()))
