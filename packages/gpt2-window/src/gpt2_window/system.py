"""gpt2-window as memfit sees it: train/eval commands and the budget rows of `memfit budget`."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from memfit.system import BudgetEntry, Scaling, System, parse_then_run

from gpt2_window.config import GPTConfig, get_config

if TYPE_CHECKING:  # torch loads when a step is built: `memfit systems` and `--help` stay fast
    from memfit.step import TrainStep

PAPER_BATCH, PAPER_T = 4, 1024


def gpt_step(cfg: GPTConfig, batch: int, T: int, amp_dtype: Any = "bf16") -> TrainStep:
    """One training step of GPT(cfg) on random tokens (batch, T), with the AdamW the app trains with;
    amp_dtype: a torch dtype, None, or its name ("bf16", "fp16", "none")."""
    import torch
    from memfit.step import AMP_DTYPES, TrainStep

    from gpt2_window.model import GPT, make_optimizer

    amp_dtype = AMP_DTYPES[amp_dtype] if isinstance(amp_dtype, str) else amp_dtype
    vocab = cfg.vocab_size

    def make_batch(device):
        x = torch.randint(0, vocab, (batch, T), device=device)
        return x, torch.randint(0, vocab, (batch, T), device=device)

    return TrainStep(
        build_model=lambda: GPT(cfg),
        make_batch=make_batch,
        loss=lambda model, b: model(*b)[1],
        optimizer=lambda params: make_optimizer(params),
        amp_dtype=amp_dtype,
    )


def _calibration(cfg: GPTConfig, amp_dtype: Any) -> TrainStep:
    """The same variant shrunk to run for real on CPU in well under a second (T > window: band path)."""
    small = replace(cfg, n_layer=2, n_head=2, n_embd=64, block_size=256, vocab_size=512)
    if cfg.window is not None:
        small = replace(small, window=32)
    return gpt_step(small, 2, 256, amp_dtype)


def budget_entries() -> list[BudgetEntry]:
    """d12 (124M) at batch 4 x 1024 tokens: causal, window 64 (bf16 and fp32), and the seed's baseline."""
    rows = [
        ("causal", get_config("d12"), "bf16", "bf16", 6.0, False, "causal SDPA"),
        ("window", get_config("d12_window"), "bf16", "bf16", 6.0, False, "window 64"),
        ("window-fp32", get_config("d12_window"), None, "fp32", 10.5, False, "window 64, no autocast"),
        (
            "window-seed",
            get_config("d12_window", attn_impl="seed"),
            "bf16",
            "bf16",
            None,
            True,
            "window 64, the seed's B=H=1 mask cache broadcast to dense (B, H, T, T) masks",
        ),
    ]
    return [
        BudgetEntry(
            variant=variant,
            step=gpt_step(cfg, PAPER_BATCH, PAPER_T, amp),
            batch=PAPER_BATCH,
            dtype=dtype,
            budget_gib=budget,
            is_baseline=baseline,
            config=f"d12 GPT-2 124M, T {PAPER_T}, {what}",
            calibration=_calibration(cfg, amp),
            make_step=lambda b, ckpt, cfg=cfg, amp=amp: gpt_step(
                replace(cfg, checkpoint=ckpt), b, PAPER_T, amp
            ),
            scaling=Scaling(
                label="sequence length T (batch 4)",
                sizes=[256, 512, 1024],
                make_step=lambda T, cfg=cfg, amp=amp: gpt_step(cfg, PAPER_BATCH, T, amp),
            ),
        )
        for variant, cfg, amp, dtype, budget, baseline, what in rows
    ]


SYSTEM = System(
    name="gpt2-window",
    summary="GPT-2 with sliding-window attention that never costs more memory than causal (124M parameters "
    "at paper size)",
    train="gpt2_window.train:main",
    eval=parse_then_run("gpt2_window.flags:eval_args", "gpt2_window.eval:run"),
    budgets=budget_entries,
    extra_commands={"generate": parse_then_run("gpt2_window.flags:generate_args", "gpt2_window.sample:run")},
    config_cls=GPTConfig,
    build_model="gpt2_window.model:GPT",
    tags=("text-generation", "gpt2", "sliding-window-attention"),
)

# The package's console aliases (pyproject [project.scripts]): exit 0 on success, 2 on bad input.
train_cli = SYSTEM.command("train")
eval_cli = SYSTEM.command("eval")
