"""Small parameter arrays packed into a few flat buffers, unpacked inside the jitted programs.

A jitted call costs about 2.4 us per argument array on the H200 (thirteenth session, `scripts/trace_gaps.py
--no-trace`): the bench preset's decode step passes 268 arrays, 0.6 ms of a 4.5 ms batch-1 step, and Flash's 40
layers would pass about 1500. Most parameter arrays are small (norm weights, block scales, biases). `pack` puts
every unsharded leaf of at most `max_bytes` into one 1-D buffer per dtype; `unpack`, the first thing a program
does, slices them back, and XLA fuses those slices into the ops that read them. Each leaf starts on a multiple of
`ALIGN` bytes: XLA hands a kernel that takes such a leaf as an operand the slice in place (a sub-buffer), and the
Mosaic GPU custom call rejects inputs that are not 256-byte aligned (H200, 2026-12-01: "Input buffer 6 is not
256-byte aligned" with unaligned offsets). Large and sharded leaves pass through as they are.

Opt-in (`Engine(pack_params=True)`): on the H200 (twenty-first session, `scripts/trace_gaps.py --no-trace`, bench
preset, batch 1) packing took a call's argument passing from 1.009 to 0.806 ms but the device program from 4.616
to 4.788 ms, no net gain at this size; Flash's ~1500 arrays are where it may pay.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MAX_BYTES = 64 * 1024
ALIGN = 256  # bytes: where each packed leaf starts (what the Mosaic GPU custom call asks of its inputs)


@jax.tree_util.register_pytree_node_class
class PackedParams:
    """A parameter tree with its small leaves packed: `big` (the leaves that stay arrays, in tree order), `packs`
    (one 1-D buffer per dtype) and, static, the tree's structure and where each leaf lives."""

    def __init__(self, big: tuple, packs: tuple, treedef, slots: tuple):
        self.big, self.packs, self.treedef, self.slots = big, packs, treedef, slots

    def tree_flatten(self):
        return (self.big, self.packs), (self.treedef, self.slots)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def num_arrays(self) -> int:
        return len(self.big) + len(self.packs)


def _packable(x, max_bytes: int) -> bool:
    if not isinstance(x, jax.Array):
        return False
    sharding = getattr(x, "sharding", None)
    replicated = sharding is None or len(sharding.device_set) == 1 or sharding.is_fully_replicated
    return replicated and x.size * x.dtype.itemsize <= max_bytes


def pack(params, max_bytes: int = MAX_BYTES) -> PackedParams:
    """params (any pytree of arrays) -> PackedParams with every unsharded leaf of <= max_bytes in a per-dtype
    buffer. Packing a PackedParams again returns it unchanged."""
    if isinstance(params, PackedParams):
        return params
    leaves, treedef = jax.tree.flatten(params)
    big, groups, sizes, slots = [], {}, {}, []
    for x in leaves:
        if _packable(x, max_bytes):
            key = jnp.dtype(x.dtype).name
            step = max(ALIGN // x.dtype.itemsize, 1)
            offset = -(-sizes.get(key, 0) // step) * step
            groups.setdefault(key, []).append((offset, x))
            sizes[key] = offset + int(x.size)
            slots.append(("pack", key, offset, tuple(x.shape)))
        else:
            slots.append(("big", len(big)))
            big.append(x)
    keys = sorted(groups)
    packs = tuple(_concat_at(groups[k]) for k in keys)
    index = {k: i for i, k in enumerate(keys)}
    slots = tuple(s if s[0] == "big" else ("pack", index[s[1]], s[2], s[3]) for s in slots)
    return PackedParams(tuple(big), packs, treedef, slots)


def _concat_at(placed: list) -> jax.Array:
    """(offset, leaf) pairs in offset order -> one 1-D buffer with each leaf at its offset (zeros between)."""
    parts, end = [], 0
    for offset, x in placed:
        if offset > end:
            parts.append(jnp.zeros((offset - end,), x.dtype))
        parts.append(x.reshape(-1))
        end = offset + int(x.size)
    return jnp.concatenate(parts)


def unpack(params):
    """The parameter tree back (inside a jitted program the slices are views XLA fuses into their readers);
    anything that is not a PackedParams is returned as it is."""
    if not isinstance(params, PackedParams):
        return params
    leaves = []
    for s in params.slots:
        if s[0] == "big":
            leaves.append(params.big[s[1]])
        else:
            _, i, offset, shape = s
            n = int(np.prod(shape, dtype=np.int64))
            leaves.append(jax.lax.slice(params.packs[i], (offset,), (offset + n,)).reshape(shape))
    return jax.tree.unflatten(params.treedef, leaves)
