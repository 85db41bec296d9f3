"""serving/engine/backends.py: the programs' one static choice and the size limits of the fused sites."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dsv41 import mhc, moe
from dsv41.config import preset
from dsv41.ops import XLA
from serving.engine import backends as BK


def test_backends_hash_and_compare_by_value():
    """jit keys its cache on the static `Backends`: two engines that resolve the same choices share programs."""
    a = BK.Backends("xla", BK.KernelOptions(), BK.kernel_ops(experts=True, mhc="pallas", router="interpret"))
    b = BK.Backends("xla", BK.KernelOptions(), BK.kernel_ops(experts=True, mhc="pallas", router="interpret"))
    assert a == b and hash(a) == hash(b)
    assert BK.Backends() == BK.Backends("xla", BK.KernelOptions(), XLA)
    assert BK.kernel_ops() == XLA and XLA.mhc_site is mhc.site and XLA.route is moe.route_plain
    assert a != dataclasses.replace(a, ops=BK.kernel_ops(mhc="pallas"))


def test_bad_choices_say_what_to_pick():
    with pytest.raises(BK.BackendError, match="mhc must be one of"):
        BK.kernel_ops(mhc="fast")
    with pytest.raises(BK.BackendError, match="attention backend must be one of"):
        BK.Backends("fast")


@pytest.mark.parametrize("tokens, kernel", [(64, True), (65, False)])
def test_fused_route_above_its_token_limit_takes_xla(tokens, kernel, monkeypatch):
    """FusedRoute(max_tokens=64): 64 tokens through the router kernel, 65 (a prefill chunk past the limit) and any
    call with an image mask through `moe.route_plain`."""
    cfg = dataclasses.replace(preset("tiny"), n_routed_experts=64)
    calls = []

    def fake(x, gate, cfg, backend):
        calls.append(backend)
        w, idx = moe.route(x.astype(jnp.float32), gate, cfg)
        return w, idx, *moe.expert_order(idx, cfg.n_routed_experts)

    monkeypatch.setattr(BK.router, "route_fused", fake)
    gate = {"weight": jnp.zeros((64, cfg.dim), jnp.bfloat16), "bias": jnp.zeros((64,), jnp.float32),
            "bias_vl": jnp.zeros((64,), jnp.float32)}
    route = BK.FusedRoute("pallas", 64)
    x = jnp.zeros((tokens, cfg.dim), jnp.bfloat16)
    _, _, perm = jax.eval_shape(lambda x: route(x, gate, cfg), x)
    assert calls == (["pallas"] if kernel else []) and (perm is not None) == kernel
    jax.eval_shape(lambda x: route(x, gate, cfg, jnp.zeros((tokens,), bool)), x)
    assert len(calls) == int(kernel)
