"""The commands a user types first answer in about a second: `memfit --help`, `memfit systems` and
`memfit train SYSTEM --help` never import torch (about 2 s of CPU on its own, 5 s with the estimator).

Each command runs in a fresh interpreter (a subprocess: this one has torch loaded long ago). What is
checked is what does not depend on how busy the machine is: that torch was not imported, and the CPU time
the process used (user + system, not wall time: on a loaded 2-core CI machine the wall time of the same
work can triple). 1.2 s of CPU is the limit: the commands take 0.2-0.4 s on an idle machine, and the
same commands importing torch took 6.7 s.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.systems import ALIASES

CPU_LIMIT_S = 1.2

PROBE = """
import contextlib, io, json, resource, sys
from memfit import cli
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
use = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "cpu_s": use.ru_utime + use.ru_stime,
                  "out": out.getvalue()}))
"""


def run_cli(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.splitlines()[-1]), "err": done.stderr}


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["systems"], *(["train", s, "--help"] for s in sorted(ALIASES))],
    ids=lambda a: " ".join(a),
)
def test_first_commands_answer_without_torch(argv):
    r = run_cli(*argv)
    assert r["code"] == 0 and r["out"].strip()
    assert not r["torch"], f"memfit {' '.join(argv)} imported torch"
    assert r["cpu_s"] <= CPU_LIMIT_S, f"memfit {' '.join(argv)} used {r['cpu_s']:.2f} s of CPU"


@pytest.mark.parametrize("system", sorted(ALIASES))
def test_a_number_no_preset_takes_is_one_line_without_torch(system):
    """`train S --lr 0`: every preset refuses it, so it is refused before torch is imported
    (memfit.train.settings.TrainParser); the line names the flag and the range."""
    r = run_cli("train", system, "--lr", "0")
    assert r["code"] == 2 and r["err"].splitlines() == [f"{system} train: error: --lr must be > 0, got 0"], r
    assert not r["torch"], f"memfit train {system} --lr 0 imported torch"
    assert r["cpu_s"] <= CPU_LIMIT_S, f"memfit train {system} --lr 0 used {r['cpu_s']:.2f} s of CPU"


def _system_commands() -> list[list[str]]:
    """`eval S` and `run S COMMAND` for every system and extra command: the work behind them imports
    torch, their flags do not (memfit.system.parse_then_run)."""
    from memfit.system import load_system

    out = [["eval", s] for s in sorted(ALIASES)]
    for s in sorted(ALIASES):
        out += [["run", s, c] for c in sorted(load_system(s).extra_commands)]
    return out


@pytest.mark.parametrize("command", _system_commands(), ids=lambda a: " ".join(a))
def test_every_system_command_answers_help_and_a_wrong_flag_without_torch(command):
    r = run_cli(*command, "--help")
    assert r["code"] == 0 and "--" in r["out"]
    assert not r["torch"], f"memfit {' '.join(command)} --help imported torch"
    assert r["cpu_s"] <= CPU_LIMIT_S, f"memfit {' '.join(command)} --help used {r['cpu_s']:.2f} s of CPU"
    wrong = run_cli(*command, "--no_such_flag")
    assert wrong["code"] == 2 and not wrong["torch"], f"memfit {' '.join(command)} --no_such_flag"


def test_the_help_still_names_every_command_and_the_heavy_ones_still_parse():
    """The estimator's commands are listed without being loaded, and their own --help still has their
    flags (declared apart from the estimator: no torch either)."""
    top = run_cli("--help")["out"]
    for command in ("budget", "fit", "estimate", "run", "systems", "train", "eval", "export", "doctor"):
        assert f"    {command}" in top
    estimate = run_cli("estimate", "--help")
    assert estimate["code"] == 0 and "--gpu_gib" in estimate["out"] and not estimate["torch"]
    systems = run_cli("systems")["out"]
    assert "mbsnet-speech  (extra commands: enhance)" in systems and "gpt2-window" in systems


HEAVY = ("torch._dynamo", "torch._inductor", "scipy.signal")


@pytest.mark.parametrize(
    "module",
    [
        "mbsnet_speech.model",
        "mbsnet_speech.enhance",
        "mbsnet_speech.data",
        "gpt2_window.model",
        "gpt2_window.sample",
        "ginr_cifar.model",
        "moremouse_triplane.model",
    ],
)
def test_a_model_or_its_inference_imports_no_compiler_and_no_scipy_signal(module):
    """torch.compile's front end (torch._dynamo with sympy: 1 s of an idle core, 5 s of a busy one) and
    scipy.signal (0.7 s) are imported where they run: a compiled path, the reverb augmentation, the PESQ
    loss's filters. Importing a model, `enhance` or `generate` pays for neither."""
    code = f"import sys, json, {module}; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [], f"importing {module} imported these"


def test_enhancing_a_file_runs_the_kernels_without_the_compiler(tmp_path):
    """The CPU scan and conv kernels are torch custom ops, whose wrapper imports torch._dynamo on a
    first call (registry.defer_compiler keeps it out until something compiles): `enhance` of a
    1-second file imports neither the compiler nor scipy.signal, and writes its output."""
    import numpy as np
    import soundfile as sf

    sf.write(
        tmp_path / "one.wav", (0.1 * np.random.default_rng(0).standard_normal(16000)).astype("float32"), 16000
    )
    code = (
        "import sys, json; from memfit import cli\n"
        "try:\n    cli.main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    argv = ["run", "mbsnet-speech", "enhance", str(tmp_path / "one.wav"), "--out", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
    assert (tmp_path / "out" / "one.wav").stat().st_size > 16000


@pytest.mark.parametrize("command", ["estimate", "budget", "fit"])
def test_the_estimators_commands_answer_help_without_torch(command):
    """Their flags live in memfit.estimate.flags, which imports no torch (nor does the package's face)."""
    r = run_cli(command, "--help")
    assert r["code"] == 0 and "--gpu" in r["out"]
    assert not r["torch"], f"memfit {command} --help imported torch"
    assert r["cpu_s"] <= CPU_LIMIT_S, f"memfit {command} --help used {r['cpu_s']:.2f} s of CPU"


def test_the_margin_said_in_help_is_the_margin_used():
    from memfit.estimate.fit import MARGIN
    from memfit.estimate.flags import MARGIN_TEXT

    assert float(MARGIN_TEXT) == MARGIN
