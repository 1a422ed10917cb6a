"""Perceptual contrast stretching on / off, scored on a run's OWN validation files (never a test split).

    uv run python tools/mbsnet_pcs_val.py RUN [--data ROOT]

RUN is a run folder or checkpoint. With --data (a VoiceBank-style root) the files are the train split's
pairs that `train --data ROOT` held out (its fixed choice of 8); without it, the generated pairs that
`train` validates on. One thread. Prints PESQ-wb, STOI and SI-SDR of the noisy input and of the model
with PCS off and on.
"""

from __future__ import annotations

import argparse

import torch
from mbsnet_speech.data import find_pairs, heldout_pairs
from mbsnet_speech.eval import score_model
from mbsnet_speech.system import SYSTEM
from mbsnet_speech.train import VAL_SEED, _split_heldout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--data", default=None, help="the --data root the run trained on (default: generated)")
    ap.add_argument("--val_files", type=int, default=8, help="train's --val_files (default 8)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.data:
        pairs = find_pairs(a.data, split="train")
        _, val_idx = _split_heldout(len(pairs), a.val_files)
        items = [(pairs.names[i], *pairs.load(i)[::-1]) for i in val_idx]
    else:
        items = heldout_pairs(a.val_files, seconds=3.0, seed=VAL_SEED)
    rows = {"noisy": score_model(None, items)}
    for pcs in (False, True):
        model, state = SYSTEM.load_model(a.run, "cpu", pcs=pcs)
        rows[f"pcs {'on' if pcs else 'off'}"] = score_model(model, items)
    print(f"{state['path']} (step {state['step']}), {len(items)} validation files, 1 thread")
    for name, r in rows.items():
        print(f"  {name:8s} PESQ-wb {r['pesq']:.3f}  STOI {r['stoi']:.4f}  SI-SDR {r['si_sdr']:.2f} dB")


if __name__ == "__main__":
    main()
