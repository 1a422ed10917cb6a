"""Cameras, rays, triplane sampling and NeRF volume rendering on a white background.

Conventions: world up is +z; cameras are OpenCV-style (x right, y down, z forward), given by intrinsics
K (3, 3) in pixels and a 4x4 camera-to-world matrix. The scene lives in the box [-bbox, bbox]^3; rays are
sampled only between their entry and exit of that box, and rays that miss it show the background.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from memfit.ops.layers import checkpointed
from torch import nn

# field(points (B, P, 3)) -> (sigma (B, P), rgb (B, P, 3))
Field = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# bounds(rays_o, rays_d, near, far) -> the part (near, far) of each ray (B, R) worth sampling
Bounds = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# ----------------------------------------------------------------------------------------------------
# Cameras and rays
# ----------------------------------------------------------------------------------------------------


def intrinsics(fov_deg: float, height: int, width: int) -> torch.Tensor:
    """Pinhole K (3, 3) with the given horizontal field of view and the principal point at the centre."""
    f = 0.5 * width / math.tan(math.radians(fov_deg) / 2)
    return torch.tensor([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])


def look_at(
    eye: torch.Tensor, target: torch.Tensor | None = None, up: torch.Tensor | None = None
) -> torch.Tensor:
    """OpenCV camera-to-world (..., 4, 4) for cameras at eye (..., 3) looking at target (default origin)."""
    target = torch.zeros_like(eye) if target is None else target.expand_as(eye)
    up = eye.new_tensor([0.0, 0.0, 1.0]).expand_as(eye) if up is None else up.expand_as(eye)
    forward = F.normalize(target - eye, dim=-1)
    right = F.normalize(torch.linalg.cross(forward, up, dim=-1), dim=-1)
    down = torch.linalg.cross(forward, right, dim=-1)
    c2w = eye.new_zeros(*eye.shape[:-1], 4, 4)
    c2w[..., :3, 0], c2w[..., :3, 1], c2w[..., :3, 2], c2w[..., :3, 3] = right, down, forward, eye
    c2w[..., 3, 3] = 1.0
    return c2w


def orbit_eye(azimuth_deg: float, elevation_deg: float, radius: float) -> torch.Tensor:
    """Camera position (3,) on a sphere around the origin; azimuth 0 is +x, elevation towards +z."""
    az, el = math.radians(azimuth_deg), math.radians(elevation_deg)
    return torch.tensor(
        [radius * math.cos(el) * math.cos(az), radius * math.cos(el) * math.sin(az), radius * math.sin(el)]
    )


def pixel_rays(K: torch.Tensor, c2w: torch.Tensor, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rays through pixels (..., P, 2), (x, y) in pixel units -> origins, unit directions (..., P, 3)."""
    x = (pixels[..., 0] - K[..., None, 0, 2]) / K[..., None, 0, 0]
    y = (pixels[..., 1] - K[..., None, 1, 2]) / K[..., None, 1, 1]
    d_cam = torch.stack([x, y, torch.ones_like(x)], dim=-1)
    d = F.normalize(d_cam @ c2w[..., :3, :3].transpose(-1, -2), dim=-1)
    o = c2w[..., None, :3, 3].expand_as(d)
    return o, d


def image_rays(
    K: torch.Tensor, c2w: torch.Tensor, height: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rays through every pixel centre, row-major -> origins, directions (..., H*W, 3)."""
    ys, xs = torch.meshgrid(
        torch.arange(height, device=K.device) + 0.5, torch.arange(width, device=K.device) + 0.5, indexing="ij"
    )
    pixels = torch.stack([xs, ys], dim=-1).reshape(-1, 2).to(K.dtype)
    return pixel_rays(K, c2w, pixels)


def ray_box(rays_o: torch.Tensor, rays_d: torch.Tensor, bbox: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry and exit distances (...,) of rays in [-bbox, bbox]^3 (slab method); a miss gives near == far."""
    d = torch.where(rays_d.abs() < 1e-9, torch.full_like(rays_d, 1e-9), rays_d)
    t0, t1 = (-bbox - rays_o) / d, (bbox - rays_o) / d
    near = torch.minimum(t0, t1).amax(dim=-1).clamp(min=0.0)
    far = torch.maximum(t0, t1).amin(dim=-1)
    return near, torch.maximum(far, near)


# ----------------------------------------------------------------------------------------------------
# Volume rendering
# ----------------------------------------------------------------------------------------------------


def composite(
    sigma: torch.Tensor, rgb: torch.Tensor, delta: torch.Tensor, background: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alpha compositing: sigma (..., S), rgb (..., S, 3), bin length delta (...) -> rgb (..., 3), acc (...).

    alpha_i = 1 - exp(-sigma_i delta); T_i = exp(-sum_{j<i} sigma_j delta); what light is left after the
    last sample shows the background colour.
    """
    tau = sigma.float() * delta.float()[..., None]
    alpha = 1.0 - torch.exp(-tau)
    # exclusive cumulative sum: transmittance before each sample, exact even when some alpha is 1
    trans = torch.exp(-(torch.cumsum(tau, dim=-1) - tau))
    weights = alpha * trans
    acc = weights.sum(dim=-1)
    color = (weights[..., None] * rgb.float()).sum(dim=-2) + (1.0 - acc[..., None]) * background
    return color, acc


def _render_chunk(
    field: Field,
    rays_o: torch.Tensor,
    rays_d: torch.Tensor,
    jitter: torch.Tensor | None,
    n_samples: int,
    bbox: float,
    bounds: Bounds | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, R, _ = rays_o.shape
    near, far = ray_box(rays_o, rays_d, bbox)
    if bounds is not None:
        near, far = bounds(rays_o, rays_d, near, far)
    delta = (far - near) / n_samples  # equal bins between entry and exit; 0 for rays that miss
    u = torch.arange(n_samples, device=rays_o.device, dtype=rays_o.dtype) + 0.5
    u = u.expand(B, R, n_samples) if jitter is None else u - 0.5 + jitter.to(rays_o.dtype)
    t = near[..., None] + delta[..., None] * u
    pts = rays_o[..., None, :] + t[..., None] * rays_d[..., None, :]
    sigma, rgb = field(pts.reshape(B, R * n_samples, 3))
    return composite(sigma.reshape(B, R, n_samples), rgb.reshape(B, R, n_samples, 3), delta)


def render_rays(
    field: Field,
    rays_o: torch.Tensor,
    rays_d: torch.Tensor,
    *,
    n_samples: int,
    bbox: float = 1.0,
    jitter: torch.Tensor | None = None,
    chunk: int | None = None,
    use_checkpoint: bool = False,
    bounds: Bounds | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Render rays (B, R, 3) through a field -> rgb (B, R, 3), opacity (B, R).

    Samples are stratified in n_samples equal bins between box entry and exit (or the narrower
    interval that `bounds` gives, outside which the field must be empty): at bin centres, or at
    bin start + jitter (B, R, S) in [0, 1). Rays go through the field `chunk` per image at a time; with
    use_checkpoint each chunk is recomputed in backward, so training memory is one chunk's, not all rays'.
    """
    R = rays_o.shape[1]
    chunk = R if chunk is None else chunk
    colors, accs = [], []
    for i in range(0, R, chunk):
        sl = slice(i, min(i + chunk, R))
        jit = None if jitter is None else jitter[:, sl]
        args = (field, rays_o[:, sl], rays_d[:, sl], jit, n_samples, bbox, bounds)
        c, a = checkpointed(_render_chunk, *args, enabled=use_checkpoint)
        colors.append(c)
        accs.append(a)
    if len(colors) == 1:
        return colors[0], accs[0]
    return torch.cat(colors, dim=1), torch.cat(accs, dim=1)


# ----------------------------------------------------------------------------------------------------
# Triplane field
# ----------------------------------------------------------------------------------------------------


def sample_triplane(planes: torch.Tensor, pts: torch.Tensor, bbox: float = 1.0) -> torch.Tensor:
    """Bilinear features of planes (B, 3, C, H, W) at points (B, P, 3) -> (B, P, 3, C).

    Plane 0 is indexed by (x, y), plane 1 by (x, z), plane 2 by (y, z); points outside the box read 0.
    """
    B, _, C, H, W = planes.shape
    p = pts / bbox
    grid = torch.stack([p[..., [0, 1]], p[..., [0, 2]], p[..., [1, 2]]], dim=1)  # (B, 3, P, 2)
    grid = grid.reshape(B * 3, 1, -1, 2).to(planes.dtype)
    feats = F.grid_sample(planes.reshape(B * 3, C, H, W), grid, mode="bilinear", align_corners=False)
    return feats.reshape(B, 3, C, -1).permute(0, 3, 1, 2)


class TriplaneDecoder(nn.Module):
    """Plane features -> density and colour: a small MLP (hidden width 64 in the paper)."""

    def __init__(
        self, channels: int, hidden: int = 64, layers: int = 2, combine: str = "concat", extra: int = 0
    ) -> None:
        super().__init__()
        self.combine = combine
        dims = [(3 * channels if combine == "concat" else channels) + extra] + [hidden] * layers + [4]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        with torch.no_grad():  # start nearly empty (white), so early steps do not fight a grey fog
            self.layers[-1].bias.copy_(torch.tensor([-3.0, 0.0, 0.0, 0.0]))
        self.density_scale = 10.0

    def decode(
        self, feats: torch.Tensor, extra: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """feats (B, P, 3, C) -> sigma (B, P) >= 0, rgb (B, P, 3) in (0, 1); with `extra`, sample_view's
        features (B, P, 1, E) (rgb, ..., depth): the decoder reads them and its colour corrects their rgb.

        A plain method over F.linear, not submodule calls: the renderer calls it once per ray chunk, and
        PyTorch's MemTracker (behind memfit's estimator) refuses modules entered several times per step.
        """
        x = feats.flatten(-2) if self.combine == "concat" else feats.sum(dim=-2)
        if extra is not None:
            x = torch.cat([x, extra.flatten(-2)], dim=-1)
        for i, layer in enumerate(self.layers):
            x = F.linear(x, layer.weight, layer.bias)
            if i < len(self.layers) - 1:
                x = F.silu(x)
        out = x.float()
        rgb = out[..., 1:]
        if extra is not None:  # colour as a correction to what the input camera saw there (sample_view)
            rgb = rgb + torch.logit(extra[..., 0, :3].float().clamp(0.02, 0.98))
        return F.softplus(out[..., 0]) * self.density_scale, torch.sigmoid(rgb)

    def forward(
        self, feats: torch.Tensor, extra: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode(feats, extra)


PIXEL_FEATURES = 4  # what sample_view adds per point from the input image alone: rgb seen there + depth


def sample_view(image: torch.Tensor, K: torch.Tensor, c2w: torch.Tensor, pts: torch.Tensor) -> torch.Tensor:
    """What the input camera saw where points project: image (B, 3 + F, H, W) (rgb, then F optional
    feature channels), K (B, 3, 3), c2w (B, 4, 4), points (B, P, 3) -> (B, P, 1, 3 + F + 1): rgb there
    (white outside the image), the features there (0 outside) and the point's depth (z) in the camera."""
    H, W = image.shape[-2:]
    cam = (pts - c2w[:, None, :3, 3]) @ c2w[:, :3, :3]  # world -> camera (OpenCV)
    z = cam[..., 2].clamp(min=1e-3)
    u = K[:, None, 0, 0] * cam[..., 0] / z + K[:, None, 0, 2]
    v = K[:, None, 1, 1] * cam[..., 1] / z + K[:, None, 1, 2]
    grid = torch.stack([u / W * 2 - 1, v / H * 2 - 1], dim=-1)[:, None].to(image.dtype)  # (B, 1, P, 2)
    white = torch.zeros_like(image[:1, :, :1, :1])
    white[:, :3] = 1.0  # sample image - white with zero padding, add white back: outside reads white rgb
    feats = F.grid_sample(image - white, grid, mode="bilinear", align_corners=False)[:, :, 0] + white[..., 0]
    return torch.cat([feats.transpose(1, 2), cam[..., 2:3].to(feats.dtype)], dim=-1)[:, :, None, :]


@torch.no_grad()
def _inside_hull(view: tuple[torch.Tensor, torch.Tensor, torch.Tensor], pts: torch.Tensor, carve: float):
    """Points (B, P, 3) -> bool (B, P): the input view does not see background there (some channel of its
    rgb further than `carve` from white): one view's visual hull on a white background."""
    seen = sample_view(view[0][:, :3], view[1], view[2], pts)[..., 0, :3].float()
    return (1.0 - seen).amax(dim=-1) > carve


def carved_field(
    decoder: TriplaneDecoder,
    planes: torch.Tensor,
    view: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pts: torch.Tensor,
    bbox: float,
    carve: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The field at points (B, P, 3), empty wherever the input view sees background (within `carve` of
    white in every channel) there: on a white background, what the input camera sees through an empty
    pixel is empty (one view's visual hull). Only the points inside the hull go through the decoder."""
    B, P, _ = pts.shape
    keep = _inside_hull(view, pts, carve)
    feats, extra = [], []
    for b in range(B):  # a different number of points per scene: sample each scene's planes apart
        p = pts[b][keep[b]][None]
        feats.append(sample_triplane(planes[b : b + 1], p, bbox)[0])
        extra.append(sample_view(view[0][b : b + 1], view[1][b : b + 1], view[2][b : b + 1], p)[0])
    f = torch.cat(feats)
    s, c = decoder.decode(f, torch.cat(extra).to(f.dtype))
    # masked_scatter fills the kept points in row-major order: scene by scene, as they were gathered
    sigma = s.new_zeros(B, P).masked_scatter(keep, s)
    rgb = c.new_ones(B, P, 3).masked_scatter(keep[..., None].expand(B, P, 3), c)
    return sigma, rgb


def hull_bounds(view: tuple[torch.Tensor, torch.Tensor, torch.Tensor], carve: float, probes: int) -> Bounds:
    """Bounds for carved_field: probe each ray at `probes` bin centres between near and far and keep
    the interval from half a bin before the first point the input view does not see as background to
    a bin and a half after the last; a ray with no such point gets an empty interval (it is white).
    The renderer's samples then all fall where the field can be non-zero."""

    @torch.no_grad()
    def bounds(
        rays_o: torch.Tensor, rays_d: torch.Tensor, near: torch.Tensor, far: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, R, _ = rays_o.shape
        step = (far - near) / probes
        t = near[..., None] + step[..., None] * (torch.arange(probes, device=near.device) + 0.5)
        pts = (rays_o[..., None, :] + t[..., None] * rays_d[..., None, :]).reshape(B, R * probes, 3)
        keep = _inside_hull(view, pts, carve).reshape(B, R, probes)
        idx = torch.arange(probes, device=near.device).expand_as(keep)
        first = torch.where(keep, idx, probes).amin(dim=-1)
        last = torch.where(keep, idx, -1).amax(dim=-1)
        lo = torch.minimum(torch.maximum(near + (first - 0.5) * step, near), far)
        hi = torch.maximum(torch.minimum(near + (last + 1.5) * step, far), lo)
        return lo, hi

    return bounds


def render_triplane(
    decoder: TriplaneDecoder,
    planes: torch.Tensor,
    rays_o: torch.Tensor,
    rays_d: torch.Tensor,
    *,
    bbox: float = 1.0,
    view: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    carve: float = 0.0,
    hull_probes: int = 0,
    **sampling,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Volume-render triplanes (B, 3, C, H, W) along rays (B, R, 3) -> rgb (B, R, 3), opacity (B, R).

    sampling: render_rays' n_samples (required), jitter, chunk and use_checkpoint. view = (input image,
    K, c2w): the decoder also reads sample_view's features of each point; with carve > 0 too, points the
    input view sees as background are empty (carved_field), and with hull_probes > 0 the samples are
    spread over the part of each ray inside that hull (hull_bounds)."""

    def field(pts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if view is not None and carve > 0:
            return carved_field(decoder, planes, view, pts, bbox, carve)
        feats = sample_triplane(planes, pts, bbox)
        if view is not None:
            return decoder.decode(feats, sample_view(*view, pts).to(feats.dtype))
        return decoder.decode(feats)

    return render_rays(
        field,
        rays_o,
        rays_d,
        bbox=bbox,
        **sampling,
        bounds=hull_bounds(view, carve, hull_probes)
        if view is not None and carve > 0 and hull_probes
        else None,
    )
