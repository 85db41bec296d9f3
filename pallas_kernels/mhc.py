"""Fused mHC site (Mega-mHC analog): expand -> coefficients -> delayed-pre collapse -> RMSNorm, issue #6.

Between two sublayers `dsv41.model.block` runs, per token (h: hc=4 copies of D=5120, bf16):

    h1 = mhc.expand(y, h, post, comb)                          # post step of the previous sublayer
    pre', post', comb' = mhc.coefficients(h1, fn, scale, base)  # RMS over hc*D, 24 x (hc*D) f32 dots, Sinkhorn
    x = rms_norm(mhc.collapse(h1, pre_delayed), norm_w)         # the *delayed* pre-mix, not pre'

`mhc_fused(y, h, post, comb, pre_delayed, fn, scale, base, norm_w, cfg, backend=)` returns
(h1 [T, hc, D] bf16, x [T, D] bf16, pre' [T, hc] f32, post' [T, hc] f32, comb' [T, hc, hc] f32).
y=None (with post/comb None) is the first site of the model: no expand, h1 = h.

Backends:
- 'xla': the plain-jnp reference, the composition of dsv41.mhc / dsv41.nn functions (what the model runs today).
- 'pallas': one Mosaic GPU kernel + one small XLA epilogue (two phases: the RMS statistics and the 24 dot
  products need the whole token, and the kernel spreads D over CTAs).
- 'interpret': the same kernel in the Mosaic GPU interpreter (CPU tests).

Phase 1, the kernel: grid (D / dc column chunks, T / tt token blocks), one warpgroup per CTA. A CTA TMA-loads
its fn chunk [24, hc, dc] f32 once and its tokens' h [tt, hc, dc] (and y [tt, dc]), then per token:
  h1_j = bf16(post_j * y + sum_i comb[i, j] * h_i)     -> written out (bf16, exactly the reference rounding)
  xc   = bf16(sum_j pre_delayed_j * h1_j)               -> written out (the un-normalized collapse)
  26 per-thread partial vectors: sum_j fn[m, j] * h1_j (m < 24), sum_j h1_j^2, xc^2, stored as rows of a
  [64, dc + 8] f32 tile in shared memory (two tokens x 32 rows), which is read back in the WGMMA register
  layout so that one row reduction (in-thread adds + 2 shuffles) reduces 2 x 26 values at once (a full
  reduction per value would cost a shared-memory round trip and a barrier each).
  -> partial sums [D / dc, T / tt, ceil(tt / 2), 64] f32 (per token 32 rows, 26 used).
All dot products are f32 FMAs on CUDA cores (the reference uses f32 HIGHEST); only the summation order differs.

Phase 2 (XLA, fuses into a couple of small kernels): sum the partials over chunks, rs = rsqrt(mean h1^2 + eps),
mix = dots * rs, sigmoids, softmax + Sinkhorn (`mhc.coefficients_from_mix`, straight-line code that XLA fuses),
x = bf16(w * xc * rsqrt(mean xc^2 + eps)).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

from dsv41 import mhc
from dsv41.config import ModelConfig
from dsv41.nn import rms_norm

Backend = Literal["pallas", "xla", "interpret"]

S_PAD = 8  # floats of padding per row of the reduction tile (bank conflicts, see the scratch list)
ROWS = 64  # rows of the reduction tile (one WGMMA row block): 2 tokens x TOKEN_ROWS
TOKEN_ROWS = 32  # statistic rows per token; rows >= 26 unused


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    dc: int = 128  # D columns per CTA: a multiple of 128 (one f32 per thread per strided vector), <= 256 (TMA box)
    tt: int = 8  # max tokens per CTA (the fn chunk is loaded once per CTA and reused for its tokens)


def default_config(t: int, d: int) -> KernelConfig:
    del t, d
    return KernelConfig()


# ---------------------------------------------------------------------------------------------------
# reference (the model's code path)


def mhc_reference(y, h, post, comb, pre_delayed, fn, scale, base, norm_w, cfg: ModelConfig):
    """Plain jnp, the composition of dsv41.mhc functions exactly as dsv41.model.block chains them.

    y [T, D] bf16 or None, h [T, hc, D] bf16, post [T, hc], comb [T, hc, hc], pre_delayed [T, hc] f32,
    fn [24, hc*D] f32, scale [3], base [24] f32, norm_w [D] -> (h1, x, pre, post, comb)."""
    h1 = h if y is None else mhc.expand(y, h, post, comb)
    pre2, post2, comb2 = mhc.coefficients(h1, fn, scale, base, cfg)
    x = rms_norm(mhc.collapse(h1, pre_delayed), norm_w, cfg.norm_eps)
    return h1, x, pre2, post2, comb2


# ---------------------------------------------------------------------------------------------------
# phase 2: statistics -> coefficients and the normalized collapse


def _finish(part, xc, scale, base, norm_w, cfg: ModelConfig):
    """part [C, T, TOKEN_ROWS] f32 partial sums, xc [T, D] bf16 -> x [T, D] bf16, pre, post, comb."""
    hc, d = cfg.hc_mult, xc.shape[-1]
    nm = (2 + hc) * hc
    tot = jnp.sum(part[..., :nm + 2], axis=0)  # [T, 26]
    rs = jax.lax.rsqrt(tot[:, nm:nm + 1] / (hc * d) + cfg.norm_eps)
    pre, post, comb = mhc.coefficients_from_mix(tot[:, :nm] * rs, scale, base, cfg)
    rx = jax.lax.rsqrt(tot[:, nm + 1:nm + 2] / d + cfg.norm_eps)
    x = (norm_w.astype(jnp.float32) * (xc.astype(jnp.float32) * rx)).astype(xc.dtype)
    return x, pre, post, comb


# ---------------------------------------------------------------------------------------------------
# phase 1: the Mosaic GPU kernel


def _token_block(t: int, cap: int) -> int:
    """Largest divisor of t that is <= cap (no padding copies; decode T is small)."""
    return max(b for b in range(1, min(t, cap) + 1) if t % b == 0)


@functools.lru_cache(maxsize=None)
def _build_kernel(t: int, hc: int, d: int, first: bool, cfg: KernelConfig, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    dc = cfg.dc
    if dc % 128 or dc > 256:
        raise ValueError(f"dc={dc} must be a multiple of 128 and <= 256")
    if d % dc:
        raise ValueError(f"D={d} must be a multiple of dc={dc}")
    nm = (2 + hc) * hc
    if nm + 2 > TOKEN_ROWS:
        raise ValueError(f"hc={hc} needs {nm + 2} statistic rows > {TOKEN_ROWS}")
    tt = _token_block(t, cfg.tt)
    n_chunks, n_tblocks = d // dc, t // tt
    pairs = (tt + 1) // 2
    f32, bf16 = jnp.float32, jnp.bfloat16

    def kernel(*refs):
        if first:  # h1 = h: nothing to write back (the wrapper returns the input)
            (h_g, pre_g, fn_g, xc_g, part_g,
             fn_s, h_s, h1_s, xc_s, s_s, p_s, bars) = refs
            y_g = post_g = comb_g = y_s = h1_g = None
        else:
            (y_g, h_g, post_g, comb_g, pre_g, fn_g, h1_g, xc_g, part_g,
             fn_s, h_s, y_s, h1_s, xc_s, s_s, p_s, bars) = refs
        c = jax.lax.axis_index("c")
        tb = jax.lax.axis_index("t")
        d0 = c * dc
        t0 = tb * tt
        plgpu.copy_gmem_to_smem(fn_g.at[:, :, pl.ds(d0, dc)], fn_s, bars.at[0])
        plgpu.copy_gmem_to_smem(h_g.at[pl.ds(t0, tt), :, pl.ds(d0, dc)], h_s, bars.at[1])
        if not first:
            plgpu.copy_gmem_to_smem(y_g.at[pl.ds(t0, tt), pl.ds(d0, dc)], y_s, bars.at[2])
            plgpu.barrier_wait(bars.at[2])
        plgpu.barrier_wait(bars.at[1])
        plgpu.barrier_wait(bars.at[0])

        def write_stats(tl, base):
            """Token tl: h1, xc to smem, its 26 partial vectors to rows base.. of s_s."""
            tg = t0 + tl
            if first:
                h1b = [h_s[tl, j, :] for j in range(hc)]
            else:
                hs = [h_s[tl, i, :].astype(f32) for i in range(hc)]
                yv = y_s[tl, :].astype(f32)
                h1b = []
                for j in range(hc):
                    mixed = comb_g[tg, 0, j] * hs[0]
                    for i in range(1, hc):
                        mixed = mixed + comb_g[tg, i, j] * hs[i]
                    v = (post_g[tg, j] * yv + mixed).astype(bf16)
                    h1_s[tl, j, :] = v
                    h1b.append(v)
            h1f = [v.astype(f32) for v in h1b]
            xcf = pre_g[tg, 0] * h1f[0]
            for j in range(1, hc):
                xcf = xcf + pre_g[tg, j] * h1f[j]
            xb = xcf.astype(bf16)
            xc_s[tl, :] = xb
            xq = xb.astype(f32)

            def dot_row(m, carry):
                a = fn_s[m, 0, :] * h1f[0]
                for j in range(1, hc):
                    a = a + fn_s[m, j, :] * h1f[j]
                s_s[base + m, pl.ds(0, dc)] = a
                return carry

            jax.lax.fori_loop(0, nm, dot_row, 0)
            sq = h1f[0] * h1f[0]
            for j in range(1, hc):
                sq = sq + h1f[j] * h1f[j]
            s_s[base + nm, pl.ds(0, dc)] = sq
            s_s[base + nm + 1, pl.ds(0, dc)] = xq * xq

        def reduce_pair(pi):
            plgpu.commit_smem()  # every thread's rows are visible before the transposed read below
            acc = plgpu.load(s_s.at[:, pl.ds(0, 64)], layout=plgpu.Layout.WGMMA, optimized=False)
            for k in range(1, dc // 64):
                acc = acc + plgpu.load(s_s.at[:, pl.ds(64 * k, 64)], layout=plgpu.Layout.WGMMA, optimized=False)
            p_s[pi, :] = jnp.sum(acc, axis=1)  # [64] = 2 tokens x TOKEN_ROWS
            plgpu.commit_smem()  # the next pair overwrites s_s

        def pair(pi, carry):
            write_stats(2 * pi, 0)
            write_stats(2 * pi + 1, TOKEN_ROWS)
            reduce_pair(pi)
            return carry

        jax.lax.fori_loop(0, tt // 2, pair, 0)
        if tt % 2:  # the last token alone; rows TOKEN_ROWS.. are stale and land in the padding slot tt
            write_stats(tt - 1, 0)
            reduce_pair(tt // 2)
        plgpu.commit_smem()
        if not first:
            plgpu.copy_smem_to_gmem(h1_s, h1_g.at[pl.ds(t0, tt), :, pl.ds(d0, dc)])
        plgpu.copy_smem_to_gmem(xc_s, xc_g.at[pl.ds(t0, tt), pl.ds(d0, dc)])
        plgpu.copy_smem_to_gmem(p_s, part_g.at[c, tb])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((nm, hc, dc), f32),  # fn chunk
        plgpu.SMEM((tt, hc, dc), bf16),  # h
    ]
    if not first:
        scratch.append(plgpu.SMEM((tt, dc), bf16))  # y
    scratch += [
        plgpu.SMEM((tt, hc, dc), bf16),  # h1 (unused at the first site, where h1 = h)
        plgpu.SMEM((tt, dc), bf16),  # xc
        # per-thread partial vectors, one row per statistic; rows padded by 8 floats so the transposed (WGMMA
        # layout) read of 8 rows x 8 columns per warp hits distinct banks (unpadded: 8-way conflicts)
        plgpu.SMEM((ROWS, dc + S_PAD), f32),
        plgpu.SMEM((pairs, ROWS), f32),  # reduced statistics of this CTA's token pairs
        plgpu.Barrier(num_barriers=3),
    ]
    out_type = (
        *(() if first else (jax.ShapeDtypeStruct((t, hc, d), bf16),)),
        jax.ShapeDtypeStruct((t, d), bf16),
        jax.ShapeDtypeStruct((n_chunks, n_tblocks, pairs, ROWS), f32),
    )
    # jit-wrapped and cached: lowered once per program, not per call site (see expert_gemm._build_kernel)
    return jax.jit(plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(n_chunks, n_tblocks),
        grid_names=("c", "t"),
        kernel_name="mhc_site",
        # Lane semantics: layouts are fixed by the ops (the warpgroup semantics' layout inference search did not
        # finish in 5 minutes on this kernel). No auto barriers: every smem hazard is covered by the explicit
        # commit_smem() calls (about 30 stores per token would otherwise each get a warpgroup barrier).
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             unsafe_no_auto_barriers=True),
        scratch_types=scratch,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    ))


def mhc_fused_pallas(y, h, post, comb, pre_delayed, fn, scale, base, norm_w, cfg: ModelConfig,
                     config: KernelConfig | None = None, interpret: bool = False):
    t, hc, d = h.shape
    kc = config or default_config(t, d)
    first = y is None
    call = _build_kernel(t, hc, d, first, kc, interpret)
    fn3 = fn.astype(jnp.float32).reshape(fn.shape[0], hc, d)  # free: hc-major, as the reference flattens
    pre_d = pre_delayed.astype(jnp.float32)
    if first:  # h1 = h, returned as given: writing it back would add 40 KB a token (at D=5120) for nothing
        h1 = h.astype(jnp.bfloat16)
        xc, part = call(h1, pre_d, fn3)
    else:
        h1, xc, part = call(y.astype(jnp.bfloat16), h.astype(jnp.bfloat16), post.astype(jnp.float32),
                            comb.astype(jnp.float32), pre_d, fn3)
    n_chunks, n_tblocks, pairs, _ = part.shape  # -> [n_chunks, T, TOKEN_ROWS], dropping an odd tt's pad slot
    part = part.reshape(n_chunks, n_tblocks, 2 * pairs, TOKEN_ROWS)[:, :, :t // n_tblocks]
    part = part.reshape(n_chunks, t, TOKEN_ROWS)
    x, pre2, post2, comb2 = _finish(part, xc, scale, base, norm_w, cfg)
    return h1, x, pre2, post2, comb2


def mhc_fused(y, h, post, comb, pre_delayed, fn, scale, base, norm_w, cfg: ModelConfig,
              backend: Backend = "pallas", config: KernelConfig | None = None):
    """One mHC site. y [..., D] or None, h [..., hc, D] bf16, post [..., hc], comb [..., hc, hc],
    pre_delayed [..., hc] f32 (leading dims are flattened to T) -> (h1 [..., hc, D] bf16, x [..., D] bf16,
    pre [..., hc], post [..., hc], comb [..., hc, hc] f32)."""
    lead = h.shape[:-2]
    hc, d = h.shape[-2:]
    if (y is None) != (post is None) or (y is None) != (comb is None):
        raise ValueError("y, post and comb must be all given or all None (first site)")
    if backend == "xla":
        return mhc_reference(y, h, post, comb, pre_delayed, fn, scale, base, norm_w, cfg)
    if backend not in ("pallas", "interpret"):
        raise ValueError(f"unknown backend {backend!r}")
    flat = lambda a: None if a is None else a.reshape(-1, *a.shape[len(lead):])
    args = (flat(y), flat(h), flat(post), flat(comb), flat(pre_delayed))
    h1, x, pre2, post2, comb2 = mhc_fused_pallas(*args, fn, scale, base, norm_w, cfg, config,
                                                 interpret=backend == "interpret")
    return (h1.reshape(*lead, hc, d), x.reshape(*lead, d), pre2.reshape(*lead, hc), post2.reshape(*lead, hc),
            comb2.reshape(*lead, hc, hc))


__all__ = ["KernelConfig", "default_config", "mhc_fused", "mhc_fused_pallas", "mhc_reference"]
