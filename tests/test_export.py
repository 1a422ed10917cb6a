"""A trained run leaves memfit: `memfit export` + `from_pretrained` round trips, one-call APIs, versions."""

from __future__ import annotations

import json

import pytest
import torch
from memfit import cli
from memfit.system import load_system
from memfit.train.flags import export_eval_name

from tests.systems import ALIASES, evaluate, one_error_line, train


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{system: (run folder, export folder)}: two tiny steps each, exported."""
    root = tmp_path_factory.mktemp("export")
    out = {}
    for system in sorted(ALIASES):
        assert train(system, root / "runs", "--steps", "2") == 0
        run = root / "runs" / system / "run"
        with pytest.raises(SystemExit) as e:
            cli.main(["export", str(run), "--out", str(root / system)])
        assert e.value.code == 0
        out[system] = (run, root / system)
    return out


@pytest.mark.parametrize("system", sorted(ALIASES))
def test_export_round_trips_bit_exactly_with_safetensors_alone(system, exported, monkeypatch):
    run, folder = exported[system]
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    doc = json.loads((folder / "config.json").read_text())
    assert doc["system"] == system and doc["format"] == 1 and doc["meta"]["step"] == 2
    card = (folder / "README.md").read_text()
    assert f"# {system}" in card and "2 optimizer steps" in card
    sys_obj = load_system(system)
    trained, _ = sys_obj.load_model(run)

    def no_pickle(*a, **k):
        raise AssertionError("an exported model must load without torch.load")

    monkeypatch.setattr(torch, "load", no_pickle)
    model = sys_obj.from_pretrained(folder)
    assert not model.training
    a, b = trained.state_dict(), model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("system", sorted(ALIASES))
def test_eval_takes_an_exported_folder_as_its_run(system, exported, tmp_path):
    """Its results go beside the runs (--runs_dir/<system>/exported/<folder name>-<path digits>/eval, a
    folder no run can have), never into the export."""
    _, folder = exported[system]
    before = sorted(p.name for p in folder.iterdir())
    assert evaluate(system, folder, "--runs_dir", str(tmp_path)) == 0
    assert any((tmp_path / system / "exported" / export_eval_name(folder) / "eval").iterdir())
    assert not (tmp_path / system / folder.name).exists()
    assert sorted(p.name for p in folder.iterdir()) == before


def test_export_refuses_to_write_into_its_run_or_over_files(exported, capsys):
    run, folder = exported["gpt2-window"]
    for argv, says in [
        (["export", str(run), "--out", str(run / "exp")], "outputs never replace inputs"),
        (["export", str(run), "--out", str(folder)], "is not empty; pass --overwrite"),
        (["export", "nope", "--out", str(folder / "x")], "no run 'nope'"),
    ]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and says in one_error_line(capsys)
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(run), "--out", str(folder), "--overwrite"])
    assert e.value.code == 0


def test_one_call_apis_work_from_an_exported_folder(exported):
    import ginr_cifar
    import gpt2_window
    import mbsnet_speech
    import moremouse_triplane

    text = gpt2_window.generate("def ", exported["gpt2-window"][1], max_new_tokens=5)
    assert isinstance(text, str) and text.startswith("def ") and len(text) == 9
    texts = gpt2_window.samples("def ", exported["gpt2-window"][1], num_samples=2, max_new_tokens=5)
    assert len(texts) == 2 and all(t.startswith("def ") and len(t) == 9 for t in texts)
    images = torch.rand(3, 3, 32, 32)
    assert ginr_cifar.reconstruct(images, exported["ginr-cifar"][1]).shape == (3, 3, 32, 32)
    assert ginr_cifar.reconstruct(images, exported["ginr-cifar"][1], resolution=64).shape == (3, 3, 64, 64)
    with pytest.raises(ValueError, match="images must be"):
        ginr_cifar.reconstruct(torch.rand(3, 32, 32), exported["ginr-cifar"][1])
    model = moremouse_triplane.load(exported["moremouse-triplane"][1])
    size = model.cfg.image_size
    mouse = exported["moremouse-triplane"][1]
    views = moremouse_triplane.render_views(torch.rand(3, size, size), mouse, views=3)
    assert views.shape == (3, 3, size, size) and views.min() >= 0 and views.max() <= 1
    enhancer = mbsnet_speech.load(exported["mbsnet-speech"][1])
    assert enhancer.cfg is not None
    for package in (ginr_cifar, gpt2_window, mbsnet_speech, moremouse_triplane):
        assert package.__version__ == "0.1.0"


def test_memfit_version_and_plot(exported, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("memfit 0.1.0 (torch 2.11")
    run, _ = exported["gpt2-window"]
    with pytest.raises(SystemExit) as e:
        cli.main(["plot", str(run)])
    assert e.value.code == 0 and (run / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_memfit_train_and_eval_spell_the_system_portably(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "gpt2-window", "--model", "nano", "--batch_size", "2", "--eval_iters", "1",
                  "--steps", "1", "--no_progress", "--runs_dir", str(tmp_path)])  # fmt: skip
    assert e.value.code == 0 and (tmp_path / "gpt2-window" / "run" / "ckpt_0000001.pt").exists()
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "gpt2-window", "--run", "run", "--runs_dir", str(tmp_path), "--eval_iters", "1"])
    assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "nope"])
    assert e.value.code == 2 and "unknown system 'nope'" in capsys.readouterr().err


def test_model_card_says_whether_the_weights_are_the_runs_best():
    from memfit.train.export import model_card

    system = load_system("mbsnet-speech")
    best = {"metric": "choice", "value": 2.1, "step": 3000}
    own = model_card(system, {}, {"step": 3000, "best": best})
    later = model_card(system, {}, {"step": 5764, "best": best})
    assert "| validation | the run's best choice 2.1 (these weights) |" in own
    assert "| validation | the run's best choice 2.1 (step 3000, not these weights) |" in later


def test_model_card_names_the_validation_figures_behind_a_compound_choice(tmp_path):
    """A run chosen on a compound metric (mbsnet's "choice") gets the eval/* figures it logged at that
    step on its card: the last row for the step wins, rows of other steps and broken lines are skipped."""
    from memfit.train.export import _validation, model_card

    rows = [
        {"step": 600, "eval/pesq": 1.5, "eval/choice": -4.0},
        {"step": 5124, "loss": -3.1},
        {"step": 5124, "eval/pesq": 2.0, "eval/stoi": 0.88, "eval/choice": -1.0},
        {"step": 5124, "eval/pesq": 2.1784, "eval/stoi": 0.8836, "eval/choice": -1.2375},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n{not json\n")
    figures = _validation(tmp_path, 5124)
    assert figures == {"pesq": 2.1784, "stoi": 0.8836, "choice": -1.2375}
    assert _validation(tmp_path, 1) == {} and _validation(tmp_path / "none", 5124) == {}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"eval/pesq": 1.0}) + "\n")  # a row with no step
    assert _validation(tmp_path, None) == {}
    best = {"metric": "choice", "value": -1.2375, "step": 5124}
    card = model_card(load_system("mbsnet-speech"), {}, {"step": 5124, "best": best, "validation": figures})
    assert "| validation | the run's best choice -1.238 (these weights), pesq 2.178, stoi 0.8836 |" in card


@pytest.mark.parametrize("system", sorted(ALIASES))
def test_an_export_is_readable_files_with_a_hugging_face_model_card(system, exported):
    """Every file is written as an ordinary file (0644 under the usual umask; safetensors itself writes
    0600), and README.md opens with the YAML metadata the Hugging Face Hub reads; its title names the
    model's own size."""
    import os

    import yaml

    _, folder = exported[system]
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "config.json", "README.md"):
        assert (folder / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    card = (folder / "README.md").read_text()
    head, _, body = card.removeprefix("---\n").partition("\n---\n")
    meta = yaml.safe_load(head)
    assert meta["library_name"] == "memfit" and meta["license"] == "apache-2.0"
    assert {"memfit", system} <= set(meta["tags"]) and len(meta["tags"]) >= 3
    assert isinstance(meta["datasets"], list) and isinstance(meta["metrics"], list)
    params = json.loads((folder / "config.json").read_text())["meta"]["params"]
    assert body.lstrip().startswith(f"# {system}: {params / 1e6:.2f}M parameters, `")
    assert "GPT-2 124M" not in card


def test_from_pretrained_returns_the_model_and_raises_ordinary_one_line_errors(exported, tmp_path, capsys):
    """Hugging Face style: the model itself; a missing folder is a FileNotFoundError, a folder that is not
    this system's export a ValueError, each one line, the same line a command prints."""
    run, folder = exported["gpt2-window"]
    gpt2 = load_system("gpt2-window")
    assert isinstance(gpt2.from_pretrained(folder), torch.nn.Module)
    with pytest.raises(FileNotFoundError, match=r"^error: .*nope does not exist; pass a folder") as e:
        gpt2.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="is not an exported model"):
        gpt2.from_pretrained(run)
    with pytest.raises(ValueError, match="holds a mbsnet-speech model") as other:
        gpt2.from_pretrained(exported["mbsnet-speech"][1])
    assert "\n" not in str(e.value) and "\n" not in str(other.value)
    assert evaluate("gpt2-window", exported["mbsnet-speech"][1], "--out", str(tmp_path / "ev")) == 2
    assert one_error_line(capsys).endswith(str(other.value))
    import gpt2_window

    with pytest.raises(FileNotFoundError, match="no run 'missing'"):
        gpt2_window.load("missing", runs_dir=tmp_path)
