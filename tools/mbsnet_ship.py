"""Put a trained mbsnet-speech run into the package as the model `enhance` uses without --run.

    uv run python tools/mbsnet_ship.py runs/mbsnet-speech/RUN [--keep_noisy SHARE] [--no-pcs] [--shifts N]

Exports the run's best.pt (`memfit export`: weights and config, no pickle) into
packages/mbsnet-speech/src/mbsnet_speech/pretrained/, with the inference settings chosen on the run's own
validation (`tools/mbsnet_pcs_val.py RUN`) written into its config. Then rerun the package's tests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mbsnet_speech.enhance import inference_overrides, shipped_model
from mbsnet_speech.system import SYSTEM
from memfit.train.export import export_run, model_card
from memfit.train.flags import Parser


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--keep_noisy", type=float, default=0.0, help="share of noisy input kept (validation's)")
    ap.add_argument("--pcs", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--shifts", type=int, default=None, help="delayed passes averaged (validation's)")
    a = ap.parse_args()
    settings = inference_overrides(a.pcs, a.keep_noisy, a.shifts)
    # a setting the run's config refuses stops here (one line), before the shipped folder is touched
    SYSTEM.load_model(a.run, "cpu", **settings)
    out = export_run(SYSTEM, a.run, shipped_model(), overwrite=True)
    path = out / "config.json"
    doc = json.loads(path.read_text())
    doc["config"].update(settings)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    (out / "README.md").write_text(model_card(SYSTEM, doc["config"], doc["meta"]))
    SYSTEM.from_pretrained(out)  # it loads
    print(f"shipped {a.run} as {out} ({sum(p.stat().st_size for p in Path(out).iterdir()) / 2**20:.2f} MiB)")


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("mbsnet_ship", lambda _argv: main()))
