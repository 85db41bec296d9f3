"""The indexer's top-k threshold in one Mosaic GPU kernel: the k-th largest score of each row.

The indexer keeps the 512 best of up to 16K scores a query (`indexer_logits.topk_entries`). On the H200 that
top-k took 57-65 us at batch 1 and 102-123 us at batch 64 (lax.top_k sorts; `dsv41.topk`'s radix select
counts in 8 passes of XLA kernels), more than the scoring kernel before it (docs/KERNELS_INDEXER.md). The
selection needs the k-th largest key t: then every position above t and the lowest positions equal to it are
the answer, placed in order by a cumulative sum and a scatter (`dsv41.topk.positions_from_threshold`,
XLA).

This kernel finds t in one launch. One CTA (one warpgroup) per row: TMA brings the row's keys (the
order-preserving uint32 map of the float32 scores, `dsv41.topk.order_keys`) into shared memory, and up to
REG_KEYS of them stay in registers (128 a thread at 16K). Then 32 one-bit passes from the most significant bit:
candidate c = prefix | bit, count the keys >= c (a compare and an add per key a thread holds, one warpgroup
reduction), keep c when the count still reaches k. The result is the largest t with #(keys >= t) >= k, what
`dsv41.topk.kth_largest_key` computes (its reference). One bit a pass is the fewest compares: a d-bit digit
costs 2^d - 1 counts a pass for 32/d passes. The indexer's scores are bf16 values, whose keys are fixed by
their top 16 bits: 16 passes (`bf16_values`).

A row longer than MAX_KEYS (the row in shared memory, 128 KB: at decode, the context-scoring layers beyond a
64K-token context at ratio 2) is cut into segments: the threshold of each segment's k largest, those keys
gathered, and the threshold of the gathered keys is the row's (two launches; XLA's radix select where the
segments' k largest would be as many keys as the row). Rows are padded with key 0, below every key of a
NaN-free float.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from dsv41 import topk

MAX_KEYS = 32768   # shared memory: 128 KB; TMA: the row as [N / 128, 128], at most 256 rows of a box
REG_KEYS = 16384   # rows up to this many keys are held in registers (128 a thread) for every pass
CHUNK = 4096       # keys a loaded array holds (32 a thread)


def _padded(n: int) -> int:
    return -(-n // CHUNK) * CHUNK if n > CHUNK else -(-n // 128) * 128


@functools.cache
def _build_kernel(b: int, n: int, k: int, passes: int, interpret: bool):
    """keys uint32 [b, n / 128, 128] -> uint32 [b, 128] (each row's threshold prefix over the top `passes` bits,
    repeated)."""
    rows = n // 128
    cr = min(rows, CHUNK // 128)     # rows of 128 keys in one loaded array
    n_ch = rows // cr

    def body(keys_ref, out_ref, keys_smem, bar):
        r = lax.axis_index("row")
        plgpu.copy_gmem_to_smem(keys_ref.at[r], keys_smem, bar)
        plgpu.barrier_wait(bar)
        held = [keys_smem[pl.ds(c * cr, cr), :] for c in range(n_ch)] if n <= REG_KEYS else None

        def count_at_least(t):
            acc = None
            for c in range(n_ch):
                v = held[c] if held is not None else keys_smem[pl.ds(c * cr, cr), :]
                ge = jnp.where(v >= t, 1, 0).astype(jnp.int32)
                acc = ge if acc is None else acc + ge
            return jnp.sum(acc)

        def one_bit(i, prefix):
            c = prefix | lax.shift_left(jnp.uint32(1), (31 - i).astype(jnp.uint32))
            return jnp.where(count_at_least(c) >= k, c, prefix)

        t = lax.fori_loop(0, passes, one_bit, jnp.uint32(0))
        out_ref[r, :] = jnp.broadcast_to(t, (128,))

    kwargs = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    # jit-wrapped and cached: lowered once per program, not per call site (see expert_gemm._build_kernel)
    return jax.jit(plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b, 128), jnp.uint32),
        grid=(b,),
        grid_names=("row",),
        kernel_name="topk_threshold",
        # Lane semantics: the layouts follow from the loads (plain strided vectors), no inference search
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        scratch_types=[plgpu.SMEM((rows, 128), jnp.uint32), plgpu.Barrier(num_arrivals=1)],
        **kwargs,
    ))


def kth_largest_key(keys: jax.Array, k: int, *, bf16_values: bool = False, interpret: bool = False) -> jax.Array:
    """uint32 [..., N] -> uint32 [...]: the largest t with #(keys >= t) >= k (1 <= k <= N), as
    `dsv41.topk.kth_largest_key`. bf16_values: the keys are `order_keys` of bf16 values (the indexer's scores):
    their low 16 bits follow from the sign (0 for a value >= 0, 0xFFFF below), so 16 passes find the top half
    and the low half is set from it."""
    lead, n = keys.shape[:-1], keys.shape[-1]
    if not 0 < k <= n:
        raise ValueError(f"k={k} must be in [1, {n}]")
    flat = keys.reshape(-1, n).astype(jnp.uint32)
    if n > MAX_KEYS:
        nseg = -(-n // MAX_KEYS)
        k1 = min(k, MAX_KEYS)
        if nseg * k1 >= n:  # segments' k largest would not be fewer keys than the row (k near the row length)
            return topk.kth_largest_key(flat, k).reshape(lead)
        # Longer than shared memory: the k-th largest of a row is the k-th largest of its segments' k largest
        # (each key among the row's k largest is among its segment's; padding keys 0 are below every key).
        seg = jnp.pad(flat, ((0, 0), (0, nseg * MAX_KEYS - n))).reshape(-1, MAX_KEYS)
        t1 = kth_largest_key(seg, k1, bf16_values=bf16_values, interpret=interpret)
        top = jnp.take_along_axis(seg, topk.positions_from_threshold(seg, t1, k1), axis=-1)
        cand = top.reshape(flat.shape[0], nseg * k1)
        return kth_largest_key(cand, k, bf16_values=bf16_values, interpret=interpret).reshape(lead)
    npad = _padded(n)
    flat = jnp.pad(flat, ((0, 0), (0, npad - n)))
    b = flat.shape[0]
    out = _build_kernel(b, npad, k, 16 if bf16_values else 32, bool(interpret))(flat.reshape(b, npad // 128, 128))
    t = out[:, 0]
    if bf16_values:
        t = t | jnp.where(t < jnp.uint32(0x80000000), jnp.uint32(0xFFFF), jnp.uint32(0))
    return t.reshape(lead)


def top_k_positions(x: jax.Array, k: int, *, bf16_values: bool = False, interpret: bool = False) -> jax.Array:
    """x float [..., N] -> int32 [..., k]: the positions lax.top_k(x, k) selects (ties to the lower position),
    ascending; the threshold by the kernel, the placement in XLA. bf16_values: every x is a bf16 value (16
    passes instead of 32; a wrong promise gives a wrong selection)."""
    keys = topk.order_keys(x)
    t = kth_largest_key(keys, k, bf16_values=bf16_values, interpret=interpret)
    return topk.positions_from_threshold(keys, t, k)
