"""scripts/torch_baselines.py (the PyTorch side of the kernel benches) against numpy and the model's router,
on the CPU in the Python 3.11 reference environment (torch is not installed for 3.12). A baseline that
computed something else would make the benches' comparison meaningless; on the GPU the benches check them
against our references again."""

import subprocess
import sys
import textwrap

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import router as R
from tests.reference.driver import REF_PYTHON, REFERENCE_MISSING, REPO_ROOT, _child_env

pytestmark = pytest.mark.skipif(not REF_PYTHON.exists(), reason=REFERENCE_MISSING)

RUNNER = textwrap.dedent("""
    import sys
    import numpy as np, torch
    sys.path.insert(0, sys.argv[1] + "/scripts")
    import torch_baselines as tb
    a = np.load(sys.argv[2])
    bf = lambda k: torch.from_numpy(a[k]).to(torch.bfloat16)
    o = tb.decode_attention(bf("q"), bf("win"), torch.from_numpy(a["win_valid"]), bf("pool"),
                            torch.from_numpy(a["rows"]), torch.from_numpy(a["sink"]))
    y = tb.grouped_mm(bf("x"), bf("w"), torch.from_numpy(a["sizes"]))
    rw, ri, ro, rs = tb.route(bf("rx"), torch.from_numpy(a["rw"]), torch.from_numpy(a["rb"]), 6, 1.5)
    np.savez(sys.argv[3], o=o.float().numpy(), y=y.float().numpy(), rw=rw.numpy(), ri=ri.numpy(),
             ro=ro.numpy(), rs=rs.numpy())
""")


def _bf16(rng, *shape):
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16).astype(np.float32)


def _attention(q, win, win_valid, pool, rows, sink):
    d = q.shape[-1]
    kv = np.concatenate([win, pool[np.maximum(rows, 0)]], 1).astype(np.float64)
    valid = np.concatenate([win_valid, rows >= 0], 1)
    s = np.einsum("bhd,bnd->bhn", q, kv) / np.sqrt(d)
    s = np.where(valid[:, None], s, -np.inf)
    m = np.maximum(s.max(-1), sink[None])
    p = np.exp(s - m[..., None])
    return np.einsum("bhn,bnd->bhd", p, kv) / (p.sum(-1) + np.exp(sink[None] - m))[..., None]


def test_torch_baselines_compute_the_ops_they_stand_for(tmp_path):
    rng = np.random.default_rng(0)
    B, H, D, W, K, N = 3, 8, 64, 16, 24, 200
    inp = {"q": _bf16(rng, B, H, D), "win": _bf16(rng, B, W, D), "pool": _bf16(rng, N, D),
           "win_valid": rng.random((B, W)) < 0.8, "sink": rng.standard_normal(H).astype(np.float32),
           "rows": np.where(rng.random((B, K)) < 0.25, -1, rng.integers(0, N, (B, K))).astype(np.int64)}
    inp["rows"][1] = -1  # a row with no selected entry: the window and the sink only
    sizes = np.array([5, 0, 7, 1, 0, 3], np.int64)
    inp.update(x=_bf16(rng, int(sizes.sum()), 32), w=_bf16(rng, len(sizes), 48, 32), sizes=sizes)
    # the router with biases 0.2 apart and scores within +-0.1 (no near-ties in the top 6: torch.topk's order of
    # equal keys is not top_k's): the same experts in the same order, weights, expert order and group sizes
    inp.update(rx=_bf16(rng, 7, 64), rw=_bf16(rng, 128, 64) / 128, rb=rng.permutation(128).astype(np.float32) * 0.2)
    np.savez(tmp_path / "in.npz", **inp)
    subprocess.run([str(REF_PYTHON), "-c", RUNNER, str(REPO_ROOT), str(tmp_path / "in.npz"),
                    str(tmp_path / "out.npz")], check=True, env=_child_env(1), cwd=tmp_path, timeout=300,
                   stdout=sys.stdout, stderr=subprocess.PIPE)
    out = np.load(tmp_path / "out.npz")
    want = _attention(*(inp[k] for k in ("q", "win", "win_valid", "pool", "rows", "sink")))
    assert np.abs(out["o"] - want).max() <= 1e-2 * np.abs(want).max()
    starts = np.concatenate([[0], np.cumsum(sizes)])
    want_y = np.concatenate([inp["x"][a:b] @ inp["w"][g].T for g, (a, b) in enumerate(zip(starts, starts[1:]))])
    assert np.abs(out["y"] - want_y).max() <= 1e-2 * np.abs(want_y).max()
    rw, ri, ro, rs = R.route_reference(jnp.asarray(inp["rx"], jnp.bfloat16),
                                       {"weight": jnp.asarray(inp["rw"], jnp.bfloat16), "bias": inp["rb"]},
                                       R.RouteConfig())
    np.testing.assert_array_equal(out["ri"], np.asarray(ri))
    np.testing.assert_allclose(out["rw"], np.asarray(rw), rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(out["ro"], np.asarray(ro))
    np.testing.assert_array_equal(out["rs"], np.asarray(rs))
