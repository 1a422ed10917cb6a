"""`memfit estimate` against PyTorch's MemTracker (fake tensors) and a real CPU run, with the time of each.

    uv run python tools/compare_estimators.py            # resnet18, batch 8, 224x224, fp32, AdamW
    uv run python tools/compare_estimators.py --model resnet50 --input 2x3x224x224

Also prints the figures accelerate's and DeepSpeed's rules give from the parameter count alone (Adam
training = 4 x the fp32 model; 16 bytes per parameter for fp16 mixed precision without ZeRO): neither tool
is installed here, and neither sees activations. Numbers of docs/your-own-model.md.
"""

from __future__ import annotations

import time

import torch
import torchvision
from memfit.estimate import make_target
from memfit.estimate.steps import estimate_training_step, measure_training_step, memtracker_peak
from memfit.estimate.tracker import MIB
from memfit.train.flags import Parser


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18", help="a torchvision.models factory")
    p.add_argument("--input", default="8x3x224x224")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    step = make_target(getattr(torchvision.models, args.model), args.model, [args.input]).step()
    est, t_est = timed(lambda: estimate_training_step(step))
    theirs, t_mt = timed(lambda: memtracker_peak(step))
    real, t_real = timed(lambda: measure_training_step(step))
    n = est.params
    print(f"{args.model} --input {args.input}, fp32, fused AdamW, {args.threads} thread(s), {n} parameters")
    print(f"memfit estimate            {est.peak_bytes / MIB:9.1f} MiB  {t_est:6.2f} s")
    print(
        f"MemTracker (fake tensors)  {theirs / MIB:9.1f} MiB  {t_mt:6.2f} s  "
        f"memfit/this {est.peak_bytes / theirs:.4f}"
    )
    print(
        f"real CPU run               {real.peak_bytes / MIB:9.1f} MiB  {t_real:6.2f} s  "
        f"memfit/this {est.peak_bytes / real.peak_bytes:.4f}"
    )
    print(f"accelerate's rule          {4 * 4 * n / MIB:9.1f} MiB  (4 x the fp32 model)")
    print(f"DeepSpeed's rule           {16 * n / MIB:9.1f} MiB  (16 B per parameter)")


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("compare_estimators", lambda _argv: main()))
