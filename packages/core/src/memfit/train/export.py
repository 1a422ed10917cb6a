"""Exported models: a folder that rebuilds a trained model without memfit's trainer or any pickle.

    memfit export RUN --out DIR          (RUN: a run folder, a checkpoint file, or a run name with --system;
                                          an exported folder is copied, keeping what it says of its run)

writes ``DIR/model.safetensors`` (the weights; a run's weight average when it kept one), ``DIR/config.json``
(``{"format": 1, "system", "config": the model config, "meta": what eval needs and the run's figures}``)
and ``DIR/README.md`` (a short model card). ``System.from_pretrained(DIR)`` (and each package's
``load(DIR)``) rebuilds the model from the two files with safetensors alone; every `eval`, `enhance` and
`generate` takes such a folder as its ``--run`` too.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from memfit.errors import ModelFileError, ModelFileMissing, UsageError, first_line
from memfit.train.checkpoint import (
    CHECKPOINT_FORMAT,
    memfit_version,
    nonfinite_parameter,
    refuse_newer_format,
)
from memfit.train.config import from_dict, with_overrides
from memfit.train.outputs import check_outputs, output_files

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CARD = "README.md"


def is_export(path: str | Path) -> bool:
    """Whether `path` is a folder that `export` wrote (weights and config side by side)."""
    path = Path(path)
    return path.is_dir() and (path / WEIGHTS).is_file() and (path / CONFIG).is_file()


def _numbers(d: Any, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) JSON object, flattened: what a model card can quote."""
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_numbers(v, f"{prefix}{k}/"))
    elif isinstance(d, (int, float)) and not isinstance(d, bool) and math.isfinite(d):
        out[prefix.rstrip("/")] = float(d)
    return out


def _evaluations(run_dir: Path) -> dict[str, dict[str, float]]:
    """{file: {metric: value}} of the eval results saved in run_dir/eval/ (top-level numbers only)."""
    found: dict[str, dict[str, float]] = {}
    for path in sorted((run_dir / "eval").glob("*.json")) if (run_dir / "eval").is_dir() else []:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            continue
        nums = {k: v for k, v in _numbers(doc).items() if "/" not in k}
        if nums:
            found[path.name] = nums
    return found


def _validation(run_dir: Path, step: Any) -> dict[str, float]:
    """The eval/* figures that the run logged at `step` (run_dir/metrics.jsonl; its last such row), so a
    card can say what a compound choice metric stood for."""
    from memfit.train.plot import read_metrics

    found: dict[str, float] = {}
    if step is None:  # a run with no best step: nothing to name
        return found
    try:
        rows = read_metrics(run_dir)
    except UsageError:  # no metrics.jsonl
        return found
    for row in rows:
        if row["step"] == step:
            nums = {k[len("eval/") :]: v for k, v in _numbers(row).items() if k.startswith("eval/")}
            found = nums or found
    return found


def trained_on(settings: dict[str, Any] | None, meta: dict[str, Any] | None = None) -> list[str]:
    """The data a model trained on, as its run named it: every data flag it had (--data, --clean,
    --noise), else what its meta says; [] for a system's built-in data (no data flag)."""
    train = (settings or {}).get("train") or {}
    sources = [str(train[k]) for k in ("data", "clean", "noise") if train.get(k)]
    return sources or ([str(meta["data"])] if (meta or {}).get("data") else [])


def model_line(system: Any, state: dict[str, Any]) -> str:
    """One line naming the model a command uses and what it was trained on, from load_model's dict (or one
    with its meta merged in): 'model: the weights shipped with S (`general` preset, 4747 steps on A + B)'."""
    path = Path(state["path"])
    what = f"the weights shipped with {system.name}" if system.is_shipped(path) else str(path)
    meta = state.get("meta") or state
    settings = state.get("settings")
    preset = (settings or {}).get("preset") or meta.get("preset")
    data = " + ".join(trained_on(settings, meta)) or "the built-in data"
    if settings is None and not meta.get("data"):
        data = "data it does not record"
    step = state.get("step")
    steps = f"{step} step{'' if step == 1 else 's'}" if step is not None else "an unknown number of steps"
    return f"model: {what} ({f'`{preset}` preset, ' if preset else ''}{steps} on {data})"


def _yaml_list(values: list[str]) -> str:
    return "".join(f"\n- {json.dumps(v)}" for v in values) if values else " []"


def model_card(system: Any, config: dict[str, Any], meta: dict[str, Any]) -> str:
    """A README.md for an exported model, Hugging Face style: YAML metadata (library, licence, tags, data
    sets, metrics), then what it is, what it was trained on and what it scores."""
    sources = trained_on(meta.get("settings"), meta)
    data = " + ".join(sources) or "the system's built-in default data"
    metrics = [k for k in (meta.get("validation") or {}) if k != "choice"]
    best = meta.get("best") or {}
    if best.get("metric") and best["metric"] not in metrics and best["metric"] != "choice":
        metrics.append(best["metric"])
    params = meta.get("params", 0) / 1e6
    lines = [
        "---",
        "library_name: memfit",
        f"license: {getattr(system, 'license', 'apache-2.0')}",
        f"tags:{_yaml_list(['memfit', system.name, *getattr(system, 'tags', ())])}",
        f"datasets:{_yaml_list(sources)}",
        f"metrics:{_yaml_list(metrics)}",
        "---",
        "",
        f"# {system.name}: {params:.2f}M parameters, `{meta.get('preset') or 'custom'}` preset",
        "",
        f"{system.name}: {system.summary.rstrip('.')}.",
        "",
        "Load it with `memfit.system.load_system"
        f'("{system.name}").from_pretrained(DIR)`, or pass the folder as `--run DIR` to the system\'s '
        "`eval` and extra commands.",
        "",
        "| | |",
        "|---|---|",
        f"| system | `{system.name}` |",
        f"| preset | `{meta.get('preset')}` |",
        f"| parameters | {params:.3f}M |",
        f"| trained | {meta.get('step')} optimizer steps on {data} |",
    ]
    if best.get("metric") and best.get("value") is not None:
        where = (
            "these weights" if best["step"] == meta.get("step") else f"step {best['step']}, not these weights"
        )
        figures = meta.get("validation") or {}
        figures = {k: v for k, v in figures.items() if k != best["metric"]}
        shown = "".join(f", {k} {v:.4g}" for k, v in list(figures.items())[:8])
        lines.append(f"| validation | the run's best {best['metric']} {best['value']:.4g} ({where}){shown} |")
    for name, nums in (meta.get("evaluations") or {}).items():
        shown = ", ".join(f"{k} {v:.4g}" for k, v in list(nums.items())[:8])
        lines.append(f"| `eval/{name}` | {shown} |")
    lines += [f"| exported | {meta.get('exported')} from `{meta.get('source')}` |", "", "## Config", ""]
    lines += ["```json", json.dumps(config, indent=1), "```", ""]
    return "\n".join(lines)


def _ordinary_mode(path: Path) -> None:
    """The mode an ordinary file gets here (0644 under the usual umask): safetensors writes 0600."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def export_run(system: Any, run: str | Path, out: str | Path, runs_dir: str | Path = "runs",
               overwrite: bool = False) -> Path:  # fmt: skip
    """Write the export folder of a run (its best.pt, else its newest intact checkpoint) to `out`: the three
    files whole or none of them (memfit.train.outputs); a non-empty `out` only with `overwrite`. `run` may
    be an export folder itself (the shipped weights among them): `out` is then a copy of it, its weights
    checked by loading them, that keeps what it says of the run it came from (best, evaluations, source)."""
    from safetensors.torch import save_model

    model, state = system.load_model(run, "cpu", runs_dir=runs_dir)
    source = Path(state["path"])  # the checkpoint file loaded, or an export's folder
    copy = is_export(source)
    run_dir = source if copy else source.parent
    out = Path(out)
    check_outputs([out], [run_dir], overwrite=True, flag="--out")  # never into the run or export it reads
    if out.exists() and not out.is_dir():
        raise UsageError(f"error: --out {out} is a file; give a folder to export into")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UsageError(
            f"error: --out {out} is not empty; pass --overwrite to replace its files, or another --out"
        )
    if copy:  # its meta already says where it came from; the export folder has no eval/ or metrics
        meta = {**(state.get("meta") or {}), "params": sum(p.numel() for p in model.parameters())}
    else:
        meta = _run_meta(state, model, run_dir, source)
    doc = {"format": CHECKPOINT_FORMAT, "memfit_version": memfit_version(), "system": system.name,
           "config": state["config"], "meta": meta}  # fmt: skip
    tags = {"system": system.name, "format": str(CHECKPOINT_FORMAT)}
    with output_files([out / WEIGHTS, out / CONFIG, out / CARD], overwrite=True) as (weights, config, card):
        save_model(model, str(weights), metadata=tags)
        _ordinary_mode(weights)
        config.write_text(json.dumps(doc, indent=2) + "\n")
        card.write_text(model_card(system, state["config"], meta))
    return out


def _run_meta(state: dict[str, Any], model: Any, run_dir: Path, source: Path) -> dict[str, Any]:
    """An export's meta from a run's checkpoint: what eval needs, the run's figures and where it came from."""
    return {
        **(state.get("meta") or {}),
        "step": state.get("step"),
        "best": state.get("best"),
        "settings": state.get("settings"),
        "params": sum(p.numel() for p in model.parameters()),
        "evaluations": _evaluations(run_dir),
        "validation": _validation(run_dir, (state.get("best") or {}).get("step")),
        "source": str(source),
        "exported": time.strftime("%Y-%m-%d %H:%M"),
    }


def load_export(system: Any, path: str | Path, device: str | torch.device = "cpu", **overrides: Any):
    """(model in eval mode, {"config", "meta", "settings", "path", "step", "format", "system"}) from an
    export folder, with safetensors and json alone; overrides replace config fields (e.g. pcs=True).
    "settings" are the run's (its data and split; None where the export does not record them), as in a
    checkpoint. Errors: ModelFileError (a ValueError) or ModelFileMissing (a FileNotFoundError), one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    path = Path(path)
    try:
        doc = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise ModelFileMissing(f"error: {path / CONFIG} does not exist; export the run again") from None
    except (OSError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else first_line(e)
        raise ModelFileError(f"error: {path / CONFIG}: not readable ({why}); export the run again") from None
    if not isinstance(doc, dict):
        raise ModelFileError(
            f"error: {path / CONFIG}: not an export's config (a JSON object); export the run again"
        )
    refuse_newer_format(doc, path / CONFIG, "model export")
    if doc.get("format") != CHECKPOINT_FORMAT or doc.get("system") != system.name:
        raise ModelFileError(
            f"error: {path} holds a {doc.get('system')} model (format {doc.get('format')}), not a "
            f"{system.name} "
            f"one of format {CHECKPOINT_FORMAT}; pass a {system.name} export"
        )
    config_cls, build_model = system._builders()
    try:
        cfg = from_dict(config_cls, doc["config"])
    except (TypeError, ValueError, KeyError) as e:
        raise ModelFileError(f"error: {path}: its config does not build a model ({first_line(e)})") from None
    cfg = with_overrides(cfg, overrides)
    try:
        model = build_model(cfg)
    except (TypeError, ValueError, RuntimeError, KeyError) as e:
        raise ModelFileError(f"error: {path}: its config does not build a model ({first_line(e)})") from None
    try:
        load_model(model, str(path / WEIGHTS), strict=True)
    except SafetensorError as e:  # a torn copy: "incomplete metadata", "file too small"
        raise ModelFileError(
            f"error: {path / WEIGHTS} is truncated or damaged ({first_line(e)}); export the run again"
        ) from None
    except (TypeError, ValueError, RuntimeError, KeyError, OSError) as e:
        raise ModelFileError(f"error: {path}: its weights do not fit its config ({first_line(e)})") from None
    if bad := nonfinite_parameter(model):
        raise ModelFileError(f"error: {path / WEIGHTS}: its weights are not finite ({bad}); export a run "
                             "whose weights are (its training diverged, or the file is damaged)")  # fmt: skip
    meta = doc.get("meta") or {}
    info = {**doc, "path": str(path), "step": meta.get("step"), "settings": meta.get("settings")}
    return model.to(device).eval(), info
