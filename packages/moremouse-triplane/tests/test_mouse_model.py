"""The generator's pieces: shapes, SDPA vs materialised attention, checkpointing, a plugged-in encoder."""

import pytest
import torch
from moremouse_triplane.baselines import NaiveSelfAttention
from moremouse_triplane.config import TriplaneConfig, get_config
from moremouse_triplane.model import SelfAttention, build_model
from moremouse_triplane.system import random_batch
from torch import nn


def test_tiny_shapes_and_render():
    torch.manual_seed(0)
    cfg = get_config("tiny")
    model = build_model(cfg)
    b = random_batch(cfg, 2, torch.device("cpu"))
    planes = model(b["images"])
    assert planes.shape == (2, 3, cfg.out_channels, cfg.out_res, cfg.out_res)
    rgb = model(b["images"], b["rays_o"], b["rays_d"], b["jitter"])
    assert rgb.shape == (2, cfg.rays_per_scene, 3) and ((rgb >= 0) & (rgb <= 1)).all()


def test_paper_preset_matches_table_a3():
    cfg = get_config("paper")
    assert cfg.num_tokens == 12_288 and (cfg.width, cfg.heads, cfg.head_dim, cfg.depth) == (512, 16, 64, 12)
    assert (cfg.out_channels, cfg.out_res, cfg.decoder_hidden, cfg.samples_per_ray, cfg.encoder_dim) == (
        80,
        128,
        64,
        128,
        768,
    )


def test_sdpa_attention_matches_materialised_reference():
    torch.manual_seed(0)
    fast, naive = SelfAttention(32, 4, 16), NaiveSelfAttention(32, 4, 16)
    naive.load_state_dict(fast.state_dict())
    x = torch.randn(2, 48, 32)
    y1, y2 = fast(x), naive(x)
    torch.testing.assert_close(y1, y2, atol=1e-5, rtol=1e-5)
    g1 = torch.autograd.grad(y1.square().sum(), fast.qkv.weight)[0]
    g2 = torch.autograd.grad(y2.square().sum(), naive.qkv.weight)[0]
    torch.testing.assert_close(g1, g2, atol=1e-4, rtol=1e-4)


def test_checkpointing_changes_memory_not_results():
    torch.manual_seed(0)
    cfg = get_config("tiny", render_chunk=100)
    plain = build_model(cfg)
    ckpt = build_model(get_config("tiny", render_chunk=100, checkpoint=True, render_checkpoint=True))
    ckpt.load_state_dict(plain.state_dict())
    b = random_batch(cfg, 2, torch.device("cpu"))
    l1, l2 = plain.loss(b), ckpt.loss(b)
    torch.testing.assert_close(l1, l2)
    g1 = torch.autograd.grad(l1, list(plain.parameters()))
    g2 = torch.autograd.grad(l2, list(ckpt.parameters()))
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-4)


class _PoolEncoder(nn.Module):
    """A stand-in for a pretrained backbone: 4x4 average-pooled pixels as 48-d tokens."""

    out_dim = 48

    def forward(self, images):
        x = nn.functional.avg_pool2d(images, 8)  # (B, 3, 4, 4)
        return x.flatten(2).transpose(1, 2).repeat(1, 1, 16)


def test_pluggable_encoder_and_pixelshuffle_upsampler():
    cfg = get_config("tiny", upsampler="pixelshuffle", combine="sum")
    model = build_model(cfg, encoder=_PoolEncoder())
    planes = model(torch.rand(2, 3, 32, 32))
    assert planes.shape == (2, 3, cfg.out_channels, 16, 16)
    assert model.transformer.blocks[0].xattn is not None


def test_view_features_reach_the_decoder_and_learn():
    """With view_features the decoder reads a CNN feature map of the input image where each point
    projects: it changes what is rendered, and the CNN gets gradients from the ray loss."""
    torch.manual_seed(0)
    cfg = get_config("cpu", view_features=8)
    model = build_model(cfg)
    assert model.decoder.layers[0].in_features == 3 * cfg.out_channels + 4 + 8
    b = random_batch(cfg, 2, torch.device("cpu"))
    loss = model.loss(b)
    loss.backward()
    grads = [p.grad for p in model.view_encoder.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
    with torch.no_grad():
        model.view_encoder.out_global.bias.add_(1.0)
        assert model.loss(b) != loss


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="view_features needs pixel_features"):
        get_config("tiny", view_features=8)
    with pytest.raises(ValueError, match="carve needs pixel_features"):
        get_config("tiny", carve=0.01)
    with pytest.raises(ValueError, match="attention"):
        TriplaneConfig(attention="flash3")
    with pytest.raises(ValueError, match="patch_size"):
        get_config("tiny", patch_size=5)
    with pytest.raises(ValueError, match="unknown preset"):
        get_config("huge")
