"""Data: loaders, clear errors on bad input, the embedded default, deterministic batches."""

from pathlib import Path

import numpy as np
import pytest
import torch
from ginr_cifar.data import (
    embedded_images,
    holdout_split,
    image_to_pixels,
    load_split,
    pixel_coords,
    sample_batch,
)
from PIL import Image

SHARED = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "cifar10-jpg"


def _write(path: Path, size=(32, 32), mode="RGB", seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr).convert(mode).save(path)
    return arr


def _folder(tmp_path: Path, n=6) -> Path:
    for i in range(n):
        _write(tmp_path / "data" / ("cat" if i % 2 else "dog") / f"{i}.png", seed=i)
    return tmp_path / "data"


def test_ginr_image_folder_roundtrip_and_split(tmp_path):
    root = _folder(tmp_path)
    train = load_split(root, "train", holdout=2)
    held = load_split(root, "holdout", holdout=2)
    assert train.images.shape == (4, 3, 32, 32) and train.images.dtype == torch.uint8
    assert held.images.shape == (2, 3, 32, 32)
    # every image appears in exactly one of the two splits, pixel-exact (PNG is lossless)
    files = sorted(root.rglob("*.png"))
    originals = {np.asarray(Image.open(f)).tobytes() for f in files}
    loaded = {im.permute(1, 2, 0).numpy().tobytes() for im in torch.cat([train.images, held.images])}
    assert loaded == originals
    tr, ho = holdout_split(6, 2)
    assert set(tr.tolist()).isdisjoint(ho.tolist()) and len(tr) + len(ho) == 6


def test_ginr_validation_is_carved_from_training_and_never_touches_the_holdout(tmp_path):
    root = _folder(tmp_path, n=10)
    tr, ho = holdout_split(10, 3)
    tr2, val, ho2 = holdout_split(10, 3, val=2)
    assert torch.equal(ho, ho2)  # the holdout is the same images with or without validation
    assert set(tr2.tolist()) | set(val.tolist()) == set(tr.tolist()) and len(val) == 2
    assert set(val.tolist()).isdisjoint(tr2.tolist())
    split = {"holdout": 3, "val": 2}
    parts = [load_split(root, s, **split).images for s in ("train", "val", "holdout")]
    assert [len(p) for p in parts] == [5, 2, 3]
    pixels = [{im.numpy().tobytes() for im in p} for p in parts]
    assert not (pixels[0] & pixels[1] or pixels[0] & pixels[2] or pixels[1] & pixels[2])
    assert torch.equal(parts[2], load_split(root, "holdout", holdout=3).images)
    with pytest.raises(ValueError, match="lower --eval_images or --holdout"):
        load_split(root, "train", holdout=3, val=7)


def test_ginr_cache_is_named_once_and_workers_fit_the_cpus_we_may_use(tmp_path, monkeypatch, capsys):
    """A cached folder's cache location is said once per process (a run caches its train and validation
    parts); DataLoader workers never outnumber the CPUs in this process's affinity (torch warned once per
    loader otherwise)."""
    import os
    import warnings

    from ginr_cifar import data

    root = _folder(tmp_path, n=6)
    monkeypatch.setattr(data, "_NAMED", set())
    cache = tmp_path / "cache"
    train = load_split(root, "train", holdout=2, val=1, cache_dir=cache)
    val = load_split(root, "val", holdout=2, val=1, cache_dir=cache)
    err = capsys.readouterr().err
    assert (
        err.count(f"[ginr] decoded images are cached in {cache}") == 1 and len(train) == 3 and len(val) == 1
    )
    assert sorted(p.suffix for p in cache.iterdir()) == [".pt", ".pt"]
    monkeypatch.setattr(data, "LARGE", 2)  # decode these few files in workers, as a 50,000-image folder
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})  # one CPU allowed, whatever the machine has
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's "This DataLoader will create N worker processes"
            images = data.read_images(sorted(root.rglob("*.png")))
    finally:
        os.sched_setaffinity(0, mine)
    assert images.shape == (6, 3, 32, 32)


def test_ginr_wrong_size_is_rejected(tmp_path):
    root = _folder(tmp_path)
    _write(root / "cat" / "big.png", size=(40, 32))
    with pytest.raises(ValueError, match=r"big\.png.*40x32.*expected 32x32"):
        load_split(root, "train", holdout=0)


@pytest.mark.parametrize("mode", ["L", "RGBA"])
def test_ginr_wrong_channels_is_rejected(tmp_path, mode):
    root = _folder(tmp_path)
    _write(root / "cat" / "odd.png", mode=mode)
    with pytest.raises(ValueError, match=rf"odd\.png.*mode {mode}.*RGB"):
        load_split(root, "train", holdout=0)


def test_ginr_corrupt_image_is_rejected(tmp_path):
    root = _folder(tmp_path)
    (root / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    with pytest.raises(ValueError, match=r"broken\.jpg: cannot decode"):
        load_split(root, "train", holdout=0)


def test_ginr_empty_or_missing_folder_is_rejected(tmp_path):
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no images found"):
        load_split(tmp_path / "empty", "train", holdout=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_split(tmp_path / "nowhere", "train")
    root = _folder(tmp_path)
    with pytest.raises(ValueError, match="holdout"):
        load_split(root, "train", holdout=6)


def test_ginr_fake_cifar_batches_give_a_clear_error(tmp_path):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    (d / "batches.meta").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="not a valid CIFAR-10 python batch folder"):
        load_split(tmp_path, "train")


def test_ginr_embedded_default_is_real_image_patches():
    imgs = embedded_images(count=64)
    assert imgs.shape == (64, 3, 32, 32) and imgs.dtype == torch.uint8
    x = imgs.float() / 255
    # natural-image statistics: varied content, neighbouring pixels strongly correlated (not noise)
    assert x.std(dim=(1, 2, 3)).mean() > 0.03
    a, b = x[..., :, :-1].flatten(), x[..., :, 1:].flatten()
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.8
    assert torch.equal(imgs, embedded_images(count=64))  # deterministic


def test_ginr_sample_batch_is_deterministic_and_consistent():
    images = embedded_images(count=32)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a = sample_batch(images, 4, 100, g1, torch.device("cpu"))
    b = sample_batch(images, 4, 100, g2, torch.device("cpu"))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    imgs, coords, rgb = a
    assert coords.shape == (4, 100, 2) and rgb.shape == (4, 100, 3)
    assert coords.abs().max() < 1
    # each target is the image's pixel at that coordinate
    grid = pixel_coords(32)
    pix = (coords[..., None, :] == grid).all(-1).float().argmax(-1)
    torch.testing.assert_close(rgb, image_to_pixels(imgs).gather(1, pix[..., None].expand(-1, -1, 3)))
    with pytest.raises(ValueError, match="num_sample_coords"):
        sample_batch(images, 2, 2000, g1, torch.device("cpu"))


def test_ginr_shared_cifar_folder_loads():
    if not SHARED.exists():
        pytest.skip(f"shared CIFAR-10 JPEGs not found at {SHARED}")
    held = load_split(SHARED / "train", "holdout", holdout=500)
    assert held.images.shape == (500, 3, 32, 32)
    sub = load_split(SHARED / "train", "train", holdout=500, max_images=50)
    assert sub.images.shape == (50, 3, 32, 32)
