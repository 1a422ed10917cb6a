"""Short CPU runs that chose mbsnet-speech's CPU recipe: a CPU-time budget, scored on held-out TRAIN files.

    uv run python tools/mbsnet_short_runs.py --name base --minutes 4 [--channels 48] [--lr 4e-3]
        [--hop 200] [--bidir] [--noisy_phase] [--loss '{"pha": 0.0, "sisdr": 0.02}'] [--remix] [--energy]

One thread; the budget is process CPU time (so other jobs on the machine do not change the step count
much); the validation set is 24 files carved from speech-tts's train split with a fixed seed (the test
split is never read); prints one RESULT line with PESQ-wb / STOI / SI-SDR noisy -> enhanced.
--remix mixes a clean file with another pair's noise (noisy - clean) at --snr (-5..15 dB) instead of
the fixed pairs (mbsnet_speech.data.PairRemix).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from mbsnet_speech.config import LossWeights, get_config
from mbsnet_speech.data import PairFolder, PairRemix, find_pairs, folder_batch, mix_batch, pair_rng
from mbsnet_speech.eval import score_model
from mbsnet_speech.losses import enhancement_loss
from mbsnet_speech.model import MBSNet, count_params
from mbsnet_speech.train import freeze_phase_head
from memfit.train.flags import Parser
from memfit.train.loop import ema_avg_fn

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "speech-tts"


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="run")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--minutes", type=float, default=4.0, help="CPU-time budget")
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--bands", type=int, default=12)
    ap.add_argument("--growth", type=float, default=4.0, help="last band width / first band width")
    ap.add_argument("--d_state", type=int, default=8)
    ap.add_argument("--hop", type=int, default=100)
    ap.add_argument("--bidir", action="store_true")
    ap.add_argument("--noisy_phase", action="store_true")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--loss", default="", help='LossWeights as JSON, e.g. {"pha": 0.0}')
    ap.add_argument("--remix", action="store_true")
    ap.add_argument("--snr", type=float, nargs=2, default=(-5.0, 15.0), help="remix SNR range (dB)")
    ap.add_argument("--expand", type=float, default=1.0)
    ap.add_argument("--energy", action="store_true", help="band log energy as an extra input feature")
    ap.add_argument("--ema", type=float, default=0.0, help="also score an EMA of the weights (decay)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    weights = LossWeights(**json.loads(a.loss)) if a.loss else LossWeights()
    pairs = find_pairs(a.data, split="train")
    perm = np.random.default_rng(0).permutation(len(pairs))
    val_idx, tr_idx = perm[:24], perm[24:]
    tr = PairFolder(pairs.root, [pairs.clean[i] for i in tr_idx], [pairs.noisy[i] for i in tr_idx])
    remix = PairRemix(tr, tuple(a.snr))
    cfg = get_config(
        "cpu",
        channels=a.channels,
        num_layers=a.layers,
        num_bands=a.bands,
        band_growth=a.growth,
        d_state=a.d_state,
        hop=a.hop,
        temporal_bidirectional=a.bidir,
        expand=a.expand,
        band_energy=a.energy,
    )
    torch.manual_seed(0)
    model = MBSNet(cfg)
    if a.noisy_phase:
        freeze_phase_head(model)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.01, betas=(0.8, 0.99))
    # the trainer's --ema: the decay warms up as min(ema, (1 + n) / (10 + n)); runs C-H in the README
    # (2026-11-22, before 16:05) used a plain EMA at the full decay from the first step
    ema = torch.optim.swa_utils.AveragedModel(model, avg_fn=ema_avg_fn(a.ema)) if a.ema else None
    crop, budget, warmup = int(a.seconds * 16000), a.minutes * 60, 50
    t0, step = time.process_time(), 0
    while (elapsed := time.process_time() - t0) < budget:
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget))
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, (step + 1) / (warmup + 1)) * cosine
        rng = pair_rng(0, step, 0)
        noisy, clean = (
            mix_batch(remix, a.batch, crop, rng)[:2] if a.remix else folder_batch(tr, a.batch, crop, rng)
        )
        loss, parts = enhancement_loss(model, (torch.from_numpy(noisy), torch.from_numpy(clean)), weights)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        if ema is not None:
            ema.update_parameters(model)
        step += 1
        if step % 200 == 0:
            print(
                step,
                f"{elapsed:.0f}s",
                f"{loss.item():.4f}",
                {k: round(float(v), 4) for k, v in parts.items()},
            )
    items = [(pairs.names[int(i)], *pairs.load(int(i))[::-1]) for i in val_idx]
    noisy = score_model(None, items)
    report(a, model, items, noisy, step, "")
    if ema is not None:
        report(a, ema.module, items, noisy, step, f" ema {a.ema:g}")


def report(a, model, items, noisy: dict, step: int, tag: str) -> None:
    """The RESULT line: the model's validation scores (eval.score_model) beside the noisy input's."""
    model.eval()
    r = score_model(model, items)
    print(
        f"RESULT {a.name}{tag} params {count_params(model) / 1e3:.1f}k steps {step} "
        f"({a.minutes:g} CPU min, 1 thread) "
        f"val24 PESQ-wb {noisy['pesq']:.3f}->{r['pesq']:.3f} ({r['pesq'] - noisy['pesq']:+.3f}) "
        f"STOI {noisy['stoi']:.3f}->{r['stoi']:.3f} ({r['stoi'] - noisy['stoi']:+.3f}) "
        f"SI-SDR {noisy['si_sdr']:.2f}->{r['si_sdr']:.2f}",
        flush=True,
    )


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("mbsnet_short_runs", lambda _argv: main()))
