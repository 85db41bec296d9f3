"""Test-wide settings. CPU runs: 8 virtual devices for sharding tests, fast XLA compiles (the tiny model is
compile-bound, not compute-bound), and a persistent compilation cache shared by the test processes."""

from __future__ import annotations

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# fast XLA compiles for the CPU tests (DSV41_TEST_FULL_OPT=1 leaves them out)
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
if "jax" not in sys.modules:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += " --xla_force_host_platform_device_count=8"
    if os.environ.get("DSV41_TEST_FULL_OPT") != "1" and "xla_backend_optimization_level" not in flags:
        flags += " " + " ".join(FAST_COMPILE_FLAGS)
    os.environ["XLA_FLAGS"] = flags.strip()
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "scripts"))  # the benchmark scripts' tests import them by name

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
