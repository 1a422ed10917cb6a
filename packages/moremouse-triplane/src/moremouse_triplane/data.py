"""Multi-view scenes: procedurally generated mice (no download), or a folder of real renders.

Synthetic scenes: a mouse-like shape built from ellipsoids (body, belly, head, nose, ears, eyes, a curled
tail of spheres) with a random yaw, offset, size, head turn and colours. It is analytic twice over: a
density/colour field (for the volume renderer) and exact ray-ellipsoid intersection, which renders the
ground truth (2 x 2 supersampled) about a hundred times faster than marching 96 samples per ray.
Everything is a function of
(seed, split, index), so a scene never depends on what was generated before it.

Folder layout (`--data PATH`)::

    PATH/scene_000/cameras.json
    PATH/scene_000/000.png  001.png ...
    PATH/scene_001/...

cameras.json: {"input": "000.png",                      (optional; default: the first frame)
               "frames": [{"file": "000.png",
                           "intrinsics": [[fx, 0, cx], [0, fy, cy], [0, 0, 1]],     (pixels)
                           "cam_to_world": [[...], [...], [...], [0, 0, 0, 1]]},   (OpenCV: x right,
                          ...]}                                                       y down, z forward)
Images are square RGB or RGBA (composited on white), image_size x image_size, the object inside
[-1, 1]^3 (world up +z). `memfit run moremouse-triplane make-data OUT` writes synthetic scenes in it
(OUT new or empty, or --overwrite to replace the scenes make-data wrote there before: those listed in
its hidden record OUT/.make-data.json; nothing else in OUT is ever removed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from memfit.errors import UsageError
from memfit.train.outputs import output_dir, pid_alive, remove_stale_temps
from PIL import Image

from moremouse_triplane.config import SPLIT_IDS
from moremouse_triplane.flags import make_data_args
from moremouse_triplane.render import intrinsics, look_at, orbit_eye, pixel_rays

# Camera rig of the synthetic scenes: one fixed input camera, target cameras anywhere on the orbit.
RADIUS = 2.3
FOV_DEG = 40.0
INPUT_VIEW = (45.0, 25.0)  # azimuth, elevation in degrees
EVAL_VIEWS = ((135.0, 20.0), (225.0, 35.0), (315.0, 10.0), (90.0, 55.0))  # held-out views, never the input


def _scene_seed(seed: int, split: str, index: int) -> int:
    if split not in SPLIT_IDS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLIT_IDS)}")
    return ((seed * 1_000_003 + index) * 8 + SPLIT_IDS[split]) % (2**63 - 1)


def _rot_z(angle: torch.Tensor) -> torch.Tensor:
    c, s = torch.cos(angle), torch.sin(angle)
    z, o = torch.zeros_like(c), torch.ones_like(c)
    return torch.stack([torch.stack([c, -s, z]), torch.stack([s, c, z]), torch.stack([z, z, o])])


def _hsv(h: float, s: float, v: float) -> list[float]:
    i = int(h * 6) % 6
    f = h * 6 - int(h * 6)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    return [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]


class MouseField:
    """One mouse as a union of ellipsoids: an analytic density/colour field and an exact ray caster.

    Colours are Lambert-shaded under a fixed world light, so they do not depend on the viewing
    direction and every view of a scene is consistent (what a radiance field can represent).
    """

    SIGMA_MAX = 60.0
    EDGE = 0.004  # width of the soft surface of the density field, in world units
    LIGHT = (0.4, 0.3, 0.87)  # direction towards the light (world, normalised below)

    def __init__(self, g: torch.Generator) -> None:
        def u(lo: float, hi: float) -> float:
            return lo + (hi - lo) * float(torch.rand((), generator=g))

        fur = _hsv(u(0, 1), u(0.1, 0.7), u(0.35, 0.95))
        skin = _hsv(u(0.9, 1.05) % 1.0, u(0.3, 0.6), u(0.75, 1.0))
        belly = [min(1.0, c * 1.25 + 0.1) for c in fur]
        s = u(0.85, 1.05)
        head_yaw = u(-0.5, 0.5)
        # (centre, radii, colour) in the mouse's frame: facing +x, up +z
        parts: list[tuple[list[float], list[float], list[float]]] = [
            ([-0.05, 0.0, -0.15], [0.45 * u(0.9, 1.1), 0.28 * u(0.85, 1.1), 0.25 * u(0.85, 1.1)], fur),
            ([0.0, 0.0, -0.28], [0.35, 0.2, 0.1], belly),
        ]
        hc = [0.45, 0.12 * math.sin(head_yaw), -0.05 + u(-0.05, 0.08)]
        fwd = [math.cos(head_yaw), math.sin(head_yaw)]
        side = [-fwd[1], fwd[0]]
        parts.append((hc, [0.21, 0.17, 0.16], fur))
        parts.append(([hc[0] + 0.2 * fwd[0], hc[1] + 0.2 * fwd[1], hc[2] - 0.03], [0.05, 0.05, 0.05], skin))
        for sgn in (-1.0, 1.0):
            ear = [
                hc[0] - 0.03 * fwd[0] + sgn * 0.14 * side[0],
                hc[1] - 0.03 * fwd[1] + sgn * 0.14 * side[1],
                hc[2] + 0.17,
            ]
            parts.append((ear, [0.05, 0.1, 0.1], skin))
            eye = [
                hc[0] + 0.15 * fwd[0] + sgn * 0.08 * side[0],
                hc[1] + 0.15 * fwd[1] + sgn * 0.08 * side[1],
                hc[2] + 0.04,
            ]
            parts.append((eye, [0.035, 0.035, 0.035], [0.05, 0.05, 0.05]))
        curl = u(-1.2, 1.2)
        for i in range(8):
            t = i / 7
            tail = [
                -0.48 - 0.45 * t,
                0.35 * math.sin(curl * t * math.pi / 2),
                -0.3 + 0.1 * math.sin(t * math.pi),
            ]
            r = 0.045 - 0.015 * t
            parts.append((tail, [r, r, r], skin))
        self.radii = torch.tensor([p[1] for p in parts]) * s  # (K, 3)
        self.colors = torch.tensor([p[2] for p in parts]).clamp(0, 1)  # (K, 3)
        # world = rot @ mouse + offset; parts are axis-aligned in the mouse frame
        self.rot = _rot_z(torch.tensor(u(0, 2 * math.pi)))
        self.offset = torch.tensor([u(-0.1, 0.1), u(-0.1, 0.1), u(-0.05, 0.1)])
        self.centres = torch.tensor([p[0] for p in parts]) * s  # (K, 3), mouse frame
        self.light = torch.nn.functional.normalize(torch.tensor(self.LIGHT), dim=0)

    def _shade(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Albedo x Lambert at unit-sphere coordinates q (..., 3) of part k (...) -> rgb (..., 3)."""
        n = torch.nn.functional.normalize((q / self.radii[k]) @ self.rot.T, dim=-1)  # ellipsoid normal, world
        lambert = (n @ self.light).clamp(min=0.0)
        return self.colors[k] * (0.35 + 0.65 * lambert[..., None])

    def __call__(self, pts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Density field: pts (B, P, 3) -> sigma (B, P), rgb (B, P, 3) (for the volume renderer)."""
        p = (pts - self.offset) @ self.rot  # into the mouse frame
        q = (p[..., None, :] - self.centres) / self.radii  # (B, P, K, 3)
        # shifted inwards by 2 edge widths: grazing rays through the soft shell must not fatten the shape
        occ = torch.sigmoid((1.0 - q.norm(dim=-1)) * self.radii.amin(-1) / self.EDGE - 2.0)
        k = occ.argmax(dim=-1)
        qk = torch.gather(q, -2, k[..., None, None].expand(*k.shape, 1, 3))[..., 0, :]
        return occ.amax(dim=-1) * self.SIGMA_MAX, self._shade(qk, k)

    def cast(self, rays_o: torch.Tensor, rays_d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact first hit of rays (..., 3) with the ellipsoids -> rgb on white (..., 3), hit mask (...).

        Ray o + t d meets ellipsoid k where a t^2 + b t + c = 0 with a = |d / r_k|^2,
        b = 2 (o - c_k) / r_k . d / r_k, c = |(o - c_k) / r_k|^2 - 1: each term is a sum over the three
        axes, i.e. a (rays, 3) @ (3, parts) product, so no (rays, parts, 3) tensor is ever built (in
        float64: expanding |o - c_k|^2 cancels digits that float32 does not have).
        """
        o = (rays_o - self.offset) @ self.rot
        d = rays_d @ self.rot
        o64, d64 = o.double(), d.double()
        w = self.radii.T.double().reciprocal().square()  # (3, K): 1 / r^2
        wc = self.centres.T.double() * w  # (3, K): c / r^2
        a = (d64 * d64) @ w
        b = 2.0 * ((o64 * d64) @ w - d64 @ wc)
        c = (o64 * o64) @ w - 2.0 * (o64 @ wc) + (self.centres.T.double() * wc).sum(0) - 1.0
        disc = b * b - 4 * a * c
        t = ((-b - disc.clamp(min=0).sqrt()) / (2 * a)).to(o.dtype)
        t = torch.where((disc >= 0) & (t > 0), t, torch.full_like(t, float("inf")))
        t_hit, k = t.min(dim=-1)
        hit = torch.isfinite(t_hit)
        t_hit = torch.where(hit, t_hit, torch.zeros_like(t_hit))
        q = (o + t_hit[..., None] * d - self.centres[k]) / self.radii[k]  # the hit on part k's unit sphere
        rgb = torch.where(hit[..., None], self._shade(q, k), torch.ones_like(q))
        return rgb, hit


# 2 x 2 supersampling of ground-truth pixels: anti-aliased edges, as a volume renderer produces
_SUBPIXEL = torch.tensor([[-0.25, -0.25], [0.25, -0.25], [-0.25, 0.25], [0.25, 0.25]])


def _cast_pixels(field: MouseField, K: torch.Tensor, c2w: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """Ground truth at pixel centres (..., P, 2) -> rgb (..., P, 3), averaged over 4 sub-pixel rays."""
    sub = pixels[..., None, :] + _SUBPIXEL  # (..., P, 4, 2)
    o, d = pixel_rays(K, c2w, sub.flatten(-3, -2))
    rgb, _ = field.cast(o, d)
    return rgb.unflatten(-2, (pixels.shape[-2], 4)).mean(-2)


class SyntheticScenes:
    """Endless generated mice for a split; scene(index) is deterministic in (seed, split, index)."""

    def __init__(self, image_size: int, seed: int = 0, split: str = "train") -> None:
        _scene_seed(seed, split, 0)  # validates the split
        self.image_size, self.seed, self.split = image_size, seed, split
        self.K = intrinsics(FOV_DEG, image_size, image_size)
        self.input_c2w = look_at(orbit_eye(*INPUT_VIEW, RADIUS))
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return 2**31

    def field(self, index: int) -> MouseField:
        g = torch.Generator().manual_seed(_scene_seed(self.seed, self.split, index))
        return MouseField(g)

    def render(self, index: int, K: torch.Tensor, c2w: torch.Tensor) -> torch.Tensor:
        """Ground-truth image (3, H, W) of scene `index` from camera (K, c2w)."""
        S = self.image_size
        ys, xs = torch.meshgrid(torch.arange(S) + 0.5, torch.arange(S) + 0.5, indexing="ij")
        rgb = _cast_pixels(self.field(index), K, c2w, torch.stack([xs, ys], -1).reshape(-1, 2))
        return rgb.T.reshape(3, S, S)

    def input_image(self, index: int) -> torch.Tensor:
        if index not in self._cache:
            self._cache[index] = self.render(index, self.K, self.input_c2w)
            if len(self._cache) > 4096:
                self._cache.popitem(last=False)
        return self._cache[index]

    def train_batch(
        self, indices: list[int], n_rays: int, num_targets: int, g: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """Input images and n_rays random target rays per scene (input view + num_targets random views)."""
        H = self.image_size
        images, os_, ds, rgbs = [], [], [], []
        for idx in indices:
            az = torch.rand(num_targets, generator=g) * 360
            el = 5 + torch.rand(num_targets, generator=g) * 45
            c2ws = torch.stack(
                [self.input_c2w] + [look_at(orbit_eye(float(a), float(e), RADIUS)) for a, e in zip(az, el)]
            )
            cam = torch.randint(0, num_targets + 1, (n_rays,), generator=g)
            pix = torch.randint(0, H, (n_rays, 2), generator=g).float() + 0.5
            o, d = pixel_rays(self.K, c2ws[cam], pix[:, None, :])
            images.append(self.input_image(idx))
            os_.append(o[:, 0])
            ds.append(d[:, 0])
            rgbs.append(_cast_pixels(self.field(idx), self.K, c2ws[cam], pix[:, None, :])[:, 0])
        return {
            "images": torch.stack(images),
            "rays_o": torch.stack(os_),
            "rays_d": torch.stack(ds),
            "rgb": torch.stack(rgbs),
            "input_K": self.K.expand(len(indices), 3, 3),
            "input_c2w": self.input_c2w.expand(len(indices), 4, 4),
        }

    def eval_scene(self, index: int) -> dict[str, torch.Tensor]:
        """Input image (3, H, W) and held-out views: K (V, 3, 3), c2w (V, 4, 4), images (V, 3, H, W)."""
        c2w = torch.stack([look_at(orbit_eye(a, e, RADIUS)) for a, e in EVAL_VIEWS])
        K = self.K.expand(len(EVAL_VIEWS), 3, 3)
        images = torch.stack([self.render(index, K[i], c2w[i]) for i in range(len(EVAL_VIEWS))])
        return {
            "input": self.input_image(index),
            "input_K": self.K,
            "input_c2w": self.input_c2w,
            "K": K,
            "c2w": c2w,
            "images": images,
        }


# ----------------------------------------------------------------------------------------------------
# A folder of real renders
# ----------------------------------------------------------------------------------------------------


def _matrix(value: Any, shape: tuple[int, int], path: Path, where: str) -> torch.Tensor:
    try:
        m = torch.tensor(value, dtype=torch.float32)
    except (TypeError, ValueError):
        raise ValueError(
            f"{path}: {where} must be a {shape[0]}x{shape[1]} list of numbers, got {value!r}"
        ) from None
    if tuple(m.shape) != shape:
        raise ValueError(f"{path}: {where} must be {shape[0]}x{shape[1]}, got shape {tuple(m.shape)}")
    if not torch.isfinite(m).all():
        raise ValueError(f"{path}: {where} contains NaN or inf; fix the camera export")
    return m


def load_image(path: Path, image_size: int) -> torch.Tensor:
    """A square RGB(A) image file -> (3, S, S) in [0, 1], alpha composited on white; checks the size."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: image listed in cameras.json does not exist")
    try:
        img = Image.open(path)
        img.load()
    except OSError as e:
        raise ValueError(f"{path}: not a readable image ({e})") from None
    w, h = img.size
    if w != h:
        raise ValueError(f"{path}: image is {w}x{h}; images must be square ({image_size}x{image_size})")
    if w != image_size:
        raise ValueError(
            f"{path}: image is {w}x{h}, expected {image_size}x{image_size} (the model's image_size)"
        )
    arr = np.asarray(img.convert("RGBA"), dtype=np.float32) / 255.0
    rgb, a = arr[..., :3], arr[..., 3:]
    return torch.from_numpy(rgb * a + (1.0 - a)).permute(2, 0, 1).contiguous()


class FolderScenes:
    """Scenes from a folder of renders (layout in the module docstring), all validated on load."""

    def __init__(self, root: str | Path, image_size: int) -> None:
        root = Path(root).expanduser()
        layout = f"expected scene folders inside: {root / 'scene_000' / 'cameras.json'}, 000.png, ..."
        if not root.exists():
            raise FileNotFoundError(f"--data {root}: no such folder ({layout})")
        if not root.is_dir():
            raise FileNotFoundError(f"--data {root} is a file, not a folder ({layout})")
        dirs = sorted(p.parent for p in root.glob("*/cameras.json"))
        if not dirs:
            raise FileNotFoundError(
                f"--data {root}: no scene folders with a cameras.json "
                f"(expected {root}/scene_000/cameras.json)"
            )
        self.image_size = image_size
        self.scenes = [self._load(d) for d in dirs]

    def _load(self, d: Path) -> dict[str, torch.Tensor]:
        path = d / "cameras.json"
        try:
            meta = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError(f"{path}: JSON nested too deeply to be cameras") from None
        frames = meta.get("frames") if isinstance(meta, dict) else None
        if not isinstance(frames, list) or not frames:
            raise ValueError(
                f"{path}: missing field 'frames' (a non-empty list of {{file, intrinsics, cam_to_world}})"
            )
        files, Ks, c2ws, images = [], [], [], []
        for i, fr in enumerate(frames):
            for key in ("file", "intrinsics", "cam_to_world"):
                if not isinstance(fr, dict) or key not in fr:
                    raise ValueError(f"{path}: frames[{i}] is missing field '{key}'")
            Ks.append(_matrix(fr["intrinsics"], (3, 3), path, f"frames[{i}].intrinsics"))
            c2w = _matrix(fr["cam_to_world"], (4, 4), path, f"frames[{i}].cam_to_world")
            if not torch.allclose(c2w[3], torch.tensor([0.0, 0.0, 0.0, 1.0])):
                raise ValueError(f"{path}: frames[{i}].cam_to_world last row must be [0, 0, 0, 1]")
            c2ws.append(c2w)
            images.append(load_image(d / fr["file"], self.image_size))
            files.append(fr["file"])
        inp = meta.get("input", files[0])
        if inp not in files:
            raise ValueError(f"{path}: field 'input' = {inp!r} is not one of the frames' files")
        return {
            "input": files.index(inp),
            "K": torch.stack(Ks),
            "c2w": torch.stack(c2ws),
            "images": torch.stack(images),
        }

    def __len__(self) -> int:
        return len(self.scenes)

    def split(self, count: int, seed: int = 0) -> tuple[FolderScenes, FolderScenes]:
        """(training scenes, `count` held-out scenes chosen by a fixed seed; at most a quarter of them)."""
        count = min(count, len(self) // 4)
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed)).tolist()
        parts = []
        for keep in (sorted(perm[count:]), sorted(perm[:count])):
            part = object.__new__(FolderScenes)
            part.image_size, part.scenes = self.image_size, [self.scenes[i] for i in keep]
            parts.append(part)
        return parts[0], parts[1]

    def input_image(self, index: int) -> torch.Tensor:
        s = self.scenes[index % len(self)]
        return s["images"][s["input"]]

    def train_batch(
        self, indices: list[int], n_rays: int, num_targets: int, g: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """Input images and n_rays random pixels per scene drawn from all of its frames."""
        H = self.image_size
        keys = ("images", "rays_o", "rays_d", "rgb", "input_K", "input_c2w")
        out: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for idx in indices:
            s = self.scenes[idx % len(self)]
            cam = torch.randint(0, len(s["K"]), (n_rays,), generator=g)
            xy = torch.randint(0, H, (n_rays, 2), generator=g)
            o, d = pixel_rays(s["K"][cam], s["c2w"][cam], xy[:, None, :].float() + 0.5)
            out["images"].append(s["images"][s["input"]])
            out["input_K"].append(s["K"][s["input"]])
            out["input_c2w"].append(s["c2w"][s["input"]])
            out["rays_o"].append(o[:, 0])
            out["rays_d"].append(d[:, 0])
            out["rgb"].append(s["images"][cam, :, xy[:, 1], xy[:, 0]])
        return {k: torch.stack(v) for k, v in out.items()}

    def eval_scene(self, index: int) -> dict[str, torch.Tensor]:
        """Input image and every other frame as a held-out view."""
        s = self.scenes[index % len(self)]
        keep = [i for i in range(len(s["K"])) if i != s["input"]]
        return {
            "input": self.input_image(index),
            "input_K": s["K"][s["input"]],
            "input_c2w": s["c2w"][s["input"]],
            "K": s["K"][keep],
            "c2w": s["c2w"][keep],
            "images": s["images"][keep],
        }


def make_source(
    data: str | None, image_size: int, seed: int = 0, split: str = "train"
) -> SyntheticScenes | FolderScenes:
    """`--data` value -> scenes: None or 'synthetic' for generated mice, else a folder of renders."""
    if data in (None, "", "synthetic"):
        return SyntheticScenes(image_size, seed=seed, split=split)
    return FolderScenes(data, image_size)


# ----------------------------------------------------------------------------------------------------
# Export generated scenes in the folder layout
# ----------------------------------------------------------------------------------------------------


def save_image(img: torch.Tensor, path: Path) -> None:
    """(3, H, W) in [0, 1] -> PNG."""
    arr = (img.clamp(0, 1).permute(1, 2, 0).numpy() * 255 + 0.5).astype(np.uint8)
    Image.fromarray(arr).save(path)


def export_scenes(
    out: str | Path, num_scenes: int, image_size: int, seed: int = 0, split: str = "train"
) -> Path:
    """Write num_scenes synthetic scenes (input view + the held-out views) in the folder layout."""
    out = Path(out)
    src = SyntheticScenes(image_size, seed=seed, split=split)
    for i in range(num_scenes):
        d = out / f"scene_{i:03d}"
        d.mkdir(parents=True, exist_ok=True)
        ev = src.eval_scene(i)
        K = torch.cat([src.K[None], ev["K"]])
        c2w = torch.cat([src.input_c2w[None], ev["c2w"]])
        imgs = torch.cat([ev["input"][None], ev["images"]])
        frames = []
        for v in range(len(imgs)):
            save_image(imgs[v], d / f"{v:03d}.png")
            frames.append(
                {"file": f"{v:03d}.png", "intrinsics": K[v].tolist(), "cam_to_world": c2w[v].tolist()}
            )
        (d / "cameras.json").write_text(json.dumps({"input": "000.png", "frames": frames}, indent=1))
    return out


def export_main(argv: list[str] | None = None) -> None:
    """`make-data` with these flags (None: sys.argv[1:]; moremouse_triplane.flags.make_data_args)."""
    make_data(make_data_args(argv))


# What export_scenes writes in a scene folder; a scene folder holding anything else is not all make-data's.
MADE_FILES = re.compile(r"^(cameras\.json|\d{3}\.png)$")
SCENE_NAME = re.compile(r"^scene_\d{3,}$")
# Inside OUT, make-data's hidden folders: .make-data.tmpPID holds the new scenes until they are moved into
# place, .make-data.oldPID the old ones an --overwrite moved aside until the new ones are all in.
TEMP_DIR = re.compile(r"^\.make-data\.(?P<kind>tmp|old)(?P<pid>\d+)$")
# make-data's record in OUT: {"scenes": the scene folders it wrote there, "seed", "image_size", "split"},
# and while an --overwrite swaps them, "swap": {"pid", "new": names moving in, "old": names moved aside}.
# --overwrite removes only folders on this list; a folder without it is never removed from.
MARKER = ".make-data.json"


def _bad_marker(path: Path, why: str) -> UsageError:
    return UsageError(
        f"error: {path} is not make-data's record of its scenes ({why}); remove it, or choose another OUT"
    )


def _read_marker(out: Path) -> dict[str, Any] | None:
    """OUT's record of the scenes make-data wrote there (MARKER), checked; None where there is none."""
    path = out / MARKER
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_file():
        raise _bad_marker(path, "a link or a folder")
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _bad_marker(path, f"unreadable: {e}") from None

    def names(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(n, str) and SCENE_NAME.match(n) for n in v)

    if not isinstance(m, dict) or not names(m.get("scenes")):
        raise _bad_marker(path, "no list of scene_NNN folders")
    swap = m.get("swap")
    if swap is not None and not (
        isinstance(swap, dict)
        and type(swap.get("pid")) is int
        and names(swap.get("new"))
        and names(swap.get("old"))
    ):
        raise _bad_marker(path, "a broken 'swap'")
    return m


def _write_marker(out: Path, marker: dict[str, Any]) -> None:
    tmp = out / f"{MARKER}.tmp{os.getpid()}"  # .make-data.json.tmpPID: the record is replaced whole
    tmp.write_text(json.dumps(marker, indent=1) + "\n")
    tmp.replace(out / MARKER)


def _foreign(d: Path) -> str | None:
    """The first entry of scene folder d that make-data does not write (a link, a folder, another file)."""
    for f in sorted(d.iterdir()):
        if f.is_symlink() or not f.is_file() or not MADE_FILES.match(f.name):
            return f.name
    return None


def _is_made_scene(d: Path) -> bool:
    """Whether d is a real folder (no link) named scene_NNN that holds only what export_scenes writes."""
    return SCENE_NAME.match(d.name) is not None and not d.is_symlink() and d.is_dir() and _foreign(d) is None


def _remove_scene(d: Path) -> None:
    """Remove a scene folder that _is_made_scene: its files (never followed: none is a link), then it."""
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def _roll_back(out: Path, marker: dict[str, Any]) -> int:
    """Undo an --overwrite's swap recorded in OUT's marker: the new scenes that got in go, the old ones
    come back from .make-data.oldPID, and the marker lists the old ones again. Returns how many came back.

    The old scenes all go aside before any new one comes in, so a name in OUT is a new scene where its old
    one is aside, or where it had no old one (a name taken by anything else was refused before the swap)."""
    swap = marker["swap"]
    aside = out / f".make-data.old{swap['pid']}"
    back = sorted(p.name for p in aside.iterdir()) if aside.is_dir() and not aside.is_symlink() else []
    for name in swap["new"]:
        d = out / name
        if (name in back or name not in swap["old"]) and _is_made_scene(d):
            _remove_scene(d)
    for name in back:
        (aside / name).rename(out / name)
    _write_marker(out, {k: v for k, v in marker.items() if k != "swap"})
    return len(back)


def _clean_up(out: Path, pid: int) -> int:
    """Finish what make-data `pid` (this one failing, or one that was killed) left in OUT: a swap half
    done is rolled back; its hidden folders go. Returns how many old scenes were put back."""
    marker = _read_marker(out)
    restored = 0
    if marker is not None and marker.get("swap", {}).get("pid") == pid:
        restored = _roll_back(out, marker)
    for kind in ("old", "tmp"):  # what is left aside once the new scenes are in, and unfinished new ones
        d = out / f".make-data.{kind}{pid}"
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d)
    (out / f"{MARKER}.tmp{pid}").unlink(missing_ok=True)
    return restored


def _clean_up_killed(out: Path) -> None:
    """Before OUT is looked at: what a killed make-data left there (its pid gone), said in one line each."""
    marker = _read_marker(out)
    swap = marker.get("swap") if marker else None
    if swap:  # (one of this pid is an earlier process's: this one has not begun yet)
        if swap["pid"] != os.getpid() and pid_alive(swap["pid"]):
            raise UsageError(
                f"error: make-data (pid {swap['pid']}) is replacing the scenes of {out}; wait for it to "
                "finish, or choose another OUT"
            )
        n = _clean_up(out, swap["pid"])
        print(
            f"[memfit] undid the make-data --overwrite (pid {swap['pid']}) killed while it replaced the "
            f"scenes of {out}: its new scenes removed, the {n} old one{'' if n == 1 else 's'} put back",
            file=sys.stderr,
        )
    for p in sorted(out.iterdir()):
        m = TEMP_DIR.match(p.name)
        dead = m is not None and (int(m["pid"]) == os.getpid() or not pid_alive(int(m["pid"])))
        if dead and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
            print(f"[memfit] removed {p}, left by a make-data that was killed", file=sys.stderr)
    remove_stale_temps(out, "a make-data that was killed")  # .make-data.json.tmpPID


def make_data(args: argparse.Namespace) -> None:
    """`make-data`'s work: write the scenes its flags ask for, and say where.

    OUT must be new or empty unless --overwrite (memfit.train.outputs.output_dir). make-data removes only
    what it can tell it wrote: the scene folders listed in OUT's MARKER that are still real folders holding
    only its files. A name a new scene needs, taken by anything else, is refused before any work; other
    files and folders in OUT stay (an OUT without the marker: real renders, or an older make-data's scenes,
    loses nothing). The new scenes are written into a hidden folder inside OUT; then the old ones are moved
    aside, the new ones in, the marker updated, and only then the old ones removed: a failure (Ctrl-C
    included) before that puts the old scenes back, so OUT holds the old scenes or the new ones, never a
    mix. What a killed make-data left is cleaned up by the next one. The folders this command created go
    again on a failure (memfit.errors.make_folders)."""
    out = Path(args.out)
    if out.is_dir():
        _clean_up_killed(out)
    alone = out.is_dir() and all(p.name == MARKER for p in out.iterdir())  # a record of no scene: empty
    output_dir(out, overwrite=args.overwrite or alone, flag="OUT")  # created, and removed if this fails
    recorded = _read_marker(out)
    marker = recorded or {"scenes": []}
    old = []  # the listed scenes that are make-data's still: these are replaced
    for name in marker["scenes"]:
        d = out / name
        if d.is_symlink() or not d.is_dir():
            continue  # gone, or not a folder make-data wrote any more: not removed (refused if in the way)
        if (f := _foreign(d)) is not None:
            raise UsageError(
                f"error: --overwrite: {d} holds {f!r}, which make-data does not write (renders of your "
                "own?); move that scene out of OUT, or choose another OUT"
            )
        old.append(name)
    new = [f"scene_{i:03d}" for i in range(args.num_scenes)]
    for name in new:
        if os.path.lexists(taken := out / name) and name not in old:
            if recorded is None:
                why = f"no {MARKER} in OUT lists the scenes make-data wrote there (renders of your own?)"
            elif name not in recorded["scenes"]:
                why = f"it is not on the list of scenes make-data wrote there ({out / MARKER})"
            else:
                why = "make-data wrote a folder there, but this is a link or a file"
            raise UsageError(
                f"error: --overwrite: {taken} is in the way of a new scene and is not make-data's to remove: "
                f"{why}; move it out of OUT, or choose another OUT"
            )
    pid = os.getpid()
    tmp, aside = out / f".make-data.tmp{pid}", out / f".make-data.old{pid}"
    try:
        export_scenes(tmp, args.num_scenes, args.image_size, args.seed, args.split)
        _write_marker(out, {**marker, "swap": {"pid": pid, "new": new, "old": old}})  # how to roll back
        if old:
            aside.mkdir()
        for name in old:
            (out / name).rename(aside / name)
        for name in new:
            (tmp / name).rename(out / name)
        made = {"scenes": new, "seed": args.seed, "image_size": args.image_size, "split": args.split}
        _write_marker(out, made)
    except BaseException:
        _clean_up(out, pid)
        raise
    _clean_up(out, pid)  # the old scenes moved aside, and the emptied hidden folder
    replaced = f" (replacing its {len(old)} old scene{'' if len(old) == 1 else 's'})" if old else ""
    print(f"wrote {args.num_scenes} scene{'' if args.num_scenes == 1 else 's'} to {out}{replaced}")
