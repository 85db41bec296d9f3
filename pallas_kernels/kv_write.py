"""Fused decode-time KV writes of one attention layer (Pallas / Mosaic GPU).

At decode every row of the batch brings one new token (T = 1). For each layer the engine writes
  * the SWA ring: FP8 e4m3 + UE8M0 per 32 of the token's window latent, at ring slot pos % R of its sequence;
  * on FULL layers (KV sources; Flash: ratio 2 at layers 2/8/14, ratio 1 at layer 20), when the token completes
    a compressor group at a position >= write_lo: the compressed main-KV entry (RoPE + FP4 e2m1 with E4M3 per 16,
    288 B) and the index key (wk + k_norm + RoPE + MXFP4 e2m1 with UE8M0 per 32, 68 B) into the paged pool
    through the block table; for ratio 2 the open group's pending kv || score (f32) in `comp_state`.
Today (`serving/engine/programs.py`, `cached_attention`) that is ~20 small XLA ops per layer: ring gathers,
a select over the whole gathered ring, scatters back, a state gather/scatter and four entry scatters.

Split of the work (why): everything whose float result depends on evaluation order or transcendental
implementations (the compressor's softmax, RMSNorms, the wk GEMM, RoPE's cos/sin, the quantize-dequantize round
trips) stays in XLA, computed by the very dsv41 functions programs.py calls, so the written bytes are the same
by construction. The kernel does everything after the bytes exist, in ONE launch: the destination arithmetic
(ring slot, group id, write_lo, block-table lookup, padding rows) and all seven writes, in place on the pool
(mutable refs -> `input_output_aliases`; no pool copy). GEMMs producing the inputs (wkv, compressor wkv/wgate)
stay outside; the wk GEMM of the index key runs in the XLA prelude.

Kernel: grid (B,), one warpgroup per row. Each destination row >= 16 B (and a multiple of 16) goes
GMEM -> SMEM by TMA (`cp.async.bulk`) and SMEM -> GMEM by a bulk store at the dynamic row; rows < 16 B (the
4-byte index-key scales at Flash; several at test shapes) are copied as scalar stores. The pool arrays reach
the kernel only reshaped to rows (no bitcast, no copy); the kernel is decode-only (T = 1: n_valid is 0 or 1).

Public API:
  * `kv_write_decode(layer_kv, swa_kv, slot, pos, n_valid, block_table, write_lo, ...)` -> new `LayerKV`;
    backend 'pallas' | 'interpret' | 'xla' ('xla' = the reference).
  * `kv_write_reference(...)` (same arguments) -- a transcription of programs.py at T=1, the spec.
  * `token_bytes(...)` (the XLA prelude) and `write_rows(...)` (the kernel alone) / `write_rows_reference`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from dsv41 import attention as A
from dsv41 import indexer, quant
from dsv41 import kv_layout as kl
from dsv41.kv_layout import LayerKV
from dsv41.quant import Numerics

BULK_ALIGN = 16  # cp.async.bulk: sizes and addresses are multiples of 16 bytes
TMA_MAX_BOX = 256  # a TMA box holds at most 256 elements along each dimension


@dataclasses.dataclass(frozen=True)
class KVWriteConfig:
    """Static description of the layer: ratio 0 = SWA-only, 1 or 2 = a FULL (KV-source) layer."""

    ratio: int
    norm_eps: float


# ---- the reference: programs.py's cached_attention writes at T = 1 ------------------------------------


def _entry_values(lkv: LayerKV, comp_kv, comp_score, slot, pos, n_valid, p_comp, p_idx, freqs, kcfg, num):
    """The compressed entry and index key of the group each row's token may complete (the engine's compressor
    step `kv_layout.compress_step`, index_keys, compressed_entries and the quantization at T = 1, pos = the
    token's position). -> (bytes {field: [B, 1, row]}, group ids g [B, 1], complete [B, 1], the new pending
    state [B, 2 * Dh] (ratio 2) else None)."""
    r = kcfg.ratio
    state = kl.read_slots(lkv.comp_state, slot) if r == 2 else None
    lat, g, complete, new_state = kl.compress_step(comp_kv[:, None], None if r == 1 else comp_score[:, None], state,
                                                   pos, n_valid, p_comp, r, _cfg(kcfg), num.jdtype)
    gpos = g * r
    ik = indexer.index_keys(lat, p_idx, gpos, freqs, _cfg(kcfg), num)
    ce = A.compressed_entries(lat, gpos, freqs, num)
    ikp, iks = quant.mxfp4_encode(ik)
    cep, ces = quant.fp4_quantize(ce, 16, e4m3_scales=True)  # the pool keeps E4M3 scales as float8: not bytes
    vals = {"kv_packed": cep, "kv_scale": quant.e4m3(ces), "ik_packed": ikp, "ik_scale": iks}
    return vals, g, complete, new_state


@dataclasses.dataclass(frozen=True)
class _NormCfg:
    """The one ModelConfig field rms_norm users read here (index_keys, pool_groups take a cfg)."""

    norm_eps: float


def _cfg(kcfg: KVWriteConfig):
    return _NormCfg(kcfg.norm_eps)


def kv_write_reference(lkv: LayerKV, swa_kv, slot, pos, n_valid, block_table, write_lo, *, kcfg: KVWriteConfig,
                       comp_kv=None, comp_score=None, p_comp=None, p_idx=None, freqs=None,
                       num: Numerics = quant.REFERENCE) -> LayerKV:
    """What programs.cached_attention writes for one token a row (T = 1), in plain jnp.

    swa_kv [B, Dh] (A.window_kv's output), slot/pos/n_valid/write_lo int32 [B] (pos = Batch.pos0; padding rows
    have slot == S and n_valid == 0), block_table int32 [B, C] (P where unused). FULL layers: comp_kv [B, Dh]
    (ratio 2: float32 with comp_score [B, Dh] float32, compressor.project's outputs; ratio 1: the activation
    dtype), p_comp = params["compressor"] (reads "norm"), p_idx = params["indexer"] (reads "wk", "k_norm"),
    freqs = the layer's RoPE frequencies. -> the updated LayerKV."""
    kq, ks = quant.fp8_quantize(swa_kv[:, None])
    rq = kl.read_slots(lkv.swa_q, slot)
    rs = kl.read_slots(lkv.swa_s, slot)
    new_rq = kl.write_ring(rq, kq, pos, n_valid)
    new_rs = kl.write_ring(rs, quant.ue8m0_encode(ks), pos, n_valid)
    out = {"swa_q": kl.write_slots(lkv.swa_q, slot, new_rq), "swa_s": kl.write_slots(lkv.swa_s, slot, new_rs)}
    if kcfg.ratio == 0:
        return dataclasses.replace(lkv, **out)
    vals, g, complete, new_state = _entry_values(lkv, comp_kv, comp_score, slot, pos, n_valid, p_comp, p_idx, freqs,
                                                 kcfg, num)
    ok = complete & (g * kcfg.ratio >= write_lo[:, None])
    for k, v in vals.items():
        out[k] = kl.write_entries(getattr(lkv, k), block_table, g, ok, v)
    if kcfg.ratio == 2:
        out["comp_state"] = kl.write_slots(lkv.comp_state, slot, new_state)
    return dataclasses.replace(lkv, **out)


# ---- the kernel ----------------------------------------------------------------------------------------

# Destination groups. A row is written when its group's condition holds (computed in-kernel from scalars).
_RING, _ENTRY, _STATE = 0, 1, 2


def _as_bytes(x):
    """fp8 arrays -> their uint8 bits (same width: a bitcast, no copy). Other dtypes unchanged."""
    return lax.bitcast_convert_type(x, jnp.uint8) if x.dtype.itemsize == 1 and x.dtype != jnp.uint8 else x


def _typed_like(x, dtype):
    """uint8 bits -> the same bits as `dtype` (fp8 pools); other dtypes unchanged."""
    return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype and jnp.dtype(dtype).itemsize == 1 else x


def _copy_mode(row_bytes: int) -> str:
    if row_bytes % BULK_ALIGN == 0:
        return "bulk"
    if row_bytes < BULK_ALIGN:
        return "scalar"
    raise ValueError(f"a destination row of {row_bytes} B is neither < 16 B nor a multiple of 16 B")


def _build_kernel(B, groups, ring_size, entries_per_page, num_pages, num_slots, ratio, ctx_cols, interpret):
    """groups: tuple of (group id, row_len, dtype) in the order of the src/dst refs.

    Kernel refs: slot, pos, n_valid, write_lo [B] int32, block_table [B, C] int32, then one src [B, n] per
    destination, then the destinations (mutable, flattened to rows [N, n])."""
    n = len(groups)
    modes = [_copy_mode(L * jnp.dtype(dt).itemsize) for _, L, dt in groups]
    bulk = [i for i in range(n) if modes[i] == "bulk"]

    def body(slot_ref, pos_ref, nv_ref, wlo_ref, bt_ref, *refs):
        srcs, dsts = refs[:n], refs[n:2 * n]
        smem, bars = refs[2 * n:2 * n + len(bulk)], refs[2 * n + len(bulk)]
        b = lax.axis_index("b")
        s, p, nv, wlo = slot_ref[b], pos_ref[b], nv_ref[b], wlo_ref[b]
        slot_ok = (s >= 0) & (s < num_slots) & (nv > 0)
        rows, conds = {}, {}
        rows[_RING] = s * ring_size + lax.rem(p, ring_size)
        conds[_RING] = slot_ok
        if ratio:
            g = lax.div(p, ratio)
            complete = g < lax.div(p + nv, ratio)
            col = jnp.minimum(lax.div(g, entries_per_page), ctx_cols - 1)
            page = bt_ref[b, col]
            rows[_ENTRY] = page * entries_per_page + lax.rem(g, entries_per_page)
            conds[_ENTRY] = complete & (g * ratio >= wlo) & (page >= 0) & (page < num_pages) & (nv > 0)
        if ratio == 2:
            rows[_STATE] = s
            conds[_STATE] = slot_ok & (lax.rem(p + nv, 2) == 1)
        # Start every bulk load first (all land on one barrier each), then store what is due.
        for k, i in enumerate(bulk):
            plgpu.copy_gmem_to_smem(srcs[i].at[b], smem[k], bars.at[k])
        for i, (grp, L, _) in enumerate(groups):
            if modes[i] == "scalar":
                @pl.when(conds[grp])
                def _(i=i, grp=grp, L=L):
                    for j in range(L):  # < 16 bytes: a few uniform scalar stores beat a TMA round trip
                        dsts[i][rows[grp], j] = srcs[i][b, j]
        for k, i in enumerate(bulk):
            grp = groups[i][0]
            plgpu.barrier_wait(bars.at[k])

            @pl.when(conds[grp])
            def _(i=i, k=k, grp=grp):
                plgpu.copy_smem_to_gmem(smem[k], dsts[i].at[rows[grp]])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = [plgpu.SMEM(_row_shape(groups[i][1]), groups[i][2]) for i in bulk]
    scratch.append(plgpu.Barrier(num_arrivals=1, num_barriers=max(len(bulk), 1)))
    kw = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    return plgpu.kernel(body, out_type=(), grid=(B,), grid_names=("b",), scratch_types=scratch,
                        kernel_name="kv_write_decode", **kw)


def _row_shape(L: int) -> tuple[int, int]:
    """A row of L elements as a 2-D TMA box (L / c, c), c <= 256."""
    c = min(L, TMA_MAX_BOX)
    if L % c:
        raise ValueError(f"row length {L} is not a multiple of {c}")
    return (L // c, c)


def _rows(x):
    """[..., L] -> [N, *_row_shape(L)] for bulk rows, [N, L] for scalar ones (a reshape: no copy)."""
    L = x.shape[-1]
    if _copy_mode(L * x.dtype.itemsize) == "scalar":
        return x.reshape(-1, L)
    return x.reshape(-1, *_row_shape(L))


def token_bytes(lkv: LayerKV, swa_kv, slot, pos, *, kcfg: KVWriteConfig, comp_kv=None, comp_score=None,
                p_comp=None, p_idx=None, freqs=None, num: Numerics = quant.REFERENCE) -> dict:
    """The XLA prelude: each row's bytes to write, by pool field -> {name: [B, row] array} (uint8, or float32
    for comp_state), whether or not the row ends up written (the kernel decides)."""
    kq, ks = quant.fp8_encode(swa_kv)
    out = {"swa_q": kq, "swa_s": ks}
    if kcfg.ratio:
        # as if every row held a token: the kernel writes only the rows that do
        vals, _, _, new_state = _entry_values(lkv, comp_kv, comp_score, slot, pos, jnp.ones_like(pos), p_comp, p_idx,
                                              freqs, kcfg, num)
        out.update({k: _as_bytes(v[:, 0]) for k, v in vals.items()})
        if kcfg.ratio == 2:
            out["comp_state"] = new_state.astype(jnp.float32)
    return out


_GROUP = {"swa_q": _RING, "swa_s": _RING, "kv_packed": _ENTRY, "kv_scale": _ENTRY, "ik_packed": _ENTRY,
          "ik_scale": _ENTRY, "comp_state": _STATE}


def write_rows(lkv: LayerKV, rows: dict, slot, pos, n_valid, block_table, write_lo, *, ratio: int,
               interpret: bool = False) -> LayerKV:
    """The kernel alone: rows = token_bytes(...) -> lkv with each row written where due, in place.

    Ring rows go to swa_*[slot, pos % R] when 0 <= slot < S and n_valid > 0; entry rows to
    [page, g % E] with g = pos // ratio, page = block_table[clip(g // E)], when the token completes its group
    (g < (pos + n_valid) // ratio), g * ratio >= write_lo and 0 <= page < P; comp_state[slot] when the token
    opens a group ((pos + n_valid) odd). Anything else is left untouched."""
    names = [k for k in _GROUP if k in rows]
    B = rows["swa_q"].shape[0]
    S, R, _ = lkv.swa_q.shape
    P, E = lkv.kv_packed.shape[:2] if ratio else (1, 1)
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    # Sources take the pool's dtype (fp8 bits: a bitcast of a small array) so the pool arrays go to the kernel
    # as they are: a reshape only, nothing XLA could decide to copy.
    srcs = [_typed_like(rows[k], getattr(lkv, k).dtype) for k in names]
    groups = tuple((_GROUP[k], x.shape[-1], x.dtype) for k, x in zip(names, srcs))
    srcs = [_rows(x) for x in srcs]
    refs = [jax.new_ref(_rows(getattr(lkv, k))) for k in names]
    kern = _build_kernel(B, groups, R, E, P, S, ratio, block_table.shape[1], interpret)
    kern(i32(slot), i32(pos), i32(n_valid), i32(write_lo), i32(block_table), *srcs, *refs)
    out = {k: jax.freeze(ref).reshape(getattr(lkv, k).shape) for k, ref in zip(names, refs)}
    return dataclasses.replace(lkv, **out)


def write_rows_reference(lkv: LayerKV, rows: dict, slot, pos, n_valid, block_table, write_lo, *,
                         ratio: int) -> LayerKV:
    """`write_rows` in plain jnp (gather / select / scatter as programs.py does): the kernel-only check on the
    device, independent of how XLA fuses the prelude."""
    def typed(k):
        dt = getattr(lkv, k).dtype
        v = rows[k][:, None]
        return lax.bitcast_convert_type(v, dt) if v.dtype != dt and dt.itemsize == 1 else v

    out = {}
    for k in ("swa_q", "swa_s"):
        ring = kl.read_slots(getattr(lkv, k), slot)
        out[k] = kl.write_slots(getattr(lkv, k), slot, kl.write_ring(ring, typed(k), pos, n_valid))
    if ratio:
        g = (pos // ratio)[:, None]
        ok = (g < ((pos + n_valid) // ratio)[:, None]) & (g * ratio >= write_lo[:, None])
        for k in ("kv_packed", "kv_scale", "ik_packed", "ik_scale"):
            out[k] = kl.write_entries(getattr(lkv, k), block_table, g, ok, typed(k))
    if ratio == 2:
        upd = ((pos + n_valid) % 2 == 1) & (n_valid > 0)
        state = kl.read_slots(lkv.comp_state, slot)
        out["comp_state"] = kl.write_slots(lkv.comp_state, slot, jnp.where(upd[:, None], rows["comp_state"], state))
    return dataclasses.replace(lkv, **out)


def kv_write_decode(lkv: LayerKV, swa_kv, slot, pos, n_valid, block_table, write_lo, *, kcfg: KVWriteConfig,
                    comp_kv=None, comp_score=None, p_comp=None, p_idx=None, freqs=None,
                    num: Numerics = quant.REFERENCE, backend: str = "pallas") -> LayerKV:
    """Same arguments and result as `kv_write_reference`; backend 'pallas' (Mosaic GPU), 'interpret' (the
    kernel in the Mosaic GPU interpreter) or 'xla' (the reference). Call it inside the jitted program that
    donates the pool: the kernel updates the arrays in place (aliased), only written rows change."""
    if backend == "xla":
        return kv_write_reference(lkv, swa_kv, slot, pos, n_valid, block_table, write_lo, kcfg=kcfg,
                                  comp_kv=comp_kv, comp_score=comp_score, p_comp=p_comp, p_idx=p_idx,
                                  freqs=freqs, num=num)
    if backend not in ("pallas", "interpret"):
        raise ValueError(f"unknown backend {backend!r}")
    rows = token_bytes(lkv, swa_kv, slot, pos, kcfg=kcfg, comp_kv=comp_kv, comp_score=comp_score, p_comp=p_comp,
                       p_idx=p_idx, freqs=freqs, num=num)
    return write_rows(lkv, rows, slot, pos, n_valid, block_table, write_lo, ratio=kcfg.ratio,
                      interpret=backend == "interpret")
