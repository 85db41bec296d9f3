"""Decode steps fed on the device (`EngineConfig.device_feed`): the engine's side.

A step dispatches the next decode step before it reads the tokens of the one in flight: each row whose newest
token is still on the device takes it from the previous step's sampled ids (`programs.Feed`: the decode step's ids
padded to the top decode bucket per data rank, and the prefill call's first tokens padded to its rows a rank, so
one program serves every previous batch), and its Engram rows are hashed and gathered inside the program
(`ngram_hash.device_rows`, the tables in device memory: `programs.DeviceEngram`). Then the step reads the
previous tokens and accepts them, admits and prefills. So the GPU runs step N + 1 right behind step N: the host
prepares and launches it while step N computes (docs/PERFORMANCE.md section 2 measured what that buys). Every row
with a token in flight is decoded in the very next step (a length limit it reaches is known ahead: then it is not
in flight), so the padded ids it reads are always the latest.

What it costs: a row that stopped on a stop token at step N computes step N + 1 too, and that output is dropped.
The host keeps each row's Engram history (`ngram_hash`'s classes of the tokens before its next input) and appends
a fed token's class when it reads the token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import ngram_hash, quant, sharding
from dsv41.config import ConfigError
from serving.engine import kv_pool, programs
from serving.engine.errors import EngineError
from serving.engine.scheduler import _bucket, _InFlight, _Request


def _padded(a: jax.Array, *, ranks: int, width: int) -> jax.Array:
    """A step's per-row outputs [ranks * b, ...] -> [ranks * width, ...], each rank's b rows first
    (`programs.Feed.prev`, `programs.SpecFeed`'s)."""
    per = a.reshape(ranks, -1, *a.shape[1:])
    pad = ((0, 0), (0, width - per.shape[1])) + ((0, 0),) * (a.ndim - 1)
    return jnp.pad(per, pad).reshape(-1, *a.shape[1:])


def split_rows(a, on: jax.sharding.Sharding, ranks: int) -> jax.Array:
    """a [n, ...] (numpy or jax) placed by `on`, whose first axis splits over `ranks`: rows padded with zeros to a
    multiple of ranks, each device's block read from a on its own (no padded copy of a whole table)."""
    n = -(-a.shape[0] // ranks) * ranks
    if n == a.shape[0]:
        return jax.device_put(a, on)

    def block(index):
        lo, hi, _ = index[0].indices(n)
        part = np.asarray(a[lo:min(hi, a.shape[0])])
        pad = hi - lo - part.shape[0]
        return np.concatenate([part, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else part

    return jax.make_array_from_callback((n, *a.shape[1:]), on, block)


class DeviceFeed:
    def _device_engram(self, abstract: bool, tables: list) -> None:
        """Puts the Engram tables and the hasher's arrays in the params tree (`programs.DeviceEngram`): on a mesh
        each table's rows split over the data ranks (replicated over tensor ranks), the hasher's arrays whole on
        every device. tables: per Engram layer as `model.strip_tables` returned them (an abstract engine's:
        ShapeDtypeStructs)."""
        if not self.cfg.engram_layer_ids:
            return
        if self.mesh is None:
            ranks, whole = 1, jax.sharding.SingleDeviceSharding(jax.devices()[0])
            rows = whole
        else:
            ranks, whole = self.mesh.shape[sharding.DATA], sharding.replicated(self.mesh)
            rows = sharding.rank_sharding(self.mesh)

        def put(a, on, split=1):
            if split == 1:
                return jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=on) if abstract else jax.device_put(a, on)
            if abstract:
                return jax.ShapeDtypeStruct((-(-a.shape[0] // split) * split, *a.shape[1:]), a.dtype, sharding=on)
            return split_rows(a, on, split)

        try:
            consts = ngram_hash.device_constants(self.hasher)
        except ConfigError as e:
            raise EngineError(str(e)) from None
        try:
            dev = programs.DeviceEngram([quant.Fp8Rows(put(t.weight, rows, ranks), put(t.scale, rows, ranks))
                                         for t in tables], {k: put(v, whole) for k, v in consts.items()}, ranks)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            gib = kv_pool.engram_bytes_per_device(self.cfg, ranks) / 2**30
            raise EngineError(f"the Engram tables ({gib:.1f} GiB a device) do not fit in device memory beside the "
                              f"weights, which the device feed needs: pass --no-device-feed "
                              f"(EngineConfig(device_feed=False)) to read decode tokens on the host, or split the "
                              f"tables' rows over more data ranks (--data-parallel-size)") from None
        self.params = {**self.params, programs.DEVICE_ENGRAM: dev}

    def _init_device_feed(self, feed: bool) -> None:
        """feed: the engine's resolved `EngineConfig.device_feed` (`engine.platform_config`); the first `Feed.prev`
        (zeros)."""
        self.device_feed = feed
        if not feed:
            return
        D = len(self.ranks)
        self.feed_width = _bucket(self.layout.num_slots, self.min_decode_bucket)  # per rank: the top decode bucket
        rows = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if self.mesh is None
                else sharding.rank_sharding(self.mesh))
        # committed as the step's sampled ids are (a program compiles once per committed / uncommitted signature)
        first = self.shared_prefill[0] if self.shared_prefill else 1  # a prefill call's rows a rank, at most
        # (a pytree of outputs padded in one program: a speculative step's four)
        self._pad = jax.jit(lambda t: jax.tree.map(functools.partial(_padded, ranks=D, width=self.feed_width), t),
                            out_shardings=rows)
        self._pad_first = jax.jit(functools.partial(_padded, ranks=D, width=first), out_shardings=rows)
        self._prev = jax.device_put(np.zeros(D * self.feed_width, np.int32), rows)
        self._first = jax.device_put(np.zeros(D * first, np.int32), rows)
        if self.spec is not None:  # `programs.SpecFeed`'s: out, accepted, drafts, n_next (all k: `_spec_padded`)
            k, n = self.spec_tokens, D * self.feed_width
            self._spec_prev = tuple(jax.device_put(np.full(s, v, np.int32), rows)
                                    for s, v in (((n, k + 1), 0), ((n,), 0), ((n, k), 0), ((n,), k)))

    def _fed_batch(self, rows: list[_Request | None]) -> programs.Batch:
        """A decode batch whose tokens the program takes from `_prev` where they are in flight (`programs.Feed`),
        each row's Engram history as of its input; advances the history past the host tokens it feeds."""
        index, history = self._feed_arrays(len(rows))
        toks, pos0 = {}, {}
        for i, r in enumerate(rows):
            if r is None:
                continue
            if self.hasher is not None:
                history[i] = r.history[0]
            if r.in_flight:  # its input is its newest token, unread
                index[i] = r.fed_row
                toks[r.id], pos0[r.id] = [0], r.num_tokens
            else:  # known: the history moves past it now
                toks[r.id], pos0[r.id] = [r.last_token], r.num_tokens - 1
                self._advance(r, r.last_token)
        b = self._batch(rows, toks, pos0, 1, engram=False)
        return dataclasses.replace(b, feed=programs.Feed(self._prev, self._first, index, history))

    def _advance(self, r: _Request, tok: int) -> None:
        """r's Engram history [1, H] after one more (text) token, in place (each request's array is its own)."""
        if self.hasher is not None:
            h = r.history[0]
            h[:-1] = h[1:]
            h[-1] = self.hasher.token_map[tok]

    def _feed_arrays(self, B: int) -> tuple[np.ndarray, np.ndarray]:
        """A `Feed`'s index and history for B padding rows: no token from the device, nothing before."""
        H = self.hasher.history_len if self.hasher is not None else 1
        return np.full(B, -1, np.int32), np.full((B, H), ngram_hash.NO_TOKEN, np.int32)

    def _feed_padding(self, b: programs.Batch) -> programs.Batch:
        """An all-padding decode batch as `_fed_batch` (speculative: `_decode_speculative`) builds one (warm-up)."""
        B = b.tokens.shape[0]
        index, history = self._feed_arrays(B)
        if self.spec is None:
            return dataclasses.replace(b, rows=[], feed=programs.Feed(self._prev, self._first, index, history))
        feed = programs.SpecFeed(*self._spec_prev, self._first, index, index, np.zeros(B, np.int32), history,
                                 rerun=self.spec_rerun)
        return dataclasses.replace(b, rows=[], feed=feed)

    def _feed_decodes(self) -> list[_Request]:
        """The rows a fed step decodes: running, past their prompt, and not stopped by a length limit by the tokens
        in flight, or (speculative) whose positions may pass the context: those wait for the read."""
        out = []
        for r in self.running.values():
            if r.prefilling:
                continue
            if (len(r.output) + r.in_flight >= r.sampling.max_tokens
                    or r.num_tokens + self.step_advance * r.in_flight >= self.max_model_len):
                continue
            out.append(r)
        return out

    def _dispatched_spec(self, rows: list, spec: tuple, logits: jax.Array, n_verify: np.ndarray) -> None:
        """A fed speculative step's outputs (out, accepted, next drafts, n_next) are in flight: the next step's rows
        continue them (`programs.SpecFeed`), the next engine step reads them (`_accept_spec`)."""
        per = len(rows) // len(self.ranks)
        for i, r in enumerate(rows):
            if r is not None:
                r.in_flight += 1
                r.fed_row = i - r.rank * per
                r.drafts_drawn = True
        self._spec_prev = self._spec_padded(spec)
        f = _InFlight(rows, spec, logits if self.keep_logits else None, n_verify)
        for a in (*spec, f.logits):
            if isinstance(a, jax.Array):
                a.copy_to_host_async()
        self._in_flight.append(f)

    def _spec_padded(self, spec: tuple) -> tuple:
        """A speculative step's (out, accepted, drafts, n_next) as the next `SpecFeed` takes them, padded in one
        program; an n_next on the host (all k, `_next_verify`) keeps the constant one."""
        dev = spec if isinstance(spec[3], jax.Array) else spec[:3]
        return (*self._pad(dev), *self._spec_prev[len(dev):])

    def _dispatched_fed(self, rows: list, tok: jax.Array, decode: bool) -> None:
        """A decode step's or a prefill call's sampled ids (rows: a request per row, None where nothing was
        sampled, rank-major) are in flight: each row's next decode takes its token from them."""
        per = len(rows) // len(self.ranks)
        at = 0 if decode else self.feed_width  # the prefill's ids after the decode step's (`programs.Feed`)
        for i, r in enumerate(rows):
            if r is not None:
                r.in_flight += 1
                r.fed_row = at + i - r.rank * per
        if decode:
            self._prev = self._pad(tok)
        else:
            self._first = self._pad_first(tok)

    def _fed_read(self, r: _Request, tok: int) -> None:
        """A token of r is read: one fewer in flight; if the step after fed it, its class joins the history."""
        r.in_flight -= 1
        if r.in_flight:
            self._advance(r, tok)
