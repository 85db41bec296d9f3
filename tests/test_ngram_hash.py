"""Engram n-gram hashing: against a literal big-int transcription of spec §2.6, chunking, ranges, Flash sizes."""

from __future__ import annotations

import numpy as np
import pytest

from dsv41 import ngram_hash as N
from dsv41 import tokenizer as T
from dsv41.config import ConfigError, ModelConfig, engram_primes, preset

FLASH = ModelConfig()


def _flash_map() -> np.ndarray:
    """A stand-in for the release map: any map with Flash's vocab and 99,092 classes hashes the same way."""
    return (np.arange(FLASH.vocab_size, dtype=np.int64) * 7919) % FLASH.engram_compressed_vocab_size


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, N.NgramHasher(cfg, T.builtin_compressed_token_map()[0])


@pytest.fixture(scope="module")
def flash():
    return N.NgramHasher(FLASH, _flash_map())


def _reference(cfg: ModelConfig, token_map, ids, dead) -> np.ndarray:
    """Spec §2.6 steps 2-5 with Python ints, one position at a time (slow, obviously right)."""
    v = cfg.engram_compressed_vocab_size
    bound = max(1, ((2**63 - 1) // v) // 2)
    primes = engram_primes(cfg)
    pad = int(token_map[cfg.engram_pad_id])
    n_max = cfg.engram_max_ngram_size
    draws = [np.random.default_rng(10007 * layer).integers(0, bound, size=n_max, dtype=np.int64)
             for layer in cfg.engram_layer_ids]
    mult = [[int(x) * 2 + 1 for x in d] for d in draws]
    b, s = len(ids), len(ids[0])
    out = np.zeros((b, s, len(cfg.engram_layer_ids), cfg.engram_n_cols), dtype=np.int64)
    for bi in range(b):
        for p in range(s):
            toks, stopped = [], False
            for k in range(cfg.engram_max_ngram_size):
                stopped = stopped or p - k < 0 or bool(dead[bi][p - k])
                toks.append(pad if stopped else int(token_map[ids[bi][p - k]]))
            for li in range(len(cfg.engram_layer_ids)):
                flat = [q for per_n in primes[li] for q in per_n]
                products = [t * m for t, m in zip(toks, mult[li])]
                assert all(0 <= x < 2**63 for x in products)  # fits int64
                col, offset, rolling = 0, 0, products[0]
                for n in range(2, cfg.engram_max_ngram_size + 1):
                    rolling ^= products[n - 1]
                    for _head in range(cfg.engram_n_heads):
                        out[bi, p, li, col] = rolling % flat[col] + offset
                        offset += flat[col]
                        col += 1
    return out


def _random_case(cfg, rng, b, s, dead_rate=0.1):
    ids = rng.integers(0, cfg.vocab_size, size=(b, s))
    dead = rng.random((b, s)) < dead_rate
    return ids, dead


def test_flash_table_sizes(flash):
    assert flash.table_rows == (384006168, 384016682)
    assert flash.table_rows == FLASH.engram_num_embeddings
    assert flash.primes.shape == flash.offsets.shape == (2, 24)
    assert len(set(flash.primes.ravel().tolist())) == 48 and flash.primes.min() > 15_999_999


def test_multipliers(flash):
    bound = N.multiplier_bound(99092)
    assert bound == (np.iinfo(np.int64).max // 99092) // 2
    m = flash.multipliers
    assert m.shape == (2, 4) and m.dtype == np.int64
    assert np.all(m % 2 == 1) and np.all(m >= 1) and np.all(m < 2 * bound)
    assert not np.array_equal(m[0], m[1])  # per-layer seeds
    # the largest class times the largest multiplier stays inside int64
    assert (99092 - 1) * int(m.max()) < 2**63
    assert np.array_equal(m[0], np.random.default_rng(10007).integers(0, bound, size=4, dtype=np.int64) * 2 + 1)


@pytest.mark.parametrize("which", ["tiny", "flash"])
def test_matches_reference(which, tiny, flash):
    rng = np.random.default_rng(0)
    if which == "tiny":
        cfg, h = tiny
    else:
        cfg, h = FLASH, flash
    ids, dead = _random_case(cfg, rng, 2, 23)
    dead[0, 0] = True  # a dead first token
    dead[1, 5:8] = True  # a dead span
    got = h.hash_ids(ids, dead_mask=dead)
    assert got.shape == (2, 23, len(cfg.engram_layer_ids), cfg.engram_n_cols) and got.dtype == np.int64
    assert np.array_equal(got, _reference(cfg, h.token_map, ids, dead))


def test_rows_inside_their_buckets(tiny):
    cfg, h = tiny
    ids, dead = _random_case(cfg, np.random.default_rng(1), 4, 300)
    rows = h.hash_ids(ids, dead_mask=dead)
    lo, hi = h.offsets, h.offsets + h.primes  # [L, n_cols]
    assert np.all(rows >= lo) and np.all(rows < hi)
    assert np.all(rows < np.array(cfg.engram_num_embeddings)[:, None])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunks_equal_whole(tiny, seed):
    cfg, h = tiny
    rng = np.random.default_rng(seed)
    ids, dead = _random_case(cfg, rng, 3, 64, dead_rate=0.15)
    whole = h.hash_ids(ids, dead_mask=dead)
    cuts = sorted(set(rng.integers(1, 64, size=6).tolist()) | {1, 2, 63})  # includes 1-token (decode) steps
    history, pieces, start = h.initial_history(3), [], 0
    for end in [*cuts, 64]:
        rows, history = h.hash_step(ids[:, start:end], history, dead[:, start:end])
        pieces.append(rows)
        start = end
    assert np.array_equal(np.concatenate(pieces, axis=1), whole)
    # the same through hash_ids with an explicit start position and a history rebuilt from the prefix
    k = cuts[2]
    hist = h.history_from_ids(ids[:, :k], dead[:, :k])
    assert np.array_equal(h.hash_ids(ids[:, k:], start_pos=k, history=hist, dead_mask=dead[:, k:]), whole[:, k:])


def test_empty_chunk_keeps_history(tiny):
    cfg, h = tiny
    hist = h.history_from_ids(np.array([[5, 6, 7, 8]]))
    rows, new = h.hash_step(np.zeros((1, 0), dtype=np.int64), hist)
    assert rows.shape == (1, 0, 2, cfg.engram_n_cols) and np.array_equal(new, hist)
    assert np.array_equal(hist, h.token_map[[[6, 7, 8]]])


def test_history_before_start(tiny):
    cfg, h = tiny
    ids = np.array([[11, 12, 13]])
    short = h.history_from_ids(ids[:, :1])
    assert short.tolist() == [[N.NO_TOKEN, N.NO_TOKEN, int(h.token_map[11])]]
    # start_pos masks history slots before position 0 even if they hold real classes
    fake = np.array([[3, 4, int(h.token_map[11])]])
    assert np.array_equal(h.hash_ids(ids[:, 1:], start_pos=1, history=fake), h.hash_ids(ids)[:, 1:])


def test_dead_token_acts_like_a_sequence_start(tiny):
    cfg, h = tiny
    ids, _ = _random_case(cfg, np.random.default_rng(3), 2, 40)
    dead = np.zeros_like(ids, dtype=bool)
    dead[:, 17] = True
    whole = h.hash_ids(ids, dead_mask=dead)
    assert np.array_equal(whole[:, 18:], h.hash_ids(ids[:, 18:]))
    assert not np.array_equal(whole[:, 18:21], h.hash_ids(ids)[:, 18:21])  # the mask mattered
    # a dead position itself hashes the all-pad n-grams
    pad_only = h.hash_ids(np.full((1, 1), cfg.engram_pad_id))
    assert np.array_equal(whole[:, 17], np.broadcast_to(pad_only[0, 0], whole[:, 17].shape))


def test_errors(tiny):
    cfg, h = tiny
    with pytest.raises(ValueError, match="history"):
        h.hash_ids(np.zeros((1, 4), dtype=np.int64), start_pos=3)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        h.hash_ids(np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="token ids"):
        h.hash_ids(np.array([[cfg.vocab_size]]))
    with pytest.raises(ValueError, match="history must be"):
        h.hash_step(np.zeros((2, 3), dtype=np.int64), h.initial_history(1))
    with pytest.raises(ConfigError, match="classes"):
        N.NgramHasher(cfg, np.zeros(cfg.vocab_size, dtype=np.int64))
    with pytest.raises(ConfigError, match="covers"):
        N.NgramHasher(cfg, T.builtin_compressed_token_map()[0][:-1])
    assert not h.token_map.flags.writeable and not h.offsets.flags.writeable


@pytest.mark.parametrize("which", ["tiny", "flash"])
def test_device_rows_equal_the_hosts(which, tiny, flash):
    """`device_rows` (uint32 halves, the modulus in 7-bit digits) gives `hash_step`'s int64 row ids exactly, at
    Flash's sizes too (primes up to 2^24, products up to 2^63), with histories holding DEAD and NO_TOKEN."""
    import jax
    import jax.numpy as jnp

    hasher = tiny[1] if which == "tiny" else flash
    cfg = tiny[0] if which == "tiny" else FLASH
    rng = np.random.default_rng(3)
    ids = rng.integers(0, cfg.vocab_size, size=(16, 5))
    hist = rng.integers(0, cfg.engram_compressed_vocab_size, size=(16, hasher.history_len))
    hist[0], hist[1, 0], hist[2, -1], hist[3, :2] = N.NO_TOKEN, N.DEAD, N.DEAD, N.NO_TOKEN
    hist[4, 0] = hasher.pad
    consts = jax.tree_util.tree_map(jnp.asarray, N.device_constants(hasher))
    got = jax.jit(N.device_rows)(consts, jnp.asarray(ids, jnp.int32), jnp.asarray(hist, jnp.int32))
    want, _ = hasher.hash_step(ids, hist)
    assert got.dtype == jnp.int32 and np.array_equal(np.asarray(got), want)
