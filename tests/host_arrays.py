"""Host (numpy) data on the device without a compile. Under JAX 0.11, `jnp.asarray(numpy_array, dtype)` casts on
the host and then runs a copy program compiled once per shape and dtype, which a test that builds many small inputs
pays again and again on the CPU; `jax.device_put` of the same numpy-cast bytes compiles nothing."""

from __future__ import annotations

import jax
import numpy as np


def put(a, dtype=None) -> jax.Array:
    """`jnp.asarray(a, dtype)` of host data (the same bytes), without its compile."""
    return jax.device_put(np.asarray(a, dtype))
