"""The four systems' fastest flags and their console commands, for the cross-system tests."""

from __future__ import annotations

from importlib.metadata import entry_points

ALIASES = {
    "ginr-cifar": "ginr",
    "gpt2-window": "gpt2",
    "mbsnet-speech": "mbsnet",
    "moremouse-triplane": "mouse",
}
TRAIN = {
    "ginr-cifar": ["--config", "tiny", "--batch_size", "2", "--num_sample_coords", "32", "--warmup", "1",
                   "--holdout", "50", "--eval_images", "4", "--max_images", "64"],
    "gpt2-window": ["--model", "nano", "--batch_size", "2", "--eval_iters", "1", "--warmup", "1"],
    "mbsnet-speech": ["--config", "tiny", "--batch_size", "2", "--seconds", "0.5"],
    "moremouse-triplane": ["--config", "tiny", "--batch_size", "1", "--rays_per_scene", "32",
                           "--samples_per_ray", "8"],
}  # fmt: skip
EVAL = {
    "ginr-cifar": ["--num_images", "4", "--grid", "2", "--device", "cpu"],
    "gpt2-window": ["--eval_iters", "1", "--batch_size", "2"],
    "mbsnet-speech": ["--pairs", "1", "--seconds", "0.5"],
    "moremouse-triplane": ["--num_scenes", "1"],
}


def console(name: str):
    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == name]
    return ep.load()


def train(system, runs, *extra):
    argv = [*TRAIN[system], "--steps", "1", "--no_progress", "--runs_dir", str(runs), *extra]
    return console(f"{ALIASES[system]}-train")(argv)


def evaluate(system, run, *extra):
    return console(f"{ALIASES[system]}-eval")(["--run", str(run), *EVAL[system], *extra])


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err and "Traceback" not in "\n".join(err), err
    return err[-1]
