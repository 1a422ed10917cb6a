"""The flags of `memfit estimate` (and the help texts `memfit budget` and `fit` share), declared without the
estimator: no torch is imported until a command runs, so `--help` answers at once."""

from __future__ import annotations

#: ``memfit.estimate.fit.MARGIN``, said in --help without importing the estimator (a test keeps them equal)
MARGIN_TEXT = "0.1"

GPU_HELP = (
    "the card a CUDA estimate is for, by name (h100, h200, a100, l4, ...) or compute capability (9.0, "
    "sm86): it sets the cuBLAS workspace size; default this machine's GPU, else h200"
)
MEASURE_HELP = (
    "on a machine with a GPU: also run the real steps there and print estimate and measurement side by "
    "side (allocated, reserved, total, by category)"
)
NO_CUDA_KERNELS_HELP = (
    "with --device cuda: a GPU without the cuda extra's mamba_ssm and causal-conv1d (the Mamba torch-op "
    "path); default: what this machine's GPU has, or the extra installed when there is no GPU"
)
MAX_BATCH_HELP = "where the search for the largest batch that fits stops (default %(default)s)"

SNAPSHOT_HELP = (
    "write the step in PyTorch's memory-snapshot format to this file (open it at pytorch.org/memory_viz); "
    "with --measure, the real step's snapshot too, beside it (NAME.measured.pickle)"
)


def add_parser(sub) -> None:
    """Register `memfit estimate` on the `memfit` subparsers."""
    p = sub.add_parser(
        "estimate",
        help="training-step memory of any model: peak, culprits, what-ifs, largest batch",
        description="Estimate the peak memory of one training step (forward, loss, backward, AdamW) of any "
        "PyTorch model under FakeTensorMode on the CPU, and say what holds it.",
    )
    p.add_argument(
        "target",
        help="path/to/file.py:func or package.module:func (func() returns a memfit.memory.TrainStep, or is "
        "a module factory: then give --input, as for a module built at import, file.py:MODEL); or a model "
        "by name: hf:ORG/NAME or hf:path/to/dir (its config.json, no weights), timm:NAME, torchvision:NAME",
    )
    p.add_argument(
        "--input",
        action="append",
        help="input shape, e.g. 64x3x224x224, or 8x1024:int64 with its dtype (repeatable, one per input)",
    )
    p.add_argument(
        "--dtype",
        help="dtype of inputs given without one (default: int64 token ids when the model's first layer is "
        "an nn.Embedding, else float32)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="whose kernels to model: cuda = what a CUDA run keeps (fused attention, CUDA autocast, 512-byte "
        "allocator blocks); default cuda with --gpu_gib, else cpu",
    )
    p.add_argument("--no_cuda_kernels", action="store_true", help=NO_CUDA_KERNELS_HELP)
    p.add_argument(
        "--target",
        dest="loss_target",
        choices=["classes", "same", "sum"],
        default="classes",
        help="loss: cross-entropy over the output's last axis (classes), MSE to a tensor of the output's "
        "shape (same), or the output's sum",
    )
    p.add_argument(
        "--amp",
        choices=["none", "bf16", "fp16"],
        default="none",
        help="autocast for a module factory or a model by name (a TrainStep sets its own amp_dtype)",
    )
    p.add_argument(
        "--task",
        help="an hf: model's head instead of config.json's architectures: causal-lm, masked-lm, seq2seq-lm, "
        "classification, base",
    )
    p.add_argument(
        "--lora",
        help="fine-tune with peft's LoRA of rank R on peft's default modules for the model (R:mod1,mod2 "
        "names them); needs memfit-core[finetune]",
    )
    p.add_argument("--freeze", help="freeze the parameters whose names match this regular expression")
    p.add_argument(
        "--optimizer",
        help="any torch.optim class by name with keywords, e.g. sgd:momentum=0.9, adafactor, "
        "adamw:betas=(0.9,0.95) (default: fused AdamW, or the TrainStep's)",
    )
    p.add_argument("--accumulate", help="micro-batches (forward + backward each) per optimizer step")
    p.add_argument("--top", type=int, default=10, help="how many tensor groups to list")
    p.add_argument(
        "--explain",
        action="store_true",
        help="what-ifs: SDPA, bf16 autocast, checkpointing each block, half the batch, and where they apply "
        "LoRA r=16 and SGD instead of an Adam; with the batch scaling and whether the step fits",
    )
    p.add_argument("--scale", help="fit the activation exponent over 1x-4x of: batch, input:AXIS, or a knob")
    p.add_argument(
        "--gpu_gib",
        type=float,
        help="largest batch that fits a GPU of this many GiB (with --device cpu: the CPU step's tensors, "
        "as a GPU would hold them; a CPU run's pre-flight judges RAM, at twice its tensors: malloc's heap)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=None,
        help=f"the share of --gpu_gib kept free (default {MARGIN_TEXT}: the one margin memfit fit and the "
        "train pre-flight keep too)",
    )
    p.add_argument("--gpu", help=GPU_HELP)
    p.add_argument("--measure", action="store_true", help=MEASURE_HELP)
    p.add_argument("--ranks", type=int, default=1, help="data-parallel ranks: the per-rank peak (and fit)")
    p.add_argument("--shard", choices=["ddp", "fsdp"], default="ddp", help="how ranks hold the state")
    p.add_argument(
        "--fsdp_units",
        metavar="REGEX",
        help="with --shard fsdp: the modules fully_shard wraps, by name matched whole (e.g. "
        "'layers\\.\\d+', or '\\d+' for the children of a Sequential); default: the repeated blocks, else "
        "the whole model as one unit (the report says which)",
    )
    p.add_argument("--max_batch", type=int, default=4096, help=MAX_BATCH_HELP)
    p.add_argument("--json", action="store_true", help="everything as one JSON object")
    p.add_argument("--timeline", metavar="PNG", help="draw memory over the step to this .png file")
    p.add_argument("--snapshot", metavar="PICKLE", help=SNAPSHOT_HELP)
    p.set_defaults(func=_run)


def _run(args) -> int:
    """The command, imported when it runs (memfit.estimate.command)."""
    from memfit.estimate.command import main

    return main(args)
