"""scripts/bench_expert_gemm.py: the config strings its --decode-configs / --prefill-configs take, so that a
device run times the configs it names."""

import bench_expert_gemm as beg
import pytest

from pallas_kernels import expert_gemm as eg


def test_parse_configs_flags():
    C = eg.KernelConfig
    got = beg.parse_configs("64x256x4co,8x256x4cm4,8x512x5m2w3,8x128x4cok5,64x256x3")
    assert got == [C(tm=64, tk=256, stages=4, chain=True, overlap=True),
                   C(tm=8, tk=256, stages=4, chain=True, warp_mma=4),
                   C(tm=8, tk=512, stages=5, warp_mma=2, num_wgs=3),
                   C(tm=8, tk=128, stages=4, chain=True, overlap=True, ksplit=5),
                   C(tm=64, tk=256, stages=3)]
    assert beg.label(got[1]).endswith("mma.sync x4")
    assert beg.parse_configs("") is None


def test_parse_configs_rejects_unknown_flags():
    with pytest.raises(SystemExit, match="expected TMxTKxSTAGES"):
        beg.parse_configs("8x256x4cq")
    with pytest.raises(SystemExit, match="expected TMxTKxSTAGES"):
        beg.parse_configs("8x256x4cs")  # no stream-K flag
    with pytest.raises(SystemExit, match="expected TMxTKxSTAGES"):
        beg.parse_configs("8x256x4cm")  # m needs its accumulator count
