"""`memfit doctor` on this (GPU-less) machine, and on a faked GPU with faked kernels."""

import importlib.metadata
import subprocess
import sys
import types

import pytest
import torch
from memfit import cli
from memfit.ops import doctor
from memfit.ops import registry as probes

from tests.fake_kernels import fake_conv, fake_flash, fake_scan


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
    assert "on the CPU:" in out and "Mamba scan, conv" in out
    code, out, err = run(["doctor", "--require-cuda"], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("memfit: error: --require-cuda: CUDA is not available")


def test_doctor_names_the_cpu_scan_compiler(monkeypatch, capsys):
    from memfit.ops import cpu_kernel as _scan_kernel

    monkeypatch.setattr(_scan_kernel, "_compiler", lambda: None)
    assert "no C compiler" in doctor.cpu_scan()
    monkeypatch.setenv("MEMFIT_SCAN_KERNEL", "0")
    assert "MEMFIT_SCAN_KERNEL=0" in doctor.cpu_scan()


def fake_gpu(monkeypatch, cap=(9, 0), kernels=None):
    """A GPU with the given capability; kernels: {kernel: fn or None (not installed)} as importable modules.
    The probes run on CPU tensors (device "cpu") with the fake functions."""
    kernels = kernels or {}
    monkeypatch.setattr(doctor, "cuda_state", lambda: (True, "torch 2.11, CUDA 12.8, 1 device(s)"))
    monkeypatch.setattr(
        doctor, "gpus", lambda: [{"index": 0, "name": "Fake GPU", "capability": cap, "gib": 80.0}]
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(probes, "capability", lambda device: cap)
    real_version = importlib.metadata.version

    def version(name):
        for kernel, (package, _, _) in doctor.EXTRA.items():
            if name == package:
                if kernels.get(kernel) is None:
                    raise importlib.metadata.PackageNotFoundError(name)
                return "9.9"
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    for kernel, (_, module, fn_name) in doctor.EXTRA.items():
        if kernels.get(kernel) is not None:
            monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{fn_name: kernels[kernel]}))
    real_probe = probes.probe
    monkeypatch.setattr(probes, "probe", lambda kernel, fn, device: real_probe(kernel, fn, "cpu"))


GOOD = {"selective_scan": fake_scan, "causal_conv1d": fake_conv, "flash_attn": fake_flash}


def test_doctor_on_a_gpu_whose_kernels_pass(monkeypatch, capsys):
    fake_gpu(monkeypatch, kernels=GOOD)
    code, out, err = run(["doctor", "--require-cuda"], capsys)
    assert code == 0, err
    assert "cuda:0  Fake GPU, compute capability 9.0, 80.0 GiB" in out
    assert out.count("probe passed") == 3
    assert (
        "mamba_ssm's kernel" in out and "causal-conv1d (width 2-4" in out and "flash-attn in fp16/bf16" in out
    )


def test_require_cuda_fails_when_one_kernel_fails_its_probe(monkeypatch, capsys):
    def no_kernel(*args, **kwargs):
        raise RuntimeError("selective_scan_cuda is not installed")

    fake_gpu(monkeypatch, kernels={**GOOD, "selective_scan": no_kernel})
    code, out, _ = run(["doctor"], capsys)
    assert code == 0 and "probe FAILED" in out and "torch-op chunked scan" in out
    code, out, err = run(["doctor", "--require-cuda"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "mamba-ssm 9.9, probe FAILED: the test call failed: RuntimeError" in err


def test_require_cuda_fails_when_a_kernel_is_missing(monkeypatch, capsys):
    fake_gpu(monkeypatch, cap=(7, 5), kernels={**GOOD, "flash_attn": None})
    code, out, _ = run(["doctor"], capsys)
    assert code == 0 and "flash-attn     not installed" in out and "compiled FlexAttention" in out
    code, _, err = run(["doctor", "--require-cuda"], capsys)
    assert code == 2 and "flash-attn not installed" in err


def test_doctor_runs_as_a_command():
    r = subprocess.run([sys.executable, "-m", "memfit.cli", "doctor"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("memfit doctor:")
