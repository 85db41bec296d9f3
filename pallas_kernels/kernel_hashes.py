"""One Mosaic GPU kernel, one hash, wherever and whenever it is lowered.

jax's Mosaic GPU lowering names every kernel module for its debug dumps with a process-wide counter (the module's
`mosaic_gpu.dump_basename`: "fp8_linear_4", and "fp8_linear_39" for the same kernel lowered later), then hashes
the serialized module, that name included. The hash keys jaxlib's cache of compiled kernels (each kernel hash
compiled once in a process, one at a time under one lock, when a program is compiled and again whenever a process
loads it), so the same kernel called by two programs, or at two layers of one program whose calls are not one
cached jit, compiled once per name: lowered for CUDA, the bench preset's four decode programs at serve's defaults
held 140 kernel hashes for 87 distinct kernels, its 11 programs 245 for 176 (`scripts/bench_startup.py --abstract
--lower-for cuda`), at ~0.25 s a kernel compile on an H100's host (`--trace-compile`).

`install()` drops the name from each module while no dump is asked for (`MOSAIC_GPU_DUMP_*`); jaxlib names the
module again when it compiles it, so its dumps, if asked for then, still have their names. It is process-wide and
changes no kernel's code (every kernel's GPU test passes with it, `scripts/h200_checks.sh tests`); importing
`pallas_kernels` installs it unless the environment sets DSV41_STABLE_KERNEL_HASHES=0.
"""

from __future__ import annotations

import logging

from jax.experimental.mosaic.gpu import core as mgpu_core

log = logging.getLogger(__name__)

ENV = "DSV41_STABLE_KERNEL_HASHES"
_NAME_ATTR = "mosaic_gpu.dump_basename"
# jaxlib's DumpOptions flags: any of them on means the user asked for dumps, which the names tell apart
_DUMP_FLAGS = ("mlir_passes", "ptx", "ptxas", "sass", "sass_ctrl", "resources", "constraint_system")


def install() -> bool:
    """Wraps jaxlib's `get_or_set_dump_options` (the call that names a module) so that the name leaves the module
    again unless a dump is asked for. -> whether it is installed (False: this jax has no such call)."""
    dialect = mgpu_core.dialect
    original = getattr(dialect, "get_or_set_dump_options", None)
    if original is None:
        log.warning("%s: this jax's Mosaic GPU has no get_or_set_dump_options; kernel hashes left as they are", ENV)
        return False
    if getattr(original, "_dsv41_stable", False):
        return True

    def get_or_set_dump_options(module):
        options = original(module)
        attrs = module.operation.attributes
        if _NAME_ATTR in attrs and not any(getattr(options, f, False) for f in _DUMP_FLAGS):
            del attrs[_NAME_ATTR]
        return options

    get_or_set_dump_options._dsv41_stable = True
    dialect.get_or_set_dump_options = get_or_set_dump_options
    return True
