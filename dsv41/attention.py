"""Attention of one layer (spec §2.4): low-rank Q, the shared K=V latent over a sliding window, the selected
compressed entries, a per-head sink, inverse RoPE on the output and the grouped low-rank output projection.

The pieces are shared by the full-sequence model and the cached engine: both hand `attend` the window keys
with their absolute positions and the compressed entries each query selected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import quant
from dsv41.config import ModelConfig
from dsv41.nn import grouped_linear, linear, rms_norm
from dsv41.quant import Numerics
from dsv41.rope import apply_rope

NO_POS = -(1 << 30)  # position of an empty window slot: never inside any query's window


def _linear(ops):
    """The linear of `ops` (a `dsv41.ops.Ops`; None: `nn.linear`)."""
    return linear if ops is None else ops.linear


def project_q(x: jax.Array, p: dict, pos: jax.Array, freqs: np.ndarray, cfg: ModelConfig, num: Numerics,
              rope: bool = True, ops=None):
    """x [B, S, D] -> q [B, S, H, Dh] (RoPE'd at pos [B, S]; rope=False: not, for a kernel that rotates it) and
    the low-rank qr [B, S, q_lora] the indexer reads. ops: the `dsv41.ops.Ops` whose linears run here (None:
    `nn`'s XLA ones)."""
    linear = _linear(ops)
    qr = rms_norm(linear(x, p["wq_a"], num, fp8_input=True), p["q_norm"], cfg.norm_eps)
    q = linear(qr, p["wq_b"], num, fp8_input=True).reshape(*x.shape[:-1], cfg.n_heads, cfg.head_dim)
    return (apply_rope(q, pos[..., None], freqs) if rope else q), qr


def window_kv(x: jax.Array, p: dict, pos: jax.Array, freqs: np.ndarray, cfg: ModelConfig, num: Numerics,
              ops=None):
    """x [B, S, D] -> the SWA K=V latent [B, S, Dh]: normalized, RoPE'd, FP8 round trip over all dims."""
    kv = rms_norm(_linear(ops)(x, p["wkv"], num, fp8_input=True), p["kv_norm"], cfg.norm_eps)
    kv = apply_rope(kv, pos, freqs)
    return quant.fp8_qdq(kv) if num.kv_quant else kv


def compressed_entries(latent: jax.Array, pos: jax.Array, freqs: np.ndarray, num: Numerics) -> jax.Array:
    """Pre-RoPE latents [B, G, Dh] at group-start positions -> compressed KV entries (RoPE'd, FP4 round trip)."""
    kv = apply_rope(latent, pos, freqs)
    return quant.kv_fp4_qdq(kv) if num.kv_quant else kv


def _window_scores_dense(q, q_pos, k, k_pos, lo, cfg):
    """q [B,S,H,D], k [B,T,D] -> scores [B,S,H,T] float32 (unscaled) and mask [B,S,1,T]."""
    s = jnp.einsum("bshd,btd->bsht", q, k, preferred_element_type=jnp.float32)
    qp, kp = q_pos[:, :, None, None], k_pos[:, None, None, :]
    mask = (kp <= qp) & (kp > qp - cfg.window_size) & (kp >= lo[:, None, None, None])
    return s, mask


def attend(q: jax.Array, q_pos: jax.Array, win_k: jax.Array, win_pos: jax.Array, comp_k: jax.Array | None,
           comp_valid: jax.Array | None, sink: jax.Array, cfg: ModelConfig, num: Numerics,
           window_lo: jax.Array | None = None, win_mask: jax.Array | None = None) -> jax.Array:
    """Softmax attention with a sink over window keys plus per-query selected compressed entries (K = V).

    q [B, S, H, Dh] at q_pos [B, S]; win_k [B, T, Dh] at win_pos [B, T] (NO_POS for empty slots): query i sees
    positions (q_pos - window, q_pos], and none below window_lo [B] (bounded replay clips windows there);
    win_mask [B, S, T] (bool), when given, says instead which window keys each query sees (a DSpark block sees its
    context window and its whole own block: `dsv41.dspark`).
    comp_k [B, S, K, Dh] with comp_valid [B, S, K]. o = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}),
    s = q.k / sqrt(Dh). Probabilities round to bf16 before P.V when num.bf16_probs (relative to the final
    max; the reference kernel rounds relative to a running max per 64 keys). -> [B, S, H, Dh].
    """
    dt = num.jdtype
    B, S, H, Dh = q.shape
    scale = Dh**-0.5
    lo = jnp.full((B,), NO_POS, jnp.int32) if window_lo is None else window_lo
    sw, mw = _window_scores_dense(q.astype(dt), q_pos, win_k.astype(dt), win_pos, lo, cfg)
    if win_mask is not None:
        mw = win_mask[:, :, None, :]
    sw = jnp.where(mw, sw * scale, -jnp.inf)
    m = jnp.max(sw, axis=-1)
    if comp_k is not None and comp_k.shape[2] > 0:
        sc = jnp.einsum("bshd,bskd->bshk", q.astype(dt), comp_k.astype(dt), preferred_element_type=jnp.float32)
        sc = jnp.where(comp_valid[:, :, None, :], sc * scale, -jnp.inf)
        m = jnp.maximum(m, jnp.max(sc, axis=-1))
    m = jnp.maximum(m, -1e30)  # a query with no key at all gets zeros, not NaN
    pw = jnp.exp(sw - m[..., None])
    denom = jnp.sum(pw, -1)
    if num.bf16_probs:
        pw = quant.round_to(pw, jnp.bfloat16)
    o = jnp.einsum("bsht,btd->bshd", pw.astype(jnp.float32), win_k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    if comp_k is not None and comp_k.shape[2] > 0:
        pc = jnp.exp(sc - m[..., None])
        denom = denom + jnp.sum(pc, -1)
        if num.bf16_probs:
            pc = quant.round_to(pc, jnp.bfloat16)
        o = o + jnp.einsum("bshk,bskd->bshd", pc.astype(jnp.float32), comp_k.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
    denom = denom + jnp.exp(sink.astype(jnp.float32) - m)
    return (o / denom[..., None]).astype(dt)


def output(o: jax.Array, pos: jax.Array, p: dict, freqs: np.ndarray, cfg: ModelConfig, num: Numerics,
           rope: bool = True, ops=None) -> jax.Array:
    """o [B, S, H, Dh] -> [B, S, D]: inverse RoPE at the query position (rope=False: o comes rotated back
    already), then wo_a per group of heads (block-diagonal, bf16) and wo_b."""
    if rope:
        o = apply_rope(o, pos[..., None], freqs, inverse=True)
    gl = grouped_linear if ops is None else ops.grouped_linear
    u = gl(o.reshape(*o.shape[:-2], cfg.o_groups, -1), p["wo_a"], num)  # [B, S, G, R]
    return _linear(ops)(u.reshape(*u.shape[:-2], -1), p["wo_b"], num, fp8_input=True)


def gather_entries(kv: jax.Array, idx: jax.Array):
    """kv [B, G, Dh], idx [B, S, K] (-1 = none) -> entries [B, S, K, Dh] and valid [B, S, K]."""
    valid = idx >= 0
    B, S, K = idx.shape
    flat = jnp.where(valid, idx, 0).reshape(B, S * K)
    ent = jnp.take_along_axis(kv, flat[..., None], axis=1).reshape(B, S, K, -1)
    return ent, valid
