"""The bare `train`/`eval` scripts (memfit.bare) and `memfit budget`."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from memfit import bare, cli
from memfit.errors import UsageError
from memfit.system import available_systems

ROOT = Path(__file__).resolve().parents[3]
needs_uv = pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not on PATH")


def _uv(*args, env=None):
    env = {**os.environ, **(env or {})}
    env.pop("MEMFIT_SYSTEM", None)
    return subprocess.run(
        ["uv", "run", "--no-sync", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )


def test_pick_system_rules(monkeypatch):
    monkeypatch.delenv("MEMFIT_SYSTEM", raising=False)
    monkeypatch.setattr(bare, "available_systems", lambda: {"alpha": None, "beta": None})
    monkeypatch.setattr(bare, "uv_run_package", lambda: None)
    assert bare.pick_system(["--system", "beta", "--steps", "3"]) == ("beta", ["--steps", "3"])
    assert bare.pick_system(["--system=alpha"]) == ("alpha", [])
    with pytest.raises(UsageError, match="Installed: alpha, beta"):
        bare.pick_system(["--steps", "3"])
    with pytest.raises(UsageError) as e:  # each script names its own forms, never the other's
        bare.pick_system(["--run", "r"], "eval")
    line = str(e.value)
    assert all(
        f in line for f in ("`memfit eval <system>`", "`eval --system <system>`", "--package <system> eval`")
    )
    assert "train" not in line, line
    with pytest.raises(UsageError, match="unknown system 'gamma'"):
        bare.pick_system(["--system", "gamma"])
    monkeypatch.setattr(bare, "uv_run_package", lambda: "beta")  # `uv run --package beta train`
    assert bare.pick_system(["-h"]) == ("beta", ["-h"])
    monkeypatch.setattr(bare, "uv_run_package", lambda: "memfit-core")  # a package that is no system
    with pytest.raises(UsageError, match="which system"):
        bare.pick_system([])
    monkeypatch.setattr(bare, "available_systems", lambda: {"alpha": None})
    assert bare.pick_system([]) == ("alpha", [])


@pytest.mark.parametrize("through", ["/proc", "ps"])
def test_the_uv_package_is_read_from_the_parent_process_command_line(tmp_path, through):
    """uv passes the --package to nobody: it is read from the parent's argv, on Linux from /proc, and
    elsewhere (no /proc, as on macOS) from `ps`. A process started by `uv run --package beta` finds beta."""
    import sys

    if through == "ps" and shutil.which("ps") is None:
        pytest.skip("no ps on this machine")
    if through == "/proc" and not Path("/proc/self/cmdline").exists():
        pytest.skip("no /proc on this machine")
    fake_uv = tmp_path / "uv"  # a parent process whose argv reads `uv -c ... run --package beta train`
    fake_uv.symlink_to(sys.executable)
    hide_proc = "bare.Path = lambda *a: Path('/no/proc/here') if a == ('/proc',) else Path(*a); "
    code = "from pathlib import Path; from memfit import bare; " + (hide_proc if through == "ps" else "")
    child = [sys.executable, "-c", code + "print(bare.uv_run_package())"]
    spawn = f"import subprocess; subprocess.run({child!r})"
    cases = ((["--package", "beta", "train"], "beta"), (["--package=gamma"], "gamma"), ([], "None"))
    for words, found in cases:
        done = subprocess.run([str(fake_uv), "-c", spawn, "run", *words], capture_output=True, text=True)
        assert done.stdout.strip() == found, done.stderr


def test_a_memfit_system_that_names_no_system_is_one_line(monkeypatch):
    monkeypatch.setenv("MEMFIT_SYSTEM", "gpt2-windo")
    with pytest.raises(UsageError, match="MEMFIT_SYSTEM=gpt2-windo is not an installed system"):
        bare.pick_system(["--help"])


@needs_uv
@pytest.mark.parametrize("system", sorted(available_systems()))
def test_uv_run_package_train_help_reaches_that_system(system):
    """`uv run --package X train --help` answers with X's own trainer (argparse prog "X train")."""
    res = _uv("--package", system, "train", "--help")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"{system} train" in res.stdout


@needs_uv
def test_uv_run_train_without_package_lists_choices():
    if len(available_systems()) < 2:
        pytest.skip("needs two installed systems")
    res = _uv("train", "--help")
    assert res.returncode != 0
    assert "which system" in res.stderr
    for name in available_systems():
        assert name in res.stderr


def test_budget_json_is_valid_and_complete(capsys):
    systems = sorted(available_systems())
    if not systems:
        pytest.skip("no systems installed")
    system = (
        "moremouse-triplane" if "moremouse-triplane" in systems else systems[0]
    )  # the quickest to estimate
    with pytest.raises(SystemExit):
        cli.main(["budget", "--json", "--system", system])
    rows = json.loads(capsys.readouterr().out)
    assert rows
    keys = {
        "system",
        "variant",
        "batch",
        "dtype",
        "params",
        "estimated_gib",
        "budget_gib",
        "is_baseline",
        "by_category",
    }
    for r in rows:
        assert keys <= set(r)
        assert set(r["by_category"]) == {"params", "grads", "optimizer", "activations"}
        assert r["estimated_gib"] == pytest.approx(sum(r["by_category"].values()), rel=1e-3, abs=1e-3)
        assert (r["budget_gib"] is None) == r["is_baseline"]


def test_budget_unknown_system_is_clear(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["budget", "--system", "nope"])
    assert e.value.code == 2 and "memfit: error: unknown system 'nope'" in capsys.readouterr().err


def test_export_names_an_unknown_system_and_the_installed_ones(tmp_path, capsys):
    """--system bogus is a typo to name, not a system memfit 'cannot tell'; a run whose config.json names
    a system that is not installed says so."""
    installed = ", ".join(sorted(available_systems()))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"system": "ghost"}))
    for argv, says in [
        (["--system", "bogus"], f"memfit: error: unknown system 'bogus'; installed systems: {installed}"),
        ([], f"error: {tmp_path / 'run'} is a ghost run, which is not installed; installed: {installed}"),
    ]:
        with pytest.raises(SystemExit) as e:
            cli.main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out"), *argv])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.endswith(says) and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_plot_says_what_it_was_given_where_a_run_folder_or_a_png_is_expected(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    (run / "ckpt_0000001.pt").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    fix = f"pass the run folder that holds it: `memfit plot {run}`"
    metrics, ckpt, png = run / "metrics.jsonl", run / "ckpt_0000001.pt", tmp_path / "curves.png"
    folder = f"--out {tmp_path} is a folder; give the PNG file to write, e.g. {png}"
    for argv, says in [
        ([str(metrics)], f"{metrics} is the run's metrics file, not a run folder; {fix}"),
        ([str(ckpt)], f"{ckpt} is a file, not a run folder; {fix}"),
        ([str(tmp_path / "notes.txt")], "notes.txt is a file, not a run folder; pass a run folder that"),
        ([str(tmp_path / "nope")], f"{tmp_path / 'nope'} does not exist; pass a run folder that"),
        ([str(run), "--out", str(tmp_path)], folder),
    ]:
        with pytest.raises(SystemExit) as e:
            cli.main(["plot", *argv])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and says in err and "\n" not in err, err
    assert sorted(p.name for p in run.iterdir()) == ["ckpt_0000001.pt", "metrics.jsonl"]


def test_largest_batch_search_is_exact():
    from memfit.estimate.fit import largest_batch

    calls = []

    def peak(b):
        calls.append(b)
        return 0.5 + 0.1 * b  # GiB

    b, gib, nxt, probes, first = largest_batch(peak, 24.0)
    assert b == 235 and gib == pytest.approx(24.0) and nxt == pytest.approx(24.1) and first == 1
    assert probes == len(set(calls)) <= 20
    assert largest_batch(peak, 0.55)[0] == 0  # not even batch 1
    assert largest_batch(peak, 1e9, max_batch=100)[:3] == (100, pytest.approx(10.5), None)  # the cap


def test_largest_batch_searches_from_two_when_batch_one_cannot_train():
    """BatchNorm over one value per channel raises at batch 1 only: the search starts at 2; a step that
    fails at 2 as well keeps batch 1's error."""
    from memfit.estimate.fit import largest_batch

    def peak(b):
        if b == 1:
            raise ValueError("Expected more than 1 value per channel when training")
        return 0.5 + 0.1 * b

    assert largest_batch(peak, 24.0)[0::4] == (235, 2)
    assert largest_batch(peak, 0.6)[:1] == (0,)  # batch 2 needs 0.7

    def broken(b):
        raise ValueError(f"broken at {b}")

    with pytest.raises(ValueError, match="broken at 1"):
        largest_batch(broken, 24.0)


def test_memfit_run_reaches_extra_commands(capsys):
    if "mbsnet-speech" not in available_systems():
        pytest.skip("mbsnet-speech not installed")
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "mbsnet-speech", "nope"])
    assert e.value.code == 2 and "extra commands: enhance" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "mbsnet-speech", "enhance", "--help"])
    assert exit_info.value.code == 0
    assert "--out" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["systems"])
    assert "mbsnet-speech  (extra commands: enhance)" in capsys.readouterr().out


def test_estimate_fit_and_budget_flags_each_say_what_they_do():
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    cli._heavy_parsers(sub)
    for name in ("estimate", "fit", "budget"):
        silent = [a.option_strings or a.dest for a in sub.choices[name]._actions if not a.help]
        assert not silent, f"memfit {name}: no help for {silent}"
    fit = sub.choices["fit"]
    assert {a.dest for a in fit._actions if a.required} == {"system", "gpu_gib"}  # as the usage line says
    assert "memfit estimate TARGET --gpu_gib N" in fit.description
    estimate = {a.dest: a.help for a in sub.choices["estimate"]._actions}
    assert "LoRA" in estimate["explain"] and "SGD" in estimate["explain"]
    assert "by name" in estimate["amp"] and "TrainStep" in estimate["amp"]


def test_every_subcommand_help_opens_with_what_it_does(capsys):
    # (train and eval pass --help on to the system named after them)
    for name in ["run", "systems", "export", "plot", "doctor", "budget", "fit", "estimate"]:
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        out = capsys.readouterr().out
        description = out.split("\n\n")[1]
        assert description[:1].isupper() and not description.startswith(("options", "positional")), out
