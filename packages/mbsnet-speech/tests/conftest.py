"""Shared test data for mbsnet-speech: the pesq package's speech files in ../shared/data/speech."""

from pathlib import Path

import pytest
import soundfile as sf

SPEECH = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "speech"


def _read_speech(dtype: str):
    """(clean, noisy, fs): speech.wav and speech_bab_0dB.wav as dtype; skips when the data is absent."""
    if not (SPEECH / "speech.wav").exists():
        pytest.skip(f"shared speech data not found at {SPEECH}")
    clean, fs = sf.read(SPEECH / "speech.wav", dtype=dtype)
    noisy, _ = sf.read(SPEECH / "speech_bab_0dB.wav", dtype=dtype)
    return clean, noisy, fs


@pytest.fixture
def speech():
    """(clean, noisy, fs) as float32."""
    return _read_speech("float32")


@pytest.fixture
def speech_int16():
    """(clean, noisy, fs) as int16, the samples the pesq package's reference scores are for."""
    return _read_speech("int16")


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
