"""Runs of layers that share one compiled body: consecutive layers whose attention plan, compress ratio, KV source,
RoPE frequencies, Engram / split role and parameter shapes are all equal (`runs`). A program traces each run's
body once and loops it over the run's layers (`scan`), so its compile time grows with the number of bodies, not of
layers. Where a sequence of such runs repeats, it is one periodic run, scanned over its whole periods, the parts of
a last, partial period after the loop (Flash: 10 runs of 40 layers, 12 bodies; L21-39 three reuse layers and a
reindex layer, four times, then three reuse layers). No run of two layers or more holds a KV source, an Engram
layer or the split layer, so those keep their static per-layer code.

The parameters of the programs hold the layers grouped by run (`stack_params`): stacked (each leaf [n, ...] for a
run of n layers, scanned; a periodic run `Periodic`: its parts' stacks over the whole periods, leaves [periods, part
length, ...], and those of its partial period's parts, leaves [part length, ...]), or a list of the run's
per-layer dicts (stack=False: the runs unrolled, each layer's weights their own buffers, as a kernel that reads a
weight in place needs while it cannot take a layer index: a scan's per-layer slice of a stacked weight is a copy
wherever XLA does not fuse it into its reader). On disk and in `init_params` / `load_checkpoint` trees the layers
stay one dict a layer, as released.

On a GPU XLA fuses a layer's slice into its reader where the loop slices the stack by its own counter (`lax.scan`'s
xs); a slice at another traced index (a loop's stack indexed by a value it carries, or inside a `lax.cond`) is a
copy of the layer's weights, so a periodic run's partial period has stacks of its own rather than a branch on the
period in the loop or the last period of longer stacks. Where XLA fuses it, a kernel gets the slice in place, at
the layer's offset in the stack, and Mosaic GPU kernels take only `ALIGN`-byte aligned operands: a replicated leaf
whose layer is not a multiple of ALIGN bytes (the mHC `scale` [3] and `base` [24] float32) is stacked `Padded`,
each layer flattened and padded to one, and `scan` hands the body the layer's own shape again.
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

# bytes: the operand alignment of Mosaic GPU kernels (and of the buffers XLA allocates), so the stride of a layer in
# a stack; serving/engine/host_rows.py aligns a call's host arrays to it too
ALIGN = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Padded:
    """A stacked leaf with layers of `shape`, each flattened and padded to a multiple of ALIGN bytes: data
    [*lead, k]. Indexing its layer axes (`jax.tree_util.tree_map` over a run's tree, `lax.scan`) keeps it Padded;
    `unpadded` gives a layer's array."""

    data: Any
    shape: tuple = dataclasses.field(metadata=dict(static=True))


def unpadded(tree):
    """A layer's tree with its `Padded` leaves (data [k]) as arrays of their shape."""
    def one(x):
        if not isinstance(x, Padded):
            return x
        return x.data[:int(np.prod(x.shape, dtype=np.int64))].reshape(x.shape)

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, Padded))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Periodic:
    """A periodic run's stacked weights (`stack_layers`): `whole`, one tree a part, leaves [whole periods, part
    length, ...], which the run's loop takes as its xs; `tail`, one tree a part of its last, partial period (a
    prefix of the parts, maybe none), leaves [part length, ...]."""

    whole: tuple
    tail: tuple


def trees_of(run_params) -> list:
    """The dict trees of a run's entry in the `RUNS_KEY` list: a run of one's (or an unrolled run's) layers, a
    stacked run's tree, a periodic run's stacks (`Periodic`: the whole periods' parts, then the partial period's)."""
    if isinstance(run_params, list):
        return run_params
    if isinstance(run_params, Periodic):
        return [*run_params.whole, *run_params.tail]
    return [run_params]


def _padded_size(x) -> int | None:
    """The elements a layer of leaf x takes in its stack when it must be `Padded` (a replicated leaf of a size that
    is not a multiple of ALIGN bytes), else None."""
    nbytes = int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize
    sh = getattr(x, "sharding", None)
    replicated = sh is None or sh.is_fully_replicated
    if nbytes % ALIGN == 0 or not replicated:
        return None
    return -(-nbytes // ALIGN) * ALIGN // x.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Run:
    """Layers [first, first + n): everything static about them is the first layer's (its `plan`). A periodic run
    (`parts` set) repeats a period of parts, each part `count` consecutive layers of one body (`plan`: that of its
    first layer in the first period): its layers' plans differ by position, not by period. Its last period may
    stop after any part (Flash: L21-39, four periods and the first part of a fifth)."""

    first: int
    n: int
    plan: LayerPlan
    parts: tuple[tuple[LayerPlan, int], ...] = ()

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.n)

    @property
    def period(self) -> int:
        return sum(c for _, c in self.parts) if self.parts else 1

    def locate(self, j: int) -> tuple[int, int, int]:
        """The run's j-th layer -> (its part, its period, its position in the part)."""
        t, o = divmod(j, self.period)
        for q, (_, c) in enumerate(self.parts or ((self.plan, 1),)):
            if o < c:
                return q, t, o
            o -= c
        raise AssertionError("unreachable: o < period")

    @property
    def whole(self) -> int:
        """How many periods hold every part (the loop's length; the last period may hold a prefix of the parts)."""
        return self.n // self.period

    def periods(self, q: int = 0) -> int:
        """How many periods hold part q."""
        return self.whole + (self.n % self.period > sum(c for _, c in self.parts[:q]))

    def view(self, q: int) -> Run:
        """The run as part q's layers see it: the part's plan, the run's geometry (its first layer, its length:
        its KV record holds every layer's rings)."""
        return dataclasses.replace(self, plan=self.parts[q][0]) if self.parts else self


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


# Periods tried: of up to this many runs (Flash: a reindex layer and three reuse layers, two runs)
MAX_PERIOD_RUNS = 4


def _simple_runs(cfg: ModelConfig) -> list[tuple[Run, tuple]]:
    """Maximal runs of consecutive layers with one body, each with its body key."""
    out: list[tuple[Run, tuple]] = []
    for layer in range(cfg.n_layers):
        k = _body_key(cfg, layer)
        if out and k == out[-1][1]:
            out[-1] = (dataclasses.replace(out[-1][0], n=out[-1][0].n + 1), k)
        else:
            out.append((Run(layer, 1, LayerPlan.of(cfg, layer)), k))
    return out


@functools.lru_cache(maxsize=16)
def runs(cfg: ModelConfig) -> tuple[Run, ...]:
    """The model's layers as runs with one scanned body: maximal runs of consecutive layers of one body, and where
    a sequence of such runs repeats (same bodies, same lengths) twice or more, one periodic run of them (the
    longest span, first from the left; its last period may hold only its first runs). Only runs without code of
    their own repeat (a KV source's pages, the Engram and split layers stay runs of one), so every layer of a
    periodic run reads the pool the same way: its rings, one record for the run."""
    simple = _simple_runs(cfg)
    out: list[Run] = []
    r = 0
    while r < len(simple):
        best: tuple = (1, 1, 0)  # (full periods, runs a period, runs of a last partial period)
        for p in range(2, MAX_PERIOD_RUNS + 1):
            pattern = [(k, run.n) for run, k in simple[r:r + p]]
            if len(pattern) < p or any(k[0] is not None for k, _ in pattern):
                continue
            reps = 1
            while [(k, run.n) for run, k in simple[r + reps * p:r + (reps + 1) * p]] == pattern:
                reps += 1
            tail = 0  # the parts of a last, partial period
            while tail < p - 1 and [(k, run.n) for run, k in simple[r + reps * p + tail:][:1]] == pattern[tail:][:1]:
                tail += 1
            if reps > 1 and reps * p + tail > best[0] * best[1] + best[2]:
                best = (reps, p, tail)
        reps, p, tail = best
        if reps == 1:
            out.append(simple[r][0])
        else:
            period = [run for run, _ in simple[r:r + p]]
            out.append(Run(period[0].first, reps * sum(x.n for x in period) + sum(x.n for x in period[:tail]),
                           period[0].plan, tuple((x.plan, x.n) for x in period)))
        r += reps * p + tail
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


def _stacked_sharding(x, axes: int = 1) -> Any:
    from dsv41 import sharding

    sh = getattr(x, "sharding", None)
    if not isinstance(sh, jax.sharding.NamedSharding):
        return None
    for _ in range(axes):
        sh = sharding.stacked(sh)
    return sh


@functools.lru_cache(maxsize=None)
def _stacker(sharding, lead: tuple[int, ...], padded: int | None = None) -> Callable:
    """A jitted stack of one leaf's per-layer arrays [*lead, ...] (lead: n, or periods and the part's length),
    placed at `sharding` (None: where jit puts it), one per placement (a fresh jit a call would trace and compile
    every leaf). padded: each layer flattened and padded to that many elements ([*lead, padded], `Padded`'s data)."""
    if padded is None:
        return jax.jit(lambda *xs: jnp.stack(xs).reshape(*lead, *xs[0].shape), out_shardings=sharding)

    def stack(*xs):
        flat = jnp.stack([x.reshape(-1) for x in xs])
        return jnp.pad(flat, ((0, 0), (0, padded - flat.shape[1]))).reshape(*lead, padded)

    return jax.jit(stack, out_shardings=sharding)


def _padded_sharding(x):
    """The sharding of a replicated leaf's `Padded` stack: replicated where the leaf was."""
    sh = getattr(x, "sharding", None)
    if not isinstance(sh, jax.sharding.NamedSharding):
        return None
    return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(), memory_kind=sh.memory_kind)


def _stack_group(trees: list, lead: tuple[int, ...], consume: bool):
    """The layers' trees (in order) -> one tree, leaves [*lead, ...]; consume: each leaf's per-layer arrays deleted
    once stacked."""
    leaves, treedef = jax.tree_util.tree_flatten(trees[0])
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        def abstract(x):
            k = _padded_size(x)
            if k is None:
                return jax.ShapeDtypeStruct((*lead, *x.shape), x.dtype, sharding=_stacked_sharding(x, len(lead)))
            return Padded(jax.ShapeDtypeStruct((*lead, k), x.dtype, sharding=_padded_sharding(x)), x.shape)

        return jax.tree_util.tree_unflatten(treedef, [abstract(x) for x in leaves])
    stacked = []
    for xs in zip(*(jax.tree_util.tree_flatten(t)[0] for t in trees)):
        k = _padded_size(xs[0])
        if k is None:
            stacked.append(_stacker(_stacked_sharding(xs[0], len(lead)), lead)(*xs))
        else:
            stacked.append(Padded(_stacker(_padded_sharding(xs[0]), lead, k)(*xs), xs[0].shape))
        if consume:
            for x in xs:
                if isinstance(x, jax.Array) and not x.is_deleted():
                    x.delete()
    return jax.tree_util.tree_unflatten(treedef, stacked)


def stack_layers(layers: list, cfg: ModelConfig, consume: bool = False) -> list:
    """Per-layer dicts (release layout, any weight formats, device or abstract arrays) -> one entry a run: for a
    run of several layers a tree whose leaves are stacked on a new leading layer axis [n, ...]; for a periodic run
    a `Periodic`: one such tree a part over the whole periods, leaves [periods, part length, ...], and one a part
    of the last, partial period, leaves [part length, ...]; placed as the layer's leaf plus those
    axes, which no mesh axis splits (`sharding.stacked`). A run of one stays its layer's dict (in a list, as `scan`
    takes it: nothing to copy).

    Stacking copies the weights of the runs of several layers. consume=False: the per-layer arrays are left
    as they are (while the caller holds them, both copies are in memory: call it once per model). consume=True:
    each leaf's per-layer arrays are deleted as soon as their stack exists, so memory peaks at the weights plus
    one leaf of one run, not twice the weights; the caller's `layers` is unusable afterwards (its owner, e.g. the
    engine on the tree it loaded, asks for this)."""
    out = []
    for run in runs(cfg):
        if run.n == 1:
            out.append([layers[run.first]])
        elif not run.parts:
            out.append(_stack_group([layers[i] for i in run.layers], (run.n,), consume))
        else:
            whole, o, loop, tail = run.whole, 0, [], []
            for q, (_, c) in enumerate(run.parts):
                trees = [layers[run.first + t * run.period + o + j] for t in range(whole) for j in range(c)]
                loop.append(_stack_group(trees, (whole, c), consume))
                if run.periods(q) > whole:
                    tail.append(_stack_group([layers[run.first + whole * run.period + o + j] for j in range(c)],
                                             (c,), consume))
                o += c
            out.append(Periodic(tuple(loop), tuple(tail)))
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
    return unpadded(_layer_of(runs(cfg)[r], params[RUNS_KEY][r], j))


def _layer_of(run: Run, run_params, j: int):
    """The run's j-th layer's tree (its `Padded` leaves as they are) out of its entry in the `RUNS_KEY` list."""
    if isinstance(run_params, list):
        return run_params[j]
    if isinstance(run_params, Periodic):
        q, t, k = run.locate(j)
        if t < run.whole:
            return jax.tree_util.tree_map(lambda a: a[t, k], run_params.whole[q])
        return jax.tree_util.tree_map(lambda a: a[k], run_params.tail[q])
    return jax.tree_util.tree_map(lambda a: a[j], run_params)


def _unpadded_body(body: Callable, state, lp, layer, view):
    return body(state, unpadded(lp), layer, view)


def scan(body: Callable, state, run: Run, run_params, unroll: bool = False):
    """body(state, layer params, layer, view) -> (state, y) over the run's layers; view: the run as the layer's
    body sees it (`Run.view`: its part's plan on a periodic run). run_params: stacked (`stack_params`: [n, ...], or
    a periodic run's `Periodic`) or a list of the layers' dicts.

    A run of one, a list, or unroll (a traced path that names per-layer intermediates) calls body per layer with
    the static layer index; otherwise one `lax.scan` whose body gets the layer index traced (a periodic run: a scan
    over its whole periods whose body runs each part, a part of several layers its own inner scan, then the parts
    of its last, partial period).
    -> (state, ys stacked [n, ...] in layer order, or None)."""
    body = functools.partial(_unpadded_body, body)
    if run.n == 1 or unroll or isinstance(run_params, list):
        ys = []
        for j in range(run.n):
            state, y = body(state, _layer_of(run, run_params, j), run.first + j, run.view(run.locate(j)[0]))
            ys.append(y)
        if ys[0] is None:
            return state, None
        return state, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ys)

    def scan_part(state, part_params, first, view):
        def step(state, args):
            lp, j = args
            return body(state, lp, first + j, view)

        n = jax.tree_util.tree_leaves(part_params)[0].shape[0]
        return jax.lax.scan(step, state, (part_params, jnp.arange(n, dtype=jnp.int32)))

    if not run.parts:
        return scan_part(state, run_params, run.first, run)

    def part(state, part_params, first, q):
        if run.parts[q][1] == 1:  # no loop around a single layer
            state, y = body(state, jax.tree_util.tree_map(lambda a: a[0], part_params), first, run.view(q))
            return state, None if y is None else jax.tree_util.tree_map(lambda a: a[None], y)
        return scan_part(state, part_params, first, run.view(q))

    def parts(state, parts_params, first):
        ys = []
        for q, part_params in enumerate(parts_params):
            state, y = part(state, part_params, first + sum(c for _, c in run.parts[:q]), q)
            ys.append(y)
        return state, None if ys[0] is None else jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *ys)

    def period(state, args):
        t, sliced = args
        return parts(state, sliced, run.first + t * run.period)

    whole = run.whole
    state, ys = jax.lax.scan(period, state, (jnp.arange(whole, dtype=jnp.int32), run_params.whole))
    if ys is not None:
        ys = jax.tree_util.tree_map(lambda a: a.reshape(whole * run.period, *a.shape[2:]), ys)
    if not run_params.tail:
        return state, ys
    state, tail_ys = parts(state, run_params.tail, run.first + whole * run.period)
    return state, None if ys is None else jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), ys, tail_ys)
