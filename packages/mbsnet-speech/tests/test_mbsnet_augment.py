"""The generalisation data pipeline: augmentations keep length and alignment, mixes hit their SNR with
every augmentation on, several sources mix, and whole voices / noise recordings are held out."""

import numpy as np
import pytest
import soundfile as sf
from mbsnet_speech import augment
from mbsnet_speech.augment import Augment
from mbsnet_speech.data import (
    MixSource,
    Sources,
    audio_files,
    group_of,
    heldout_mixes,
    make_noise,
    mix_batch,
    pair_rng,
    split_groups,
)

ALL_ON = Augment(speed=1, eq=1, reverb=1, gain=1, clip=0, bandlimit=1)


def _lag(a: np.ndarray, b: np.ndarray, max_lag: int = 200) -> int:
    """The lag (samples) at which b best matches a."""
    scores = [np.dot(a[max_lag:-max_lag], np.roll(b, k)[max_lag:-max_lag]) for k in range(-max_lag, max_lag)]
    return int(np.argmax(scores)) - max_lag


@pytest.mark.parametrize("name", ["speed", "eq", "reverb", "bandlimit", "clip"])
def test_each_augmentation_keeps_length_and_timing(speech, name):
    clean = speech[0][:24000].astype(np.float32)
    rng = np.random.default_rng(3)
    y = getattr(augment, name)(clean, rng)
    assert y.shape == clean.shape and y.dtype == np.float32 and np.all(np.isfinite(y))
    assert not np.allclose(y, clean)  # it did something
    if name != "speed":  # speed moves later samples by design; the start stays put
        assert _lag(clean, y) == 0
    else:  # a time warp x0.9..1.1 that starts where the input starts: the first 1000 samples match best
        # at a warp, not at a shift
        f = np.linspace(0.9, 1.1, 201)
        t = np.arange(1000)
        err = [np.abs(np.interp(t * k, np.arange(len(clean)), clean) - y[:1000]).max() for k in f]
        assert 0.9 < f[int(np.argmin(err))] < 1.1 and min(err) < 0.2 * max(err)


def test_speed_is_the_time_warp_it_replaced():
    """torchaudio's speed in place of np.interp: the same factor draw (rounded to 0.01), the same length,
    no shift, and on a smooth signal the same samples as the linear interpolation it replaced, to the
    linear interpolation's own error."""
    n = 16000
    smooth = (0.5 * np.sin(2 * np.pi * 150 * np.arange(n) / 16000)).astype(np.float32)
    for seed in range(5):
        factor = round(np.random.default_rng(seed).uniform(0.9, 1.1), 2)
        y = augment.speed(smooth, np.random.default_rng(seed))
        old = np.interp(np.arange(0, n - 1, factor), np.arange(n), smooth)[:n]
        m = min(len(old), n) - 400  # the resampler's edge: its last window sees zeros past the end
        assert y.shape == smooth.shape and np.abs(y[:m] - old[:m]).max() < 2e-3, (seed, factor)


def test_room_response_has_its_direct_path_first():
    h = augment.room_response(np.random.default_rng(0))
    assert h[0] == 1 and np.argmax(np.abs(h)) == 0 and 0.15 * 16000 * 0.9 < len(h) <= 0.5 * 16000


def test_augment_probabilities_are_checked():
    with pytest.raises(ValueError, match="probability"):
        Augment(reverb=1.5)
    with pytest.raises(ValueError):
        Augment(eq=-0.1)


def _voices(tmp_path, speech, voices=("aa_one", "bb_two", "cc_three", "dd_four", "ee_five"), per=3):
    clean = speech[0]
    d = tmp_path / "voices"
    d.mkdir()
    for v, voice in enumerate(voices):
        for i in range(per):
            start = (v * per + i) * 3000 % (len(clean) - 16000)
            sf.write(d / f"{voice}_{i:03d}.flac", clean[start : start + 16000], 16000)
    return d


def test_mixes_hit_the_requested_snr_with_every_augmentation_on(tmp_path, speech):
    """noisy - clean is exactly the scaled noise (aligned, same length), at the requested SNR within 0.5 dB,
    with speed, EQ, room, band-limit and quiet levels on (clipping changes the mix by design)."""
    files = audio_files(_voices(tmp_path, speech), "--clean")
    src = MixSource(files, None, snr=(0.0, 10.0))
    noisy, clean, snr = mix_batch(src, 12, 8000, pair_rng(0, 2), ALL_ON)
    assert noisy.shape == clean.shape == (12, 8000) and noisy.dtype == np.float32
    noise = (noisy - clean).astype(np.float64)
    realised = 10 * np.log10(np.sum(clean.astype(np.float64) ** 2, 1) / np.sum(noise**2, 1))
    assert np.all(np.abs(realised - snr) < 0.5)
    assert np.max(np.abs(noisy)) <= 0.1 + 1e-6  # gain=1: every mix is a quiet recording (peak <= 0.1)
    clipped, _, _ = mix_batch(src, 4, 8000, pair_rng(0, 2), Augment(clip=1))
    assert all(np.sum(np.abs(x) >= np.max(np.abs(x)) - 1e-7) > 1 for x in clipped)  # flat tops


def test_sources_draw_mixes_from_each_by_weight(tmp_path, speech):
    files = audio_files(_voices(tmp_path, speech), "--clean")
    loud = MixSource(files[:3], None, snr=(30.0, 30.0))
    noisy_src = MixSource(files[3:], None, snr=(-5.0, -5.0))
    noisy, clean, _ = mix_batch(Sources([loud, noisy_src], [0.25, 0.75]), 200, 2000, pair_rng(0, 1))
    realised = 10 * np.log10(np.sum(clean**2, 1) / np.sum((noisy - clean) ** 2, 1))
    share = np.mean(realised > 10)
    assert 0.15 < share < 0.35


def test_whole_voices_and_noise_recordings_are_held_out(tmp_path, speech):
    d = _voices(tmp_path, speech)
    files = audio_files(d, "--clean")
    assert group_of(files[0], d) == "aa_one"
    train, val, test, val_g, test_g = split_groups(files, d, ("two", "cc_three"), ("five",))
    assert val_g == ["bb_two", "cc_three"] and test_g == ["ee_five"]
    assert {group_of(f, d) for f in train} == {"aa_one", "dd_four"}
    assert len(val) == 6 and len(test) == 3 and not set(train) & (set(val) | set(test))
    # no named voice present: a fixed automatic choice (at most a quarter of them), the same every time
    a = split_groups(files, d, ("nobody",))
    assert a[3] == split_groups(files, d, ("nobody",))[3] and len(a[3]) == 1
    # speaker sub-folders are voices too
    (tmp_path / "spk" / "p225").mkdir(parents=True)
    sf.write(tmp_path / "spk" / "p225" / "x.wav", speech[0][:8000], 16000)
    assert group_of(tmp_path / "spk" / "p225" / "x.wav", tmp_path / "spk") == "p225"


def test_heldout_mixes_are_fixed_and_use_the_given_noise(tmp_path, speech):
    files = audio_files(_voices(tmp_path, speech), "--clean")
    nd = tmp_path / "noise"
    nd.mkdir()
    sf.write(nd / "fan_01.flac", make_noise("pink", 20000, np.random.default_rng(1)) * 0.1, 16000)
    noise = audio_files(nd, "--noise")
    a = heldout_mixes(files, noise, 4, seed=7, snr=(0.0, 10.0))
    b = heldout_mixes(files, noise, 4, seed=7, snr=(0.0, 10.0))
    assert [x[0] for x in a] == [x[0] for x in b] and all(np.array_equal(x[1], y[1]) for x, y in zip(a, b))
    assert all("fan" in name for name, _, _ in a) and len({name.split("_")[0] for name, _, _ in a}) > 1
    for _, noisy, clean in a:
        snr = 10 * np.log10(np.sum(clean**2) / np.sum((noisy - clean) ** 2))
        assert -0.5 < snr < 10.5
    one = heldout_mixes(files[:1], None, 5, seed=7)  # one recording: reused with other noises
    assert len(one) == 5 and len({name for name, _, _ in one}) == 5
