import time

import pytest

pytest.importorskip("memfit.mamba", reason="memfit.mamba (the chunked Mamba block) is not installed yet")

from mbsnet_speech import eval, train  # noqa: E402


@pytest.mark.slow
def test_short_training_improves_pesq_on_unseen_pairs(tmp_path):
    """A few minutes of CPU training on generated pairs beats the noisy input on held-out pairs."""
    t0 = time.perf_counter()
    train.main(
        [
            "--config",
            "tiny",
            "--channels",
            "32",
            "--batch_size",
            "4",
            "--seconds",
            "1.0",
            "--steps",
            "300",
            "--lr",
            "2e-3",
            "--save_every",
            "0",
            "--no_progress",
            "--log_every",
            "50",
            "--runs_dir",
            str(tmp_path),
            "--run_name",
            "learn",
        ]
    )
    t_train = time.perf_counter() - t0
    summary = eval.main(
        ["--ckpt", str(tmp_path / "mbsnet-speech" / "learn"), "--pairs", "12", "--seconds", "3"]
    )
    print(
        f"\ntrain {t_train:.0f} s; PESQ-wb {summary['noisy/pesq_wb']:.3f} -> "
        f"{summary['enhanced/pesq_wb']:.3f} "
        f"(delta {summary['delta/pesq_wb']:+.3f}); SI-SDR delta {summary['delta/si_sdr']:+.2f} dB"
    )
    assert summary["n_failed"] == 0
    assert summary["delta/pesq_wb"] > 0
