"""A program call's host arrays as one transfer: every numpy argument whose leading axis is the batch's rows B
(and whose rows are small: `MAX_ROW_BYTES`) travels inside one uint8 [B, row bytes] buffer (each row: its bytes
of every such array, in argument order), and the jitted program slices and bitcasts them back.

Why one buffer: XLA runs a GPU program's kernels as a CUDA graph and, on each call, updates only the commands
that read an argument whose device address changed. A fresh transfer per array (tokens, positions, block table,
Engram rows, sampling values) gave the kernels that read them a changed address, and updating those (the Mosaic
kernels' captures are re-traced) held the host; the batch-1 engine step fell by 1.6 ms with one buffer
(docs/PERFORMANCE.md, section 2). With one buffer only the few fusions that unpack it change; the kernels read
their unpacked copies, which XLA keeps at fixed places in its temporary buffer. Rows stay rows, so a mesh splits
the buffer over data ranks as it split the arrays.

Each array's bytes start at a multiple of `ALIGN` within a row: with one row (a decode step of one sequence, or one
row per data rank) an array is a contiguous range of the buffer, which XLA hands to a kernel in place (its
dynamic-slice fusion), and Mosaic GPU kernels reject an operand that is not 256-byte aligned ("Input buffer 4 is
not 256-byte aligned": the block table at byte 16 of the row, `dsv41 serve`'s defaults on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41.layer_runs import ALIGN  # the Mosaic GPU kernels' operand alignment, bytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostRows:
    data: Any  # uint8 [B, row bytes]
    fields: tuple = dataclasses.field(metadata=dict(static=True))  # ((numpy dtype, shape of one row), ...)


@functools.lru_cache(maxsize=256)
def _offsets(fields: tuple) -> tuple[tuple[int, ...], int]:
    """Where each field's bytes start in a row, and the row's bytes (each start a multiple of ALIGN)."""
    starts, at = [], 0
    for dtype, shape in fields:
        starts.append(at)
        at += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    return tuple(starts), at


def pack(arrays: list[np.ndarray]) -> HostRows:
    """Arrays [B, ...] (one B) -> their rows side by side in one buffer."""
    B = arrays[0].shape[0]
    fields = tuple((a.dtype, a.shape[1:]) for a in arrays)
    starts, row_bytes = _offsets(fields)
    data = np.empty((B, row_bytes), np.uint8)  # the padding between arrays is never read
    for a, at in zip(arrays, starts):
        c = np.ascontiguousarray(a).view(np.uint8).reshape(B, -1)
        data[:, at: at + c.shape[1]] = c
    return HostRows(data, fields)


def unpack(rows: HostRows) -> list[jax.Array]:
    """`pack`'s arrays, on the device (traced)."""
    B = rows.data.shape[0]
    out = []
    for (dtype, shape), at in zip(rows.fields, _offsets(rows.fields)[0]):
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        x = rows.data[:, at: at + n]
        if dtype == np.bool_:
            x = x != 0
        elif dtype.itemsize > 1:
            x = jax.lax.bitcast_convert_type(x.reshape(B, -1, dtype.itemsize), dtype)
        elif dtype != np.uint8:
            x = jax.lax.bitcast_convert_type(x, dtype)
        out.append(jnp.reshape(x, (B, *shape)))
    return out


# Arrays with larger rows pass as their own transfer: a prefill chunk's Engram rows (6 KiB a token, 12 MiB for a
# 2048-token chunk) would cost the host a copy of that size, and a program that long does not feel the update of
# the few fusions that read them.
MAX_ROW_BYTES = 64 * 1024


def split(args: tuple) -> tuple[HostRows | None, tuple, Any]:
    """A call's arguments -> (the packed host arrays, the other leaves, the static layout `join` needs). Packed:
    numpy arrays whose leading axis is the first such array's, rows of at most MAX_ROW_BYTES; the rest (device
    arrays, scalars, large rows) pass as they are."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    B = next((x.shape[0] for x in leaves if isinstance(x, np.ndarray) and x.ndim), None)
    host = tuple(isinstance(x, np.ndarray) and x.ndim > 0 and x.shape[0] == B and x.nbytes <= B * MAX_ROW_BYTES
                 for x in leaves)
    packed = [x for x, h in zip(leaves, host) if h]
    rest = tuple(x for x, h in zip(leaves, host) if not h)
    return (pack(packed) if packed else None), rest, (tree, host)


def join(rows: HostRows | None, rest: tuple, layout) -> tuple:
    """`split`'s arguments again, inside the program."""
    tree, host = layout
    packed, rest = iter(unpack(rows) if rows is not None else ()), iter(rest)
    return jax.tree_util.tree_unflatten(tree, [next(packed) if h else next(rest) for h in host])


def one_transfer(fn):
    """fn(params, pool, *args, **static) -> the function a program jits: (params, pool, rows, rest, *, layout,
    **static), its arguments as `split` gives them."""

    def program(params, pool, rows, rest, *, layout, **static):
        return fn(params, pool, *join(rows, rest, layout), **static)

    program.__name__ = program.__qualname__ = fn.__name__
    return program
