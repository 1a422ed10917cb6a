"""The estimate's timeline picture and its PyTorch memory snapshot (memfit.estimate.timeline)."""

from __future__ import annotations

import pickle
import pickletools
import struct
import textwrap

import pytest
import torch
from memfit import cli
from memfit import estimate as estimate_api
from memfit.estimate import CAT, allocator
from memfit.estimate import timeline as tl
from memfit.estimate.steps import _run_step, training_state_tensors
from torch import nn
from torch.cuda import _memory_viz

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# the opcodes the viewer's own unpickler knows (torch/utils/viz/MemoryViz.js, `unpickle`)
VIEWER_OPCODES = {
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET", "BININT",
    "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET", "MARK", "MEMOIZE",
    "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE", "BINUNICODE", "STOP",
    "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT",
}  # fmt: skip


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


TARGETS = ["cpu-estimate", "cuda-estimate"]  # no `cuda` id: such a test needs a GPU (conftest.py)
MODELS = {"mlp": (mlp, "16x64", "classes"), "encoder": (encoder, "4x32x64", "same")}


def _estimate(name: str, device: str):
    factory, shape, loss = MODELS[name]
    return estimate_api(factory, shape, loss=loss, device=device)


def _active(snap: dict) -> list[dict]:
    return [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]


def _replay(snap: dict) -> int:
    """The peak of the bytes the snapshot's alloc / free_completed events hold, in their order."""
    live = peak = 0
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live += e["size"]
            peak = max(peak, live)
        elif e["action"] == "free_completed":
            live -= e["size"]
    return peak


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=TARGETS)
def test_snapshot_events_replayed_give_the_estimates_peak(name, device):
    result = _estimate(name, device)
    snap = result.snapshot()
    peak = _replay(snap)
    if device == "cpu":
        assert peak == result.peak_bytes
        return
    # the storages alone (512-byte blocks) are the trace's own sum; the allocator adds the unsplit ends
    assert peak == result.cuda.traced
    assert abs(peak - result.peak_bytes) <= 0.005 * result.peak_bytes
    # the same events through the allocator simulation give the estimate's allocator and reserved peaks,
    # and its segment_alloc events add up to the reserved peak (segments are never given back in a step)
    events = snap["device_traces"][0]
    sim = allocator.simulate(allocator.events_from_device_trace(events))
    assert (sim.peak_allocated, sim.peak_reserved) == (result.allocated_bytes, result.reserved_bytes)
    assert sum(e["size"] for e in events if e["action"] == "segment_alloc") == result.reserved_bytes


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=TARGETS)
def test_memory_viz_reads_the_snapshot(tmp_path, device):
    result = _estimate("encoder", device)
    path = tmp_path / "step.pickle"
    snap = result.snapshot(str(path))
    data = path.read_bytes()
    assert {op.name for op, _, _ in pickletools.genops(data)} <= VIEWER_OPCODES
    loaded = pickle.loads(data)
    summary, history = _memory_viz.segsum(loaded), _memory_viz.trace(loaded)  # both check their sums
    assert f"segments: {len(snap['segments'])}" in summary and "Device 0" in history
    assert "cudaMalloc" in history and "del " in history
    for seg in loaded["segments"]:  # the blocks tile each segment, in address order
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"] and seg["device"] == 0
    # the flame graph of what is alive at the end names the modules and their classes (the parameters
    # by the module that holds them), and every event names the op that made the storage
    stacks = _memory_viz.memory(loaded, format_flamegraph=lambda lines: lines)
    assert "layers.0.self_attn:0:MultiheadAttention;layers.0.self_attn.out_proj:0:" in stacks
    assert "layers.1.linear1:0:Linear;layers.1.linear1:0:" in stacks
    every = {f["filename"] for e in loaded["device_traces"][0] for f in e["frames"]}
    assert "layers.1.self_attn" in every and "layers.0.linear1" in every
    # the phase each storage was made in: parameters in the build, the optimizer state in an optimizer step
    ends = {b["frames"][0]["name"].split("(")[-1]: b["frames"][-1]["name"] for b in _active(loaded)}
    assert ends["params)"] == "build (set-up)"
    assert ends["optimizer)"] == ("optimizer (set-up)" if device == "cpu" else "optimizer (step 1)")
    ops = {f["name"].split()[0] for e in loaded["device_traces"][0] for f in e["frames"][:1]}
    assert {"addmm", "gelu", "native_layer_norm"} <= ops or {"addmm", "relu", "native_layer_norm"} <= ops


def test_snapshot_ends_holding_what_a_real_step_leaves():
    """At the end of the last step a real run holds the parameters, the optimizer state and the step's
    input batch: the snapshot's active blocks hold exactly those bytes (counted on a real model after a
    real step)."""
    torch.manual_seed(0)
    result = _estimate("mlp", "cpu")
    active = sum(b["requested_size"] for b in _active(result.snapshot()))
    step = result.target.step()
    model = step.build_model()
    opt = step.optimizer(model.parameters())
    _run_step(step, model, opt, torch.device("cpu"))
    held = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in training_state_tensors(model, opt)}
    batch = sum(t.untyped_storage().nbytes() for t in step.make_batch(torch.device("cpu")))
    assert active == sum(st.nbytes() for st in held.values()) + batch


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=TARGETS)
def test_timeline_png_is_written_and_its_top_is_the_peak(tmp_path, device):
    result = _estimate("encoder", device)
    path = tmp_path / "timeline.png"
    png = result.timeline(str(path))
    assert path.read_bytes() == png and png.startswith(PNG_MAGIC)
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert width > 400 and height > 200
    assert result._repr_png_().startswith(PNG_MAGIC)
    assert "<img src='data:image/png;base64," in result._repr_html_()
    # the stacked layers reach the estimate's peak (the allocator peak on CUDA) at the traced peak
    lay = tl.layout(result.trace)
    xs, ys, reserved = tl.series(lay)
    totals = [sum(col) for col in zip(*ys)]
    assert max(totals) == result.peak_bytes
    # what the peak's note counts is what the picture stacks there
    at = xs.index(result.trace.peak_seq)
    alive = tl.alive_at(lay, result.trace.peak_seq)
    assert sum(lay.size(i) for i in alive) == totals[at] == result.peak_bytes
    activations = [i for i in alive if result.trace.records[i][CAT] == "activations"]
    assert sum(lay.size(i) for i in activations) == ys[3][at] + ys[4][at] > 0
    assert (reserved is None) == (device == "cpu")
    if reserved is not None:
        assert max(reserved) == result.reserved_bytes
    # the phases: forward, backward and optimizer of the last step, the peak inside one of them
    spans = tl._spans(result.trace, lay.end)
    last = max(s[4] for s in spans)
    assert [s[2] for s in spans if s[4] == last] == ["forward", "backward", "optimizer"]
    assert any(start <= result.trace.peak_seq < stop for start, stop, *_ in spans)


def test_thinning_a_long_timeline_keeps_its_peak():
    xs = list(range(10_000))
    ys = [[(i * 7919) % 1000 for i in xs], [1] * len(xs)]
    ys[0][4321] = 5000
    tx, ty, _ = tl._thin(xs, ys, None, limit=100)
    assert len(tx) == 100 and 4321 in tx and max(ty[0]) == 5000


def _cli(capfd, *argv):
    with pytest.raises(SystemExit) as info:
        cli.main(["estimate", *argv])
    out = capfd.readouterr()
    return info.value.code, out.out, out.err


@pytest.fixture
def model_file(tmp_path):
    f = tmp_path / "models.py"
    f.write_text(
        textwrap.dedent(
            """
            import torch

            def small():
                return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
            """
        )
    )
    return f


def test_cli_writes_the_timeline_and_the_snapshot(tmp_path, capfd, model_file):
    png, snap = tmp_path / "t.png", tmp_path / "s.pickle"
    snap.write_bytes(b"an older file")  # replaced
    code, out, err = _cli(capfd, f"{model_file}:small", "--input", "4x8", "--timeline", str(png),
                          "--snapshot", str(snap), "--json")  # fmt: skip
    assert code == 0, err
    assert png.read_bytes().startswith(PNG_MAGIC)
    data = pickle.loads(snap.read_bytes())
    assert set(data) == {"segments", "device_traces"} and data["device_traces"][0]
    import json

    assert _replay(data) == round(json.loads(out)["peak_gib"] * 2**30)


@pytest.mark.parametrize(
    "flag,where,message",
    [
        ("--timeline", "{tmp}", "is a folder; give a file name, e.g."),
        ("--snapshot", "{tmp}/no/such/folder/s.pickle", "no folder"),
        ("--timeline", "{file}/t.png", "no folder"),
        ("--timeline", "{tmp}/t.jpg", "the timeline is a PNG image; name it"),
    ],
)
def test_cli_bad_output_paths_are_one_line_exit_2(tmp_path, capfd, model_file, flag, where, message):
    path = where.format(tmp=tmp_path, file=model_file)
    code, out, err = _cli(capfd, f"{model_file}:small", "--input", "4x8", flag, path)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"memfit estimate: error: {flag} ") and message in err, err


@pytest.mark.cuda
def test_measure_writes_the_real_steps_snapshot_beside_the_predicted_one(tmp_path, capfd, model_file):
    snap = tmp_path / "s.pickle"
    code, _, err = _cli(capfd, f"{model_file}:small", "--input", "4x8", "--measure", "--snapshot", str(snap))
    assert code == 0, err
    real = pickle.loads((tmp_path / "s.measured.pickle").read_bytes())
    predicted = pickle.loads(snap.read_bytes())
    for s in (predicted, real):
        assert "segments:" in _memory_viz.segsum(s) and "Device 0" in _memory_viz.trace(s)
    assert any(e["action"] == "alloc" for e in real["device_traces"][torch.cuda.current_device()])
