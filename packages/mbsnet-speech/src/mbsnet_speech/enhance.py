"""Enhance wav files with a trained MBS-Net: `memfit run mbsnet-speech enhance IN --out DIR --run RUN`.

IN is a wav file or a folder of them; long files are processed in chunks that overlap and are
cross-faded, so memory stays bounded whatever the file length.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from memfit.distributed import resolve_device
from memfit.errors import UsageError
from memfit.flags import Parser, add_threads_arg, apply_threads, check_numbers, eval_out_dir
from memfit.run_dir import resolve_run

from mbsnet_speech.data import AUDIO_EXTS, SAMPLE_RATE, conversion_notes, read_wav, write_wav
from mbsnet_speech.model import MBSNet


def load_model(run: str | Path | None, device: str | torch.device = "cpu", pcs: bool | None = None) -> MBSNet:
    """The model of a run (name or folder: best.pt, else its newest checkpoint) or a checkpoint file."""
    from mbsnet_speech.system import SYSTEM

    return SYSTEM.load_model(run, device, **({} if pcs is None else {"pcs": pcs}))[0]


def add_pcs_arg(p: argparse.ArgumentParser) -> None:
    """--pcs / --no-pcs for eval and enhance: None (neither given) keeps what the run's config says."""
    p.add_argument(
        "--pcs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="perceptual contrast stretching of the output (default: the run's config; CPU recipe: on)",
    )


def enhance_array(
    fn: Callable[[torch.Tensor], torch.Tensor],
    wav: np.ndarray,
    chunk: int = 4 * SAMPLE_RATE,
    overlap: int = SAMPLE_RATE // 2,
    min_len: int = 400,
) -> np.ndarray:
    """Run fn on (1, n) pieces of at most `chunk` samples overlapping by `overlap`, cross-fade; (n,) -> (n,).

    The fades are complementary (sin^2 + cos^2 = 1), so a fn that returns its input comes back exact.
    """
    if overlap >= chunk:
        raise ValueError(f"overlap ({overlap}) must be smaller than chunk ({chunk})")
    n = len(wav)
    x = torch.from_numpy(np.asarray(wav, dtype=np.float32))

    def run(piece: torch.Tensor) -> torch.Tensor:
        m = piece.shape[0]
        if m < min_len:  # pad a short tail to one STFT window
            piece = torch.nn.functional.pad(piece, (0, min_len - m))
        return fn(piece[None])[0, :m].float().cpu().clone()  # fades below work in place

    if n <= chunk:
        return run(x).numpy()
    out = torch.zeros(n)
    step = chunk - overlap
    fade_in = torch.sin(torch.linspace(0, torch.pi / 2, overlap)) ** 2
    start = 0
    while True:
        end = min(start + chunk, n)
        y = run(x[start:end])
        if start > 0:  # fade in over the overlap with the previous piece, which fades out
            y[:overlap] *= fade_in
            out[start : start + overlap] *= 1 - fade_in
            out[start : start + overlap] += y[:overlap]
            out[start + overlap : end] = y[overlap:]
        else:
            out[start:end] = y
        if end == n:
            break
        start += step
    return out.numpy()


def model_fn(model: MBSNet) -> Callable[[torch.Tensor], torch.Tensor]:
    """(1, n) float CPU tensor -> enhanced (1, n), on the model's device, no grad."""
    device = next(model.parameters()).device

    @torch.no_grad()
    def fn(x: torch.Tensor) -> torch.Tensor:
        return model(x.to(device)).wav

    return fn


def main(argv: list[str] | None = None) -> list[Path]:
    """Enhance a wav or a folder of wavs; returns the written paths."""
    p = Parser(prog="memfit run mbsnet-speech enhance", description=__doc__.splitlines()[0])
    p.add_argument("input", help="a .wav file or a folder of them")
    p.add_argument("--out", required=True, help="output folder (same file names)")
    p.add_argument(
        "--run", default=None, help="run name, run folder or .pt file (default runs/mbsnet-speech/run)"
    )
    p.add_argument("--runs_dir", default="runs", help="where train wrote its runs (default %(default)s)")
    p.add_argument("--chunk_seconds", type=float, default=4.0)
    p.add_argument("--overlap_seconds", type=float, default=0.5)
    add_pcs_arg(p)
    p.add_argument("--device", default="auto")
    add_threads_arg(p)
    args = p.parse_args(argv)
    apply_threads(args)
    check_numbers(args, chunk_seconds=">0", overlap_seconds=">=0")
    src = Path(args.input)
    if src.is_dir():
        files = sorted(f for f in src.iterdir() if f.suffix.lower() in AUDIO_EXTS)
        if not files:
            raise UsageError(f"error: no .wav files in {src}")
    elif src.exists():
        files = [src]
    else:
        raise UsageError(f"error: {src} does not exist")
    notes = set()
    for f in files:
        with contextlib.suppress(RuntimeError, sf.LibsndfileError):  # unreadable: read_wav says so below
            notes.update(conversion_notes(sf.info(str(f))))
    for n in sorted(notes):
        print(f"[mbsnet] {n} (the enhanced files are 16 kHz mono)", file=sys.stderr)
    out_dir = eval_out_dir(args, src)
    try:
        run = resolve_run(args.run, "mbsnet-speech", args.runs_dir)
        model = load_model(run, resolve_device(args.device), pcs=args.pcs)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"error: {e}") from None
    chunk, overlap = int(args.chunk_seconds * SAMPLE_RATE), int(args.overlap_seconds * SAMPLE_RATE)
    fn = model_fn(model)
    written = []
    for f in files:
        try:
            wav = read_wav(f)
            enhanced = enhance_array(fn, wav, chunk, overlap)
        except ValueError as e:
            raise UsageError(f"error: {f}: {e}") from None
        write_wav(out_dir / f.name, enhanced)
        written.append(out_dir / f.name)
        print(f"{f} -> {out_dir / f.name} ({len(wav) / SAMPLE_RATE:.1f} s)")
    return written


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("memfit run mbsnet-speech enhance", main))
