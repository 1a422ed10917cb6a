"""Where a trained MBS-Net loses PESQ: oracle substitutions on TRAIN-split files (never a test split).

    uv run python tools/mbsnet_diagnose.py RUN [--data ROOT] [--files 14]

For every 3rd of the first 3*files train pairs of ROOT it prints PESQ-wb of: the noisy input, the model,
the model's magnitude with the noisy phase, with the clean phase, the oracle mask (clean / noisy
magnitude, capped at 1, noisy phase), the model's mask with the oracle's inside one octave band
(0-1, 1-2, 2-4, 4-8 kHz), and clean speech plus white noise 30 dB below it (how hard PESQ-wb punishes a
quiet residual on this speech). One thread; PCS off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from mbsnet_speech.data import find_pairs, mix
from mbsnet_speech.metrics import pesq_score
from mbsnet_speech.system import SYSTEM
from memfit.train.flags import Parser

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "speech-tts"
OCTAVES = ((0, 1000), (1000, 2000), (2000, 4000), (4000, 8001))


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--files", type=int, default=14)
    a = ap.parse_args()
    torch.set_num_threads(1)
    pairs = find_pairs(a.data, split="train")
    model, state = SYSTEM.load_model(a.run, "cpu", pcs=False)
    c = model.cfg
    hz = torch.arange(c.n_bins) * c.sample_rate / c.n_fft
    cols = ["noisy", "model", "noisy phase", "clean phase", "oracle mask"]
    cols += [f"oracle {lo / 1000:g}-{round(hi / 1000)}k" for lo, hi in OCTAVES] + ["clean+white 30dB"]
    rows, rng = [], np.random.default_rng(0)
    with torch.no_grad():
        for i in range(0, min(3 * a.files, len(pairs)), 3):
            clean, noisy = pairs.load(i)
            x = torch.from_numpy(noisy.astype(np.float32))[None]
            s = torch.from_numpy(clean.astype(np.float32))[None]
            mag, pha = model.stft(x)
            cmag, cpha = model.stft(s)
            mask, dpha = model.spec_forward(mag, pha)
            oracle = (cmag / mag.clamp_min(1e-8)).clamp(max=1)

            def wav(m, p, mag=mag, n=x.shape[1]):
                return model.istft(m * mag, p, n)[0].numpy()

            outs = [noisy, wav(mask, pha + dpha), wav(mask, pha), wav(mask, cpha), wav(oracle, pha)]
            for lo, hi in OCTAVES:
                band = ((hz >= lo) & (hz < hi))[:, None]
                outs.append(wav(torch.where(band, oracle, mask), pha))
            outs.append(mix(clean, rng.standard_normal(len(clean)), 30.0))
            rows.append([pesq_score(clean, o) for o in outs])
            print(pairs.names[i], " ".join(f"{v:.2f}" for v in rows[-1]), flush=True)
    print(f"{state['path']} (step {state['step']}), {len(rows)} train-split files, 1 thread, PESQ-wb means:")
    for name, v in zip(cols, np.mean(rows, axis=0)):
        print(f"  {name:18s} {v:.2f}")


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("mbsnet_diagnose", lambda _argv: main()))
