"""Evaluate MBS-Net: PESQ (wb, nb), STOI and SI-SDR of noisy vs enhanced, a table, a CSV and a spectrogram.

`uv run mbsnet-eval [--run RUN] [--data ROOT]`: pairs from a clean_*/noisy_* folder (the test split
when there is one) or, by default, generated held-out pairs that no training batch contains.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
from memfit.flags import add_eval_args, apply_threads, check_numbers, eval_out_dir, hidden_alias
from memfit.run_dir import resolve_run
from memfit.training import resolve_device

from mbsnet_speech.data import SAMPLE_RATE, find_pairs, heldout_pairs
from mbsnet_speech.enhance import enhance_array, load_model, model_fn
from mbsnet_speech.metrics import PairResult, evaluate_pairs, summarise

METRICS = ("pesq_wb", "pesq_nb", "stoi", "si_sdr")


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="clean_*/noisy_* root; default: generated held-out pairs")
    p.add_argument("--pairs", type=int, default=16, help="generated pairs to evaluate")
    p.add_argument("--seconds", type=float, default=3.0, help="length of generated pairs")
    p.add_argument("--limit", type=int, default=None, help="evaluate at most this many files from --data")
    p.add_argument("--pcs", action="store_true", help="perceptual contrast stretching of the output")
    add_eval_args(p, "mbsnet-speech")
    hidden_alias(p, "--ckpt", dest="run")  # the old spelling
    args = p.parse_args(argv)
    apply_threads(args)
    check_numbers(args, pairs=">=1", seconds=">0", limit=">=1")
    run = resolve_run(args.run, "mbsnet-speech", args.runs_dir)
    out_dir = eval_out_dir(args, run)
    try:
        model = load_model(run, resolve_device(args.device), pcs=args.pcs or None)
        items = load_pairs(args.data, args.pairs, args.seconds, args.limit)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    fn = model_fn(model)
    rows, enhanced = [], {}
    for name, noisy, clean in items:
        try:
            enh = enhance_array(fn, noisy)
        except ValueError as e:  # recorded by evaluate_pairs as this file's failure
            enh = np.full_like(noisy, np.nan)
            print(f"{name}: enhancement failed: {e}")
        enhanced[name] = enh
        rows.append((name, clean, noisy, enh))
    results = evaluate_pairs(rows)
    summary = summarise(results)
    print(format_table(results, summary))
    write_csv(out_dir / "metrics.csv", results)
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
    print(f"wrote {out_dir / 'metrics.csv'} and {out_dir / 'spectrogram.png'}")
    return summary


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("mbsnet-eval", main))
