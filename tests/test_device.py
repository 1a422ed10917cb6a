"""Every system's commands on a GPU, emulated on the CPU (tests/emulated_cuda.py), so device bugs fail here.

Inside ``emulated_cuda()`` every tensor put on ``cuda`` reports ``cuda:0`` and a CPU tensor of one or more
dimensions mixed with it raises CUDA's "found at least two devices" error. Each system runs for real with
``--device cuda`` and its test sizes: training (2 steps, a validation, a checkpoint), a resume, eval, its
extra commands, its one-call API, export and plot. Then CPU tensors are planted in each system's model,
loss and render path and in the Trainer's batch-to-device step: each plant trains on the CPU and fails on
the emulated GPU.
"""

from __future__ import annotations

import contextlib
import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from memfit.ops import registry
from memfit.system import load_system
from memfit.train.checkpoint import list_checkpoints, load_checkpoint

from tests.emulated_cuda import MIXED, EmulatedCuda, emulated_cuda
from tests.systems import ALIASES, evaluate, train

SYSTEMS = sorted(ALIASES)
GPU = ("--device", "cuda")
# what a GPU without the cuda extra takes (memfit.ops.registry): the Triton scan, conv1d, and for window
# attention whichever of the timed records the registry measured fastest
TIMED = frozenset(r.name for r in registry.records("attention") if r.timed)
PATHS = {
    "ginr-cifar": {"scan": {"triton"}, "conv": {"torch"}},
    "mbsnet-speech": {"scan": {"triton"}, "conv": {"torch"}},
    "gpt2-window": {"attention": TIMED},  # the fastest of the timed window records, measured here
    "moremouse-triplane": {"attention": {"sdpa"}},
}


@pytest.fixture(scope="module", autouse=True)
def _imported():
    """Every command's module imported before the GPU is emulated: none sees the patched torch.cuda at
    import and keeps what it said for later tests."""
    import importlib

    for system in SYSTEMS:
        sys_ = load_system(system)
        for kind in ("train", "eval", *sys_.extra_commands):
            command = sys_.entry(kind)
            if hasattr(command, "load"):  # memfit.system.parse_then_run: flags first, the work on call
                command.load()
        importlib.import_module(f"{MODELS[system][0].split('.')[0]}.api")
    importlib.import_module("memfit.cli")


def memfit_main(*argv: str) -> int:
    from memfit.cli import main

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code


def extra_commands(system: str, run, tmp_path) -> None:
    """The system's extra commands and its one-call API, on the GPU."""
    sys_ = load_system(system)
    if system == "gpt2-window":
        from gpt2_window.api import generate

        assert sys_.command("generate")(["--run", str(run), "--max_new_tokens", "3", *GPU]) == 0
        text = generate("ab", run, max_new_tokens=3, device="cuda")
        assert isinstance(text, str) and text.startswith("ab") and len(text) == 5
    if system == "mbsnet-speech":
        from mbsnet_speech.data import read_wav, write_wav
        from mbsnet_speech.enhance import enhance_file

        noise = 0.1 * np.random.default_rng(0).standard_normal(8000)
        write_wav(tmp_path / "in.wav", noise.astype(np.float32))
        argv = [str(tmp_path / "in.wav"), "--out", str(tmp_path / "enhanced"), "--run", str(run), *GPU]
        assert sys_.command("enhance")(argv) == 0
        for model, dst in ((run, "api.wav"), (None, "shipped.wav")):  # None: the model in the package
            out = enhance_file(tmp_path / "in.wav", tmp_path / dst, run=model, device="cuda")
            assert np.isfinite(read_wav(out)[0]).all()
    if system == "moremouse-triplane":
        from moremouse_triplane.api import render_views

        assert sys_.command("make-data")([str(tmp_path / "scenes"), "--num_scenes", "1"]) == 0
        size = sys_.load_model(run)[0].cfg.image_size
        views = render_views(torch.rand(3, size, size), run, views=2, device="cuda")
        assert views.shape == (2, 3, size, size) and views.isfinite().all()
    if system == "ginr-cifar":
        from ginr_cifar.api import reconstruct

        out = reconstruct(torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8), run, device="cuda")
        assert out.shape == (2, 3, 32, 32) and out.isfinite().all()


def test_the_emulated_gpu_refuses_what_cuda_refuses_and_allows_what_it_allows(tmp_path):
    with emulated_cuda():
        x = torch.ones(3, 4, device="cuda")
        assert isinstance(x, EmulatedCuda) and x.device == torch.device("cuda", 0) and x.is_cuda
        for mixed in (
            lambda: x + torch.ones(4),
            lambda: torch.cat([x, torch.ones(1, 4)]),
            lambda: x @ torch.ones(4),
        ):
            with pytest.raises(RuntimeError, match=MIXED):
                mixed()
        with pytest.raises(TypeError, match="can't convert cuda:0"):
            x.numpy()
        # CUDA allows: CPU scalars, copies and moves across devices, CPU indices, factories with a device
        assert (x * torch.tensor(2.0)).sum().item() == 24
        x[torch.tensor([0, 2])] = torch.zeros(4)
        x.copy_(x.cpu() + 1)
        assert x.sum().item() == 16 and type(x.cpu()) is torch.Tensor and x.cpu().device.type == "cpu"
        assert torch.as_tensor(np.ones(2), device="cuda").is_cuda and torch.zeros_like(x, device="cpu").is_cpu
        assert x.to("cuda") is x and x.to(device="cuda", copy=True) is not x  # GradScaler copies so
        host = torch.zeros(3, 4)
        assert host.copy_(x) is host and host.sum().item() == 16 and torch.ones(4).expand_as(x).is_cpu
        with pytest.raises(RuntimeError, match=MIXED):
            host[torch.tensor([0], device="cuda")]  # GPU indices into a CPU tensor
        # Module.to moves parameters in place (an optimizer made before keeps them); grads are on the GPU
        net = torch.nn.Linear(4, 2)
        weight = net.weight
        opt = torch.optim.AdamW(net.parameters())
        net.to("cuda")
        assert net.weight is weight and isinstance(weight, torch.nn.Parameter) and weight.is_cuda
        net(x).sum().backward()
        opt.step()
        assert weight.grad.is_cuda and opt.state[weight]["exp_avg"].is_cuda
        torch.save(net.state_dict(), tmp_path / "w.pt")
    saved = torch.load(tmp_path / "w.pt", map_location="cpu", weights_only=True)  # as a GPU run's file loads
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in saved.values())
    assert torch.equal(saved["weight"], weight.inner)


def every_command(system: str, tmp_path, capsys, gpu, peak: str) -> tuple:
    """train (2 steps with activation checkpointing, a validation, a checkpoint), --resume, eval, the extra
    commands, the one-call API, export and its model on the GPU, and plot, with the paths a GPU without the
    cuda extra takes. ``gpu`` is the context the GPU exists in (the emulated one, or a real one's), ``peak``
    the Trainer's peak-memory line it must print; returns the exported model and what the context gave."""
    runs = tmp_path / "runs"
    run = runs / system / "run"
    registry.reset()
    with gpu as device:
        # with activation checkpointing: the kernels' probes run inside it (mbsnet's GPU recipe has it on)
        argv = ("--steps", "2", "--eval_every", "2", "--save_every", "1", "--checkpointing", *GPU)
        assert train(system, runs, *argv) == 0
        assert re.search(peak, capsys.readouterr().out)  # the Trainer's device, and what it read there
        assert train(system, runs, "--steps", "3", "--resume", *GPU) == 0
        assert "resumed from" in capsys.readouterr().err
        assert evaluate(system, run, *GPU) == 0
        extra_commands(system, run, tmp_path)
        assert memfit_main("export", str(run), "--out", str(tmp_path / "export")) == 0
        model = load_system(system).from_pretrained(tmp_path / "export", device="cuda")
        assert all(p.is_cuda for p in model.parameters())
        assert memfit_main("plot", str(run)) == 0
    ran = {op: set(registry.ran(op)) for op in registry.OPS if registry.ran(op)}
    want = PATHS[system]
    assert set(ran) == set(want) and all(ran[op] <= want[op] if want[op] is TIMED else ran[op] == want[op]
                                         for op in ran), ran  # fmt: skip
    # a GPU run's checkpoint, loaded on the CPU: plain tensors
    state = load_checkpoint(list_checkpoints(run)[-1])
    assert state["step"] == 3
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in state["model"].values())
    return model, device


@pytest.mark.parametrize("system", SYSTEMS)
def test_every_command_runs_on_the_gpu(system, tmp_path, capsys):
    """Every command on the GPU emulated on the CPU: each step's tensors really meet it."""
    zero = r"peak memory consumption: 0 MiB \(cuda\)"  # nothing is allocated on a CUDA allocator here
    model, gpu = every_command(system, tmp_path, capsys, emulated_cuda(), zero)
    assert gpu.ops > 1000  # what ran on the GPU (not a step of CPU tensors that never met it)
    assert all(isinstance(p, EmulatedCuda) for p in model.parameters())


@pytest.mark.cuda
@pytest.mark.parametrize("system", SYSTEMS)
def test_every_command_runs_on_cuda(system, tmp_path, capsys, monkeypatch):
    """The same commands on a real GPU, as users have it: without the cuda extra's kernels."""
    monkeypatch.setenv("MEMFIT_DISABLE", ",".join(sorted(registry.extra_kernels())))
    every_command(
        system, tmp_path, capsys, contextlib.nullcontext(), r"peak memory consumption: [1-9]\d* MiB \(cuda\)"
    )


# ----------------------------------------------------------------------------------------------------
# Planted device bugs: a CPU tensor made without device=, mixed into a step
# ----------------------------------------------------------------------------------------------------

MODELS = {
    "ginr-cifar": ("ginr_cifar.model", "GINR"),
    "gpt2-window": ("gpt2_window.model", "GPT"),
    "mbsnet-speech": ("mbsnet_speech.model", "MBSNet"),
    "moremouse-triplane": ("moremouse_triplane.model", "TriplaneGenerator"),
}
QUICK = {  # no validation, no pre-flight: a planted run fails in its first step
    "ginr-cifar": ["--no_preflight"],
    "gpt2-window": ["--no_preflight"],
    "mbsnet-speech": ["--no_preflight", "--val_files", "0"],
    "moremouse-triplane": ["--no_preflight", "--val_scenes", "0"],
}


def plant_forward(monkeypatch, system):
    """The model's input plus torch.zeros(n): a tensor made on the CPU inside forward."""
    import importlib

    module, name = MODELS[system]
    cls = getattr(importlib.import_module(module), name)
    real = cls.forward

    def planted(self, x, *args, **kwargs):
        return real(self, x + torch.zeros(x.shape[-1], dtype=x.dtype), *args, **kwargs)

    monkeypatch.setattr(cls, "forward", planted)
    return "planted"  # the frame CUDA's error is raised from


def plant_loss(monkeypatch, system):
    """The loss times torch.ones(2), averaged: a weight vector made on the CPU in the loss."""
    from memfit.train import loop

    real = loop.Trainer.__post_init__

    def post_init(self):
        loss_fn = self.loss_fn

        def planted(model, batch):
            out = loss_fn(model, batch)
            loss, metrics = out if isinstance(out, tuple) else (out, {})
            return (loss * torch.ones(2)).mean(), metrics

        self.loss_fn = planted
        real(self)

    monkeypatch.setattr(loop.Trainer, "__post_init__", post_init)
    return "planted"


def plant_batch(monkeypatch, system):
    """A batch tensor left on the CPU: the first one the batch-to-device step returns goes back there."""
    from memfit.train import loop

    real = loop.to_device
    depth = [0]

    def planted(batch, device):
        depth[0] += 1
        try:
            moved = real(batch, device)  # it calls itself for what the batch holds
        finally:
            depth[0] -= 1
        if depth[0]:
            return moved
        if isinstance(moved, dict):
            key = next(iter(moved))
            return {**moved, key: moved[key].cpu()}
        return type(moved)([moved[0].cpu(), *moved[1:]])

    monkeypatch.setattr(loop, "to_device", planted)
    return "_train_step"  # where the CPU tensor meets the model


def plant_render(monkeypatch, system):
    """The rays' entry distances plus torch.zeros(n): a tensor made on the CPU in the renderer."""
    from moremouse_triplane import render

    real = render.ray_box

    def planted(rays_o, rays_d, bbox):
        near, far = real(rays_o, rays_d, bbox)
        return near + torch.zeros(near.shape[-1]), far

    monkeypatch.setattr(render, "ray_box", planted)
    return "planted"


PLANTS = [(s, p) for s in SYSTEMS for p in (plant_forward, plant_loss, plant_batch)]
PLANTS.append(("moremouse-triplane", plant_render))


@pytest.mark.parametrize(("system", "plant"), PLANTS, ids=[f"{s}-{p.__name__[6:]}" for s, p in PLANTS])
def test_a_cpu_tensor_planted_in_a_step_fails_on_the_gpu(system, plant, tmp_path, monkeypatch):
    """Each plant trains on the CPU (every tensor is there) and stops the GPU run with CUDA's error, raised
    at the plant (test_every_command_runs_on_the_gpu: without it, the same run passes)."""
    where = plant(monkeypatch, system)
    assert train(system, tmp_path / "cpu", *QUICK[system], "--device", "cpu") == 0
    with emulated_cuda(), pytest.raises(RuntimeError, match=MIXED) as e:
        train(system, tmp_path / "gpu", *QUICK[system], *GPU)
    assert any(entry.name == where for entry in e.traceback), e.traceback


# ----------------------------------------------------------------------------------------------------
# The GPU suite (`pytest -m cuda`) on the emulated GPU: its device handling is checked on every CPU run
# ----------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
CORE, GPT2 = "packages/core/tests", "packages/gpt2-window/tests"
CUDA_FILE = f"{CORE}/test_cuda.py"
CUDA_TESTS = [  # (file::test, its parameters): every `cuda` test whose checks hold without real kernels
    (f"{CUDA_FILE}::test_mamba_block_on_cuda_matches_the_pytorch_path",
     lambda m: {"paths": m.DEFAULT, "amp": True}),
    (f"{CUDA_FILE}::test_scan_on_cuda_matches_the_reference", {"path": "triton", "use_kernels": True}),
    (f"{CUDA_FILE}::test_scan_on_cuda_matches_the_reference", {"path": "torch", "use_kernels": False}),
    (f"{CUDA_FILE}::test_last_state_gradient_on_cuda", {}),
    (f"{CUDA_FILE}::test_a_first_call_inside_activation_checkpointing_takes_the_triton_scan", {}),
    (f"{CUDA_FILE}::test_resume_on_cuda_gives_identical_weights", {}),
    (f"{CUDA_FILE}::test_compile_on_cuda_trains_like_eager", {}),
    (f"{CORE}/test_ssm.py::test_cuda_matches_reference", {}),
    (f"{CORE}/test_attention.py::test_flex_on_cuda_matches_reference", {"L": 257, "w": 64}),
    (f"{CORE}/test_attention.py::test_flex_on_cuda_matches_reference", {"L": 100, "w": 200}),
    (f"{CORE}/test_attention.py::test_band_on_cuda_matches_reference", {}),
    (f"{CORE}/test_window_triton.py::test_cuda_matches_the_reference_at_real_sizes",
     {"L": 300, "w": 64, "layout": "model"}),
    (f"{CORE}/test_scan_triton.py::test_cuda_matches_the_reference_at_real_sizes",
     {"batch": 2, "dim": 384, "L": 300, "N": 16, "dtype": torch.float32, "bc": "step"}),
    (f"{GPT2}/test_gpt2_cuda.py::test_window_model_matches_reference_on_cuda", {}),
    (f"{GPT2}/test_gpt2_cuda.py::test_generate_in_fp32_on_cuda_compiles_a_few_lengths", {}),
]  # fmt: skip


def _module(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"gpu_suite_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("test", "params"), CUDA_TESTS, ids=[t.split("::")[1] for t, _ in CUDA_TESTS])
def test_the_gpu_suite_runs_on_the_emulated_gpu(test, params, tmp_path, monkeypatch):
    """A `cuda` test of the GPU suite on the emulated GPU, called with the fixtures it takes (tmp_path;
    no_extra, directly or through request.getfixturevalue: the extra's kernels off)."""
    import inspect

    path, name = test.split("::")
    module = _module(path)
    fn = getattr(module, name)
    kwargs = params(module) if callable(params) else dict(params)

    def no_extra() -> None:
        monkeypatch.setenv("MEMFIT_DISABLE", ",".join(sorted(registry.extra_kernels())))

    request = types.SimpleNamespace(getfixturevalue=lambda name: no_extra())
    fixtures = {"tmp_path": tmp_path, "no_extra": None, "request": request, "monkeypatch": monkeypatch}
    wanted = inspect.signature(fn).parameters
    if "no_extra" in wanted:
        no_extra()
    kwargs.update({k: v for k, v in fixtures.items() if k in wanted and k not in kwargs})
    registry.reset()
    with emulated_cuda():
        fn(**kwargs)
