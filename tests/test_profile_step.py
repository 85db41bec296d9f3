"""scripts/profile_step.py's mapping from kernels to model parts (the CUPTI part needs a GPU)."""

import jax
import jax.numpy as jnp

import profile_step as ps


def test_kernels_are_summed_by_named_scope():
    def f(x, w):
        with jax.named_scope("layer3"), jax.named_scope("moe"), jax.named_scope("router"):
            y = jnp.tanh(x @ w)
        with jax.named_scope("layer3"), jax.named_scope("mhc"):
            z = jnp.sum(y * 2, axis=-1)
        return z, y.T

    parts = ps.hlo_parts(jax.jit(f).lower(jnp.ones((64, 128)), jnp.ones((128, 256))).compile().as_text())
    assert "moe/router" in parts.values() and "mhc" in parts.values()  # layer numbers and jit levels dropped
    tanh = next(k for k, v in parts.items() if v == "moe/router" and "tanh" in k)
    got = ps.by_part([(tanh, 0.1), ("expert_gemm_fp4_mosaic_gpu_kernel", 0.5), ("nvjet_sm90_x", 0.3)], parts)
    assert got == {"moe/router": (1, 0.1), "pallas expert_gemm_fp4": (1, 0.5), "unmatched": (1, 0.3)}
