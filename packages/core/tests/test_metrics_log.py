"""The one metrics writer: JSON lines always, TensorBoard events with --tensorboard (optional extra)."""

import builtins
import importlib.util
import json

import pytest
import torch
from memfit.errors import UsageError
from memfit.train.loop import Trainer, step_generator
from memfit.train.metrics_log import MetricsLog
from memfit.train.settings import LoopConfig, TrainRun
from torch import nn


def _trainer(run_dir, steps, **loop):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def batch(step, micro):
        x = torch.randn(8, 4, generator=step_generator(0, step, micro))
        return x, x.sum(1, keepdim=True)

    resume = loop.pop("resume", False)
    cfg = LoopConfig(steps=steps, log_every=1, save_every=2, amp="none", progress=False, device="cpu", **loop)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                   lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), batch, TrainRun.of(cfg, resume=resume),
                   run_dir=run_dir)  # fmt: skip


def test_tensorboard_without_the_extra_is_one_line(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(UsageError) as e:
        MetricsLog(tmp_path / "metrics.jsonl", tensorboard=True)
    assert "--extra tensorboard" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError, match="tensorboard extra"):
        _trainer(tmp_path / "run", 2, tensorboard=True)
    assert not (tmp_path / "run" / ".lock").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="the optional tensorboard extra is not installed (uv sync --all-packages --extra tensorboard)",
)
def test_tensorboard_events_match_metrics_jsonl_and_resume_purges(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _trainer(tmp_path, 4, tensorboard=True).fit()
    (tmp_path / "ckpt_0000004.pt").unlink()
    _trainer(tmp_path, 4, tensorboard=True, resume=True).fit()  # resumes at 2: steps 3, 4 again
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("loss")
    assert [e.step for e in events] == [1, 2, 3, 4]
    for e in events:
        assert e.value == pytest.approx(losses[e.step], rel=1e-6)
