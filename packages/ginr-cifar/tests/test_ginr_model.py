"""Model behaviour: query independence per decoder variant, input checks, checkpointing parity, presets."""

import pytest
import torch
from ginr_cifar.config import GINRConfig, get_config
from ginr_cifar.model import GINR


def _model(decoder: str, **kw) -> GINR:
    torch.manual_seed(0)
    return GINR(get_config("tiny", decoder=decoder, **kw)).eval()


def _split_vs_joint(model: GINR) -> float:
    """Max |decode(cat(c1, c2)) - cat(decode(c1), decode(c2))| in fp32."""
    g = torch.Generator().manual_seed(1)
    images = torch.rand(2, 3, 32, 32, generator=g)
    c1 = torch.rand(2, 40, 2, generator=g) * 2 - 1
    c2 = torch.rand(2, 24, 2, generator=g) * 2 - 1
    with torch.no_grad():
        latent = model.encode(images)
        joint = model.decode(latent, torch.cat([c1, c2], dim=1))
        apart = torch.cat([model.decode(latent, c1), model.decode(latent, c2)], dim=1)
    assert joint.shape == (2, 64, 3)
    return (joint - apart).abs().max().item()


@pytest.mark.parametrize("decoder", ["ff", "xattn"])
def test_ginr_decoder_is_query_independent(decoder):
    assert _split_vs_joint(_model(decoder)) < 1e-5


def test_ginr_attn_decoder_is_not_query_independent():
    # The naive SCENT decoder mixes coordinates: a pixel's colour depends on its batch-mates.
    assert _split_vs_joint(_model("attn")) > 1e-3


@pytest.mark.parametrize("decoder", ["ff", "xattn"])
def test_ginr_single_pixel_matches_full_grid(decoder):
    # Decoding one coordinate alone gives the same colour as decoding it inside the full 32x32 grid.
    from ginr_cifar.data import pixel_coords

    model = _model(decoder)
    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    grid = pixel_coords(32)[None]
    with torch.no_grad():
        full = model(images, grid)
        one = model(images, grid[:, 517:518])
    torch.testing.assert_close(one, full[:, 517:518], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decoder", ["ff", "xattn", "attn"])
def test_ginr_checkpointing_matches_plain(decoder):
    torch.manual_seed(0)
    plain = GINR(get_config("tiny", decoder=decoder))
    ckpt = GINR(get_config("tiny", decoder=decoder, checkpoint=True))
    ckpt.load_state_dict(plain.state_dict())
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    coords = torch.rand(2, 50, 2, generator=torch.Generator().manual_seed(4)) * 2 - 1
    grads = []
    for m in (plain, ckpt):
        out = m(images, coords)
        out.square().mean().backward()
        grads.append(
            (out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        )
    torch.testing.assert_close(grads[0][0], grads[1][0])
    assert grads[0][1].keys() == grads[1][1].keys()
    for n in grads[0][1]:
        torch.testing.assert_close(grads[0][1][n], grads[1][1][n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("bad", [1.5, -1.01, float("nan")])
def test_ginr_coords_outside_unit_square_are_rejected(bad):
    model = _model("ff")
    coords = torch.zeros(1, 4, 2)
    coords[0, 2, 1] = bad
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        model(torch.rand(1, 3, 32, 32), coords)


def test_ginr_coords_shape_and_image_shape_are_checked():
    model = _model("ff")
    with pytest.raises(ValueError, match="coords must have shape"):
        model(torch.rand(1, 3, 32, 32), torch.zeros(1, 4, 3))
    with pytest.raises(ValueError, match=r"images must have shape \(batch, 3, 32, 32\)"):
        model(torch.rand(1, 1, 32, 32), torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match=r"images must have shape"):
        model(torch.rand(1, 3, 64, 64), torch.zeros(1, 4, 2))


def test_ginr_presets_follow_the_seed():
    for name, (dim, lp, depth, hidden) in {
        "fast": (128, 16, 3, 64),
        "balanced": (256, 32, 4, 128),
        "high": (512, 64, 6, 256),
    }.items():
        c = get_config(name)
        assert (c.dim, c.num_lp, c.depth, c.hidden_dim, c.patch_size) == (dim, lp, depth, hidden, 2), name
    assert get_config("balanced").decoder_width == 512
    with pytest.raises(ValueError, match="decoder must be one of"):
        GINRConfig(decoder="mlp")
    with pytest.raises(ValueError, match="num_lp"):
        GINRConfig(num_lp=30)
    with pytest.raises(ValueError, match="unknown preset"):
        get_config("huge")
