"""Which code runs each part of a step, decided once per engine: the attention backend, the kernel options
and the model's `Ops` (FP8 linear kernel, grouped FP4 expert GEMM, fused router, fused mHC site), with the
weights prepared for them. One `Backends` value is the programs' single static choice (part of jit's cache key).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from dsv41 import mhc, moe, quant, sharding
from dsv41.config import ModelConfig
from dsv41.nn import grouped_linear, linear, linear_input
from dsv41.ops import XLA, Ops
from dsv41.quant import Fp4Weight, Numerics
from dsv41.sharding import (ExpertParallel, Parallelism, TensorReplicated, TensorShards, last_dim_spec,
                            per_tensor_rank, ragged_all_to_all_reference, tensor_spec, tensor_sum, tensor_ways)
from pallas_kernels import expert_gemm, fp8_linear, router
from pallas_kernels.indexer_logits import TOPK_METHODS
from pallas_kernels.mhc import mhc_fused


class BackendError(ValueError):
    """A backend choice that cannot run here (the message says why and what to pick instead)."""


# Decode KV path. 'xla': dsv41's attention and indexer on dequantized KV. 'pallas': the fused Mosaic GPU kernels
# (KV writes, indexer scores + top-k, sparse attention; GPU). 'interpret' / 'reference': those kernels in the
# Mosaic GPU interpreter / their jnp references, for tests on any backend.
ATTENTION_BACKENDS = ("xla", "pallas", "interpret", "reference")


# Backends of the fused per-layer sites (mHC, router): 'xla' the plain composition; 'pallas' Mosaic GPU;
# 'interpret' the same kernel in the interpreter, for CPU tests.
SITE_BACKENDS = ("xla", "pallas", "interpret")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Options of the kernel attention path (any attention backend but 'xla'), static in every program (part of
    the jit cache key: a program traced with one setting is never reused for another).

    fuse_rope: the query RoPE and the output's inverse RoPE inside the attention kernel
      (`KernelConfig.fuse_rope`) instead of two XLA passes over q and o (at a 2048-token prefill chunk 128 MB each
      way, per layer). On the H200 (docs/KERNELS_SPARSE_ATTENTION.md): the kernel's GPU tests and the engine
      layer by layer pass; batch-64 decode 9.20 -> 8.98 ms of device time, batch 1 unchanged (4.77 ms). In the
      interpreter the fused kernel equals the unfused one bit for bit (tests/pallas_kernels/test_sparse_attention.py).
    prefill_indexer_kernel: a prefill chunk's indexers through the kernels (`_kernel_index_topk`: the encoder
      indexers and the candidate source through `indexer_chunk`, the layers after it through their candidates)
      instead of XLA's einsum, whose [B, T, heads, G] float32 products grow with the context (`indexer.raw_scores`
      forms them 4 GiB at a time beyond 16K entries). On by default: on the H200 (docs/KERNELS_INDEXER.md)
      `indexer_chunk` scored a 2048-query chunk 3.2-4.0x faster than XLA (4.63 vs 18.51 ms at 64K entries) and a
      64K prompt took 1.171 s against 1.372. (A first version, the decode kernel run on groups of 8 queries, made
      the 64K prompt 32% slower.)
    indexer_topk: how the kernel path's indexers pick their top-k entries and layer 20's blocks, one of
      `indexer_logits.TOPK_METHODS`: 'auto' (`indexer_logits.auto_topk_method`: the threshold kernel
      `topk_select` where the H200 measured it faster: in place of radix select for 64 rows of 2048+ scores,
      in place of lax.top_k for fewer rows of 16384+; else those two, by rows) or 'kernel' (the threshold
      kernel for every row).
    prefill_indexer_block_entries: with prefill_indexer_kernel, a prefill chunk's encoder indexers and candidate
      source (a chunk of more queries than the decode kernel takes, `indexer_chunk.query_group`; fewer score in
      one pass, as a decode step does) score the block table in blocks of about this many entries, only those
      some query sees, each merged into the running top-k (`indexer_logits.context_topk_blocks`), so that their
      work follows the context, not `--max-model-len`: at serve's defaults for the bench preset one pass over the
      whole table writes [chunk, 32-64K entries] float32 scores a layer whatever the prompt. A table of at most
      this many entries is scored in one pass all the same (one block would cost more than the pass: below).
      0: one pass always. On the H200 (docs/PERFORMANCE.md, section 3) with 8192, replay prefill of 1K / 16K
      tokens: in an engine of 131072 tokens 0.052 -> 0.044 s and 0.326 -> 0.227 s; in one of 18432 tokens (4608
      entries a ratio-4 layer) the blocks cost 0.036 -> 0.048 s and 0.201 -> 0.228 s, so such a table keeps the
      one pass."""

    fuse_rope: bool = True
    prefill_indexer_kernel: bool = True
    indexer_topk: str = "auto"
    prefill_indexer_block_entries: int = 8192

    def __post_init__(self):
        if self.indexer_topk not in TOPK_METHODS:
            raise ValueError(f"indexer_topk={self.indexer_topk!r}: one of {list(TOPK_METHODS)}")
        n = self.prefill_indexer_block_entries
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"prefill_indexer_block_entries={n!r}: an integer >= 0 (0: one pass)")


@dataclasses.dataclass(frozen=True)
class Backends:
    """Everything static a program needs to know about which code runs: the decode KV path's backend (one of
    ATTENTION_BACKENDS), the kernel attention path's options, and the model's `Ops`."""

    attention: str = "xla"
    options: KernelOptions = KernelOptions()
    ops: Ops = XLA

    def __post_init__(self):
        if self.attention not in ATTENTION_BACKENDS:
            raise BackendError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")


def scans_layers(b: Backends) -> bool:
    """Whether runs of layers of one kind share one scanned body when `EngineConfig.scan_layers` is unset: on the
    XLA path, yes; where a Mosaic GPU kernel reads weights or the pool, no: the scanned decode step took 25.4 / 39.5
    ms against 19.2 / 34.5 ms unrolled at batch 1 / 64 for a compile of 80 / 103 s against 132 / 151 s (H100,
    Flash's schedule with 16 experts; docs/PERFORMANCE.md section 9), when XLA copied the reindex layer of the
    periodic run L21-39 every period (~2.1 ms a step: its weights sliced inside a `lax.cond`, which also held the
    host every period). Its partial period has stacks of its own since (`layer_runs.Periodic`): at batch 1 on
    another H100 host the scanned step took 21.0 ms against 31.4 ms unrolled, compiled in 108 s against 189 s,
    where the unrolled step is 1.6x the other hosts'; batch 64 and a host with the usual unrolled step are the
    runs before kernels scan."""
    return b.attention != "pallas" and b.ops == XLA


def _small_bf16(rows: int, num: Numerics) -> bool:
    # decode-sized batches only: larger ones were not faster through the kernel, and it takes bf16 only
    return rows <= fp8_linear.MAX_ROWS and num.jdtype == jnp.bfloat16


def _unwrap(w):
    return w.value if isinstance(w, TensorShards) else w


def fp8_linear_op(x: jax.Array, w, num: Numerics, *, fp8_input: bool) -> jax.Array:
    """`Ops.linear` with the FP8 linear kernel on `prepare_linears`' weights for decode-sized bf16 rows: the FP8
    weight is read once and decoded in the kernel. Other weights and sizes: `nn.linear`.

    Under tensor parallelism (w a `TensorShards`) each rank runs the kernel on its slice: a column-parallel
    weight (out split: heads, FFN width) on the whole x, giving its slice of the output; a row-parallel one (in
    split: wo_b, the shared expert's w2) on its slice of x, the partial outputs summed over ranks (each rank's
    partial is rounded to bf16 by the kernel before the sum); a replicated one on the whole x on every rank."""
    rows = math.prod(x.shape[:-1])
    if not (isinstance(_unwrap(w), fp8_linear.PreparedFp8) and _small_bf16(rows, num)):
        return linear(x, _unwrap(w), num, fp8_input=fp8_input)
    x = linear_input(x, num, fp8_input)
    if not isinstance(w, TensorShards):
        return _fp8_linear_rows(x, w)
    col, row = w.split(1), w.split(2)  # PreparedFp8.weight [1, out, in]

    def local(x, pw):
        y = _fp8_linear_rows(x, pw)
        return tensor_sum(y.astype(jnp.float32)).astype(y.dtype) if row else y

    return per_tensor_rank(local, in_specs=(last_dim_spec(x.ndim, row), w.spec_tree()),
                           out_specs=last_dim_spec(x.ndim, col))(x, w.value)


def _fp8_linear_rows(x, w):
    return fp8_linear.fp8_linear(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], -1)


def fp8_grouped_linear_op(x: jax.Array, w, num: Numerics) -> jax.Array:
    """`Ops.grouped_linear` with the FP8 kernel on a `PreparedFp8` [G, out, in] for decode-sized bf16 inputs (G
    groups of one grouped GEMM). Other weights and sizes: `nn.grouped_linear`. Under tensor parallelism (w a
    `TensorShards`, groups split: wo_a's o_groups) each rank runs its groups on its groups' inputs."""
    rows = math.prod(x.shape[:-2])
    if not (isinstance(_unwrap(w), fp8_linear.PreparedFp8) and _small_bf16(rows, num)):
        return grouped_linear(x, _unwrap(w), num)
    x = x.astype(num.jdtype)
    if not isinstance(w, TensorShards):
        return _fp8_grouped_rows(x, w)
    spec = jax.sharding.PartitionSpec(*last_dim_spec(x.ndim - 1, w.split(0)), None)  # [..., G (split), in]
    return per_tensor_rank(_fp8_grouped_rows, in_specs=(spec, w.spec_tree()), out_specs=spec)(x, w.value)


def _fp8_grouped_rows(x, w):
    g, rows = x.shape[-2], math.prod(x.shape[:-2])
    y = fp8_linear.fp8_grouped_linear(jnp.swapaxes(x.reshape(rows, g, -1), 0, 1), w)  # [G, rows, out]
    return jnp.swapaxes(y, 0, 1).reshape(*x.shape[:-1], -1)


def routed_experts_op(x, w, idx, p: dict, cfg: ModelConfig, num: Numerics, permutation=None):
    """`Ops.routed_experts` with the grouped FP4 kernel on `prepare_experts`' weights (else `moe.routed_experts`).

    Under tensor parallelism (the experts `TensorShards`, their width F split: `prepare_experts` lays w13 out so
    that each rank's rows are its slices of w1 then w3) each rank runs both GEMMs on its F-slice for every routed
    token (x, routing replicated) and the partial outputs [T, D] are summed over ranks (float32)."""
    if not isinstance(_unwrap(p.get("w13")), expert_gemm.PreparedFp4):
        return moe.routed_experts(x, w, idx, p, cfg, num, permutation)
    order, sizes = moe.expert_order(idx, cfg.n_routed_experts, permutation)
    if not isinstance(p["w13"], TensorShards):
        return _routed_experts_fp4(x, w, order, sizes, p, cfg, num)
    split = p["w13"].split(1)

    def local(x, w, order, sizes, experts):
        y = _routed_experts_fp4(x, w, order, sizes, experts, cfg, num)
        return tensor_sum(y) if split else y

    rep = jax.sharding.PartitionSpec()
    return per_tensor_rank(local, in_specs=(rep, rep, rep, rep, {k: v.spec_tree() for k, v in p.items()}),
                           out_specs=rep)(x, w, order, sizes, {k: v.value for k, v in p.items()})


def _routed_experts_fp4(x, w, order, sizes, p, cfg: ModelConfig, num: Numerics):
    """`moe.routed_experts` with the grouped FP4 kernel (`prepare_experts`: w13 [E, 2F, D], w2 [E, D, F]).

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
    h = moe.swiglu(gu[:, :f], gu[:, f:], cfg.swiglu_limit)
    h = jnp.where(has_row[:, None], w.reshape(-1)[order[src]][:, None] * h, 0.0).astype(num.jdtype)
    if num.act_quant:
        h = quant.fp8_qdq(h)
    y = expert_gemm.matmul_padded(h.astype(jnp.bfloat16), w2, sched, c2, w2.interpret)  # [t_max * tm, D]
    sorted_row = moe.token_rows(order, T, k)
    # a slot of no group (expert parallelism: another rank's expert) reads past the end: zeros (-1 would wrap to
    # y's last row, which no sorted row may have written)
    rows = jnp.where(sched.valid[sorted_row], sched.pos[sorted_row], y.shape[0])
    ys = jnp.take(y, rows, axis=0, mode="fill", fill_value=0).astype(num.jdtype).astype(jnp.float32)
    return moe.sum_in_expert_order(ys)


@dataclasses.dataclass(frozen=True)
class FusedRoute:
    """`Ops.route` through the fused router kernel (pallas_kernels/router.py: gate GEMM, sqrt-softplus, bias,
    top-k, renormalisation and the experts' permutation) in calls of up to `max_tokens` tokens (None: every
    size). With an image mask the route stays in XLA: the kernel has no bias_vl."""

    backend: str = "pallas"
    max_tokens: int | None = None

    def __call__(self, x, gate: dict, cfg: ModelConfig, image_mask=None):
        if image_mask is not None or (self.max_tokens is not None and x.shape[0] > self.max_tokens):
            return moe.route_plain(x, gate, cfg, image_mask)
        gate = {**gate, "weight": quant.dense(gate["weight"], jnp.bfloat16)}
        w, idx, order, sizes = router.route_fused(x.astype(jnp.bfloat16), gate, cfg, backend=self.backend)
        return w, idx, (order, sizes)


@dataclasses.dataclass(frozen=True)
class FusedMhcSite:
    """`Ops.mhc_site` as one kernel (pallas_kernels/mhc.py, the same roundings: coefficients, collapse, norm and
    the FFN site's expand of the attention output) in calls of up to `max_tokens` tokens (None: every size);
    larger calls take `mhc.site`. The expand of the FFN output stays in XLA, so Engram can rewrite the copies
    before the next block."""

    backend: str = "pallas"
    max_tokens: int | None = None

    def __call__(self, y, h, post, comb, pre, fn, scale, base, norm_w, cfg: ModelConfig):
        if self.max_tokens is not None and math.prod(h.shape[:-2]) > self.max_tokens:
            return mhc.site(y, h, post, comb, pre, fn, scale, base, norm_w, cfg)
        return mhc_fused(y, h, post, comb, pre, fn, scale, base, norm_w, cfg, backend=self.backend)


# 'xla': routed experts dequantized for lax.ragged_dot. 'pallas': the grouped FP4 Mosaic GPU kernel on the
# experts in its layout (`prepare_experts`, once at load). 'interpret': that kernel in the interpreter (CPU tests).
MOE_BACKENDS = ("xla", "pallas", "interpret")
# 'xla': FP8 linears dequantized inside the step. 'pallas': decode batches through the FP8 linear kernel
# (`prepare_linears`, converted once at load); 'interpret': in the interpreter. 'auto' -> 'pallas' on a GPU with
# FP8 linear weights (a release checkpoint) and bf16 activations, else 'xla': on the H200 (release weights, bench
# preset) the kernel took the batch-1 decode step from 6.48 to 4.41 ms of device time, and 9-12% off batch 64
# (9.13 -> 8.38 ms). Engine runs repeat bit for bit with either (compare_engine_runs.py: two runs each, identical
# logits at every step). The two backends differ by the kernel's rounding (0.0055 of the logits at the prefill),
# which flips a near-tied expert choice a few steps on (docs/PERFORMANCE.md).
LINEAR_BACKENDS = ("xla", "pallas", "interpret")
# 'auto' runs a fused site as its kernel in calls of up to this many tokens (None: every size) and in XLA above,
# from the H200's per-call times (docs/PERFORMANCE.md): a block's two mHC sites
# took 18.4 us of GPU time as kernels against 34.6 in XLA (Sinkhorn unrolled) at 1 token, 236 against 164 at 512;
# at 64, 53.2 against 48.7 but in 9 launches against 19, so decode batches up to 64 keep the kernels. The router
# (Flash's 384 experts): 17.0 / 19.3 / 72.3 / 104.8 us against 17.3 / 29.2 / 70.5 / 182.8 at 1 / 64 / 512 / 2048
# tokens, so the kernel at every size.
SITE_KERNEL_MAX_TOKENS = {"mhc": 64, "router": None}


def resolve_linear_backend(params: dict, backend: str, num: Numerics) -> str:
    if backend not in ("auto", *LINEAR_BACKENDS):
        raise BackendError(f"linear_backend must be 'auto' or one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "xla":
        return "xla"
    is_fp8 = lambda w: isinstance(w, quant.Fp8Weight)
    fp8 = any(is_fp8(w) for w in jax.tree_util.tree_leaves(params["layers"], is_leaf=is_fp8))
    why = ("needs a CUDA GPU" if backend != "interpret" and jax.default_backend() != "gpu" else
           "needs FP8 linear weights (a release checkpoint, or init_params without dtype)" if not fp8 else
           f"needs bfloat16 activations (numerics dtype {num.dtype})" if num.jdtype != jnp.bfloat16 else "")
    if backend == "auto":
        return "xla" if why else "pallas"
    if why:
        raise BackendError(f"linear_backend={backend!r} {why}; use 'xla'")
    return backend


def resolve_backends(cfg: ModelConfig, params: dict, attention: str, moe_backend: str, mhc_backend: str = "auto",
                     router_backend: str = "auto", num: Numerics = quant.REFERENCE, width_ways: int = 1):
    """-> (attention backend, MoE backend, the mHC site op, the route op: `Ops.mhc_site` / `Ops.route`).
    'auto' -> the Mosaic GPU kernels on a GPU
    where the shapes and weight formats allow them, else XLA. An explicit 'pallas' that cannot run raises
    BackendError saying why. 'auto' runs the mHC and router sites as kernels in calls of up to
    SITE_KERNEL_MAX_TOKENS tokens (the mHC sites: decode batches) and in XLA in larger ones, where the kernels were
    not faster on the H200; an explicit 'pallas' runs them at every size. width_ways: the tensor ranks that split
    the routed experts' width (tensor parallelism without expert parallelism): the kernel's shape limits apply to
    one rank's slice."""
    gpu = jax.default_backend() == "gpu"
    site = {"mhc": mhc_backend, "router": router_backend}
    try:
        router.select_tiling(cfg.n_routed_experts, cfg.n_activated_experts)
        selectable = True
    except ValueError:
        selectable = False
    shapes = {"mhc": f"needs dim % 128 == 0 (dim {cfg.dim})" if cfg.dim % 128 else "",
              "router": f"needs dim % 128 == 0, n_routed_experts a multiple of 64 up to 512 and at most 8 "
                        f"activated ({cfg.dim}, {cfg.n_routed_experts}, {cfg.n_activated_experts})"
              if cfg.dim % 128 or not selectable else ""}
    if num.jdtype != jnp.bfloat16:
        shapes["mhc"] = shapes["mhc"] or f"needs bfloat16 activations (numerics dtype {num.dtype})"
    for name, be in site.items():
        if be not in ("auto", *SITE_BACKENDS):
            raise BackendError(f"{name}_backend must be 'auto' or one of {SITE_BACKENDS}, got {be!r}")
        why = "needs a CUDA GPU" if be == "pallas" and not gpu else shapes[name] if be != "auto" else ""
        if be != "xla" and why:
            raise BackendError(f"{name}_backend={be!r} {why}; use 'xla'")
    auto = {n: "pallas" if gpu and not shapes[n] else "xla" for n in site}
    chosen = {n: auto[n] if be == "auto" else be for n, be in site.items()}
    limits = {f"{n}_max_tokens": SITE_KERNEL_MAX_TOKENS[n] for n, be in site.items()
              if be == "auto" and chosen[n] != "xla"}
    mhc_site = mhc.site if chosen["mhc"] == "xla" else FusedMhcSite(chosen["mhc"], limits.get("mhc_max_tokens"))
    route = moe.route_plain if chosen["router"] == "xla" else FusedRoute(chosen["router"],
                                                                          limits.get("router_max_tokens"))
    if attention not in ("auto", *ATTENTION_BACKENDS):
        raise BackendError(f"attention_backend must be 'auto' or one of {ATTENTION_BACKENDS}, "
                          f"got {attention!r}")
    if moe_backend not in ("auto", *MOE_BACKENDS):
        raise BackendError(f"moe_backend must be 'auto' or one of {MOE_BACKENDS}, got {moe_backend!r}")
    attn_why = ("needs a CUDA GPU" if not gpu else
                f"needs head_dim % 128 == 0 and n_heads <= 64 (head_dim {cfg.head_dim}, n_heads {cfg.n_heads})"
                if cfg.head_dim % 128 or cfg.n_heads > 64 else "")
    fp4 = all(isinstance(_unwrap(w), (quant.Fp4Weight, expert_gemm.PreparedFp4))
              for lp in params["layers"] + params.get("mtp", []) for w in lp["ffn"]["experts"].values())
    moe_why = ("needs a CUDA GPU" if not gpu else
               "needs FP4 expert weights (a release checkpoint, or init_params without dtype)" if not fp4 else
               f"needs dim and moe_inter_dim / (tensor ranks splitting it) multiples of 256 ({cfg.dim}, "
               f"{cfg.moe_inter_dim} / {width_ways})" if cfg.dim % 256 or (cfg.moe_inter_dim // width_ways) % 256
               else "")
    if attention == "auto":
        attention = "xla" if attn_why else "pallas"
    elif attention == "pallas" and attn_why:
        raise BackendError(f"attention_backend='pallas' {attn_why}; use 'xla'")
    if moe_backend == "auto":
        moe_backend = "xla" if moe_why else "pallas"
    elif moe_backend == "pallas" and moe_why:
        raise BackendError(f"moe_backend='pallas' {moe_why}; use 'xla'")
    elif moe_backend == "interpret" and not fp4:
        raise BackendError("moe_backend='interpret' needs FP4 expert weights")
    elif moe_backend == "interpret" and (cfg.moe_inter_dim // width_ways) % 128:
        raise BackendError(f"moe_backend='interpret' needs each tensor rank's expert width a multiple of 128 "
                           f"(moe_inter_dim {cfg.moe_inter_dim} / {width_ways}); use 'xla'")
    return attention, moe_backend, mhc_site, route


# build_abstract's placements: the mesh sharding of each traced leaf, by id (a tracer carries none)
_TRACED_PLACEMENT: dict[int, jax.sharding.NamedSharding] = {}


def build_abstract(cfg: ModelConfig, params: dict, num: Numerics, **kw) -> tuple[Backends, dict]:
    """`build` over a tree of jax.ShapeDtypeStructs: the same choices, the prepared tree's shapes (nothing
    computed), each leaf with the sharding `build` gives it on a mesh (a leaf no placement names: replicated)."""
    chosen = {}
    in_shardings = [getattr(x, "sharding", None) for x in jax.tree_util.tree_leaves(params)]

    def prepare(p):
        for x, sh in zip(jax.tree_util.tree_leaves(p), in_shardings):
            if isinstance(sh, jax.sharding.NamedSharding):
                _TRACED_PLACEMENT[id(x)] = sh
        chosen["backends"], out = build(cfg, p, num, **kw)
        chosen["shardings"] = [_TRACED_PLACEMENT.get(id(x)) for x in jax.tree_util.tree_leaves(out)]
        return out

    try:
        prepared = jax.eval_shape(prepare, params)
    finally:
        _TRACED_PLACEMENT.clear()
    mesh = next((sh.mesh for sh in in_shardings if isinstance(sh, jax.sharding.NamedSharding)), None)
    if mesh is not None:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        leaves, tree = jax.tree_util.tree_flatten(prepared)
        prepared = jax.tree_util.tree_unflatten(tree, [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh or replicated)
            for x, sh in zip(leaves, chosen["shardings"])])
    return chosen["backends"], prepared


def build(cfg: ModelConfig, params: dict, num: Numerics, *, attention: str = "auto", moe_backend: str = "auto",
          mhc_backend: str = "auto", router_backend: str = "auto", linear_backend: str = "auto",
          options: KernelOptions = KernelOptions(), parallelism: Parallelism = Parallelism()) -> tuple[Backends, dict]:
    """Resolves every backend choice ('auto' or explicit, `resolve_backends` / `resolve_linear_backend`) and
    prepares the weights the chosen kernels read. params: the tree without Engram tables.
    -> (the programs' `Backends`, the prepared tree). Raises BackendError for a choice that cannot run.

    On a mesh the programs run per data rank, so with tensor_parallel_size 1 every kernel sees whole local
    arrays and runs as on one device. With tensor parallelism each kernel op runs on each tensor rank's shards
    inside a `shard_map` over the tensor axis (a kernel, one device's Mosaic GPU program, is not partitioned by
    XLA): the prepared weights are split as the dense ones (`TensorShards`), the routed experts and the FP8
    linears run on their slices with the sums the split needs, the mHC and router sites run whole on every rank
    (`TensorReplicated`: their weights are replicated), and in the KV path (programs.py) the KV writes and the
    indexer run whole on every rank, the sparse attention on each rank's heads. Expert
    parallelism wraps the chosen routed-experts op in `sharding.ExpertParallel` (each rank its experts; the tokens
    exchanged as `Parallelism.all2all` says)."""
    tp = parallelism.tensor > 1
    width_ways = parallelism.tensor if not parallelism.expert else 1
    attention, moe_backend, mhc_site, route = resolve_backends(cfg, params, attention, moe_backend, mhc_backend,
                                                               router_backend, num, width_ways)
    if moe_backend != "xla":
        params = prepare_experts(params, interpret=moe_backend == "interpret")
    linear_backend = resolve_linear_backend(params, linear_backend, num)
    if linear_backend != "xla":
        params = prepare_linears(params, cfg, interpret=linear_backend == "interpret")
    if tp:  # the fused sites' weights are replicated: every tensor rank runs the kernel whole
        mhc_site = mhc_site if mhc_site is mhc.site else TensorReplicated(mhc_site)
        route = route if route is moe.route_plain else TensorReplicated(route)
    ops = kernel_ops(experts=moe_backend != "xla", linears=linear_backend != "xla", mhc_site=mhc_site, route=route)
    if parallelism.expert:
        ops = dataclasses.replace(ops, routed_experts=expert_parallel(ops.routed_experts, parallelism))
    return Backends(attention, options, ops), params


def expert_parallel(routed_experts, parallelism: Parallelism) -> ExpertParallel:
    """routed_experts (an `Ops.routed_experts`) on each expert-parallel rank's experts, the tokens exchanged as
    parallelism.all2all says. XLA's CPU backend has no ragged-all-to-all: there (tests) the exchange runs through
    its all-gather form."""
    ragged = ragged_all_to_all_reference if jax.default_backend() == "cpu" else jax.lax.ragged_all_to_all
    return ExpertParallel(routed_experts, parallelism.tensor, parallelism.all2all, ragged)


def kernel_ops(*, experts: bool = False, linears: bool = False, mhc: str = "xla", router: str = "xla",
               mhc_site=None, route=None) -> Ops:
    """The model's `Ops` with the chosen kernels. experts: the grouped FP4 GEMM on `prepare_experts`' weights;
    linears: the FP8 linear kernel on `prepare_linears`' weights (both fall back to XLA on other weights);
    mhc / router: a site backend (SITE_BACKENDS) at every size, or mhc_site / route: the op itself."""
    for name, be in (("mhc", mhc), ("router", router)):
        if be not in SITE_BACKENDS:
            raise BackendError(f"{name} must be one of {SITE_BACKENDS}, got {be!r}")
    if mhc_site is None:
        mhc_site = XLA.mhc_site if mhc == "xla" else FusedMhcSite(mhc)
    if route is None:
        route = XLA.route if router == "xla" else FusedRoute(router)
    ops = dataclasses.replace(XLA, mhc_site=mhc_site, route=route)
    if experts:
        ops = dataclasses.replace(ops, routed_experts=routed_experts_op)
    if linears:
        ops = dataclasses.replace(ops, linear=fp8_linear_op, grouped_linear=fp8_grouped_linear_op)
    return ops


# The FP8 linears that run through `Ops.linear`, by path in a layer (wo_a: `Ops.grouped_linear`, GROUPED_FP8_LINEARS).
FP8_LINEARS = (("attn", "wq_a"), ("attn", "wq_b"), ("attn", "wkv"), ("attn", "wo_b"), ("attn", "indexer", "wq_b"),
               ("ffn", "shared_experts", "w1"), ("ffn", "shared_experts", "w2"), ("ffn", "shared_experts", "w3"),
               ("engram", "wkv"))


# Grouped linears stored dense in our tree but FP8 in the release (convert.py dequantizes wo_a): their values
# are FP8 values, so `prepare_linears` takes them back to FP8 exactly (and leaves them dense if they are not).
GROUPED_FP8_LINEARS = (("attn", "wo_a"),)


def _placement(a) -> jax.sharding.NamedSharding | None:
    """A placed array's mesh sharding (None: one device; a tracer: `build_abstract`'s record of it)."""
    if isinstance(a, jax.core.Tracer):
        return _TRACED_PLACEMENT.get(id(a))
    sh = getattr(a, "sharding", None)
    return sh if isinstance(sh, jax.sharding.NamedSharding) else None


def _place_like(pw, sh: jax.sharding.NamedSharding | None, weight_dims, scale_dims, wrap: bool = True):
    """A kernel-layout weight (`PreparedFp8` / `PreparedFp4`: `weight`, `scale_t`) split as the dense weight it
    was made from is split (sh; None: as it is). weight_dims / scale_dims: for each dim of pw.weight /
    pw.scale_t, the dense weight's dim it indexes (None: a dim of its own, whole). On a mesh with tensor ranks
    and wrap, the result is a `TensorShards` (its kernel op then runs per tensor rank)."""
    if sh is None:
        return pw
    dense = tuple(sh.spec) + (None,) * (max(d for d in (*weight_dims, *scale_dims) if d is not None) + 1)
    specs = [jax.sharding.PartitionSpec(*(None if d is None else dense[d] for d in dims))
             for dims in (weight_dims, scale_dims)]
    shardings = [jax.sharding.NamedSharding(sh.mesh, sp) for sp in specs]
    placed = [jax.device_put(a, s) for a, s in zip((pw.weight, pw.scale_t), shardings)]
    for a, s in zip(placed, shardings):
        if isinstance(a, jax.core.Tracer):  # an abstract tree's (`build_abstract`)
            _TRACED_PLACEMENT[id(a)] = s
    pw = dataclasses.replace(pw, weight=placed[0], scale_t=placed[1])
    if not wrap or sh.mesh.shape.get(sharding.TENSOR, 1) == 1:
        return pw
    return TensorShards(pw, tuple(tensor_spec(s, a.ndim) for a, s in zip(placed, shardings)))


def _local_fp8(w, sh, grouped: bool, groups: int = 1):
    """The [out, in] shape one tensor rank holds of a dense FP8 linear [out, in] placed with sh (grouped: wo_a
    [G * out, in] split on G) -> (out, in) per group, for the kernel's shape limits and its K slices."""
    n, k = w.shape[-2:]
    if grouped:
        return n // groups, k // tensor_ways(sh, 1)
    return n // tensor_ways(sh, 0), k // tensor_ways(sh, 1)


def _local_splits(pw, n: int, k: int, groups: int):
    """pw with the K slices of one rank's block [groups, n, k] (a row-parallel rank holds K / tensor)."""
    if (groups, n, k) == pw.weight.shape:
        return pw
    return dataclasses.replace(pw, splits=fp8_linear.splits(n, k, expert_gemm._num_sms(), groups))


def _grouped_fp8(w, groups: int, interpret: bool):
    """A dense [G * out, in] weight holding FP8 values -> PreparedFp8 [G, out, in], or None where its values are
    not exactly FP8 with 32x32 block scales (then it stays dense)."""
    if quant.is_quantized(w) or w.ndim != 2 or w.shape[0] % groups:
        return None
    q, exact = _as_grouped_fp8(w, groups)
    if not fp8_linear.supported(q):
        return None
    if not isinstance(exact, jax.core.Tracer) and not bool(exact):  # abstract trees take the kernel layout as given
        return None
    return fp8_linear.prepare_fp8_linear(q, interpret=interpret)


@functools.partial(jax.jit, static_argnames="groups")
def _as_grouped_fp8(w: jax.Array, groups: int) -> tuple[quant.Fp8Weight, jax.Array]:
    """(w quantized as [G, out, in] FP8 with 32x32 block scales, whether that holds w's values exactly)."""
    q = quant.quantize_fp8_weight(w.reshape(groups, -1, w.shape[-1]))
    return q, jnp.array_equal(q.dequantize(w.dtype).reshape(w.shape), w)


def prepare_linears(params: dict, cfg, interpret: bool = False) -> dict:
    """The FP8 linears (`FP8_LINEARS`, and `GROUPED_FP8_LINEARS` in `cfg.o_groups` groups) in the FP8 linear
    kernel's layout (once, at load): `fp8_linear_op` / `fp8_grouped_linear_op` then read each weight byte once at decode
    instead of XLA writing a bf16 copy first. Weights the kernel cannot take (not FP8, dims not multiples of
    128) stay as they are. Returns a new tree; the old weights are dropped layer by layer."""
    def convert(tree: dict, path: tuple[str, ...], grouped: bool) -> dict:
        head, *rest = path
        if head not in tree:
            return tree
        if rest:
            return {**tree, head: convert(tree[head], tuple(rest), grouped)}
        w = tree[head]
        sh = _placement(w if grouped else getattr(w, "weight", None))
        n, k = _local_fp8(w, sh, grouped, cfg.o_groups)
        if n % fp8_linear.TN or k % fp8_linear.TK:  # a rank's slice is below the kernel's tiles
            return tree
        if grouped:
            pw = _grouped_fp8(w, cfg.o_groups, interpret)
            if pw is None:
                return tree
            g = cfg.o_groups // tensor_ways(sh, 0) if sh is not None else cfg.o_groups
            pw = _place_like(_local_splits(pw, n, k, g), sh, (0, None, 1), (0, 1, None))
            return {**tree, head: pw}
        if not fp8_linear.supported(w):
            return tree
        pw = fp8_linear.prepare_fp8_linear(w, interpret=interpret)
        return {**tree, head: _place_like(_local_splits(pw, n, k, 1), sh, (None, 0, 1), (None, 1, 0))}

    def block(lp: dict, _name: str) -> dict:
        for path in FP8_LINEARS:
            lp = convert(lp, path, False)
        for path in GROUPED_FP8_LINEARS:
            lp = convert(lp, path, True)
        return lp

    return _map_blocks(params, block)


def _map_blocks(params: dict, fn) -> dict:
    """fn(block, its name) over every block of the tree: the layers, then the DSpark stages (`mtp`, when present),
    one at a time."""
    out = {**params, "layers": [fn(lp, f"layer {i}") for i, lp in enumerate(params["layers"])]}
    if "mtp" in params:
        out["mtp"] = [fn(sp, f"DSpark stage {i}") for i, sp in enumerate(params["mtp"])]
    return out


def prepare_experts(params: dict, interpret: bool = False) -> dict:
    """The routed experts' FP4 weights in the grouped-GEMM kernel's layout (once, at load): `routed_experts_op`
    then runs the Mosaic GPU kernel instead of dequantizing every expert for lax.ragged_dot. w1 and w3 become
    one weight 'w13' [E, 2F, D] (one call per layer for both). The old arrays are dropped as each layer is
    converted, so peak memory grows by one layer's experts.

    On a mesh the prepared weights are split as the FP4 ones are: on the experts (expert parallelism:
    `ExpertParallel` runs the kernel on each rank's experts) or on the width F (tensor parallelism: a
    `TensorShards`, w13 laid out so that each rank's block is its slices of w1 then w3)."""
    def block(lp: dict, name: str) -> dict:
        ex = lp["ffn"]["experts"]
        bad = [k for k, w in ex.items() if not isinstance(_unwrap(w), (Fp4Weight, expert_gemm.PreparedFp4))]
        if bad:
            raise ValueError(f"{name}: routed experts {bad} are not FP4 (the release's format); the grouped FP4 kernel "
                             f"needs FP4 weights: load a release checkpoint or use init_params without dtype")
        if all(isinstance(_unwrap(w), expert_gemm.PreparedFp4) for w in ex.values()):
            return lp
        sh = {k: _placement(w.weight) for k, w in ex.items()}
        # experts split over tensor ranks (expert parallelism): ExpertParallel's shard_map gives the kernel its own
        wrap = all(s is None or tensor_ways(s, 0) == 1 for s in sh.values())
        ex = {k: expert_gemm.prepare_fp4_experts(w, interpret=interpret) for k, w in ex.items()}
        if "w1" in ex:
            blocks = 1 if sh["w1"] is None else tensor_ways(sh["w1"], 1)
            ex = {"w13": expert_gemm.concat_out_features(ex.pop("w1"), ex.pop("w3"), blocks=blocks), **ex}
            sh["w13"] = sh.pop("w1")
        ex = {k: _place_like(w, sh[k], (0, 1, 2), (0, 2, 1), wrap) for k, w in ex.items()}
        return {**lp, "ffn": {**lp["ffn"], "experts": ex}}

    return _map_blocks(params, block)
