"""`memfit doctor` on this (GPU-less) machine, and on a faked GPU with faked kernels."""

import subprocess
import sys

import pytest
import torch
from memfit import cli
from memfit.ops import doctor
from memfit.ops import registry as probes

from tests.fake_kernels import fake_conv, fake_flash, fake_scan, install


@pytest.fixture(autouse=True)
def _fresh():
    probes.reset(probes=True)
    yield
    probes.reset(probes=True)


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without CUDA")
def test_doctor_without_cuda(capsys):
    code, out, err = run(["doctor"], capsys)
    assert code == 0 and err == ""
    assert "CUDA: no (" in out
    for package in ("mamba-ssm", "causal-conv1d", "flash-attn"):
        assert package in out
    assert "on cpu (each op's implementations" in out
    # every CPU record of the registry is listed, and one per op is marked as the one a call takes
    cpu = [r for r in probes.RECORDS if r.device in ("cpu", "any")]
    assert all(f" {r.name} " in out for r in cpu)
    assert out.count("-> ") == len(probes.OPS)
    code, out, err = run(["doctor", "--require_cuda"], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("memfit: error: --require_cuda: CUDA is not available")


def test_doctor_names_why_the_cpu_kernel_is_not_used(monkeypatch, capsys):
    from memfit.ops import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "_compiler", lambda: None)
    _, out, _ = run(["doctor"], capsys)
    assert "cpu_kernel" in out and "no C compiler" in out
    assert "-> Mamba scan        torch" in out
    monkeypatch.setenv("MEMFIT_DISABLE", "cpu_kernel")
    _, out, _ = run(["doctor"], capsys)
    assert "switched off" in out


def test_the_old_scan_kernel_switch_is_refused_with_the_new_name(monkeypatch):
    from memfit.ops import device, registry

    monkeypatch.setattr(device, "_said_old_switch", False)
    monkeypatch.setenv("MEMFIT_SCAN_KERNEL", "0")
    with pytest.warns(RuntimeWarning, match="MEMFIT_DISABLE=cpu_kernel"):
        assert "cpu_kernel" not in registry.disabled()


def fake_gpu(monkeypatch, cap=(9, 0), kernels=None):
    """A GPU with the given capability; kernels: {name: fn or None (not installed)} in their own
    signatures, seen by the registry. The probes run on CPU tensors (device "cpu")."""
    kernels = kernels or {}
    monkeypatch.setattr(doctor, "cuda_state", lambda: (True, "torch 2.11, CUDA 12.8, 1 device(s)"))
    monkeypatch.setattr(
        doctor, "gpus", lambda: [{"index": 0, "name": "Fake GPU", "capability": cap, "gib": 80.0}]
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(probes, "capability", lambda device: cap)
    packages = {r.package: r.name for r in probes.RECORDS if r.package}
    monkeypatch.setattr(doctor, "version", lambda p: "9.9" if kernels.get(packages.get(p)) else None)
    for name in ("mamba_ssm", "causal_conv1d", "flash", "triton"):
        install(monkeypatch, name, kernels.get(name))
    real_probe = probes.probe
    monkeypatch.setattr(probes, "probe", lambda impl, device: real_probe(impl, "cpu"))


GOOD = {"mamba_ssm": fake_scan, "causal_conv1d": fake_conv, "flash": fake_flash}


def test_doctor_on_a_gpu_whose_kernels_pass(monkeypatch, capsys):
    fake_gpu(monkeypatch, kernels=GOOD)
    code, out, err = run(["doctor", "--require-kernels"], capsys)
    assert code == 0, err
    assert "cuda:0  Fake GPU, compute capability 9.0, 80.0 GiB" in out
    assert out.count("probe passed") == 3
    assert "-> Mamba scan        mamba_ssm" in out and "-> Mamba conv        causal_conv1d" in out
    assert "-> window attention  flash" in out


def test_require_cuda_fails_when_one_kernel_fails_its_probe(monkeypatch, capsys):
    def no_kernel(*args, **kwargs):
        raise RuntimeError("selective_scan_cuda is not installed")

    fake_gpu(monkeypatch, kernels={**GOOD, "mamba_ssm": no_kernel})
    code, out, _ = run(["doctor"], capsys)
    assert code == 0 and "probe FAILED" in out and "-> Mamba scan        torch" in out
    code, out, err = run(["doctor", "--require-cuda"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "mamba_ssm (Mamba scan): probe FAILED: the test call failed: RuntimeError" in err


def test_require_kernels_fails_when_a_kernel_is_missing_and_require_cuda_does_not(monkeypatch, capsys):
    fake_gpu(monkeypatch, cap=(7, 5), kernels={**GOOD, "flash": None})
    code, out, _ = run(["doctor"], capsys)
    assert code == 0 and "flash-attn     not installed" in out
    for racing in ("flex", "flex_narrow", "varlen", "blocks"):  # timed by the registry: all marked
        assert f"-> window attention  {racing} " in out, out
    code, _, err = run(["doctor", "--require-kernels"], capsys)
    assert code == 2 and "flash-attn is not installed" in err
    code, _, err = run(["doctor", "--require-cuda"], capsys)  # the GPU job without the extra: fine
    assert code == 0, err


def test_doctor_runs_as_a_command():
    r = subprocess.run([sys.executable, "-m", "memfit.cli", "doctor"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("memfit doctor:")
