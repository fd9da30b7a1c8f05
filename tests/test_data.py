"""Data sources, the validation split and deterministic batches (disagmoe/data.py)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from disagmoe.config import DataConfig
from disagmoe.data import (
    SYNTHETIC_ALPHABET,
    SYNTHETIC_SUCCESSOR_PROBS,
    TokenDataset,
    load_splits,
    load_token_stream,
    split_tokens,
    synthetic_corpus,
)


def test_synthetic_corpus_is_fixed_and_uses_the_alphabet():
    a, b = synthetic_corpus(50_000), synthetic_corpus(50_000)
    assert np.array_equal(a, b)
    assert set(np.unique(a).tolist()) <= set(SYNTHETIC_ALPHABET)
    assert len(a) == 50_000


def test_synthetic_corpus_next_token_is_nearly_determined_by_two_before():
    corpus = synthetic_corpus(200_000).tolist()
    contexts = Counter(zip(corpus, corpus[1:]))
    triples = Counter(zip(corpus, corpus[1:], corpus[2:]))
    n = sum(triples.values())
    empirical = -sum(c / n * math.log(c / contexts[t[:2]]) for t, c in triples.items())
    designed = -sum(p * math.log(p) for p in SYNTHETIC_SUCCESSOR_PROBS)
    # chain boundaries add a little; an untrained byte model sits at ln(256)
    assert empirical == pytest.approx(designed, abs=0.05)
    assert empirical < math.log(256) / 5


def test_a_larger_synthetic_alphabet_uses_its_ids_with_the_same_order_2_structure():
    k = 256
    corpus = synthetic_corpus(200_000, alphabet_size=k)
    assert np.array_equal(corpus, synthetic_corpus(200_000, alphabet_size=k))
    assert len(np.unique(corpus)) > 0.9 * k and int(corpus.max()) < k
    ids = corpus.tolist()
    contexts = Counter((a % 16, b) for a, b in zip(ids, ids[1:]))
    triples = Counter((a % 16, b, c) for a, b, c in zip(ids, ids[1:], ids[2:]))
    n = sum(triples.values())
    empirical = -sum(c / n * math.log(c / contexts[t[:2]]) for t, c in triples.items())
    designed = -sum(p * math.log(p) for p in SYNTHETIC_SUCCESSOR_PROBS)
    assert empirical == pytest.approx(designed, abs=0.1)  # few samples per context bias it low


def test_a_synthetic_alphabet_larger_than_the_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="synthetic_alphabet"):
        load_token_stream(DataConfig(synthetic_alphabet=512), vocab_size=256)


def test_text_file_bytes_are_tokens(tmp_path):
    text = "hello, MoE world\n" * 20
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    tokens = load_token_stream(DataConfig(kind="text", path=str(path)), vocab_size=256)
    assert tokens.tolist() == list(text.encode())


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_round_trips(tmp_path, dtype):
    ids = np.random.default_rng(0).integers(0, 1000, size=500).astype(dtype)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    tokens = load_token_stream(DataConfig(kind="tokens", path=str(path), token_dtype=dtype), vocab_size=1000)
    assert np.array_equal(np.asarray(tokens), ids)


def test_token_ids_beyond_the_vocabulary_are_rejected(tmp_path):
    path = tmp_path / "tokens.bin"
    np.array([1, 2, 300], dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="vocab_size is 256"):
        load_token_stream(DataConfig(kind="tokens", path=str(path)), vocab_size=256)


def test_token_file_of_odd_size_names_the_dtype(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="token_dtype"):
        load_token_stream(DataConfig(kind="tokens", path=str(path)), vocab_size=256)


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "does not exist; set data.path"), (b"", "is empty"), (b"x" * 64, "fewer than one sequence")],
    ids=["missing", "empty", "shorter-than-a-sequence"],
)
def test_bad_data_files_raise_value_error_with_the_fix(tmp_path, content, match):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        load_splits(DataConfig(kind="text", path=str(path), val_fraction=0.0), vocab_size=256, seq_len=64)


def test_validation_split_is_the_tail_and_must_fit_a_sequence():
    tokens = np.arange(1000) % 256
    splits = split_tokens(tokens, val_fraction=0.2, seq_len=16, source="t")
    assert np.array_equal(np.concatenate([splits.train, splits.val]), tokens)
    assert len(splits.val) == 200
    assert split_tokens(tokens, val_fraction=0.0, seq_len=16, source="t").val is None
    with pytest.raises(ValueError, match="val_fraction=0 to skip"):
        split_tokens(tokens, val_fraction=0.01, seq_len=16, source="t")


def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = synthetic_corpus(20_000)
    make = lambda seed: TokenDataset(tokens, seq_len=32, batch_size=8, seed=seed, split="train")  # noqa: E731
    a, b = make(0), make(0)
    assert torch.equal(a.batch(5), b.batch(5))
    assert not torch.equal(a.batch(5), a.batch(6))
    assert not torch.equal(a.batch(5), make(1).batch(5))
    val = TokenDataset(tokens, seq_len=32, batch_size=8, seed=0, split="val")
    assert not torch.equal(a.batch(5), val.batch(5))


def test_batch_rows_are_windows_of_the_stream_and_read_independently():
    tokens = synthetic_corpus(20_000)
    data = TokenDataset(tokens, seq_len=32, batch_size=8, seed=3, split="train")
    batch = data.batch(7)
    assert batch.shape == (8, 33) and batch.dtype == torch.int64
    for row, start in zip(batch, data.row_starts(7)):
        assert row.tolist() == tokens[start : start + 33].tolist()
    assert torch.equal(data.rows(7, slice(2, 6)), batch[2:6])
