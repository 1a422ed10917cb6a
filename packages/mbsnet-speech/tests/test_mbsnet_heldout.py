"""Training on several sources with whole voices held out, eval's held-out sets beside the Wiener filter,
bad audio in a training folder, and enhance's outputs (never over an input, streamed in bounded memory)."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import soundfile as sf
from mbsnet_speech import enhance, eval, train
from mbsnet_speech.data import make_noise, read_blocks, read_wav
from memfit.errors import UsageError

TINY = [
    *("--config", "tiny", "--batch_size", "2", "--seconds", "0.5", "--no_progress", "--log_every", "1"),
    "--no_preflight",
]
VOICES = ("en_aa", "it_bb", "ru_cc", "fi_dd", "cs_ee", "ca_ff")


@pytest.fixture
def corpora(tmp_path, speech, make_voicebank):
    """(pairs root, clean-voices folder, noise folder): 6 voices x 3 utterances, 5 noise recordings."""
    clean = speech[0]
    voices = tmp_path / "voices"
    voices.mkdir()
    for v, voice in enumerate(VOICES):
        for i in range(3):
            start = (v * 3 + i) * 2000 % (len(clean) - 20000)
            sf.write(voices / f"{voice}_{i:03d}.flac", clean[start : start + 20000], 16000)
    noise = tmp_path / "noise"
    noise.mkdir()
    for k, kind in enumerate(("white", "pink", "brown", "hum", "babble")):
        x = 0.1 * make_noise(kind, 24000, np.random.default_rng(k))
        sf.write(noise / f"{kind}-rec_{k:02d}.flac", x, 16000)
    return make_voicebank(tmp_path / "vb"), voices, noise


def test_train_on_several_sources_holds_out_voices_and_eval_scores_each_set(corpora, tmp_path, capsys):
    pairs, voices, noise = corpora
    held = [
        "--val_voices",
        "aa,bb",
        "--test_voices",
        "ff",
        "--val_noises",
        "white-rec",
        "--test_noises",
        "hum-rec",
    ]
    train.main(
        [*TINY, "--steps", "2", "--eval_every", "2", "--val_files", "2", "--data", str(pairs)]
        + ["--clean", str(voices), "--noise", str(noise), "--augment", "speed=0.5,reverb=0.5,eq=0.5", *held]
        + ["--runs_dir", str(tmp_path / "runs"), "--run_name", "mix"]
    )
    err = capsys.readouterr().err
    assert "voices held out: en_aa, it_bb (validation), ca_ff (test, never seen)" in err
    assert "noises held out: white-rec (validation), hum-rec (test, never seen)" in err
    assert "augment speed=0.5,eq=0.5,reverb=0.5" in err
    run = tmp_path / "runs" / "mbsnet-speech" / "mix"
    # eval with no data flags: what the run trained on, its test split and its never-seen voice x noise
    s = eval.main(["--run", str(run), "--mixes", "3", "--out", str(tmp_path / "ev")])
    report = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    labels = [x["data"] for x in report["sets"]]
    assert len(labels) == 2 and "test split" in labels[0]
    assert "held-out voices ca_ff x held-out noises hum-rec" in labels[1]
    assert all(f["file"].startswith("ca_ff_") and "hum-rec" in f["file"] for f in report["sets"][1]["files"])
    for x in report["sets"]:  # the Wiener filter beside the model in each set
        assert np.isfinite(x["summary"]["classical/pesq_wb"]) and np.isfinite(
            x["summary"]["enhanced/pesq_wb"]
        )
    assert s == report["sets"][0]["summary"]
    # --speech: a recording mixed with the held-out noises
    eval.main(
        ["--run", str(run), "--speech", str(voices / "en_aa_000.flac"), "--mixes", "2"]
        + ["--out", str(tmp_path / "ev2")]
    )
    sets = json.loads((tmp_path / "ev2" / "metrics.json").read_text())["sets"]
    assert len(sets) == 1 and len(sets[0]["files"]) == 2 and "en_aa_000.flac" in sets[0]["data"]


def test_a_bad_file_in_a_training_folder_is_one_line_naming_it(corpora, tmp_path, capsys):
    _, voices, _ = corpora
    bad = np.zeros(8000, np.float32)
    bad[100] = np.nan
    sf.write(voices / "en_aa_009.wav", bad, 16000, subtype="FLOAT")
    code = run_command_exit(
        [*TINY, "--steps", "3", "--clean", str(voices), "--val_files", "0"]
        + ["--runs_dir", str(tmp_path / "runs"), "--run_name", "bad"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "error:" in err[0] and "en_aa_009.wav contains NaN" in err[0]
    assert not (tmp_path / "runs" / "mbsnet-speech" / "bad").exists()  # refused before a run folder


def run_command_exit(argv) -> int:
    from memfit.errors import run_command

    return run_command("mbsnet-train", train.main, argv)


def test_eval_refuses_pieces_shorter_than_a_frame(tmp_path):
    with pytest.raises(UsageError, match="shorter than one STFT frame"):
        eval.main(["--run", str(tmp_path), "--seconds", "0.001"])


def test_enhance_never_writes_over_its_inputs(tmp_path, speech):
    (tmp_path / "noisy").mkdir()
    sf.write(tmp_path / "noisy" / "a.wav", speech[1], 16000)
    before = (tmp_path / "noisy" / "a.wav").read_bytes()
    with pytest.raises(UsageError, match="outputs never replace inputs"):
        enhance.main([str(tmp_path / "noisy"), "--out", str(tmp_path / "noisy")])
    with pytest.raises(UsageError, match="outputs never replace inputs"):  # a file beside its output
        enhance.main([str(tmp_path / "noisy" / "a.wav"), "--out", str(tmp_path / "noisy")])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.wav").write_bytes(b"mine")
    with pytest.raises(UsageError, match="exists; pass --overwrite"):
        enhance.main([str(tmp_path / "noisy"), "--out", str(tmp_path / "out")])
    assert (tmp_path / "noisy" / "a.wav").read_bytes() == before
    assert (tmp_path / "out" / "a.wav").read_bytes() == b"mine"


def test_read_blocks_is_read_wav_in_pieces(tmp_path, speech):
    """Streaming reads give what reading the whole file gives, for 16 kHz and for 48 kHz stereo."""
    x = np.tile(speech[0], 4)
    sf.write(tmp_path / "a.wav", x, 16000, subtype="FLOAT")
    np.testing.assert_array_equal(
        np.concatenate(list(read_blocks(tmp_path / "a.wav", 1.3))), read_wav(tmp_path / "a.wav")
    )
    t = np.arange(3 * 48000) / 48000
    st = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 1000 * t)], 1) * 0.3
    sf.write(tmp_path / "b.wav", st, 48000, subtype="FLOAT")
    whole = read_wav(tmp_path / "b.wav")
    parts = np.concatenate(list(read_blocks(tmp_path / "b.wav", 0.7)))
    assert abs(len(parts) - len(whole)) <= 2
    m = min(len(parts), len(whole))
    assert np.max(np.abs(parts[:m] - whole[:m])) < 1e-3


STREAM = textwrap.dedent(
    """
    import resource, sys
    import numpy as np, soundfile as sf
    from mbsnet_speech.enhance import enhance_stream
    minutes, src, dst = float(sys.argv[1]), sys.argv[2], sys.argv[3]
    rng = np.random.default_rng(0)
    with sf.SoundFile(src, "w", 16000, 1, subtype="PCM_16") as f:  # written in pieces: the test holds none
        for _ in range(int(minutes * 6)):
            f.write(0.1 * rng.standard_normal(160000))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = enhance_stream(lambda x: 0.5 * x, src, dst)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(seconds, (peak - base) / 1024)
    """
)


def test_enhance_streams_a_long_file_in_bounded_memory(tmp_path):
    """60 minutes of audio (230 MB as float32) go through in blocks: the peak memory grows by far less
    than the file, and the same as for 1 minute."""
    grown = {}
    for minutes in (1, 60):
        src, dst = tmp_path / f"in{minutes}.wav", tmp_path / f"out{minutes}.wav"
        out = subprocess.run(
            [sys.executable, "-c", STREAM, str(minutes), str(src), str(dst)], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        seconds, mib = map(float, out.stdout.split())
        assert seconds == minutes * 60 and sf.info(str(dst)).frames == minutes * 60 * 16000
        grown[minutes] = mib
        src.unlink()
        dst.unlink()
    assert grown[60] < 40 and grown[60] < grown[1] + 20, grown
