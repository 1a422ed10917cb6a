"""On a GPU. `pytest -m cuda`: the paths a GPU takes without the cuda extra (the Triton scan, conv1d), on
any GPU machine (the extra's kernels are switched off for them, MEMFIT_DISABLE); `pytest -m cuda_kernels`:
the extra's kernels (the kernels CI job builds them). Every test asserts which implementation ran
(memfit.ops.registry.ran), so a path that did not run fails here instead of passing on another one. Without
CUDA, or without the kernels a `cuda_kernels` test names, the selected tests fail (conftest.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from memfit.ops import registry as probes
from memfit.ops.mamba import Mamba, MambaConfig
from memfit.ops.scan import selective_scan, selective_scan_ref
from memfit.train.checkpoint import list_checkpoints
from memfit.train.loop import Trainer, WarmupCosine, step_generator
from memfit.train.settings import LoopConfig, TrainRun
from torch import nn

KERNELS = {("conv", "causal_conv1d"): 1, ("scan", "mamba_ssm"): 1}  # the cuda extra's
DEFAULT = {("conv", "torch"): 1, ("scan", "triton"): 1}  # a GPU without it


@pytest.fixture(autouse=True)
def _fresh():
    probes.reset()
    yield


@pytest.fixture
def no_extra(monkeypatch):
    """A GPU as most users have it: the cuda extra's kernels off, wherever it is installed."""
    monkeypatch.setenv("MEMFIT_DISABLE", ",".join(sorted(probes.extra_kernels())))


def _block(d_model=64, seed=0, **kw):
    torch.manual_seed(seed)
    return Mamba(MambaConfig(d_model=d_model, d_state=16, **kw)).cuda()


def _fwd_bwd(m, x, amp, params=None):
    """Output and the gradients of the input and every parameter, with the block's own (strided) inputs."""
    params = list(m.parameters() if params is None else params)
    for p in params:
        p.grad = None
    x = x.detach().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        y = m(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device="cuda")).sum().backward()
    return [y.float(), x.grad.float()] + [p.grad.float() for p in params]


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "paths",
    [pytest.param(KERNELS, marks=pytest.mark.cuda_kernels("causal_conv1d", "mamba_ssm"), id="extra"),
     pytest.param(DEFAULT, marks=pytest.mark.cuda, id="triton")],
)  # fmt: skip
def test_mamba_block_on_cuda_matches_the_pytorch_path(paths, amp, request):
    """The block's conv (causal-conv1d on a channels-last view of in_proj's output; else conv1d) and scan
    (mamba_ssm; else the Triton scan) against F.conv1d + the torch-op scan, forward and every gradient, in
    fp32 and under bf16 autocast."""
    if paths is DEFAULT:
        request.getfixturevalue("no_extra")
    m = _block()
    x = torch.randn(4, 300, 64, device="cuda")
    got = _fwd_bwd(m, x, amp)
    assert probes.ran() == paths, probes.ran()
    m.config.use_kernels = False
    want = _fwd_bwd(m, x, amp)
    tol = 3e-2 if amp else 2e-4
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=tol * max(1.0, w.abs().max().item()), rtol=tol)


@pytest.mark.cuda
def test_a_first_call_inside_activation_checkpointing_takes_the_triton_scan(no_extra):
    """The Triton scan's probe runs at the first call, here inside activation checkpointing (mbsnet's GPU
    recipe): it passes (its graph apart from the checkpoint's), and the step matches one without
    checkpointing."""
    import warnings

    from memfit.ops.layers import checkpointed

    probes.reset(probes=True)  # the probe runs now, inside the checkpoint
    m = _block()
    x = torch.randn(2, 100, 64, device="cuda")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = _fwd_bwd(lambda t: checkpointed(m, t, enabled=True), x, amp=False, params=m.parameters())
    assert not [w for w in said if "memfit:" in str(w.message)]  # a failed probe says so
    assert probes.ran() == {("conv", "torch"): 2, ("scan", "triton"): 2}, probes.ran()  # forward, recompute
    want = _fwd_bwd(m, x, amp=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5 * max(1.0, w.abs().max().item()), rtol=1e-5)


def _scan_inputs(batch=2, dim=32, L=200, N=16, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.randn(batch, dim, L, device="cuda", generator=g, dtype=dtype)
    delta = (0.5 * torch.randn(batch, dim, L, device="cuda", generator=g)).to(dtype)
    A = -torch.rand(dim, N, device="cuda", generator=g) - 0.5
    B, C = (torch.randn(batch, N, L, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    D = torch.randn(dim, device="cuda", generator=g)
    z = torch.randn(batch, dim, L, device="cuda", generator=g, dtype=dtype)
    bias = 0.1 * torch.randn(dim, device="cuda", generator=g)
    return [t.requires_grad_(True) for t in (u, delta, A, B, C, D, z, bias)]


def _scan_grads(fn, inputs, last=False, **kw):
    inputs = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(*inputs, delta_softplus=True, return_last_state=last, **kw)
    loss = out[0].sum() + out[1].sum() if last else out.sum()
    loss.backward()
    return [out[0] if last else out] + ([out[1]] if last else []) + [t.grad for t in inputs]


@pytest.mark.parametrize(
    ("path", "use_kernels"),
    [pytest.param("mamba_ssm", True, marks=pytest.mark.cuda_kernels("mamba_ssm"), id="mamba_ssm"),
     pytest.param("triton", True, marks=pytest.mark.cuda, id="triton"),
     pytest.param("torch", False, marks=pytest.mark.cuda, id="torch-op")],
)  # fmt: skip
def test_scan_on_cuda_matches_the_reference(path, use_kernels, request):
    """mamba_ssm's kernel (the extra), the Triton scan (the CUDA default without it) and, use_kernels=False,
    the torch-op scan."""
    if path == "triton":
        request.getfixturevalue("no_extra")
    inputs = _scan_inputs()
    got = _scan_grads(selective_scan, inputs, use_kernels=use_kernels)
    assert probes.ran("scan") == {path: 1}
    want = _scan_grads(selective_scan_ref, inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-3 * max(1.0, w.abs().max().item()), rtol=1e-3)


@pytest.mark.cuda
def test_last_state_gradient_on_cuda():
    """A call whose last state needs a gradient takes the Triton scan, which keeps it (mamba_ssm, installed
    or not, drops it: the registry passes such a call on)."""
    inputs = _scan_inputs(L=100)
    got = _scan_grads(selective_scan, inputs, last=True)
    assert probes.ran("scan") == {"triton": 1}
    want = _scan_grads(selective_scan_ref, inputs, last=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-3 * max(1.0, w.abs().max().item()), rtol=1e-3)


# ----------------------------------------------------------------------------------------------------
# Training on CUDA: resume, --compile, DDP
# ----------------------------------------------------------------------------------------------------


class MambaNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.1))  # dropout: the RNG state matters
        self.mix = Mamba(MambaConfig(d_model=64, d_state=16))
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.mix(self.emb(x))).squeeze(-1)


def make_batch(step, micro, batch=8, rank=0, world=1):
    g = step_generator(0, step, micro)
    x = torch.randn(batch, 64, 8, generator=g)
    y = x.sum(-1).cumsum(-1) / 8
    lo = rank * batch // world
    return x[lo : lo + batch // world], y[lo : lo + batch // world]


def loss_fn(model, batch):
    x, y = (t.cuda(non_blocking=True) for t in batch)
    loss = (model(x).float() - y).pow(2).mean()
    return loss, {"mse": loss.item()}


def _trainer(run_dir, steps, resume=False, compile=False, amp="bf16"):
    torch.manual_seed(0)
    model = MambaNet()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = LoopConfig(steps=steps, amp=amp, save_every=3, keep_last=2, progress=False, log_every=1,
                     device="cuda", compile=compile, preflight=False)  # fmt: skip
    return Trainer(model, opt, loss_fn, make_batch, TrainRun.of(cfg, resume=resume),
                   lr_schedule=WarmupCosine(2, total_steps=8), config={}, run_dir=run_dir)  # fmt: skip


@pytest.mark.cuda
def test_resume_on_cuda_gives_identical_weights(tmp_path, no_extra):
    """A checkpoint written on the GPU (its RNG state loaded onto the GPU) resumes to the same weights. The
    model is built on the CPU: the Trainer moves it (and each batch) to its device."""
    full = _trainer(tmp_path / "full", steps=8)
    full.fit()
    assert next(full.raw_model.parameters()).device == torch.device("cuda", torch.cuda.current_device())
    assert probes.ran("scan").keys() == {"triton"} and probes.ran("conv").keys() == {"torch"}, probes.ran()
    part = _trainer(tmp_path / "part", steps=7)
    part.fit()
    for p in list_checkpoints(tmp_path / "part"):
        if p.name != "ckpt_0000006.pt":
            p.unlink()
    resumed = _trainer(tmp_path / "part", steps=8, resume=True)
    assert resumed.step == 6
    resumed.fit()
    for a, b in zip(full.raw_model.parameters(), resumed.raw_model.parameters()):
        # the Triton backward accumulates dB/dC with atomics: not bit-reproducible, hence the tolerance
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.cuda
def test_compile_on_cuda_trains_like_eager(tmp_path, no_extra):
    """--compile: the Triton scan's ops are opaque nodes of the compiled graph. The model has dropout, whose
    masks inductor draws with its own generator on CUDA (eager-equal on the CPU) unless told to fall back
    to eager's random ops: on an H200 the compiled run's weights differed by up to 0.016 after 4 AdamW steps
    of lr 3e-3 without it, the size of a few steps' updates."""
    import torch._inductor.config as inductor_config

    eager = _trainer(tmp_path / "eager", steps=4, amp="none")
    eager.fit()
    assert probes.ran("scan") == {"triton": 4} and probes.ran("conv") == {"torch": 4}, probes.ran()
    compiled = _trainer(tmp_path / "compiled", steps=4, compile=True, amp="none")
    with inductor_config.patch(fallback_random=True):
        compiled.fit()
    for a, b in zip(eager.raw_model.parameters(), compiled.raw_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


DDP_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {testdir!r})
    from memfit.ops import registry as probes
    from memfit.train.distributed import dist_info
    from memfit.train.loop import Trainer
    from memfit.train.settings import LoopConfig, TrainRun
    from test_cuda import MambaNet, loss_fn, make_batch

    info = dist_info()
    torch.manual_seed(0)
    model = MambaNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = LoopConfig(steps=4, amp="none", progress=False, grad_clip=0, device="cuda", preflight=False)
    get = lambda s, m: make_batch(s, m, batch=8, rank=info.rank, world=info.world_size)
    t = Trainer(model, opt, loss_fn, get, TrainRun.of(cfg), run_dir={run_dir!r})
    t.fit()
    assert next(t.raw_model.parameters()).device == torch.device("cuda", info.local_rank)
    assert probes.ran("scan") == {{"triton": 4}}, probes.ran()
    if info.rank == 0:
        torch.save([p.detach().cpu() for p in t.raw_model.parameters()], {out!r})
    """
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, nproc):
    out, script = tmp_path / f"w{nproc}.pt", tmp_path / f"ddp{nproc}.py"
    run_dir = str(tmp_path / f"r{nproc}")
    script.write_text(DDP_SCRIPT.format(testdir=os.path.dirname(__file__), run_dir=run_dir, out=str(out)))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(script)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP on GPUs needs 2 of them")
def test_ddp_on_two_gpus_equals_one_gpu_with_double_batch(tmp_path, no_extra):
    """torchrun, NCCL, --device cuda: rank r on cuda:r; 2 x 4 samples == 1 x 8 samples."""
    two, one = _run(tmp_path, 2), _run(tmp_path, 1)
    for a, b in zip(two, one):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
