"""Shared test data for mbsnet-speech: the pesq package's speech files in ../shared/data/speech."""

from pathlib import Path

import pytest
import soundfile as sf

SPEECH = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "speech"


@pytest.fixture
def speech():
    """(clean, noisy, fs): speech.wav and speech_bab_0dB.wav as float32; skips when the data is absent."""
    if not (SPEECH / "speech.wav").exists():
        pytest.skip(f"shared speech data not found at {SPEECH}")
    clean, fs = sf.read(SPEECH / "speech.wav", dtype="float32")
    noisy, _ = sf.read(SPEECH / "speech_bab_0dB.wav", dtype="float32")
    return clean, noisy, fs


@pytest.fixture
def make_voicebank(speech):
    """make_voicebank(root, n=3): a VoiceBank+DEMAND tree (clean_*/ noisy_*/, same names) of n clips."""
    clean, noisy, fs = speech

    def make(root: Path, n: int = 3) -> Path:
        for split in ("trainset_wav", "testset_wav"):
            (root / f"clean_{split}").mkdir(parents=True)
            (root / f"noisy_{split}").mkdir(parents=True)
            step = len(clean) // n
            for i in range(n):
                sl = slice(i * step, (i + 1) * step)
                sf.write(root / f"clean_{split}" / f"p{i:03d}.wav", clean[sl], fs)
                sf.write(root / f"noisy_{split}" / f"p{i:03d}.wav", noisy[sl], fs)
        return root

    return make
