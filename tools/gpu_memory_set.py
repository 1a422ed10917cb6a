"""`memfit estimate --device cuda` against a real GPU, on sixteen third-party training steps at GPU sizes,
recurrent and fp32-LLaMA steps at several shapes (``checks``), and every budget row of the four systems
(naive baselines included).

On a machine with a GPU, each step is estimated for that GPU (memfit.estimate.measure.estimate_for) and run
for real from an empty allocator (measure_step: 3 steps): allocated peak, reserved peak and card total,
estimate beside measurement, printed as one table and written as JSON. tools/bench_gpu.py runs it as its
part (e). Models come from torchvision and transformers with random weights (nothing is
downloaded), optimised with fused AdamW, each loss as its library computes it.

    uv run python tools/gpu_memory_set.py                 # on a GPU: the set and the budget rows
    uv run python tools/gpu_memory_set.py --only gru,resnet50-fp32 --no_budgets
    uv run python tools/gpu_memory_set.py --smoke         # CPU: estimates two entries (checks it runs)
    uv run python tools/gpu_memory_set.py --smoke --only gru-tagger-4x100,llama-fp32-gqa-2x256
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from memfit.step import TrainStep, default_optimizer  # noqa: E402
from memfit.train.flags import Parser  # noqa: E402
from torch import nn  # noqa: E402

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Model:
    """One third-party step, shaped as a budget row for measure.compare_budgets (variant, batch, step)."""

    variant: str
    shape: str
    make: Callable[[], TrainStep]
    batch: int = 0

    @property
    def step(self) -> TrainStep:
        return self.make()


def _image_step(build, batch: int, size: int, classes: int = 1000, amp=None) -> TrainStep:
    def make(d):
        return torch.randn(batch, 3, size, size, device=d), torch.randint(0, classes, (batch,), device=d)

    def loss(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    return TrainStep(build, make, loss, default_optimizer, amp)


def _tv(name: str, **kw) -> Callable[[], nn.Module]:
    def build():
        import torchvision

        return torchvision.models.get_model(name, weights=None, **kw)

    return build


def _segmentation(batch: int, size: int) -> TrainStep:
    def build():
        import torchvision

        return torchvision.models.segmentation.fcn_resnet50(
            weights=None, weights_backbone=None, aux_loss=False
        )

    def make(d):
        return torch.randn(batch, 3, size, size, device=d), torch.randint(
            0, 21, (batch, size, size), device=d
        )

    def loss(m, b):
        return F.cross_entropy(m(b[0])["out"], b[1])

    return TrainStep(build, make, loss, default_optimizer, None)


def _hf(cls_name: str, config_name: str, **config) -> Callable[[], nn.Module]:
    def build():
        import transformers

        cfg = getattr(transformers, config_name)(**config)
        cfg.use_cache = False  # a training step keeps no key/value cache
        return getattr(transformers, cls_name)(cfg)

    return build


def _causal_lm(build, batch: int, seq: int, vocab: int, amp=None) -> TrainStep:
    def make(d):
        return torch.randint(0, vocab, (batch, seq), device=d)

    def loss(m, ids):
        return m(input_ids=ids, labels=ids).loss  # the library's shifted cross-entropy

    return TrainStep(build, make, loss, default_optimizer, amp)


def _masked_lm(batch: int, seq: int) -> TrainStep:
    vocab = 30522

    def make(d):
        ids = torch.randint(0, vocab, (batch, seq), device=d)
        labels = torch.where(torch.rand(batch, seq, device=d) < 0.15, ids, torch.full_like(ids, -100))
        return ids, labels

    def loss(m, b):
        return m(input_ids=b[0], labels=b[1]).loss

    return TrainStep(_hf("BertForMaskedLM", "BertConfig"), make, loss, default_optimizer, None)


def _seq2seq(batch: int, src: int, tgt: int) -> TrainStep:
    vocab = 32128

    def make(d):
        return torch.randint(0, vocab, (batch, src), device=d), torch.randint(
            0, vocab, (batch, tgt), device=d
        )

    def loss(m, b):
        return m(input_ids=b[0], labels=b[1]).loss

    return TrainStep(
        _hf("T5ForConditionalGeneration", "T5Config", decoder_start_token_id=0, pad_token_id=0),
        make,
        loss,
        default_optimizer,
        None,
    )


class FrameRNN(nn.Module):
    """A speech-style recurrent tagger: (B, T, features) -> per-frame classes, cuDNN's RNN on a GPU."""

    def __init__(self, kind: str, features: int, hidden: int, layers: int, classes: int, bidirectional=False):
        super().__init__()
        rnn = {"gru": nn.GRU, "lstm": nn.LSTM}[kind]
        self.rnn = rnn(features, hidden, layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), classes)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def _rnn(kind: str, batch: int, frames: int, bidirectional: bool = False) -> TrainStep:
    features, classes = 80, 40

    def make(d):
        x = torch.randn(batch, frames, features, device=d)
        return x, torch.randint(0, classes, (batch, frames), device=d)

    def loss(m, b):
        return F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())

    def build():
        return FrameRNN(kind, features, 512, 3 if kind == "gru" else 2, classes, bidirectional)

    return TrainStep(build, make, loss, default_optimizer, None)


class Tagger(nn.Module):
    """A recurrent sequence tagger: token embeddings -> GRU/LSTM -> per-token tags (cuDNN's RNN on a GPU)."""

    def __init__(
        self, kind: str, vocab: int, embed: int, hidden: int, layers: int, bidirectional: bool, tags: int
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        rnn = {"gru": nn.GRU, "lstm": nn.LSTM}[kind]
        self.rnn = rnn(embed, hidden, layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), tags)

    def forward(self, ids):
        return self.head(self.rnn(self.embed(ids))[0])


class ConvLSTM(nn.Module):
    """A mixed model: a 1-D convolutional front end over feature frames, an LSTM, per-frame classes."""

    def __init__(
        self, features: int, channels: int, hidden: int, layers: int, bidirectional: bool, classes: int
    ):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(features, channels, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 5, padding=2),
        )
        self.rnn = nn.LSTM(channels, hidden, layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), classes)

    def forward(self, x):  # (B, T, features)
        return self.head(self.rnn(self.conv(x.transpose(1, 2)).transpose(1, 2))[0])


def _tagger(kind: str, batch: int, steps: int, hidden: int, layers: int = 1, bidirectional: bool = False,
            embed: int = 128, amp=None) -> TrainStep:  # fmt: skip
    vocab, tags = 10000, 20

    def make(d):
        return torch.randint(0, vocab, (batch, steps), device=d), torch.randint(
            0, tags, (batch, steps), device=d
        )

    def loss(m, b):
        return F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())

    def build():
        return Tagger(kind, vocab, embed, hidden, layers, bidirectional, tags)

    return TrainStep(build, make, loss, default_optimizer, amp)


def _conv_lstm(
    batch: int, frames: int, hidden: int, layers: int = 1, bidirectional: bool = False
) -> TrainStep:
    features, classes = 80, 40

    def make(d):
        return torch.randn(batch, frames, features, device=d), torch.randint(
            0, classes, (batch, frames), device=d
        )

    def loss(m, b):
        return F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())

    def build():
        return ConvLSTM(features, 256, hidden, layers, bidirectional, classes)

    return TrainStep(build, make, loss, default_optimizer, None)


def _llama(batch: int, seq: int, hidden: int, layers: int, heads: int, kv_heads: int) -> TrainStep:
    """A LLaMA-style decoder in fp32 (no autocast), random weights, vocab 32000; ``kv_heads < heads`` is
    grouped-query attention (SDPA's math path in fp32 on torch 2.11)."""
    build = _hf("LlamaForCausalLM", "LlamaConfig", vocab_size=32000, hidden_size=hidden,
                intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=max(2048, seq))  # fmt: skip
    return _causal_lm(build, batch, seq, 32000)


def checks() -> list[Model]:
    """Recurrent and fp32-LLaMA steps at several shapes, beside the set: cuDNN RNNs at small shapes (batch 4,
    about 100 steps, hidden 256: the small end of the RNN workspace table, between its measured hidden
    sizes) and at large ones (outside the table: hidden 1024, 3 layers, long sequences), and LLaMA-style
    decoders in fp32 with and without grouped key/value heads, at several batch x length."""
    return [
        Model("gru-tagger-4x100", "4x100 ids, GRU 128->256", lambda: _tagger("gru", 4, 100, 256)),
        Model("bigru-tagger-4x100", "4x100 ids, 2-layer bidirectional GRU 128->256",
              lambda: _tagger("gru", 4, 100, 256, layers=2, bidirectional=True)),
        Model("lstm-tagger-4x120", "4x120 ids, LSTM 128->256", lambda: _tagger("lstm", 4, 120, 256)),
        Model("conv-lstm-4x100", "4x100 frames of 80, conv front end, LSTM 256->256",
              lambda: _conv_lstm(4, 100, 256)),
        Model("conv-bilstm-4x100", "4x100 frames of 80, conv front end, 2-layer bidirectional LSTM 256->256",
              lambda: _conv_lstm(4, 100, 256, layers=2, bidirectional=True)),
        Model("gru-tagger-8x50", "8x50 ids, GRU 128->128", lambda: _tagger("gru", 8, 50, 128)),
        Model("bilstm-tagger-16x200-bf16", "16x200 ids, bidirectional LSTM 128->512, bf16 autocast",
              lambda: _tagger("lstm", 16, 200, 512, bidirectional=True, amp=BF16)),
        Model("lstm-tagger-64x400", "64x400 ids, 2-layer bidirectional LSTM 300->512",
              lambda: _tagger("lstm", 64, 400, 512, layers=2, bidirectional=True, embed=300)),
        Model("gru-tagger-16x1000", "16x1000 ids, 3-layer GRU 128->1024",
              lambda: _tagger("gru", 16, 1000, 1024, layers=3)),
        Model("llama-fp32-gqa-2x256", "2x256 ids, fp32, hidden 1024, 8 layers, 16 heads / 4 kv",
              lambda: _llama(2, 256, 1024, 8, 16, 4)),
        Model("llama-fp32-2x256", "2x256 ids, fp32, hidden 1024, 8 layers, 16 heads",
              lambda: _llama(2, 256, 1024, 8, 16, 16)),
        Model("llama-fp32-gqa-small-2x256", "2x256 ids, fp32, hidden 768, 12 layers, 12 heads / 4 kv",
              lambda: _llama(2, 256, 768, 12, 12, 4)),
        Model("llama-fp32-gqa-4x512", "4x512 ids, fp32, hidden 1024, 8 layers, 16 heads / 4 kv",
              lambda: _llama(4, 512, 1024, 8, 16, 4)),
        Model("llama-fp32-gqa-1x1024", "1x1024 ids, fp32, hidden 2048, 4 layers, 32 heads / 8 kv",
              lambda: _llama(1, 1024, 2048, 4, 32, 8)),
    ]  # fmt: skip


def _wav2vec2(batch: int, samples: int) -> TrainStep:
    # LayerDrop draws a random number per layer and branches on it: off, as a fake trace cannot follow it
    build = _hf("Wav2Vec2ForCTC", "Wav2Vec2Config", vocab_size=32, layerdrop=0.0, mask_time_prob=0.0)

    def make(d):
        return torch.randn(batch, samples, device=d)

    def loss(m, x):
        logits = m(input_values=x).logits
        labels = torch.arange(logits.shape[1], device=logits.device).remainder(32).expand(logits.shape[:2])
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    return TrainStep(build, make, loss, default_optimizer, None)


def models() -> list[Model]:
    """The set: convnets, vision transformers, language models (SDPA and eager attention), recurrent and
    speech models, a segmentation net; fp32 and bf16 autocast."""
    img = _image_step
    gpt2 = _hf("GPT2LMHeadModel", "GPT2Config")
    gpt2_eager = _hf("GPT2LMHeadModel", "GPT2Config", attn_implementation="eager")
    return [
        Model("resnet50-fp32", "2x3x160x160, 1000 classes", lambda: img(_tv("resnet50"), 2, 160)),
        Model("resnet50-bf16", "2x3x160x160, bf16 autocast", lambda: img(_tv("resnet50"), 2, 160, amp=BF16)),
        Model("gpt2-124m", "2x128 ids", lambda: _causal_lm(gpt2, 2, 128, 50257)),
        Model("gpt2-124m-eager-bf16", "8x1024 ids, eager attention, bf16 autocast",
              lambda: _causal_lm(gpt2_eager, 8, 1024, 50257, amp=BF16)),
        Model("gru-3x512", "32x300 frames of 80", lambda: _rnn("gru", 32, 300)),
        Model("bilstm-2x512", "16x200 frames of 80", lambda: _rnn("lstm", 16, 200, bidirectional=True)),
        Model("vit_b_16-bf16", "8x3x224x224, bf16 autocast", lambda: img(_tv("vit_b_16"), 8, 224, amp=BF16)),
        Model("efficientnet_b0", "16x3x224x224", lambda: img(_tv("efficientnet_b0"), 16, 224)),
        Model("mobilenet_v3_large", "32x3x224x224", lambda: img(_tv("mobilenet_v3_large"), 32, 224)),
        Model("convnext_tiny-bf16", "8x3x224x224, bf16 autocast",
              lambda: img(_tv("convnext_tiny"), 8, 224, amp=BF16)),
        Model("densenet121", "8x3x224x224", lambda: img(_tv("densenet121"), 8, 224)),
        Model("swin_t", "8x3x224x224", lambda: img(_tv("swin_t"), 8, 224)),
        Model("bert-base-mlm", "8x128 ids, 15% masked", lambda: _masked_lm(8, 128)),
        Model("t5-small", "4x256 ids -> 4x64", lambda: _seq2seq(4, 256, 64)),
        Model("fcn_resnet50", "2x3x256x256, 21 classes per pixel", lambda: _segmentation(2, 256)),
        Model("wav2vec2-base", "2x32000 samples, per-frame classes", lambda: _wav2vec2(2, 32000)),
    ]  # fmt: skip


def budget_rows() -> dict:
    """{system: its budget rows} for the four systems, baselines included (memfit budget --measure)."""
    from memfit.system import load_system

    return {name: load_system(name).budgets() for name in ("ginr-cifar", "gpt2-window", "mbsnet-speech",
                                                           "moremouse-triplane")}  # fmt: skip


def smoke(names: list[str]) -> list[dict]:
    """On the CPU: the CUDA estimate (an sm90 card) of each named entry, no measurement."""
    from memfit.estimate import workspaces
    from memfit.estimate.steps import estimate_training_step

    rows = []
    for m in models() + checks():
        if m.variant in names:
            with workspaces.assume_card(workspaces.card("h200")):
                report = estimate_training_step(m.step, device="cuda")
            gib = {"allocated": report.peak_bytes / 2**30, "reserved": report.cuda.reserved / 2**30}
            rows.append({"system": "third-party", "variant": m.variant, "estimate_gib": gib})
    return rows


def run(only: list[str] | None = None, budgets: bool = True, steps: int = 3) -> list[dict]:
    """Estimate and measure on this GPU: the third-party set, the recurrent and fp32-LLaMA checks (``only``
    those named) then the budget rows."""
    from memfit.estimate.measure import compare_budgets

    groups: dict = {
        "third-party": [m for m in models() if not only or m.variant in only],
        "checks": [m for m in checks() if not only or m.variant in only],
    }
    if budgets:
        groups |= budget_rows()
    rows = []
    for name, entries in groups.items():
        for entry in entries:
            try:
                rows += compare_budgets({name: [entry]}, steps=steps)
            except Exception as e:  # noqa: BLE001 - one model this torch cannot run is reported, not fatal
                rows.append(
                    {"system": name, "variant": entry.variant, "skipped": f"{type(e).__name__}: {e}"[:200]}
                )
            torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict]) -> str:
    """How many rows each figure gets within 2% / 5%."""
    done = [r for r in rows if "gap" in r]
    out = []
    for k in ("allocated", "reserved"):
        gaps = [abs(r["gap"][k]) for r in done if r["gap"].get(k) is not None]
        out.append(f"{k}: {sum(g <= 0.02 for g in gaps)}/{len(gaps)} within 2%, "
                   f"{sum(g <= 0.05 for g in gaps)}/{len(gaps)} within 5%")  # fmt: skip
    return "; ".join(out)


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", default="gpu_memory_set.json", help="the JSON file to write (default %(default)s)"
    )
    p.add_argument("--only", default="", help="comma-separated entries of the set (default: all)")
    p.add_argument("--no_budgets", action="store_true", help="the third-party set only")
    p.add_argument(
        "--smoke", action="store_true", help="CPU: estimate resnet50-fp32 and gru-3x512, measure none"
    )
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - {m.variant for m in models() + checks()}
    if unknown:
        from memfit.errors import UsageError

        raise UsageError(
            f"error: --only names {sorted(unknown)}, not in the set; choose from "
            + ", ".join(m.variant for m in models() + checks())
        )
    start = time.perf_counter()
    if args.smoke:
        rows = smoke(only or ["resnet50-fp32", "gru-3x512"])
        for r in rows:
            print(f"{r['variant']}: estimate {r['estimate_gib']['allocated']:.3f} GiB allocated, "
                  f"{r['estimate_gib']['reserved']:.3f} GiB reserved (H200)")  # fmt: skip
    else:
        from memfit.estimate.measure import format_rows

        rows = run(only, budgets=not args.no_budgets)
        print(format_rows([r for r in rows if "card" in r]))
        for r in rows:
            if "card" not in r:
                print(f"{r['system']}/{r['variant']}: {r['skipped']}")
        print(summary(rows))
    Path(args.out).write_text(
        json.dumps({"rows": rows, "seconds": time.perf_counter() - start}, indent=1, default=str)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("gpu_memory_set", main))
