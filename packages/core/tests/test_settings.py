"""One settings tree per system: preset <- --config FILE <- flags, frozen, one-line errors."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest
import torch
from memfit.errors import UsageError
from memfit.train.config import check_fields, from_dict
from memfit.train.settings import LoopConfig, Settings, TrainParser, override, tree_dict, write_run_config


@dataclass(frozen=True)
class Weights:
    a: float = 1.0
    b: float = 0.0

    def __post_init__(self) -> None:
        check_fields(self, a=">=0", b=">=0")


@dataclass(frozen=True)
class Model:
    width: int = 16
    deep: bool = False


@dataclass(frozen=True)
class Recipe:
    lr: float = 1e-3
    snr: tuple[float, float] | None = None
    loss: Weights = field(default_factory=Weights)
    data: str | None = None

    def __post_init__(self) -> None:
        check_fields(self, lr=">0")


PRESETS = {
    "small": Settings(Model(8), Recipe(), LoopConfig(steps=100)),
    "big": lambda device: Settings(Model(64, device.type == "cuda"), Recipe(lr=3e-4), LoopConfig(steps=500)),
}


def parser() -> TrainParser:
    p = TrainParser("toy", "a toy", PRESETS, default="small")
    g = p.group("toy")
    p.flag(g, "--width", path="model.width", help="width")  # type, action: from the field's annotation
    p.flag(g, "--deep", path="model.deep", help="deep")
    p.flag(g, "--lr", path="train.lr", help="learning rate")
    p.flag(g, "--snr", path="train.snr", type=float, nargs=2, help="snr range")
    p.flag(g, "--loss", path="train.loss", expand=True, help="weights",
           type=lambda s: {k: float(v) for k, v in (x.split("=") for x in s.split(","))})  # fmt: skip
    return p


def test_a_file_flag_is_stored_absolute_and_its_words_as_given(tmp_path, monkeypatch):
    """A run's config.json names the same data from any working directory: a file flag's relative path
    (and ~) is made absolute as the flags are read; the words it takes that are not paths stay."""
    p = parser()
    p.flag(p.group("data"), "--data", path="train.data", file=("synthetic",), help="data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    run = p.parse(["--data", "corpus/a.txt", "--runs_dir", str(tmp_path / "runs")])
    assert run.settings.train.data == str(tmp_path / "corpus" / "a.txt")
    assert p.parse(["--data", "~/b"]).settings.train.data == str(tmp_path / "home" / "b")
    assert p.parse(["--data", "synthetic"]).settings.train.data == "synthetic"
    assert p.parse([]).settings.train.data is None
    # a path in a --config file is opened from the working directory too, and stored as that
    cfg = tmp_path / "mine.json"
    cfg.write_text(json.dumps({"system": "toy", "train": {"data": "corpus/c.txt"}}))
    assert p.parse(["--config", str(cfg)]).settings.train.data == str(tmp_path / "corpus" / "c.txt")
    cfg.write_text(json.dumps({"system": "toy", "train": {"data": "synthetic"}}))
    assert p.parse(["--config", str(cfg)]).settings.train.data == "synthetic"


def test_override_replaces_nested_fields_validates_and_stays_frozen():
    s = PRESETS["small"]
    t = override(s, {"train.lr": 0.5, "train.loss.b": 2, "model": {"width": 3}})
    assert (t.train.lr, t.train.loss.b, t.model.width, t.train.loss.a) == (0.5, 2.0, 3, 1.0)
    assert isinstance(t.train.loss.b, float) and s.train.lr == 1e-3  # the original is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.train.lr = 1.0
    assert override(s, {"train.snr": [1, 2]}).train.snr == (1, 2)  # a JSON list back to a tuple
    bad_ones = [({"train.lrr": 1}, "is not a setting"), ({"train.lr": "x"}, "must be float"),
                ({"train.lr": 0}, "must be > 0, got 0"), ({"train.lr.x": 1}, "is a value")]  # fmt: skip
    for bad, problem in bad_ones:
        with pytest.raises(ValueError, match=problem):
            override(s, bad)


def test_from_dict_refuses_unknown_keys():
    assert from_dict(Model, {"width": 3}) == Model(3)
    with pytest.raises(ValueError, match="Model has no field 'widht'"):
        from_dict(Model, {"widht": 3})


def test_flags_override_the_preset_and_help_shows_every_presets_default(capsys):
    run = parser().parse(["--config", "big", "--lr", "0.01", "--loss", "b=0.5", "--snr", "0", "5"])
    s = run.settings
    assert run.preset == "big" and s.model.width == 64 and s.train.lr == 0.01 and s.loop.steps == 500
    assert s.train.loss == Weights(1.0, 0.5) and s.train.snr == (0.0, 5.0)
    assert {"train.lr", "train.loss.b", "train.snr"} <= run.given and "model.width" not in run.given
    with pytest.raises(SystemExit):
        parser().parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "width (default 8; --config big: 64)" in text
    assert "optimizer steps" in text and "--config big: 500" in text


def test_a_flag_takes_its_type_from_the_fields_annotation():
    run = parser().parse(["--width", "32", "--deep", "--lr", "0.01"])
    assert (run.settings.model.width, run.settings.model.deep, run.settings.train.lr) == (32, True, 0.01)
    assert parser().parse(["--config", "big", "--no-deep"]).settings.model.deep is False
    with pytest.raises(UsageError, match="--width: invalid int value: '1.5'"):
        parser().parse(["--width", "1.5"])
    p = parser()
    with pytest.raises(
        TypeError, match=r"flag --weights \(train.loss\): its field's type .*Weights.* give type="
    ):
        p.flag(p.group("x"), "--weights", path="train.loss", help="no flag form")


def test_a_time_budget_without_steps_trains_until_the_budget():
    s = parser().parse(["--max_minutes", "5"]).settings.loop
    assert s.steps is None and s.max_minutes == 5
    s = parser().parse(["--max_minutes", "5", "--steps", "7"]).settings.loop
    assert s.steps == 7


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--lrr", "1"], "unrecognized arguments: --lrr 1"),
        (["--lr", "0"], "--lr must be > 0, got 0"),
        (["--lr", "nan"], "--lr must be > 0, got nan"),
        (["--loss", "a=-1"], "--loss a must be >= 0"),
        (["--steps", "-1"], "--steps must be >= 1"),
        (["--run_name", "../x"], "--run_name must be one folder name"),
        (["--run_name", ""], "--run_name must be one folder name"),
        (["--config", "nope"], "neither a preset (small, big) nor a file"),
        (["--config", "missing.json"], "no such file"),
        (["--resume", "--overwrite"], "contradict"),
        (["--device", "tpu"], "unknown device"),
    ],
)
def test_bad_flags_are_one_line(argv, says):
    with pytest.raises(UsageError) as e:
        parser().parse(argv)
    assert says in str(e.value) and "\n" not in str(e.value)


@dataclass(frozen=True)
class Capped:
    width: int = 16
    cap: int = 32

    def __post_init__(self) -> None:
        if self.width > self.cap:
            raise ValueError(f"width must be <= {self.cap} here, got {self.width}")


def test_flags_every_preset_refuses_are_refused_before_the_device_is_resolved(monkeypatch):
    """`--lr 0` is refused before memfit.train.distributed (torch) resolves the device, in the line the
    full parse prints; a flag that some preset the run could start from accepts (the GPU preset's wider
    cap) waits for the device, which picks the preset."""
    from memfit.train import distributed

    presets = {
        "gpu": lambda d: Settings(Capped(cap=64 if d.type == "cuda" else 32), Recipe(), LoopConfig(steps=5)),
        "cpu": Settings(Capped(), Recipe(), LoopConfig(steps=5)),
    }

    def capped() -> TrainParser:
        p = TrainParser("toy", "a toy", presets, auto=("gpu", "cpu"))
        g = p.group("toy")
        p.flag(g, "--width", path="model.width", help="width")
        p.flag(g, "--lr", path="train.lr", help="learning rate")
        return p

    lines = {}
    for flag in ("--lr 0", "--width 48"):  # on the CPU both are refused, by every preset or by the one picked
        with pytest.raises(UsageError) as e:
            capped().parse([*flag.split(), "--device", "cpu"])
        lines[flag] = str(e.value)
    assert lines == {
        "--lr 0": "error: --lr must be > 0, got 0",
        "--width 48": "error: --width must be <= 32 here, got 48",
    }

    def no_device(*args, **kwargs):
        raise AssertionError("the device was resolved")

    parsers = [capped() for _ in range(5)]  # built first: --help's defaults ask torch for the device
    monkeypatch.setattr(distributed, "resolve_device", no_device)
    for config in ("auto", "cpu"):
        with pytest.raises(UsageError) as e:
            parsers.pop().parse(["--config", config, "--lr", "0", "--device", "cpu"])
        assert str(e.value) == lines["--lr 0"]
    with pytest.raises(UsageError, match="width must be <= 32 here"):  # both kinds of device refuse it
        parsers.pop().parse(["--config", "cpu", "--width", "48"])
    with pytest.raises(AssertionError, match="the device was resolved"):  # the GPU preset would take it
        parsers.pop().parse(["--width", "48", "--device", "cpu"])
    with pytest.raises(AssertionError, match="the device was resolved"):  # --resume reads the run's file
        parsers.pop().parse(["--resume", "--lr", "0"])


def test_config_file_sits_between_the_preset_and_the_flags(tmp_path):
    run = parser().parse(["--config", "big", "--lr", "0.02", "--run_name", "a", "--runs_dir", str(tmp_path)])
    write_run_config(tmp_path, "toy", run.preset, run.settings.model, run.settings)
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["preset"] == "big" and doc["config"] == {"width": 64, "deep": False}
    assert doc["train"] == tree_dict(run.settings.train) and doc["loop"]["run_name"] == "a"
    again = parser().parse(["--config", str(tmp_path / "config.json"), "--width", "5"])
    assert again.preset == "big" and again.settings.train.lr == 0.02 and again.settings.model.width == 5
    assert again.settings.loop.steps == 500
    (tmp_path / "bad.json").write_text(json.dumps({"train": {"lr": 1, "oops": 2}}))
    with pytest.raises(UsageError, match=r"train.oops in --config .*bad.json is not a setting"):
        parser().parse(["--config", str(tmp_path / "bad.json")])
    (tmp_path / "other.json").write_text(json.dumps({"system": "gpt2-window"}))
    with pytest.raises(
        UsageError, match="holds gpt2-window settings, not toy; use `memfit train gpt2-window`"
    ):
        parser().parse(["--config", str(tmp_path / "other.json")])


def test_resume_reads_the_runs_own_settings_and_flags_still_win(tmp_path):
    argv = ["--config", "big", "--lr", "0.02", "--runs_dir", str(tmp_path), "--max_minutes", "9"]
    first = parser().parse(argv)
    run_dir = first.settings.loop.run_dir("toy")
    write_run_config(run_dir, "toy", first.preset, first.settings.model, first.settings)
    resumed = parser().parse(["--resume", "--runs_dir", str(tmp_path), "--steps", "600"])
    s = resumed.settings
    assert resumed.preset == "big" and s.train.lr == 0.02 and s.loop.max_minutes == 9 and s.loop.steps == 600
    assert resumed.device == torch.device("cpu")


def test_a_switch_is_spelled_with_underscores_and_the_older_hyphen_still_works():
    """--x / --no_x, as every other memfit flag; --no-x (argparse's spelling, which earlier versions
    printed) still parses, is named in --help, and stays out of the usage line. A flag whose name starts
    with "no" is not taken for a negation."""
    import argparse

    from memfit.train.flags import BooleanFlag

    p = argparse.ArgumentParser(prog="t")
    p.add_argument("--remix", action=BooleanFlag, default=True, help="mix")
    p.add_argument("--noisy_phase", action=BooleanFlag, default=False, help="phase")
    assert p.parse_args([]).remix is True
    assert p.parse_args(["--no_remix"]).remix is False
    assert p.parse_args(["--no-remix"]).remix is False
    assert p.parse_args(["--no_remix", "--remix"]).remix is True
    assert p.parse_args(["--noisy_phase"]).noisy_phase is True
    assert p.parse_args(["--no_noisy_phase"]).noisy_phase is False
    usage, text = p.format_usage(), p.format_help()
    assert "[--remix | --no_remix]" in usage and "--no-remix" not in usage
    assert "also --no-remix, the older spelling" in " ".join(text.split())


def test_summary_of_reads_a_docstring_without_importing_the_module(monkeypatch):
    """A command's torch-free flags describe it with the first line of the module that does the work."""
    import sys

    from memfit.train.flags import summary_of

    monkeypatch.delitem(sys.modules, "memfit.estimate.timeline", raising=False)
    line = summary_of("memfit.estimate.timeline")
    assert "memfit.estimate.timeline" not in sys.modules
    from memfit.estimate import timeline

    assert line == timeline.__doc__.splitlines()[0] and line
    with pytest.raises(ModuleNotFoundError):
        summary_of("memfit.no_such_module")
