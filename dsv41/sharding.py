"""The one place that decides partitioning: mesh axes, parallelism modes, logical-axis rules.

Every weight names its logical axes once (`params.Spec.axes`); a table of rules per mode maps logical axes to
the mesh axes ("data", "tensor"), MaxText-style, through Flax's logical-partitioning helpers. No other module
names a mesh axis. Expert parallelism is not a mesh axis of its own: experts are split over data x tensor (all
ranks), as vLLM's DEP (--data-parallel-size N --enable-expert-parallel) does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as fnn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv41 import quant
from dsv41.config import ConfigError, ModelConfig

DATA, TENSOR = "data", "tensor"
MESH_AXES = (DATA, TENSOR)
# the ways tokens reach the ranks that hold their experts (vLLM's --all2all-backend names)
ALL2ALL_BACKENDS = ("allgather_reducescatter", "ragged_all_to_all")

Rules = tuple[tuple[str, Any], ...]

# Tensor parallel: heads, index heads, output groups, FFN widths and vocabulary split; embed and the KV latent
# replicated (one 512-wide latent shared by every head, so every rank holds all of it).
TP_RULES: Rules = (
    ("heads", TENSOR),
    ("index_heads", TENSOR),
    ("o_groups", TENSOR),
    ("ffn", TENSOR),
    ("expert_ffn", TENSOR),
    ("vocab", TENSOR),
    ("activation_heads", TENSOR),
    ("activation_vocab", TENSOR),
)
# Data-parallel attention + expert parallel: experts over every rank, so their width stays whole; attention is
# replicated per data rank with heads split by tensor inside it; each data rank runs its own batch.
DEP_RULES: Rules = (
    ("experts", (DATA, TENSOR)),
    ("heads", TENSOR),
    ("index_heads", TENSOR),
    ("o_groups", TENSOR),
    ("ffn", TENSOR),
    ("vocab", TENSOR),
    ("activation_batch", DATA),
    ("activation_heads", TENSOR),
    ("activation_vocab", TENSOR),
)
# Data parallel without EP: the TP table per data rank, each data rank running its own batch.
DP_RULES: Rules = TP_RULES + (("activation_batch", DATA),)


class ParallelismError(ConfigError):
    """A parallel layout the model or the machine cannot take."""


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """vLLM's --tensor-parallel-size, --data-parallel-size, --enable-expert-parallel, --all2all-backend (how
    tokens reach their experts' ranks: `ALL2ALL_BACKENDS`, `ExpertParallel`)."""

    tensor: int = 1
    data: int = 1
    expert: bool = False
    all2all: str = "allgather_reducescatter"

    @property
    def devices(self) -> int:
        return self.tensor * self.data

    @property
    def expert_ranks(self) -> int:
        """How many ranks split the routed experts (1 without EP)."""
        return self.devices if self.expert else 1

    def rules(self) -> Rules:
        if self.expert:
            return DEP_RULES
        return DP_RULES if self.data > 1 else TP_RULES

    def validate(self, cfg: ModelConfig, n_devices: int | None = None) -> None:
        """Raises ParallelismError naming the first thing this layout cannot split, before anything loads."""
        if self.tensor < 1 or self.data < 1:
            raise ParallelismError(f"parallel sizes must be >= 1, got tensor={self.tensor}, data={self.data}")
        if self.expert and self.data == 1:
            raise ParallelismError("expert parallelism needs --data-parallel-size > 1; for one data rank use "
                                   "tensor parallelism")
        if self.all2all not in ALL2ALL_BACKENDS:
            raise ParallelismError(f"unknown --all2all-backend {self.all2all!r}; choose one of {ALL2ALL_BACKENDS}")
        if self.all2all != ALL2ALL_BACKENDS[0] and not self.expert:
            raise ParallelismError(f"--all2all-backend {self.all2all} exchanges tokens between expert-parallel "
                                   "ranks; add --enable-expert-parallel or drop it")
        n = len(jax.devices()) if n_devices is None else n_devices
        if self.devices > n:
            raise ParallelismError(f"--tensor-parallel-size {self.tensor} x --data-parallel-size {self.data} asks "
                                   f"for {self.devices} devices but {n} are present; lower the sizes")
        t = self.tensor
        checks = [("attention heads (n_heads)", cfg.n_heads, t),
                  ("indexer heads (index_n_heads)", cfg.index_n_heads, t),
                  ("output groups (o_groups)", cfg.o_groups, t),
                  ("vocabulary (vocab_size)", cfg.vocab_size, t)]
        if self.expert:
            checks.append(("routed experts (n_routed_experts)", cfg.n_routed_experts, self.expert_ranks))
            if cfg.n_mtp_layers:
                checks.append(("DSpark routed experts (dspark_n_routed_experts)", cfg.dspark_n_routed_experts,
                               self.expert_ranks))
            checks.append(("shared expert width (moe_inter_dim)", cfg.moe_inter_dim, t))
        else:
            checks.append(("expert width (moe_inter_dim)", cfg.moe_inter_dim, t))
        for what, size, ways in checks:
            if size % ways:
                flag = "--tensor-parallel-size" if ways == t else "the EP size (tensor x data)"
                raise ParallelismError(f"{what} = {size} cannot be split {ways} ways; choose {flag} dividing "
                                       f"{size}")


def make_mesh(par: Parallelism, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "tensor") mesh of par.data x par.tensor devices; Auto axes so XLA places the activations."""
    devices = list(jax.devices() if devices is None else devices)
    if par.devices > len(devices):
        raise ParallelismError(f"{par} needs {par.devices} devices but {len(devices)} are given")
    return jax.make_mesh((par.data, par.tensor), MESH_AXES, devices=devices[:par.devices],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def parallelism_of(mesh: Mesh) -> Parallelism:
    """The layout a bare mesh implies: a data axis > 1 means DEP (the usual multi-rank serving layout)."""
    unknown = set(mesh.axis_names) - set(MESH_AXES)
    if unknown:
        raise ParallelismError(f"mesh axes {sorted(unknown)} are not dsv41 axes {MESH_AXES}; build the mesh "
                               "with dsv41.sharding.make_mesh")
    data = mesh.shape.get(DATA, 1)
    return Parallelism(tensor=mesh.shape.get(TENSOR, 1), data=data, expert=data > 1)


def logical_spec(axes: Sequence[str | None], ndim: int) -> PartitionSpec:
    """A weight's logical PartitionSpec, padded with None to ndim."""
    axes = tuple(axes)[:ndim]
    return PartitionSpec(*(axes + (None,) * (ndim - len(axes))))


def _axis_size(mesh: Mesh, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def mesh_spec(axes: Sequence[str | None], mesh: Mesh, par: Parallelism,
              shapes: Sequence[tuple[int, ...]]) -> PartitionSpec:
    """The mesh PartitionSpec of a weight with logical `axes`; a dim stays whole where the split does not
    divide every one of `shapes` (a quantized weight's weight and scale, which must shard alike)."""
    ndim = len(shapes[0])
    spec = fnn.logical_to_mesh_axes(logical_spec(axes, ndim), par.rules())
    parts = [_split(mesh, p) if all(s[i] % _axis_size(mesh, p) == 0 for s in shapes) else None
             for i, p in enumerate(spec)]
    return PartitionSpec(*parts)


def _split(mesh: Mesh, entry):
    """entry without the mesh axes of size 1 (they split nothing), so specs read the same on any layout."""
    names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n and mesh.shape[n] > 1)
    return None if not names else names[0] if len(names) == 1 else names


def weight_sharding(axes: Sequence[str | None], mesh: Mesh | None, shapes: Sequence[tuple[int, ...]],
                    par: Parallelism | None = None) -> jax.sharding.Sharding:
    """Where one weight lives; no mesh: the first device."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    par = parallelism_of(mesh) if par is None else par
    return NamedSharding(mesh, mesh_spec(axes, mesh, par, shapes))


def per_device_bytes(tree, shardings) -> dict[jax.Device, int]:
    """Bytes each device holds for a tree of arrays / ShapeDtypeStructs under a matching tree of shardings,
    from the shard shapes (abstract: nothing is allocated)."""
    leaves = jax.tree_util.tree_leaves(tree)
    shs = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(leaves) != len(shs):
        raise ValueError(f"{len(leaves)} arrays but {len(shs)} shardings; pass matching trees")
    out: dict[jax.Device, int] = {}
    for x, sh in zip(leaves, shs):
        nbytes = math.prod(sh.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
        for d in sh.addressable_devices:
            out[d] = out.get(d, 0) + nbytes
    return out


def param_shardings(cfg: ModelConfig, par: Parallelism, mesh: Mesh, dtype: str | None = None):
    """The NamedSharding of every array of `abstract_params(cfg, dtype)` (a quantized leaf's weight and scale
    alike), from the logical axes of `params.param_specs`. Validates par first."""
    from dsv41 import params as P  # params imports nothing from here; the late import keeps config -> params

    par.validate(cfg, len(mesh.devices.flat))
    specs = jax.tree_util.tree_leaves(P.param_specs(cfg), is_leaf=lambda x: isinstance(x, P.Spec))
    leaves, treedef = jax.tree_util.tree_flatten(P.abstract_params(cfg, dtype), is_leaf=P.is_weight_leaf)
    out = []
    for spec, leaf in zip(specs, leaves, strict=True):
        arrays, sub = jax.tree_util.tree_flatten(leaf)
        sh = NamedSharding(mesh, mesh_spec(spec.axes, mesh, par, [a.shape for a in arrays]))
        out.append(jax.tree_util.tree_unflatten(sub, [sh] * len(arrays)))
    return jax.tree_util.tree_unflatten(treedef, out)


def put(tree, sh: jax.sharding.Sharding):
    """A pytree of host or device arrays placed as `sh` (one `jax.device_put` on one process). With several
    processes a host value, which every process holds alike, goes through `jax.make_array_from_callback`: each
    process copies only its own devices' shards, and no collective checks that the copies agree
    (`jax.device_put` runs one per array). A tree with abstract leaves (jax.ShapeDtypeStruct: an abstract engine's)
    -> every leaf abstract, placed as sh: what the placed tree would be."""
    leaves = jax.tree_util.tree_leaves(tree)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        def abstract(x):
            a = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh, weak_type=getattr(a, "weak_type", False))

        return jax.tree_util.tree_map(abstract, tree)
    if jax.process_count() == 1 or sh.is_fully_addressable:
        return jax.device_put(tree, sh)

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sh)
        a = np.asarray(x)
        return jax.make_array_from_callback(a.shape, sh, lambda index: a[index])

    return jax.tree_util.tree_map(one, tree)


def place_params(params, cfg: ModelConfig, par: Parallelism, mesh: Mesh):
    """params (any weight formats) placed as the rules split them on the mesh; arrays already placed so stay
    where they are, host arrays (the Engram tables, read by row on the host) and entries that are not weights
    stay as they are."""
    from dsv41 import params as P

    par.validate(cfg, len(mesh.devices.flat))

    def place(spec, leaf):
        arrays, sub = jax.tree_util.tree_flatten(leaf)
        if any(isinstance(a, np.ndarray) for a in arrays) or isinstance(leaf, quant.Fp8Rows):  # Engram tables
            return leaf
        sh = NamedSharding(mesh, mesh_spec(spec.axes, mesh, par, [a.shape for a in arrays]))
        return jax.tree_util.tree_unflatten(sub, [put(a, sh) for a in arrays])

    spec_keys = P.param_specs(cfg).keys()
    weights = {k: v for k, v in params.items() if k in spec_keys}  # other entries (a token map) stay as they are
    return {**params, **P.map_with_spec(place, cfg, weights)}


def abstract_mesh(par: Parallelism) -> jax.sharding.AbstractMesh:
    """The mesh of a layout without its devices (capacity plans for machines that are not here)."""
    return jax.sharding.AbstractMesh((par.data, par.tensor), MESH_AXES)


def weight_bytes_per_device(cfg: ModelConfig, par: Parallelism, dtype: str | None = None) -> int:
    """Bytes of device-resident weights (everything but the host's Engram tables) one device holds under the
    layout's rules, from the shard shapes of `abstract_params(cfg, dtype)` (None: the release's formats)."""
    from dsv41 import params as P

    par.validate(cfg, par.devices)
    mesh = abstract_mesh(par)
    specs = jax.tree_util.tree_leaves(P.param_specs(cfg), is_leaf=lambda x: isinstance(x, P.Spec))
    leaves = jax.tree_util.tree_leaves(P.abstract_params(cfg, dtype), is_leaf=P.is_weight_leaf)
    total = 0
    for spec, leaf in zip(specs, leaves, strict=True):
        if isinstance(leaf, quant.Fp8Rows):  # Engram tables: host memory
            continue
        arrays = jax.tree_util.tree_leaves(leaf)
        mspec = mesh_spec(spec.axes, mesh, par, [a.shape for a in arrays])
        for a in arrays:
            shard = [d // _axis_size(mesh, e) for d, e in zip(a.shape, tuple(mspec) + (None,) * a.ndim)]
            total += math.prod(shard) * np.dtype(a.dtype).itemsize
    return total


# ---- the engine's programs on a mesh ---------------------------------------------------------------------------
# The serving programs run per data rank: a `shard_map` manual over "data" (each rank its own batch rows, KV pool
# and sampling), automatic over "tensor" (XLA partitions heads, widths and vocabulary by the weights' shardings
# and inserts the reductions). Arrays that are per rank (pool, batch, outputs) stack the ranks on axis 0.


def rank_sharding(mesh: Mesh) -> NamedSharding:
    """Per-rank arrays (pool, batch, outputs): axis 0 split over data ranks, replicated over tensor ranks."""
    return NamedSharding(mesh, PartitionSpec(DATA))


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy on every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec())


def stacked(sh: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """The sharding of a weight stacked on a new leading layer axis (`layer_runs.stack_layers`): the layer's own
    sharding, the layer axis split by no mesh axis (a scanned program slices one layer a step on every device)."""
    if isinstance(sh, NamedSharding):
        return NamedSharding(sh.mesh, PartitionSpec(None, *sh.spec), memory_kind=sh.memory_kind)
    return sh


def manual_spec(sh: jax.sharding.Sharding) -> PartitionSpec:
    """The part of a weight's sharding that a data-manual `shard_map` declares (only "data"; "tensor" stays
    automatic inside). A replicated weight -> P()."""
    if not isinstance(sh, NamedSharding):
        return PartitionSpec()
    parts = []
    for entry in sh.spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        parts.append(DATA if DATA in names else None)
    return PartitionSpec(*parts)


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
    """`jax.lax.ragged_all_to_all`'s result built from an all-gather, for one slice per rank (offsets and sizes
    [axis size]): XLA's CPU backend has no ragged-all-to-all, so the CPU tests check the exchange's bookkeeping
    through this and the GPU runs the collective. Moves every rank's whole operand; never a fast path."""
    del recv_sizes  # implied by the senders' send_sizes
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [n, rows, ...]
    src_off = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # [n]: where each sender's slice for me starts
    size = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    dst_off = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    o = jnp.arange(output.shape[0], dtype=dst_off.dtype)
    inside = (o[None] >= dst_off[:, None]) & (o[None] < (dst_off + size)[:, None])  # [n, out rows]
    src = jnp.argmax(inside, axis=0)
    row = jnp.clip(src_off[src] + o - dst_off[src], 0, operand.shape[0] - 1)
    got = ops[src, row]
    return jnp.where(inside.any(0).reshape((-1,) + (1,) * (output.ndim - 1)), got, output)


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """`Ops.routed_experts` with the routed experts split over every rank (data x tensor: DEP, vLLM's
    --enable-expert-parallel), inside the engine's data-manual programs. Each rank runs its own experts on the
    token slots routed to them (`inner`, any `Ops.routed_experts`, on a permutation that puts the other slots past
    its groups: no rows computed for them); the tokens get there by one of `ALL2ALL_BACKENDS` (`exchange`):

    - "allgather_reducescatter": every data rank gathers every rank's tokens and routing, and the partial sums are
      added over tensor ranks and reduce-scattered back over data ranks. Moves ranks x T rows each way whatever
      the routing; simple, and one collective of each kind.
    - "ragged_all_to_all": each token goes only to the data ranks that hold one of its experts (once per rank, for
      all of its experts there), and only its partial sums come back (`jax.lax.ragged_all_to_all` both ways).
      Moves the routed rows, at most min(top-k, ranks) x T; what DEP over many GPUs needs (an all-gather over 72
      ranks moves 72 x T rows into every GPU).

    tensor: the mesh's tensor size (static; 1 makes the expert loop manual over data only). ragged: the
    collective (`ragged_all_to_all_reference` where XLA has none: CPU)."""

    inner: Callable
    tensor: int = 1
    exchange: str = "allgather_reducescatter"
    ragged: Callable = jax.lax.ragged_all_to_all

    def __post_init__(self):
        if self.exchange not in ALL2ALL_BACKENDS:
            raise ParallelismError(f"unknown --all2all-backend {self.exchange!r}; choose one of {ALL2ALL_BACKENDS}")

    def __call__(self, x, w, idx, experts, cfg: ModelConfig, num, permutation=None):
        # the router's permutation (if any) orders all experts; each rank makes its own below
        espec = jax.tree_util.tree_map(lambda _: PartitionSpec(TENSOR), experts)
        rep = PartitionSpec()
        if self.exchange == "ragged_all_to_all":
            # every axis manual: the collective is over data ranks of one tensor index, each tensor rank sending
            # the tokens of its own counterparts' experts
            f = functools.partial(self._routed, cfg=cfg, num=num)
            return per_tensor_rank(f, in_specs=(espec, rep, rep, rep), out_specs=rep)(experts, x, w, idx)
        xg = jax.lax.all_gather(x, DATA, tiled=True)  # [ranks_data * T, D]
        wg = jax.lax.all_gather(w, DATA, tiled=True)
        ig = jax.lax.all_gather(idx, DATA, tiled=True)

        def local(experts, xg, wg, ig):
            y = self._own_experts(experts, xg, wg, ig, cfg, num)
            if self.tensor > 1:
                y = jax.lax.psum(y, TENSOR)
            return jax.lax.psum_scatter(y, DATA, scatter_dimension=0, tiled=True)

        if self.tensor == 1:
            return local(experts, xg, wg, ig)
        return jax.shard_map(local, in_specs=(espec, rep, rep, rep), out_specs=rep,
                             axis_names={TENSOR})(experts, xg, wg, ig)

    def _rank(self):
        rank = jax.lax.axis_index(DATA)
        return rank * self.tensor + jax.lax.axis_index(TENSOR) if self.tensor > 1 else rank

    def _own_experts(self, experts, x, w, idx, cfg, num):
        """inner on this rank's experts: x [N, D], w / idx [N, k] (global expert ids) -> its partial sums [N, D]."""
        n_local = jax.tree_util.tree_leaves(experts)[0].shape[0]
        lid = idx - self._rank() * n_local
        mine = (lid >= 0) & (lid < n_local)
        lid = jnp.where(mine, lid, n_local).reshape(-1)  # others sort last, past every group
        order = jnp.argsort(lid, stable=True)
        sizes = jnp.bincount(lid, length=n_local).astype(jnp.int32)  # drops n_local
        return self.inner(x, jnp.where(mine, w, 0.0), idx, experts, cfg, num, (order, sizes))

    def _routed(self, experts, x, w, idx, *, cfg, num):
        """The "ragged_all_to_all" exchange on one device (every axis manual): x [T, D], w / idx [T, k] ->
        [T, D], the routed experts' sum over every rank."""
        T, k = idx.shape
        ranks = jax.lax.axis_size(DATA)
        n_local = jax.tree_util.tree_leaves(experts)[0].shape[0]
        me, t = jax.lax.axis_index(DATA), (jax.lax.axis_index(TENSOR) if self.tensor > 1 else 0)
        owner = idx // n_local  # [T, k]: the rank (data * tensor + tensor index) of each slot's expert
        dest = jnp.where(owner % self.tensor == t, owner // self.tensor, ranks)  # data rank, ranks: another tensor's
        sends = (dest[:, :, None] == jnp.arange(ranks)[None, None]).any(1)  # [T, ranks]
        send_sizes = sends.sum(0, dtype=jnp.int32)
        # the sent (token, rank) pairs by rank then token, at most min(k, ranks) a token
        N = T * min(k, ranks)
        key = jnp.where(sends, jnp.arange(ranks, dtype=jnp.int32)[None] * T + jnp.arange(T, dtype=jnp.int32)[:, None],
                        ranks * T).reshape(-1)
        tok = (jnp.argsort(key, stable=True)[:N] // ranks).astype(jnp.int32)
        in_off = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
        recv_sizes = jax.lax.all_to_all(send_sizes, DATA, 0, 0, tiled=True)
        their_off = jax.lax.all_to_all(in_off, DATA, 0, 0, tiled=True)  # where my rows sit in each sender's buffer
        # each sender's rows land in slab [sender * T, sender * T + its count) of every receiver
        slab = jnp.full((ranks,), me * T, jnp.int32)
        meta = jnp.concatenate([jax.lax.bitcast_convert_type(w.astype(jnp.float32), jnp.int32), idx.astype(jnp.int32)],
                               -1)
        empty_meta = jnp.concatenate([jnp.zeros((ranks * T, k), jnp.int32), jnp.full((ranks * T, k), -1, jnp.int32)],
                                     -1)  # weight 0, expert -1: nobody's
        xr = self.ragged(x[tok], jnp.zeros((ranks * T,) + x.shape[1:], x.dtype), in_off, send_sizes, slab,
                         recv_sizes, axis_name=DATA)
        mr = self.ragged(meta[tok], empty_meta, in_off, send_sizes, slab, recv_sizes, axis_name=DATA)
        wr, ir = jax.lax.bitcast_convert_type(mr[:, :k], jnp.float32).astype(w.dtype), mr[:, k:]
        y = self._own_experts(experts, xr, wr, ir, cfg, num)  # [ranks * T, D]
        # N rows back, then a zero row that tokens with fewer ranks point at
        back = self.ragged(y, jnp.zeros((N + 1,) + y.shape[1:], y.dtype), jnp.arange(ranks, dtype=jnp.int32) * T,
                           recv_sizes, their_off, send_sizes, axis_name=DATA)
        # each token's rows by a gather, added rank after rank (a float scatter-add is atomics on a GPU, its order
        # varying run to run): row of (token, rank) = the rank's offset + the token's place among its tokens
        row = jnp.where(sends, in_off[None] + jnp.cumsum(sends, 0, dtype=jnp.int32) - 1, N)  # [T, ranks]
        first = jnp.sort(jnp.where(sends, jnp.arange(ranks, dtype=jnp.int32)[None], ranks), 1)[:, :min(k, ranks)]
        at = jnp.take_along_axis(jnp.pad(row, ((0, 0), (0, 1)), constant_values=N), first, 1)  # [T, min(k, ranks)]
        out = back[at[:, 0]]
        for j in range(1, at.shape[1]):  # the token's j-th rank (ranks: none, the zero row)
            out = out + back[at[:, j]]
        return jax.lax.psum(out, TENSOR) if self.tensor > 1 else out


# ---- kernel ops under tensor parallelism ------------------------------------------------------------------------
# A kernel (one device's program) cannot be partitioned by XLA: with tensor ranks each kernel op runs inside a
# `shard_map` manual over "tensor", on its rank's shards of the weights it reads, with the reduction the math
# needs written out. The weights carry their tensor split (`TensorShards`, from the placed dense weight's
# sharding) because an op's call does not say which weight it reads.


def tensor_spec(sh: jax.sharding.Sharding, ndim: int) -> PartitionSpec:
    """The part of a weight's sharding a tensor-manual `shard_map` declares (only "tensor"), padded to ndim."""
    parts = []
    entries = tuple(sh.spec) if isinstance(sh, NamedSharding) else ()
    for entry in entries + (None,) * (ndim - len(entries)):
        names = entry if isinstance(entry, tuple) else (entry,)
        parts.append(TENSOR if TENSOR in names else None)
    return PartitionSpec(*parts)


def tensor_ways(sh: jax.sharding.Sharding, dim: int) -> int:
    """How many tensor ranks split dim `dim` of an array placed with sh (1: whole on each)."""
    if not isinstance(sh, NamedSharding) or TENSOR not in sh.mesh.shape or len(sh.spec) <= dim:
        return 1
    entry = sh.spec[dim]
    return sh.mesh.shape[TENSOR] if TENSOR in (entry if isinstance(entry, tuple) else (entry,)) else 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TensorShards:
    """A weight a kernel op reads per tensor rank: `value` (any weight pytree, e.g. a kernel layout) placed so
    that each tensor rank holds the slices `specs` name, one tensor PartitionSpec per leaf of value (static).
    `shape` / `dequantize` pass through to value, so code that reads the dense weight (XLA fallbacks under XLA's
    own partitioning) works on it unchanged."""

    value: Any
    specs: tuple = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return self.value.dequantize(dtype)

    def spec_tree(self):
        """specs in value's tree structure (a shard_map in_spec for value)."""
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self.value), list(self.specs))

    def split(self, dim: int) -> bool:
        """Whether dim `dim` of value's first leaf (the weight array) is split over tensor ranks."""
        spec = self.specs[0]
        return len(spec) > dim and spec[dim] == TENSOR


def last_dim_spec(ndim: int, split: bool) -> PartitionSpec:
    """An activation [..., d]'s tensor spec: d split over tensor ranks (split) or replicated."""
    return PartitionSpec(*([None] * (ndim - 1)), TENSOR) if split else PartitionSpec()


def per_tensor_rank(fn: Callable, in_specs, out_specs) -> Callable:
    """fn run on each tensor rank's blocks (`shard_map` manual over "tensor", inside a data-manual program or
    under `jax.set_mesh`); `tensor_sum` inside fn for reductions. Mesh axes of size 1 that are still automatic
    become manual too (they split nothing): the Mosaic GPU interpreter's callbacks need every axis manual."""

    def call(*args):
        mesh = jax.sharding.get_abstract_mesh()
        ones = {n for n, k in zip(mesh.axis_names, mesh.axis_sizes) if k == 1 and n not in mesh.manual_axes}
        return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names={TENSOR} | ones,
                             check_vma=False)(*args)

    return call


def tensor_sum(x: jax.Array) -> jax.Array:
    """x summed over tensor ranks (inside `per_tensor_rank`)."""
    return jax.lax.psum(x, TENSOR)


@dataclasses.dataclass(frozen=True)
class TensorReplicated:
    """An op every tensor rank runs whole, on replicated inputs, inside a tensor-manual `shard_map` (a kernel
    site whose weights are replicated: mHC, router; the decode KV writes and the indexer's top-k). Arguments that
    are not arrays (a config, a flag) pass as they are; keyword arguments too."""

    inner: Callable

    def __call__(self, *args, **kwargs):
        names = tuple(kwargs)
        every = args + tuple(kwargs.values())
        is_dyn = [all(isinstance(v, jax.Array) for v in jax.tree_util.tree_leaves(a)) for a in every]
        dyn = [a for a, d in zip(every, is_dyn) if d]

        def local(*d):
            it = iter(d)
            full = [next(it) if flag else a for a, flag in zip(every, is_dyn)]
            return self.inner(*full[:len(args)], **dict(zip(names, full[len(args):])))

        return per_tensor_rank(local, in_specs=(PartitionSpec(),) * len(dyn), out_specs=PartitionSpec())(*dyn)


def split_spec(ndim: int, dim: int) -> PartitionSpec:
    """The tensor spec of an activation whose dim `dim` is split over tensor ranks (heads of q, of a sink)."""
    return PartitionSpec(*(TENSOR if i == dim else None for i in range(ndim)))


def tensor_auto() -> bool:
    """Whether the op being traced runs with tensor ranks left to XLA (a tensor-parallel program, or under
    `jax.set_mesh` of one), so a kernel in it must run per tensor rank."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TENSOR not in mesh.axis_names:
        return False
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[TENSOR] > 1 and TENSOR not in mesh.manual_axes
