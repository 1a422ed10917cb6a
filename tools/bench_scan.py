"""Selective scan training step (forward + backward of the scan alone): time and memory, CPU, fp32.

    uv run python tools/bench_scan.py                  # the three reference sizes, 1 thread
    uv run python tools/bench_scan.py --with-ref       # also mamba_ssm's selective_scan_ref at every size
    uv run python tools/bench_scan.py --quick          # one small size, seconds
    uv run python tools/bench_scan.py --sizes 60x256x200x16 --threads 2 --repeat 7 --json scan.json
    uv run python tools/bench_scan.py --mbsnet --repeat 9    # the MBS-Net CPU recipe's two scan shapes
    uv run python tools/bench_scan.py --mbsnet-step          # its whole training step, lane vs sequence path

Rows per size (batch B, dim D, length L, state N):

* ``selective_scan``: memfit's chunked recomputing Mamba-1 scan (A is (D, N): every state entry has
  its own decay) as it runs by default on CPU: the fused C kernel (memfit/cpu_kernel.c, chunk 64)
  when a C compiler is there, on its channel-lane path for this layout (blocks of 16 channels, the
  state as N lane vectors). ``selective_scan seq. path``: the same kernel on its sequence path (one
  (b, d) sequence per work item, the N-vector state as the SIMD axis;
  ``memfit.ops.scan.cpu.LANE_PATH = False``),
  which is what ran before the lane path existed. ``selective_scan torch-ops``: the same scan with
  ``use_kernels=False``, its torch-op path (auto chunk size), the fallback without a compiler.
* ``ssd (Mamba-2)``: tools/ssd_reference.py, our plain re-implementation of Mamba-2's chunked SSD on
  the same data seen as heads of 64 channels (A one scalar per head, B/C shared by the heads, dt per
  head); D and the z gate included. It does less arithmetic than a Mamba-1 scan (no per-entry decays),
  which is why it is the bar. Its chunk length is the fastest of a few (Mamba-2's default 64, 32, and a
  divisor of L near 32), each shown; the ratio uses the fastest.
* ``selective_scan_ref``: mamba_ssm's materialising reference: one timed run, and by default only at
  small sizes (``--quick``); ``--with-ref`` adds it at every size (minutes each).

Inputs are laid out as a Mamba block passes them (u, delta, z and the output's gradient transposed views
of (B, L, D) tensors, B/C (B, N, L) per step; ``--contiguous`` makes the per-step tensors contiguous
(B, D, L), where the kernel takes its sequence path). Forward + backward is the output's backward with a
fixed random gradient. Time: median wall seconds of ``--repeat`` runs, the candidates alternated within
each repeat (CPU seconds of this process beside it). Peak: tensor memory allocated inside forward +
backward, inputs included (``memfit.estimate.memory.measure_peak``).

``--mbsnet`` runs the shapes the MBS-Net CPU recipe (mbsnet-speech ``--config cpu``: 64 channels,
d_state 8, expand 1, batch 4 of 1 s) passes its scans: 48 sequences of 161 frames (temporal) and 644 of
12 bands (cross-band). ``--mbsnet-step`` times that recipe's whole training step (forward, loss,
backward, AdamW on random audio) with the kernel's lane path and with its sequence path, alternated.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from memfit.estimate.steps import measure_peak
from memfit.ops.cpu_kernel import library as fused_kernel
from memfit.ops.scan import auto_chunk_size, selective_scan, selective_scan_ref
from memfit.ops.scan import cpu as ssm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memfit.errors import UsageError
from memfit.train.flags import Parser
from ssd_reference import ssd_scan  # noqa: E402

SIZES = [(60, 256, 200, 16), (1, 1536, 512, 16), (1, 1536, 2048, 16)]
MBSNET_SIZES = [(48, 64, 161, 8), (644, 64, 12, 8)]  # CPU recipe: temporal, cross-band scans
HEAD_DIM = 64
REF_MAX_ELEMENTS = 4 * 2**20  # selective_scan_ref runs by default only up to this B*D*L*N (--quick)
# the reference sizes, fp32 fwd+bwd, 1 thread (seconds / MiB), as measured before the fused kernel
ANCHORS = {
    (60, 256, 200, 16): "memfit 1.11 s/114 MiB, selective_scan_ref 66 s/1216 MiB, "
    "mamba.py pscan 9.0 s/2061 MiB, ssd_minimal 0.25 s/165 MiB",
    (1, 1536, 512, 16): "memfit 0.18 s/22 MiB, selective_scan_ref 41.5 s/400 MiB, pscan 1.35 s/399 MiB, "
    "ssd_minimal 0.045 s/42 MiB",
    (1, 1536, 2048, 16): "memfit 1.06 s/76 MiB, selective_scan_ref 469 s/1608 MiB, pscan 8.0 s/1596 MiB, "
    "ssd_minimal 0.28 s/174 MiB",
}


def make_inputs(batch, dim, L, N, contiguous=False, seed=0) -> dict[str, torch.Tensor]:
    """Mamba-1 scan inputs (Mamba's S4D-real A, softplus dt around 0.1) as leaves needing gradients."""
    g = torch.Generator().manual_seed(seed)

    def per_step(scale=1.0, shift=0.0):  # (B, D, L), from a (B, L, D) tensor unless contiguous
        x = torch.randn(batch, L, dim, generator=g) * scale + shift
        return x.transpose(1, 2).contiguous() if contiguous else x.transpose(1, 2)

    return {
        "u": per_step().detach().requires_grad_(),
        "delta": per_step(0.5, -1.0).detach().requires_grad_(),
        "A": (-torch.arange(1, N + 1, dtype=torch.float32).repeat(dim, 1)).requires_grad_(),
        "B": torch.randn(batch, N, L, generator=g).requires_grad_(),
        "C": torch.randn(batch, N, L, generator=g).requires_grad_(),
        "D": torch.ones(dim).requires_grad_(),
        "z": per_step().detach().requires_grad_(),
        "delta_bias": (torch.rand(dim, generator=g) * -4).requires_grad_(),
    }


def ssd_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same data for Mamba-2: heads of HEAD_DIM channels, one A and one dt per head."""
    dim = inputs["u"].shape[1]
    H = max(1, dim // HEAD_DIM)
    g = torch.Generator().manual_seed(1)
    delta = inputs["delta"].detach()
    return {
        "u": inputs["u"].detach().clone().requires_grad_(),
        "delta_h": delta.unflatten(1, (H, -1))[:, :, 0].transpose(1, 2).contiguous().requires_grad_(),
        "A_h": (-torch.rand(H, generator=g) * 15 - 1).requires_grad_(),
        "B": inputs["B"].detach().clone().requires_grad_(),
        "C": inputs["C"].detach().clone().requires_grad_(),
        "D": inputs["D"].detach().clone().requires_grad_(),
        "z": inputs["z"].detach().clone().requires_grad_(),
        "bias_h": inputs["delta_bias"].detach().unflatten(0, (H, -1))[:, 0].clone().requires_grad_(),
    }


def ssd_layer(t: dict[str, torch.Tensor], chunk: int) -> torch.Tensor:
    """Mamba-2's scan on (B, D, L) data: dt = softplus(delta + bias) per head, SSD, + D u, * silu(z)."""
    u = t["u"]
    batch, dim, L = u.shape
    H = t["A_h"].shape[0]
    dt = F.softplus(t["delta_h"] + t["bias_h"])  # (B, L, H)
    x = (u.transpose(1, 2).unflatten(2, (H, -1)) * dt.unsqueeze(-1)).contiguous()  # (B, L, H, P)
    a = dt * t["A_h"]
    Bs, Cs = t["B"].transpose(1, 2), t["C"].transpose(1, 2)  # (B, L, N)
    pad = -L % chunk
    if pad:
        x, a = F.pad(x, (0, 0, 0, 0, 0, pad)), F.pad(a, (0, 0, 0, pad))
        Bs, Cs = F.pad(Bs, (0, 0, 0, pad)), F.pad(Cs, (0, 0, 0, pad))
    y, _ = ssd_scan(x, a, Bs, Cs, chunk=chunk)
    y = y[:, :L].flatten(2).transpose(1, 2)  # (B, D, L)
    return (y + u * t["D"][:, None]) * F.silu(t["z"])


def mamba1(fn, lane_path=True):
    def step(t):
        return fn(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"], True)

    step.lane_path = lane_path  # train_step holds memfit.ops.scan.cpu.LANE_PATH at this through backward
    return step


def out_grad(inputs: dict[str, torch.Tensor], seed=2) -> torch.Tensor:
    """A fixed gradient for the output, laid out like u (out_proj's gradient in a Mamba block)."""
    u = inputs["u"]
    g = torch.randn(u.shape, generator=torch.Generator().manual_seed(seed))
    return g if u.stride(2) == 1 else g.transpose(1, 2).contiguous().transpose(1, 2)


def train_step(fn, t: dict[str, torch.Tensor], gout: torch.Tensor) -> None:
    ssm.LANE_PATH = getattr(fn, "lane_path", True)
    try:
        fn(t).backward(gout)
    finally:
        ssm.LANE_PATH = True
    for v in t.values():
        v.grad = None


def ssd_chunks(L: int) -> list[int]:
    near32 = max(c for c in range(1, 33) if L % c == 0)
    return sorted({64, 32, near32} if near32 >= 16 else {64, 32})


def bench_size(size, args) -> list[dict]:
    batch, dim, L, N = size
    inputs = make_inputs(batch, dim, L, N, contiguous=args.contiguous)
    s_in = ssd_inputs(inputs)
    gout = out_grad(inputs)
    torch_ops = partial(selective_scan, use_kernels=False)
    cands = [("selective_scan", mamba1(selective_scan), inputs),
             ("selective_scan seq. path", mamba1(selective_scan, lane_path=False), inputs),
             ("selective_scan torch-ops", mamba1(torch_ops), inputs)]  # fmt: skip
    cands += [(f"ssd (Mamba-2) chunk {c}", lambda t, c=c: ssd_layer(t, c), s_in) for c in ssd_chunks(L)]
    if args.with_ref or batch * dim * L * N <= REF_MAX_ELEMENTS:
        cands.append(("selective_scan_ref", mamba1(selective_scan_ref), inputs))
    for name, fn, t in cands:
        if name != "selective_scan_ref":
            train_step(fn, t, gout)  # warm-up
    times = {name: [] for name, _, _ in cands}
    cpus = {name: [] for name, _, _ in cands}
    for r in range(args.repeat):
        for name, fn, t in cands if r % 2 == 0 else cands[::-1]:
            if name == "selective_scan_ref" and r >= 1:
                continue  # one timed run is enough for the slow reference
            w0, c0 = time.perf_counter(), time.process_time()
            train_step(fn, t, gout)
            times[name].append(time.perf_counter() - w0)
            cpus[name].append(time.process_time() - c0)
    rows = []
    for name, fn, t in cands:
        with measure_peak("cpu", existing=list(t.values())) as m:
            train_step(fn, t, gout)
        rows.append({"name": name, "time_s": statistics.median(times[name]),
                     "cpu_s": statistics.median(cpus[name]), "peak_mib": m.peak_mib})  # fmt: skip
    ssd = min((r for r in rows if r["name"].startswith("ssd")), key=lambda r: r["time_s"])
    ours, seq = rows[0], rows[1]
    path = "fused C kernel" if fused_kernel() else "no C compiler: torch ops"
    print(f"\nB{batch} D{dim} L{L} N{N}  (selective_scan: {path}; torch-ops chunk "
          f"{auto_chunk_size(batch, dim, L, N)})")  # fmt: skip
    print(f"  {'scan':28s} {'time s':>8s} {'cpu s':>8s} {'peak MiB':>9s} {'time/ssd':>9s} {'mem/ssd':>8s}")
    for r in rows:
        r["time_vs_ssd"], r["mem_vs_ssd"] = r["time_s"] / ssd["time_s"], r["peak_mib"] / ssd["peak_mib"]
        print(f"  {r['name']:28s} {r['time_s']:8.3f} {r['cpu_s']:8.3f} {r['peak_mib']:9.1f} "
              f"{r['time_vs_ssd']:8.2f}x {r['mem_vs_ssd']:7.2f}x")  # fmt: skip
    print(f"  ours / fastest SSD: time {ours['time_vs_ssd']:.2f}x (target <= 2), "
          f"memory {ours['mem_vs_ssd']:.2f}x (target <= 1)")  # fmt: skip
    print(f"  lane path / sequence path: time {ours['time_s'] / seq['time_s']:.2f}x "
          f"(sequence path {seq['time_s'] / ours['time_s']:.2f}x the lane path's time)")  # fmt: skip
    print(f"  before the fused kernel: {ANCHORS.get(size, '-')}")
    return rows


def mbsnet_step(args, warmup=3) -> None:
    """The MBS-Net CPU recipe's training step (batch 4 x 1 s of random audio, its loss, backward, AdamW)
    with the scan kernel's lane path and with its sequence path, alternated; median of --repeat."""
    from mbsnet_speech.config import SETTINGS
    from mbsnet_speech.losses import enhancement_loss
    from mbsnet_speech.model import MBSNet

    recipe = SETTINGS["cpu"](torch.device("cpu"))
    cfg, train = recipe.model, recipe.train
    torch.manual_seed(0)
    model = MBSNet(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=train.lr)
    samples = int(train.seconds * cfg.sample_rate)
    g = torch.Generator().manual_seed(0)
    batch = tuple(0.1 * torch.randn(train.batch_size, samples, generator=g) for _ in range(2))

    def one(lane_path: bool) -> float:
        ssm.LANE_PATH = lane_path
        t = time.perf_counter()
        enhancement_loss(model, batch, train.loss)[0].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ssm.LANE_PATH = True
        return time.perf_counter() - t

    times = {True: [], False: []}
    for r in range(warmup + args.repeat):
        for lane_path in (True, False) if r % 2 == 0 else (False, True):
            t = one(lane_path)
            if r >= warmup:
                times[lane_path].append(t)
    lane, seq = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"MBS-Net CPU recipe training step (batch {train.batch_size} x {samples} samples, "
        f"{torch.get_num_threads()} thread(s), median of {args.repeat} alternated after {warmup} warm-up)"
    )
    print(f"  scan lane path     {lane:.3f} s/step")
    print(f"  scan sequence path {seq:.3f} s/step   (sequence / lane: {seq / lane:.2f}x)")  # fmt: skip


def parse_size(text: str) -> tuple[int, int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(text)
    return tuple(int(p) for p in parts)


def main(argv=None) -> None:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", help="comma-separated BxDxLxN (default: the three reference sizes)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--with-ref", action="store_true", help="selective_scan_ref at every size (minutes)")
    p.add_argument("--contiguous", action="store_true", help="contiguous (B, D, L) delta and z")
    p.add_argument("--quick", action="store_true", help="one small size, 3 repeats")
    p.add_argument("--mbsnet", action="store_true", help="the MBS-Net CPU recipe's two scan shapes")
    p.add_argument("--mbsnet-step", action="store_true",
                   help="time the MBS-Net CPU recipe's training step, lane vs sequence path")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = p.parse_args(argv)
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
    except ValueError as e:
        raise UsageError(
            f"error: --sizes wants BxDxLxN with positive integers, e.g. 60x256x200x16; got {e}"
        ) from None
    if args.repeat < 1 or args.threads < 1:
        raise UsageError("error: --repeat and --threads must be at least 1")
    if args.quick:
        args.sizes, args.repeat = [(8, 128, 64, 16)], 3
    torch.set_num_threads(args.threads)
    if args.mbsnet_step:
        mbsnet_step(args)
        return
    if args.mbsnet:
        args.sizes = (args.sizes or []) + MBSNET_SIZES
    sizes = args.sizes or SIZES
    layout = "contiguous" if args.contiguous else "as a Mamba block passes them"
    print(f"selective scan fwd+bwd, fp32, CPU, {torch.get_num_threads()} thread(s), median of {args.repeat} "
          f"alternated repeats; inputs {layout}")  # fmt: skip
    out = {f"B{b}xD{d}xL{L}xN{n}": bench_size((b, d, L, n), args) for b, d, L, n in sizes}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "sizes": out}, f, indent=2)


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("bench_scan", lambda argv: main(argv)))
