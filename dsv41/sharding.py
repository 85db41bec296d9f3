"""The one place that decides partitioning: mesh axes, parallelism modes, logical-axis rules.

Every weight names its logical axes once (`params.Spec.axes`); a table of rules per mode maps logical axes to
the mesh axes ("data", "tensor"), MaxText-style, through Flax's logical-partitioning helpers. No other module
names a mesh axis. Expert parallelism is not a mesh axis of its own: experts are split over data x tensor (all
ranks), as vLLM's DEP (--data-parallel-size N --enable-expert-parallel) does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import linen as fnn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv41.config import ConfigError, ModelConfig

DATA, TENSOR = "data", "tensor"
MESH_AXES = (DATA, TENSOR)

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
    """vLLM's --tensor-parallel-size, --data-parallel-size, --enable-expert-parallel."""

    tensor: int = 1
    data: int = 1
    expert: bool = False

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
