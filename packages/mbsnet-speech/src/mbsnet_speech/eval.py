"""Evaluate MBS-Net: PESQ (wb, nb), STOI and SI-SDR of noisy vs enhanced, a table, a CSV and a spectrogram.

`uv run mbsnet-eval [--run RUN] [--data ROOT] [--clean DIR --noise DIR] [--speech FILE]`: each set
beside the classical Wiener filter: pairs from a clean_*/noisy_* folder (the test split when there is
one); voices the run never trained on mixed with noise recordings it never trained on (by default the
run's own test groups, data.split_groups); a recording (--speech) mixed with those noises. Without any,
what the run trained on (when it is here), else generated held-out pairs no training batch contains.
The split is the model's own, read from its settings: a run's checkpoint or an export's config.json
(`meta.settings`); a model that records none gets its sets named as such, never "held-out". Without
--run: the model shipped in the package.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

import numpy as np
from memfit.errors import UsageError
from memfit.train.distributed import resolve_device
from memfit.train.export import model_line
from memfit.train.flags import apply_threads, eval_out_dir
from memfit.train.outputs import output_files, write_file, write_text

from mbsnet_speech.classical import wiener_enhance
from mbsnet_speech.config import SAMPLE_RATE
from mbsnet_speech.data import (
    MIX_NOISE_KINDS,
    VAL_SEED,
    audio_files,
    find_pairs,
    heldout_mixes,
    heldout_pairs,
    split_groups,
)
from mbsnet_speech.enhance import enhance_array, inference_overrides, model_fn
from mbsnet_speech.flags import eval_args
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


def write_csv(path: Path, results: list[tuple[str, PairResult]]) -> None:
    """One row per file of every set: [(set label, result)]."""
    with output_files([path], overwrite=True) as (tmp,), open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["set", "file", *(f"noisy_{m}" for m in METRICS), *(f"enhanced_{m}" for m in METRICS), "error"]
        )
        for label, r in results:
            w.writerow(
                [
                    label,
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
    try:
        write_file(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"), overwrite=True)
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Evaluate from the command line (argv None -> sys.argv[1:]); returns the first set's summary."""
    return run(eval_args(argv))


def run(args: argparse.Namespace) -> dict[str, float]:
    """Evaluate what flags.eval_args read (`memfit eval mbsnet-speech`); returns the first set's summary."""
    apply_threads(args)
    from mbsnet_speech.system import SYSTEM

    model_path = SYSTEM.run_dir(args.run, args.runs_dir)
    name = "shipped" if SYSTEM.is_shipped(model_path) else None
    try:  # the model first (seconds): --shifts or --keep_noisy it refuses leaves no --out folder behind
        overrides = inference_overrides(args.pcs, args.keep_noisy, args.shifts)
        model, state = SYSTEM.load_model(model_path, resolve_device(args.device), **overrides)
    except UsageError:
        raise
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"error: {e}") from None
    out_dir = eval_out_dir(args, model_path, (args.data, args.clean, args.noise, args.speech), name)
    try:
        settings = state.get("settings")
        sets = eval_sets(args, (settings or {}).get("train") or {}, known=settings is not None)
    except UsageError:
        raise
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"error: {e}") from None
    print(model_line(SYSTEM, state))
    fn = model_fn(model)
    reports = []
    for label, items in sets:
        print(f"\ndata: {label}")
        reports.append(score_set(fn, label, items, out_dir, first=not reports))
    write_csv(out_dir / "metrics.csv", [(r["data"], res) for r in reports for res in r.pop("_results")])
    report = {"checkpoint": state["path"], "step": state.get("step"), "model": model_line(SYSTEM, state)}
    report |= {**reports[0], "sets": reports}
    write_text(out_dir / "metrics.json", json.dumps(report, indent=1), overwrite=True)
    print(f"\nwrote {out_dir / 'metrics.csv'}, {out_dir / 'metrics.json'} and {out_dir / 'spectrogram.png'}")
    return reports[0]["summary"]


def eval_sets(args, trained: dict, known: bool = True) -> list[tuple[str, list]]:
    """[(label, [(name, noisy, clean)])]: the --data test split, held-out voices of --clean mixed with
    held-out noises, --speech mixed with them; each defaults to what the run trained on (its settings
    `trained`) when that still exists here; generated held-out pairs when there is none of these. known
    False: the model records no settings, so no voice or noise can be called held out: the labels say so."""
    sets = []
    explicit = args.data or args.clean or args.speech
    data = args.data if explicit else _existing(trained.get("data"))
    if data:
        items = load_pairs(data, args.pairs, args.seconds, args.limit)
        sets.append((f"{len(items)} pairs from {data} ({'test split' if _has_test(data) else 'all'})", items))
    clean = args.clean if explicit else _existing(trained.get("clean"), "--clean")
    if clean or args.speech:
        noise, noise_label = _heldout_noise(args, trained, known)
    if clean:
        voices = args.voices if args.voices is not None else tuple(trained.get("test_voices") or ())
        files = audio_files(clean, "--clean")
        chosen, groups = _held_out(files, clean, trained.get("val_voices"), voices, auto=3)
        if not chosen:
            raise ValueError(
                f"no held-out voice in {clean}; name voices with --voices (e.g. --voices krb,lj)"
            )
        items = heldout_mixes(chosen, noise, args.mixes, VAL_SEED + 1, tuple(args.snr))
        voices = f"held-out voices {', '.join(groups)}" if known else f"voices {', '.join(groups)}{UNKNOWN}"
        sets.append((f"{len(items)} mixes of {voices} x {noise_label}", items))
    if args.speech:
        path = Path(args.speech)
        files = audio_files(path, "--speech") if path.is_dir() else [path]
        items = heldout_mixes(files, noise, args.mixes, VAL_SEED + 2, tuple(args.snr))
        sets.append((f"{len(items)} mixes of {args.speech} x {noise_label}", items))
    if not sets:
        items = heldout_pairs(args.pairs, args.seconds)
        sets.append((f"{len(items)} generated held-out pairs", items))
    return sets


def _existing(path: str | None, flag: str = "--data") -> str | None:
    """A path the run trained on, where it exists here; where it does not, None, and a line that says so
    (the set it stood for is then left out, or generated pairs stand in)."""
    if path and not Path(path).exists():
        print(f"[mbsnet] the run trained on {flag} {path}, which is not here; scoring without it (give "
              f"{flag} PATH to score it)", file=sys.stderr)  # fmt: skip
    return path if path and Path(path).exists() else None


# how a set is named when the model records no training settings (an export written without them)
UNKNOWN = " (the model records no training split: it may have trained on them)"


def _heldout_noise(args, trained: dict, known: bool = True) -> tuple[list[Path] | None, str]:
    """The noise files for held-out mixes: --noise's (or the run's) test recordings, else its validation
    ones, else all of them; None (built-in kinds) without a noise folder."""
    folder = args.noise or _existing(trained.get("noise"), "--noise")
    if not folder:
        return None, "built-in noises"
    names = args.noises if args.noises is not None else tuple(trained.get("test_noises") or ())
    files = audio_files(folder, "--noise")
    chosen, groups = _held_out(files, folder, trained.get("val_noises"), names, auto=0)
    if chosen:
        return (
            chosen,
            f"held-out noises {', '.join(groups)}" if known else f"noises {', '.join(groups)}{UNKNOWN}",
        )
    return files, f"noises of {folder}"


def _held_out(files: list[Path], root: str, val: list | None, test: tuple, auto: int) -> tuple[list, list]:
    """(files, groups) held out from training: the `test` groups, else the run's validation groups `val`
    (data.split_groups); ([], []) when there is neither."""
    _, v, t, val_g, test_g = split_groups(files, root, tuple(val or ()), test, auto)
    return (t, test_g) if t else (v, val_g)


def score_set(fn, label: str, items: list, out_dir: Path, first: bool) -> dict:
    """Score the model and the Wiener filter on items, print the table; the set's report."""
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
    ok = next((r for r in results if r.error is None), None)
    if first and ok is not None:
        noisy, clean = next((n, c) for nm, n, c in items if nm == ok.name)
        spectrogram_png(
            out_dir / "spectrogram.png",
            noisy,
            enhanced[ok.name],
            clean,
            f"{ok.name}: PESQ-wb {ok.noisy['pesq_wb']:.2f} -> {ok.enhanced['pesq_wb']:.2f}",
        )
    files = [
        {"file": r.name, "noisy": r.noisy, "enhanced": r.enhanced, "classical": c.enhanced, "error": r.error}
        for r, c in zip(results, classical)
    ]
    return {
        "data": label,
        "summary": summary,
        "per_noise_kind": per_kind,
        "files": files,
        "_results": results,
    }


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
