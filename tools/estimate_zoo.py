"""`memfit estimate` on the model zoo: every torchvision classifier, timm's main families, transformers
architectures built from config. Each model is estimated (fake tensors, the `memfit estimate` path) and
measured (a real two-step CPU run, every live tensor storage counted: the steady state with optimizer
state), at small shapes, and the table is written to docs/estimate-zoo.md.

    OMP_NUM_THREADS=1 uv run python tools/estimate_zoo.py
    uv run python tools/estimate_zoo.py --only resnet18,tf:gpt2 --no-write     # a few, printed only

Nothing is downloaded: timm models are built with pretrained=False, transformers models from small
configs (HF_HUB_OFFLINE=1 is set before transformers is imported). `ZOO` and `FAST` are what
packages/core/tests/test_zoo.py runs.
"""

from __future__ import annotations

import gc
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from memfit.step import TrainStep, default_optimizer  # noqa: E402
from memfit.train.flags import Parser
from torch import nn  # noqa: E402

MEASURE_LIMIT = 400e6  # parameters: above this a real two-step run needs > 6 GiB; estimate only


@dataclass
class Entry:
    """One zoo model: a name, its family, the TrainStep at the zoo's shape, the shape in words."""

    name: str
    family: str
    step: Callable[[], TrainStep]
    shape: str
    params_hint: float = 0.0  # > MEASURE_LIMIT: not measured
    tags: set[str] = field(default_factory=set)


def _classifier_step(build: Callable[[], nn.Module], shape: tuple, classes: int) -> TrainStep:
    def batch(d):
        return torch.randn(shape, device=d), torch.randint(0, classes, (shape[0],), device=d)

    def loss(model, b):
        out = model(b[0])
        out = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
        return F.cross_entropy(out.float(), b[1])

    return TrainStep(build, batch, loss, default_optimizer, amp_dtype=None)


# ----------------------------------------------------------------------------------------------------
# torchvision: every classification model
# ----------------------------------------------------------------------------------------------------

TV_KW = {
    "inception_v3": {"aux_logits": False, "init_weights": False},
    "googlenet": {"aux_logits": False, "init_weights": False},
    "vit_b_16": {"image_size": 64},
    "vit_b_32": {"image_size": 64},
    "vit_l_16": {"image_size": 64},
    "vit_l_32": {"image_size": 64},
    "vit_h_14": {"image_size": 56},
}
TV_SIZE = {"inception_v3": 96, "maxvit_t": 224, "vit_h_14": 56}
TV_BIG = {"vit_h_14": 632e6, "regnet_y_128gf": 644e6}


def torchvision_entries() -> list[Entry]:
    import torchvision

    out = []
    for name in torchvision.models.list_models(module=torchvision.models):
        size = TV_SIZE.get(name, 64)
        batch = 1 if name == "maxvit_t" else 2
        kw = {"num_classes": 10, **TV_KW.get(name, {})}

        def build(name=name, kw=kw):
            return torchvision.models.get_model(name, weights=None, **kw)

        out.append(
            Entry(
                name,
                "torchvision",
                lambda b=build, s=(batch, 3, size, size): _classifier_step(b, s, 10),
                f"{batch}x3x{size}x{size}",
                TV_BIG.get(name, 0.0),
            )
        )
    return out


# ----------------------------------------------------------------------------------------------------
# timm: its main families (drop-path on where the model has it)
# ----------------------------------------------------------------------------------------------------

TIMM = {  # name: input size
    "resnet18": 64,
    "resnet50d": 64,
    "resnext26ts": 64,
    "seresnext26d_32x4d": 64,
    "res2net50_26w_4s": 64,
    "resnest14d": 64,
    "regnety_016": 64,
    "regnetx_002": 64,
    "efficientnet_b0": 64,
    "efficientnetv2_rw_t": 64,
    "mobilenetv3_small_100": 64,
    "mobilenetv4_conv_small": 64,
    "mixnet_s": 64,
    "ghostnet_100": 64,
    "rexnet_100": 64,
    "lcnet_050": 64,
    "densenet121": 64,
    "dla34": 64,
    "cspresnet50": 64,
    "hrnet_w18_small": 64,
    "repvgg_a0": 64,
    "nf_resnet26": 64,
    "convnext_atto": 64,
    "convnextv2_atto": 64,
    "edgenext_xx_small": 64,
    "poolformer_s12": 64,
    "hgnetv2_b0": 64,
    "vit_tiny_patch16_224": 224,
    "deit_tiny_patch16_224": 224,
    "eva02_tiny_patch14_224": 224,
    "swin_tiny_patch4_window7_224": 224,
    "levit_128s": 224,
    "coat_lite_tiny": 224,
    "mobilevit_xxs": 256,
    "fastvit_t8": 256,
    "efficientformer_l1": 224,
    "pit_ti_224": 224,
    "cait_xxs24_224": 224,
}


def timm_entries() -> list[Entry]:
    import timm

    out = []
    for name, size in TIMM.items():
        batch = 2 if size <= 64 or name.startswith("levit") else 1  # LeViT's head has a BatchNorm1d

        def build(name=name):
            try:
                return timm.create_model(name, pretrained=False, num_classes=10, drop_path_rate=0.1)
            except TypeError:  # a model without drop-path
                return timm.create_model(name, pretrained=False, num_classes=10)

        out.append(
            Entry(
                f"timm:{name}",
                "timm",
                lambda b=build, s=(batch, 3, size, size): _classifier_step(b, s, 10),
                f"{batch}x3x{size}x{size}",
            )
        )
    return out


# ----------------------------------------------------------------------------------------------------
# transformers: from small configs
# ----------------------------------------------------------------------------------------------------

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
TOKENS = {"vocab_size": 512, "max_position_embeddings": 128}
# model_type: (AutoModel class, config overrides, kind)
TF = {
    "gpt2": ("AutoModelForCausalLM", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}, "lm"),
    "bert": ("AutoModelForMaskedLM", {}, "lm"),
    "roberta": ("AutoModelForMaskedLM", {"max_position_embeddings": 130}, "lm"),
    "distilbert": ("AutoModelForMaskedLM", {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128}, "lm"),
    "albert": ("AutoModelForMaskedLM", {"embedding_size": 32}, "lm"),
    "electra": ("AutoModelForMaskedLM", {"embedding_size": 32}, "lm"),
    "deberta-v2": ("AutoModelForMaskedLM", {}, "lm"),
    "llama": ("AutoModelForCausalLM", {"num_key_value_heads": 2}, "lm"),
    "mistral": ("AutoModelForCausalLM", {"num_key_value_heads": 2, "head_dim": 16}, "lm"),
    "qwen2": ("AutoModelForCausalLM", {"num_key_value_heads": 2}, "lm"),
    "gemma": ("AutoModelForCausalLM", {"num_key_value_heads": 1, "head_dim": 16}, "lm"),
    "phi": ("AutoModelForCausalLM", {}, "lm"),
    "opt": ("AutoModelForCausalLM", {"ffn_dim": 128, "word_embed_proj_dim": 64}, "lm"),
    "gpt_neo": (
        "AutoModelForCausalLM",
        {"num_layers": 2, "attention_types": [[["global", "local"], 1]]},
        "lm",
    ),
    "bloom": ("AutoModelForCausalLM", {"n_layer": 2, "n_head": 4}, "lm"),
    "t5": (
        "AutoModelForSeq2SeqLM",
        {
            "d_model": 64,
            "d_kv": 16,
            "d_ff": 128,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "num_heads": 4,
            "decoder_start_token_id": 0,
            "pad_token_id": 0,
        },
        "seq2seq",
    ),
    "bart": (
        "AutoModelForSeq2SeqLM",
        {
            "d_model": 64,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
        },
        "seq2seq",
    ),
    "vit": (
        "AutoModelForImageClassification",
        {"image_size": 64, "patch_size": 16, "num_labels": 10},
        "image",
    ),
    "swin": (
        "AutoModelForImageClassification",
        {
            "image_size": 64,
            "embed_dim": 32,
            "depths": [2, 2],
            "num_heads": [2, 4],
            "window_size": 4,
            "num_labels": 10,
        },
        "image",
    ),
    "convnext": (
        "AutoModelForImageClassification",
        {"hidden_sizes": [32, 64], "depths": [1, 1], "num_stages": 2, "num_labels": 10},
        "image",
    ),
    "whisper": (
        "AutoModelForSpeechSeq2Seq",
        {
            "d_model": 64,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
            "num_mel_bins": 16,
            "max_source_positions": 50,
            "max_target_positions": 64,
        },
        "speech-seq2seq",
    ),
    "wav2vec2": (
        "AutoModelForCTC",
        {
            "conv_dim": [32, 32],
            "conv_stride": [5, 2],
            "conv_kernel": [10, 3],
            "num_feat_extract_layers": 2,
            "num_conv_pos_embeddings": 16,
            "num_conv_pos_embedding_groups": 4,
            "vocab_size": 32,
            "mask_time_prob": 0.0,
            "layerdrop": 0.0,  # LayerDrop draws a random number per layer and branches on it
        },
        "audio",
    ),
}


def _tf_model(model_type: str) -> Callable[[], nn.Module]:
    import transformers

    cls_name, overrides, kind = TF[model_type]
    base = {} if kind in ("image", "audio", "speech-seq2seq") else dict(TOKENS)
    small = {} if model_type in ("swin", "convnext") else SMALL  # they size themselves per stage
    kw = {**small, **base, **overrides}

    def build():
        config = transformers.AutoConfig.for_model(model_type, **kw)
        config.use_cache = False  # a training step keeps no key/value cache
        return getattr(transformers, cls_name).from_config(config)

    return build


def tf_step(model_type: str, batch: int = 2, seq: int = 64) -> tuple[TrainStep, str]:
    build = _tf_model(model_type)
    kind = TF[model_type][2]
    vocab = TOKENS["vocab_size"]
    if kind == "lm":

        def make(d):
            return torch.randint(0, vocab, (batch, seq), device=d)

        def loss(m, ids):
            logits = m(input_ids=ids).logits
            return F.cross_entropy(logits.float().flatten(0, -2), ids.flatten())

        return TrainStep(build, make, loss, default_optimizer, None), f"{batch}x{seq} ids"
    if kind == "seq2seq":

        def make(d):
            return torch.randint(0, vocab, (batch, seq), device=d), torch.randint(
                0, vocab, (batch, seq // 2), device=d
            )

        def loss(m, b):
            return m(input_ids=b[0], labels=b[1]).loss

        return TrainStep(
            build, make, loss, default_optimizer, None
        ), f"{batch}x{seq} ids -> {batch}x{seq // 2}"
    if kind == "image":
        return _classifier_step(build, (batch, 3, 64, 64), 10), f"{batch}x3x64x64"
    if kind == "speech-seq2seq":

        def make(d):
            feats = torch.randn(batch, 16, 100, device=d)
            return feats, torch.randint(0, 1000, (batch, 16), device=d)

        def loss(m, b):
            return m(input_features=b[0], labels=b[1]).loss

        return TrainStep(build, make, loss, default_optimizer, None), f"{batch}x16x100 mels -> {batch}x16"

    def make(d):  # audio: raw waveform, CTC-style per-frame classification
        return torch.randn(batch, 4000, device=d)

    def loss(m, x):
        logits = m(input_values=x).logits
        labels = torch.randint(0, logits.shape[-1], logits.shape[:-1], device=logits.device)
        return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten())

    return TrainStep(build, make, loss, default_optimizer, None), f"{batch}x4000 samples"


def transformers_entries() -> list[Entry]:
    out = []
    for model_type in TF:
        step, shape = tf_step(model_type)
        out.append(Entry(f"tf:{model_type}", "transformers", lambda s=step: s, shape))
    return out


# ----------------------------------------------------------------------------------------------------
# Models of our own that exercise kernels the zoo above does not (an LSTM: oneDNN's workspace)
# ----------------------------------------------------------------------------------------------------


class LSTMTagger(nn.Module):
    def __init__(self, vocab=256, dim=64, hidden=96, layers=2, classes=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, layers, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, ids):
        return self.head(self.lstm(self.emb(ids))[0])


def own_entries() -> list[Entry]:
    def lstm(amp=None):
        def make(d):
            return torch.randint(0, 256, (4, 50), device=d)

        def loss(m, ids):
            return F.cross_entropy(m(ids).float().flatten(0, 1), ids.flatten() % 10)

        return TrainStep(LSTMTagger, make, loss, default_optimizer, amp)

    return [
        Entry("lstm-tagger", "nn", lambda: lstm(), "4x50 ids"),
        Entry("lstm-tagger-bf16", "nn", lambda: lstm(torch.bfloat16), "4x50 ids, bf16 autocast"),
    ]


def gpt2_124m() -> nn.Module:
    """GPT-2 124M with transformers' defaults (dropout 0.1, SDPA attention), random weights: the figure in
    docs/your-own-model.md (`memfit estimate tools/estimate_zoo.py:gpt2_124m --input 8x1024 --amp bf16`)."""
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config())


def zoo() -> list[Entry]:
    return own_entries() + torchvision_entries() + timm_entries() + transformers_entries()


# the default-test subset: a torchvision convnet, an LSTM, a timm model with drop-path, a decoder and an
# encoder-decoder from transformers
FAST = ["resnet18", "lstm-tagger", "timm:convnext_atto", "tf:gpt2", "tf:t5"]


# ----------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    family: str
    shape: str
    measured: int | None
    estimate: int | None
    seconds: float | None
    params: int = 0
    error: str = ""

    @property
    def rel(self) -> float | None:
        if self.measured is None or self.estimate is None:
            return None
        return (self.estimate - self.measured) / self.measured


def run_entry(entry: Entry, measure: bool = True) -> Row:
    from memfit.estimate.steps import estimate_training_step, measure_training_step
    from memfit.estimate.trace import failure_text, trace_step

    row = Row(entry.name, entry.family, entry.shape, None, None, None)
    try:
        step = entry.step()
        t0 = time.perf_counter()
        trace = trace_step(step)
        row.seconds = time.perf_counter() - t0
        row.estimate, row.params = trace.report.peak_bytes, trace.report.params
    except Exception as exc:  # noqa: BLE001 - a model that does not estimate is a row of the table
        row.error = failure_text(exc)[:200]
        return row
    if measure and entry.params_hint <= MEASURE_LIMIT:
        try:
            torch.manual_seed(0)
            row.measured = measure_training_step(step).peak_bytes
        except Exception as exc:  # noqa: BLE001
            row.error = f"measurement failed: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
    del estimate_training_step
    gc.collect()
    return row


def fmt_mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def table(rows: list[Row]) -> str:
    lines = [
        "| model | family | shape | params | measured MiB | estimate MiB | error | estimate s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        err = "-" if r.rel is None else f"{100 * r.rel:+.3f}%"
        if r.error and r.estimate is None:
            err = "does not build: " + r.error.replace("|", "/")
        elif r.measured is None and not r.error:
            err = "not measured (too large here)"
        secs = "-" if r.seconds is None else f"{r.seconds:.2f}"
        lines.append(
            f"| {r.name} | {r.family} | {r.shape} | {r.params / 1e6:.1f}M | {fmt_mib(r.measured)} | "
            f"{fmt_mib(r.estimate)} | {err} | {secs} |"
        )
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    built = [r for r in rows if r.estimate is not None]
    measured = [r for r in built if r.rel is not None]
    within = [r for r in measured if abs(r.rel) <= 0.01]
    worst = sorted(measured, key=lambda r: -abs(r.rel))[:3]
    slowest = max(built, key=lambda r: r.seconds or 0, default=None)
    by_family: dict[str, list[int]] = {}
    for r in rows:
        c = by_family.setdefault(r.family, [0, 0, 0])
        c[0] += 1
        c[1] += r.estimate is not None
        c[2] += r.rel is not None and abs(r.rel) <= 0.01
    fam = "; ".join(f"{k} {v[1]}/{v[0]} build, {v[2]} within 1%" for k, v in by_family.items())
    worst_text = ", ".join(f"{r.name} {100 * r.rel:+.3f}%" for r in worst)
    slow = "-" if slowest is None else f"{slowest.name} {slowest.seconds:.2f} s"
    return (
        f"{len(built)} of {len(rows)} models build and estimate; {len(within)} of {len(measured)} measured "
        f"are within 1% of the measured peak ({fam}). Largest errors: {worst_text}. Slowest estimate: {slow}."
    )


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated names (e.g. resnet18,timm:convnext_atto,tf:gpt2)")
    p.add_argument("--family", help="only this family: nn, torchvision, timm, transformers")
    p.add_argument("--no-measure", action="store_true", help="estimate only")
    p.add_argument("--no-write", action="store_true", help="print, do not write docs/estimate-zoo.md")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "estimate-zoo.md"))
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    entries = zoo()
    if args.only:
        names = set(args.only.split(","))
        entries = [e for e in entries if e.name in names]
    if args.family:
        entries = [e for e in entries if e.family == args.family]
    rows = []
    t_all = time.perf_counter()
    for e in entries:
        r = run_entry(e, measure=not args.no_measure)
        rows.append(r)
        rel = "-" if r.rel is None else f"{100 * r.rel:+.3f}%"
        print(
            f"{r.name:<36} est {fmt_mib(r.estimate):>10} real {fmt_mib(r.measured):>10} {rel:>9} "
            f"{r.seconds or 0:6.2f}s {r.error[:120]}",
            flush=True,
        )
    print(summary(rows))
    if args.no_write:
        return 0
    import timm
    import transformers

    head = f"""# `memfit estimate` on the model zoo

Every classification model of `torchvision.models.list_models()`, {len(TIMM)} timm models across its main
families (drop-path 0.1 where the model has it), {len(TF)} transformers architectures built from small
configs (decoders, encoders, encoder-decoders, vision, speech), and an LSTM of our own, at small CPU
shapes. Each model's training step (cross-entropy, or the model's own loss for encoder-decoders; fused
AdamW; fp32 unless stated) is **estimated** (`memfit.estimate.trace.trace_step`: fake tensors, what
`memfit estimate` runs) and **measured** (`memfit.estimate.steps.measure_training_step`: two real steps on the
CPU, every live tensor storage counted, so the peak is the steady state with optimizer state).
"measured MiB" is that real peak, "error" is (estimate - measured) / measured, "estimate s" the
estimate's own time in the process (1 thread; the CLI adds its start-up, mostly importing torch and the
model library).

The torchvision and timm models are built with `num_classes=10`: `memfit estimate torchvision:resnet18
--input 2x3x64x64` builds the 1000-class head of `weights=None` and gives more than the resnet18 row; a
factory of yours returning `torchvision.models.resnet18(num_classes=10)` gives the row.

Regenerate (about {(time.perf_counter() - t_all) / 60:.0f} minutes on one core):

```bash
OMP_NUM_THREADS=1 uv run python tools/estimate_zoo.py
```

torch {torch.__version__}, torchvision {__import__("torchvision").__version__}, timm {timm.__version__},
transformers {transformers.__version__}, Python {platform.python_version()}, 1 thread.

**Summary.** {summary(rows)}

"""
    Path(args.out).write_text(head + table(rows) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("estimate_zoo", lambda argv: main(argv)))
