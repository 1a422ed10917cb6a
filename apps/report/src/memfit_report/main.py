"""`memfit-report`: every system's budget (ours vs naive baseline), calibration, scaling and benchmarks.

Writes ``reports/latest/``: ``report.md`` (the table), ``report.json`` (every figure),
``memory_by_category.png`` (ours vs baseline per system) and ``scaling.png`` (activations vs tokens, log-log,
with fitted exponents), plus the benchmarks' JSON when they are run.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

from memfit.errors import UsageError, console
from memfit.estimate.steps import estimate_training_step, measure_training_step
from memfit.estimate.tracker import GIB
from memfit.system import available_systems, load_system
from memfit.train.flags import Parser
from memfit.train.outputs import output_dir, write_file, write_text

DEFAULT_OUT = "reports/latest"
CATEGORY_COLORS = {"params": "#4C72B0", "grads": "#55A868", "optimizer": "#C44E52", "activations": "#8172B2"}


def fit_exponent(xs: list[float], ys: list[float]) -> float:
    """Slope of log(y) against log(x), least squares."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def collect(systems: list[str], calibrate: bool = True, scaling: bool = True, log=print) -> dict:
    """Estimate every budget entry, its calibration (estimate vs measured) and its scaling."""
    rows, scalings = [], []
    for name in systems:
        for e in load_system(name).budgets():
            t0 = time.perf_counter()
            est = estimate_training_step(e.step)
            row = e.row(name, est)
            if calibrate and e.calibration is not None:
                small_est = estimate_training_step(e.calibration)
                small_real = measure_training_step(e.calibration)
                row["calibration"] = {
                    "estimated_mib": small_est.peak_mib,
                    "measured_mib": small_real.peak_mib,
                    "drift": small_est.peak_bytes / small_real.peak_bytes - 1,
                }
            if scaling and e.scaling is not None:
                reports = [estimate_training_step(e.scaling.make_step(n)) for n in e.scaling.sizes]
                # fit the activations: parameters and optimizer state do not grow with tokens
                acts = [r.by_category["activations"] / GIB for r in reports]
                scalings.append(
                    {
                        "system": name,
                        "variant": e.variant,
                        "is_baseline": e.is_baseline,
                        "label": e.scaling.label,
                        "sizes": e.scaling.sizes,
                        "peak_gib": [r.peak_gib for r in reports],
                        "activations_gib": acts,
                        "exponent": fit_exponent(e.scaling.sizes, acts),
                    }
                )
            rows.append(row)
            log(f"  {name}/{e.variant}: {est.peak_gib:.3f} GiB ({time.perf_counter() - t0:.1f} s)")
    # ours-vs-baseline ratios within each system
    for r in rows:
        base = [b for b in rows if b["system"] == r["system"] and b["is_baseline"]]
        if base and not r["is_baseline"]:
            r["baseline_gib"] = max(b["estimated_gib"] for b in base)
            r["baseline_ratio"] = r["baseline_gib"] / r["estimated_gib"]
    return {"rows": rows, "scaling": scalings}


def markdown_table(rows: list[dict]) -> str:
    out = [
        "| system | variant | config | batch | dtype | estimated peak GiB | budget GiB | baseline GiB | "
        "baseline / ours | small-size estimate vs measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cal = r.get("calibration")
        cal_s = (
            f"{cal['estimated_mib']:.1f} / {cal['measured_mib']:.1f} MiB ({cal['drift']:+.1%})"
            if cal
            else "-"
        )
        budget = "baseline" if r["is_baseline"] else f"{r['budget_gib']:.2f}"
        base = f"{r['baseline_gib']:.2f}" if "baseline_gib" in r else "-"
        ratio = f"{r['baseline_ratio']:.1f}×" if "baseline_ratio" in r else "-"
        out.append(
            f"| {r['system']} | {r['variant']} | {r['config']} | {r['batch']} | {r['dtype']} | "
            f"{r['estimated_gib']:.2f} | {budget} | {base} | {ratio} | {cal_s} |"
        )
    return "\n".join(out)


def _panels(records: list[dict], height: float):
    """One subplot per system (sorted): returns (figure, [(axis, system), ...])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = sorted({r["system"] for r in records})
    n = max(1, len(systems))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, height), squeeze=False)
    return fig, list(zip(axes[0], systems))


def _save(fig, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    try:
        write_file(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), overwrite=True)
    finally:
        plt.close(fig)


def plot_categories(rows: list[dict], path: Path) -> None:
    fig, panels = _panels(rows, 4.2)
    for ax, name in panels:
        mine = [r for r in rows if r["system"] == name]
        labels = [r["variant"] + ("\n(baseline)" if r["is_baseline"] else "") for r in mine]
        bottom = [0.0] * len(mine)
        for cat, color in CATEGORY_COLORS.items():
            vals = [r["by_category"][cat] for r in mine]
            ax.bar(labels, vals, bottom=bottom, color=color, label=cat)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, r in enumerate(mine):
            if r["budget_gib"]:
                ax.plot([i - 0.4, i + 0.4], [r["budget_gib"]] * 2, "k--", lw=1)
        ax.set_title(name)
        ax.set_ylabel("estimated peak, GiB")
        ax.tick_params(axis="x", labelsize=8)
    panels[0][0].legend(fontsize=8)
    _save(fig, "Training-step peak by category (dashed: budget)", path)


def plot_scaling(scalings: list[dict], path: Path) -> None:
    fig, panels = _panels(scalings, 4.0)
    for ax, name in panels:
        for s in (s for s in scalings if s["system"] == name):
            style = "--o" if s["is_baseline"] else "-o"
            ax.loglog(
                s["sizes"], s["activations_gib"], style, label=f"{s['variant']} (slope {s['exponent']:.2f})"
            )
            ax.set_xlabel(s["label"])
        ax.set_title(name)
        ax.set_ylabel("activations at the peak, GiB")
        ax.legend(fontsize=8)
    _save(fig, "Activation memory vs tokens (log-log, fitted exponents)", path)


# The core benchmarks (--quick --json PATH). tools/bench_gpt2.py is left out: its `memory` rows are the
# budget table's, and its `quality` run takes a quarter of an hour.
BENCHMARKS = ("bench_attention.py", "bench_scan.py")


def run_benchmarks(tools_dir: Path, out_dir: Path, log=print) -> dict:
    """Run the core benchmarks with --quick --json; returns {name: parsed JSON or error}."""
    results = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for script in (tools_dir / name for name in BENCHMARKS if (tools_dir / name).exists()):
        out = out_dir / f"{script.stem}.json"
        log(f"  {script.name} --quick")
        res = subprocess.run(
            [sys.executable, str(script), "--quick", "--json", str(out)], capture_output=True, text=True
        )
        if res.returncode == 0 and out.exists():
            results[script.stem] = json.loads(out.read_text())
        else:
            results[script.stem] = {"error": res.stderr[-2000:]}
    return results


def write_report(out_dir: Path, data: dict) -> None:
    """report.json, report.md and the plots in out_dir, each through memfit's one output path (whole or
    not at all; out_dir's files are replaced: output_dir decided that they may be)."""
    write_text(out_dir / "report.json", json.dumps(data, indent=2), overwrite=True)
    md = ["# memfit report", "", "Regenerate: `uv run memfit-report` (writes this folder).", ""]
    md += [markdown_table(data["rows"]), ""]
    if data["scaling"]:
        md += ["## Scaling (estimated activations at the peak vs tokens, fitted log-log exponent)", ""]
        md += [
            "| system | variant | tokens | sizes | peak GiB | activations GiB | exponent |",
            "|---|---|---|---|---|---|---|",
        ]
        for s in data["scaling"]:
            peaks = ", ".join(f"{p:.2f}" for p in s["peak_gib"])
            acts = ", ".join(f"{p:.2f}" for p in s["activations_gib"])
            cells = [
                s["system"],
                s["variant"],
                s["label"],
                str(s["sizes"]),
                peaks,
                acts,
                f"{s['exponent']:.2f}",
            ]
            md.append("| " + " | ".join(cells) + " |")
        md.append("")
    for name, res in data.get("benchmarks", {}).items():
        md += [f"## {name} (`--quick`)", "", "```", json.dumps(res, indent=1)[:4000], "```", ""]
    md += ["![memory by category](memory_by_category.png)", "", "![scaling](scaling.png)", ""]
    write_text(out_dir / "report.md", "\n".join(md), overwrite=True)
    if data["rows"]:
        plot_categories(data["rows"], out_dir / "memory_by_category.png")
    if data["scaling"]:
        plot_scaling(data["scaling"], out_dir / "scaling.png")


def main(argv: list[str] | None = None) -> int:
    """The report; 0, or 1 when a system is over its budget (bad input: UsageError, exit 2)."""
    p = Parser(prog="memfit-report", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT}, replaced each time)")
    p.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out")
    p.add_argument("--system", action="append", help="only these systems (repeatable)")
    p.add_argument("--no_bench", action="store_true", help="skip tools/bench_*.py")
    p.add_argument("--no_calibration", action="store_true", help="skip the small real runs")
    p.add_argument("--tools", default="tools", help="folder of bench_*.py (default %(default)s)")
    args = p.parse_args(argv)
    installed = sorted(available_systems())
    systems = args.system or installed
    unknown = [s for s in systems if s not in installed]
    if unknown:
        raise UsageError(f"error: unknown system(s) {unknown}; installed: {', '.join(installed)}")
    # before minutes of work: an unwritable location, or a non-empty --out without --overwrite, fails now
    out_dir = output_dir(args.out or DEFAULT_OUT, overwrite=args.overwrite, own=args.out is None)
    print(f"estimating {len(systems)} system(s)")
    data = collect(systems, calibrate=not args.no_calibration)
    if not args.no_bench and Path(args.tools).is_dir():
        print("benchmarks")
        data["benchmarks"] = run_benchmarks(Path(args.tools), out_dir)
    write_report(out_dir, data)
    print(markdown_table(data["rows"]))
    print(f"wrote {out_dir}/report.md, report.json and plots")
    over = [r for r in data["rows"] if r["fits"] is False]
    if over:
        print(f"over budget: {[(r['system'], r['variant']) for r in over]}", file=sys.stderr)
        return 1
    return 0


cli = console(main, "memfit-report")  # the console script: one line and exit 2 for bad input

if __name__ == "__main__":
    raise SystemExit(cli())
