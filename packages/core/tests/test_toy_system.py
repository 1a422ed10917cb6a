"""A fifth system, defined here and registered through the contract alone (docs/adding-a-system.md):
a frozen model config and training recipe, settings presets and flags (memfit.train.settings), the Trainer,
one checkpoint schema and System.load_model. It trains end to end through `train`, evaluates through
`eval`, resumes, and refuses bad input like the four real systems do.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import pytest
import torch
from memfit import bare
from memfit.ops.layers import checkpointed
from memfit.system import System, available_systems, parse_then_run, register, unregister
from memfit.train.checkpoint import load_checkpoint
from memfit.train.config import check_fields
from memfit.train.flags import Parser, add_eval_args, apply_threads, eval_out_dir, export_eval_name
from memfit.train.loop import Trainer, step_generator
from memfit.train.run_dir import resolve_run
from memfit.train.settings import LoopConfig, Settings, TrainParser
from torch import nn

NAME = "toy-regression"
TRUE_W = torch.linspace(-1, 1, 4)


@dataclass(frozen=True)
class ToyConfig:
    width: int = 16
    checkpoint: bool = False


@dataclass(frozen=True)
class ToyTrain:
    lr: float = 0.05

    def __post_init__(self) -> None:
        check_fields(self, lr=">0")


PRESETS = {"tiny": ToyConfig(width=8), "small": ToyConfig(width=32)}
LOOP = LoopConfig(steps=40, log_every=5, save_every=10)
SETTINGS = {name: Settings(cfg, ToyTrain(), LOOP) for name, cfg in PRESETS.items()}


class ToyModel(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.body = nn.Sequential(nn.Linear(4, cfg.width), nn.Tanh(), nn.Linear(cfg.width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpointed(self.body, x, enabled=self.cfg.checkpoint).squeeze(-1)


def batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = step_generator(seed, step)
    x = torch.randn(64, 4, generator=g)
    return x, x @ TRUE_W


def mse(model: nn.Module, seed: int = 999) -> float:
    x, y = batch(seed, 0)
    with torch.no_grad():
        return (model(x) - y).pow(2).mean().item()


def train_main(argv: list[str] | None = None) -> dict:
    p = TrainParser(NAME, "train the toy", SETTINGS, default="tiny")
    g = p.group("toy")
    recompute = argparse.BooleanOptionalAction
    p.flag(g, "--checkpointing", path="model.checkpoint", action=recompute, help="recompute in backward")
    p.flag(g, "--lr", path="train.lr", type=float, help="learning rate")
    run = p.parse(argv)
    cfg, loop = run.settings.model, run.settings.loop
    torch.manual_seed(loop.seed)
    model = ToyModel(cfg)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=run.settings.train.lr),
        lambda m, b: (m(b[0]) - b[1]).pow(2).mean(),
        lambda step, micro: batch(loop.seed, step),
        run,
        eval_fn=lambda m: {"val_mse": mse(m)},
        eval_every=10,
        best_metric="val_mse",
        best_mode="min",
        config=cfg,
        meta={"preset": run.preset},
    )
    return trainer.fit()


def eval_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags (a real system keeps them in its torch-free flags.py)."""
    p = Parser()
    add_eval_args(p, NAME)
    return p.parse_args(argv)


def eval_run(args: argparse.Namespace) -> dict:
    apply_threads(args)
    path = resolve_run(args.run, NAME, args.runs_dir)
    out = eval_out_dir(args, path)
    model, state = SYSTEM.load_model(path, "cpu")
    result = {"mse": mse(model), "step": state["step"], "preset": state["meta"]["preset"]}
    (out / "eval.json").write_text(json.dumps(result))
    return result


SYSTEM = System(
    name=NAME,
    summary="a linear regression with a hidden layer: the contract's smallest user",
    train=train_main,
    eval=parse_then_run(eval_args, eval_run),
    config_cls=ToyConfig,
    build_model=ToyModel,
)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.delenv("MEMFIT_SYSTEM", raising=False)
    register(SYSTEM)
    yield SYSTEM
    unregister(NAME)


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_toy_system_trains_evaluates_and_resumes_through_the_contract(toy, tmp_path, capsys):
    assert NAME in available_systems()
    runs = ["--runs_dir", str(tmp_path), "--no_progress", "--amp", "none"]
    torch.manual_seed(0)
    untrained = mse(ToyModel(PRESETS["tiny"]))
    bare.train_main(["--system", NAME, *runs, "--steps", "20", "--run_name", "r", "--checkpointing"])
    run = tmp_path / NAME / "r"
    assert (run / "best.pt").exists() and (run / "ckpt_0000020.pt").exists()

    bare.eval_main(["--system", NAME, "--run", "r", "--runs_dir", str(tmp_path)])  # by name, as trained
    result = json.loads((run / "eval" / "eval.json").read_text())
    assert result["mse"] < 0.5 * untrained and result["preset"] == "tiny"
    best = [r for r in _rows(run / "metrics.jsonl") if "best_step" in r][-1]
    assert result["step"] == best["best_step"]  # eval used best.pt
    assert result["mse"] == pytest.approx(best["best/val_mse"], rel=1e-6)

    # --ema: validation, best.pt and eval all use the weight average, not the raw weights
    bare.train_main(["--system", NAME, *runs, "--steps", "20", "--run_name", "e", "--ema", "0.9"])
    bare.eval_main(["--system", NAME, "--run", "e", "--runs_dir", str(tmp_path)])
    ema_run = tmp_path / NAME / "e"
    averaged = json.loads((ema_run / "eval" / "eval.json").read_text())["mse"]
    best = [r for r in _rows(ema_run / "metrics.jsonl") if "best_step" in r][-1]
    assert averaged == pytest.approx(best["best/val_mse"], rel=1e-6)
    raw = ToyModel(PRESETS["tiny"])
    raw.load_state_dict(load_checkpoint(ema_run / "best.pt")["model"])
    assert mse(raw) != pytest.approx(averaged, rel=1e-3)
    with pytest.raises(SystemExit) as e:
        bare.train_main(["--system", NAME, *runs, "--ema", "1", "--run_name", "f"])
    assert e.value.code == 2 and "--ema must be in [0, 1)" in capsys.readouterr().err

    bare.train_main(["--system", NAME, *runs, "--steps", "30", "--run_name", "r", "--resume"])
    steps = [r["step"] for r in _rows(run / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(5, 31, 5))  # one row per logged step, none duplicated

    with pytest.raises(SystemExit) as e:  # the same run again, without --resume
        bare.train_main(["--system", NAME, *runs, "--steps", "30", "--run_name", "r"])
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bare.train_main(["--system", NAME, *runs, "--lr", "0", "--run_name", "s"])
    assert e.value.code == 2 and "--lr must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a checkpoint of this system, another config
        bare.train_main(["--system", NAME, *runs, "--config", "small", "--run_name", "r", "--resume"])
    assert e.value.code == 2 and "width 8 -> 32" in capsys.readouterr().err


def _train(tmp_path, *argv):
    bare.train_main(["--system", NAME, "--runs_dir", str(tmp_path), "--no_progress", "--amp", "none",
                     "--steps", "2", *argv])  # fmt: skip


def _memfit(capsys, *argv) -> tuple[int, str]:
    """(exit status, the last line of stderr) of `memfit ARGV`."""
    from memfit import cli

    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert "Traceback" not in "\n".join(err), err
    return e.value.code, err[-1] if err else ""


def test_an_exports_eval_never_lands_in_a_run_of_the_same_name(toy, tmp_path, capsys):
    """An exported folder is read only, so its eval results go beside the runs: under exported/<its folder
    name>/, a name `train` refuses, not runs_dir/<system>/<its folder name>/, where a run of that name keeps
    its own results."""
    _train(tmp_path, "--run_name", "r")
    _train(tmp_path, "--run_name", "exp", "--lr", "0.001")
    runs = ["--runs_dir", str(tmp_path)]
    bare.eval_main(["--system", NAME, "--run", "exp", *runs])
    own = tmp_path / NAME / "exp" / "eval" / "eval.json"
    before = own.read_text()
    folder = tmp_path / "elsewhere" / "exp"  # an export of run r that happens to be called like run exp
    assert _memfit(capsys, "export", str(tmp_path / NAME / "r"), "--out", str(folder))[0] == 0
    exported = sorted(p.name for p in folder.iterdir())
    bare.eval_main(["--system", NAME, "--run", str(folder), *runs])
    assert own.read_text() == before  # the run's results are its own
    result = json.loads(
        (tmp_path / NAME / "exported" / export_eval_name(folder) / "eval" / "eval.json").read_text()
    )
    assert result["mse"] != json.loads(before)["mse"]
    assert sorted(p.name for p in folder.iterdir()) == exported  # nothing written into the export
    # another export of the same name (of run exp) keeps its results apart from the first one's
    other = tmp_path / "other" / "exp"
    assert _memfit(capsys, "export", str(tmp_path / NAME / "exp"), "--out", str(other))[0] == 0
    bare.eval_main(["--system", NAME, "--run", str(other), *runs])
    second = tmp_path / NAME / "exported" / export_eval_name(other) / "eval" / "eval.json"
    assert json.loads(second.read_text())["mse"] == json.loads(before)["mse"]
    assert (
        json.loads(
            (tmp_path / NAME / "exported" / export_eval_name(folder) / "eval" / "eval.json").read_text()
        )
        == result
    )
    with pytest.raises(SystemExit) as e:  # and no run can take the folder these results live in
        _train(tmp_path, "--run_name", "exported")
    assert e.value.code == 2 and "run_name 'exported' is kept" in capsys.readouterr().err


def test_an_export_exports_as_a_copy_that_keeps_what_it_says_of_its_run(toy, tmp_path, capsys):
    """An exported folder given to `memfit export` is copied (weights checked by loading them) with its
    meta whole; --out inside it is refused naming it, not its parent folder."""
    from safetensors.torch import load_file

    _train(tmp_path, "--run_name", "r", "--steps", "10")
    bare.eval_main(["--system", NAME, "--run", "r", "--runs_dir", str(tmp_path)])
    first, second = tmp_path / "out" / "a", tmp_path / "out" / "b"
    assert _memfit(capsys, "export", str(tmp_path / NAME / "r"), "--out", str(first))[0] == 0
    assert _memfit(capsys, "export", str(first), "--out", str(second))[0] == 0
    meta = json.loads((first / "config.json").read_text())["meta"]
    assert meta["best"]["step"] == 10 and meta["evaluations"]["eval.json"]["step"] == 10
    assert json.loads((second / "config.json").read_text())["meta"] == meta
    weights = [load_file(folder / "model.safetensors") for folder in (first, second)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert (first / "README.md").read_text() == (second / "README.md").read_text()
    code, line = _memfit(capsys, "export", str(first), "--out", str(first / "inner"))
    assert code == 2 and f"--out {first / 'inner'} is inside the input {first}:" in line, line


def test_a_wrong_or_empty_run_names_a_command_that_exists(toy, tmp_path, capsys):
    """The hints of load_model's refusals (another system's checkpoint, a folder without one) are commands
    that run: `memfit eval S` / `memfit train S`, not `S eval`, which no script answers to."""
    import re
    from dataclasses import replace

    from memfit.errors import ModelFileError, ModelFileMissing

    _train(tmp_path, "--run_name", "r")
    other = register(replace(SYSTEM, name="toy-other"))
    try:
        with pytest.raises(ModelFileError) as wrong:
            other.load_model(tmp_path / NAME / "r")
        (tmp_path / "empty").mkdir()
        with pytest.raises(ModelFileMissing) as empty:
            SYSTEM.load_model(tmp_path / "empty")
    finally:
        unregister("toy-other")
    hints = [re.findall(r"`([^`]+)`", str(e.value)) for e in (wrong, empty)]
    assert hints == [[f"memfit eval {NAME}"], [f"memfit train {NAME}"]], hints
    for (hint,) in hints:  # each one answers (its --help) rather than being unknown
        code, _ = _memfit(capsys, *hint.split()[1:], "--help")
        assert code == 0, hint


def test_resume_of_a_run_name_that_holds_no_run_is_refused_naming_the_runs(toy, tmp_path, capsys):
    """--resume --run_name TYPO is one line naming the runs there, and starts nothing; a bare --resume
    with no run yet still starts one (the name is the default, not a typo)."""
    _train(tmp_path, "--run_name", "r")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _train(tmp_path, "--run_name", "rr", "--resume")
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err, err
    assert f"--resume: no run 'rr' in {tmp_path / NAME} (its runs: r); pass the --run_name of a run" in err
    assert sorted(p.name for p in (tmp_path / NAME).iterdir()) == ["r"]
    _train(tmp_path, "--resume")  # the default run name: a first --resume starts the run
    assert (tmp_path / NAME / "run" / "ckpt_0000002.pt").exists()
    assert "no checkpoint in" in capsys.readouterr().err
