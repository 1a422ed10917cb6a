"""How a model treats one clean recording across input SNRs: white noise at 0, 10, 20 and 30 dB.

    uv run python tools/mbsnet_snr_sweep.py [--run RUN_OR_EXPORT ...] [--clean FILE] [--snr 0,10,20,30]

Without --run: the model shipped in the package. Each row: PESQ-wb, STOI and SI-SDR of the noisy input and
of the model's output (1 thread, seed 0 noise). A model trained on PESQ and STOI can raise both while
lowering SI-SDR at high SNR: this shows where.
"""

from __future__ import annotations

import numpy as np
import torch
from mbsnet_speech.data import mix, read_wav
from mbsnet_speech.enhance import enhance_array, load_model, model_fn, shipped_model
from mbsnet_speech.metrics import all_metrics
from memfit.train.flags import Parser


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", nargs="*", default=None, help="runs, checkpoints or exported folders")
    ap.add_argument("--clean", default="../shared/data/speech/speech.wav")
    ap.add_argument("--snr", default="0,10,20,30", help="comma-separated SNRs in dB")
    a = ap.parse_args()
    torch.set_num_threads(1)
    clean = read_wav(a.clean)
    noise = np.random.default_rng(0).standard_normal(len(clean)).astype(np.float32)
    for run in a.run or [shipped_model()]:
        fn = model_fn(load_model(run, "cpu"))
        print(run)
        for snr in (float(s) for s in a.snr.split(",")):
            noisy = mix(clean, noise, snr)
            x, y = all_metrics(clean, noisy), all_metrics(clean, enhance_array(fn, noisy))
            print(
                f"  white {snr:>4g} dB: PESQ-wb {x['pesq_wb']:.3f} -> {y['pesq_wb']:.3f}  "
                f"STOI {x['stoi']:.3f} -> {y['stoi']:.3f}  SI-SDR {x['si_sdr']:.2f} -> {y['si_sdr']:.2f} dB"
            )


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("mbsnet_snr_sweep", lambda _argv: main()))
