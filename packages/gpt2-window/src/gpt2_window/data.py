"""Text for the GPT: a UTF-8 file (characters, or GPT-2 BPE when tiktoken works offline), uint16 token
shards (nanoGPT's train.bin / val.bin, or llm.c shards with their 1 KiB header), or the default corpus.

The default corpus is always there without a download: the Python standard library's own ``.py``
sources (ASCII files only, sorted by name, about 2 MB), found via ``sysconfig``. It differs a little
between Python versions but is fixed for a given interpreter.

Batches are random windows drawn with a generator the caller seeds, so a batch is a function of
(seed, step, micro) and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

DEFAULT_CORPUS_CHARS = 2_000_000
LLMC_MAGIC = 20240520  # llm.c token shards: 256 int32 header, then uint16 tokens
GPT2_VOCAB = 50257


# ----------------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------------


def _tiktoken_gpt2():
    """tiktoken's GPT-2 encoding, or an error message saying why it cannot be had offline."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed (the optional extra: `uv sync --all-packages --extra bpe`)"
    try:
        return tiktoken.get_encoding("gpt2"), ""
    except Exception as e:  # no cached encoding and no network
        return None, (
            f"tiktoken could not load the GPT-2 encoding offline ({type(e).__name__}: {e}); run once with "
            "network access or point TIKTOKEN_CACHE_DIR at a cached copy"
        )


@dataclass
class Tokenizer:
    """kind "char": one id per character of `chars`; "gpt2": tiktoken's GPT-2 BPE (ids < 50257)."""

    kind: str
    chars: str = ""
    vocab_size: int = 0
    _enc: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind == "char":
            self.vocab_size = len(self.chars)
            self._stoi = {c: i for i, c in enumerate(self.chars)}
        elif self.kind == "gpt2":
            self.vocab_size = GPT2_VOCAB
        else:
            raise ValueError(f"unknown tokenizer kind {self.kind!r}; use char or gpt2")

    @classmethod
    def from_text(cls, text: str) -> Tokenizer:
        return cls("char", "".join(sorted(set(text))))

    def _gpt2(self):
        if self._enc is None:
            self._enc, why = _tiktoken_gpt2()
            if self._enc is None:
                raise ValueError(
                    f"this model uses GPT-2 BPE tokens, but {why}; install tiktoken and cache gpt2"
                )
        return self._enc

    def encode(self, text: str) -> list[int]:
        """str -> token ids; characters the vocabulary lacks raise ValueError naming them."""
        if self.kind == "gpt2":
            return self._gpt2().encode_ordinary(text)
        missing = sorted({c for c in text if c not in self._stoi})
        if missing:
            raise ValueError(
                f"characters {''.join(missing)!r} are not in this model's vocabulary of {self.vocab_size}; "
                "use only characters from the training text"
            )
        return [self._stoi[c] for c in text]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "gpt2":
            return self._gpt2().decode([i for i in ids if i < GPT2_VOCAB])
        return "".join(self.chars[i] if i < len(self.chars) else "\ufffd" for i in ids)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "chars": self.chars}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tokenizer:
        return cls(d["kind"], d.get("chars", ""))


# ----------------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------------


def default_corpus(max_chars: int = DEFAULT_CORPUS_CHARS) -> str:
    """About max_chars of Python standard-library source (ASCII .py files, sorted by name)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            text = path.read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(f"# ---- {path.name} ----\n{text}")
        total += len(parts[-1])
        if total >= max_chars:
            break
    if total < 100_000:
        raise RuntimeError(f"the default corpus found only {total} characters of Python source in {stdlib}")
    return "".join(parts)[:max_chars]


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's content; missing, empty or non-UTF-8 files raise a clear error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist; pass a UTF-8 text file or token shards")
    if path.is_dir():
        raise ValueError(f"{path} is a folder without train.bin/val.bin token shards")
    raw = path.read_bytes()
    if not raw.strip():
        raise ValueError(f"data file {path} is empty; it needs text to train on")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"data file {path} is not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "convert it, e.g. `iconv -f latin1 -t utf-8`, or pass uint16 token shards (.bin)"
        ) from None


def _open_shard(path: Path) -> np.ndarray:
    """A uint16 token shard as a memmap; llm.c's 1 KiB header (magic 20240520) is skipped."""
    if path.stat().st_size == 0:
        raise ValueError(f"token shard {path} is empty")
    head = np.fromfile(path, dtype=np.int32, count=3)
    if len(head) == 3 and head[0] == LLMC_MAGIC:
        return np.memmap(path, dtype=np.uint16, mode="r", offset=1024, shape=(int(head[2]),))
    if path.stat().st_size % 2:
        raise ValueError(f"token shard {path} has an odd byte count; expected raw uint16 tokens")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _char_ids(text: str) -> tuple[np.ndarray, str]:
    """Character ids of text (vectorised) and the sorted characters they index."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    uniq, ids = np.unique(codes, return_inverse=True)
    return ids.astype(np.uint16 if len(uniq) < 65536 else np.int32), "".join(map(chr, uniq))


def _encode_chars(text: str, chars: str, source: str) -> np.ndarray:
    """Ids of text in a given character vocabulary (vectorised); unknown characters raise ValueError."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocab = np.frombuffer(chars.encode("utf-32-le"), dtype=np.uint32)
    order = np.argsort(vocab)
    pos = np.clip(np.searchsorted(vocab[order], codes), 0, len(vocab) - 1)
    ids = order[pos]
    bad = vocab[ids] != codes
    if bad.any():
        missing = "".join(sorted({chr(c) for c in codes[bad][:1000]}))
        raise ValueError(
            f"{source} has characters {missing!r} that the model's vocabulary lacks; "
            "evaluate on text written with the training text's characters"
        )
    return ids.astype(np.uint16 if len(vocab) < 65536 else np.int32)


# ----------------------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------------------


@dataclass
class TokenData:
    """Token arrays per split (each split a list of 1-D arrays: shards) and the tokenizer."""

    train: list[np.ndarray]
    val: list[np.ndarray]
    tokenizer: Tokenizer | None  # None: shards whose vocabulary is unknown (ids only)
    vocab_size: int
    source: str

    def num_tokens(self, split: str) -> int:
        return sum(len(a) for a in self._split(split))

    def _split(self, split: str) -> list[np.ndarray]:
        if split not in ("train", "val"):
            raise ValueError(f"split must be train or val, got {split!r}")
        return self.train if split == "train" else self.val

    def check_length(self, block: int) -> None:
        """Every split must hold at least one window of block + 1 tokens."""
        for split in ("train", "val"):
            longest = max((len(a) for a in self._split(split)), default=0)
            if longest < block + 1:
                raise ValueError(
                    f"the {split} split of {self.source} has only {longest} tokens in its longest "
                    f"shard, fewer than sequence_length + 1 = {block + 1}; "
                    "use a shorter --sequence_length or more data"
                )

    def batch(
        self,
        split: str,
        batch_size: int,
        block: int,
        generator: torch.Generator,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: x (B, T) int64 and y = x shifted by one, drawn with `generator` (CPU)."""
        arrays = [a for a in self._split(split) if len(a) > block]
        sizes = torch.tensor([len(a) - block for a in arrays], dtype=torch.float64)
        shard = torch.multinomial(sizes, batch_size, replacement=True, generator=generator)
        u = torch.rand(batch_size, generator=generator, dtype=torch.float64)
        xs, ys = [], []
        for s, r in zip(shard.tolist(), u.tolist()):
            a = arrays[s]
            i = int(r * (len(a) - block))
            chunk = torch.from_numpy(np.asarray(a[i : i + block + 1]).astype(np.int64))
            xs.append(chunk[:-1])
            ys.append(chunk[1:])
        x, y = torch.stack(xs), torch.stack(ys)
        if torch.device(device).type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)


def _split_90_10(ids: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    n = int(0.9 * len(ids))
    return [ids[:n]], [ids[n:]]


def _shard_files(path: Path) -> tuple[list[Path], list[Path]] | None:
    """(train shards, val shards) for a .bin file or a folder of them; None if path is not shards."""
    if path.is_file() and path.suffix == ".bin":
        return [path], []
    if path.is_dir():
        bins = sorted(path.glob("*.bin"))
        if not bins:
            raise ValueError(
                f"{path} is a folder without .bin token shards; expected train.bin and val.bin "
                "(nanoGPT) or *_train_*.bin / *_val_*.bin (llm.c), or pass a text file"
            )
        val = [p for p in bins if "val" in p.stem]
        train = [p for p in bins if p not in val]
        if not train:
            raise ValueError(f"{path} has validation shards but no training shard (e.g. train.bin)")
        return train, val
    return None


def load_data(path: str | Path | None = None, tokenizer: str | Tokenizer = "char") -> TokenData:
    """Load --data: None -> the default corpus; a text file; or uint16 token shards (.bin / a folder).

    tokenizer (text only): "char"; "gpt2" or "auto" (GPT-2 BPE: needs tiktoken and its encoding offline,
    else ValueError naming the fix; never a silent switch to characters); or a Tokenizer (e.g. from a
    checkpoint) whose vocabulary the text is encoded with, so ids match the trained model.
    """
    if isinstance(tokenizer, Tokenizer):
        fixed, tokenizer = tokenizer, tokenizer.kind
    else:
        fixed = None
    if tokenizer not in ("char", "gpt2", "auto"):
        raise ValueError(f"unknown tokenizer {tokenizer!r}; use char, gpt2 or auto")
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"data path {path} does not exist; pass a UTF-8 text file or token shards"
            )
        shards = _shard_files(path)
        if shards is not None:
            train_files, val_files = shards
            train = [_open_shard(p) for p in train_files]
            if val_files:
                val = [_open_shard(p) for p in val_files]
            else:
                if len(train) != 1:
                    raise ValueError(f"{path}: several training shards but no *val*.bin shard")
                train, val = _split_90_10(train[0])
            top = max(int(np.max(a)) for a in train + val if len(a)) + 1
            # uint16 shards hold GPT-2 ids in practice; the embedding must cover them whatever they are.
            tok = Tokenizer("gpt2") if top <= GPT2_VOCAB else None
            return TokenData(train, val, tok, max(top, GPT2_VOCAB if tok else top), str(path))
        text, source = read_text(path), str(path)
    else:
        text, source = default_corpus(), "default corpus (Python standard-library sources)"
    if fixed is not None and fixed.kind == "char":
        train, val = _split_90_10(_encode_chars(text, fixed.chars, source))
        return TokenData(train, val, fixed, fixed.vocab_size, source)
    if tokenizer in ("gpt2", "auto"):
        enc, why = _tiktoken_gpt2()
        if enc is not None:
            ids = np.array(enc.encode_ordinary(text), dtype=np.uint16)
            tok = Tokenizer("gpt2", _enc=enc)
            train, val = _split_90_10(ids)
            return TokenData(train, val, tok, tok.vocab_size, source)
        raise ValueError(f"GPT-2 BPE tokens asked for, but {why}; or use --tokenizer char")
    ids, chars = _char_ids(text)
    tok = Tokenizer("char", chars)
    train, val = _split_90_10(ids)
    return TokenData(train, val, tok, tok.vocab_size, source)
