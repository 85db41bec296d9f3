import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import rope
from dsv41.config import ModelConfig
from pallas_kernels import sparse_attention as sa


@jax.jit
def _both(x, pos):
    freqs = rope.inv_freq(ModelConfig(), 2)
    cos, sin = rope.cos_sin(pos, freqs)
    return (rope.apply_rope(x, pos[:, None], freqs), sa.apply_rope_tail(x, cos, sin),
            rope.apply_rope(x, pos[:, None], freqs, inverse=True), sa.apply_rope_tail(x, cos, sin, inverse=True))


def test_kernel_callers_rotate_with_rope():
    """sparse_attention's cos/sin rotation is rope.rotate: bit-equal to apply_rope at the same positions."""
    x = jax.random.normal(jax.random.key(0), (3, 4, 512))
    a, b, ai, bi = _both(x, jnp.array([0, 7, 100000], jnp.int32))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(ai), np.asarray(bi))
    np.testing.assert_array_equal(np.asarray(a[..., :448]), np.asarray(x[..., :448]))
