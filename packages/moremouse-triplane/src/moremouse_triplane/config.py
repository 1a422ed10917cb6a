"""Configuration of the triplane generator: one dataclass, presets (`paper`, `tiny`, `cpu`), and the
training recipe that `train` uses for a preset when its flags leave a choice open."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from memfit.train import config
from memfit.train.config import COUNT0, RATE, STEPS, WEIGHT, check_config
from memfit.train.settings import LoopConfig, Settings

# The generated scenes' splits and the number each mixes into a scene's seed (data._scene_seed): a scene of
# one split is never one of another's (`make-data --split`, `eval --split`).
SPLIT_IDS = {"train": 0, "val": 1, "test": 2}


@dataclass(frozen=True)
class TriplaneConfig:
    """Image encoder -> triplane transformer -> upsampler -> triplane decoder + volume renderer."""

    # image encoder (ViT-style patch encoder; the paper uses a frozen DINOv2 ViT-B/14 with 768-d tokens)
    image_size: int = 256
    patch_size: int = 16
    encoder_dim: int = 768
    encoder_depth: int = 12
    encoder_heads: int = 12
    # triplane transformer (paper Table A3): 3 x 64 x 64 learnable tokens, width 512, 16 heads x 64
    plane_res: int = 64
    width: int = 512
    heads: int = 16
    head_dim: int = 64  # separate from width / heads: 16 x 64 = 1024 inner width, as in the paper
    depth: int = 12
    ff_mult: int = 4
    # add a projection of the mean image token to every triplane token before the blocks: a direct path
    # from the image to all of the planes (cross-attention alone learns to use the image slowly)
    global_context: bool = False
    attention: str = "sdpa"  # "sdpa" (memfit.ops.attention) | "naive" (materialised scores, the seed's)
    checkpoint: bool = True  # per-block activation checkpointing
    # how the model runs or samples, not what it computes: `train --resume` may change these
    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = (
        "checkpoint",
        "attention",
        "render_chunk",
        "render_checkpoint",
        "rays_per_scene",
        "samples_per_ray",
    )
    # upsampler: 64 x 64 x 512 -> 128 x 128 x 80
    upsampler: str = "deconv"  # "deconv" (ConvTranspose2d k=2 s=2) | "pixelshuffle"
    out_channels: int = 80
    # decoder MLP and renderer
    combine: str = "concat"  # how the three plane features are merged: "concat" | "sum"
    decoder_hidden: int = 64
    # also feed the decoder the input image's colour where each sample point projects into the input
    # view, and the point's depth there (PixelNeRF-style): what the camera saw lines up with 3D at once
    pixel_features: bool = False
    # with pixel_features: also sample this many channels of a small CNN's feature map of the input image
    # (0: rgb + depth only). Features with context say what surface a pixel shows and, with the point's
    # depth, whether the point is in front of it, on it or behind it: what rgb alone cannot tell
    view_features: int = 0
    # with pixel_features: > 0 makes points empty where the input view sees background (every channel
    # within `carve` of white), one view's visual hull on a white background; the decoder runs only on
    # the points inside it (0: off, the decoder decides everywhere)
    carve: float = 0.0
    # with carve: probe each ray at this many points for the hull first and spread samples_per_ray
    # samples over the part inside it, not over the whole box (0: the whole box)
    hull_probes: int = 0
    decoder_layers: int = 2  # hidden layers of the MLP
    samples_per_ray: int = 128
    bbox: float = 1.0  # scene lives in [-bbox, bbox]^3
    render_chunk: int = 1024  # rays per image rendered at once
    render_checkpoint: bool = True  # recompute each ray chunk in backward: render memory = one chunk
    # training-time ray budget per scene (random subset of target-view pixels)
    rays_per_scene: int = 4096
    num_targets: int = 4  # target views per scene
    RANGES: ClassVar[dict[str, str]] = {
        **dict.fromkeys(("image_size", "patch_size", "encoder_dim", "encoder_depth", "encoder_heads",
                         "plane_res", "width", "heads", "head_dim", "depth", "ff_mult", "out_channels",
                         "decoder_hidden", "decoder_layers", "num_targets"), "[1, 2**16]"),
        **dict.fromkeys(("rays_per_scene", "render_chunk"), "[1, 2**24]"),
        "samples_per_ray": "[2, 2**16]",
        **dict.fromkeys(("view_features", "hull_probes"), "[0, 2**16]"),
        "carve": "[0, 1)",
        "bbox": "(0, 1e6]",
    }  # fmt: skip

    def __post_init__(self) -> None:
        check_config(self)  # sizes first: the checks below divide by them
        checks = [
            (self.image_size % self.patch_size == 0, "image_size must be a multiple of patch_size"),
            (self.encoder_dim % self.encoder_heads == 0, "encoder_dim must be divisible by encoder_heads"),
            (
                self.attention in ("sdpa", "naive"),
                f"attention must be 'sdpa' or 'naive', got {self.attention!r}",
            ),
            (
                self.upsampler in ("deconv", "pixelshuffle"),
                f"upsampler must be deconv|pixelshuffle, got {self.upsampler!r}",
            ),
            (self.combine in ("concat", "sum"), f"combine must be 'concat' or 'sum', got {self.combine!r}"),
            (self.pixel_features or not self.view_features, "view_features needs pixel_features"),
            (self.pixel_features or not self.carve, "carve needs pixel_features"),
            (self.carve or not self.hull_probes, "hull_probes needs carve > 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"TriplaneConfig: {msg}")

    @property
    def num_tokens(self) -> int:
        """Triplane tokens the transformer attends over: 3 x plane_res^2 (12,288 for the paper)."""
        return 3 * self.plane_res**2

    @property
    def out_res(self) -> int:
        """Resolution of the upsampled planes (2 x plane_res)."""
        return 2 * self.plane_res


PRESETS: dict[str, TriplaneConfig] = {
    "paper": TriplaneConfig(),
    # Small enough to train on 2 CPU cores in minutes: 3 x 8 x 8 tokens, 32 x 32 images.
    "tiny": TriplaneConfig(
        image_size=32,
        patch_size=4,
        encoder_dim=64,
        encoder_depth=2,
        encoder_heads=4,
        plane_res=8,
        width=64,
        heads=4,
        head_dim=16,
        depth=2,
        checkpoint=False,
        out_channels=16,
        decoder_hidden=32,
        samples_per_ray=32,
        render_chunk=4096,
        render_checkpoint=False,
        rays_per_scene=256,
        num_targets=3,
    ),
}
# The CPU recipe's model (`--config cpu`, and `auto` without a GPU): the tiny transformer, plus what
# short measured runs showed it needs to get past a grey "average mouse" blob in 20 CPU minutes:
# pixel-aligned input features (colour, a CNN feature map of the input image, the point's depth),
# the mean image token added to every triplane token, carving by the input view's silhouette (the
# decoder only runs inside it: ~2x faster steps) and 64 samples per ray. See the README's Learning row.
PRESETS["cpu"] = replace(
    PRESETS["tiny"],
    pixel_features=True,
    view_features=32,
    carve=0.01,
    global_context=True,
    decoder_hidden=96,
    samples_per_ray=64,
)


def get_config(name: str, **overrides: Any) -> TriplaneConfig:
    """A preset by name with field overrides, e.g. get_config("paper", attention="naive")."""
    return config.get_config(PRESETS, name, **overrides)


@dataclass(frozen=True)
class TrainConfig:
    """How `train` trains (settings.train): scenes, optimizer, schedule and validation."""

    data: str | None = None  # folder of renders (scene_*/cameras.json); None: generated mice
    num_scenes: int = 0  # cycle over this many generated scenes (0: new every time)
    batch_size: int = 4  # scenes per micro-batch
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 50
    schedule_steps: int | None = None  # length of the LR schedule (None: the run's steps)
    val_scenes: int = 8  # held-out scenes validated on (0: no validation, no best.pt)
    eval_every: int = 200  # validation on held-out scenes every N steps (best.pt by PSNR)

    RANGES: ClassVar[dict[str, str]] = {
        "num_scenes": COUNT0,
        "batch_size": "[1, 2**20]",
        "lr": RATE,
        "weight_decay": WEIGHT,
        "warmup": STEPS,
        "schedule_steps": "[1, 2**53]",
        "val_scenes": "[0, 2**20]",
        "eval_every": STEPS,
    }

    def __post_init__(self) -> None:
        check_config(self)


def _paper(name: str):
    def make(device) -> Settings:
        loop = LoopConfig(steps=600, log_every=20, save_every=200)
        return Settings(get_config(name), TrainConfig(), loop)

    return make


def _cpu(device) -> Settings:
    """The CPU recipe (`--config cpu`, and `auto` without a GPU): chosen by short measured runs (docs)."""
    loop = LoopConfig(steps=1000, amp="none", threads=1, log_every=20, save_every=1000)
    return Settings(get_config("cpu"), TrainConfig(lr=3e-3, eval_every=300), loop)


SETTINGS = {"paper": _paper("paper"), "tiny": _paper("tiny"), "cpu": _cpu}
