"""Enhance wav files with a trained MBS-Net: `memfit run mbsnet-speech enhance IN --out DIR --run RUN`.

IN is an audio file or a folder of them; files are read, enhanced and written in blocks (chunks that
overlap and are cross-faded), so memory stays bounded whatever the file length. Without --run (or with
`--run shipped`) it uses the model shipped in the package (docs/results.md says what it was trained on
and what it scores).

From Python the module is callable: ``mbsnet_speech.enhance(audio, sample_rate)`` enhances an array or
tensor already in memory, one signal (n,) or a batch (batch, n) (`enhance_audio`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import torch
from memfit.errors import UsageError, make_folders
from memfit.train.distributed import resolve_device
from memfit.train.export import model_line
from memfit.train.flags import apply_threads
from memfit.train.outputs import check_outputs, output_files

from mbsnet_speech.config import MIN_SAMPLES, SAMPLE_RATE
from mbsnet_speech.data import AUDIO_EXTS, conversion_notes, read_blocks
from mbsnet_speech.flags import chunk_samples, enhance_args
from mbsnet_speech.model import MBSNet
from mbsnet_speech.system import SYSTEM


def load_model(
    run: str | Path | None = None,
    device: str | torch.device = "cpu",
    pcs: bool | None = None,
    keep_noisy: float | None = None,
    shifts: int | None = None,
    runs_dir: str | Path = "runs",
) -> MBSNet:
    """The model of a run (name or folder: best.pt, else its newest checkpoint), a checkpoint file or an
    exported folder; None or "shipped": the model shipped in the package. pcs / keep_noisy / shifts None
    keep what its config says."""
    return SYSTEM.load_model(run, device, runs_dir=runs_dir, **inference_overrides(pcs, keep_noisy, shifts))[
        0
    ]


def inference_overrides(pcs: bool | None, keep_noisy: float | None, shifts: int | None = None) -> dict:
    """Config overrides of --pcs / --keep_noisy / --shifts (None: the run's own)."""
    given = {"pcs": pcs, "keep_noisy": keep_noisy, "shifts": shifts}
    return {k: v for k, v in given.items() if v is not None}


def enhance_blocks(
    fn: Callable[[torch.Tensor], torch.Tensor],
    blocks: Iterable[np.ndarray],
    chunk: int = 4 * SAMPLE_RATE,
    overlap: int = SAMPLE_RATE // 2,
    min_len: int = MIN_SAMPLES,
) -> Iterator[np.ndarray]:
    """Enhance a stream: consecutive pieces of a signal in (any sizes) -> consecutive pieces out, the same
    samples in all. fn runs on (1, m) windows of at most `chunk` samples overlapping by `overlap`, cross-faded
    with complementary fades (sin^2 + cos^2 = 1, so a fn that returns its input comes back exact). Memory
    is one chunk plus one block, whatever the length of the stream."""
    if overlap >= chunk:
        raise ValueError(f"overlap ({overlap}) must be smaller than chunk ({chunk})")
    step = chunk - overlap
    fade_in = torch.sin(torch.linspace(0, torch.pi / 2, overlap)) ** 2

    def run(piece: np.ndarray) -> torch.Tensor:
        m = len(piece)
        x = torch.from_numpy(np.ascontiguousarray(piece, dtype=np.float32))
        if m < min_len:  # pad a short tail to one STFT window
            x = torch.nn.functional.pad(x, (0, min_len - m))
        return fn(x[None])[0, :m].float().cpu().clone()  # the fades below work in place

    def blend(y: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
        if tail is not None and overlap:  # fade in over the previous window's end, which fades out
            y[:overlap] = y[:overlap] * fade_in + tail * (1 - fade_in)
        return y

    buf = np.zeros(0, np.float32)
    tail = None
    for block in blocks:
        buf = np.concatenate([buf, np.asarray(block, np.float32)])
        while len(buf) > chunk:  # more follows this window: all but its last `overlap` samples are final
            y = blend(run(buf[:chunk]), tail)
            yield y[:step].numpy()
            tail = y[step:].clone()
            buf = buf[step:]
    if len(buf):
        yield blend(run(buf), tail).numpy()


def enhance_array(
    fn: Callable[[torch.Tensor], torch.Tensor],
    wav: np.ndarray,
    chunk: int = 4 * SAMPLE_RATE,
    overlap: int = SAMPLE_RATE // 2,
    min_len: int = MIN_SAMPLES,
) -> np.ndarray:
    """enhance_blocks on one array: (n,) -> (n,)."""
    pieces = list(enhance_blocks(fn, [wav], chunk, overlap, min_len))
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def enhance_stream(
    fn: Callable[[torch.Tensor], torch.Tensor],
    src: str | Path,
    dst: str | Path,
    chunk: int = 4 * SAMPLE_RATE,
    overlap: int = SAMPLE_RATE // 2,
) -> float:
    """Enhance an audio file into a 16 kHz mono 16-bit wav, reading and writing in blocks (data.read_blocks),
    so memory does not grow with the file's length; the seconds written. The output goes through memfit's
    one output path (memfit.train.outputs): a temporary file renamed at the end, removed on an error, a
    full disk, Ctrl-C or SIGTERM; the caller has decided whether dst may be replaced. A progress bar counts
    the seconds done, on a terminal only (a long recording takes minutes)."""
    from tqdm import tqdm

    n = 0
    try:
        info = sf.info(str(src))
        total = round(info.frames / info.samplerate, 1)
    except (RuntimeError, sf.LibsndfileError):  # unreadable: read_blocks says so below
        total = None
    bar = tqdm(total=total, desc=Path(src).name, unit="s", leave=False, disable=None)
    with bar, output_files([dst], overwrite=True) as (tmp,):
        with sf.SoundFile(str(tmp), "w", SAMPLE_RATE, 1, subtype="PCM_16", format="WAV") as out:
            for y in enhance_blocks(fn, read_blocks(src), chunk, overlap):
                out.write(np.clip(y, -1.0, 1.0))
                n += len(y)
                bar.update(round(len(y) / SAMPLE_RATE, 3))
        if n == 0:
            raise ValueError(f"{src} contains no samples")
    return n / SAMPLE_RATE


def enhance_file(
    src: str | Path,
    dst: str | Path,
    run: str | Path | None = None,
    device: str = "cpu",
    pcs: bool | None = None,
    keep_noisy: float | None = None,
    shifts: int | None = None,
) -> Path:
    """Enhance one audio file (any rate, any channels) into a 16 kHz mono wav with a run's model, an
    exported one, or (run None) the model shipped in the package; returns dst. pcs / keep_noisy / shifts
    None keep the model's config (the shipped model: 4 shifted passes; shifts=1 is 3x faster)."""
    check_outputs([dst], [src], overwrite=True)  # before the model loads: a refusal costs nothing
    model = load_model(run, device, pcs, keep_noisy, shifts)
    enhance_stream(model_fn(model), src, dst)
    return Path(dst)


def enhance_audio(
    audio: Any,
    sample_rate: int,
    run: str | Path | None = None,
    *,
    model: MBSNet | None = None,
    device: str = "cpu",
    runs_dir: str | Path = "runs",
    pcs: bool | None = None,
    keep_noisy: float | None = None,
    shifts: int | None = None,
) -> Any:
    """Enhance audio already in memory: a numpy array or torch tensor, one mono signal (n,) or a batch
    (batch, n), at `sample_rate` -> the same type, shape and rate (the model runs at 16 kHz: other rates are
    resampled there and back, so nothing above 8 kHz comes back). Long signals run in overlapping chunks, as
    enhance_file. `model`: one loaded already (`mbsnet_speech.load()`), else `run`'s, else the model shipped
    in the package. Also called as ``mbsnet_speech.enhance(audio, sample_rate)``."""
    import torchaudio.functional as AF

    tensor = isinstance(audio, torch.Tensor)
    x = (audio.detach().cpu() if tensor else torch.from_numpy(np.asarray(audio))).float()
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"audio must be (n,) or (batch, n) with n > 0 samples, got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("audio contains NaN or Inf samples")
    if int(sample_rate) != sample_rate or sample_rate <= 0:
        raise ValueError(f"sample_rate must be a positive integer (Hz), got {sample_rate!r}")
    rows = x.reshape(-1, x.shape[-1])
    if sample_rate != SAMPLE_RATE:
        rows = AF.resample(rows, int(sample_rate), SAMPLE_RATE)
    if model is None:
        model = load_model(run, resolve_device(device), pcs, keep_noisy, shifts, runs_dir)
    fn = model_fn(model)
    out = torch.stack([torch.from_numpy(enhance_array(fn, r.numpy())) for r in rows])
    if sample_rate != SAMPLE_RATE:
        out = AF.resample(out, SAMPLE_RATE, int(sample_rate))
    out = torch.nn.functional.pad(out, (0, max(0, x.shape[-1] - out.shape[-1])))[..., : x.shape[-1]]
    out = out.reshape(x.shape)
    return out.to(audio.device) if tensor else out.numpy()


def shipped_model() -> Path:
    """The folder of the model that comes with the package (memfit export format: weights and config)."""
    return Path(SYSTEM.shipped)


def model_fn(model: MBSNet) -> Callable[[torch.Tensor], torch.Tensor]:
    """(1, n) float CPU tensor -> enhanced (1, n), on the model's device, no grad."""
    device = next(model.parameters()).device

    @torch.no_grad()
    def fn(x: torch.Tensor) -> torch.Tensor:
        return model(x.to(device)).wav

    return fn


def main(argv: list[str] | None = None) -> list[Path]:
    """Enhance a wav or a folder of wavs from the command line (argv None -> sys.argv[1:]); returns the
    written paths."""
    return run(enhance_args(argv))


def run(args: argparse.Namespace) -> list[Path]:
    """Enhance what flags.enhance_args read (`memfit run mbsnet-speech enhance`); returns the written
    paths."""
    apply_threads(args)
    chunk, overlap = chunk_samples(args)
    src = Path(args.input)
    if src.is_dir():
        files = sorted(f for f in src.iterdir() if f.suffix.lower() in AUDIO_EXTS and f.is_file())
        if not files:
            raise UsageError(f"error: no .wav or .flac files in {src}")
    elif src.exists():
        files = [src]
    else:
        raise UsageError(f"error: {src} does not exist")
    out_dir = Path(args.out)
    targets = [out_dir / (f.stem + ".wav") for f in files]
    check_outputs(targets, [src, *files], overwrite=args.overwrite)
    if len(set(targets)) < len(targets):
        raise UsageError(f"error: {src} holds files that differ only in extension; they would share a name")
    notes = set()
    for f in files:
        with contextlib.suppress(RuntimeError, sf.LibsndfileError):  # unreadable: read_blocks says so below
            notes.update(conversion_notes(sf.info(str(f))))
    for n in sorted(notes):
        print(f"[mbsnet] {n} (the enhanced files are 16 kHz mono)", file=sys.stderr)
    try:  # now, so an unwritable place fails before the model loads; removed again if the command fails
        make_folders(out_dir)
    except OSError as e:
        raise UsageError(f"error: cannot create --out {out_dir}: {e.strerror}") from None
    return _enhance_into(args, files, targets, out_dir, chunk, overlap)


def _enhance_into(args, files: list[Path], targets: list[Path], out_dir: Path, chunk: int, overlap: int):
    """run()'s work once --out exists: load the model, enhance each file; the written paths."""
    overrides = inference_overrides(args.pcs, args.keep_noisy, args.shifts)
    try:
        model, state = SYSTEM.load_model(
            args.run, resolve_device(args.device), runs_dir=args.runs_dir, **overrides
        )
    except UsageError:  # one line already
        raise
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"error: {e}") from None
    print(model_line(SYSTEM, state), file=sys.stderr)
    fn = model_fn(model)
    written, failed = [], []
    for f, dst in zip(files, targets):
        try:
            seconds = enhance_stream(fn, f, dst, chunk, overlap)
        except ValueError as e:  # one bad file of a folder: say so, go on with the others
            print(f"error: {f}: {e}", file=sys.stderr)
            failed.append(f)
            continue
        written.append(dst)
        print(f"{f} -> {dst} ({seconds:.1f} s)")
    if failed:
        raise UsageError(
            f"error: {len(failed)} of {len(files)} files could not be enhanced (above); "
            f"{len(written)} written to {out_dir}"
        )
    return written


class _CallableModule(types.ModuleType):
    """`mbsnet_speech.enhance` is this module and, called, `enhance_audio`."""

    def __call__(self, audio: Any, sample_rate: int, run: str | Path | None = None, **kwargs: Any) -> Any:
        return enhance_audio(audio, sample_rate, run, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("memfit run mbsnet-speech enhance", main))
