"""The sqrt-softplus MoE: 1 shared + top-k of n routed SwiGLU experts (spec §2.5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41 import quant
from dsv41.config import ModelConfig
from dsv41.nn import linear, linear_f32
from dsv41.quant import Fp4Weight, Numerics
from pallas_kernels import expert_gemm


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


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """silu(g) * u in float32 with the trained clamps: u to [-limit, limit], g from above only."""
    g, u = g.astype(jnp.float32), u.astype(jnp.float32)
    if limit > 0:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, limit)
    return jax.nn.silu(g) * u


def shared_expert(x: jax.Array, p: dict, cfg: ModelConfig, num: Numerics) -> jax.Array:
    h = swiglu(linear(x, p["w1"], num, fp8_input=True), linear(x, p["w3"], num, fp8_input=True), cfg.swiglu_limit)
    return linear(h.astype(num.jdtype), p["w2"], num, fp8_input=True)


def routed_experts(x: jax.Array, w: jax.Array, idx: jax.Array, p: dict, cfg: ModelConfig, num: Numerics,
                   permutation: tuple[jax.Array, jax.Array] | None = None):
    """Grouped GEMMs over tokens sorted by expert: x [T, D], w/idx [T, k] -> float32 [T, D].
    permutation: (order [T*k] = stable argsort of idx's slots, group sizes [E]) when the router made them."""
    T, k = idx.shape
    E = cfg.n_routed_experts
    dt = num.jdtype
    flat = idx.reshape(-1)
    if permutation is None:
        order, sizes = jnp.argsort(flat, stable=True), jnp.bincount(flat, length=E).astype(jnp.int32)
    else:
        order, sizes = permutation
    if isinstance(p.get("w13"), expert_gemm.PreparedFp4):
        return _routed_experts_fp4(x, w, order, sizes, p, cfg, num)
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
    return _sum_in_expert_order(y[_token_rows(order, T, k)])


def _token_rows(order: jax.Array, T: int, k: int) -> jax.Array:
    """int32 [T, k]: each token's rows of the expert-sorted order (order [T * k] sorts the (token, choice) slots
    by expert), in expert order."""
    m = order.shape[0]
    return jnp.sort(jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32)).reshape(T, k), axis=1)


def _sum_in_expert_order(ys: jax.Array) -> jax.Array:
    """float32 [T, k, D] -> [T, D], added one expert after another, as a loop over experts adds them (the
    reference; and XLA's scatter-add on a CPU, bit for bit). A reduce over k may pair them otherwise."""
    out = ys[:, 0]
    for j in range(1, ys.shape[1]):
        out = out + ys[:, j]
    return out


def _routed_experts_fp4(x, w, order, sizes, p, cfg: ModelConfig, num: Numerics):
    """`routed_experts` with the grouped FP4 kernel (`prepare_experts`: w13 [E, 2F, D], w2 [E, D, F]).

    Rows stay in the kernel's layouts between the two GEMMs (`expert_gemm.tile_schedule`): x is gathered from
    the tokens straight into the padded row layout; SwiGLU, the routing weight and the activation quantization
    read w13's output where the tile layout holds it, writing w2's input in the padded row layout; each token
    sums its k rows of w2's output. One schedule for both GEMMs, no per-call row gathers, and a gather-sum in
    place of a float32 scatter-add over the T * k rows (atomics) at the end. The activation quantization of x
    runs on the T tokens before the gather, not on their T * k copies (the same per-row values)."""
    T, D = x.shape
    k = w.shape[-1]
    m, E = order.shape[0], sizes.shape[0]
    w13, w2 = p["w13"], p["w2"]
    f = w2.shape[-1]
    c13, c2 = expert_gemm.default_config(m, 2 * f, D, E), expert_gemm.default_config(m, D, f, E)
    if c13.tm != c2.tm:
        raise ValueError(f"w13 and w2 share one tile schedule: their configs need the same tm ({c13} / {c2})")
    sched = expert_gemm.tile_schedule(sizes, m, c13.tm, expert_gemm.max_tiles(m, E, c13.tm))
    has_row = sched.src < m
    src = jnp.minimum(sched.src, m - 1)  # padded row -> sorted row (padding rows masked by has_row)
    xq = quant.fp8_qdq(x.astype(num.jdtype)) if num.act_quant else x
    xp = jnp.take(xq.astype(jnp.bfloat16), jnp.where(has_row, order[src] // k, T), axis=0, mode="fill",
                  fill_value=0)
    gu = expert_gemm.matmul_padded(xp, w13, sched, c13, w13.interpret)  # tile layout [t_max * tm, 2F]
    gu = jnp.take(gu, sched.pos[src], axis=0)  # w2's padded row layout
    h = swiglu(gu[:, :f], gu[:, f:], cfg.swiglu_limit)
    h = jnp.where(has_row[:, None], w.reshape(-1)[order[src]][:, None] * h, 0.0).astype(num.jdtype)
    if num.act_quant:
        h = quant.fp8_qdq(h)
    y = expert_gemm.matmul_padded(h.astype(jnp.bfloat16), w2, sched, c2, w2.interpret)  # [t_max * tm, D]
    sorted_row = _token_rows(order, T, k)
    rows = jnp.where(sched.valid[sorted_row], sched.pos[sorted_row], -1)
    ys = jnp.take(y, rows, axis=0, mode="fill", fill_value=0).astype(num.jdtype).astype(jnp.float32)
    return _sum_in_expert_order(ys)


def prepare_experts(params: dict, interpret: bool = False) -> dict:
    """The routed experts' FP4 weights in the grouped-GEMM kernel's layout (once, at load): `routed_experts`
    then runs the Mosaic GPU kernel instead of dequantizing every expert for lax.ragged_dot. w1 and w3 become
    one weight 'w13' [E, 2F, D] (one call per layer for both). The old arrays are dropped as each layer is
    converted, so peak memory grows by one layer's experts."""
    layers = []
    for i, lp in enumerate(params["layers"]):
        ex = lp["ffn"]["experts"]
        bad = [k for k, w in ex.items() if not isinstance(w, (Fp4Weight, expert_gemm.PreparedFp4))]
        if bad:
            raise ValueError(f"layer {i}: routed experts {bad} are not FP4 (the release's format); the grouped FP4 "
                             f"kernel needs FP4 weights: load a release checkpoint or use init_params without dtype")
        ex = {k: expert_gemm.prepare_fp4_experts(w, interpret=interpret) for k, w in ex.items()}
        if "w1" in ex:
            ex = {"w13": expert_gemm.concat_out_features(ex.pop("w1"), ex.pop("w3")), **ex}
        layers.append({**lp, "ffn": {**lp["ffn"], "experts": ex}})
    return {**params, "layers": layers}


def moe(x: jax.Array, p: dict, cfg: ModelConfig, num: Numerics, image_mask: jax.Array | None = None,
        return_routing: bool = False, router_backend: str = "xla"):
    """x [..., D] -> [..., D]: routed experts summed in float32, the shared expert added, one cast.
    router_backend 'pallas' / 'interpret': the fused router kernel (pallas_kernels/router.py) routes and builds
    the experts' permutation; with an image mask the route stays here (the kernel has no bias_vl)."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    with jax.named_scope("router"):
        if router_backend == "xla" or image_mask is not None:
            w, idx = route(xt, p["gate"], cfg, None if image_mask is None else image_mask.reshape(-1))
            perm = None
        else:
            from pallas_kernels import router

            gate = {**p["gate"], "weight": quant.dense(p["gate"]["weight"], jnp.bfloat16)}
            w, idx, order, sizes = router.route_fused(xt.astype(jnp.bfloat16), gate, cfg, backend=router_backend)
            perm = (order, sizes)
    with jax.named_scope("routed_experts"):
        y = routed_experts(xt, w, idx, p["experts"], cfg, num, perm)
    with jax.named_scope("shared_expert"):
        y = (y + shared_expert(xt, p["shared_experts"], cfg, num).astype(jnp.float32)).astype(x.dtype)
    y = y.reshape(shape)
    if return_routing:
        return y, (w.reshape(*shape[:-1], -1), idx.reshape(*shape[:-1], -1))
    return y
