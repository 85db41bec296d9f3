"""Where a program makes XLA's GPU backend wait for the host in the middle of a call.

XLA's GPU backend runs a `lax.cond` / `lax.switch` on a device value by copying the branch index to the host and
launching the branch it names, and a `lax.while_loop` by reading its condition on the host before every iteration
(neither is a CUDA-graph command under XLA's default `--xla_gpu_enable_command_buffer`); a host callback
(`jax.pure_callback`, `io_callback`, `jax.debug.print` / `callback`) copies its operands to the host and runs Python
there. Each such op stops the host thread that launches the program until the device reaches it, so the call
cannot return once it is launched: the host cannot prepare the next step meanwhile (`EngineConfig.device_feed`
counts on that), and every op is a device idle gap while the host launches what follows. Not counted: a cond on
`lax.platform_dependent`'s index (resolved when the program is lowered for one platform), a loop with a static trip
count (jax's scan; XLA knows its trip count), and anything inside a kernel's body (Pallas / Mosaic GPU: its control
flow runs on the device).

    host_round_trips(jax.jit(step).trace(*args).jaxpr)  # -> [("cond", "head_sample"), ("while", "attention")]
"""

from __future__ import annotations

from typing import Iterator

from jax.extend import core

# kernel calls: their bodies' control flow is the kernel's own (Mosaic GPU's primitive, and Pallas' in interpret mode)
_KERNEL_PRIMITIVES = frozenset({"mpmd_map", "pallas_call"})
_CALLBACKS = frozenset({"pure_callback", "io_callback", "debug_callback", "debug_print"})


def host_round_trips(jaxpr: core.ClosedJaxpr | core.Jaxpr) -> list[tuple[str, str]]:
    """The ops of a traced program (`jax.jit(f).trace(...).jaxpr`) that read a device value on the host mid-call
    on a GPU: ("cond" | "while" | "callback", the op's named scope), in program order, nested ones included."""
    return list(_walk(getattr(jaxpr, "jaxpr", jaxpr)))


def _walk(jaxpr: core.Jaxpr) -> Iterator[tuple[str, str]]:
    made_by = {}
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            made_by[v] = eqn.primitive.name
        name = eqn.primitive.name
        if name in _KERNEL_PRIMITIVES:
            continue
        if name == "cond" and not _static_index(eqn.invars[0], made_by):
            yield "cond", str(eqn.source_info.name_stack)
        elif name == "while":
            yield "while", str(eqn.source_info.name_stack)
        elif name in _CALLBACKS:
            yield "callback", str(eqn.source_info.name_stack)
        for sub in sub_jaxprs(eqn):
            yield from _walk(sub)


def sub_jaxprs(eqn: core.JaxprEqn) -> Iterator[core.Jaxpr]:
    """The jaxprs an equation holds (a pjit's, a loop's body, a cond's branches)."""
    for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
            if isinstance(sub, core.ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, core.Jaxpr):
                yield sub


def _static_index(index, made_by: dict) -> bool:
    """A cond's index known when the program is lowered: a literal, or `lax.platform_dependent`'s platform."""
    return isinstance(index, core.Literal) or made_by.get(index) == "platform_index"
