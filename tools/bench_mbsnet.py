"""MBS-Net training-step time on CPU at the default (paper-size) config: 2.62M parameters, batch 6, 2 s.

    uv run python tools/bench_mbsnet.py --threads 2          # median s per step, as mbsnet-train runs it
    uv run python tools/bench_mbsnet.py --checkpointing      # with layer recompute (the GPU setting)
    uv run python tools/bench_mbsnet.py --amp none           # fp32 (the scan and conv are fp32 either way)
    MEMFIT_KEEP_FREED=0 uv run python tools/bench_mbsnet.py  # malloc's defaults (memfit.train.cpu)
    uv run python tools/bench_mbsnet.py --threads 1 --batch 2 --steps 1 --profile   # where the time goes
    uv run python tools/bench_mbsnet.py --recipe --threads 1 --steps 30   # the generalising recipe's step

A step is what ``mbsnet-train --config default`` runs on a CPU: the paper recipe's bf16 autocast (Linear
layers in bf16, the fused conv and scan in fp32), no layer recompute (the recipe's CPU choice; the config
recomputes on a GPU), MP-SENet losses, backward and AdamW, on random (noisy, clean) audio, with malloc
reusing freed blocks as the trainer sets it (``memfit.train.cpu.keep_freed_memory``). ``--quick`` runs the
tiny
CPU-recipe model instead (seconds). ``--recipe`` runs the generalising recipe's step (``--config
general``: the CPU preset's model and loss at hop 200, the PESQ, STOI and -SI-SDR terms at 0.6, 10 and
0.01, batch 4 x 1 s, fp32).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time

import torch
from mbsnet_speech.config import SETTINGS, default_config, tiny_config
from mbsnet_speech.system import train_step
from memfit.errors import UsageError
from memfit.train.cpu import keep_freed_memory, minor_page_faults
from memfit.train.flags import Parser


def main(argv=None) -> None:
    cpu = torch.device("cpu")
    paper, recipe = SETTINGS["default"](cpu), SETTINGS["cpu"](cpu)  # what mbsnet-train runs on a CPU
    general = SETTINGS["general"](cpu)  # the generalising recipe (--config general)
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice, all cores; on 2 cores 2 threads measured "
                        "faster than 1: 8.3 s vs 14.3 s per step, 2026-11-22)")  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="timed steps after two warm-up ones (median)")
    p.add_argument("--batch", type=int, default=None, help="default 6 (--recipe: the preset's 4)")
    p.add_argument("--seconds", type=float, default=None, help="crop length; default 2 (--recipe: 1)")
    p.add_argument("--amp", choices=["none", "bf16"], default=None,
                   help=f"autocast dtype (default: the recipe's: {paper.loop.amp}, with --quick or --recipe "
                        f"{recipe.loop.amp})")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="the tiny CPU-recipe model")
    p.add_argument("--recipe", action="store_true", help="--config general's model, loss and crops")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction,
                   default=paper.model.checkpoint,
                   help="recompute each encoder layer in backward (default: off, as mbsnet-train on a CPU; "
                        "on is the config's GPU setting: less memory, more compute; the --quick model has "
                        "none either way)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="print the top ops of one more step")
    args = p.parse_args(argv)
    if args.quick and args.recipe:
        raise UsageError("error: --quick and --recipe are two different models; give one")
    if args.batch is None:
        args.batch = general.train.batch_size if args.recipe else 6
    if args.seconds is None:
        args.seconds = general.train.seconds if args.recipe else 2.0
    if (
        (args.threads is not None and args.threads < 1)
        or args.steps < 1
        or args.batch < 1
        or args.seconds <= 0
    ):
        raise UsageError("error: --threads, --steps and --batch must be >= 1 and --seconds > 0")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    malloc = "reusing freed blocks" if keep_freed_memory() else "malloc defaults"
    weights = None
    if args.recipe:  # the README's generalising command (--config general)
        cfg, weights = general.model, general.train.loss
    else:
        cfg = tiny_config() if args.quick else default_config()
    cfg = dataclasses.replace(cfg, checkpoint=args.checkpointing and cfg.checkpoint)
    if args.amp is None:
        args.amp = general.loop.amp if args.recipe else recipe.loop.amp if args.quick else paper.loop.amp
    amp = torch.bfloat16 if args.amp == "bf16" else None
    step = train_step(cfg, args.batch, int(args.seconds * cfg.sample_rate), amp=amp, weights=weights)
    torch.manual_seed(0)
    model = step.build_model()
    opt = step.optimizer(model.parameters())
    batch = step.make_batch(torch.device("cpu"))
    n_params = sum(p.numel() for p in model.parameters())

    faults = []

    def one() -> float:
        f0 = minor_page_faults()
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            loss = step.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = time.perf_counter() - t
        faults.append(minor_page_faults() - f0)
        return t

    name = "tiny" if args.quick else "generalising recipe's" if args.recipe else "default"
    print(f"MBS-Net {name} config, {n_params / 1e6:.2f}M params, batch {args.batch}, "
          f"{args.seconds:g} s crops, {args.amp}, recompute {'on' if cfg.checkpoint else 'off'}, "
          f"{torch.get_num_threads()} thread(s), {malloc}")  # fmt: skip
    # two warm-up steps: malloc's heap grows to the step's working set over the first two or three (the
    # page faults printed per step)
    warm = [one() for _ in range(2)]
    times = [one() for _ in range(args.steps)]
    shown = ", ".join(f"{t:.2f}" for t in times)
    goal = "" if args.quick or args.recipe else " (goal <= 10 s on 2 cores)"
    print(f"  warm-up {', '.join(f'{t:.2f}' for t in warm)} s; steps {shown} s; "
          f"median {statistics.median(times):.3f} s/step{goal}; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB")  # fmt: skip
    print(f"  minor page faults per step (warm-up first): {', '.join(f'{f:,}' for f in faults)}")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            one()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("bench_mbsnet", lambda argv: main(argv)))
