"""A request's images in the engine: where their spans sit in the prompt, their rows for a prefill chunk, and
what the prefix cache and the Engram hasher see of them.

An image's span rows (`dsv41.vision.span_embeddings`: [max_image_tokens, D], zeros past the span) are computed
once per prefill of its request, when the first chunk that reaches the span runs, and dropped when the prefill
ends. A chunk takes its rows from a stack of the spans it touches by one gather, so the text programs see only
[B, T, D] rows and a mask (`programs.Batch.image_embeds` / `image_mask`).

Prefix-cache keys: every token of a span is the image token, so a page's key also hashes, for each span that
overlaps it, the image's digest (BLAKE2b of its encoded bytes) and the span's offset from the page: a repeated
image hits, another image (or the same one elsewhere) does not.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import image_processing as ip
from serving.engine.errors import EngineError


@dataclasses.dataclass(frozen=True)
class PromptImage:
    """One image of a prompt: its span starts at `start` (the prompt's ids there are the image token)."""

    start: int
    inputs: ip.VisionInputs
    digest: bytes

    @property
    def end(self) -> int:
        return self.start + self.inputs.span_len

    @classmethod
    def of(cls, start: int, data: bytes, prepared: ip.PreparedImage, v) -> "PromptImage":
        """From the encoded image bytes (what the digest hashes) and their preprocessing."""
        return cls(start, ip.vision_inputs(prepared, v), digest(data))


def check(ids: list[int], images: tuple, cfg) -> None:
    """A request's images against its prompt ids and the model: raises EngineError naming what is wrong."""
    if not images:
        return
    if cfg.vision is None:
        raise EngineError("this model has no vision tower (its config.json has no vision_config); send text only")
    tok, end = cfg.image_token_id, 0
    for x in images:
        if x.start < end or x.end > len(ids) or any(t != tok for t in ids[x.start:x.end]):
            raise EngineError(f"an image span [{x.start}, {x.end}) must lie inside the prompt, overlap no other "
                              f"span and hold only the image token {tok}; lay the prompt out with "
                              "image_processing.expand_spans")
        if x.inputs.types.shape[0] != cfg.vision.max_image_tokens:
            raise EngineError("an image's inputs were prepared for another vision_config; prepare them with "
                              "this model's config")
        end = x.end


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def mask(images, lo: int, hi: int) -> np.ndarray | None:
    """bool [hi - lo]: the positions [lo, hi) inside an image span; None when none is."""
    out = None
    for im in images:
        a, b = max(lo, im.start), min(hi, im.end)
        if a < b:
            if out is None:
                out = np.zeros(hi - lo, bool)
            out[a - lo:b - lo] = True
    return out


def page_salts(images, first: int, last: int, page_tokens: int) -> list[bytes]:
    """Per page in [first, last): the digests and offsets of the spans that overlap it (b"" for none)."""
    out = []
    for j in range(first, last):
        lo, hi = j * page_tokens, (j + 1) * page_tokens
        out.append(b"".join(im.digest + (im.start - lo).to_bytes(8, "little", signed=True)
                            for im in images if im.start < hi and im.end > lo))
    return out


@functools.partial(jax.jit, static_argnames=("dtype",))
def gather_rows(table: jax.Array, idx: jax.Array, dtype) -> jax.Array:
    """table [K, S, D] (span rows), idx int32 [B, T] (k * S + s; -1: none) -> [B, T, D] (zeros where none)."""
    flat = table.reshape(-1, table.shape[-1])
    rows = jnp.take(flat, jnp.maximum(idx, 0), axis=0)
    return jnp.where((idx >= 0)[..., None], rows, 0).astype(dtype)


def chunk_rows(chunks, span_rows, B: int, T: int, dtype):
    """The image rows of a batch. chunks: per row (pos0, n tokens, the request's images) or None; span_rows(image)
    -> its [S, D] rows. -> (rows [B, T, D], mask bool [B, T]) or (None, None) when no row reaches a span."""
    idx = np.full((B, T), -1, np.int32)
    table, where = [], {}
    for i, c in enumerate(chunks):
        if c is None:
            continue
        pos0, n, images = c
        for im in images:
            a, b = max(pos0, im.start), min(pos0 + n, im.end)
            if a >= b:
                continue
            if id(im) not in where:
                where[id(im)] = len(table)
                table.append(span_rows(im))
            S = table[0].shape[0]
            idx[i, a - pos0:b - pos0] = where[id(im)] * S + np.arange(a - im.start, b - im.start)
    if not table:
        return None, None
    K = 1 << (len(table) - 1).bit_length()  # a power of two: few table shapes
    stack = jnp.stack(table + [jnp.zeros_like(table[0])] * (K - len(table)))
    return gather_rows(stack, idx, dtype), idx >= 0
