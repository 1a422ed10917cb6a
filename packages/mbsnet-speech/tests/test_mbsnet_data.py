import numpy as np
import pytest
import soundfile as sf
from mbsnet_speech.data import (
    MIX_NOISE_KINDS,
    MixSource,
    PairRemix,
    audio_files,
    find_pairs,
    folder_batch,
    heldout_pairs,
    make_noise,
    mix_batch,
    pair_rng,
    read_wav,
    synth_batch,
)


def test_generator_is_deterministic_and_heldout_is_disjoint():
    a = synth_batch(2, 8000, pair_rng(0, 5, 0))
    b = synth_batch(2, 8000, pair_rng(0, 5, 0))
    c = synth_batch(2, 8000, pair_rng(0, 6, 0))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])
    noisy, clean = a
    assert noisy.shape == clean.shape == (2, 8000) and noisy.dtype == np.float32
    assert np.max(np.abs(noisy)) <= 0.9 + 1e-6
    snr = 10 * np.log10(np.sum(clean**2, 1) / np.sum((noisy - clean) ** 2, 1))
    assert np.all((snr > -0.5) & (snr < 20.5))  # default range 0..20 dB
    held = heldout_pairs(2, seconds=0.5)
    train_cleans = [synth_batch(1, 8000, pair_rng(1234, i, 0))[1][0] for i in range(2)]
    assert all(not np.array_equal(h[2], t) for h in held for t in train_cleans)


def test_voicebank_folder_pairs_and_crops(tmp_path, make_voicebank):
    root = make_voicebank(tmp_path / "vb")
    pairs = find_pairs(root, split="train")
    assert pairs.names == ["p000.wav", "p001.wav", "p002.wav"]
    noisy, clean = folder_batch(pairs, 4, 32000, pair_rng(0, 0))  # clips are ~1 s: zero-padded
    assert noisy.shape == (4, 32000) and np.abs(clean[:, 20000:]).max() == 0
    again = folder_batch(pairs, 4, 32000, pair_rng(0, 0))
    assert np.array_equal(noisy, again[0])


def test_stereo_44k_is_resampled_to_16k_mono(tmp_path, speech):
    x, _, fs = speech
    import torch
    import torchaudio.functional as AF

    x44 = AF.resample(torch.from_numpy(x), fs, 44100).numpy()
    sf.write(tmp_path / "st.wav", np.stack([x44, 0.5 * x44], 1), 44100)
    y = read_wav(tmp_path / "st.wav")
    assert y.ndim == 1 and abs(len(y) - len(x)) <= 2
    m = min(len(x), len(y))
    err = np.sum((0.75 * x[:m] - y[:m]) ** 2) / np.sum((0.75 * x[:m]) ** 2)
    assert err < 1e-2  # the same speech, average of the two channels


def test_bad_folders_raise_clear_errors(tmp_path, make_voicebank):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        find_pairs(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="clean_"):
        find_pairs(tmp_path / "empty")
    root = make_voicebank(tmp_path / "mismatch")
    (root / "noisy_trainset_wav" / "p001.wav").rename(root / "noisy_trainset_wav" / "p999.wav")
    with pytest.raises(ValueError, match=r"names differ.*p001\.wav.*p999\.wav"):
        find_pairs(root, split="train")
    root = make_voicebank(tmp_path / "short")
    sf.write(root / "clean_trainset_wav" / "p000.wav", np.zeros(100, np.float32), 16000)
    with pytest.raises(ValueError, match="shorter than one STFT frame"):
        find_pairs(root, split="train")
    root = make_voicebank(tmp_path / "corrupt")
    (root / "noisy_testset_wav" / "p002.wav").write_bytes(b"RIFF\x00\x00garbage")
    with pytest.raises(ValueError, match=r"p002\.wav.*corrupt"):
        find_pairs(root, split="test")
    with pytest.raises(ValueError, match="valid wav"):
        read_wav(root / "noisy_testset_wav" / "p002.wav")


def _realised_snr(noisy: np.ndarray, clean: np.ndarray) -> np.ndarray:
    n, c = noisy.astype(np.float64), clean.astype(np.float64)
    return 10 * np.log10(np.sum(c**2, 1) / np.sum((n - c) ** 2, 1))


def test_on_the_fly_mix_hits_the_requested_snr(tmp_path, speech):
    clean, _, fs = speech
    (tmp_path / "clean").mkdir()
    for i in range(3):  # 1 s clips of real speech
        sf.write(tmp_path / "clean" / f"c{i}.wav", clean[i * 12000 : i * 12000 + 16000], fs)
    (tmp_path / "noise").mkdir()
    sf.write(tmp_path / "noise" / "short.wav", make_noise("pink", 3000, np.random.default_rng(0)) * 0.1, fs)
    files = audio_files(tmp_path / "clean", "--clean")
    for noise in (None, audio_files(tmp_path / "noise", "--noise")):  # built-in kinds, then a (tiled) file
        src = MixSource(files, noise, snr=(-5.0, 15.0))
        noisy, cl, snr = mix_batch(src, 16, 8000, pair_rng(0, 3))
        assert noisy.shape == cl.shape == (16, 8000) and noisy.dtype == np.float32
        assert np.all(np.abs(_realised_snr(noisy, cl) - snr) < 0.1)
        assert np.all((snr >= -5) & (snr <= 15)) and snr.std() > 2  # random SNRs across the range
        peaks = np.abs(noisy).max(1)
        assert peaks.max() <= 0.9 + 1e-6 and peaks.min() < 0.6  # random gain, no clipping
        again = mix_batch(src, 16, 8000, pair_rng(0, 3))
        other = mix_batch(src, 16, 8000, pair_rng(0, 4))
        assert np.array_equal(noisy, again[0])  # deterministic per (seed, step): resume is exact
        assert not np.array_equal(noisy, other[0])  # a new mix every step


def test_pair_remix_mixes_speech_with_other_pairs_noise_at_the_requested_snr(tmp_path, speech):
    """--data with --remix: the clean crop of one pair plus the noise (noisy - clean) of a random pair at a
    random SNR: every combination of speech and noise occurs, and the mix hits its SNR within 0.1 dB."""
    clean, _, fs = speech
    t = np.arange(16000) / fs
    for split in ("clean_train", "noisy_train"):
        (tmp_path / split).mkdir()
    for j in range(3):  # pair j: its own speech, and a tone at 300 (j + 1) Hz as its noise
        c = clean[j * 14000 : j * 14000 + 16000]
        sf.write(tmp_path / "clean_train" / f"p{j}.wav", c, fs, subtype="FLOAT")
        tone = 0.1 * np.sin(2 * np.pi * 300 * (j + 1) * t).astype(np.float32)
        sf.write(tmp_path / "noisy_train" / f"p{j}.wav", c + tone, fs, subtype="FLOAT")
    pairs = find_pairs(tmp_path, split="train")
    src = PairRemix(pairs, snr=(-5.0, 15.0))
    noisy, cl, snr = mix_batch(src, 32, 8000, pair_rng(0, 1))
    assert noisy.shape == cl.shape == (32, 8000) and noisy.dtype == np.float32
    assert np.all(np.abs(_realised_snr(noisy, cl) - snr) < 0.1)
    assert np.all((snr >= -5) & (snr <= 15)) and snr.std() > 2
    assert np.abs(noisy).max() <= 0.9 + 1e-6
    combos = set()
    for b in range(32):
        spec = np.abs(np.fft.rfft(noisy[b] - cl[b]))
        noise_pair = round(np.argmax(spec) * fs / 8000 / 300) - 1  # which pair's tone
        scores = [  # which pair's speech: the crop is a scaled window of it
            np.max(np.abs(np.correlate(pairs.load(j)[0], cl[b] / np.linalg.norm(cl[b]))))
            / np.linalg.norm(pairs.load(j)[0])
            for j in range(3)
        ]
        combos.add((int(np.argmax(scores)), noise_pair))
    assert len(combos) >= 7  # of the 9 speech x noise combinations, not just the 3 fixed pairs
    again = mix_batch(src, 32, 8000, pair_rng(0, 1))
    assert np.array_equal(noisy, again[0])
    with pytest.raises(ValueError, match="MIN <= MAX"):
        PairRemix(pairs, snr=(15.0, -5.0))


def test_builtin_noise_kinds_are_unit_power_and_distinct():
    rng = np.random.default_rng(0)
    spectra = {}
    for kind in MIX_NOISE_KINDS:
        x = make_noise(kind, 16000, rng)
        assert np.mean(x**2) == pytest.approx(1.0, rel=1e-3)
        spectra[kind] = np.abs(np.fft.rfft(x)) ** 2
    low = {k: s[:500].sum() / s.sum() for k, s in spectra.items()}  # share of power below 500 Hz (1 Hz bins)
    assert low["brown"] > 0.9 and low["white"] < 0.08 and low["hum"] > 0.8


def test_on_the_fly_mix_rejects_bad_input(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no audio here")
    with pytest.raises(ValueError, match="no .wav or .flac"):
        audio_files(tmp_path / "empty", "--clean")
    (tmp_path / "n").mkdir()
    sf.write(tmp_path / "n" / "tiny.wav", np.zeros(100, np.float32), 16000)
    with pytest.raises(ValueError, match="shorter than one STFT frame"):
        audio_files(tmp_path / "n", "--noise")
    with pytest.raises(ValueError, match="MIN <= MAX"):
        MixSource([tmp_path / "x.wav"], None, snr=(10.0, 0.0))
