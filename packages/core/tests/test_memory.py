"""The estimator (fake tensors) against real measured peaks, and the scaling laws it must reproduce."""

import math
import resource

import pytest
import torch
import torch.nn.functional as F
from memfit.estimate.steps import estimate_training_step, measure_peak, measure_training_step, memtracker_peak
from memfit.step import TrainStep
from torch import nn


class NaiveAttentionBlock(nn.Module):
    """One pre-norm attention block whose attention materialises the (L, L) scores."""

    def __init__(self, dim=64, heads=4, fused=False):
        super().__init__()
        self.heads, self.fused = heads, fused
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = ((q @ k.transpose(-2, -1)) / math.sqrt(D // self.heads)).softmax(-1) @ v
        return x + self.out(y.transpose(1, 2).reshape(B, L, D))


class CheckpointedMLP(nn.Module):
    def __init__(self, dim=128, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(depth)
        )

    def forward(self, x):
        for b in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
        return x


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class CustomFnModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(96, 96)

    def forward(self, x):
        return Square.apply(self.lin(x))


def mse(model, x):
    return model(x).float().pow(2).mean()


def _step(build, shape, amp=None):
    return TrainStep(build, lambda d: torch.randn(*shape, device=d), mse, amp_dtype=amp)


CASES = {
    "mlp": _step(lambda: nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)), (512, 256)),
    "attention": _step(lambda: NaiveAttentionBlock(64, 4), (4, 256, 64)),
    "attention-sdpa-bf16": _step(
        lambda: NaiveAttentionBlock(64, 4, fused=True), (4, 256, 64), torch.bfloat16
    ),
    "conv": _step(
        lambda: nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10),
        ),
        (8, 3, 64, 64),
    ),
    "checkpoint": _step(lambda: CheckpointedMLP(), (256, 128)),
    "custom-function": _step(CustomFnModel, (512, 96)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_estimate_matches_measured_cpu_peak(name):
    step = CASES[name]
    est = estimate_training_step(step)
    real = measure_training_step(step)
    assert real.peak_bytes > 0
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.15 * real.peak_bytes, (est.format(), real.format())
    assert est.params == real.params


def test_estimate_breakdown_adds_up_and_sees_optimizer_state():
    est = estimate_training_step(CASES["mlp"])
    assert sum(est.by_category.values()) == est.peak_bytes
    n = est.params
    # AdamW keeps two fp32 moments per parameter once the first step has run
    assert est.by_category["optimizer"] >= 2 * 4 * n
    assert est.by_category["params"] >= 4 * n
    assert set(est.by_module) == {"0", "1", "2"}


def test_estimate_is_free_at_paper_size():
    """A step that would need ~12 GiB of real memory is estimated without allocating it."""
    step = _step(
        lambda: nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096)), (65536, 4096)
    )
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with measure_peak() as m:
        est = estimate_training_step(step)
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert est.peak_gib > 5
    assert m.peak_bytes < 2**20  # no real tensor was allocated
    assert rss_growth < 2**30


def _fit_exponent(xs, ys):
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


@pytest.mark.parametrize("fused,lo,hi", [(False, 1.7, 2.1), (True, 0.85, 1.15)])
def test_attention_memory_scaling(fused, lo, hi):
    """Naive attention's activation memory grows ~N^2, SDPA's ~N (estimated at N, 2N, 4N)."""
    ns, peaks = [1024, 2048, 4096], []
    for n in ns:
        step = _step(lambda: NaiveAttentionBlock(128, 4, fused=fused), (2, n, 128))
        peaks.append(estimate_training_step(step).by_category["activations"])
    k = _fit_exponent(ns, peaks)
    assert lo <= k <= hi, (k, peaks)


def test_measure_peak_counts_live_tensors_only():
    with measure_peak() as m:
        a = torch.empty(1024, 1024)  # 4 MiB
        b = torch.empty(512, 1024)  # 2 MiB, live together with a
        del a, b
        c = torch.empty(256, 1024)  # 1 MiB after both were freed
        del c
    assert m.peak_bytes == 6 * 2**20


@pytest.mark.parametrize("name", ["attention", "checkpoint"])
def test_estimate_agrees_with_pytorch_memtracker(name):
    """An independent accounting of the same fake step: PyTorch's own MemTracker."""
    theirs = memtracker_peak(CASES[name])
    ours = estimate_training_step(CASES[name]).peak_bytes
    assert abs(ours - theirs) <= 0.05 * theirs, (ours, theirs)


def test_measure_peak_does_not_count_views_of_older_tensors():
    x = torch.empty(1024, 1024)  # made before the context: not counted
    with measure_peak() as m:
        v = x[:512].transpose(0, 1)  # a view: no new memory
        y = v.contiguous()  # 2 MiB copy: counted
        del v, y
    assert m.peak_bytes == 2 * 2**20
