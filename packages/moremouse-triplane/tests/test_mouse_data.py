"""Generated scenes (deterministic, consistent renderers) and the folder-of-renders loader with its errors."""

import json

import pytest
import torch
from moremouse_triplane.data import FolderScenes, MouseField, SyntheticScenes, export_scenes, make_source
from moremouse_triplane.render import image_rays, intrinsics, look_at, orbit_eye, render_rays
from PIL import Image


def test_scenes_are_deterministic_in_seed_split_index():
    a, b = SyntheticScenes(16, seed=3), SyntheticScenes(16, seed=3)
    torch.testing.assert_close(a.input_image(5), b.input_image(5))
    assert not torch.allclose(a.input_image(5), a.input_image(6))
    assert not torch.allclose(a.input_image(5), SyntheticScenes(16, seed=3, split="val").input_image(5))
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    b1, b2 = a.train_batch([1, 2], 32, 2, g1), b.train_batch([1, 2], 32, 2, g2)
    for k in b1:
        torch.testing.assert_close(b1[k], b2[k])
    assert b1["rays_o"].shape == (2, 32, 3) and b1["rgb"].shape == (2, 32, 3)
    img = a.input_image(5)
    assert (img == 1).float().mean() > 0.3 and (img < 0.9).any()  # white background and a mouse


def test_ray_cast_ground_truth_matches_volume_rendering_of_the_same_field():
    field = MouseField(torch.Generator().manual_seed(0))
    K, c2w = intrinsics(40.0, 32, 32), look_at(orbit_eye(45.0, 25.0, 2.3))
    o, d = image_rays(K, c2w, 32, 32)
    cast, hit = field.cast(o, d)
    with torch.no_grad():
        vol, acc = render_rays(field, o[None], d[None], n_samples=512)
    assert hit.any() and not hit.all()
    assert (acc[0] > 0.5).eq(hit).float().mean() > 0.99  # the same silhouette
    inside = hit & (acc[0] > 0.99)
    assert (vol[0][inside] - cast[inside]).abs().mean() < 0.05  # and the same colours


def test_ray_cast_matches_a_plain_per_part_intersection():
    """cast's matrix form against the textbook one: each ellipsoid on its own, the nearest hit in front."""
    field = MouseField(torch.Generator().manual_seed(7))
    o, d = image_rays(intrinsics(40.0, 48, 48), look_at(orbit_eye(200.0, 30.0, 2.3)), 48, 48)
    rgb, hit = field.cast(o, d)
    po, pd = (o - field.offset) @ field.rot, d @ field.rot
    best = torch.full(o.shape[:-1], float("inf"))
    for centre, radii in zip(field.centres, field.radii):
        oq, dq = (po - centre) / radii, pd / radii
        a, b, c = (dq * dq).sum(-1), 2 * (oq * dq).sum(-1), (oq * oq).sum(-1) - 1
        disc = b * b - 4 * a * c
        t = (-b - disc.clamp(min=0).sqrt()) / (2 * a)
        best = torch.minimum(best, torch.where((disc >= 0) & (t > 0), t, torch.full_like(t, float("inf"))))
    ref_hit = torch.isfinite(best)
    assert 0.05 < ref_hit.float().mean() < 0.95
    assert (hit != ref_hit).float().mean() < 1e-3  # float32 vs float64 may split a grazing ray
    assert ((rgb == 1).all(-1) | hit).all() and (rgb[hit] < 1).any(-1).float().mean() > 0.99


def test_export_and_folder_loader_round_trip(tmp_path):
    export_scenes(tmp_path, 2, 16, seed=0, split="val")
    folder = FolderScenes(tmp_path, 16)
    src = SyntheticScenes(16, seed=0, split="val")
    assert len(folder) == 2
    ev_f, ev_s = folder.eval_scene(1), src.eval_scene(1)
    assert (ev_f["images"] - ev_s["images"]).abs().max() <= 1 / 255 + 1e-6  # 8-bit PNG quantisation
    torch.testing.assert_close(ev_f["c2w"], ev_s["c2w"])
    torch.testing.assert_close(ev_f["input"], src.input_image(1), atol=1 / 255 + 1e-6, rtol=0)
    batch = folder.train_batch([0, 1], 20, 0, torch.Generator().manual_seed(0))
    assert batch["rgb"].shape == (2, 20, 3) and batch["images"].shape == (2, 3, 16, 16)


def _scene(tmp_path, size=(16, 16), frame_edit=None):
    d = tmp_path / "scene_000"
    d.mkdir(parents=True)
    Image.new("RGB", size, (255, 255, 255)).save(d / "000.png")
    frame = {
        "file": "000.png",
        "intrinsics": [[20.0, 0, 8], [0, 20.0, 8], [0, 0, 1]],
        "cam_to_world": torch.eye(4).tolist(),
    }
    if frame_edit:
        frame_edit(frame)
    (d / "cameras.json").write_text(json.dumps({"frames": [frame]}))
    return d


@pytest.mark.parametrize(
    "size,edit,match",
    [
        ((16, 12), None, r"000\.png: image is 16x12; images must be square"),
        ((32, 32), None, r"000\.png: image is 32x32, expected 16x16"),
        (
            (16, 16),
            lambda f: f.pop("intrinsics"),
            r"cameras\.json: frames\[0\] is missing field 'intrinsics'",
        ),
        ((16, 16), lambda f: f["cam_to_world"][0].__setitem__(3, float("nan")), r"cam_to_world contains NaN"),
        ((16, 16), lambda f: f.__setitem__("intrinsics", [[1, 0], [0, 1]]), r"intrinsics must be 3x3"),
        (
            (16, 16),
            lambda f: f.__setitem__("file", "missing.png"),
            r"missing\.png: image listed in cameras\.json does not exist",
        ),
    ],
)
def test_bad_folder_input_names_file_and_field(tmp_path, size, edit, match):
    _scene(tmp_path, size, edit)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        FolderScenes(tmp_path, 16)


def test_missing_folder_and_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        make_source(str(tmp_path / "nope"), 16)
    with pytest.raises(FileNotFoundError, match="no scene folders"):
        make_source(str(tmp_path), 16)


def test_folder_split_holds_out_a_fixed_quarter_at_most(tmp_path):
    export_scenes(tmp_path, 8, 16, seed=0, split="train")
    src = FolderScenes(tmp_path, 16)
    train, held = src.split(5)
    again = src.split(5)[1]
    assert len(held) == 2 and len(train) == 6  # capped at a quarter of 8
    ids = {id(s) for s in src.scenes}
    assert {id(s) for s in train.scenes} | {id(s) for s in held.scenes} == ids
    assert not {id(s) for s in train.scenes} & {id(s) for s in held.scenes}
    assert [id(s) for s in again.scenes] == [id(s) for s in held.scenes]
