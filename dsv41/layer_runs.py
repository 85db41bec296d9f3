"""Runs of layers that share one compiled body: consecutive layers whose attention plan, compress ratio, KV source,
RoPE frequencies, Engram / split role and parameter shapes are all equal (`runs`). A program traces each run's
body once and loops it over the run's layers (`scan`), so its compile time grows with the number of runs, not of
layers (Flash: 18 runs of 40 layers; no run of two layers or more holds a KV source, an Engram layer or the split
layer, so those keep their static per-layer code).

The parameters of the programs hold the layers grouped by run (`stack_params`): stacked (each leaf [n, ...] for a
run of n layers, scanned), or a list of the run's per-layer dicts (stack=False: the runs unrolled, each layer's
weights their own buffers, as a kernel that reads a weight in place needs while it cannot take a layer index: a
scan's per-layer slice of a stacked weight is a copy wherever XLA does not fuse it into its reader). On disk and
in `init_params` / `load_checkpoint` trees the layers stay one dict a layer, as released.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import rope
from dsv41.config import ModelConfig
from dsv41.layer_plan import LayerPlan
from dsv41.params import Spec, layer_specs

# The params-tree key of the layers grouped by run (`stack_params`), in place of "layers".
RUNS_KEY = "runs"


@dataclasses.dataclass(frozen=True)
class Run:
    """Layers [first, first + n): everything static about them is the first layer's (its `plan`)."""

    first: int
    n: int
    plan: LayerPlan

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.n)


def _body_key(cfg: ModelConfig, layer: int) -> tuple:
    """What must be equal for two layers to share a body. Layers with code of their own (a KV source writes its
    own pages, the Engram and split layers take per-layer inputs and phases) key on their index: a run of one."""
    plan = LayerPlan.of(cfg, layer)
    own = plan.writes_kv or layer in cfg.engram_layer_ids or layer == cfg.split_layer
    specs = layer_specs(cfg, layer)

    def is_spec(x) -> bool:
        return isinstance(x, Spec)

    return (layer if own else None, dataclasses.replace(plan, layer=0), rope.inv_freq(cfg, layer).tobytes(),
            jax.tree_util.tree_structure(specs, is_leaf=is_spec),
            tuple(jax.tree_util.tree_leaves(specs, is_leaf=is_spec)))


@functools.lru_cache(maxsize=16)
def runs(cfg: ModelConfig) -> tuple[Run, ...]:
    """The model's layers as maximal runs of consecutive layers with one body."""
    out: list[Run] = []
    key = None
    for layer in range(cfg.n_layers):
        k = _body_key(cfg, layer)
        if out and k == key:
            out[-1] = dataclasses.replace(out[-1], n=out[-1].n + 1)
        else:
            out.append(Run(layer, 1, LayerPlan.of(cfg, layer)))
            key = k
    return tuple(out)


def run_of(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """-> (index of the run holding `layer`, its position in the run)."""
    for r, run in enumerate(runs(cfg)):
        if layer in run.layers:
            return r, layer - run.first
    raise ValueError(f"layer {layer} out of range [0, {cfg.n_layers})")


def runs_between(cfg: ModelConfig, first: int, last: int) -> list[tuple[int, Run]]:
    """(index, run) of the runs covering layers [first, last); both ends must be run boundaries (the split layer
    is a run of one, so the encoder / decoder boundaries are)."""
    out = [(r, run) for r, run in enumerate(runs(cfg)) if first <= run.first < last]
    if out and (out[0][1].first != first or out[-1][1].layers.stop != last):
        raise ValueError(f"layers [{first}, {last}) do not start and end at runs of {runs(cfg)}")
    return out


def _stacked_sharding(x) -> Any:
    from dsv41 import sharding

    sh = getattr(x, "sharding", None)
    return sharding.stacked(sh) if isinstance(sh, jax.sharding.NamedSharding) else None


@functools.lru_cache(maxsize=None)
def _stacker(sharding) -> Callable:
    """A jitted stack of one leaf's per-layer arrays [n, ...] placed at `sharding` (None: where jit puts it), one
    per placement (a fresh jit a call would trace and compile every leaf)."""
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)


def stack_layers(layers: list, cfg: ModelConfig, consume: bool = False) -> list:
    """Per-layer dicts (release layout, any weight formats, device or abstract arrays) -> one entry a run: for a
    run of several layers a tree whose leaves are stacked on a new leading layer axis [n, ...], placed as the
    layer's leaf plus that axis, which no mesh axis splits (`sharding.stacked`); a run of one stays its layer's
    dict (in a list, as `scan` takes it: nothing to copy).

    Stacking copies the weights of the runs of several layers. consume=False: the per-layer arrays are left
    as they are (while the caller holds them, both copies are in memory: call it once per model). consume=True:
    each leaf's per-layer arrays are deleted as soon as their stack exists, so memory peaks at the weights plus
    one leaf of one run, not twice the weights; the caller's `layers` is unusable afterwards (its owner, e.g. the
    engine on the tree it loaded, asks for this)."""
    out = []
    for run in runs(cfg):
        trees = [layers[i] for i in run.layers]
        if run.n == 1:
            out.append(trees)
            continue
        leaves, treedef = jax.tree_util.tree_flatten(trees[0])
        per_leaf = zip(*(jax.tree_util.tree_flatten(t)[0] for t in trees))
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            out.append(jax.tree_util.tree_unflatten(treedef, [
                jax.ShapeDtypeStruct((run.n, *x.shape), x.dtype, sharding=_stacked_sharding(x)) for x in leaves]))
            continue
        stacked = []
        for xs in per_leaf:
            stacked.append(_stacker(_stacked_sharding(xs[0]))(*xs))
            if consume:
                for x in xs:
                    if isinstance(x, jax.Array) and not x.is_deleted():
                        x.delete()
        out.append(jax.tree_util.tree_unflatten(treedef, stacked))
    return out


def stack_params(params: dict, cfg: ModelConfig, stack: bool = True, consume: bool = False) -> dict:
    """A params tree with its "layers" list replaced by the `RUNS_KEY` list, one entry a run: its layers stacked
    (`stack_layers`; consume: deleting the per-layer arrays as they are stacked), or (stack=False) the list of its
    layers' dicts, unrolled by `scan`. A tree already grouped is returned as it is."""
    if RUNS_KEY in params:
        return params
    out = {k: v for k, v in params.items() if k != "layers"}
    out[RUNS_KEY] = (stack_layers(params["layers"], cfg, consume) if stack
                     else [[params["layers"][i] for i in run.layers] for run in runs(cfg)])
    return out


def layer_params(params: dict, cfg: ModelConfig, layer: int) -> dict:
    """One layer's dict out of a run-stacked tree (a view for tests and tools; the programs scan the runs)."""
    r, j = run_of(cfg, layer)
    group = params[RUNS_KEY][r]
    return group[j] if isinstance(group, list) else jax.tree_util.tree_map(lambda a: a[j], group)


def scan(body: Callable, state, run: Run, run_params, xs=None, unroll: bool = False):
    """body(state, layer params, layer, x) -> (state, y) over the run's layers: run_params stacked [n, ...] (sliced
    per layer) or a list of the layers' dicts (`stack_params`).

    A run of one, a list, or unroll (a traced path that names per-layer intermediates) calls body per layer with
    the static layer index; otherwise one `lax.scan` whose body gets the layer index traced. -> (state, ys stacked
    [n, ...] or None)."""
    listed = isinstance(run_params, list)
    if run.n == 1 or unroll or listed:
        ys = []
        for j in range(run.n):
            lp = run_params[j] if listed else jax.tree_util.tree_map(lambda a: a[j], run_params)
            x = None if xs is None else jax.tree_util.tree_map(lambda a: a[j], xs)
            state, y = body(state, lp, run.first + j, x)
            ys.append(y)
        if ys[0] is None:
            return state, None
        return state, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ys)

    def step(state, args):
        lp, j, x = args
        return body(state, lp, run.first + j, x)

    return jax.lax.scan(step, state, (run_params, jnp.arange(run.n, dtype=jnp.int32), xs))
