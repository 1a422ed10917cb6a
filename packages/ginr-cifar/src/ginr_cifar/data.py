"""CIFAR-10 images as one uint8 tensor in memory, coordinate grids, and deterministic batches.

Sources (``load_images``):
* ``--data`` holding torchvision's ``cifar-10-batches-py`` (or that folder itself): read with
  ``torchvision.datasets.CIFAR10`` (no download).
* ``--data`` an ImageFolder tree (``<class>/<n>.jpg``, e.g. ../shared/data/cifar10-jpg/train), or a folder
  with ``train/`` (and optionally ``test/``) trees. Every file is checked: 32x32, RGB, decodable.
* nothing: an embedded set generated offline from photographs that ship with matplotlib (32x32 crops of
  its sample photos at several scales); procedural textures if matplotlib is not installed.

The 50 000 CIFAR images take 150 MB as uint8, so the whole set lives in one tensor and a batch is an
index into it: fast, and a pure function of (seed, step, micro), which makes resume exact.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from memfit.train.cpu import cpu_count

from ginr_cifar.config import SPLITS, default_cache_dir  # noqa: F401 - data's names for them too

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".gif", ".tif", ".tiff", ".webp")
SPLIT_SEED = 1234  # the held-out split never depends on the training seed


@dataclass
class ImageSet:
    """images: uint8 (N, 3, H, W); source: where they came from (for logs)."""

    images: torch.Tensor
    source: str

    def __len__(self) -> int:
        return self.images.shape[0]


# ----------------------------------------------------------------------------------------------------
# Coordinates
# ----------------------------------------------------------------------------------------------------


def pixel_coords(size: int = 32, device: torch.device | str | None = None) -> torch.Tensor:
    """(size*size, 2) pixel-centre coordinates (y, x) in (-1, 1), raster order."""
    c = (torch.arange(size, dtype=torch.float32, device=device) + 0.5) / size * 2 - 1
    yy, xx = torch.meshgrid(c, c, indexing="ij")
    return torch.stack([yy, xx], dim=-1).view(-1, 2)


def image_to_pixels(images: torch.Tensor) -> torch.Tensor:
    """images (B, C, H, W) -> (B, H*W, C), raster order matching pixel_coords."""
    return images.flatten(2).transpose(1, 2)


def pixels_to_image(pixels: torch.Tensor, size: int = 32) -> torch.Tensor:
    """(B, H*W, C) -> (B, C, H, W)."""
    B, _, C = pixels.shape
    return pixels.transpose(1, 2).reshape(B, C, size, size)


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------


def _check_array(arr, what: str, size: int) -> None:
    if arr.ndim != 3 or arr.shape[2] != 3:
        ch = 1 if arr.ndim == 2 else arr.shape[2]
        raise ValueError(f"{what}: has {ch} channel(s); expected 3-channel RGB {size}x{size} images")
    if arr.shape[0] != size or arr.shape[1] != size:
        raise ValueError(
            f"{what}: image is {arr.shape[1]}x{arr.shape[0]} (WxH); expected {size}x{size}. "
            f"Resize the images to {size}x{size} first (CIFAR-10 images are 32x32 RGB)."
        )


def read_image(path: str | Path, size: int = 32) -> torch.Tensor:
    """One image file -> uint8 (3, size, size); ValueError naming the file if corrupt or not RGB."""
    import numpy as np
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
            mode = im.mode
            arr = np.asarray(im)
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError... for broken files
        raise ValueError(
            f"{path}: cannot decode image ({type(e).__name__}: {e}); remove or replace the file"
        ) from e
    if mode not in ("RGB",):
        bands = {"L": 1, "1": 1, "P": 1, "LA": 2, "RGBA": 4, "CMYK": 4, "I": 1, "F": 1, "I;16": 1}.get(
            mode, "?"
        )
        raise ValueError(
            f"{path}: image mode {mode} ({bands} channel(s)); expected 3-channel RGB {size}x{size} images. "
            "Convert it to RGB first."
        )
    _check_array(arr, str(path), size)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1)


LAYOUT = (
    "an ImageFolder tree (<class>/<image>), a folder of images, or the folder holding cifar-10-batches-py"
)


def data_folder(root: str | Path) -> Path:
    """--data as a folder: FileNotFoundError when it does not exist, ValueError when it is a file."""
    root = Path(root).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"--data {root} does not exist; give {LAYOUT}")
    if not root.is_dir():
        raise ValueError(f"--data {root} is a file, not a folder; give {LAYOUT}")
    return root


def list_image_files(root: str | Path) -> list[Path]:
    """Image files under root (recursively), sorted; FileNotFoundError if there are none."""
    root = data_folder(root)
    files = sorted(
        Path(dp) / f for dp, _, fs in os.walk(root) for f in fs if f.lower().endswith(IMAGE_EXTENSIONS)
    )
    if not files:
        raise FileNotFoundError(
            f"no images found under {root} (looked for {', '.join(IMAGE_EXTENSIONS)} in <class>/ sub-folders "
            "or directly). Point --data at an ImageFolder tree or at a folder holding cifar-10-batches-py."
        )
    return files


class _FileDataset(torch.utils.data.Dataset):
    """Decodes one file per item; errors come back as values so the main process raises them cleanly."""

    def __init__(self, files: list[Path], size: int):
        self.files, self.size = files, size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        try:
            return read_image(self.files[i], self.size), ""
        except ValueError as e:
            return torch.zeros(3, self.size, self.size, dtype=torch.uint8), str(e)


def _collate(items):
    return torch.stack([x for x, _ in items]), [e for _, e in items]


LARGE = 4000  # image sets from this size decode in DataLoader workers, and say so


def read_images(files: list[Path], size: int = 32, workers: int | None = None) -> torch.Tensor:
    """Decode files -> uint8 (N, 3, size, size); DataLoader workers decode in parallel for large sets, at
    most one per CPU this process may use (its affinity, not the machine's count: torch warns beyond it),
    with a progress bar on a terminal."""
    from tqdm import tqdm

    if workers is None:
        workers = min(4, cpu_count()) if len(files) >= LARGE else 0
    loader = torch.utils.data.DataLoader(
        _FileDataset(files, size), batch_size=500, num_workers=workers, collate_fn=_collate
    )
    out = []
    with tqdm(total=len(files), desc="[ginr] decoding images", unit="img", leave=False, disable=None) as bar:
        for imgs, errs in loader:
            bad = [e for e in errs if e]
            if bad:
                raise ValueError(bad[0])
            out.append(imgs)
            bar.update(len(imgs))
    return torch.cat(out)


def _cache_key(files: list[Path]) -> str:
    h = hashlib.sha1()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def load_image_files(files: list[Path], size: int = 32, cache_dir: str | Path | None = None) -> torch.Tensor:
    """Decode (or load from cache_dir, keyed by paths, sizes and mtimes) -> uint8 (N, 3, size, size). The
    first use of a cache folder in a process names it (once), and a large set says it is being decoded."""
    if cache_dir is None:
        return read_images(files, size)
    _name_cache(Path(cache_dir))
    path = Path(cache_dir) / f"images_{_cache_key(files)}.pt"
    if path.exists():
        try:
            images = torch.load(path, weights_only=True)
            if images.shape == (len(files), 3, size, size):
                return images
        except Exception:
            pass  # a stale or broken cache is rebuilt
    if len(files) >= LARGE:
        print(
            f"[ginr] decoding {len(files):,} images once; next time they load from the cache", file=sys.stderr
        )
    images = read_images(files, size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(images, tmp)
    os.replace(tmp, path)
    return images


_NAMED: set[Path] = set()


def _name_cache(folder: Path) -> None:
    """Say once per process where decoded images are kept (150 MB for CIFAR-10's 50,000)."""
    if folder not in _NAMED:
        _NAMED.add(folder)
        print(f"[ginr] decoded images are cached in {folder} (--cache_dir elsewhere, --no_cache: never)",
              file=sys.stderr)  # fmt: skip


def _find_cifar_batches(root: Path) -> Path | None:
    """The folder that holds cifar-10-batches-py, if root is it or contains it."""
    if root.name == "cifar-10-batches-py" and (root / "batches.meta").exists():
        return root.parent
    if (root / "cifar-10-batches-py").is_dir():
        return root
    return None


def _load_cifar_batches(root: Path, train: bool, size: int) -> torch.Tensor:
    from torchvision.datasets import CIFAR10

    try:
        ds = CIFAR10(str(root), train=train, download=False)
    except RuntimeError as e:
        raise ValueError(
            f"{root / 'cifar-10-batches-py'}: not a valid CIFAR-10 python batch folder ({e})"
        ) from e
    images = torch.from_numpy(ds.data)  # (N, 32, 32, 3) uint8
    _check_array(images[0].numpy(), str(root / "cifar-10-batches-py"), size)
    return images.permute(0, 3, 1, 2).contiguous()


def _split_files(root: Path, split: str, holdout: int) -> list[Path]:
    """Files of a split in an ImageFolder layout: root/train, root/test, or root itself is the train set.
    `holdout`: the images held out of train (what --split test's refusal offers instead)."""
    if split == "test":
        if (root / "test").is_dir():
            return list_image_files(root / "test")
        if holdout:
            held = f"{holdout} image{'' if holdout == 1 else 's'} held out of train"
            instead = f"; use --split holdout ({held})"
        else:
            instead = (
                ", and --holdout 0 held none of it out; use --split all, or a --data with a test/ folder"
            )
        raise FileNotFoundError(f"{root} has no test/ folder{instead}")
    if (root / "train").is_dir():
        return list_image_files(root / "train")
    return list_image_files(root)


def holdout_split(n: int, holdout: int, val: int = 0) -> tuple[torch.Tensor, ...]:
    """Deterministic (train_indices, holdout_indices) of range(n), independent of the training seed; with
    ``val`` > 0, (train, val, holdout): ``val`` validation images carved from the training part, so that
    choices made on validation (best.pt) never touch the holdout. The holdout is the same either way."""
    if not 0 <= holdout < n:
        raise ValueError(
            f"--holdout {holdout} keeps {holdout} images out of training, but the set has {n}; "
            f"give --holdout below {n} (0: none held out)"
        )
    if not 0 <= val < n - holdout:
        raise ValueError(
            f"{val} validation images leave no training images ({n} images, {holdout} held out); "
            "lower --eval_images or --holdout"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    train, ho = perm[: n - holdout], perm[n - holdout :].sort().values
    if not val:
        return train.sort().values, ho
    return train[: len(train) - val].sort().values, train[len(train) - val :].sort().values, ho


def _split_indices(n: int, split: str, holdout: int, val: int, max_images: int | None) -> torch.Tensor:
    parts = holdout_split(n, holdout, val)
    tr, ho = parts[0], parts[-1]
    if split == "holdout":
        return ho
    if split == "val":
        return parts[1] if val else tr[:0]
    return tr[:max_images]


def load_split(
    data: str | Path | None,
    split: str = "train",
    holdout: int = 500,
    max_images: int | None = None,
    size: int = 32,
    val: int = 0,
    cache_dir: str | Path | None = None,
) -> ImageSet:
    """Images of one split: "train" (minus the held-out and validation images), "val", "holdout", "test",
    or "all".

    The holdout is ``holdout`` images drawn from the training set with a fixed seed, never trained on;
    "val" is ``val`` further images carved from the rest (for validation during training), and "train"
    excludes both, so that validation choices never see the holdout.
    "test" is CIFAR-10's test batch or a folder's ``test/`` tree; "all" is every image under an image
    folder (any layout: an ImageFolder root, or plain files). ``max_images`` keeps the first images of
    the split (after the split, so the holdout is unchanged).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    if split == "all":
        if data is None or _find_cifar_batches(Path(data).expanduser()) is not None:
            raise ValueError("--split all takes an image folder; use --split test for CIFAR-10 batches")
        files = list_image_files(Path(data).expanduser())[:max_images]
        return ImageSet(load_image_files(files, size, cache_dir), f"image folder {data} ({len(files)} files)")
    if data is None:
        images, source = embedded_images(size).clone(), "embedded (matplotlib sample photos, 32x32 crops)"
        if split == "test":
            raise ValueError("the embedded default set has no test split; use --split holdout")
    else:
        root = data_folder(data)
        batches = _find_cifar_batches(root)
        if batches is not None:
            images = _load_cifar_batches(batches, train=split != "test", size=size)
            source = f"CIFAR-10 python batches in {batches}"
        else:
            files = _split_files(root, split, holdout)
            source = f"image folder {root} ({len(files)} files)"
            if split != "test":
                idx = _split_indices(len(files), split, holdout, val, max_images)
                return ImageSet(load_image_files([files[i] for i in idx.tolist()], size, cache_dir), source)
            images = load_image_files(files[:max_images], size, cache_dir)
    if split != "test":
        images = images[_split_indices(images.shape[0], split, holdout, val, max_images)]
    elif max_images is not None:
        images = images[:max_images]
    return ImageSet(images.contiguous(), source)


# ----------------------------------------------------------------------------------------------------
# The embedded default
# ----------------------------------------------------------------------------------------------------

EMBEDDED_COUNT = 2560


def _sample_photos():
    """PIL RGB photographs shipped with matplotlib (public-domain Grace Hopper portrait and others)."""
    from PIL import Image

    try:
        import matplotlib

        folder = Path(matplotlib.get_data_path()) / "sample_data"
    except ImportError:
        return []
    photos = []
    for name in ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png"):
        p = folder / name
        if p.exists():
            with Image.open(p) as im:
                photos.append(im.convert("RGB"))
    return photos


@functools.lru_cache(maxsize=2)
def embedded_images(size: int = 32, count: int = EMBEDDED_COUNT) -> torch.Tensor:
    """uint8 (count, 3, size, size): deterministic crops of bundled photos at 4 scales, with flips."""
    import numpy as np
    from PIL import Image

    photos = _sample_photos()
    if not photos:
        return procedural_textures(size, count)
    rng = np.random.default_rng(0)
    pyramid = []
    for im in photos:
        w, h = im.size
        for scale in (1.0, 0.5, 0.25, 0.125):
            sw, sh = int(w * scale), int(h * scale)
            if min(sw, sh) >= size:
                pyramid.append(np.asarray(im.resize((sw, sh), Image.BICUBIC)))
    out = np.empty((count, size, size, 3), dtype=np.uint8)
    for i in range(count):
        arr = pyramid[rng.integers(len(pyramid))]
        y = rng.integers(arr.shape[0] - size + 1)
        x = rng.integers(arr.shape[1] - size + 1)
        crop = arr[y : y + size, x : x + size]
        out[i] = crop[:, ::-1] if rng.random() < 0.5 else crop
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


def procedural_textures(size: int = 32, count: int = EMBEDDED_COUNT) -> torch.Tensor:
    """uint8 (count, 3, size, size): random coloured blobs and gratings (fallback without matplotlib)."""
    g = torch.Generator().manual_seed(0)
    c = pixel_coords(size).view(size, size, 2)
    imgs = torch.empty(count, 3, size, size)
    for i in range(count):
        img = torch.rand(3, 1, 1, generator=g).expand(3, size, size).clone()
        for _ in range(3):
            centre = torch.rand(2, generator=g) * 2 - 1
            radius = 0.1 + 0.5 * torch.rand(1, generator=g)
            blob = torch.exp(-((c - centre) ** 2).sum(-1) / radius**2)
            img = img * (1 - blob) + torch.rand(3, 1, 1, generator=g) * blob
        freq = torch.randn(2, generator=g) * 6
        img = img + 0.15 * torch.sin((c * freq).sum(-1) * torch.pi)
        imgs[i] = img.clamp(0, 1)
    return (imgs * 255).round().to(torch.uint8)


# ----------------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------------


def sample_batch(
    images: torch.Tensor,
    batch_size: int,
    num_coords: int,
    generator: torch.Generator,
    device: torch.device,
    jitter: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random images and pixels: (images (B, 3, H, W) float 0..1, coords (B, K, 2), rgb (B, K, 3)).

    ``images`` is uint8 (N, 3, H, W) on any device; all randomness comes from ``generator`` (CPU).
    ``jitter`` > 0 moves each sampled coordinate uniformly by up to ``jitter`` pixels (each axis) off its
    pixel centre and takes the bilinearly interpolated colour there as the target, so the decoder is
    trained between pixel centres too (what a finer decode queries), not only at them.
    """
    N, _, H, W = images.shape
    P = H * W
    if not 1 <= num_coords <= P:
        raise ValueError(f"num_sample_coords must be in [1, {P}], got {num_coords}")
    idx = torch.randint(N, (batch_size,), generator=generator)
    pix = torch.rand(batch_size, P, generator=generator).argsort(dim=1)[:, :num_coords]
    offset = (torch.rand(batch_size, num_coords, 2, generator=generator) * 2 - 1) * jitter if jitter else None
    imgs = images[idx.to(images.device)].to(device, non_blocking=True).float() / 255
    pix = pix.to(device)
    grid = pixel_coords(H, device=device)
    coords = grid[pix]
    if offset is None:
        target = image_to_pixels(imgs).gather(1, pix[..., None].expand(-1, -1, imgs.shape[1]))
        return imgs, coords, target
    coords = (coords + offset.to(device) * (2 / H)).clamp(-1, 1)
    return imgs, coords, sample_image(imgs, coords)


def sample_image(images: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """Bilinear colour of images (B, C, H, W) at coords (B, K, 2) (y, x) in [-1, 1] -> (B, K, C).

    Pixel centres return the pixel exactly; outside the outermost centres the border pixel is repeated.
    """
    g = coords.flip(-1)[:, :, None]  # grid_sample wants (x, y)
    out = torch.nn.functional.grid_sample(
        images, g, mode="bilinear", padding_mode="border", align_corners=False
    )
    return out[..., 0].transpose(1, 2)
