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
    tok = order // k
    xs = x[tok].astype(dt)
    if num.act_quant:
        xs = quant.fp8_qdq(xs)

    def gmm(a, weight):  # a [N, in], weight [E, out, in]
        if isinstance(weight, expert_gemm.PreparedFp4):  # FP4 decoded in the Mosaic GPU kernel (prepare_experts)
            backend = "interpret" if weight.interpret else "pallas"
            return expert_gemm.grouped_fp4_matmul(a.astype(jnp.bfloat16), weight, sizes, backend).astype(dt)
        wd = jnp.swapaxes(quant.dense(weight, dt), 1, 2)
        return jax.lax.ragged_dot(a, wd, sizes, preferred_element_type=jnp.float32).astype(dt)

    if "w13" in p:  # prepare_experts: w1 and w3 as one weight [E, 2F, D], one kernel call
        gu = gmm(xs, p["w13"])
        f = gu.shape[-1] // 2
        h = swiglu(gu[:, :f], gu[:, f:], cfg.swiglu_limit)
    else:
        h = swiglu(gmm(xs, p["w1"]), gmm(xs, p["w3"]), cfg.swiglu_limit)
    h = (w.reshape(-1)[order][:, None] * h).astype(dt)
    if num.act_quant:
        h = quant.fp8_qdq(h)
    y = gmm(h, p["w2"]).astype(jnp.float32)
    return jnp.zeros((T, x.shape[-1]), jnp.float32).at[tok].add(y)


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
