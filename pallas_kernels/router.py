"""Fused MoE router (the "Mega-Gate" analog, issue #6): gate GEMM, sqrt-softplus, bias, top-k, renorm, scale.

Semantics are `dsv41.moe.route` (without the image-mask / bias_vl path) plus the permutation that
`dsv41.moe.routed_experts` builds for the grouped GEMM:

  x bf16 [T, D], gate weight bf16 [E, D], bias f32 [E]
  scores  = sqrt(softplus((x @ W^T) / gate_temp))                    f32 [T, E]
  ids     = top_k(scores + bias, k)  (ties -> lower expert id)        int32 [T, k]
  weights = scores[ids] / (sum + 1e-20) * route_scale                 f32 [T, k]   (renorm if norm_topk_prob)
  order   = stable argsort of ids.reshape(-1)                         int32 [T*k]
  group_sizes = bincount(ids, length=E)                               int32 [E]

Backends (`route_fused(..., backend=)`):
- 'xla': `moe.route` + argsort + bincount (the code the model runs today).
- 'pallas': two Mosaic GPU kernels with two small XLA steps between/after them:
  1. `_gate_kernel`: split-K gate GEMM. Work items are (token tile of tm, block of 64*num_wgs experts,
     D split); weights are the wgmma M operand (64 experts per warpgroup), tokens the N operand (tm as small
     as 8, so decode does not pay for 64 padded token rows). Each item streams its x and W tiles through a
     warp-specialized TMA pipeline and stores a float32 partial [64 experts, tm] to partials [S, E, Tp].
     Decode is bound by the 3.9 MB weight read, so D is split into S pieces until about all SMs have one
     item (E/64 * S = 120 at T <= 16).
  2. XLA: logits = sum over S, padded and reordered for step 3 (one small fusion; fixed order, deterministic).
  3. `_select_kernel`: one warpgroup per tb tokens (8 for Flash's 384 experts) loads their logits as a
     [64, 64] tile (row = 64 experts of one token; XLA writes that row order in step 2's fusion) and the bias
     (TMA), then sqrt-softplus, bias, and the top-k in two levels held in registers: k rounds of (row max,
     lowest id reaching it, its score, mask) give each row's k best, and the same rounds over each token's
     r x 8 candidates (read back from shared memory, one [64, 8] tile per 64-expert segment) give its k;
     renormalisation and scale. Outputs are stored as [k, 64] per CTA and transposed in XLA.
  4. XLA: the counting-sort permutation (group sizes + stable order, `permutation`): at decode sizes a
     one-hot counting sort, else a stable argsort.
- 'interpret': the same kernels in the Mosaic GPU interpreter (CPU tests).

Why not one kernel: top-k needs all E scores of a token, which are spread over the CTAs of the split-K GEMM;
the kernel boundary is the grid-wide synchronisation (cross-CTA semaphores were not attempted). Why the
split sum is in XLA: an in-kernel pipelined sum (`emit_pipeline` + strided smem adds) next to the
WGMMA-layout top-k made Mosaic GPU's layout inference search explode (hang) in jax 0.11.2, and a transposed
f32 store of the accumulator fails layout inference (bf16 transposed stores work, see expert_gemm.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

Backend = Literal["pallas", "xla", "interpret"]

EPS = 1e-20  # as trained (not norm_eps)


# ---------------------------------------------------------------------------------------------------
# config


@dataclasses.dataclass(frozen=True)
class RouteConfig:
    """The routing hyper-parameters (taken from dsv41.config.ModelConfig by `RouteConfig.of`)."""

    k: int = 6
    gate_temp: float = 1.0
    route_scale: float = 1.5
    norm_topk_prob: bool = True

    @staticmethod
    def of(cfg) -> RouteConfig:
        return RouteConfig(k=cfg.n_activated_experts, gate_temp=float(cfg.gate_temp),
                           route_scale=float(cfg.route_scale), norm_topk_prob=bool(cfg.norm_topk_prob))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    tm: int = 8  # tokens per GEMM tile = wgmma N (multiple of 8, <= 128)
    tk: int = 128  # D per pipeline step (multiple of 64)
    splits: int = 20  # D is split into this many pieces (partials summed in XLA)
    num_wgs: int = 2  # compute warpgroups per CTA, 64 experts each
    stages: int = 2  # GEMM pipeline depth

    @property
    def tn(self) -> int:
        return 64 * self.num_wgs


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def default_config(t: int, d: int, e: int) -> KernelConfig:
    """Decode (T <= 64): split D so that ~120 CTAs share the weight read, fewer splits as tokens grow
    (the partials are S * Tp * E * 4 bytes, summed by XLA). Prefill: no split."""
    tm = _round_up(max(t, 1), 8) if t <= 64 else 128
    tk = 128
    n_k = d // tk
    if t <= 16:
        want = 20
    elif t <= 64:
        want = 10
    elif t <= 256:
        want = 4
    else:
        want = 1
    splits = max(s for s in range(1, n_k + 1) if n_k % s == 0 and s <= want)
    # Decode: one 64-expert warpgroup per CTA doubles the item count (E/64 * S = 120 at S=20).
    nwg = 2 if (t > 64 and e % 128 == 0) else 1
    return KernelConfig(tm=tm, tk=tk, splits=splits, num_wgs=nwg)


# ---------------------------------------------------------------------------------------------------
# reference (plain jnp, the spec) and the XLA path


def scores_reference(x: jax.Array, w: jax.Array, gate_temp: float = 1.0) -> jax.Array:
    """x [T, D], w [E, D] -> sqrt(softplus(x @ w^T / gate_temp)) float32 [T, E] at HIGHEST precision."""
    logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), w.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    return jnp.sqrt(jax.nn.softplus(logits / gate_temp))


def select_reference(scores: jax.Array, bias: jax.Array, rc: RouteConfig) -> tuple[jax.Array, jax.Array]:
    """scores f32 [T, E], bias [E] -> (weights f32 [T, k], ids int32 [T, k]); `moe.route`'s selection."""
    _, idx = jax.lax.top_k(scores + bias.astype(jnp.float32), rc.k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if rc.norm_topk_prob and rc.k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + EPS)
    return w * rc.route_scale, idx.astype(jnp.int32)


def permutation(ids: jax.Array, e: int, method: str = "auto") -> tuple[jax.Array, jax.Array]:
    """ids int32 [T, k] -> (order int32 [T*k] = stable argsort of ids.reshape(-1), group_sizes int32 [E]).

    'argsort': XLA's stable sort + bincount (what moe.routed_experts does).
    'count': counting sort by comparisons, O((T*k)^2) work but one fused pass: position of slot i =
    #(slots with a smaller id) + #(earlier slots with the same id); its inverse is the order.
    'auto': 'count' for T*k <= 512, else 'argsort'."""
    flat = ids.reshape(-1).astype(jnp.int32)
    n = flat.shape[0]
    if method == "auto":
        method = "count" if n <= 512 else "argsort"
    if method == "argsort":
        return (jnp.argsort(flat, stable=True).astype(jnp.int32),
                jnp.bincount(flat, length=e).astype(jnp.int32))
    if method != "count":
        raise ValueError(f"unknown permutation method {method!r}")
    i = jnp.arange(n, dtype=jnp.int32)
    before = (flat[None, :] < flat[:, None]) | ((flat[None, :] == flat[:, None]) & (i[None, :] < i[:, None]))
    pos = jnp.sum(before, axis=1, dtype=jnp.int32)  # destination of slot i
    order = jnp.zeros((n,), jnp.int32).at[pos].set(i, unique_indices=True)
    sizes = jnp.sum(flat[None, :] == jnp.arange(e, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
    return order, sizes


def route_reference(x: jax.Array, gate: dict, rc: RouteConfig):
    """The spec in float32 (HIGHEST): -> (weights [T, k], ids [T, k], order [T*k], group_sizes [E])."""
    s = scores_reference(x, gate["weight"], rc.gate_temp)
    w, ids = select_reference(s, gate["bias"], rc)
    order, sizes = permutation(ids, gate["weight"].shape[0], "argsort")
    return w, ids, order, sizes


# ---------------------------------------------------------------------------------------------------
# kernel 1: split-K gate GEMM -> float32 partial logits [S, E, Tp]


@functools.lru_cache(maxsize=None)
def _gate_kernel(t_pad: int, d: int, e: int, cfg: KernelConfig, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tm, tk, nwg, tn, s_n = cfg.tm, cfg.tk, cfg.num_wgs, cfg.tn, cfg.splits
    if tm % 8 or tm > 128:
        raise ValueError(f"tm={tm} must be a multiple of 8 and <= 128")
    if tk % 64 or d % (tk * s_n):
        raise ValueError(f"D={d} must split into {s_n} pieces of a multiple of tk={tk} (tk % 64 == 0)")
    if e % tn:
        raise ValueError(f"E={e} must be a multiple of 64*num_wgs={tn}")
    k_iters = d // (tk * s_n)
    n_t, n_e = t_pad // tm, e // tn
    n_items = n_t * n_e * s_n
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(x_gmem, w_gmem, o_gmem, o_smem):
        def get_pipeline(body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((tn, tk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
                ],
                wg_axis="wg",
                num_compute_wgs=nwg,
                max_concurrent_steps=max(1, min(cfg.stages, k_iters)),
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None
        dk = d // s_n

        @functools.partial(
            pl.run_scoped,
            allocs=get_pipeline(ignore, ignore).get_allocations(
                x_gmem.at[pl.ds(0, tm), pl.ds(0, dk)], w_gmem.at[pl.ds(0, tn), pl.ds(0, dk)]),
            collective_axes="wg",
        )
        def _scope(allocs):
            wg = jax.lax.axis_index("wg")

            # Items ordered (token tile, split, expert block): CTAs running together share x tiles in L2.
            @plgpu.nd_loop((n_items,), collective_axes="sm")
            def _loop(info):
                (lin,) = info.index
                eb = lin % n_e
                sp = (lin // n_e) % s_n
                tt = lin // (n_e * s_n)

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((64, tm), jnp.float32))
                    def _acc(acc_ref):
                        eval_pipeline(acc_ref)
                        y = acc_ref[...]  # [64 experts, tm tokens]: logits^T, partial over this D split
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        o_smem.at[wg][...] = y  # (a transposed f32 store fails Mosaic layout inference)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            o_smem.at[wg], o_gmem.at[sp, pl.ds(eb * tn + wg * 64, 64), pl.ds(tt * tm, tm)])

                def mma_body(_, x_smem, w_smem, acc_ref):
                    plgpu.wgmma(acc_ref, w_smem.at[pl.ds(wg * 64, 64)], x_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return acc_ref

                get_pipeline(mma_body, compute_context)(
                    x_gmem.at[pl.ds(tt * tm, tm), pl.ds(sp * dk, dk)],
                    w_gmem.at[pl.ds(eb * tn, tn), pl.ds(sp * dk, dk)],
                    allocations=allocs,
                )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    num_sms = 2 if interpret else min(_num_sms(), n_items)
    # jit-wrapped and cached: lowered once per program, not per call site (see expert_gemm._build_kernel)
    return jax.jit(plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((s_n, e, t_pad), jnp.float32),
        grid=(num_sms,),
        grid_names=("sm",),
        kernel_name="router_scores",
        num_threads=nwg + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(),
        scratch_types={"o_smem": plgpu.SMEM((nwg, 64, tm), jnp.float32)},
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    ))


# ---------------------------------------------------------------------------------------------------
# kernel 2: sqrt-softplus, bias, top-k in two levels, renorm, scale


def _log1p(u: jax.Array) -> jax.Array:
    """log1p for u in [0, 1] from log (Mosaic GPU has no log1p): log(1+u) * u / ((1+u) - 1) is exact to a
    few ulp (Goldberg), and u itself where 1+u rounds to 1."""
    v = 1.0 + u
    den = v - 1.0
    return jnp.where(den == 0.0, u, jnp.log(v) * (u / jnp.where(den == 0.0, 1.0, den)))


def _sqrt_softplus(z: jax.Array) -> jax.Array:
    """sqrt(softplus(z)) with softplus = max(z, 0) + log1p(exp(-|z|)) (jax.nn.softplus's form)."""
    return jnp.sqrt(jnp.maximum(z, 0.0) + _log1p(jnp.exp(-jnp.abs(z))))


def select_tiling(e: int, k: int) -> tuple[int, int]:
    """-> (r, tb): a token's E scores are r = E/64 rows of 64 experts, and a selection CTA takes tb tokens
    (a multiple of 8 with tb * r <= 64, so that its rows fill one [64, 64] WGMMA-layout tile)."""
    if e % 64:
        raise ValueError(f"E={e} must be a multiple of 64")
    r = e // 64
    if r > 8 or k > 8:
        raise ValueError(f"the selection kernel takes E <= 512 and k <= 8 (E={e}, k={k}); use the XLA route")
    return r, 8 * (8 // r)


@functools.lru_cache(maxsize=None)
def _select_kernel(t_pad: int, e: int, rc: RouteConfig, interpret: bool):
    """logits f32 [t_pad * r, 64] in `select_rows` order, bias f32 [r, 64] -> (weights f32, ids int32), each
    [t_pad / tb, k, 64] (per CTA the k picks of its tb tokens in columns 0..tb-1; the other columns are padding).

    Two levels, each k rounds of (row max, lowest id reaching it, its score, mask) in registers:
    1. The CTA's [64, 64] tile holds row s * tb + t = token t's experts s*64 .. s*64+63: every row keeps its k
       best (key = score + bias, ties to the lower id) as [64, 8] candidates (keys, ids, scores; -inf past k).
    2. Read back from shared memory from row s * tb on, the candidates of segment s are a [64, 8] tile whose
       row t is token t's: the same rounds over the r tiles pick each token's k.
    The top k of a union is the top k of its parts' top k's, and both levels break ties to the lower expert
    id, so this is top_k's selection."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    k = rc.k
    r, tb = select_tiling(e, k)
    if t_pad % tb:
        raise ValueError(f"padded tokens {t_pad} must be a multiple of {tb}")
    rows = tb * r  # rows of the [64, 64] tile that hold scores; the rest are never read back
    n_tiles = t_pad // tb
    kc = 8  # candidate columns per row (one WGMMA column tile)
    inv_temp = 1.0 / rc.gate_temp
    layout = plgpu.Layout.WGMMA
    big = 2 ** 30  # a python int: kernels may not close over jax arrays

    def top_k(keys, vals, ids):
        """Lists of [64, n] tiles holding each row's entries between them -> k rounds of per-row (best key,
        lowest id reaching it, val there), [64] each."""
        out_k, out_i, out_v = [], [], []
        for j in range(k):
            m = functools.reduce(jnp.maximum, [jnp.max(x, axis=1) for x in keys])
            i = functools.reduce(jnp.minimum, [jnp.min(jnp.where(x == m[:, None], d, big), axis=1)
                                               for x, d in zip(keys, ids)])
            hits = [d == i[:, None] for d in ids]
            # one entry holds the id: the other terms are zeros, so the sum is exact
            out_v.append(functools.reduce(jnp.add, [jnp.sum(jnp.where(h, v, 0.0), axis=1)
                                                    for h, v in zip(hits, vals)]))
            out_k.append(m)
            out_i.append(i)
            if j < k - 1:
                keys = [jnp.where(h, -jnp.inf, x) for h, x in zip(hits, keys)]
        return out_k, out_i, out_v

    def columns(vectors, pad):
        """k [64] row vectors -> [64, kc], column j = vectors[j], `pad` past k."""
        col = plgpu.broadcasted_iota(jnp.int32, (64, kc), 1, layout=layout)
        out = jnp.where(col == 0, vectors[0][:, None], pad)
        for j in range(1, k):
            out = jnp.where(col == j, vectors[j][:, None], out)
        return out

    def kernel(l_gmem, b_gmem, w_gmem, i_gmem, z_smem, b_smem, ck_smem, ci_smem, cv_smem, w_smem, i_smem, bars):
        tile = jax.lax.axis_index("tile")
        plgpu.copy_gmem_to_smem(l_gmem.at[pl.ds(tile * rows, rows)], z_smem.at[pl.ds(0, rows)], bars.at[0])
        plgpu.copy_gmem_to_smem(b_gmem, b_smem, bars.at[1])
        plgpu.barrier_wait(bars.at[0])
        plgpu.barrier_wait(bars.at[1])

        # Level 1: scores, keys and expert ids of the [64, 64] tile.
        seg = jax.lax.div(plgpu.broadcasted_iota(jnp.int32, (64, 64), 0, layout=layout), tb)
        ids = seg * 64 + plgpu.broadcasted_iota(jnp.int32, (64, 64), 1, layout=layout)
        sc = _sqrt_softplus(plgpu.load(z_smem, layout=layout) * inv_temp)
        key = sc
        for s in range(r):
            bias_s = plgpu.load(b_smem.at[s], layout=layout.reduce(0))
            key = jnp.where(seg == s, sc + bias_s[None, :], key)
        keys, picks, vals = top_k([key], [sc], [ids])
        ck_smem.at[pl.ds(0, 64)][...] = columns(keys, -jnp.inf)
        ci_smem.at[pl.ds(0, 64)][...] = columns(picks, big)
        cv_smem.at[pl.ds(0, 64)][...] = columns(vals, 0.0)

        # Level 2: r tiles of [64, 8], rows t < tb = token t's candidates from segment s.
        window = lambda ref, s: plgpu.load(ref.at[pl.ds(s * tb, 64)], layout=layout)
        _, picks, vals = top_k([window(ck_smem, s) for s in range(r)], [window(cv_smem, s) for s in range(r)],
                               [window(ci_smem, s) for s in range(r)])

        # Renormalise (same operation order as moe.route) and scale.
        if rc.norm_topk_prob and k > 1:
            tot = vals[0]
            for v in vals[1:]:
                tot = tot + v
            den = tot + EPS
            vals = [v / den for v in vals]
        for j in range(k):
            w_smem.at[j][...] = vals[j] * rc.route_scale
            i_smem.at[j][...] = picks[j]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(w_smem, w_gmem.at[tile])
        plgpu.copy_smem_to_gmem(i_smem, i_gmem.at[tile])
        plgpu.wait_smem_to_gmem(0)

    c_rows = (r - 1) * tb + 64  # the last segment's window ends here (its rows >= tb are never used)
    # jit-wrapped and cached: lowered once per program, not per call site (see expert_gemm._build_kernel)
    return jax.jit(plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((n_tiles, k, 64), jnp.float32),
                  jax.ShapeDtypeStruct((n_tiles, k, 64), jnp.int32)),
        grid=(n_tiles,),
        grid_names=("tile",),
        kernel_name="router_topk",
        compiler_params=plgpu.CompilerParams(),
        scratch_types=[
            plgpu.SMEM((64, 64), jnp.float32),  # logits; rows >= tb * r unwritten
            plgpu.SMEM((r, 64), jnp.float32),  # bias
            plgpu.SMEM((c_rows, kc), jnp.float32),  # candidates: keys, ids, scores
            plgpu.SMEM((c_rows, kc), jnp.int32),
            plgpu.SMEM((c_rows, kc), jnp.float32),
            plgpu.SMEM((k, 64), jnp.float32),
            plgpu.SMEM((k, 64), jnp.int32),
            plgpu.Barrier(num_arrivals=1, num_barriers=2),
        ],
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    ))


def select_rows(logits_t: jax.Array, r: int, tb: int) -> jax.Array:
    """logits^T f32 [E, T_sel] (the split-K sum, experts major) -> [T_sel * r, 64], the selection kernel's rows:
    CTA c's row s * tb + t = token c * tb + t, experts s*64 .. s*64+63 (one XLA transpose)."""
    t_sel = logits_t.shape[1]
    return logits_t.reshape(r, 64, t_sel // tb, tb).transpose(2, 0, 3, 1).reshape(t_sel * r, 64)


def _num_sms() -> int:
    d = jax.devices()[0]
    return int(getattr(d, "core_count", 132)) if d.platform == "gpu" else 132


# ---------------------------------------------------------------------------------------------------
# public entry points


def route_pallas(x: jax.Array, weight: jax.Array, bias: jax.Array, rc: RouteConfig,
                 config: KernelConfig | None = None, interpret: bool = False,
                 perm_method: str = "auto"):
    """x bf16 [T, D], weight bf16 [E, D], bias f32 [E] -> (weights f32 [T, k], ids int32 [T, k],
    order int32 [T*k], group_sizes int32 [E])."""
    t, d = x.shape
    e = weight.shape[0]
    cfg = config or default_config(t, d, e)
    xb = x.astype(jnp.bfloat16)
    if t > 8 and t % 8:  # a TMA descriptor's row count must be < 8 or a multiple of 8 (the 8-row tiling)
        xb = jnp.pad(xb, ((0, _round_up(t, 8) - t), (0, 0)))
    parts = _gate_kernel(_round_up(t, cfg.tm), d, e, cfg, interpret)(xb, weight.astype(jnp.bfloat16))
    # The split-K sum, the selection's token padding and its row order in XLA (one small fusion, fixed order:
    # deterministic).
    r, tb = select_tiling(e, rc.k)
    t_sel = _round_up(t, tb)
    logits_t = jnp.sum(parts, axis=0)  # [E, tokens padded to tm]
    logits_t = jnp.pad(logits_t, ((0, 0), (0, max(t_sel - logits_t.shape[1], 0))))[:, :t_sel]
    w_t, i_t = _select_kernel(t_sel, e, rc, interpret)(select_rows(logits_t, r, tb),
                                                       bias.astype(jnp.float32).reshape(r, 64))
    w = jnp.swapaxes(w_t[:, :, :tb], 1, 2).reshape(-1, rc.k)[:t]
    ids = jnp.swapaxes(i_t[:, :, :tb], 1, 2).reshape(-1, rc.k)[:t]
    order, sizes = permutation(ids, e, perm_method)
    return w, ids, order, sizes


def route_xla(x: jax.Array, gate: dict, cfg):
    """Today's model path: moe.route + the argsort/bincount of moe.routed_experts."""
    from dsv41 import moe

    w, ids = moe.route(x, gate, cfg)
    order, sizes = permutation(ids, gate["weight"].shape[0], "argsort")
    return w, ids, order, sizes


def route_fused(x: jax.Array, gate: dict, cfg, backend: Backend = "pallas", image_mask: jax.Array | None = None,
                config: KernelConfig | None = None):
    """x bf16 [T, D], gate {'weight' bf16 [E, D], 'bias' f32 [E], ...}, cfg a ModelConfig ->
    (weights f32 [T, k], ids int32 [T, k], order int32 [T*k], group_sizes int32 [E]).

    With an image_mask (bias_vl inside image spans) every backend falls back to the XLA route."""
    if image_mask is not None:
        from dsv41 import moe

        w, ids = moe.route(x, gate, cfg, image_mask)
        order, sizes = permutation(ids, gate["weight"].shape[0], "argsort")
        return w, ids, order, sizes
    if backend == "xla":
        return route_xla(x, gate, cfg)
    if backend not in ("pallas", "interpret"):
        raise ValueError(f"unknown backend {backend!r}")
    return route_pallas(x, gate["weight"], gate["bias"], RouteConfig.of(cfg), config,
                        interpret=backend == "interpret")
