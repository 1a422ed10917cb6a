"""The triplane generator: image -> image tokens -> triplane transformer -> upsampler -> renderable planes.

The seed's failure was the self-attention over 3 x 64 x 64 = 12,288 triplane tokens: nn.MultiheadAttention
materialises a (batch, heads, 12288, 12288) fp32 score matrix, 36 GiB at batch 4 with 16 heads. Here
self-attention goes through memfit.ops.attention (SDPA / flash: memory linear in tokens); `attention="naive"`
takes the seed's materialised path (``baselines.NaiveSelfAttention``), the baseline it is measured against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from memfit.ops.attention import attention
from memfit.ops.layers import CrossAttention, FeedForward, checkpointed
from torch import nn

from moremouse_triplane.baselines import NaiveSelfAttention
from moremouse_triplane.config import TriplaneConfig
from moremouse_triplane.render import PIXEL_FEATURES, TriplaneDecoder, render_triplane


class SelfAttention(nn.Module):
    """Multi-head self-attention with head_dim independent of width; x (B, N, dim) -> (B, N, dim)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, N, self.heads * self.head_dim))


# ----------------------------------------------------------------------------------------------------
# Image encoders
# ----------------------------------------------------------------------------------------------------


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dim // heads)
        self.ff = FeedForward(dim, mult=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class PatchEncoder(nn.Module):
    """A small trainable ViT: patchify, learned positions, pre-norm blocks -> (B, (H/p)(W/p), dim)."""

    def __init__(
        self, image_size: int, patch_size: int, dim: int, depth: int, heads: int, checkpoint: bool
    ) -> None:
        super().__init__()
        self.out_dim, self.image_size, self.checkpoint = dim, image_size, checkpoint
        self.patch = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        self.pos = nn.Parameter(torch.randn(1, (image_size // patch_size) ** 2, dim) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, 3, H, W) in [0, 1] -> tokens (B, T, dim)."""
        x = self.patch(images * 2.0 - 1.0).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = checkpointed(block, x, enabled=self.checkpoint)
        return self.norm(x)


# ----------------------------------------------------------------------------------------------------
# Triplane transformer and upsampler
# ----------------------------------------------------------------------------------------------------


class TriplaneBlock(nn.Module):
    """Pre-norm: self-attention over all triplane tokens, cross-attention to image tokens, feed-forward."""

    def __init__(self, cfg: TriplaneConfig, context_dim: int) -> None:
        super().__init__()
        d = cfg.width
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        attn = NaiveSelfAttention if cfg.attention == "naive" else SelfAttention
        self.attn = attn(d, cfg.heads, cfg.head_dim)
        self.xattn = CrossAttention(d, context_dim=context_dim, heads=cfg.heads, dim_head=cfg.head_dim)
        self.ff = FeedForward(d, mult=cfg.ff_mult)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """x (B, N, width), context (B, T, context_dim) -> (B, N, width)."""
        x = x + self.attn(self.norm1(x))
        x = x + self.xattn(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class TriplaneTransformer(nn.Module):
    """Learnable 3 x R x R tokens attending to themselves and to image tokens -> (B, 3, width, R, R)."""

    def __init__(self, cfg: TriplaneConfig, context_dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Parameter(torch.randn(1, cfg.num_tokens, cfg.width) * 0.02)
        self.global_proj = nn.Linear(context_dim, cfg.width) if cfg.global_context else None
        self.blocks = nn.ModuleList(TriplaneBlock(cfg, context_dim) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        B, R = context.shape[0], self.cfg.plane_res
        x = self.tokens.expand(B, -1, -1)
        if self.global_proj is not None:
            x = x + self.global_proj(context.mean(dim=1))[:, None, :]
        for block in self.blocks:
            x = checkpointed(block, x, context, enabled=self.cfg.checkpoint)
        x = self.norm(x)
        return x.view(B, 3, R, R, self.cfg.width).permute(0, 1, 4, 2, 3)


class Upsampler(nn.Module):
    """(B, 3, width, R, R) -> (B, 3, out_channels, 2R, 2R): ConvTranspose2d(k=2, s=2) or PixelShuffle."""

    def __init__(self, cfg: TriplaneConfig) -> None:
        super().__init__()
        if cfg.upsampler == "deconv":
            self.up = nn.ConvTranspose2d(cfg.width, cfg.out_channels, kernel_size=2, stride=2)
        else:
            self.up = nn.Sequential(nn.Conv2d(cfg.width, 4 * cfg.out_channels, 1), nn.PixelShuffle(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, three, C, R, _ = x.shape
        y = self.up(x.reshape(B * three, C, R, R))
        return y.view(B, three, *y.shape[1:])


class ViewEncoder(nn.Module):
    """A small CNN: input image (B, 3, H, W) -> per-pixel features (B, dim, H, W) for sample_view.

    Three scales (full, 1/2, 1/4 resolution) summed back at full resolution, plus the image mean of the
    coarsest: each pixel's feature sees its neighbourhood and the whole mouse (pose, size, where it is).
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, dim, 3, padding=1)
        self.conv2 = nn.Conv2d(dim, 2 * dim, 3, stride=2, padding=1)
        self.conv3 = nn.Conv2d(2 * dim, 2 * dim, 3, stride=2, padding=1)
        self.out1, self.out2 = nn.Conv2d(dim, dim, 1), nn.Conv2d(2 * dim, dim, 1)
        self.out3, self.out_global = nn.Conv2d(2 * dim, dim, 1), nn.Linear(2 * dim, dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h1 = F.silu(self.conv1(images * 2.0 - 1.0))
        h2 = F.silu(self.conv2(h1))
        h3 = F.silu(self.conv3(h2))
        size = images.shape[-2:]
        y = self.out1(h1) + F.interpolate(self.out2(h2), size=size, mode="bilinear", align_corners=False)
        y = y + F.interpolate(self.out3(h3), size=size, mode="bilinear", align_corners=False)
        return y + self.out_global(h3.mean(dim=(2, 3)))[:, :, None, None]


class TriplaneGenerator(nn.Module):
    """Input image (B, 3, H, W) -> triplanes (B, 3, out_channels, 2R, 2R); render() turns them into pixels."""

    def __init__(self, cfg: TriplaneConfig, encoder: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = encoder or PatchEncoder(
            cfg.image_size,
            cfg.patch_size,
            cfg.encoder_dim,
            cfg.encoder_depth,
            cfg.encoder_heads,
            cfg.checkpoint,
        )
        self.transformer = TriplaneTransformer(cfg, context_dim=self.encoder.out_dim)
        self.upsampler = Upsampler(cfg)
        self.view_encoder = ViewEncoder(cfg.view_features) if cfg.view_features else None
        extra = PIXEL_FEATURES + cfg.view_features if cfg.pixel_features else 0
        self.decoder = TriplaneDecoder(
            cfg.out_channels, cfg.decoder_hidden, cfg.decoder_layers, cfg.combine, extra=extra
        )

    def forward(
        self,
        images: torch.Tensor,
        rays_o: torch.Tensor | None = None,
        rays_d: torch.Tensor | None = None,
        jitter: torch.Tensor | None = None,
        input_K: torch.Tensor | None = None,
        input_c2w: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """images (B, 3, H, W) in [0, 1] -> planes (B, 3, C, 2R, 2R); with rays (B, R, 3): rgb (B, R, 3).

        Rendering happens inside forward when rays are given, so DDP sees one forward per step.
        With cfg.pixel_features the input camera (input_K (B, 3, 3), input_c2w (B, 4, 4)) is needed too.
        """
        planes = self.upsampler(self.transformer(self.encoder(images)))
        if rays_o is None or rays_d is None:
            return planes
        view = (images, input_K, input_c2w) if self.cfg.pixel_features else None
        return self.render(planes, rays_o, rays_d, jitter, view=view)[0]

    def render(
        self,
        planes: torch.Tensor,
        rays_o: torch.Tensor,
        rays_d: torch.Tensor,
        jitter: torch.Tensor | None = None,
        view: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """planes, rays (B, R, 3) -> rgb (B, R, 3) on white, opacity (B, R); view: (input image, K, c2w),
        required with cfg.pixel_features."""
        c = self.cfg
        if c.pixel_features and (view is None or view[1] is None or view[2] is None):
            raise ValueError("pixel_features: render needs the input view (image, K, c2w)")
        if c.pixel_features and self.view_encoder is not None:  # sample the CNN's features with the rgb
            view = (torch.cat([view[0], self.view_encoder(view[0]).to(view[0].dtype)], dim=1), *view[1:])
        return render_triplane(
            self.decoder,
            planes,
            rays_o,
            rays_d,
            n_samples=c.samples_per_ray,
            bbox=c.bbox,
            jitter=jitter,
            chunk=c.render_chunk,
            use_checkpoint=c.render_checkpoint,
            view=view if c.pixel_features else None,
            carve=c.carve,
            hull_probes=c.hull_probes,
        )

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """MSE between rendered and true colours of the batch's rays (a random subset of target pixels)."""
        return ray_loss(self, batch)


def ray_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """MSE of model(images, rays) against the rays' true colours; model may be DDP-wrapped."""
    rgb = model(
        batch["images"],
        batch["rays_o"],
        batch["rays_d"],
        batch.get("jitter"),
        batch.get("input_K"),
        batch.get("input_c2w"),
    )
    return F.mse_loss(rgb, batch["rgb"].float())


def build_model(cfg: TriplaneConfig, encoder: nn.Module | None = None) -> TriplaneGenerator:
    """The generator for cfg (on the current default device)."""
    return TriplaneGenerator(cfg, encoder)
