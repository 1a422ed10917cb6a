"""Enhance wav files with a trained MBS-Net: `uv run python -m mbsnet_speech.enhance IN --out DIR`.

IN is a wav file or a folder of them; long files are processed in chunks that overlap and are
cross-faded, so memory stays bounded whatever the file length.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mbsnet_speech.config import MBSNetConfig
from mbsnet_speech.data import AUDIO_EXTS, SAMPLE_RATE, read_wav, write_wav
from mbsnet_speech.model import MBSNet

DEFAULT_RUN = "runs/mbsnet-speech/run"


def resolve_checkpoint(ckpt: str | Path) -> Path:
    """A checkpoint file as given; for a run folder its best.pt (best validation PESQ) when there is
    one, else its newest step checkpoint."""
    from memfit.training import find_checkpoint

    path = Path(ckpt)
    if not path.is_dir():
        return path
    found = find_checkpoint(path, which="best")
    if found is None:
        raise FileNotFoundError(
            f"no checkpoint (best.pt or ckpt_*.pt) in {path}; train first or pass a .pt file"
        )
    return Path(found)


def load_checkpointed(
    ckpt: str | Path, device: str | torch.device = "cpu", pcs: bool | None = None
) -> tuple[MBSNet, Path, int]:
    """(model in eval mode, the checkpoint file used, its training step) from a file or run folder."""
    from memfit.training import load_checkpoint

    path = resolve_checkpoint(ckpt)
    state = load_checkpoint(path, map_location="cpu")
    cfg = MBSNetConfig.from_dict(state.get("model_config") or {})
    if pcs is not None:
        cfg.pcs = pcs
    model = MBSNet(cfg)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), path, int(state.get("step", -1))


def load_model(ckpt: str | Path, device: str | torch.device = "cpu", pcs: bool | None = None) -> MBSNet:
    """Rebuild the model from a checkpoint file or run folder (best.pt first) and load the weights."""
    return load_checkpointed(ckpt, device, pcs)[0]


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
    p = argparse.ArgumentParser(prog="mbsnet-enhance", description=__doc__.splitlines()[0])
    p.add_argument("input", help="a .wav file or a folder of them")
    p.add_argument("--out", required=True, help="output folder (same file names)")
    p.add_argument("--ckpt", default=DEFAULT_RUN, help="checkpoint file or run folder (default %(default)s)")
    p.add_argument("--chunk_seconds", type=float, default=4.0)
    p.add_argument("--overlap_seconds", type=float, default=0.5)
    p.add_argument("--pcs", action="store_true", help="perceptual contrast stretching of the output")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    src, out_dir = Path(args.input), Path(args.out)
    if src.is_dir():
        files = sorted(f for f in src.iterdir() if f.suffix.lower() in AUDIO_EXTS)
        if not files:
            raise SystemExit(f"error: no .wav files in {src}")
    elif src.exists():
        files = [src]
    else:
        raise SystemExit(f"error: {src} does not exist")
    try:
        model = load_model(args.ckpt, args.device, pcs=args.pcs or None)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    chunk, overlap = int(args.chunk_seconds * SAMPLE_RATE), int(args.overlap_seconds * SAMPLE_RATE)
    fn = model_fn(model)
    written = []
    for f in files:
        try:
            wav = read_wav(f)
            enhanced = enhance_array(fn, wav, chunk, overlap)
        except ValueError as e:
            raise SystemExit(f"error: {f}: {e}") from None
        write_wav(out_dir / f.name, enhanced)
        written.append(out_dir / f.name)
        print(f"{f} -> {out_dir / f.name} ({len(wav) / SAMPLE_RATE:.1f} s)")
    return written


if __name__ == "__main__":
    main()
