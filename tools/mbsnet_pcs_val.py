"""Inference settings (perceptual contrast stretching on / off, the share of noisy input kept), scored on a
run's OWN validation files (never a test split).

    uv run python tools/mbsnet_pcs_val.py RUN [RUN_OR_CHECKPOINT ...] [--files N] [--keep 0,0.05]
                                          [--shifts 1,2,4] [--pcs | --no-pcs]

Each RUN is a run folder (its best.pt) or a checkpoint. The files are the ones `train` validated the first
run on, rebuilt from the settings its checkpoint carries: held-out voices x held-out noise recordings for
`--clean`, the pairs held out of `--data`, or the generated held-out pairs; `--files N` scores N of them
instead of the run's `--val_files` (more files, less noise when comparing runs). One thread. Prints PESQ-wb,
STOI and SI-SDR of the noisy input, then of each run with PCS off and on, and with PCS on and 5, 10, 20% of
the noisy input kept; `--keep` lists the kept shares to score instead, `--shifts` the numbers of delayed
passes averaged (every pair of the two lists; PCS as the run has it, or as `--pcs` / `--no-pcs` say).
`--drop_phase` also scores each setting with the model's phase correction dropped (the noisy phase kept):
how much of a run's scores its phase head makes.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from mbsnet_speech.config import TrainConfig
from mbsnet_speech.data import SAMPLE_RATE
from mbsnet_speech.eval import score_model
from mbsnet_speech.system import SYSTEM
from mbsnet_speech.train import build_data, freeze_phase_head
from memfit.errors import UsageError
from memfit.train.flags import Parser
from memfit.train.settings import flatten, override


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="RUN")
    ap.add_argument("--files", type=int, help="validation files to score (none: the run's --val_files)")
    ap.add_argument("--keep", help="comma-separated shares of noisy input kept, e.g. 0,0.05")
    ap.add_argument("--shifts", help="comma-separated numbers of delayed passes averaged, e.g. 1,2,4")
    ap.add_argument("--pcs", action=argparse.BooleanOptionalAction, default=None, help="with --keep/--shifts")
    ap.add_argument("--drop_phase", action="store_true", help="also score with the noisy phase kept")
    a = ap.parse_args()
    torch.set_num_threads(1)
    _, state = SYSTEM.load_model(a.runs[0], "cpu")
    t = override(TrainConfig(), flatten(state["settings"]["train"], TrainConfig()))
    if a.files:
        t = replace(t, val_files=a.files)
    if a.pcs is not None and not (a.keep or a.shifts):
        raise UsageError("error: --pcs / --no-pcs go with --keep or --shifts (alone, both are scored)")
    items = build_data(t, int(t.seconds * SAMPLE_RATE))[1]
    if a.keep or a.shifts:  # PCS as the run has it unless --pcs / --no-pcs
        pcs = {} if a.pcs is None else {"pcs": a.pcs}
        keeps = [float(k) for k in (a.keep or "0").split(",")]
        shifts = [int(n) for n in (a.shifts or "1").split(",")]
        settings = [{**pcs, "keep_noisy": k, "shifts": n} for k in keeps for n in shifts]
    else:
        settings = [
            {"pcs": pcs, "keep_noisy": k}
            for pcs, k in ((False, 0), (True, 0), (True, 0.05), (True, 0.1), (True, 0.2))
        ]
    print(f"{len(items)} validation files of {a.runs[0]}, 1 thread")
    show("noisy", score_model(None, items))
    for run in a.runs:
        for kw in settings:
            model, state = SYSTEM.load_model(run, "cpu", **kw)
            pcs = "on" if model.cfg.pcs else "off"
            name = f"{state['path']} (step {state['step']}) pcs {pcs}, keep {model.cfg.keep_noisy:g}"
            name += f", shifts {model.cfg.shifts}" if model.cfg.shifts > 1 else ""
            show(name, score_model(model, items))
            if a.drop_phase:
                freeze_phase_head(model)  # phase offset exactly 0: the noisy phase
                show(name + ", noisy phase", score_model(model, items))


def show(name: str, r: dict) -> None:
    print(f"  {name}: PESQ-wb {r['pesq']:.3f}  STOI {r['stoi']:.4f}  SI-SDR {r['si_sdr']:.2f} dB", flush=True)


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("mbsnet_pcs_val", lambda _argv: main()))
