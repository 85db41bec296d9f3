"""The vision tower and aligner (spec §0, §2.1): a pre-norm ViT with full attention and 2D RoPE over one image's
patches, then a ratio x ratio merge of neighbouring patches and a GELU MLP into the text width; the span's
delimiter rows take the learned `image_start` / `image_newline` / `image_end` vectors.

Semantics of the reference (nemo-automodel `deepseek_v4/vision.py`, which V4.1 reuses): RMSNorms with eps 1e-6 (not
the text model's 1e-20); `wqkv` split q | k | v, then heads; RoPE on each head's halves (first half x second half,
not adjacent pairs) with angles row * f for the first quarter of the head dim and column * f for the second, f =
theta^(-4i / head_dim); bidirectional softmax attention over the whole image; SwiGLU MLP `w1` = gate | up, no clamp,
no biases; the merge concatenates a cell's patches channel-major (the feature of patch (ki, kj) of channel c at c *
ratio^2 + ki * ratio + kj, as torch's unfold), zeros past the grid's ragged edge; exact (erf) GELU.

Inputs are padded (`image_processing.VisionInputs`): padding patches are masked out of the attention keys and
never merged, so an image's result does not depend on its bucket.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import image_processing as ip
from dsv41.config import ModelConfig, VisionConfig
from dsv41.nn import rms_norm
from dsv41.params import VISION_KEYS
from dsv41.quant import Numerics

NORM_EPS = 1e-6


def dense(x: jax.Array, p: dict, num: Numerics) -> jax.Array:
    """x [..., in] @ weight[out, in]^T (+ bias) -> [..., out] in the activation dtype, float32 accumulation."""
    dt = num.jdtype
    y = jnp.einsum("...i,oi->...o", x.astype(dt), p["weight"].astype(dt), preferred_element_type=jnp.float32)
    if "bias" in p:
        y = y + p["bias"].astype(jnp.float32)
    return y.astype(dt)


def rope_angles(pos: jax.Array, v: VisionConfig) -> jax.Array:
    """pos int32 [N, 2] (row, column) -> angles float32 [N, head_dim / 2]: rows, then columns."""
    quarter = v.head_dim // 4
    f = 1.0 / (v.rope_theta ** (np.arange(quarter, dtype=np.float32) * 4 / v.head_dim))
    ang = pos.astype(jnp.float32)[:, :, None] * jnp.asarray(f, jnp.float32)  # [N, 2, quarter]
    return ang.reshape(pos.shape[0], 2 * quarter)


def rotate(x: jax.Array, ang: jax.Array) -> jax.Array:
    """x [N, H, hd] rotated half against half by ang [N, hd/2], in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    cos, sin = jnp.cos(ang)[:, None], jnp.sin(ang)[:, None]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(x: jax.Array, p: dict, ang: jax.Array, n_valid: jax.Array, v: VisionConfig, num: Numerics,
              impl: str | None = None):
    """x [N, Dv] -> [N, Dv]: every patch attends to the n_valid (int32 [1]) real patches, the first rows.
    impl: jax.nn.dot_product_attention's implementation (None: XLA; 'cudnn': its fused kernel, GPUs, bf16)."""
    N = x.shape[0]
    H, hd = v.n_heads, v.head_dim
    q, k, val = jnp.split(dense(x, p["wqkv"], num), 3, axis=-1)
    q, k, val = (t.reshape(1, N, H, hd) for t in (q, k, val))
    q, k = rotate(q[0], ang)[None], rotate(k[0], ang)[None]
    o = jax.nn.dot_product_attention(q, k, val, key_value_seq_lengths=n_valid, implementation=impl)
    return dense(o.reshape(N, H * hd).astype(num.jdtype), p["wo"], num)


def mlp(x: jax.Array, p: dict, num: Numerics) -> jax.Array:
    gate, up = jnp.split(dense(x, p["w1"], num), 2, axis=-1)
    return dense(jax.nn.silu(gate) * up, p["w2"], num)


def encode(p: dict, patches: jax.Array, pos: jax.Array, valid: jax.Array, v: VisionConfig,
           num: Numerics, impl: str | None = None) -> jax.Array:
    """The ViT: patches [N, 3 * P * P], pos int32 [N, 2], valid bool [N] (a prefix) -> patch states [N, Dv]."""
    x = dense(patches, p["patch_embed"]["proj"], num)
    ang = rope_angles(pos, v)
    n_valid = jnp.sum(valid, dtype=jnp.int32)[None]

    def block(x, b):
        x = x + attention(rms_norm(x, b["norm1"], NORM_EPS), b["attn"], ang, n_valid, v, num, impl)
        return x + mlp(rms_norm(x, b["norm2"], NORM_EPS), b["mlp"], num), None

    # one compiled block for all of them (Flash: 32, and a program per patch bucket): the blocks' weights are
    # stacked per call, a copy of the tower's weights that is small next to its compute
    blocks = jax.tree_util.tree_map(lambda *w: jnp.stack(w), *p["blocks"])
    x, _ = jax.lax.scan(block, x, blocks)
    return rms_norm(x, p["norm"], NORM_EPS)


def align(p: dict, x: jax.Array, merge: jax.Array, num: Numerics) -> jax.Array:
    """Patch states [N, Dv], merge int32 [S, r^2] (N: the zero row) -> image-token features [S, D]."""
    S, rr = merge.shape
    xz = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    cells = jnp.swapaxes(xz[merge], 1, 2).reshape(S, -1)  # channel-major within the cell, as unfold
    h = dense(cells, p["w1"], num)
    return dense(jax.nn.gelu(h.astype(jnp.float32), approximate=False).astype(num.jdtype), p["w2"], num)


@functools.partial(jax.jit, static_argnames=("cfg", "num", "attention"))
def span_embeddings(params: dict, patches: jax.Array, pos: jax.Array, valid: jax.Array, merge: jax.Array,
                    types: jax.Array, cfg: ModelConfig, num: Numerics, attention: str | None = None) -> jax.Array:
    """One image's span rows [S, D] (`VisionInputs`' arrays; S = max_image_tokens, zeros past the span):
    aligned features on IMAGE rows, the learned delimiters on START / NEWLINE / END.
    params: the model's tree (its `vision`, `aligner` and `image_*` entries are read). attention: `attention`'s
    impl."""
    x = encode(params["vision"], patches, pos, valid, cfg.vision, num, attention)
    feats = align(params["aligner"], x, merge, num)
    dt = num.jdtype
    rows = jnp.zeros_like(feats)
    for t, name in ((ip.START, "image_start"), (ip.NEWLINE, "image_newline"), (ip.END, "image_end")):
        rows = jnp.where((types == t)[:, None], params[name].astype(dt)[None], rows)
    return jnp.where((types == ip.IMAGE)[:, None], feats, rows)


def image_span(params: dict, inputs: ip.VisionInputs, cfg: ModelConfig, num: Numerics) -> jax.Array:
    """`span_embeddings` of one prepared image, cut to its span: [span_len, D]."""
    if cfg.vision is None:
        raise ValueError("this model has no vision tower (config.json has no vision_config); send text only")
    rows = span_embeddings(vision_params(params), inputs.patches, inputs.pos, inputs.valid, inputs.merge,
                           inputs.types, cfg, num)
    return rows[: inputs.span_len]


def vision_params(params: dict) -> dict:
    """The entries of a model tree the vision program reads."""
    return {k: params[k] for k in VISION_KEYS}
