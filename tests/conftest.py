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


@pytest.hookimpl(trylast=True)  # after -k / -m / --deselect: only the items that will run count below
def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
    if not on_gpu:
        _leave_reruns_to_the_gpu_conversion_test(items)


def _leave_reruns_to_the_gpu_conversion_test(items):
    """tests/test_gpu_conversions.py::test_numerics_tests_pass_with_gpu_conversion_simplification reruns the
    numerics tests in its `TESTS` in a subprocess under XLA's float-conversion simplification (the GPU pipeline's
    pass) and fails if one of them fails or is skipped. When it is collected and will run, the plain runs of those
    tests here are the same assertions once more (~50 s of the CPU suite, the teacher-forced reference comparison
    most of it): they are skipped here, with a reason that names the rerun, and run in its subprocess instead.
    Without it (e.g. `pytest tests/test_quant.py`, or `-k` leaving it out) they run here as usual."""
    rerun = [i for i in items if i.name == "test_numerics_tests_pass_with_gpu_conversion_simplification"
             and i.path.name == "test_gpu_conversions.py" and not i.get_closest_marker("skip")]
    if not rerun:
        return
    covered = tuple(rerun[0].module.TESTS)
    skip = pytest.mark.skip(reason="runs (same assertions, GPU conversion pipeline) in the subprocess of "
                                   "tests/test_gpu_conversions.py::test_numerics_tests_pass_with_gpu_conversion_"
                                   "simplification")

    def base(item):  # the node id without an xdist group suffix or parameters
        return item.nodeid.split("@", 1)[0].split("[", 1)[0]

    for item in items:
        if any(base(item) == t or base(item).startswith(t + "::") for t in covered):
            item.add_marker(skip)
