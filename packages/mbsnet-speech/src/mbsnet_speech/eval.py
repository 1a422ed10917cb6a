"""Evaluate MBS-Net: PESQ (wb, nb), STOI and SI-SDR of noisy vs enhanced, a table, a CSV and a spectrogram.

`uv run mbsnet-eval [--run RUN] [--data ROOT]`: pairs from a clean_*/noisy_* folder (the test split
when there is one) or, by default, generated held-out pairs that no training batch contains.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
from memfit.distributed import resolve_device
from memfit.errors import UsageError
from memfit.flags import Parser, add_eval_args, apply_threads, check_numbers, eval_out_dir
from memfit.run_dir import resolve_run

from mbsnet_speech.classical import wiener_enhance
from mbsnet_speech.data import MIX_NOISE_KINDS, SAMPLE_RATE, find_pairs, heldout_pairs
from mbsnet_speech.enhance import add_pcs_arg, enhance_array, model_fn
from mbsnet_speech.metrics import PairResult, evaluate_pairs, pesq_score, si_sdr, stoi_score, summarise

METRICS = ("pesq_wb", "pesq_nb", "stoi", "si_sdr")


def score_model(model, items: list[tuple[str, np.ndarray, np.ndarray]]) -> dict[str, float]:
    """Mean PESQ-wb, STOI and SI-SDR of the model's output on [(name, noisy, clean)]: the validation
    during training (a file the metrics reject is left out). model None scores the noisy input."""
    fn = model_fn(model) if model is not None else None
    scores = []
    for _, noisy, clean in items:
        enh = enhance_array(fn, noisy) if fn is not None else noisy
        try:
            scores.append((pesq_score(clean, enh), stoi_score(clean, enh), si_sdr(clean, enh)))
        except ValueError:
            continue
    if not scores:
        return {"pesq": float("nan"), "stoi": float("nan"), "si_sdr": float("nan")}
    m = np.mean(scores, axis=0)
    return {"pesq": float(m[0]), "stoi": float(m[1]), "si_sdr": float(m[2])}


_KIND = re.compile(r"_([A-Za-z]+)_-?\d+(?:\.\d+)?dB")


def noise_kind(name: str) -> str | None:
    """The noise kind a file name carries ('x_awb_pink_5dB.flac' -> 'pink'), else None."""
    m = _KIND.search(name)
    if m:
        return m.group(1).lower()
    tokens = re.split(r"[_\-.]", name.lower())
    return next((k for k in MIX_NOISE_KINDS if k in tokens), None)


def group_means(results: list[PairResult], classical: list[PairResult]) -> dict[str, dict[str, float]]:
    """Per noise kind (from the file names): {kind: {noisy/m, enhanced/m, classical/m, n}}."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(results):
        kind = noise_kind(r.name)
        if kind is not None and r.error is None and classical[i].error is None:
            groups.setdefault(kind, []).append(i)
    out = {}
    for kind, idx in sorted(groups.items()):
        row: dict[str, float] = {"n": len(idx)}
        for m in METRICS:
            row[f"noisy/{m}"] = float(np.mean([results[i].noisy[m] for i in idx]))
            row[f"enhanced/{m}"] = float(np.mean([results[i].enhanced[m] for i in idx]))
            row[f"classical/{m}"] = float(np.mean([classical[i].enhanced[m] for i in idx]))
        out[kind] = row
    return out


def load_pairs(
    data: str | None, count: int, seconds: float, limit: int | None
) -> list[tuple[str, np.ndarray, ...]]:
    """[(name, noisy, clean)] from a folder (test split preferred) or the held-out generator."""
    if data is None:
        return heldout_pairs(count, seconds)
    try:
        pairs = find_pairs(data, split="test")
    except FileNotFoundError:
        pairs = find_pairs(data)
    out = []
    for i in range(len(pairs) if limit is None else min(limit, len(pairs))):
        clean, noisy = pairs.load(i)
        out.append((pairs.names[i], noisy, clean))
    return out


def write_csv(path: Path, results: list[PairResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", *(f"noisy_{m}" for m in METRICS), *(f"enhanced_{m}" for m in METRICS), "error"])
        for r in results:
            w.writerow(
                [
                    r.name,
                    *(r.noisy.get(m, "") for m in METRICS),
                    *(r.enhanced.get(m, "") for m in METRICS),
                    r.error or "",
                ]
            )


def format_table(results: list[PairResult], summary: dict[str, float]) -> str:
    head = f"{'file':<28}" + "".join(f"{m:>18}" for m in METRICS)
    lines = [head, "-" * len(head)]
    for r in results:
        if r.error:
            lines.append(f"{r.name:<28}  FAILED: {r.error}")
            continue
        cells = "".join(f"{r.noisy[m]:>8.3f} -> {r.enhanced[m]:<6.3f}" for m in METRICS)
        lines.append(f"{r.name:<28}{cells}")
    lines.append("-" * len(head))
    if summary.get("n_ok"):
        cells = "".join(f"{summary[f'noisy/{m}']:>8.3f} -> {summary[f'enhanced/{m}']:<6.3f}" for m in METRICS)
        lines.append(f"{'mean (noisy -> enhanced)':<28}{cells}")
        lines.append(f"{'delta':<28}" + "".join(f"{summary[f'delta/{m}']:>+18.3f}" for m in METRICS))
    lines.append(f"{int(summary['n_ok'])} evaluated, {int(summary['n_failed'])} failed")
    return "\n".join(lines)


def spectrogram_png(
    path: Path, noisy: np.ndarray, enhanced: np.ndarray, clean: np.ndarray, title: str
) -> None:
    """Three log-magnitude spectrograms (noisy / enhanced / clean) stacked in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    win = torch.hann_window(400)
    for ax, (name, x) in zip(axes, (("noisy", noisy), ("enhanced", enhanced), ("clean", clean))):
        spec = torch.stft(
            torch.from_numpy(np.asarray(x, np.float32)), 512, 100, 400, win, return_complex=True
        )
        db = 20 * torch.log10(spec.abs() + 1e-5).numpy()
        extent = (0, len(x) / SAMPLE_RATE, 0, SAMPLE_RATE / 2000)
        ax.imshow(
            db, origin="lower", aspect="auto", extent=extent, vmin=db.max() - 80, vmax=db.max(), cmap="magma"
        )
        ax.set_ylabel(f"{name}\nkHz")
    axes[-1].set_xlabel("time (s)")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Evaluate from the command line (argv None -> sys.argv[1:]); returns the summary."""
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="clean_*/noisy_* root; default: generated held-out pairs")
    p.add_argument("--pairs", type=int, default=16, help="generated pairs to evaluate")
    p.add_argument("--seconds", type=float, default=3.0, help="length of generated pairs")
    p.add_argument("--limit", type=int, default=None, help="evaluate at most this many files from --data")
    add_pcs_arg(p)
    add_eval_args(p, "mbsnet-speech")
    args = p.parse_args(argv)
    apply_threads(args)
    check_numbers(args, pairs=">=1", seconds=">0", limit=">=1")
    run = resolve_run(args.run, "mbsnet-speech", args.runs_dir)
    out_dir = eval_out_dir(args, run, (args.data,))
    try:
        from mbsnet_speech.system import SYSTEM

        pcs = {} if args.pcs is None else {"pcs": args.pcs}
        model, state = SYSTEM.load_model(run, resolve_device(args.device), **pcs)
        items = load_pairs(args.data, args.pairs, args.seconds, args.limit)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"error: {e}") from None
    data_desc = (
        f"{len(items)} generated held-out pairs"
        if args.data is None
        else f"{len(items)} pairs from {args.data} ({'test split' if _has_test(args.data) else 'all'})"
    )
    print(f"checkpoint: {state['path']} (step {state.get('step', '?')})\ndata: {data_desc}")
    fn = model_fn(model)
    rows, classical_rows, enhanced = [], [], {}
    for name, noisy, clean in items:
        try:
            enh = enhance_array(fn, noisy)
        except ValueError as e:  # recorded by evaluate_pairs as this file's failure
            enh = np.full_like(noisy, np.nan)
            print(f"{name}: enhancement failed: {e}")
        try:
            wiener = wiener_enhance(noisy)
        except ValueError:
            wiener = np.full_like(noisy, np.nan)
        enhanced[name] = enh
        rows.append((name, clean, noisy, enh))
        classical_rows.append((name, clean, noisy, wiener))
    results = evaluate_pairs(rows)
    classical = evaluate_pairs(classical_rows)
    summary = summarise(results)
    for key, value in summarise(classical).items():
        if key.startswith("enhanced/"):
            summary["classical/" + key.split("/", 1)[1]] = value
    per_kind = group_means(results, classical)
    print(format_table(results, summary))
    print(format_baseline(summary, per_kind))
    write_csv(out_dir / "metrics.csv", results)
    report = {
        "checkpoint": state["path"],
        "step": state.get("step"),
        "data": data_desc,
        "summary": summary,
        "per_noise_kind": per_kind,
        "files": [
            {
                "file": r.name,
                "noisy": r.noisy,
                "enhanced": r.enhanced,
                "classical": c.enhanced,
                "error": r.error,
            }
            for r, c in zip(results, classical)
        ],
    }
    (out_dir / "metrics.json").write_text(json.dumps(report, indent=1))
    ok = next((r for r in results if r.error is None), None)
    if ok is not None:
        noisy, clean = next((n, c) for nm, n, c in items if nm == ok.name)
        spectrogram_png(
            out_dir / "spectrogram.png",
            noisy,
            enhanced[ok.name],
            clean,
            f"{ok.name}: PESQ-wb {ok.noisy['pesq_wb']:.2f} -> {ok.enhanced['pesq_wb']:.2f}",
        )
    print(f"wrote {out_dir / 'metrics.csv'}, {out_dir / 'metrics.json'} and {out_dir / 'spectrogram.png'}")
    return summary


def _has_test(root: str) -> bool:
    try:
        find_pairs(root, split="test")
    except (FileNotFoundError, ValueError):
        return False
    return True


def format_baseline(summary: dict[str, float], per_kind: dict[str, dict[str, float]]) -> str:
    """Means of noisy / model / classical Wiener baseline, overall and per noise kind."""
    if not summary.get("n_ok"):
        return ""
    cols = ("pesq_wb", "stoi", "si_sdr")
    head = f"{'':<18}{'n':>4}" + "".join(f"{m + ' noisy / model / Wiener':>34}" for m in cols)
    lines = ["", head, "-" * len(head)]

    def row(label: str, d: dict[str, float], n: int) -> str:
        cells = "".join(
            f"{d[f'noisy/{m}']:>14.3f} /{d[f'enhanced/{m}']:>7.3f} /{d[f'classical/{m}']:>7.3f}   "
            for m in cols
        )
        return f"{label:<18}{n:>4}{cells}"

    lines.append(row("all", summary, int(summary["n_ok"])))
    for kind, d in per_kind.items():
        lines.append(row(kind, d, int(d["n"])))
    return "\n".join(lines)


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("mbsnet-eval", main))
