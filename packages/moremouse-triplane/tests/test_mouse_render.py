"""Volume rendering, rays and triplane sampling against analytic answers."""

import math

import pytest
import torch
from moremouse_triplane.render import (
    TriplaneDecoder,
    image_rays,
    intrinsics,
    look_at,
    orbit_eye,
    ray_box,
    render_rays,
    render_triplane,
    sample_triplane,
)

RED = torch.tensor([1.0, 0.0, 0.0])


def _axis_ray(n: int = 1):
    """Rays from z = -3 straight up the z axis: they enter the unit box at t = 2 and leave at t = 4."""
    o = torch.tensor([0.0, 0.0, -3.0]).expand(1, n, 3)
    d = torch.tensor([0.0, 0.0, 1.0]).expand(1, n, 3)
    return o, d


def test_ray_box_entry_exit_and_miss():
    o = torch.tensor([[[0.0, 0.0, -3.0], [5.0, 5.0, -3.0], [0.0, 0.0, 0.0]]])
    d = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    near, far = ray_box(o, d, 1.0)
    assert near[0, 0] == pytest.approx(2.0) and near[0, 2] == 0.0  # a ray starting inside enters at 0
    assert far[0, 0] == pytest.approx(4.0) and far[0, 2] == pytest.approx(1.0)
    assert near[0, 1] == far[0, 1]  # a miss: empty interval


@pytest.mark.parametrize("sigma0", [0.5, 3.0, 20.0])
def test_constant_density_slab_gives_beer_lambert(sigma0):
    # slab z in [-0.5, 0.5] of density sigma0, red; 200 bins of 0.01 with edges on the slab faces
    def field(pts):
        inside = (pts[..., 2].abs() < 0.5).float()
        return sigma0 * inside, RED.expand(*pts.shape)

    o, d = _axis_ray()
    rgb, acc = render_rays(field, o, d, n_samples=200, bbox=1.0)
    alpha = 1 - math.exp(-sigma0 * 1.0)
    assert acc.item() == pytest.approx(alpha, abs=1e-5)
    expected = RED * alpha + (1 - alpha) * torch.ones(3)  # what is not absorbed shows the white background
    assert torch.allclose(rgb[0, 0], expected, atol=1e-5)


def test_transmittance_halves_after_ln2_optical_depth():
    # density ln(2) per unit over the whole box (length 2): a quarter of the light gets through
    def field(pts):
        return torch.full(pts.shape[:-1], math.log(2.0)), RED.expand(*pts.shape)

    rgb, acc = render_rays(field, *_axis_ray(), n_samples=64)
    assert acc.item() == pytest.approx(0.75, abs=1e-6)


def test_zero_density_and_missed_rays_are_white():
    def field(pts):
        return torch.zeros(pts.shape[:-1]), torch.zeros(*pts.shape)  # black, but empty

    o = torch.tensor([[[0.0, 0.0, -3.0], [5.0, 5.0, -3.0]]])
    d = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]])
    rgb, acc = render_rays(field, o, d, n_samples=16)
    assert torch.equal(rgb, torch.ones_like(rgb)) and torch.equal(acc, torch.zeros_like(acc))

    def dense(pts):
        return torch.full(pts.shape[:-1], 100.0), torch.zeros(*pts.shape)

    rgb, acc = render_rays(dense, o, d, n_samples=16)
    assert rgb[0, 0].abs().max() < 1e-6  # opaque black box on the axis ray
    assert torch.equal(rgb[0, 1], torch.ones(3))  # the ray missing the box never samples the field


def test_chunked_rendering_equals_unchunked_values_and_grads():
    torch.manual_seed(0)
    dec = TriplaneDecoder(channels=8, hidden=16)
    planes = torch.randn(2, 3, 8, 16, 16, requires_grad=True)
    eye = torch.nn.functional.normalize(torch.randn(2, 37, 3), dim=-1) * 2.5
    d = torch.nn.functional.normalize(-eye + 0.3 * torch.randn(2, 37, 3), dim=-1)
    jitter = torch.rand(2, 37, 12)
    outs = []
    for chunk, ckpt in [(None, False), (5, False), (8, True)]:
        rgb, acc = render_triplane(
            dec, planes, eye, d, n_samples=12, jitter=jitter, chunk=chunk, use_checkpoint=ckpt
        )
        (g,) = torch.autograd.grad(rgb.square().sum() + acc.sum(), planes)
        outs.append((rgb, acc, g))
    for rgb, acc, g in outs[1:]:
        torch.testing.assert_close(rgb, outs[0][0])
        torch.testing.assert_close(acc, outs[0][1])
        torch.testing.assert_close(g, outs[0][2])


def test_sample_triplane_reads_texel_centres_of_the_right_planes():
    torch.manual_seed(0)
    B, C, S = 2, 5, 8
    planes = torch.randn(B, 3, C, S, S)
    ix, iy, iz = 1, 6, 3
    centre = lambda i: -1 + (2 * i + 1) / S  # noqa: E731  (align_corners=False texel centres)
    pts = torch.tensor([[centre(ix), centre(iy), centre(iz)]]).expand(B, 1, 3)
    f = sample_triplane(planes, pts)  # (B, 1, 3, C)
    torch.testing.assert_close(f[:, 0, 0], planes[:, 0, :, iy, ix])  # xy plane: row y, column x
    torch.testing.assert_close(f[:, 0, 1], planes[:, 1, :, iz, ix])  # xz plane
    torch.testing.assert_close(f[:, 0, 2], planes[:, 2, :, iz, iy])  # yz plane
    # halfway between two texels along x: the mean of both (bilinear)
    pts2 = torch.tensor([[0.5 * (centre(ix) + centre(ix + 1)), centre(iy), centre(iz)]]).expand(B, 1, 3)
    f2 = sample_triplane(planes, pts2)
    torch.testing.assert_close(f2[:, 0, 0], 0.5 * (planes[:, 0, :, iy, ix] + planes[:, 0, :, iy, ix + 1]))


def test_look_at_cameras_and_rays():
    eye = orbit_eye(30.0, 20.0, 2.5)
    c2w = look_at(eye)
    R = c2w[:3, :3]
    torch.testing.assert_close(R.T @ R, torch.eye(3), atol=1e-6, rtol=0)
    assert torch.linalg.det(R) == pytest.approx(
        1.0, abs=1e-6
    )  # right-handed (OpenCV: x right, y down, z fwd)
    K = intrinsics(40.0, 9, 9)
    o, d = image_rays(K, c2w, 9, 9)
    centre = d[4 * 9 + 4]
    torch.testing.assert_close(centre, -eye / eye.norm(), atol=1e-6, rtol=0)  # the centre ray hits the origin
    assert d[0, 2] > centre[2] > d[-1, 2]  # top row looks up (+z), bottom row down
    torch.testing.assert_close(o, eye.expand(81, 3))
    # field of view: the middle row's end rays span 40 degrees minus half a pixel each side
    left, right = d[4 * 9], d[4 * 9 + 8]
    half = math.atan(math.tan(math.radians(20)) * 8 / 9)
    assert torch.dot(left, right).item() == pytest.approx(math.cos(2 * half), abs=1e-5)


def test_sample_view_reads_the_input_image_where_points_project():
    from moremouse_triplane.data import SyntheticScenes
    from moremouse_triplane.render import sample_view

    src = SyntheticScenes(32)
    img = src.input_image(3)
    o, d = image_rays(src.K, src.input_c2w, 32, 32)
    for t in (1.5, 2.3, 3.0):  # any point on a pixel's ray reads that pixel, with its depth t * cos
        f = sample_view(img[None], src.K[None], src.input_c2w[None], (o + t * d)[None])[0, :, 0]
        torch.testing.assert_close(f[:, :3], img.reshape(3, -1).T, atol=1e-4, rtol=0)
        forward = src.input_c2w[:3, 2]
        torch.testing.assert_close(f[:, 3], t * (d @ forward), atol=1e-4, rtol=0)
    behind = sample_view(img[None], src.K[None], src.input_c2w[None], (o - 5.0 * d)[None])
    assert torch.isfinite(behind).all()


def test_sample_view_reads_feature_channels_at_the_pixel_and_zero_outside():
    from moremouse_triplane.data import SyntheticScenes
    from moremouse_triplane.render import sample_view

    src = SyntheticScenes(32)
    img = src.input_image(3)
    feats = torch.randn(2, 32, 32)
    o, d = image_rays(src.K, src.input_c2w, 32, 32)
    f = sample_view(torch.cat([img, feats])[None], src.K[None], src.input_c2w[None], (o + 2.0 * d)[None])
    assert f.shape == (1, 32 * 32, 1, 3 + 2 + 1)
    torch.testing.assert_close(f[0, :, 0, :3], img.reshape(3, -1).T, atol=1e-4, rtol=0)
    torch.testing.assert_close(f[0, :, 0, 3:5], feats.reshape(2, -1).T, atol=1e-4, rtol=0)
    # a point far outside the field of view: white rgb, zero features, its depth
    side = src.input_c2w[:3, 3] + 2.0 * src.input_c2w[:3, 2] + 5.0 * src.input_c2w[:3, 0]
    out = sample_view(torch.cat([img, feats])[None], src.K[None], src.input_c2w[None], side[None, None])
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 2.0]))


def test_carving_empties_what_the_input_view_sees_as_background_and_keeps_the_rest_exact():
    """carved_field: density 0 where the input camera sees white there; elsewhere exactly the
    decoder's answer (the same as without carving), with gradients to the planes."""
    from moremouse_triplane.data import SyntheticScenes
    from moremouse_triplane.render import PIXEL_FEATURES, carved_field, sample_view

    torch.manual_seed(0)
    src = SyntheticScenes(32)
    images = torch.stack([src.input_image(3), src.input_image(4)])
    K, c2w = src.K.expand(2, 3, 3), src.input_c2w.expand(2, 4, 4)
    dec = TriplaneDecoder(8, hidden=16, extra=PIXEL_FEATURES)
    with torch.no_grad():
        dec.layers[-1].bias[0] = 2.0  # dense everywhere, so carving is what makes points empty
    planes = torch.randn(2, 3, 8, 16, 16, requires_grad=True)
    pts = torch.rand(2, 500, 3) * 2 - 1
    sigma, rgb = carved_field(dec, planes, (images, K, c2w), pts, 1.0, 0.01)
    ref_sigma, ref_rgb = dec.decode(sample_triplane(planes, pts), sample_view(images, K, c2w, pts))
    seen = sample_view(images, K, c2w, pts)[..., 0, :3]
    background = (1 - seen).amax(-1) <= 0.01
    assert 0 < background.float().mean() < 1  # both kinds of points are in the test
    assert (sigma[background] == 0).all() and (ref_sigma[background] > 0).all()
    torch.testing.assert_close(sigma[~background], ref_sigma[~background])
    torch.testing.assert_close(rgb[~background], ref_rgb[~background])
    (g,) = torch.autograd.grad(sigma.sum(), planes)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_hull_bounds_cover_every_point_the_carving_keeps():
    """hull_bounds narrows each ray to the part inside the input view's hull: of the points that
    carving keeps on a dense (1024-point) march, all but slivers of the silhouette's faint
    anti-aliased fringe (measured: 0.07%) lie inside it; rays with none get an empty interval."""
    from moremouse_triplane.data import SyntheticScenes
    from moremouse_triplane.render import hull_bounds, sample_view

    src = SyntheticScenes(32)
    images = torch.stack([src.input_image(1), src.input_image(2)])
    K, c2w = src.K.expand(2, 3, 3), src.input_c2w.expand(2, 4, 4)
    o, d = image_rays(src.K, look_at(orbit_eye(150.0, 30.0, 2.3)), 32, 32)
    o, d = o.expand(2, -1, -1), d.expand(2, -1, -1)
    near, far = ray_box(o, d, 1.0)
    lo, hi = hull_bounds((images, K, c2w), 0.01, 64)(o, d, near, far)
    assert ((lo >= near - 1e-6) & (hi <= far + 1e-6) & (hi >= lo)).all()
    t = near[..., None] + (far - near)[..., None] * (torch.arange(1024) + 0.5) / 1024
    pts = o[..., None, :] + t[..., None] * d[..., None, :]
    seen = sample_view(images, K, c2w, pts.reshape(2, -1, 3))[..., 0, :3].reshape(2, 1024, 1024, 3)
    kept = (1 - seen).amax(-1) > 0.01
    inside = (t >= lo[..., None] - 1e-5) & (t <= hi[..., None] + 1e-5)
    missed = kept & ~inside
    assert kept.any() and missed.sum() < 2e-3 * kept.sum()
    assert ((1 - seen[missed]).amax(-1) < 0.05).all()  # only the faint edge of the silhouette
    empty = ~kept.any(-1)
    assert empty.any() and (hi[empty] - lo[empty] < (far - near)[empty] / 64 + 1e-6).all()
    assert ((hi - lo)[~empty] / (far - near)[~empty]).mean() < 0.6  # samples go where the mouse may be
