"""Training tokens: a synthetic Markov corpus, byte-level text files and pre-tokenised .bin files.

A source is read into one token stream; its last `val_fraction` is the held-out validation split.
A `TokenDataset` draws a step's batch as B windows of S + 1 consecutive tokens (inputs and their
next-token targets) at offsets that depend only on (seed, split, step), so any process asked for
step t gets the same rows, and a resumed run continues with the batches it would have seen.

Legend: B sequences in a step's batch, S sequence length, K synthetic alphabet size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from disagmoe.config import DataConfig

# The synthetic corpus is the same for every run (its seed is not the training seed).
SYNTHETIC_TOKENS = 1 << 20
SYNTHETIC_SEED = 20261130
SYNTHETIC_ALPHABET = b"abcdefghijklmnop"  # K = 16 byte values: the corpus reads as text
SYNTHETIC_LETTERS = len(SYNTHETIC_ALPHABET)
SYNTHETIC_SUCCESSOR_PROBS = (0.85, 0.1, 0.05)  # each 2-token context has 3 possible next tokens
SYNTHETIC_CHAINS = 256  # independent chains generated side by side, then concatenated

_SPLIT_IDS = {"train": 0, "val": 1}


def synthetic_corpus(
    num_tokens: int = SYNTHETIC_TOKENS, seed: int = SYNTHETIC_SEED, alphabet_size: int = SYNTHETIC_LETTERS
) -> np.ndarray:
    """Tokens from a fixed random order-2 Markov chain over K = `alphabet_size` token ids.

    The context of a token is (class of the token two back, previous token), a class being an id
    mod 16; each context has three successors with probabilities 0.85 / 0.1 / 0.05, so the next
    token is nearly determined by the last two: about 0.5 nats per token. K = 16 gives the letters
    a-p as bytes (the corpus reads as text; vocab 256); a larger K gives the ids 0..K-1, which a
    MoE needs: with 16 distinct tokens its first lesson (only 16 ids occur) is one hidden vector
    shared by every token, and the router sends every token to the same experts.
    """
    rng = np.random.default_rng(seed)
    k, classes = alphabet_size, min(alphabet_size, SYNTHETIC_LETTERS)
    successors_CKN = np.stack(
        [rng.permutation(k)[: len(SYNTHETIC_SUCCESSOR_PROBS)] for _ in range(classes * k)]
    ).reshape(classes, k, -1)
    cumulative = np.cumsum(SYNTHETIC_SUCCESSOR_PROBS)
    length = -(-num_tokens // SYNTHETIC_CHAINS)
    chains = np.empty((SYNTHETIC_CHAINS, length), dtype=np.int64)
    chains[:, :2] = rng.integers(0, k, size=(SYNTHETIC_CHAINS, 2))
    choice = np.searchsorted(cumulative, rng.random((SYNTHETIC_CHAINS, length)) * cumulative[-1])
    for t in range(2, length):
        chains[:, t] = successors_CKN[chains[:, t - 2] % classes, chains[:, t - 1], choice[:, t]]
    tokens = chains.reshape(-1)[:num_tokens]
    if k == SYNTHETIC_LETTERS:
        return np.frombuffer(SYNTHETIC_ALPHABET, dtype=np.uint8)[tokens]
    return tokens.astype(np.uint16 if k <= 1 << 16 else np.uint32)


def read_text_tokens(path: Path) -> np.ndarray:
    """A text file's bytes, one token per byte (vocabulary 256)."""
    _check_file(path)
    return np.frombuffer(path.read_bytes(), dtype=np.uint8)


def read_token_file(path: Path, dtype: str) -> np.ndarray:
    """A flat binary file of token ids (uint16 or uint32, native byte order), memory-mapped."""
    _check_file(path)
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise ValueError(
            f"token file {path} has {size} bytes, not a multiple of {itemsize} ({dtype}); "
            f"set data.token_dtype to the dtype the file was written with"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise ValueError(
            f"data file {path} does not exist; set data.path to an existing file "
            f"(or data.kind=synthetic for the built-in corpus)"
        )
    if path.stat().st_size == 0:
        raise ValueError(f"data file {path} is empty; point data.path at a file with tokens in it")


def load_token_stream(data: DataConfig, vocab_size: int) -> np.ndarray:
    """The whole token stream of a data source, checked against the model's vocabulary."""
    if data.kind == "synthetic":
        if data.synthetic_alphabet > vocab_size:
            raise ValueError(
                f"data.synthetic_alphabet={data.synthetic_alphabet} exceeds the model's vocab_size "
                f"{vocab_size}; set data.synthetic_alphabet to at most {vocab_size}"
            )
        tokens = synthetic_corpus(alphabet_size=data.synthetic_alphabet)
    elif data.kind == "text":
        tokens = read_text_tokens(Path(str(data.path)))
    else:
        tokens = read_token_file(Path(str(data.path)), data.token_dtype)
    if len(tokens) == 0:
        raise ValueError(f"data source {data.path or data.kind} has no tokens")
    largest = int(tokens.max())
    if largest >= vocab_size:
        raise ValueError(
            f"data holds token id {largest} but the model's vocab_size is {vocab_size}; "
            f"use a model whose vocabulary covers the data (byte-level text needs vocab_size >= 256)"
        )
    return tokens


@dataclass(frozen=True)
class TokenSplits:
    train: np.ndarray
    val: np.ndarray | None  # None when data.val_fraction is 0


def split_tokens(tokens: np.ndarray, val_fraction: float, seq_len: int, source: str) -> TokenSplits:
    """Hold out the last `val_fraction` of the stream; both splits must fit one sequence."""
    need = seq_len + 1
    num_val = int(len(tokens) * val_fraction)
    train, val = tokens[: len(tokens) - num_val], tokens[len(tokens) - num_val :]
    if len(train) < need:
        raise ValueError(
            f"{source} has {len(train)} training tokens, fewer than one sequence needs "
            f"(seq_len + 1 = {need}); use a longer file or a smaller seq_len"
        )
    if val_fraction > 0 and len(val) < need:
        raise ValueError(
            f"{source}: the validation split (data.val_fraction={val_fraction}) has {len(val)} "
            f"tokens, fewer than one sequence needs (seq_len + 1 = {need}); raise "
            f"data.val_fraction, use a longer file, or set data.val_fraction=0 to skip validation"
        )
    return TokenSplits(train=train, val=val if val_fraction > 0 else None)


def load_splits(data: DataConfig, vocab_size: int, seq_len: int) -> TokenSplits:
    tokens = load_token_stream(data, vocab_size)
    return split_tokens(tokens, data.val_fraction, seq_len, data.path or "synthetic corpus")


class TokenDataset:
    """Deterministic batches of B windows of S + 1 tokens from one split of a token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, split: str):
        assert len(tokens) >= seq_len + 1, "split_tokens guarantees one full sequence"
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.split_id = _SPLIT_IDS[split]

    def row_starts(self, step: int) -> np.ndarray:
        """Start offsets of the B windows of `step` (a pure function of seed, split and step)."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, self.split_id, step])))
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def rows(self, step: int, rows: slice) -> torch.Tensor:
        """Rows `rows` of step `step`'s batch as int64 [b, S + 1]; only those rows are read."""
        starts = self.row_starts(step)[rows]
        windows = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1]) for s in starts])
        return torch.from_numpy(windows.astype(np.int64))

    def batch(self, step: int) -> torch.Tensor:
        """The whole batch of `step`, int64 [B, S + 1]."""
        return self.rows(step, slice(None))
