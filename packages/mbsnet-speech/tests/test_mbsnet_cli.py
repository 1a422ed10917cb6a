import csv
import json
import re
import shutil

import numpy as np
import pytest
import soundfile as sf
import torch
from memfit.cli import load_system
from memfit.errors import UsageError, run_command

pytest.importorskip(
    "memfit.ops.mamba", reason="memfit.ops.mamba (the chunked Mamba block) is not installed yet"
)

from mbsnet_speech import enhance, eval, train  # noqa: E402
from mbsnet_speech.enhance import enhance_array  # noqa: E402

TINY = [
    *("--config", "tiny", "--batch_size", "2", "--seconds", "0.5", "--no_progress", "--log_every", "1"),
    *("--val_files", "0"),  # no validation unless a test asks for it
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained 3 steps on generated pairs, checkpoints at 2 and 3 (shared by later tests)."""
    runs = tmp_path_factory.mktemp("runs")
    out = train.main(
        [*TINY, "--steps", "3", "--save_every", "2", "--runs_dir", str(runs), "--run_name", "gen"]
    )
    return runs / "mbsnet-speech" / "gen", out


def test_train_on_generator_writes_checkpoint_and_metrics(trained):
    run_dir, out = trained
    assert np.isfinite(out["loss"]) and out["peak_memory_mib"] > 0
    assert (run_dir / "ckpt_0000002.pt").exists() and (run_dir / "ckpt_0000003.pt").exists()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert all(k in records[0] for k in ("mag", "pha", "com", "time"))


def test_resume_continues_exactly(trained, tmp_path):
    """Resuming from the step-2 checkpoint reproduces the uninterrupted run's step 3 bit for bit."""
    run_dir, _ = trained
    split = tmp_path / "mbsnet-speech" / "split"
    split.mkdir(parents=True)
    shutil.copy(run_dir / "ckpt_0000002.pt", split)
    train.main([*TINY, "--steps", "3", "--runs_dir", str(tmp_path), "--run_name", "split", "--resume"])
    a = torch.load(split / "ckpt_0000003.pt", weights_only=True)["model"]
    b = torch.load(run_dir / "ckpt_0000003.pt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_train_on_voicebank_folder(tmp_path, make_voicebank, capsys):
    root = make_voicebank(tmp_path / "vb")
    out = train.main(
        [*TINY, "--steps", "1", "--data", str(root), "--runs_dir", str(tmp_path), "--run_name", "vb"]
    )
    assert np.isfinite(out["loss"])
    assert "remixed: speech x noise of other pairs at -5..15 dB" in capsys.readouterr().err
    fixed = [*TINY, "--steps", "1", "--data", str(root), "--no-remix"]  # (--snr with it: refused)
    train.main([*fixed, "--runs_dir", str(tmp_path), "--run_name", "fixed"])
    assert "remixed" not in capsys.readouterr().err
    bad_snr = [*TINY, "--steps", "1", "--data", str(root), "--snr", "15", "-5", "--runs_dir", str(tmp_path)]
    assert run_command("mbsnet-train", train.main, bad_snr) == 2
    assert "MIN <= MAX" in capsys.readouterr().err
    missing = [*TINY, "--steps", "1", "--data", str(tmp_path / "nothing_here"), "--runs_dir", str(tmp_path)]
    assert run_command("mbsnet-train", train.main, missing) == 2
    assert "clean_" in capsys.readouterr().err


def test_validation_keeps_the_best_checkpoint_and_eval_uses_it(tmp_path, capsys):
    run = tmp_path / "mbsnet-speech" / "val"
    train.main(
        [*TINY, "--steps", "4", "--eval_every", "1", "--val_files", "2", "--save_every", "0"]
        + ["--lr", "5e-2", "--runs_dir", str(tmp_path), "--run_name", "val"]
    )
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/pesq" in r]
    assert [r["step"] for r in evals] == [1, 2, 3, 4]
    assert all(np.isfinite(r["eval/stoi"]) and np.isfinite(r["eval/si_sdr"]) for r in evals)
    # best.pt: the highest PESQ-wb among validations meeting the STOI and SI-SDR floors (choice_score)
    assert all(r["eval/choice"] == r["eval/pesq"] or r["eval/choice"] <= -1 for r in evals)
    best = max(evals, key=lambda r: r["eval/choice"])
    saved = torch.load(run / "best.pt", weights_only=True)
    assert saved["step"] == best["step"] == evals[-1]["best_step"]
    capsys.readouterr()
    eval.main(["--run", str(run), "--pairs", "2", "--seconds", "1.5", "--out", str(tmp_path / "ev")])
    out = capsys.readouterr().out
    line = f"model: {run / 'best.pt'} (`tiny` preset, {best['step']} steps on the built-in data)"
    assert line in out.splitlines() and "2 generated held-out pairs" in out
    report = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert report["checkpoint"] == str(run / "best.pt") and len(report["files"]) == 2
    assert np.isfinite(report["summary"]["classical/pesq_wb"])  # the Wiener baseline beside the model


def test_best_checkpoint_rule_puts_the_stoi_and_si_sdr_floors_before_pesq():
    noisy = {"pesq": 1.2, "stoi": 0.85, "si_sdr": 5.0}

    def score(pesq, stoi, si_sdr):
        return train.choice_score({"pesq": pesq, "stoi": stoi, "si_sdr": si_sdr}, noisy)

    meets = score(1.05, 0.86, 5.0)
    assert meets == 1.05 and score(1.9, 0.9, 9.0) == 1.9  # both floors met: PESQ-wb decides
    assert max(score(4.0, 0.859, 9.0), score(4.0, 0.9, 4.9)) < meets  # a floor missed ranks below
    # of validations that miss, the nearest miss wins, whatever their PESQ-wb: STOI in units of the floor
    # (0.001 short = 0.1), SI-SDR in dB
    assert score(1.5, 0.9, 4.8) == pytest.approx(-1.2) and score(1.5, 0.859, 4.8) == pytest.approx(-1.3)
    assert score(1.5, 0.9, 4.8) > score(2.4, 0.9, 3.0) > score(2.4, 0.8, 9.0)
    assert all(np.isnan(score(*bad)) for bad in ((2.0, np.nan, 9.0), (2.0, 0.9, np.nan), (np.nan, 0.9, 9.0)))


def test_max_minutes_stops_and_saves(tmp_path):
    run = tmp_path / "mbsnet-speech" / "budget"
    train.main([*TINY, "--max_minutes", "0.001", "--runs_dir", str(tmp_path), "--run_name", "budget"])
    ckpts = sorted(run.glob("ckpt_*.pt"))
    assert len(ckpts) == 1 and torch.load(ckpts[0], weights_only=True)["step"] >= 1


def test_train_mixes_a_clean_folder_on_the_fly(tmp_path, speech, capsys):
    clean, _, fs = speech
    (tmp_path / "clean").mkdir()
    for i in range(3):
        sf.write(tmp_path / "clean" / f"c{i}.wav", clean[i * 12000 : i * 12000 + 16000], fs)
    common = [*TINY, "--steps", "1", "--runs_dir", str(tmp_path)]
    out = train.main([*common, "--clean", str(tmp_path / "clean"), "--snr", "0", "10"])
    assert np.isfinite(out["loss"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "noise").mkdir()
    sf.write(tmp_path / "noise" / "blip.wav", np.zeros(200, np.float32), fs)
    bad = {
        "no .wav or .flac": ["--clean", str(tmp_path / "empty")],
        "shorter than one STFT frame": [
            "--clean",
            str(tmp_path / "clean"),
            "--noise",
            str(tmp_path / "noise"),
        ],
        "MIN <= MAX": ["--clean", str(tmp_path / "clean"), "--snr", "10", "0"],
    }
    for msg, args in bad.items():
        capsys.readouterr()
        assert run_command("mbsnet-train", train.main, [*common, *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0] and err[0].startswith("mbsnet-train: error: ")


def test_eval_finds_noise_kinds_in_file_names():
    assert eval.noise_kind("test_001_awb_pink_0dB.flac") == "pink"
    assert eval.noise_kind("p232_001_babble_-5dB.wav") == "babble"
    assert eval.noise_kind("x_white.wav") == "white"
    assert eval.noise_kind("p232_001.wav") is None


def test_eval_and_enhance_help_opens_with_their_modules_first_line(capsys):
    """Their flags are declared in flags.py (no torch), which reads the modules' docstrings from source."""
    from mbsnet_speech import flags

    for module, parse in ((eval, flags.eval_args), (enhance, flags.enhance_args)):
        with pytest.raises(SystemExit):
            parse(["--help"])
        usage, _, rest = capsys.readouterr().out.partition("\n\n")  # the description follows the usage
        squeeze = "".join  # argparse rewraps the text (and may break at a hyphen): compare without spaces
        assert squeeze(rest.split()).startswith(squeeze(module.__doc__.splitlines()[0].split())), usage


def test_eval_writes_table_csv_and_spectrogram(trained, tmp_path, capsys):
    run_dir, _ = trained
    summary = eval.main(["--run", str(run_dir), "--pairs", "2", "--seconds", "1.5", "--out", str(tmp_path)])
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["file"] for r in rows] == ["heldout_000.wav", "heldout_001.wav"]
    assert summary["n_ok"] == 2 and np.isfinite(summary["enhanced/pesq_wb"])
    png = (tmp_path / "spectrogram.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "mean (noisy -> enhanced)" in capsys.readouterr().out


def test_pcs_follows_the_run_config_unless_a_flag_says_otherwise(trained, tmp_path):
    """The CPU recipe's config turns PCS on; eval --pcs / --no-pcs override what the run saved."""
    from mbsnet_speech.config import get_config

    assert get_config("cpu").pcs and not get_config("default").pcs and not get_config("tiny").pcs
    run_dir, _ = trained
    common = ["--run", str(run_dir), "--pairs", "1", "--seconds", "1.0"]
    saved = eval.main([*common, "--out", str(tmp_path / "a")])  # the tiny run saved pcs off
    off = eval.main([*common, "--no-pcs", "--out", str(tmp_path / "b")])
    on = eval.main([*common, "--pcs", "--out", str(tmp_path / "c")])
    assert off["enhanced/si_sdr"] == saved["enhanced/si_sdr"] != on["enhanced/si_sdr"]


def test_shifts_flag_overrides_the_run_and_a_bad_value_is_one_line(trained, tmp_path, capsys):
    """eval --shifts N averages N delayed passes over what the run saved (1); a value its config refuses
    is a UsageError (one line, exit 2) naming the setting, not the checkpoint."""
    run_dir, _ = trained
    common = ["--run", str(run_dir), "--pairs", "1", "--seconds", "1.0"]
    one = eval.main([*common, "--out", str(tmp_path / "a")])
    two = eval.main([*common, "--shifts", "2", "--out", str(tmp_path / "b")])
    assert np.isfinite(two["enhanced/si_sdr"]) and two["enhanced/si_sdr"] != one["enhanced/si_sdr"]
    for bad in ("0", "100000"):
        with pytest.raises(UsageError, match=f"^error: shifts={bad} does not fit this model: shifts must be"):
            eval.main([*common, "--shifts", bad, "--out", str(tmp_path / f"bad{bad}")])


def test_eval_on_folder_records_a_bad_file_and_goes_on(trained, tmp_path, make_voicebank):
    run_dir, _ = trained
    root = make_voicebank(tmp_path / "vb")
    sf.write(root / "clean_testset_wav" / "p001.wav", np.zeros(16000, np.float32), 16000)
    sf.write(root / "noisy_testset_wav" / "p001.wav", np.zeros(16000, np.float32), 16000)
    summary = eval.main(["--run", str(run_dir), "--data", str(root), "--out", str(tmp_path / "ev")])
    with open(tmp_path / "ev" / "metrics.csv") as f:
        rows = {r["file"]: r for r in csv.DictReader(f)}
    assert "silent" in rows["p001.wav"]["error"] and rows["p000.wav"]["error"] == ""
    assert summary["n_ok"] == 2 and summary["n_failed"] == 1
    with pytest.raises(UsageError, match="no checkpoint"):
        eval.main(["--run", str(tmp_path), "--pairs", "1"])


def test_chunked_overlap_add_is_exact_for_identity_and_bounded():
    x = np.random.default_rng(0).standard_normal(50_000).astype(np.float32)
    lengths = []

    def ident(t):
        lengths.append(t.shape[1])
        return t

    y = enhance_array(ident, x, chunk=8000, overlap=1000)
    np.testing.assert_allclose(y, x, atol=1e-6)
    assert len(lengths) == 7 and max(lengths) == 8000


def test_enhance_long_file_in_chunks(trained, tmp_path, speech):
    run_dir, _ = trained
    clean, noisy, fs = speech
    long = np.tile(noisy, 3)  # ~9.3 s
    (tmp_path / "in").mkdir()
    sf.write(tmp_path / "in" / "long.wav", long, fs)
    sf.write(tmp_path / "in" / "short.wav", noisy[:8000], fs)
    written = enhance.main(
        [
            str(tmp_path / "in"),
            "--out",
            str(tmp_path / "out"),
            "--run",
            str(run_dir),
            "--chunk_seconds",
            "2",
            "--overlap_seconds",
            "0.25",
        ]
    )
    assert sorted(p.name for p in written) == ["long.wav", "short.wav"]
    y, sr = sf.read(tmp_path / "out" / "long.wav")
    assert sr == 16000 and len(y) == len(long) and np.isfinite(y).all() and np.abs(y).max() > 0
    with pytest.raises(UsageError, match="does not exist"):
        enhance.main([str(tmp_path / "nope.wav"), "--out", str(tmp_path), "--run", str(run_dir)])


def test_noisy_phase_keeps_the_input_phase_and_trains_only_the_mask():
    torch.manual_seed(0)
    from mbsnet_speech.config import tiny_config
    from mbsnet_speech.model import MBSNet

    model = MBSNet(tiny_config())
    train.freeze_phase_head(model)
    x = 0.1 * torch.randn(2, 4000)
    out = model(x)
    _, pha = model.stft(x)
    torch.testing.assert_close(out.pha, pha, rtol=0, atol=0)
    frozen = {n for n, q in model.named_parameters() if not q.requires_grad}
    assert frozen and all(n.startswith("phase_head.") for n in frozen)


def test_paper_config_trains_without_layer_recompute_on_cpu_unless_asked():
    """On CPU the paper recipe turns layer recompute off (a GPU memory saving that cost ~1.4x the step time
    there); --checkpointing/--no-checkpointing always win, and the CPU recipe keeps its preset's choice."""

    def recompute(*flags):
        return train.build_parser().parse(["--device", "cpu", *flags]).settings.model.checkpoint

    assert recompute("--config", "default") is False
    assert recompute("--config", "default", "--checkpointing") is True
    assert recompute("--config", "cpu") is False  # the CPU recipe's preset has none
    assert recompute("--config", "cpu", "--checkpointing") is True


def test_hop_flag_sets_the_stft_hop_and_refuses_one_longer_than_the_window():
    """--hop changes the model's STFT hop over the preset's (100 samples; the generalising recipe's 200);
    a hop longer than the 400-sample window is one line naming the limit."""

    def hop(*flags):
        return train.build_parser().parse(["--device", "cpu", *flags]).settings.model.hop

    assert hop("--config", "cpu") == 100 and hop("--config", "default") == 100
    assert hop("--config", "cpu", "--hop", "200") == 200
    with pytest.raises(UsageError, match="hop must be in 1..win"):
        train.build_parser().parse(["--device", "cpu", "--config", "cpu", "--hop", "500"])


def test_general_preset_is_the_cpu_preset_with_the_generalising_recipe_flags():
    """`--config general` is the cpu preset with --hop 200, the PESQ and STOI terms at 0.6 and 10 and -SI-SDR
    at 0.01, --ema 0.999, --no-pcs and --shifts 4, in its own run folder; everything else the same, and a
    flag still overrides it."""

    def settings(*flags):
        return train.build_parser().parse(["--device", "cpu", *flags]).settings

    spelled = ["--hop", "200", "--loss", "pesq=0.6,stoi=10,sisdr=0.01", "--ema", "0.999", "--no-pcs"]
    spelled += ["--shifts", "4", "--run_name", "general"]
    general, cpu = settings("--config", "general"), settings("--config", "cpu")
    assert general == settings("--config", "cpu", *spelled)
    assert general != cpu and general.train.lr == cpu.train.lr and general.loop.threads == 1
    assert settings("--config", "general", "--loss", "sisdr=0.02").train.loss.sisdr == 0.02
    assert settings("--config", "general", "--loss", "sisdr=0.02").train.loss.stoi == 10


def test_relative_data_paths_are_kept_absolute_so_eval_elsewhere_scores_them(
    tmp_path, make_voicebank, monkeypatch, capsys
):
    a, b = tmp_path / "a", tmp_path / "b"
    make_voicebank(a / "vb")
    b.mkdir()
    monkeypatch.chdir(a)
    train.main([*TINY, "--steps", "1", "--data", "vb", "--runs_dir", str(tmp_path), "--run_name", "rel"])
    run = tmp_path / "mbsnet-speech" / "rel"
    assert json.loads((run / "config.json").read_text())["train"]["data"] == str(a / "vb")
    monkeypatch.chdir(b)  # eval defaults to the run's data: the same folder, from anywhere
    capsys.readouterr()
    eval.main(["--run", str(run), "--limit", "1"])
    assert f"data: 1 pairs from {a / 'vb'} (test split)" in capsys.readouterr().out
    (a / "vb").rename(a / "gone")  # data that is no longer there: said, not silently replaced
    eval.main(["--run", str(run), "--pairs", "1", "--seconds", "1.5"])
    out, err = capsys.readouterr()
    assert f"the run trained on --data {a / 'vb'}, which is not here" in err
    assert "data: 1 generated held-out pairs" in out


def test_relative_clean_and_noise_folders_are_kept_absolute(tmp_path, speech, monkeypatch):
    clean, _, fs = speech
    (tmp_path / "c").mkdir()
    (tmp_path / "n").mkdir()
    for i in range(3):
        sf.write(tmp_path / "c" / f"c{i}.wav", clean[i * 12000 : i * 12000 + 16000], fs)
        sf.write(tmp_path / "n" / f"hum{i}.wav", 0.1 * np.sin(np.arange(16000) * 0.05 * (i + 1)), fs)
    monkeypatch.chdir(tmp_path)
    train.main([*TINY, "--steps", "1", "--clean", "c", "--noise", "n", "--runs_dir", "runs"])
    saved = json.loads((tmp_path / "runs" / "mbsnet-speech" / "run" / "config.json").read_text())["train"]
    assert (saved["clean"], saved["noise"]) == (str(tmp_path / "c"), str(tmp_path / "n"))


def test_train_help_lists_every_preset_config_takes(capsys):
    with pytest.raises(SystemExit):
        train.build_parser().parse(["--help"])
    listed = re.search(r"--config ([a-z|]+)\]", capsys.readouterr().out)[1].split("|")
    assert sorted(listed) == sorted(["auto", *train.SETTINGS])  # general among them


def test_a_failed_enhance_removes_the_out_folder_it_created_and_only_that(trained, tmp_path, capsys):
    run_dir, _ = trained
    enhance_cmd = load_system("mbsnet-speech").command("enhance")
    (tmp_path / "in").mkdir()
    sf.write(tmp_path / "in" / "a.wav", np.zeros(8000, np.float32), 16000)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "b.wav").write_bytes(b"RIFF but not audio")
    new = tmp_path / "new" / "out"
    assert enhance_cmd([str(tmp_path / "in"), "--out", str(new), "--run", str(tmp_path / "no_run")]) == 2
    assert "no run" in capsys.readouterr().err and not (tmp_path / "new").exists()
    assert enhance_cmd([str(tmp_path / "bad"), "--out", str(new), "--run", str(run_dir)]) == 2
    assert "1 of 1 files could not be enhanced" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # nothing written: the folders it made are gone
    there = tmp_path / "there"
    there.mkdir()
    assert enhance_cmd([str(tmp_path / "in"), "--out", str(there), "--run", str(tmp_path / "no_run")]) == 2
    assert there.is_dir()  # it was there before: kept
    assert enhance_cmd([str(tmp_path / "in"), "--out", str(new), "--run", str(run_dir)]) == 0
    assert (new / "a.wav").is_file()
