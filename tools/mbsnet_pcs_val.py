"""Inference settings (perceptual contrast stretching on / off, the share of noisy input kept), scored on a
run's OWN validation files (never a test split).

    uv run python tools/mbsnet_pcs_val.py RUN

RUN is a run folder or checkpoint. The files are the ones `train` validated that run on, rebuilt from the
settings its checkpoint carries: held-out voices x held-out noise recordings for `--clean`, the pairs
held out of `--data`, or the generated held-out pairs. One thread. Prints PESQ-wb, STOI and SI-SDR of the
noisy input, of the model with PCS off and on, and with PCS on and 5, 10, 20% of the noisy input kept.
"""

from __future__ import annotations

import argparse

import torch
from mbsnet_speech.config import TrainConfig
from mbsnet_speech.data import SAMPLE_RATE
from mbsnet_speech.eval import score_model
from mbsnet_speech.system import SYSTEM
from mbsnet_speech.train import build_data
from memfit.settings import flatten, override


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    a = ap.parse_args()
    torch.set_num_threads(1)
    _, state = SYSTEM.load_model(a.run, "cpu")
    t = override(TrainConfig(), flatten(state["settings"]["train"], TrainConfig()))
    items = build_data(t, int(t.seconds * SAMPLE_RATE))[1]
    rows = {"noisy": score_model(None, items)}
    for pcs, keep in ((False, 0.0), (True, 0.0), (True, 0.05), (True, 0.1), (True, 0.2)):
        model, state = SYSTEM.load_model(a.run, "cpu", pcs=pcs, keep_noisy=keep)
        rows[f"pcs {'on' if pcs else 'off'}, keep {keep:g}"] = score_model(model, items)
    print(f"{state['path']} (step {state['step']}), {len(items)} validation files, 1 thread")
    for name, r in rows.items():
        print(f"  {name:18s} PESQ-wb {r['pesq']:.3f}  STOI {r['stoi']:.4f}  SI-SDR {r['si_sdr']:.2f} dB")


if __name__ == "__main__":
    main()
