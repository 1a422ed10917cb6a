"""The training toolkit, one import away: re-exports of the loop, checkpoint, distributed and flag modules.

Where each part lives: ``memfit.loop`` (Trainer, seeding, LR schedule), ``memfit.checkpoint`` (checkpoint
files), ``memfit.distributed`` (device, torchrun), ``memfit.flags`` (LoopConfig and the shared flags),
``memfit.metrics_log`` (metrics.jsonl), ``memfit.layers.checkpointed`` (activation checkpointing).
"""

from memfit.checkpoint import (
    BEST_NAME,
    CKPT_PATTERN,
    find_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    write_atomic,
)
from memfit.distributed import DistInfo, dist_info, init_distributed, resolve_device
from memfit.flags import (
    LoopConfig,
    add_eval_args,
    add_loop_args,
    add_model_args,
    apply_threads,
    check_numbers,
    eval_out_dir,
    hidden_alias,
    loop_config_from_args,
)
from memfit.layers import checkpointed
from memfit.loop import Trainer, autocast_context, set_seed, step_generator, warmup_cosine_lambda
from memfit.metrics_log import MetricsLog

__all__ = [
    "BEST_NAME",
    "CKPT_PATTERN",
    "DistInfo",
    "LoopConfig",
    "MetricsLog",
    "Trainer",
    "add_eval_args",
    "add_loop_args",
    "add_model_args",
    "apply_threads",
    "eval_out_dir",
    "hidden_alias",
    "autocast_context",
    "check_numbers",
    "checkpointed",
    "dist_info",
    "find_checkpoint",
    "init_distributed",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "loop_config_from_args",
    "resolve_device",
    "save_checkpoint",
    "set_seed",
    "step_generator",
    "warmup_cosine_lambda",
    "write_atomic",
]
