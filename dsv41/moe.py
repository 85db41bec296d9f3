"""The sqrt-softplus MoE: 1 shared + top-k of n routed SwiGLU experts (spec §2.5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41 import quant
from dsv41.config import ModelConfig
from dsv41.nn import linear, linear_f32
from dsv41.quant import Numerics


def router_scores(x: jax.Array, gate: dict, cfg: ModelConfig, image_mask: jax.Array | None = None):
    """x [T, D] -> (scores, scores + bias) float32 [T, E]: the experts' weights and what picks them (bias_vl
    inside image spans)."""
    scores = linear_f32(x, gate["weight"]) / cfg.gate_temp
    scores = jnp.sqrt(jax.nn.softplus(scores))
    bias = gate["bias"].astype(jnp.float32)
    if image_mask is not None:
        bias = jnp.where(image_mask[:, None], gate["bias_vl"].astype(jnp.float32), bias)
    return scores, scores + bias


def route(x: jax.Array, gate: dict, cfg: ModelConfig, image_mask: jax.Array | None = None):
    """x [T, D] -> (weights [T, k] float32, expert ids [T, k] int32).

    The bias (bias_vl inside image spans) picks the experts but does not weigh them; ties go to the lower id.
    """
    scores, biased = router_scores(x, gate, cfg, image_mask)
    _, idx = jax.lax.top_k(biased, cfg.n_activated_experts)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob and cfg.n_activated_experts > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)  # 1e-20, not norm_eps: as trained
    return w * cfg.route_scale, idx.astype(jnp.int32)


def route_plain(x: jax.Array, gate: dict, cfg: ModelConfig, image_mask: jax.Array | None = None):
    """`route` as an `Ops.route`: -> (weights [T, k], ids [T, k], None: no precomputed permutation)."""
    w, idx = route(x, gate, cfg, image_mask)
    return w, idx, None


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """silu(g) * u in float32 with the trained clamps: u to [-limit, limit], g from above only."""
    g, u = g.astype(jnp.float32), u.astype(jnp.float32)
    if limit > 0:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, limit)
    return jax.nn.silu(g) * u


def shared_expert(x: jax.Array, p: dict, cfg: ModelConfig, num: Numerics, linear=linear) -> jax.Array:
    """x [T, D] -> [T, D]; linear: `Ops.linear`."""
    h = swiglu(linear(x, p["w1"], num, fp8_input=True), linear(x, p["w3"], num, fp8_input=True), cfg.swiglu_limit)
    return linear(h.astype(num.jdtype), p["w2"], num, fp8_input=True)


def expert_order(idx: jax.Array, n_experts: int, permutation=None) -> tuple[jax.Array, jax.Array]:
    """idx [T, k] -> (order [T*k]: stable argsort of idx's slots, group sizes [E]), or the router's own."""
    if permutation is not None:
        return permutation
    flat = idx.reshape(-1)
    return jnp.argsort(flat, stable=True), jnp.bincount(flat, length=n_experts).astype(jnp.int32)


def routed_experts(x: jax.Array, w: jax.Array, idx: jax.Array, p: dict, cfg: ModelConfig, num: Numerics,
                   permutation: tuple[jax.Array, jax.Array] | None = None):
    """Grouped GEMMs over tokens sorted by expert: x [T, D], w/idx [T, k] -> float32 [T, D].
    permutation: (order [T*k] = stable argsort of idx's slots, group sizes [E]) when the router made them."""
    T, k = idx.shape
    dt = num.jdtype
    order, sizes = expert_order(idx, cfg.n_routed_experts, permutation)
    tok = order // k
    xs = x[tok].astype(dt)
    if num.act_quant:
        xs = quant.fp8_qdq(xs)

    def gmm(a, weight):  # a [N, in], weight [E, out, in]
        wd = jnp.swapaxes(quant.dense(weight, dt), 1, 2)
        return jax.lax.ragged_dot(a, wd, sizes, preferred_element_type=jnp.float32).astype(dt)

    h = swiglu(gmm(xs, p["w1"]), gmm(xs, p["w3"]), cfg.swiglu_limit)
    h = (w.reshape(-1)[order][:, None] * h).astype(dt)
    if num.act_quant:
        h = quant.fp8_qdq(h)
    y = gmm(h, p["w2"]).astype(jnp.float32)
    # each token sums its k rows by a gather: a float32 scatter-add over the T * k rows is atomics on a GPU, whose
    # order varies run to run (the H200: two runs of the same forward differed from layer 0 on, and flipped
    # near-tied expert choices, docs/KERNELS_EXPERT_GEMM.md)
    return sum_in_expert_order(y[token_rows(order, T, k)])


def token_rows(order: jax.Array, T: int, k: int) -> jax.Array:
    """int32 [T, k]: each token's rows of the expert-sorted order (order [T * k] sorts the (token, choice) slots
    by expert), in expert order."""
    m = order.shape[0]
    return jnp.sort(jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32)).reshape(T, k), axis=1)


def sum_in_expert_order(ys: jax.Array) -> jax.Array:
    """float32 [T, k, D] -> [T, D], added one expert after another, as a loop over experts adds them (the
    reference; and XLA's scatter-add on a CPU, bit for bit). A reduce over k may pair them otherwise."""
    out = ys[:, 0]
    for j in range(1, ys.shape[1]):
        out = out + ys[:, j]
    return out


def moe(x: jax.Array, p: dict, cfg: ModelConfig, num: Numerics, image_mask: jax.Array | None = None,
        return_routing: bool = False, ops=None):
    """x [..., D] -> [..., D]: routed experts summed in float32, the shared expert added, one cast.
    ops: the `dsv41.ops.Ops` whose route / routed_experts / linear run here (None: this module's XLA ones)."""
    route_fn, experts_fn, lin = ((route_plain, routed_experts, linear) if ops is None
                                 else (ops.route, ops.routed_experts, ops.linear))
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    with jax.named_scope("router"):
        w, idx, perm = route_fn(xt, p["gate"], cfg, None if image_mask is None else image_mask.reshape(-1))
    with jax.named_scope("routed_experts"):
        y = experts_fn(xt, w, idx, p["experts"], cfg, num, perm)
    with jax.named_scope("shared_expert"):
        y = (y + shared_expert(xt, p["shared_experts"], cfg, num, lin).astype(jnp.float32)).astype(x.dtype)
    y = y.reshape(shape)
    if return_routing:
        return y, (w.reshape(*shape[:-1], -1), idx.reshape(*shape[:-1], -1))
    return y
