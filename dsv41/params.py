"""The parameter pytree: one description of every weight (shape, stored dtype, init), used for random init,
abstract shapes (no allocation), loading and sharding alike.

The tree mirrors the release's key names (spec §5): a leaf at path `layers.3.attn.wq_a` is the release
tensor `layers.3.attn.wq_a.weight` (+ `.scale` when quantized); `release_name()` holds the few exceptions.
Routed experts are stacked along a leading expert axis ([E, ...]) where the release keeps one key per expert.

Leaves are plain arrays, `Fp8Weight` (e4m3 + UE8M0 32x32) or `Fp4Weight` (packed e2m1 + UE8M0 per 32).
`dequantize_params` turns a stored-precision tree into a dense one for the exact reference path.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import quant
from dsv41.config import AttnRole, ModelConfig

Params = dict[str, Any]

# Leaves stored as given (no ".weight" suffix in the release).
_BARE = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
         "attn_sink", "bias", "bias_vl", "q_weight", "k_weight", "image_start", "image_end", "image_newline")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One weight. fmt: 'fp8' (FP8 linear when the release is quantized), 'fp4' (routed expert), 'table'
    (Engram rows: e4m3 + UE8M0 per 32 along the row), 'bf16', 'f32' (kept as stored)."""

    shape: tuple[int, ...]
    fmt: str
    init: str = "normal"  # normal (1/sqrt(fan_in)), ones, zeros, small, table, fp8_grid (normal, FP8 values)
    axes: tuple[str | None, ...] = ()  # logical axes, one per dim; dsv41.sharding maps them to the mesh

    def fan_in(self) -> int:
        return self.shape[-1]


def layer_specs(cfg: ModelConfig, layer: int) -> Params:
    """Block `layer`; layers n_layers.. are the DSpark stages' blocks (window-only, their own expert count)."""
    if layer >= cfg.n_layers:
        return _block_specs(cfg.dspark_stage_config, layer, AttnRole.SWA, 0)
    return _block_specs(cfg, layer, cfg.role(layer), cfg.compress_ratios[layer])


def _block_specs(cfg: ModelConfig, layer: int, role: AttnRole, r: int) -> Params:
    D, H, Dh, Q = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    E, F = cfg.n_routed_experts, cfg.moe_inter_dim
    mix, hcD = cfg.hc_mix_dim, cfg.hc_mult * cfg.dim
    attn: Params = {
        "wq_a": Spec((Q, D), "fp8", axes=(None, "embed")),
        "q_norm": Spec((Q,), "bf16", "ones"),
        "wq_b": Spec((H * Dh, Q), "fp8", axes=("heads", None)),
        "wkv": Spec((Dh, D), "fp8", axes=(None, "embed")),
        "kv_norm": Spec((Dh,), "bf16", "ones"),
        # bf16 as convert.py leaves it, holding the release's FP8 values (the engine's
        # prepare_linears takes them back to FP8)
        "wo_a": Spec((cfg.o_groups * cfg.o_lora_rank, H * Dh // cfg.o_groups), "bf16", "fp8_grid",
                     axes=("o_groups", None)),
        "wo_b": Spec((D, cfg.o_groups * cfg.o_lora_rank), "fp8", axes=("embed", "o_groups")),
        "attn_sink": Spec((H,), "f32", "small", axes=("heads",)),
    }
    if role is AttnRole.FULL:
        # stored bf16 as released; ratio-2 pooling upcasts them and computes in float32 (compressor.project)
        attn["compressor"] = {
            "wkv": Spec((Dh, D), "bf16"),
            "norm": Spec((Dh,), "bf16", "ones"),
        }
        if r > 1:
            attn["compressor"]["wgate"] = Spec((Dh, D), "bf16")
    if role in (AttnRole.FULL, AttnRole.REINDEX):
        IH, ID = cfg.index_n_heads, cfg.index_head_dim
        attn["indexer"] = {
            "wq_b": Spec((IH * ID, Q), "fp8", axes=("index_heads", None)),
            "weights_proj": Spec((IH, D), "bf16", axes=("index_heads", None)),
        }
        if role is AttnRole.FULL:
            attn["indexer"]["wk"] = Spec((ID, Dh), "bf16")
            attn["indexer"]["k_norm"] = Spec((ID,), "bf16", "ones")
    out: Params = {
        "attn_norm": Spec((D,), "bf16", "ones"),
        "ffn_norm": Spec((D,), "bf16", "ones"),
        "hc_attn_fn": Spec((mix, hcD), "f32", "hc"),
        "hc_attn_base": Spec((mix,), "f32", "small"),
        "hc_attn_scale": Spec((3,), "f32", "ones"),
        "hc_ffn_fn": Spec((mix, hcD), "f32", "hc"),
        "hc_ffn_base": Spec((mix,), "f32", "small"),
        "hc_ffn_scale": Spec((3,), "f32", "ones"),
        "attn": attn,
        "ffn": {
            "gate": {
                "weight": Spec((E, D), "bf16"),
                "bias": Spec((E,), "f32", "small"),
                "bias_vl": Spec((E,), "f32", "small"),
            },
            "experts": {
                "w1": Spec((E, F, D), "fp4", axes=("experts", "expert_ffn", "embed")),
                "w2": Spec((E, D, F), "fp4", axes=("experts", "embed", "expert_ffn")),
                "w3": Spec((E, F, D), "fp4", axes=("experts", "expert_ffn", "embed")),
            },
            "shared_experts": {
                "w1": Spec((F, D), "fp8", axes=("ffn", "embed")),
                "w2": Spec((D, F), "fp8", axes=("embed", "ffn")),
                "w3": Spec((F, D), "fp8", axes=("ffn", "embed")),
            },
        },
    }
    if layer in cfg.engram_layer_ids:
        i = cfg.engram_layer_ids.index(layer)
        out["engram"] = {
            "embed": Spec((cfg.engram_num_embeddings[i], cfg.engram_head_dim), "table", "table"),
            "wkv": Spec((cfg.dim * (cfg.hc_mult + 1), cfg.engram_n_cols * cfg.engram_head_dim), "fp8"),
            "q_weight": Spec((cfg.hc_mult, D), "bf16", "ones"),
            "k_weight": Spec((cfg.hc_mult, D), "bf16", "ones"),
        }
    return out


def vision_specs(cfg: ModelConfig) -> Params:
    """The vision tower (`vision`), the aligner (`aligner`) and the learned span delimiters, all stored bf16
    (linears as [out, in] + bias, as the reference's torch modules). No logical axes: the tower is 0.5 B values
    (1 GB) run once per image, so every device keeps a copy and no collective runs inside it."""
    v = cfg.vision
    Dv, F, D = v.dim, v.inter_dim, cfg.dim

    def lin(n_out: int, n_in: int, bias: bool = True) -> Params:
        out = {"weight": Spec((n_out, n_in), "bf16")}
        if bias:
            out["bias"] = Spec((n_out,), "bf16", "small")
        return out

    block = {
        "norm1": Spec((Dv,), "bf16", "ones"),
        "attn": {"wqkv": lin(3 * Dv, Dv), "wo": lin(Dv, Dv)},
        "norm2": Spec((Dv,), "bf16", "ones"),
        "mlp": {"w1": lin(2 * F, Dv, bias=False), "w2": lin(Dv, F, bias=False)},
    }
    return {
        "vision": {
            "patch_embed": {"proj": lin(Dv, 3 * v.patch_size ** 2)},
            "blocks": [block] * v.n_layers,
            "norm": Spec((Dv,), "bf16", "ones"),
        },
        "aligner": {"w1": lin(D, Dv * v.downsample_ratio ** 2), "w2": lin(D, D)},
        "image_start": Spec((D,), "bf16", "embed"),
        "image_end": Spec((D,), "bf16", "embed"),
        "image_newline": Spec((D,), "bf16", "embed"),
    }


VISION_KEYS = ("vision", "aligner", "image_start", "image_end", "image_newline")
_VISION_SEED = 0x5EED


def dspark_specs(cfg: ModelConfig) -> list[Params]:
    """The DSpark stages (spec §2.8, release keys `mtp.{s}.*`): each a window-only block with its own experts;
    stage 0 also projects the target layers' mean streams (main_proj, main_norm), the last stage holds the final
    norm, the rank-r Markov bias (markov_head) and the confidence head."""
    D, V, R = cfg.dim, cfg.vocab_size, cfg.dspark_markov_rank
    stages = [layer_specs(cfg, cfg.n_layers + s) for s in range(cfg.n_mtp_layers)]
    if stages:
        stages[0]["main_proj"] = Spec((D, len(cfg.dspark_target_layer_ids) * D), "fp8", axes=(None, "embed"))
        stages[0]["main_norm"] = Spec((D,), "bf16", "ones")
        stages[-1]["norm"] = Spec((D,), "bf16", "ones")
        stages[-1]["markov_head"] = {
            "embed": Spec((V, R), "bf16", "embed", axes=("vocab", None)),
            "head": Spec((V, R), "bf16", axes=("vocab", None)),
        }
        stages[-1]["confidence_head"] = {"proj": Spec((1, D + R), "bf16")}
    return stages


def param_specs(cfg: ModelConfig) -> Params:
    specs = {
        "embed": Spec((cfg.vocab_size, cfg.dim), "bf16", "embed", axes=("vocab", "embed")),
        "layers": [layer_specs(cfg, i) for i in range(cfg.n_layers)],
        "norm": Spec((cfg.dim,), "bf16", "ones"),
        "head": Spec((cfg.vocab_size, cfg.dim), "bf16", axes=("vocab", "embed")),
    }
    if cfg.vision is not None:
        specs.update(vision_specs(cfg))
    if cfg.n_mtp_layers:
        specs["mtp"] = dspark_specs(cfg)
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, Spec)


def stored_format(spec: Spec, cfg: ModelConfig) -> str:
    """What the release stores for this weight under cfg's quantization config."""
    if spec.fmt == "fp8":
        return "fp8" if cfg.dtype == "fp8" else "bf16"
    if spec.fmt == "fp4":
        return {"fp4": "fp4", "fp8": "fp8", "bf16": "bf16"}[cfg.expert_dtype]
    return spec.fmt


# Leaves at least this large (the bench and flash presets' experts, Engram tables) are drawn with jax.random on
# the default device: a host RNG takes minutes for the bench preset's ~27 G values, a GPU seconds. Smaller ones
# keep numpy's RNG, which costs no compile per shape (the tiny preset starts in a few seconds), drawn in threads
# (numpy fills arrays off the GIL: the bench preset's 0.8 G host values took 18 s in one thread on the H100's host).
_DEVICE_RNG_MIN = 1 << 24
_HOST_RNG_THREADS = min(16, os.cpu_count() or 1)


def _std(spec: Spec) -> float:
    """The standard deviation a leaf's values are drawn with (its `init`)."""
    if spec.init == "small":
        return 0.1
    if spec.init == "hc":  # the coefficient projection is read through an RMS-normalized stream
        return 0.5 / math.sqrt(spec.shape[-1])
    if spec.init in ("embed", "table"):
        return 1.0
    return 1 / math.sqrt(spec.fan_in())


def _host_leaf(spec: Spec, key_data: np.ndarray, fmt: str) -> np.ndarray | None:
    """A small leaf's values on the host (float32; bf16 where that is its stored format and it needs no
    quantization on the device), or None for a leaf drawn on the device (`_device_leaf`)."""
    shape = spec.shape
    if spec.init == "ones":
        w = np.ones(shape, np.float32)
    elif spec.init == "zeros":
        w = np.zeros(shape, np.float32)
    elif math.prod(shape) >= _DEVICE_RNG_MIN:
        return None
    else:
        rng = np.random.default_rng(key_data.ravel().astype(np.uint32))
        w = rng.standard_normal(shape)  # float64, scaled, then rounded: the values every earlier seed gave
        w *= _std(spec)
        w = w.astype(np.float32)
    if spec.init == "fp8_grid":  # rounded on the device with the quantizer (`_quantize_leaf`)
        return w
    # a cast on the host (round to nearest even, as XLA's): a compile per shape saved (0.3 s of the tiny preset)
    return w.astype(jnp.bfloat16) if fmt == "bf16" else w


def _device_leaf(spec: Spec, key_data: np.ndarray, fmt: str):
    """A large leaf drawn and quantized on the default device in one program (one compile per distinct shape, init
    and format: 11 for the bench preset)."""
    return _draw_on_device(jax.random.wrap_key_data(key_data), spec.shape, _std(spec), spec.init == "fp8_grid", fmt)


@functools.partial(jax.jit, static_argnames=("shape", "grid", "fmt"))
def _draw_on_device(key: jax.Array, shape: tuple[int, ...], std: float, grid: bool, fmt: str):
    w = jax.random.normal(key, shape, jnp.float32) * std
    return _quantize(_fp8_grid(w) if grid else w, fmt)


def _fp8_grid(w: np.ndarray | jax.Array) -> jax.Array:
    """Values an FP8 weight with 32x32 block scales holds (what the release ships for a bf16-stored FP8 linear)."""
    return quant.quantize_fp8_weight(w).dequantize(jnp.float32)


def quantize_leaf(w: np.ndarray | jax.Array, fmt: str):
    """A dense float weight -> its stored representation (a device array, or a pytree of them)."""
    if fmt in ("bf16", "f32") and isinstance(w, np.ndarray):
        # a cast on the host (round to nearest even, as XLA's): a compile per shape saved (0.3 s of the tiny preset);
        # device_put, not jnp.asarray, which compiles a copy program per shape
        return jax.device_put(w.astype(jnp.bfloat16 if fmt == "bf16" else np.float32))
    return _quantize_leaf(w, fmt)


@functools.partial(jax.jit, static_argnames=("fmt", "grid"))
def _quantize_leaf(w: np.ndarray | jax.Array, fmt: str, grid: bool = False):
    return _quantize(_fp8_grid(w) if grid else w, fmt)


def _quantize(w: np.ndarray | jax.Array, fmt: str):
    if fmt == "fp8":
        return quant.quantize_fp8_weight(w)
    if fmt == "fp4":
        return quant.quantize_fp4_weight(w)
    if fmt == "table":
        q, s = quant.fp8_quantize(jnp.asarray(w, jnp.float32), 32)
        return quant.Fp8Rows(q, quant.ue8m0_encode(s))
    if fmt == "bf16":
        return jnp.asarray(w, jnp.bfloat16)
    if fmt == "f32":
        return jnp.asarray(w, jnp.float32)
    raise ValueError(f"unknown weight format {fmt!r}")


def init_params(cfg: ModelConfig, seed: int = 0, dtype: str | None = None) -> Params:
    """Seeded random weights.

    dtype=None keeps the release's stored precision (FP8/FP4 + scales, bf16, f32); 'bfloat16' or 'float32'
    gives the dense tree of those same (quantization-rounded) values, for the exact reference path.
    """
    specs = param_specs(cfg)
    # the tower draws from its own stream, so a seed gives the text weights it gave before the tower existed
    params = init_tree({k: v for k, v in specs.items() if k not in VISION_KEYS}, cfg, seed)
    if cfg.vision is not None:
        params.update(init_tree({k: specs[k] for k in VISION_KEYS}, cfg, seed + _VISION_SEED))
    return params if dtype is None else dequantize_params(params, dtype)


def init_tree(specs, cfg: ModelConfig, seed: int = 0) -> Params:
    """Seeded random weights for any subtree of specs (e.g. `layer_specs(cfg, i)["ffn"]`), in stored formats."""
    leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec)
    # the keys' data on the host: iterating over a jax key array unstacks it, a compile per leaf count (0.6 s of the
    # tiny preset's start)
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), len(leaves))))
    fmts = [stored_format(s, cfg) for s in leaves]
    out = []
    with concurrent.futures.ThreadPoolExecutor(_HOST_RNG_THREADS) as pool:
        # each host leaf goes to the device as soon as it (and every leaf before it) is drawn
        for s, k, fmt, w in zip(leaves, keys, fmts, pool.map(_host_leaf, leaves, keys, fmts)):
            if w is None:
                out.append(_device_leaf(s, k, fmt))
            elif w.dtype == jnp.bfloat16 or (fmt == "f32" and s.init != "fp8_grid"):
                out.append(jax.device_put(w))
            else:
                out.append(_quantize_leaf(w, fmt, grid=s.init == "fp8_grid"))
    return jax.tree_util.tree_unflatten(treedef, out)


def is_weight_leaf(x) -> bool:
    return quant.is_quantized(x) or isinstance(x, quant.Fp8Rows)


def dequantize_params(params: Params, dtype: str = "bfloat16") -> Params:
    """Every quantized weight -> a dense array of `dtype`; f32 leaves stay f32 unless dtype is float32.

    Engram tables stay quantized: they are read by row, and rows dequantize on lookup.
    """
    dt = jnp.dtype(dtype)

    def converts(x) -> bool:
        if isinstance(x, quant.Fp8Rows):
            return False
        if quant.is_quantized(x):
            return True
        if not jnp.issubdtype(x.dtype, jnp.floating):  # ids, not weights (a loaded tree's Engram token map)
            return False
        return x.dtype != dt and not (x.dtype == jnp.float32 and dt != jnp.float32)

    leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_weight_leaf)
    todo = [i for i, x in enumerate(leaves) if converts(x)]
    for i, x in zip(todo, _dense_leaves(tuple(leaves[i] for i in todo), dt.name)):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.partial(jax.jit, static_argnums=1)
def _dense_leaves(ws: tuple, dtype: str) -> list[jax.Array]:
    """The converted leaves of `dequantize_params` in one program: converted one by one, each distinct shape and
    format would be a compile of its own (~200 of them for the tiny preset, 8.7 s of a CPU test process's start)."""
    return [w.dequantize(jnp.dtype(dtype)) if quant.is_quantized(w) else w.astype(dtype) for w in ws]


def abstract_params(cfg: ModelConfig, dtype: str | None = None) -> Params:
    """Shapes and dtypes of init_params(cfg, dtype=dtype) without allocating anything."""
    return jax.eval_shape(lambda: _abstract_build(cfg, dtype))


def _abstract_build(cfg: ModelConfig, dtype: str | None) -> Params:
    def build(s: Spec):
        fmt = stored_format(s, cfg) if dtype is None else ("table" if s.fmt == "table" else "dense")
        if fmt == "dense":
            dt = jnp.float32 if (s.fmt == "f32" or dtype == "float32") else jnp.dtype(dtype)
            return jnp.zeros(s.shape, dt)
        return quantize_leaf(jnp.zeros(s.shape, jnp.float32), fmt)

    return jax.tree_util.tree_map(build, param_specs(cfg), is_leaf=_is_spec)


def release_name(path: tuple) -> str:
    """Tree path (from tree_flatten_with_path, possibly ending in a quantized leaf's field) -> release key."""
    names = []
    for p in path:
        if isinstance(p, jax.tree_util.SequenceKey):
            names.append(str(p.idx))
        elif isinstance(p, jax.tree_util.DictKey):
            names.append(str(p.key))
        elif isinstance(p, jax.tree_util.GetAttrKey):
            names.append(p.name)
        else:
            names.append(str(p))
    if names[-1] in ("weight", "scale") and len(names) >= 2 and names[-2] != "gate":
        return ".".join(names)
    if names[-1] in _BARE or (names[-1] == "weight" and names[-2] == "gate"):
        return ".".join(names)
    return ".".join(names) + ".weight"


def iter_specs(cfg: ModelConfig) -> Iterator[tuple[str, Spec]]:
    """(release key prefix of the leaf, spec) for every weight, in tree order."""
    for path, s in jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=_is_spec)[0]:
        yield release_name(path), s


def count_params(params: Params) -> int:
    n = 0
    for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_weight_leaf):
        if isinstance(leaf, (quant.Fp4Weight,)):
            n += math.prod(leaf.shape)
        elif isinstance(leaf, (quant.Fp8Weight, quant.Fp8Rows)):
            n += math.prod(leaf.weight.shape)
        else:
            n += math.prod(leaf.shape)
    return n


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def map_with_spec(fn: Callable[[Spec, Any], Any], cfg: ModelConfig, params: Params) -> Params:
    """tree_map over (spec, leaf) pairs; quantized leaves count as one leaf."""
    specs = param_specs(cfg)
    return jax.tree_util.tree_map(fn, specs, params, is_leaf=lambda x: _is_spec(x) or is_weight_leaf(x))


def engram_tables(params: Params) -> list:
    """The Engram tables (Fp8Rows) of a tree, in layer order."""
    return [lp["engram"]["embed"] for lp in params["layers"] if "engram" in lp]
