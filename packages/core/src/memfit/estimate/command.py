"""`memfit estimate`: the command (its flags: ``memfit.estimate.flags``)."""

from __future__ import annotations

import contextlib
import json
import sys

from memfit.errors import UsageError, run_command
from memfit.estimate import finetune
from memfit.estimate.api import estimate, margin_or_default
from memfit.estimate.byname import load_target
from memfit.estimate.target import DeviceTarget
from memfit.estimate.trace import (
    fmt_bytes,
)


def main(args) -> int:
    """`memfit estimate`; every user mistake is one `error:` line and exit status 2."""
    return run_command("memfit estimate", lambda _: _main(args), None)


def _main(args) -> int:
    """The command, its user's code run in a child process (memfit.estimate.child): a target that exits or
    kills itself is one line naming how and when, not a silent exit 7 or 137."""
    from memfit.estimate.child import in_child

    return in_child(lambda: _estimate_command(args))


def _estimate_command(args) -> int:
    """The report printed; with --json what the target itself prints goes to stderr, so that stdout is
    exactly the JSON object."""
    try:
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            report = _report(args)
    except NothingFits as e:  # the what-ifs asked for are printed, then the one error line
        print(e.report)
        raise UsageError(str(e)) from None
    print(report)
    return 0


class NothingFits(UsageError):
    """Not even the smallest batch fits --gpu_gib, with --explain: ``report`` (the text or JSON asked for,
    the what-ifs in it) is printed on stdout before the error line."""

    def __init__(self, message: str, report: str) -> None:
        super().__init__(message)
        self.report = report


def _report(args) -> str:
    if args.measure:
        from memfit.estimate.measure import require_gpu

        require_gpu()
        if args.device == "cpu":
            raise UsageError("error: --measure compares a CUDA estimate with the GPU: drop --device cpu")
    cuda_default = args.gpu_gib is not None or args.measure
    margin = margin_or_default(args.margin, args.gpu_gib, args.explain)
    on = DeviceTarget.from_flags(
        args.device or ("cuda" if cuda_default else "cpu"), args.gpu, False if args.no_cuda_kernels else None
    )
    for flag, path in (("--timeline", args.timeline), ("--snapshot", args.snapshot)):
        if path:  # refused before the work
            from memfit.estimate.timeline import check_path

            check_path(path, flag)
    ft = finetune.parse(args.lora, args.freeze, args.optimizer, args.accumulate)
    target = load_target(args.target, args.input, args.dtype, args.loss_target, args.amp, task=args.task)
    target.device = on.device
    target = finetune.apply(target, ft)
    with on.entered():
        result = estimate(
            target,
            args.top,
            what_ifs=args.explain,
            scale=args.scale,
            gpu_gib=args.gpu_gib,
            margin=margin,
            ranks=args.ranks,
            shard=args.shard,
            fsdp_units=args.fsdp_units,
            max_batch=args.max_batch,
        )
    fit = result.fit
    if fit is not None and fit.batch == 0:
        needs = "of the card (reserved + CUDA context)" if fit.cuda else "per rank"
        line = (
            f"error: nothing fits {args.gpu_gib:g} GiB ({100 * margin:g}% margin): batch {fit.smallest} "
            f"needs {fmt_bytes(fit.peak_bytes)} {needs}; "
        )
        if args.explain:  # the what-ifs were asked for: printed, they say what would shrink it
            where = "in the JSON" if args.json else "above"
            report = result.to_json() if args.json else result.format()
            raise NothingFits(f"{line}the what-ifs {where} say what would shrink it", report)
        raise UsageError(f"{line}try --explain for what would shrink it")
    if args.timeline:
        result.timeline(args.timeline)
        print(f"memfit estimate: wrote the timeline to {args.timeline}", file=sys.stderr)
    if args.snapshot:
        result.snapshot(args.snapshot)
        where = f"memfit estimate: wrote the snapshot to {args.snapshot}"
        print(f"{where} (open it at pytorch.org/memory_viz)", file=sys.stderr)
    if args.measure:
        from memfit.estimate.measure import estimate_measure, format_rows, measured_snapshot_path

        real = measured_snapshot_path(args.snapshot) if args.snapshot else None
        row = estimate_measure(target.step(), target.label, False if args.no_cuda_kernels else None, real)
        if real is not None and "skipped" not in row:
            print(f"memfit estimate: wrote the measured step's snapshot to {real}", file=sys.stderr)
        if args.json:
            return json.dumps({**result.to_dict(), "measure": row}, indent=2)
        return result.format() + "\n\n" + format_rows([row])
    return result.to_json() if args.json else result.format()
