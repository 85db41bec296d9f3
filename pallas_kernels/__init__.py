"""Mosaic GPU kernels for the engine's hot paths, each beside its reference (`serving.engine.backends` picks them)."""

import os as _os

from pallas_kernels import kernel_hashes as _kernel_hashes

if _os.environ.get(_kernel_hashes.ENV, "1") != "0":  # DSV41_STABLE_KERNEL_HASHES=0: jax's names kept in the hashes
    _kernel_hashes.install()
