"""memfit: a training step's memory estimated without a GPU, and the systems' train and eval.

`memfit estimate / budget / fit / export / plot / systems / run / doctor`, `memfit train SYSTEM` and
`memfit eval SYSTEM`. The bare `train` / `eval` scripts (`uv run --package SYSTEM train`) are
memfit.bare's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit import __version__
from memfit.errors import UsageError, run_command
from memfit.system import available_systems, load_system
from memfit.train.flags import Parser, check_numbers

if TYPE_CHECKING:
    from memfit.system import BudgetEntry

# The commands whose parser needs the estimator (torch and more: seconds to import). Their parsers are
# built only when one of them is asked for; `memfit --help`, `systems` and `train S --help` never load
# torch (tests/test_cli_speed.py).
HEAVY = {
    "budget": "estimated training-step peak of every system vs its budget",
    "fit": "largest batch (and whether checkpointing is needed) that fits a GPU",
    "estimate": "training-step memory of any model: peak, culprits, what-ifs, largest batch",
}

# ----------------------------------------------------------------------------------------------------
# memfit budget
# ----------------------------------------------------------------------------------------------------


def budget_rows(system: str | None = None, device: str = "cpu", ran: dict | None = None) -> list[dict]:
    """Estimate every registered (system, variant) paper-size step; one dict per row (`budget --json`).
    device="cuda": what a CUDA run allocates (memfit.estimate.rules, workspaces): ``estimated_gib`` is the
    allocator peak, and the rows add the reserved peak and the card total (memfit.estimate.cuda_memory).
    ``ran``: a dict the op implementations the estimates chose are added to ({(op, impl): calls})."""
    from tqdm import tqdm

    from memfit.estimate.steps import estimate_training_step

    names = sorted(available_systems()) if system is None else [system]
    entries: list[tuple[str, BudgetEntry]] = [(n, e) for n in names for e in load_system(n).budgets()]
    rows = []
    with tqdm(entries, desc="budget", unit="step", leave=False, disable=None) as bar:  # a terminal only
        for name, e in bar:
            bar.set_postfix_str(f"{name} {e.variant}")
            report = estimate_training_step(e.step, device=device)
            if ran is not None:
                for k, n in report.ran.items():
                    ran[k] = ran.get(k, 0) + n
            row = e.row(name, report, digits=4)
            if report.cuda is not None:
                row["reserved_gib"] = round(report.cuda.reserved / 2**30, 4)
                row["total_gib"] = round(report.cuda.total / 2**30, 4)
            rows.append(row)
    return rows


def compare_budgets(
    systems: list[str] | None = None, steps: int = 3, cuda_kernels: bool = True
) -> list[dict]:
    """`memfit budget --measure` as a function (what a benchmark script calls): every budget row of
    ``systems`` (None: all installed) estimated for this machine's GPU and measured on it, one dict per row
    (memfit.estimate.measure.compare_budgets). ``cuda_kernels=False``: the estimate assumes no cuda extra
    (as --no_cuda_kernels). Raises memfit.errors.UsageError without a GPU."""
    from memfit.estimate.measure import compare_budgets as compare
    from memfit.estimate.measure import require_gpu

    require_gpu()
    names = sorted(available_systems()) if systems is None else list(systems)
    budgets = {name: load_system(name).budgets() for name in names}
    return compare(budgets, steps, None if cuda_kernels else False)


def format_budget_table(rows: list[dict]) -> str:
    cuda = any("total_gib" in r for r in rows)
    figures = f"{'allocated':>9} {'reserved':>9} {'total GiB':>9}" if cuda else f"{'estimate GiB':>12}"
    header = (
        f"{'system':<20} {'variant':<18} {'batch':>5} {'dtype':<5} {'params':>8} "
        f"{figures} {'budget GiB':>10}  status"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        budget = "-" if r["budget_gib"] is None else f"{r['budget_gib']:.2f}"
        if r["is_baseline"]:
            status = "naive baseline"
        else:
            status = "fits" if r["fits"] else "OVER BUDGET"
        if cuda:
            shown = f"{r['estimated_gib']:>9.3f} {r['reserved_gib']:>9.3f} {r['total_gib']:>9.3f}"
        else:
            shown = f"{r['estimated_gib']:>12.3f}"
        lines.append(
            f"{r['system']:<20} {r['variant']:<18} {r['batch']:>5} {r['dtype']:<5} "
            f"{r['params'] / 1e6:>7.2f}M {shown} {budget:>10}  {status}"
        )
    if not rows:
        lines.append("(no systems registered: install a model package, e.g. `uv sync --all-packages`)")
    return "\n".join(lines)


def _budget(args: argparse.Namespace) -> int:
    from memfit.estimate.target import DeviceTarget

    if args.system is not None and args.system not in available_systems():
        choices = ", ".join(sorted(available_systems())) or "none installed"
        raise UsageError(f"error: unknown system {args.system!r}; installed systems: {choices}")
    on = DeviceTarget.from_flags(args.device, args.gpu, False if args.no_cuda_kernels else None)
    if args.measure:
        from memfit.estimate.measure import format_rows, require_gpu

        require_gpu()
        names = None if args.system is None else [args.system]
        rows = compare_budgets(names, cuda_kernels=not args.no_cuda_kernels)
        print(json.dumps(rows, indent=2) if args.json else format_rows(rows))
        return 0
    ran: dict = {}
    with on.entered():
        rows = budget_rows(args.system, args.device, ran)
        described = on.kernels_used(ran)
        which = on.card_used()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        kernels = "the CPU's kernels"
        if args.device == "cuda":
            kernels = f"CUDA{' kernels ' + described if described else ''} on {which.describe()}"
            kernels += "; allocator peak, reserved peak, card total = reserved + CUDA context"
        print(f"Estimated peak of one paper-size training step (fake tensors, {kernels}; --json for details)")
        print(format_budget_table(rows))
    return 0 if all(r["fits"] is not False for r in rows) else 1


def _fit(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from memfit.estimate.fit import MAX_GPU_GIB, fit_system, format_fit, nothing_fits
    from memfit.estimate.target import DeviceTarget
    from memfit.ops import registry

    if args.system not in available_systems():
        choices = ", ".join(sorted(available_systems())) or "none installed"
        if ":" in args.system or args.system.endswith(".py"):  # a model of the user's own, as estimate takes
            raise UsageError(
                f"error: memfit fit sizes an installed system ({choices}); for {args.system} run "
                f"`memfit estimate {args.system} --gpu_gib {args.gpu_gib:g}`"
            )
        raise UsageError(f"error: unknown system {args.system!r}; installed systems: {choices}")
    check_numbers(args, gpu_gib=f"(0, {MAX_GPU_GIB}]", max_batch="[1, 2**31-1]")
    budgets = load_system(args.system).budgets()
    fittable = [e.variant for e in budgets if not e.is_baseline and e.make_step is not None]
    for variant in args.variant or ():  # a typo would give an empty table
        if variant not in fittable:
            known = variant in {e.variant for e in budgets}
            what = (
                f"variant {variant!r} has no batch to fit (a fixed or baseline step)"
                if known
                else f"unknown variant {variant!r}"
            )
            raise UsageError(f"error: {what}; {args.system} has {', '.join(fittable)}")
    on = DeviceTarget.from_flags("cuda", args.gpu, False if args.no_cuda_kernels else None)
    before = registry.traced()
    with on.entered():
        results = fit_system(budgets, args.gpu_gib, args.max_batch, args.variant)
        ran = {k for k, n in registry.traced().items() if n > before.get(k, 0)}
        kernels = on.kernels_used(ran) or "PyTorch's own kernels"
        described = f"{kernels}, {on.card_used().describe()}"
    if (message := nothing_fits(args.system, args.gpu_gib, results)) is not None:
        raise UsageError(message)  # "memfit: error: ...", as every other refusal of the command
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(format_fit(args.system, args.gpu_gib, results, described))
    return 0


def _systems(args: argparse.Namespace) -> int:
    for name in sorted(available_systems()):
        extra = sorted(load_system(name).extra_commands)
        print(name + (f"  (extra commands: {', '.join(extra)})" if extra else ""))
    return 0


def _run_extra(args: argparse.Namespace) -> int:
    system = load_system(args.system)
    if args.cmd not in ("train", "eval", *system.extra_commands):
        choices = ", ".join(sorted(system.extra_commands)) or "none"
        raise UsageError(f"error: {args.system} has no command {args.cmd!r}; its extra commands: {choices}")
    sys.argv[0] = f"{args.system} {args.cmd}"
    return run_command(sys.argv[0], system.entry(args.cmd), args.args)


def _run_system(run: str, system: str | None, runs_dir: str) -> tuple[str, Path]:
    """(system name, run path) for `memfit export`: the system from --system, the run's config.json or
    checkpoint, or the only system with a run of that name under runs_dir."""
    path = Path(run)
    installed = ", ".join(sorted(available_systems())) or "none installed"
    if system is not None and system not in available_systems():
        raise UsageError(f"error: unknown system {system!r}; installed systems: {installed}")
    if system is None and not path.exists():
        found = [p.parent.name for p in Path(runs_dir).glob(f"*/{run}") if p.is_dir()]
        if len(found) != 1:
            where = f"several systems have a run {run!r}" if found else f"no run {run!r} in {runs_dir}/*/"
            raise UsageError(f"error: {where}; pass --system SYSTEM, or a run folder")
        system, path = found[0], Path(runs_dir) / found[0] / run
    if system is None:
        from memfit.train.checkpoint import checkpoint_candidates, load_checkpoint
        from memfit.train.settings import CONFIG_NAME

        if (path / CONFIG_NAME).is_file():
            try:
                doc = json.loads((path / CONFIG_NAME).read_text())
            except (OSError, ValueError, RecursionError):  # damaged: say so below, no traceback
                doc = None
            system = doc.get("system") if isinstance(doc, dict) else None
        else:
            files = checkpoint_candidates(path) if path.is_dir() else [path]
            try:
                system = load_checkpoint(files[0]).get("system") if files else None
            except ValueError as e:
                raise UsageError(f"error: {e}") from None
    if isinstance(system, str) and system not in available_systems():  # a run of a system not installed
        raise UsageError(f"error: {run} is a {system} run, which is not installed; installed: {installed}")
    if system not in available_systems():
        raise UsageError(f"error: cannot tell the system of {run}; pass --system SYSTEM")
    return system, path


def _export(args: argparse.Namespace) -> int:
    from memfit.train.export import export_run

    name, path = _run_system(args.run, args.system, args.runs_dir)
    out = export_run(load_system(name), path, args.out, args.runs_dir, args.overwrite)
    print(f"exported {path} to {out}/ (model.safetensors, config.json, README.md)")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from memfit.train.plot import plot_run

    out = plot_run(Path(args.run), Path(args.out) if args.out else None, args.overwrite)
    print(f"wrote {out}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from memfit.ops import doctor

    return doctor.run(require_cuda=args.require_cuda, require_kernels=args.require_kernels)


def main(argv: list[str] | None = None) -> None:
    """The `memfit` command: SystemExit with status 0, or 2 with one line for bad input."""
    raise SystemExit(run_command("memfit", _main, argv))


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"memfit {__version__} (torch {torch_version})"


def _add_parser(sub, name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose --help opens with what it does (its line in `memfit --help`)."""
    kwargs.setdefault("description", help[:1].upper() + help[1:] + ("" if help.endswith(".") else "."))
    return sub.add_parser(name, help=help, **kwargs)


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = Parser(prog="memfit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_versions())
    sub = parser.add_subparsers(dest="command", required=True)
    if argv and argv[0] in HEAVY:
        _heavy_parsers(sub)
    else:  # named in --help and the list of choices; parsed only by the real ones above
        for name, text in HEAVY.items():
            _add_parser(sub, name, help=text)
    p = _add_parser(
        sub, "run", help="a system's extra command, e.g. `memfit run mbsnet-speech enhance IN --out DIR`"
    )
    p.add_argument("system")
    p.add_argument("cmd", metavar="command")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run_extra)
    p = _add_parser(sub, "systems", help="list installed systems and their extra commands")
    p.set_defaults(func=_systems)
    for kind in ("train", "eval"):
        p = _add_parser(sub, kind, help=f"a system's {kind}: `memfit {kind} SYSTEM [flags]` (`--help` after "
                           "the system lists its flags)", add_help=False)  # fmt: skip
        p.add_argument("system")
        p.add_argument("args", nargs=argparse.REMAINDER)
        p.set_defaults(func=_run_extra, cmd=kind)
    p = _add_parser(sub, "export", help="a trained run as model.safetensors + config.json + a model card")
    p.add_argument("run", help="a run folder, a checkpoint file, a run name (with --system or unique), or an "
                   "exported folder (copied, with what it says of its run)")  # fmt: skip
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--system", help="the run's system (default: read from the run)")
    p.add_argument("--runs_dir", default="runs", help="where run names are looked up (default %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out")
    p.set_defaults(func=_export)
    p = _add_parser(sub, "plot", help="a run's loss and validation curves as a PNG (from its metrics.jsonl)")
    p.add_argument("run", help="a run folder")
    p.add_argument("--out", default=None, help="the PNG to write (default: <run>/curves.png)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=_plot)
    p = _add_parser(
        sub, "doctor", help="what each path (scan, conv, attention) uses on this machine, and why"
    )
    p.add_argument(
        "--require_cuda", "--require-cuda", action="store_true",
        help="exit 2 unless CUDA works and every CUDA implementation installed passes its probe "
             "(--require-cuda: the older spelling, still accepted)",
    )  # fmt: skip
    p.add_argument(
        "--require_kernels", "--require-kernels", action="store_true",
        help="as --require_cuda, and every kernel of the cuda extra must be installed and pass its probe "
             "(--require-kernels: the older spelling, still accepted)",
    )  # fmt: skip
    p.set_defaults(func=_doctor)
    args = parser.parse_args(argv)
    return args.func(args)


def _heavy_parsers(sub: argparse._SubParsersAction) -> None:
    """`memfit budget / fit / estimate`: their flags' help comes from the estimator."""
    from memfit.estimate import GPU_HELP, MAX_BATCH_HELP, MEASURE_HELP, NO_CUDA_KERNELS_HELP
    from memfit.estimate import add_parser as estimate_parser

    p = _add_parser(sub, "budget", help=HEAVY["budget"])
    p.add_argument("--system", help="only this system")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="whose kernels to estimate with (default cpu: what the calibration runs measure)",
    )
    p.add_argument("--no_cuda_kernels", action="store_true", help=NO_CUDA_KERNELS_HELP)
    p.add_argument("--gpu", help=GPU_HELP)
    p.add_argument("--measure", action="store_true", help=MEASURE_HELP)
    p.set_defaults(func=_budget)
    p = _add_parser(
        sub,
        "fit",
        help=HEAVY["fit"],
        description="The largest batch of an installed system's training step (each variant, with and "
        "without checkpointing) that fits a GPU, estimated without one. For a model of your own: "
        "`memfit estimate TARGET --gpu_gib N`.",
    )
    p.add_argument("--system", required=True, help="the installed system to fit (memfit systems lists them)")
    p.add_argument("--gpu_gib", type=float, required=True, help="GPU memory to fit, GiB")
    p.add_argument("--variant", action="append", help="only these variants (repeatable)")
    p.add_argument("--max_batch", type=int, default=4096, help=MAX_BATCH_HELP)
    p.add_argument(
        "--no_cuda_kernels",
        action="store_true",
        help=NO_CUDA_KERNELS_HELP.removeprefix("with --device cuda: "),
    )
    p.add_argument("--gpu", help=GPU_HELP)
    p.add_argument("--json", action="store_true", help="the rows as a JSON list")
    p.set_defaults(func=_fit)
    estimate_parser(sub)


if __name__ == "__main__":
    main()
