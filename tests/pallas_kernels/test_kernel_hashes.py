"""`kernel_hashes.install()`: the same kernel lowered twice, in two programs, carries one kernel hash (jaxlib
compiles a kernel once per hash in a process); without it the module's dump name, numbered per lowering, made
them two."""

import re

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core as mgpu_core

from dsv41.quant import Fp8Weight
from pallas_kernels import fp8_linear as f8
from pallas_kernels import kernel_hashes


def _kernel_hashes(m: int, pw) -> list[str]:
    """The Mosaic GPU kernel hashes of a program of fp8_linear on m rows, lowered for CUDA (no GPU needed)."""
    sd = jax.ShapeDtypeStruct
    text = jax.jit(f8.fp8_linear).trace(sd((m, 1280), jnp.bfloat16), pw).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r'kernel_hash = "(.*?)"', text)


def test_one_kernel_one_hash_across_programs():
    installed = mgpu_core.dialect.get_or_set_dump_options
    assert installed._dsv41_stable  # importing pallas_kernels installs it (DSV41_STABLE_KERNEL_HASHES unset)
    assert kernel_hashes.install()  # idempotent
    sd = jax.ShapeDtypeStruct
    w = Fp8Weight(sd((1024, 1280), jnp.float8_e4m3fn), sd((1024 // 32, 1280 // 32), jnp.uint8))
    pw = jax.eval_shape(lambda w: f8.prepare_fp8_linear(w, check=False), w)
    # 1 and 3 rows run the same kernel (rows padded to the 8-row tile): two programs, two lowerings
    one, three = _kernel_hashes(1, pw), _kernel_hashes(3, pw)
    assert len(one) == 1 and one == three
    assert _kernel_hashes(16, pw) != one  # a 16-row tile is another kernel
