"""The release checkpoint format (spec §5): writer, validating memory-mapped loader, and orbax fast restarts.

A checkpoint directory holds the nested `config.json`, `model.safetensors.index.json` and
`model-0000i-of-0000N.safetensors` shards keyed by release names. Our tree (params.py) mirrors those names; the
only structural difference is that routed experts are stacked [E, ...] here and one key per expert there.

Loading is validate-then-build: every header is read and every tensor checked against the config first, so a
bad checkpoint fails with one error naming each bad tensor and its file, and nothing is half-built. Tensors then
go from the page cache straight to their device(s), one shard per device when a mesh is given (each distinct
shard read once; no host copy of the whole model is made); Engram tables stay on the host as memory-mapped numpy.

Glossary: a *slot* is one leaf of our tree (a dense array or one Fp8Weight/Fp4Weight/Fp8Rows); a *form* is how a
slot is laid out in the files (its keys, dtypes, shapes); a *component* is one array of a slot (weight or scale).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from dsv41 import model, quant, sharding
from dsv41 import safetensors_io as st
from dsv41.config import ConfigError, ModelConfig
from dsv41.params import (Params, Spec, abstract_params, dequantize_params, init_params, is_weight_leaf,
                          param_specs, release_name, stored_format)

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Release tensors a config may not model, skipped on load with one log line: the vision tower, aligner and
# span delimiters under a text-only config (`vision_config` absent or 0 layers), and the DSpark stages
# beyond the config's n_mtp_layers.
SKIPPED_PREFIXES = ("mtp.", "vision.", "aligner.", "image_")
# The vision tower's tensors: BF16 in the release; F32 taken too (the reference keeps its norms in F32).
VISION_PREFIXES = ("vision.", "aligner.", "image_")
# Where our tree's stored dtype differs from the Hugging Face release (spec §5); the loader accepts both forms
# and converts exactly, the writer produces the release's with hf_layout=True.
# - kept BF16 here (as the reference's convert.py leaves it), FP8 + 32x32 UE8M0 scales in the release:
FP8_IN_RELEASE = ("attn.wo_a",)
# - weights our tree keeps in F32 that the release stores in BF16 (none at present; the loader upcasts exactly):
BF16_IN_RELEASE: tuple[str, ...] = ()

_ORBAX_FORMAT = "dsv41-orbax"
_TOKEN_MAP_FILE = "token_map.npy"  # in an orbax checkpoint's engram/: the tree's model.TOKEN_MAP_KEY entry
_DENSE_DTYPES = {"bfloat16": "BF16", "float32": "F32"}
_DENSE_NP = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))


class CheckpointError(ValueError):
    """The checkpoint on disk is missing, corrupt, or contradicts the config; nothing was loaded."""


# ---- slots and forms ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Slot:
    index: int  # position among the tree's leaves (quantized containers count as one)
    key: str  # release key of the weight (e.g. layers.0.attn.wq_a.weight, layers.0.attn.attn_sink)
    spec: Spec
    fmt: str  # stored format under the config: fp8, fp4, table, bf16, f32
    n_experts: int | None  # routed experts: stacked on axis 0 here, one release key per expert

    def keys(self, field: str | None) -> list[str]:
        """Release keys of one component (field 'scale' or None/'weight'), one per expert for routed experts."""
        key = _scale_key(self.key) if field == "scale" else self.key
        if self.n_experts is None:
            return [key]
        return [key.replace(".experts.", f".experts.{e}.", 1) for e in range(self.n_experts)]


@dataclasses.dataclass(frozen=True)
class _Part:
    field: str | None  # 'weight' / 'scale' of a quantized container; None for a plain array
    dtypes: tuple[str, ...]  # accepted safetensors dtypes
    shape: tuple[int, ...]  # per release key (without the expert axis)


@dataclasses.dataclass(frozen=True)
class _Form:
    kind: str  # fp8, fp4, rows (Engram FP8 rows), dense
    parts: tuple[_Part, ...]


def _scale_key(key: str) -> str:
    if not key.endswith(".weight"):
        raise ValueError(f"{key}: only a '.weight' tensor has a '.scale'")
    return key[: -len("weight")] + "scale"


def _slots(cfg: ModelConfig) -> tuple[list[_Slot], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=lambda x: isinstance(x, Spec))
    slots = []
    for i, (path, spec) in enumerate(leaves):
        n_exp = spec.shape[0] if spec.axes[:1] == ("experts",) else None
        slots.append(_Slot(i, release_name(path), spec, stored_format(spec, cfg), n_exp))
    return slots, treedef


def _block_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], -(-shape[-2] // 32), -(-shape[-1] // 32))


def _fp8_form(shape) -> _Form:
    return _Form("fp8", (_Part("weight", ("F8_E4M3",), shape),
                         _Part("scale", ("F8_E8M0",), _block_scale_shape(shape))))


def _forms(slot: _Slot, dense_ckpt: bool) -> list[_Form]:
    """Layouts the files may use for this slot; the first is what our writer produces for a quantized config."""
    shape = slot.spec.shape[1:] if slot.n_experts else slot.spec.shape
    if slot.fmt == "fp8":
        return [_fp8_form(shape)]
    if slot.fmt == "fp4":
        packed, per32 = (*shape[:-1], shape[-1] // 2), (*shape[:-1], shape[-1] // 32)
        return [_Form("fp4", (_Part("weight", ("I8",), packed), _Part("scale", ("F8_E8M0",), per32)))]
    if slot.fmt == "table":
        rows = _Form("rows", (_Part("weight", ("F8_E4M3",), shape),
                              _Part("scale", ("F8_E8M0",), (*shape[:-1], shape[-1] // 32))))
        return [rows, _Form("dense", (_Part(None, ("BF16", "F32"), shape),))] if dense_ckpt else [rows]
    if slot.fmt == "f32":
        return [_Form("dense", (_Part(None, ("F32", "BF16") if _in(slot, BF16_IN_RELEASE) else ("F32",), shape),))]
    wide = dense_ckpt or slot.key.startswith(VISION_PREFIXES)
    dense = [_Form("dense", (_Part(None, ("BF16", "F32") if wide else ("BF16",), shape),))]
    if _in(slot, FP8_IN_RELEASE):
        dense.append(_fp8_form(shape))
    return dense


def _in(slot: _Slot, names: Sequence[str]) -> bool:
    return any(slot.key.endswith(f".{name}.weight") for name in names)


# ---- sharding ----------------------------------------------------------------------------------------------


def sharding_for(spec: Spec, mesh: jax.sharding.Mesh | None, shapes: Sequence[tuple[int, ...]] = (),
                 par: sharding.Parallelism | None = None) -> jax.sharding.Sharding:
    """Where a weight lives, as dsv41.sharding's rules for the layout place it (no mesh: first device; par None:
    the layout the mesh implies, `sharding.parallelism_of`)."""
    return sharding.weight_sharding(spec.axes, mesh, list(shapes) or [spec.shape], par)


def _bytes_per_device(items: Sequence[tuple[tuple[int, ...], np.dtype, jax.sharding.Sharding]]) -> dict:
    need: dict = {}
    for shape, dtype, sharding in items:
        nbytes = math.prod(sharding.shard_shape(tuple(shape))) * np.dtype(dtype).itemsize
        for d in sharding.addressable_devices:
            need[d] = need.get(d, 0) + nbytes
    return need


def check_fits(need: dict, what: str) -> None:
    """Refuses a load that cannot fit in device memory. Devices without memory stats (CPU) are not checked."""
    for dev, nbytes in sorted(need.items(), key=lambda kv: kv[0].id):
        try:
            stats = dev.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if not stats or "bytes_limit" not in stats:
            continue
        limit = stats["bytes_limit"]
        free = limit - stats.get("bytes_in_use", 0)
        if nbytes > free:
            raise CheckpointError(
                f"{what} needs {nbytes / 1e9:.2f} GB on {dev}, but only {free / 1e9:.2f} GB of its "
                f"{limit / 1e9:.2f} GB are free. Spread it over more devices (mesh=dsv41.sharding.make_mesh "
                f"with a larger tensor or data x expert layout), keep weights quantized (dequantize=None), or "
                f"free device memory first.")


# ---- writing -----------------------------------------------------------------------------------------------


def _host_dtype_name(a) -> str:
    dt = np.dtype(a.dtype)
    if dt not in _DENSE_NP:
        raise CheckpointError(f"cannot write a dense weight of dtype {dt}; expected bfloat16 or float32")
    return "BF16" if dt == _DENSE_NP[0] else "F32"


@functools.partial(jax.jit, static_argnames="dense_dtype")
def _dense_leaf(leaf, dense_dtype: str):
    """dequantize_params semantics for one leaf, except that Engram tables become dense too."""
    if isinstance(leaf, quant.Fp8Rows):
        return leaf.dequantize(jnp.dtype(dense_dtype))
    return dequantize_params(leaf, dense_dtype)


_to_fp8 = jax.jit(quant.quantize_fp8_weight)
_to_bf16 = jax.jit(lambda x: x.astype(jnp.bfloat16))


def _leaf_tensors(slot: _Slot, leaf, dense_dtype: str | None, hf_layout: bool) -> list[st.TensorOut]:
    """The release tensors of one tree leaf. Host copies are made lazily, one leaf at a time, and dropped once
    every tensor of the leaf has been written."""
    if dense_dtype is not None:
        convert: Callable = functools.partial(_dense_leaf, dense_dtype=dense_dtype)
    elif hf_layout and _in(slot, FP8_IN_RELEASE):
        convert = _to_fp8
    elif hf_layout and _in(slot, BF16_IN_RELEASE):
        convert = _to_bf16
    else:
        convert = lambda x: x  # noqa: E731
    sample = jax.eval_shape(convert, leaf)
    if isinstance(sample, (quant.Fp8Weight, quant.Fp4Weight, quant.Fp8Rows)):
        fields = [("weight", sample.weight), ("scale", sample.scale)]
        dtypes = {"weight": "I8" if isinstance(sample, quant.Fp4Weight) else "F8_E4M3", "scale": "F8_E8M0"}
    else:
        fields = [(None, sample)]
        dtypes = {None: _host_dtype_name(sample)}

    cache: dict[str, Any] = {}
    remaining = [len(fields) * (slot.n_experts or 1)]

    def get(field, e):
        if "host" not in cache:
            out = convert(leaf)
            cache["host"] = {f: np.asarray(getattr(out, f) if f else out) for f, _ in fields}
        a = cache["host"][field]
        remaining[0] -= 1
        if remaining[0] == 0:
            cache.clear()
        a = a[e] if e is not None else a
        return a.view(np.uint8) if dtypes[field] in ("I8", "F8_E8M0") else a

    out = []
    for field, s in fields:
        shape = tuple(s.shape[1:] if slot.n_experts else s.shape)
        for e, key in enumerate(slot.keys(field)):
            out.append(st.TensorOut(key, dtypes[field], shape,
                                    functools.partial(get, field, e if slot.n_experts else None)))
    return out


def _shard_names(n: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def save_checkpoint(params: Params, cfg: ModelConfig, out_dir: str | os.PathLike, *, n_shards: int = 4,
                    tokenizer_dir: str | os.PathLike | None = None, dense_dtype: str | None = None,
                    hf_layout: bool = False, fsync: bool = False) -> str:
    """Writes `params` (stored precision, as from init_params or load_checkpoint) in the release format.

    dense_dtype: None writes the stored formats (F8_E4M3 + F8_E8M0, I8 + F8_E8M0 per expert, BF16, F32);
      'bfloat16' / 'float32' writes every weight dequantized (dequantize_params semantics, Engram tables too)
      under the same names, with a config that has no quantization_config (for BF16/F32-only readers).
    hf_layout: write the tensors where our tree's dtype differs from the Hugging Face release in the release's
      dtype (FP8_IN_RELEASE as FP8 + 32x32 scales, BF16_IN_RELEASE as BF16). Lossy for values not on those grids;
      the default writes the tree as it is, so that a round trip is bit-exact.
    n_shards: at most this many files, split in tree order at about equal bytes (fewer when single tensors, like
      the embedding, are larger than a share).
    fsync: flush every shard to disk before returning (for benchmarks that then evict the page cache).
    Returns out_dir.
    """
    if dense_dtype is not None and dense_dtype not in _DENSE_DTYPES:
        raise CheckpointError(f"dense_dtype={dense_dtype!r}: choose 'bfloat16', 'float32' or None")
    out_dir = os.fspath(out_dir)
    slots, treedef = _slots(cfg)
    leaves, ptree = jax.tree_util.tree_flatten(params, is_leaf=is_weight_leaf)
    if ptree != treedef:
        raise CheckpointError(f"params have {len(leaves)} weights in a different tree than the config's "
                              f"{len(slots)}; pass the config the params were built with")
    _check_tree(slots, leaves, cfg)

    tensors: list[st.TensorOut] = []
    for slot, leaf in zip(slots, leaves):
        tensors.extend(_leaf_tensors(slot, leaf, dense_dtype, hf_layout))
    total = sum(t.nbytes for t in tensors)
    n = max(1, min(n_shards, len(tensors)))
    groups: list[list[st.TensorOut]] = [[] for _ in range(n)]
    start = 0
    for t in tensors:  # contiguous runs of roughly total/n bytes, in tree order
        groups[min(n - 1, start * n // max(total, 1))].append(t)
        start += t.nbytes
    groups = [g for g in groups if g]
    names = _shard_names(len(groups))

    os.makedirs(out_dir, exist_ok=True)
    stale = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors") and f not in names)
    if stale:
        log.warning("%s already holds %d other .safetensors files (e.g. %s); they are not in the new index and "
                    "will be ignored by loaders that read it", out_dir, len(stale), stale[0])
    wcfg = cfg.replace(dtype="bf16", expert_dtype="bf16") if dense_dtype else cfg
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as f:
        json.dump(wcfg.to_hf_dict(), f, indent=2)
    weight_map: dict[str, str] = {}
    t0 = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"write {os.path.basename(out_dir)}",
              disable=None) as bar:
        for name, group in zip(names, groups):
            st.write_file(os.path.join(out_dir, name), group, {"format": "pt"}, fsync=fsync)
            weight_map.update({t.name: name for t in group})
            bar.update(sum(t.nbytes for t in group))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2)
    if tokenizer_dir is not None:
        copied = [n for n in TOKENIZER_FILES if os.path.exists(os.path.join(tokenizer_dir, n))]
        if not copied:
            raise CheckpointError(f"tokenizer_dir={tokenizer_dir} has none of {list(TOKENIZER_FILES)}; "
                                  "point it at the directory that holds tokenizer.json")
        for n in copied:
            shutil.copyfile(os.path.join(tokenizer_dir, n), os.path.join(out_dir, n))
    log.info("wrote %s: %d tensors, %.3f GB in %d shards (%.1f s)", out_dir, len(tensors), total / 1e9,
             len(groups), time.perf_counter() - t0)
    return out_dir


def _check_tree(slots: list[_Slot], leaves: list, cfg: ModelConfig) -> None:
    """The params must be the stored-precision tree of cfg: same containers and shapes as abstract_params gives
    (a dense array may be f32 where the config stores bf16, as loaded from an F32 checkpoint)."""
    want = jax.tree_util.tree_leaves(abstract_params(cfg), is_leaf=is_weight_leaf)

    def sig(x):
        if is_weight_leaf(x):
            return type(x).__name__, tuple(x.weight.shape), np.dtype(x.weight.dtype), tuple(x.scale.shape)
        return "array", tuple(x.shape), np.dtype(x.dtype) if np.dtype(x.dtype) not in _DENSE_NP else "dense"

    for slot, got, exp in zip(slots, leaves, want):
        gs, es = sig(got), sig(exp)
        if gs != es:
            raise CheckpointError(f"{slot.key}: params hold {gs}, but the config's stored-precision tree has {es}; "
                                  "pass the config the params were built with (dequantized trees cannot be "
                                  "saved; use dense_dtype= on a stored-precision tree)")


def make_checkpoint(cfg: ModelConfig, out_dir: str | os.PathLike, seed: int = 0, n_shards: int = 4,
                    tokenizer_dir: str | os.PathLike | None = None, **kw) -> str:
    """Random weights (init_params) written in the release format; kw as for save_checkpoint."""
    return save_checkpoint(init_params(cfg, seed), cfg, out_dir, n_shards=n_shards, tokenizer_dir=tokenizer_dir,
                           **kw)


# ---- validation --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Plan:
    """A validated slot: the form found on disk and, per part, one (file name, tensor) per release key."""

    slot: _Slot
    form: _Form
    sources: list[list[tuple[str, st.TensorInfo]]]


@dataclasses.dataclass
class _Located:
    files: dict[str, st.Header]  # readable shards by file name
    where: dict[str, tuple[str, st.TensorInfo]]  # key -> (file name, entry)
    index_map: dict[str, str]  # from the index json, or built from the headers
    problems: list[tuple[int, str]]  # (priority, message)


def _read_layout(path: str, workers: int) -> _Located:
    problems: list[tuple[int, str]] = []
    index_path = os.path.join(path, INDEX_NAME)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                index_map = dict(json.load(f)["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e!r}); re-download it") from None
        file_names = sorted(set(index_map.values()))
    else:
        file_names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not file_names:
            raise CheckpointError(f"{path}: no {INDEX_NAME} and no .safetensors files; is this a checkpoint "
                                  "directory?")
        index_map = {}
    by_file: dict[str, list[str]] = {}
    for k, fn in index_map.items():
        by_file.setdefault(fn, []).append(k)

    def read(fn):
        try:
            return fn, st.read_header(os.path.join(path, fn)), None
        except FileNotFoundError:
            return fn, None, "missing"
        except (st.SafetensorsError, OSError) as e:
            return fn, None, str(e)

    files: dict[str, st.Header] = {}
    with cf.ThreadPoolExecutor(max(1, workers)) as ex:
        for fn, header, err in ex.map(read, file_names):
            keys = by_file.get(fn, [])
            eg = f" (it holds {len(keys)} tensors per the index, e.g. {sorted(keys)[0]})" if keys else ""
            if err == "missing":
                problems.append((0, f"shard {fn} is listed in {INDEX_NAME} but missing from the directory{eg}; "
                                    "re-download it"))
            elif err:
                problems.append((0, f"shard {fn} is unreadable: {err}{eg}; re-download it"))
            else:
                files[fn] = header
    where: dict[str, tuple[str, st.TensorInfo]] = {}
    for fn, header in files.items():
        cut = sorted((t for t in header.tensors.values() if t.end > header.file_size), key=lambda t: t.begin)
        if cut:
            problems.append((0, f"shard {fn} is truncated: it has {header.file_size} bytes but its header needs "
                                f"{header.data_end}; {len(cut)} tensor{'s are' if len(cut) > 1 else ' is'} cut off, "
                                f"from {cut[0].name} on; re-download it"))
        for name, t in header.tensors.items():
            if name in where:
                problems.append((1, f"{name} is in both {where[name][0]} and {fn}; keep one"))
                continue
            where[name] = (fn, t)
            bad = st.check_entry(t, header)
            if bad and not cut:
                problems.append((1, f"{name} in {fn}: {bad}; re-download {fn}"))
    if not index_map:
        index_map = {k: fn for k, (fn, _) in where.items()}
    return _Located(files, where, index_map, problems)


def _plan(cfg: ModelConfig, loc: _Located, path: str) -> tuple[list[_Plan], list[_Slot], Any]:
    """Checks every tensor the config needs against the files; raises one CheckpointError listing all problems."""
    slots, treedef = _slots(cfg)
    dense_ckpt = cfg.dtype == "bf16"
    problems = list(loc.problems)
    broken = set(loc.index_map[k] for k in loc.index_map if loc.index_map[k] not in loc.files)
    used: set[str] = set()
    plans = []
    layers_present = {m.group(1) for k in loc.where if (m := re.match(r"layers\.(\d+)\.", k))}

    absent_layers: dict[str, list[str]] = {}  # layer -> its missing keys, for layers with no tensor at all
    extra_layers: dict[str, list[str]] = {}  # file -> keys of layers >= n_layers

    def missing(key: str, why: str) -> None:
        fn = loc.index_map.get(key)
        if fn in broken:
            return  # already reported with its file
        m = re.match(r"layers\.(\d+)\.", key)
        if m and m.group(1) not in layers_present:
            absent_layers.setdefault(m.group(1), []).append(key)
            return
        where = f" (the index says {fn})" if fn else ""
        if key.startswith(VISION_PREFIXES):  # a text-only checkpoint under a config with a vision_config
            why += "; for a text-only model set vision_config.num_hidden_layers to 0 in config.json"
        problems.append((3, f"missing tensor {key}{where}: {why}"))

    for slot in slots:
        forms = _forms(slot, dense_ckpt)
        first = slot.keys(forms[0].parts[0].field)[0]
        if first not in loc.where:
            missing(first, f"needed as {' or '.join(f.parts[0].dtypes[0] for f in forms)}"
                           f"{list(forms[0].parts[0].shape)}")
            used.update(k for f in forms for p in f.parts for k in slot.keys(p.field))
            continue
        fn0, t0 = loc.where[first]
        form = next((f for f in forms if t0.dtype in f.parts[0].dtypes), None)
        used.update(k for f in forms for p in f.parts for k in slot.keys(p.field))
        if form is None:
            want = sorted({d for f in forms for d in f.parts[0].dtypes})
            problems.append((3, f"{first} in {fn0}: dtype {t0.dtype}, expected {' or '.join(want)}"))
            continue
        sources, ok = [], True
        for part in form.parts:
            # every key of one part must share a dtype: they are stacked into one array
            dtypes = (t0.dtype,) if part is form.parts[0] else part.dtypes
            srcs = []
            for key in slot.keys(part.field):
                if key not in loc.where:
                    missing(key, f"needed as {dtypes[0]}{list(part.shape)} next to {first}")
                    ok = False
                    continue
                fn, t = loc.where[key]
                if t.dtype not in dtypes:
                    problems.append((3, f"{key} in {fn}: dtype {t.dtype}, expected {' or '.join(dtypes)}"))
                    ok = False
                elif t.shape != part.shape:
                    problems.append((3, f"{key} in {fn}: shape {list(t.shape)}, expected {list(part.shape)} from "
                                        "the config; the config contradicts the checkpoint or the file is wrong"))
                    ok = False
                srcs.append((fn, t))
            sources.append(srcs)
        if ok:
            plans.append(_Plan(slot, form, sources))

    skipped: dict[str, int] = {}
    for key, (fn, _) in sorted(loc.where.items()):
        if key in used:
            continue
        pre = next((p for p in SKIPPED_PREFIXES if key.startswith(p)), None)
        if pre:
            skipped[pre + "*"] = skipped.get(pre + "*", 0) + 1
            continue
        m = re.match(r"layers\.(\d+)\.", key)
        if m and int(m.group(1)) >= cfg.n_layers:
            extra_layers.setdefault(fn, []).append(key)
        else:
            problems.append((4, f"unexpected tensor {key} in {fn}: not part of a model with this config"))
    fix = "fix config.json (or the cfg passed) or use the checkpoint it belongs to"
    for fn, keys in sorted(extra_layers.items()):
        layers = sorted({int(re.match(r"layers\.(\d+)\.", k).group(1)) for k in keys})
        problems.append((2, f"the config says n_layers={cfg.n_layers}, but {fn} holds {len(keys)} tensors of "
                            f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))} (e.g. {keys[0]}): "
                            f"the config contradicts the checkpoint; {fix}"))
    if absent_layers:
        layers = sorted(absent_layers, key=int)
        eg = absent_layers[layers[0]][0]
        which = f"layer{'s' if len(layers) > 1 else ''} {', '.join(layers)}"
        problems.append((2, f"the config says n_layers={cfg.n_layers}, but no shard holds any tensor of {which} "
                            f"(e.g. {eg}): the config contradicts the checkpoint; {fix}"))
    if skipped:
        log.info("skipping %d tensors this config does not use (DSpark; vision under a text-only config): %s",
                 sum(skipped.values()),
                 ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())))
    if problems:
        problems.sort(key=lambda p: p[0])
        shown = [m for _, m in problems[:20]]
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"checkpoint {path} is not loadable ({len(problems)} problem"
                              f"{'s' if len(problems) > 1 else ''}; nothing was loaded):\n  - "
                              + "\n  - ".join(shown) + more)
    return plans, slots, treedef


# ---- building --------------------------------------------------------------------------------------------


# How device-bound tensors leave the files (the loader's `read_mode`). Measured on an H200 (scripts/bench_load.py,
# 8.4 GB to the device): from a cold page cache both run at the disk's rate; from a warm one mmap reaches 11.5 GB/s
# and pread 8.8 GB/s, so mmap is the default. A per-thread reused pread buffer was no faster than either.
#   mmap   hand the memory-mapped view to the transfer (routed experts: pread into the stacked buffer)
#   pread  one pread per contiguous range into a fresh host buffer, then the transfer
READ_MODES = ("mmap", "pread")


@dataclasses.dataclass
class _Component:
    """One array of a slot (a tensor, or routed experts stacked from one tensor per expert)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    views: list[tuple[st.MappedFile, st.TensorInfo]]  # one per expert when stacked
    stacked: bool
    convert: Callable[[np.ndarray], np.ndarray] | None = None  # exact host conversion (BF16_IN_RELEASE upcast)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.views)

    def mapped(self, huge_pages: bool = False) -> np.ndarray:
        """The whole tensor as a read-only memory-mapped view (not stacked); huge_pages: advised where the OS
        allows (`MappedFile.advise_huge_pages`)."""
        mf, t = self.views[0]
        if huge_pages:
            mf.advise_huge_pages(t.name)
        return mf.array(t.name)

    def read(self, box: list[tuple[int, int]], mode: str = "pread") -> np.ndarray:
        """Host array of tensor[box] (box: (start, stop) per dim)."""
        shape = [b - a for a, b in box]
        src_dtype = st.NUMPY_DTYPES[self.views[0][1].dtype]
        if mode == "mmap" and not self.stacked:
            out = self.mapped()[tuple(slice(a, b) for a, b in box)]
        else:
            out = np.empty(shape, src_dtype)
            if self.stacked:  # experts are separate tensors: read each straight into its row of the stack
                for j, e in enumerate(range(*box[0])):
                    _read_region(*self.views[e], box[1:], out[j])
            else:
                _read_region(*self.views[0], box, out)
        return self.convert(out) if self.convert else out


def _read_region(mf: st.MappedFile, t: st.TensorInfo, box: list[tuple[int, int]], out: np.ndarray) -> None:
    """out[...] = tensor t[box]. A box of whole rows is one contiguous pread; anything else (a column shard) is
    copied out of the memory map."""
    partial = [d for d, (a, b) in enumerate(box) if (a, b) != (0, t.shape[d])]
    if not partial or partial == [0]:
        row = math.prod(t.shape[1:]) * st.ITEMSIZE[t.dtype]
        mf.pread_into(out, t.begin + (box[0][0] * row if box else 0))
    else:
        out[...] = mf.array(t.name)[tuple(slice(a, b) for a, b in box)]


def _component(mapped: dict[str, st.MappedFile], srcs: list[tuple[str, st.TensorInfo]], stacked: bool
               ) -> _Component:
    t0 = srcs[0][1]
    shape = (len(srcs), *t0.shape) if stacked else t0.shape
    return _Component(shape, st.NUMPY_DTYPES[t0.dtype], [(mapped[fn], t) for fn, t in srcs], stacked)


def _full(shape) -> list[tuple[int, int]]:
    return [(0, n) for n in shape]


def _to_devices(shape: tuple[int, ...], sharding: jax.sharding.Sharding, read: Callable, mode: str) -> jax.Array:
    """One global array from per-device shards: each distinct shard is read once from the host, a replica of it
    is copied device to device."""
    done: dict[tuple, jax.Array] = {}
    arrays = []
    for dev, index in sharding.addressable_devices_indices_map(shape).items():
        box = tuple(tuple(sl.indices(n)[:2]) for sl, n in zip(tuple(index) + (slice(None),) * len(shape), shape))
        if box in done:
            arrays.append(jax.device_put(done[box], dev))
            continue
        x = jax.device_put(read(list(box), mode), dev)
        done[box] = x
        arrays.append(x)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _fp8_dequant_host(w: np.ndarray, s: np.ndarray, dtype) -> np.ndarray:
    """quant.Fp8Weight.dequantize on the host (exact: e4m3 times a power of two)."""
    out, inp = w.shape[-2:]
    scale = (s.astype(np.int32) << 23).view(np.float32)
    scale = np.repeat(np.repeat(scale, 32, axis=-2)[..., :out, :], 32, axis=-1)[..., :inp]
    return (w.astype(np.float32) * scale).astype(dtype)


def _requantize_rows_host(dense: np.ndarray) -> quant.Fp8Rows:
    """A dense Engram table (from a dense checkpoint) back to FP8 rows, on the CPU backend so it never touches an
    accelerator. Exact for tables that were FP8 rows before: the same values come back."""
    q, s = _fp8_rows_cpu(jax.device_put(dense, jax.devices("cpu")[0]))
    return quant.Fp8Rows(np.asarray(q), np.asarray(s))


@jax.jit
def _fp8_rows_cpu(dense):
    q, s = quant.fp8_quantize(dense.astype(jnp.float32), 32)
    return q, quant.ue8m0_encode(s)


@functools.partial(jax.jit, static_argnames="dtype")
def _dequantize_leaf(leaf, dtype: str):
    return dequantize_params(leaf, dtype)


class _Builder:
    """Turns a validated plan into one tree leaf; device leaves shard by shard (`_to_devices`)."""

    def __init__(self, plan: _Plan, mapped: dict[str, st.MappedFile], mesh, dequantize: str | None, par=None):
        self.plan = plan
        self.comps = [_component(mapped, srcs, plan.slot.n_experts is not None) for srcs in plan.sources]
        self.dequantize = dequantize
        slot, kind = plan.slot, plan.form.kind
        self.on_host = kind == "rows" or slot.fmt == "table"
        self.fp8_to_dense = kind == "fp8" and slot.fmt != "fp8"  # wo_a shipped as FP8 (FP8_IN_RELEASE)
        if self.fp8_to_dense:
            self.out_shapes = [(slot.spec.shape, np.dtype(ml_dtypes.bfloat16))]
        elif slot.fmt == "f32" and self.comps[0].dtype != np.float32:  # BF16_IN_RELEASE: exact upcast
            c = self.comps[0]
            c.convert, c.dtype = (lambda a: a.astype(np.float32)), np.dtype(np.float32)
            self.out_shapes = [(c.shape, c.dtype)]
        else:
            self.out_shapes = [(c.shape, c.dtype) for c in self.comps]
        self.sharding = None if self.on_host else sharding_for(slot.spec, mesh, [s for s, _ in self.out_shapes],
                                                               par)

    @property
    def read_bytes(self) -> int:
        return sum(c.nbytes for c in self.comps)

    def device_items(self, stored: bool = False) -> list[tuple[tuple[int, ...], np.dtype, jax.sharding.Sharding]]:
        """(shape, dtype, sharding) of what this leaf keeps on devices (stored=True: the stored-precision arrays,
        which exist only while a dequantized leaf is being made), for the memory check."""
        if self.on_host:
            return []
        if stored or not self.dequantize:
            return [(s, d, self.sharding) for s, d in self.out_shapes]
        dt = np.dtype(jnp.dtype(self.dequantize))
        if self.plan.slot.spec.fmt == "f32":  # dequantize_params keeps f32 leaves f32
            dt = np.dtype(np.float32)
        return [(self.plan.slot.spec.shape, dt, self.sharding)]

    def build(self, mode: str = "pread"):
        kind, comps = self.plan.form.kind, self.comps
        if self.on_host:
            if kind == "rows":  # never read here: rows are fetched by id at run time
                # one copy per host, shared by every local rank through the page cache
                return quant.Fp8Rows(comps[0].mapped(huge_pages=True), comps[1].mapped())
            return _requantize_rows_host(comps[0].read(_full(comps[0].shape)))
        if self.fp8_to_dense:
            dense = functools.cache(lambda: _fp8_dequant_host(comps[0].read(_full(comps[0].shape)),
                                                              comps[1].read(_full(comps[1].shape)),
                                                              ml_dtypes.bfloat16))
            leaf = _to_devices(self.out_shapes[0][0], self.sharding,
                               lambda box, _: dense()[tuple(slice(a, b) for a, b in box)], mode)
        else:
            arrays = [_to_devices(c.shape, self.sharding, c.read, mode) for c in comps]
            leaf = {"fp8": quant.Fp8Weight, "fp4": quant.Fp4Weight}[kind](*arrays) if kind != "dense" else arrays[0]
        if self.dequantize:
            leaf = _dequantize_leaf(leaf, self.dequantize)
        return leaf


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The model config of a release-format checkpoint directory (its config.json), reading no weight."""
    return _read_config(os.fspath(path), None)


def _read_config(path: str, cfg: ModelConfig | None) -> ModelConfig:
    cpath = os.path.join(path, CONFIG_NAME)
    if not os.path.exists(cpath):
        if cfg is None:
            raise CheckpointError(f"{path}: no {CONFIG_NAME}; add it or pass cfg=")
        return cfg
    try:
        file_cfg = ModelConfig.from_json(cpath)
    except ConfigError as e:
        raise CheckpointError(f"{cpath} is not a valid DeepSeek-V4.1 config: {e}") from None
    if cfg is not None and cfg != file_cfg:
        diffs = [f"{f.name}: file {getattr(file_cfg, f.name)!r}, given {getattr(cfg, f.name)!r}"
                 for f in dataclasses.fields(ModelConfig) if getattr(file_cfg, f.name) != getattr(cfg, f.name)]
        raise CheckpointError(f"{cpath} disagrees with the cfg passed ({'; '.join(diffs[:8])}"
                              f"{' ...' if len(diffs) > 8 else ''}); pass cfg=None to use the file's config, or "
                              "fix whichever is wrong")
    return file_cfg


def is_orbax_dir(path: str | os.PathLike) -> bool:
    cpath = os.path.join(path, CONFIG_NAME)
    if not os.path.isdir(os.path.join(path, "params")) or not os.path.exists(cpath):
        return False
    with open(cpath) as f:
        try:
            return json.load(f).get("format") == _ORBAX_FORMAT
        except json.JSONDecodeError:
            return False


def load_checkpoint(path: str | os.PathLike, cfg: ModelConfig | None = None, *,
                    mesh: jax.sharding.Mesh | None = None, parallelism: sharding.Parallelism | None = None,
                    dequantize: str | None = None, workers: int = 8, progress: bool = True,
                    read_mode: str = "mmap") -> tuple[ModelConfig, Params]:
    """Reads a release-format directory (or one written by save_orbax) -> (config, params).

    cfg: None reads config.json; given, it must agree with config.json when there is one.
    mesh: place each weight sharded per `sharding_for` (each device reads only its slices); None puts everything
      on the first device. parallelism: the layout's rules (None: the one the mesh implies).
    dequantize: None keeps stored precision (Fp8Weight / Fp4Weight with UE8M0 bytes); 'bfloat16' / 'float32'
      gives dequantize_params(stored, dequantize). Engram tables stay host memory-mapped Fp8Rows either way.
    Every tensor is validated before anything is built; any problem raises CheckpointError naming each bad
    tensor and its file. Vision tensors under a text-only config, and `mtp.*` (DSpark) ones beyond the
    config's n_mtp_layers stages, are skipped with one log line.
    workers: threads reading and transferring weights in parallel.
    read_mode: one of READ_MODES (see there).
    With a tokenizer.json in `path`, the tree also holds that tokenizer's Engram compressed token map under
    `model.TOKEN_MAP_KEY` (see `with_token_map`), so that `model.forward(params, cfg, ids)` hashes its n-grams
    with the checkpoint's own tokenizer.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory; pass the checkpoint directory")
    if read_mode not in READ_MODES:
        raise CheckpointError(f"read_mode={read_mode!r}: choose one of {list(READ_MODES)}")
    if dequantize not in (None, "bfloat16", "float32"):
        raise CheckpointError(f"dequantize={dequantize!r}: choose None, 'bfloat16' or 'float32'")
    if is_orbax_dir(path):
        if dequantize:
            raise CheckpointError(f"{path} is an orbax checkpoint of the loaded tree; it restores as saved "
                                  "(dequantize= applies to release-format checkpoints only)")
        ocfg, params = load_orbax(path, mesh=mesh, parallelism=parallelism)
        if cfg is not None and cfg != ocfg:
            raise CheckpointError(f"{path}: its config disagrees with the cfg passed; pass cfg=None")
        return ocfg, params
    cfg = _read_config(path, cfg)
    if parallelism is not None:  # a layout the model cannot take fails here, before any weight is read
        parallelism.validate(cfg, None if mesh is None else len(mesh.devices.flat))
    t0 = time.perf_counter()
    loc = _read_layout(path, workers)
    plans, slots, treedef = _plan(cfg, loc, path)

    mapped = {fn: st.MappedFile(h) for fn, h in loc.files.items()}
    builders = [_Builder(p, mapped, mesh, dequantize, parallelism) for p in plans]
    need = _bytes_per_device([it for b in builders for it in b.device_items()])
    if dequantize:  # up to `workers` stored leaves exist next to their dequantized copies while they are made
        largest = sorted((b for b in builders if not b.on_host), key=lambda b: -b.read_bytes)[:workers]
        for d, n in _bytes_per_device([it for b in largest for it in b.device_items(stored=True)]).items():
            need[d] = need.get(d, 0) + n
    check_fits(need, f"loading {path}" + (f" as {dequantize}" if dequantize else ""))
    host = [b for b in builders if b.on_host]
    if host:
        mm = sum(b.read_bytes for b in host if b.plan.form.kind == "rows")
        log.info("Engram tables stay on the host: %.3f GB memory-mapped%s", mm / 1e9,
                 "; dense tables of this dense checkpoint are re-quantized to FP8 rows in host memory"
                 if mm < sum(b.read_bytes for b in host) else "")

    # Largest first within each file's order keeps the pool busy to the end; threads overlap page faults.
    order = sorted((b for b in builders if not b.on_host), key=lambda b: -b.read_bytes)
    total = sum(b.read_bytes for b in order)
    leaves: list[Any] = [None] * len(slots)
    for b in host:
        leaves[b.plan.slot.index] = b.build()
    lock = threading.Lock()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"load {os.path.basename(path)}",
              disable=None if progress else True) as bar:

        def run(b: _Builder):
            leaf = b.build(read_mode)
            jax.block_until_ready(leaf)
            with lock:
                bar.update(b.read_bytes)
            return b.plan.slot.index, leaf

        ex = cf.ThreadPoolExecutor(max(1, workers))
        try:
            for i, leaf in ex.map(run, order):
                leaves[i] = leaf
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
    dt = time.perf_counter() - t0
    log.info("loaded %s: %d weights, %.3f GB to devices in %.2f s (%.2f GB/s)", path, len(order), total / 1e9, dt,
             total / 1e9 / max(dt, 1e-9))
    return cfg, with_token_map(jax.tree_util.tree_unflatten(treedef, leaves), cfg, path)


def with_token_map(params: Params, cfg: ModelConfig, path: str) -> Params:
    """The tree plus, under `model.TOKEN_MAP_KEY`, the Engram compressed token map of the tokenizer.json in `path`
    (what `model.forward` and the engine hash n-grams with). Without a tokenizer there (or without Engram) the
    tree is returned as is, and the model hashes with the built-in tokenizer."""
    if not cfg.engram_layer_ids or not os.path.exists(os.path.join(path, TOKENIZER_FILES[0])):
        return params
    from dsv41 import ngram_hash
    from dsv41 import tokenizer as T

    token_map = T.build_compressed_token_map(T.load_tokenizer(path))[0]
    try:
        ngram_hash.NgramHasher(cfg, token_map)  # its checks: sizes against the config, now rather than at a forward
    except ConfigError as e:
        raise CheckpointError(f"{path}: its tokenizer does not fit its config.json ({e}); the tokenizer.json and "
                              "config.json must come from the same release") from None
    token_map.setflags(write=False)  # shared by every hasher built from this tree
    return {**params, model.TOKEN_MAP_KEY: token_map}


load_any = load_checkpoint

ENGRAM_TABLE_MODES = ("ram", "mmap")


def resident_tables(params: Params, progress: bool = True, chunk_bytes: int = 1 << 28) -> Params:
    """The tree with every host Engram table read into host memory from its file mapping.

    A loaded table is a memory map: serving gathers a few thousand random rows a step, and each row of a page
    not yet in the page cache is a disk read (a cold 2048-token prefill chunk gathers ~50K rows per Engram
    layer). Reading the tables once, sequentially at the disk's rate, makes every later gather a memory copy.
    Tables already in memory (presets, device arrays) pass through."""
    def mapped(a) -> bool:
        return isinstance(a, np.ndarray) and not a.flags.owndata and not a.flags.writeable

    leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_weight_leaf)
    todo = [i for i, x in enumerate(leaves)
            if isinstance(x, quant.Fp8Rows) and (mapped(x.weight) or mapped(x.scale))]
    total = sum(leaves[i].weight.nbytes + leaves[i].scale.nbytes for i in todo)
    if not todo:
        return params
    t0 = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc="Engram tables to RAM", disable=not progress) as bar:
        for i in todo:
            arrays = []
            for a in (leaves[i].weight, leaves[i].scale):
                out = np.empty(a.shape, a.dtype)
                rows = max(1, chunk_bytes // max(1, a[:1].nbytes))
                for r in range(0, a.shape[0], rows):  # in chunks: a progress bar, and no second full copy
                    out[r:r + rows] = a[r:r + rows]
                    bar.update(out[r:r + rows].nbytes)
                arrays.append(out)
            leaves[i] = quant.Fp8Rows(*arrays)
    log.info("Engram tables in host memory: %.2f GB in %.1f s", total / 1e9, time.perf_counter() - t0)
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ---- orbax ---------------------------------------------------------------------------------------------------


def _split_tables(cfg: ModelConfig, params: Params) -> tuple[list, dict[str, quant.Fp8Rows], list[_Slot], Any]:
    """Tree leaves with Engram tables replaced by None, and the tables by release key."""
    slots, treedef = _slots(cfg)
    leaves = jax.tree_util.tree_leaves(params, is_leaf=is_weight_leaf)
    if len(leaves) != len(slots):
        raise CheckpointError(f"params have {len(leaves)} weights but the config describes {len(slots)}")
    tables = {s.key: leaf for s, leaf in zip(slots, leaves) if isinstance(leaf, quant.Fp8Rows)}
    rest = [None if isinstance(leaf, quant.Fp8Rows) else leaf for leaf in leaves]
    return rest, tables, slots, treedef


def _describe(leaf) -> dict:
    kind = type(leaf).__name__ if is_weight_leaf(leaf) else "array"
    arrays = {f: getattr(leaf, f) for f in ("weight", "scale")} if kind != "array" else {"": leaf}
    return {"kind": kind, "arrays": {f: [list(a.shape), np.dtype(a.dtype).name] for f, a in arrays.items()}}


def save_orbax(params: Params, cfg: ModelConfig, path: str | os.PathLike) -> str:
    """Saves a loaded tree (any precision) for fast restarts: `params/` (orbax), `engram/*.npy` (the host tables,
    raw bytes, memory-mapped on restore) and a flat config.json marked as this format. Returns path."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    token_map = params.get(model.TOKEN_MAP_KEY)
    rest, tables, slots, _ = _split_tables(cfg, {k: v for k, v in params.items() if k != model.TOKEN_MAP_KEY})
    os.makedirs(path, exist_ok=True)
    state = {s.key: leaf for s, leaf in zip(slots, rest) if leaf is not None}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), state, force=True)
        ckptr.wait_until_finished()
    os.makedirs(os.path.join(path, "engram"), exist_ok=True)
    for key, rows in tables.items():
        for f in ("weight", "scale"):
            np.save(os.path.join(path, "engram", f"{key}.{f}.npy"), np.asarray(getattr(rows, f)).view(np.uint8))
    if token_map is not None:
        np.save(os.path.join(path, "engram", _TOKEN_MAP_FILE), np.asarray(token_map))
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    meta = {"format": _ORBAX_FORMAT, **d, "leaves": {s.key: _describe(leaf) for s, leaf in zip(slots, rest)
                                                      if leaf is not None}}
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(meta, f, indent=1)
    log.info("saved orbax checkpoint %s (%d arrays, %d host tables)", path, len(state), len(tables))
    return path


def load_orbax(path: str | os.PathLike, mesh: jax.sharding.Mesh | None = None,
               parallelism: sharding.Parallelism | None = None) -> tuple[ModelConfig, Params]:
    """Restores what save_orbax wrote, placed per `sharding_for` (first device without a mesh)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if not is_orbax_dir(path):
        raise CheckpointError(f"{path} is not a dsv41 orbax checkpoint (needs params/ and a config.json with "
                              f"format={_ORBAX_FORMAT!r}); write one with save_orbax")
    with open(os.path.join(path, CONFIG_NAME)) as f:
        meta = json.load(f)
    cfg = ModelConfig.from_dict(meta)
    described = meta["leaves"]
    slots, treedef = _slots(cfg)
    target, items = {}, []
    for s in slots:
        if s.key not in described:
            continue
        d = described[s.key]
        shapes = [tuple(v[0]) for v in d["arrays"].values()]
        sh = sharding_for(s.spec, mesh, shapes, parallelism)
        structs = {f: jax.ShapeDtypeStruct(tuple(shp), jnp.dtype(dt), sharding=sh)
                   for f, (shp, dt) in d["arrays"].items()}
        items += [(x.shape, x.dtype, sh) for x in structs.values()]
        cls = {"Fp8Weight": quant.Fp8Weight, "Fp4Weight": quant.Fp4Weight, "array": None}[d["kind"]]
        target[s.key] = structs[""] if cls is None else cls(structs["weight"], structs["scale"])
    check_fits(_bytes_per_device(items), f"restoring {path}")
    t0 = time.perf_counter()
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(os.path.join(path, "params"), target)
    leaves = []
    for s in slots:
        if s.key in state:
            leaves.append(state[s.key])
            continue
        files = [os.path.join(path, "engram", f"{s.key}.{f}.npy") for f in ("weight", "scale")]
        if not all(os.path.exists(f) for f in files):
            raise CheckpointError(f"{path}: {s.key} is in neither params/ nor engram/; the checkpoint is "
                                  "incomplete, write it again with save_orbax")
        w, sc = (np.load(f, mmap_mode="r") for f in files)
        leaves.append(quant.Fp8Rows(w.view(ml_dtypes.float8_e4m3fn), sc))
    log.info("restored orbax checkpoint %s in %.2f s", path, time.perf_counter() - t0)
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    map_file = os.path.join(path, "engram", _TOKEN_MAP_FILE)
    if not os.path.exists(map_file):  # written before the map was saved: derive it, if the tokenizer is there
        return cfg, with_token_map(params, cfg, path)
    token_map = np.load(map_file)
    token_map.setflags(write=False)
    return cfg, {**params, model.TOKEN_MAP_KEY: token_map}


def release_tensors(cfg: ModelConfig, *, hf_layout: bool = False) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, dtype, shape) of every tensor save_checkpoint writes in stored precision for cfg (hf_layout as
    there), in tree order, without allocating anything."""
    out = []
    for slot in _slots(cfg)[0]:
        forms = _forms(slot, dense_ckpt=False)
        form = forms[-1] if hf_layout and _in(slot, FP8_IN_RELEASE) else forms[0]
        for part in form.parts:
            dtype = part.dtypes[-1] if hf_layout and _in(slot, BF16_IN_RELEASE) else part.dtypes[0]
            out += [(k, dtype, part.shape) for k in slot.keys(part.field)]
    return out


def iter_release_tensors(path: str | os.PathLike) -> Iterator[tuple[str, str, tuple[int, ...], str]]:
    """(key, dtype, shape, file) of every tensor in a checkpoint directory's headers, for inspection tools."""
    loc = _read_layout(os.fspath(path), 8)
    for key, (fn, t) in sorted(loc.where.items()):
        yield key, t.dtype, t.shape, fn
