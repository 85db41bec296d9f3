"""Host-side Engram n-gram hashing (spec §2.6 steps 2-5), numpy int64.

For each position p and Engram layer, the n-grams ending at p (n = 2..max_ngram) are hashed into row ids of
that layer's embedding table, one row per (n, head): `n_cols = (max_ngram - 1) * n_heads` columns, n-gram-size
major and head minor.

  t_k = class(p - k), k = 0..max_ngram-1  (compressed ids, `tokenizer.build_compressed_token_map`)
        -> the compressed pad once p - k < 0 or a DEAD (image) token sits at any lookback <= k
  P_k = t_k * M[layer, k]                 (odd multipliers; t * M < 2^63 by construction, so no overflow)
  R_1 = P_0 ^ P_1, R_{k} = R_{k-1} ^ P_k
  row[n, h] = R_{n-1} mod prime[layer][n-2][h] + offset[layer][n-2][h]

Sequences are hashed in pieces (chunked prefill, decode) by carrying a `history` of the last max_ngram-1
compressed ids: `hash_step` is a pure function returning the hashes and the next history, and hashing a sequence
in pieces equals hashing it whole.
"""

from __future__ import annotations

import numpy as np

from dsv41.config import ConfigError, ModelConfig, engram_primes

DEAD = -1  # a token that takes no part in any n-gram (inside an image span): look-back stops there
NO_TOKEN = -2  # history slot before the start of the sequence: look-back stops there too

_INT64_MAX = np.iinfo(np.int64).max


def multiplier_bound(compressed_vocab: int) -> int:
    """B: multipliers are 2*[0, B) + 1, so that (compressed_vocab - 1) * multiplier fits int64."""
    return max(1, (_INT64_MAX // compressed_vocab) // 2)


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """Odd multipliers int64 [n_engram_layers, max_ngram], one per (layer, lookback), from a per-layer seed."""
    bound = multiplier_bound(compressed_vocab)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return np.stack(rows).astype(np.int64) if rows else np.zeros((0, max_ngram), np.int64)


class NgramHasher:
    """Hashes token ids into Engram table rows for every Engram layer of `cfg`.

    Immutable after construction (its arrays are read-only); the per-sequence state is the `history` array that
    `hash_step` takes and returns.

    Attributes:
      token_map:   int64 [vocab] id -> compressed class.
      pad:         compressed class of cfg.engram_pad_id.
      multipliers: int64 [L, max_ngram]  (L = number of Engram layers).
      primes:      int64 [L, n_cols] bucket moduli, n-gram-size major, head minor.
      offsets:     int64 [L, n_cols] first row of each bucket range (exclusive cumsum of that layer's primes).
    """

    def __init__(self, cfg: ModelConfig, token_map: np.ndarray) -> None:
        token_map = np.asarray(token_map)
        if token_map.ndim != 1 or not np.issubdtype(token_map.dtype, np.integer):
            raise ValueError(f"token_map must be a 1-D integer array, got {token_map.dtype} {token_map.shape}")
        if token_map.shape[0] != cfg.vocab_size:
            raise ConfigError(f"token_map covers {token_map.shape[0]} ids, but vocab_size is {cfg.vocab_size}")
        n_classes = int(token_map.max()) + 1 if token_map.size else 0
        if token_map.min(initial=0) < 0 or n_classes != cfg.engram_compressed_vocab_size:
            # every multiplier derives from this size: a mismatch would silently rehash the whole table
            raise ConfigError(f"token_map has {n_classes} classes, but engram_compressed_vocab_size is "
                              f"{cfg.engram_compressed_vocab_size} (was the map built with the model's tokenizer?)")
        self.max_ngram = cfg.engram_max_ngram_size
        self.n_heads = cfg.engram_n_heads
        self.layer_ids = tuple(cfg.engram_layer_ids)
        self.n_cols = cfg.engram_n_cols
        self.token_map = token_map.astype(np.int64)
        self.pad = int(self.token_map[cfg.engram_pad_id])
        self.multipliers = hash_multipliers(self.layer_ids, self.max_ngram, cfg.engram_compressed_vocab_size)
        primes = np.array(engram_primes(cfg), dtype=np.int64).reshape(len(self.layer_ids), self.n_cols)
        self.primes = primes
        self.offsets = np.cumsum(primes, axis=1) - primes
        self.table_rows = tuple(int(r) for r in primes.sum(axis=1))
        for i, layer in enumerate(self.layer_ids):
            if self.table_rows[i] > cfg.engram_num_embeddings[i]:
                raise ConfigError(f"Engram layer {layer}: buckets need {self.table_rows[i]} rows, "
                                  f"table has {cfg.engram_num_embeddings[i]}")
        for a in (self.token_map, self.multipliers, self.primes, self.offsets):
            a.setflags(write=False)

    @property
    def history_len(self) -> int:
        return self.max_ngram - 1

    def initial_history(self, batch: int) -> np.ndarray:
        """History int64 [batch, max_ngram-1] of fresh sequences (nothing before position 0)."""
        return np.full((batch, self.history_len), NO_TOKEN, dtype=np.int64)

    def compress(self, ids: np.ndarray, dead_mask: np.ndarray | None = None) -> np.ndarray:
        """Compressed classes int64 [B, S]; DEAD where dead_mask (bool [B, S]) is True."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.token_map.shape[0]):
            raise ValueError(f"token ids must lie in [0, {self.token_map.shape[0]}), "
                             f"got range [{ids.min()}, {ids.max()}]")
        out = self.token_map[ids]
        if dead_mask is not None:
            dead_mask = np.asarray(dead_mask, dtype=bool)
            if dead_mask.shape != ids.shape:
                raise ValueError(f"dead_mask shape {dead_mask.shape} != ids shape {ids.shape}")
            out = np.where(dead_mask, DEAD, out)
        return out

    def hash_step(self, ids: np.ndarray, history: np.ndarray,
                  dead_mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Hashes the next S tokens of B sequences.

        ids: int [B, S]; history: int64 [B, max_ngram-1] from `initial_history` or the previous call;
        dead_mask: bool [B, S] or None.
        Returns (rows int64 [B, S, n_engram_layers, n_cols], next history int64 [B, max_ngram-1]).
        """
        ids = np.asarray(ids)
        if ids.ndim != 2:
            raise ValueError(f"ids must be [batch, seq], got shape {ids.shape}")
        b, s = ids.shape
        history = np.asarray(history, dtype=np.int64)
        if history.shape != (b, self.history_len):
            raise ValueError(f"history must be [{b}, {self.history_len}], got {history.shape}")
        if history.size and history.min() < NO_TOKEN:
            raise ValueError(f"history holds {history.min()}: only classes, DEAD={DEAD} or NO_TOKEN={NO_TOKEN}")
        ext = np.concatenate([history, self.compress(ids, dead_mask)], axis=1)  # [B, H+S]
        h = self.history_len
        tokens = np.empty((b, s, self.max_ngram), dtype=np.int64)
        blocked = np.zeros((b, s), dtype=bool)
        for k in range(self.max_ngram):
            src = ext[:, h - k: h - k + s]  # class at position p - k
            blocked |= src < 0  # DEAD or before the start: this and every longer look-back is pad
            tokens[..., k] = np.where(blocked, self.pad, src)
        rows = self._rows(tokens)
        return rows, ext[:, ext.shape[1] - h:].copy()

    def hash_ids(self, ids: np.ndarray, start_pos: int = 0, history: np.ndarray | None = None,
                 dead_mask: np.ndarray | None = None) -> np.ndarray:
        """Row ids int64 [B, S, n_engram_layers, n_cols] for tokens at positions start_pos..start_pos+S-1.

        Without `history`, only start_pos == 0 is meaningful (earlier tokens unknown); with it, `start_pos`
        additionally blocks look-back before position 0 (for histories that were padded with real-looking ids).
        """
        ids = np.asarray(ids)
        if ids.ndim != 2:
            raise ValueError(f"ids must be [batch, seq], got shape {ids.shape}")
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        if history is None:
            if start_pos != 0:
                raise ValueError(f"start_pos={start_pos} needs the history of the {self.history_len} previous "
                                 "tokens (from hash_step or history_from_ids)")
            history = self.initial_history(ids.shape[0])
        else:
            history = np.array(history, dtype=np.int64)  # copy: masked below
            before = np.arange(-self.history_len, 0) + start_pos < 0  # history slots before position 0
            history[:, before] = NO_TOKEN
        return self.hash_step(ids, history, dead_mask)[0]

    def history_from_ids(self, ids: np.ndarray, dead_mask: np.ndarray | None = None) -> np.ndarray:
        """The history after the tokens ids int [B, P] (e.g. a cached prefix), without hashing them."""
        ids = np.asarray(ids)
        b, p = ids.shape
        h = self.history_len
        tail = self.compress(ids[:, max(0, p - h):],
                             None if dead_mask is None else np.asarray(dead_mask)[:, max(0, p - h):])
        return np.concatenate([self.initial_history(b), tail], axis=1)[:, -h:]

    def _rows(self, tokens: np.ndarray) -> np.ndarray:
        """tokens int64 [B, S, max_ngram] -> rows int64 [B, S, L, n_cols]."""
        b, s, _ = tokens.shape
        n_layers = len(self.layer_ids)
        products = tokens[:, :, None, :] * self.multipliers  # [B, S, L, max_ngram]; < 2^63, see multiplier_bound
        primes = self.primes.reshape(n_layers, self.max_ngram - 1, self.n_heads)
        out = np.empty((b, s, n_layers, self.max_ngram - 1, self.n_heads), dtype=np.int64)
        rolling = products[..., 0]
        for n in range(2, self.max_ngram + 1):
            rolling = rolling ^ products[..., n - 1]  # hash of the n-gram ending here; stays >= 0
            out[..., n - 2, :] = rolling[..., None] % primes[:, n - 2, :]
        return out.reshape(b, s, n_layers, self.n_cols) + self.offsets


# ---- on the device ---------------------------------------------------------------------------------------------
# The same row ids from a jitted program, without 64-bit integers (jax's default): each product t * M[l, k] is read
# from a table of every class's product as two uint32 halves (the XOR works per half), and the modulus runs over
# the 64-bit value in digits (Horner's rule), which stays inside uint32 while every prime is below 2^25.

MAX_DEVICE_PRIME = 1 << 25


def device_constants(hasher: NgramHasher) -> dict:
    """The hasher as arrays for `device_rows`: token_map int32 [vocab]; products_hi / products_lo uint32
    [L, max_ngram, classes] (class c's t * M[l, k], c = pad included); primes uint32 / offsets int32 [L, n_cols];
    pad int32 []. ~8 bytes a class and (layer, look-back): 7 MB for Flash with its token map."""
    if hasher.primes.size and hasher.primes.max() >= MAX_DEVICE_PRIME:
        raise ConfigError(f"an Engram prime is {hasher.primes.max()}, at or above 2^25: device hashing keeps the "
                          "modulus in uint32 below that; hash on the host (no device feed)")
    if max(hasher.table_rows, default=0) >= 1 << 31:
        raise ConfigError(f"an Engram table has {max(hasher.table_rows)} rows: device row ids are int32")
    classes = np.arange(int(hasher.token_map.max()) + 1, dtype=np.uint64)
    products = classes[None, None, :] * hasher.multipliers.astype(np.uint64)[:, :, None]  # < 2^63 (multiplier_bound)
    return {"token_map": hasher.token_map.astype(np.int32),
            "products_hi": (products >> np.uint64(32)).astype(np.uint32),
            "products_lo": (products & np.uint64(0xFFFFFFFF)).astype(np.uint32),
            "primes": hasher.primes.astype(np.uint32), "offsets": hasher.offsets.astype(np.int32),
            "pad": np.int32(hasher.pad)}


def _mod64(hi, lo, p):
    """(hi * 2^32 + lo) mod p, uint32 throughout, for p < 2^25: r * 2^7 + a 7-bit digit stays below 2^32."""
    r = hi % p
    r = (r * 16 + (lo >> 28)) % p
    for shift in (21, 14, 7, 0):
        r = (r * 128 + ((lo >> shift) & 127)) % p
    return r


def device_rows(consts: dict, ids, history):
    """`NgramHasher.hash_step`'s row ids, jitted: ids int32 [B, S] (never DEAD: image tokens are hashed on the
    host), history int32 [B, max_ngram - 1] (classes, DEAD, NO_TOKEN; `hash_step`'s) -> int32 [B, S, L, n_cols]."""
    import jax.numpy as jnp

    L, K, _ = consts["products_hi"].shape
    H = K - 1
    S = ids.shape[1]
    ext = jnp.concatenate([history.astype(jnp.int32), consts["token_map"][ids]], axis=1)  # [B, H + S]
    blocked = jnp.zeros(ids.shape, bool)
    hi = lo = None
    n_heads = consts["primes"].shape[1] // H
    out = []
    for k in range(K):
        src = ext[:, H - k: H - k + S]
        blocked = blocked | (src < 0)
        t = jnp.where(blocked, consts["pad"], src)  # [B, S]
        phi, plo = consts["products_hi"][:, k, :][:, t], consts["products_lo"][:, k, :][:, t]  # [L, B, S]
        hi, lo = (phi, plo) if k == 0 else (hi ^ phi, lo ^ plo)
        if k:
            p = consts["primes"].reshape(L, H, n_heads)[:, k - 1]  # [L, heads]
            out.append(_mod64(hi[..., None], lo[..., None], p[:, None, None, :]))  # [L, B, S, heads]
    rows = jnp.stack(out, axis=-2).reshape(L, *ids.shape, H * n_heads).astype(jnp.int32)
    return jnp.moveaxis(rows, 0, 2) + consts["offsets"][None, None]
