"""Data: tokenizers, the default corpus, token shards, deterministic batches and clear errors."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gpt2_window.data import LLMC_MAGIC, Tokenizer, default_corpus, load_data, read_text
from memfit.train.loop import step_generator


def test_char_tokenizer_round_trip_and_unknown_characters():
    tok = Tokenizer.from_text("hello world\n")
    assert tok.vocab_size == len(set("hello world\n"))
    assert tok.decode(tok.encode("low hell")) == "low hell"
    with pytest.raises(ValueError, match="'z'.*not in this model's vocabulary"):
        tok.encode("zoo")
    assert Tokenizer.from_dict(tok.to_dict()) == tok


def test_default_corpus_is_offline_deterministic_python_source():
    a = default_corpus()
    assert a == default_corpus()
    assert len(a) == 2_000_000
    assert a.isascii()
    assert "def " in a and "import " in a
    data = load_data(None)
    assert data.tokenizer.kind == "char"
    assert data.num_tokens("train") == 1_800_000 and data.num_tokens("val") == 200_000
    # ids decode back to the corpus
    assert data.tokenizer.decode(data.val[0][:500]) == a[1_800_000:1_800_500]


def test_text_file_with_fixed_vocabulary_gives_the_same_ids(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcabcabd" * 50, encoding="utf-8")
    first = load_data(path)
    again = load_data(path, first.tokenizer)
    assert np.array_equal(first.train[0], again.train[0])
    other = tmp_path / "o.txt"
    other.write_text("abcx" * 40, encoding="utf-8")
    with pytest.raises(ValueError, match="'x'.*vocabulary lacks"):
        load_data(other, first.tokenizer)


def test_batches_are_windows_of_the_data_and_deterministic(tmp_path):
    path = tmp_path / "t.txt"
    text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(5000))
    path.write_text(text, encoding="utf-8")
    data = load_data(path)
    x, y = data.batch("train", 8, 16, step_generator(3, 10, 1))
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    train = data.tokenizer.decode(data.train[0])
    for row in x:
        assert data.tokenizer.decode(row.tolist()) in train
    x2, _ = data.batch("train", 8, 16, step_generator(3, 10, 1))
    x3, _ = data.batch("train", 8, 16, step_generator(3, 11, 1))
    assert torch.equal(x, x2)
    assert not torch.equal(x, x3)


def test_nanogpt_and_llmc_token_shards(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 50257, 4000).astype(np.uint16)
    val = rng.integers(0, 50257, 1000).astype(np.uint16)
    nano = tmp_path / "nano"
    nano.mkdir()
    train.tofile(nano / "train.bin")
    val.tofile(nano / "val.bin")
    data = load_data(nano)
    assert data.num_tokens("train") == 4000 and data.num_tokens("val") == 1000
    assert data.vocab_size == 50257
    assert np.array_equal(data.val[0], val)

    llmc = tmp_path / "llmc"
    llmc.mkdir()
    for name, arr in (("tok_train_000001.bin", train), ("tok_val_000000.bin", val)):
        header = np.zeros(256, dtype=np.int32)
        header[:3] = (LLMC_MAGIC, 1, len(arr))
        with open(llmc / name, "wb") as f:
            f.write(header.tobytes())
            f.write(arr.tobytes())
    data2 = load_data(llmc)
    assert np.array_equal(np.asarray(data2.train[0]), train)
    assert np.array_equal(np.asarray(data2.val[0]), val)

    single = load_data(nano / "train.bin")  # one file: 90/10 split
    assert single.num_tokens("train") == 3600 and single.num_tokens("val") == 400


def test_bad_data_raises_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_data(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_data(empty)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8.*0xe9"):
        read_text(latin)
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(ValueError, match="without .bin token shards"):
        load_data(folder)
    short = tmp_path / "short.txt"
    short.write_text("abc" * 10)
    with pytest.raises(ValueError, match="fewer than sequence_length"):
        load_data(short).check_length(64)


@pytest.mark.skipif(importlib.util.find_spec("tiktoken") is not None, reason="tiktoken is installed here")
def test_bpe_without_tiktoken_says_so(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("some text " * 100)
    for choice in ("gpt2", "auto"):  # no silent switch to characters
        with pytest.raises(ValueError, match="tiktoken is not installed.*--extra bpe.*--tokenizer char"):
            load_data(path, choice)
    assert load_data(path, "char").tokenizer.kind == "char"  # characters when asked for
