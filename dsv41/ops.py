"""The model's swappable operations: which code runs a linear, the routed experts, the router and an mHC site.

The model takes an `Ops` as a static argument (like `Numerics`); `XLA` is the plain composition the spec
describes. A serving layer builds other `Ops` (kernels on weights it prepared) without the model importing it:
every replacement must compute the same function of the same inputs, to its own rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from dsv41 import mhc, moe, nn


@dataclasses.dataclass(frozen=True)
class Ops:
    """Callables with the signatures of their XLA defaults. Fields must hash and compare by value (module-level
    functions or frozen dataclasses with `__call__`): an `Ops` is part of the jit cache key.

    linear: (x [..., in], w, num, *, fp8_input) -> [..., out] (`nn.linear`).
    grouped_linear: (x [..., G, in], w, num) -> [..., G, out] (`nn.grouped_linear`).
    routed_experts: (x [T, D], w [T, k], idx [T, k], experts, cfg, num, permutation | None) -> float32 [T, D]
      (`moe.routed_experts`).
    route: (x [T, D], gate, cfg, image_mask [T] | None) -> (weights [T, k], ids [T, k], (order [T*k],
      sizes [E]) | None) (`moe.route_plain`).
    mhc_site: (y [..., D] | None, h [..., hc, D], post, comb, pre, fn, scale, base, norm_w, cfg) ->
      (h', x, pre', post', comb') (`mhc.site`): one mHC site of `model.block`."""

    linear: Callable = nn.linear
    grouped_linear: Callable = nn.grouped_linear
    routed_experts: Callable = moe.routed_experts
    route: Callable = moe.route_plain
    mhc_site: Callable = mhc.site


XLA = Ops()
