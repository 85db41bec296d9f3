"""scripts/bench_decode_variants.py: every variant it times decodes exactly as the kernel's own PTX (the emulator
runs both on random prepared words and scale bytes), so the bench compares instruction choices, not results."""

import bench_decode_variants as bdv
import numpy as np
import pytest

from pallas_kernels import expert_gemm as eg
from tests.pallas_kernels import ptx_emulator


@pytest.mark.parametrize("name", ["plain"] + [n for n, p in bdv.VARIANTS.items() if p is not None])
def test_variant_decodes_as_the_kernel(name):
    """'plain': the builder with the kernel's own instructions, so the parts it swaps are the kernel's."""
    ptx = bdv.variant_ptx("shl", "shf", "shl", "shr") if name == "plain" else bdv.VARIANTS[name]
    rng = np.random.default_rng(3)
    words = rng.integers(0, 2**32, 5000, dtype=np.uint64).astype(np.uint32)
    e = rng.integers(0, eg.MAX_SCALE_BYTE + eg.SCALE_BIAS + 1, 5000).astype(np.uint32)
    want = ptx_emulator.run(eg._FP4_PTX, {4: words, 5: e}, 4)
    got = ptx_emulator.run(ptx, {4: words, 5: e}, 4)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
