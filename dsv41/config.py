"""Model configuration: a frozen, validated dataclass read from the release's `config.json`.

Field names follow the flat `inference/config.json` of the release (the reference's `ModelArgs`);
`ModelConfig.from_hf_dict` also reads the nested Hugging Face form (`text_config`), whose names differ.
Spec: shared/spec/ARCHITECTURE.md §1.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
from typing import Any, Sequence


class ConfigError(ValueError):
    """A config field is missing, has the wrong type, or contradicts another field."""


def _need(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


class AttnRole(enum.Enum):
    """What the compressed (global) branch of a layer's attention does (spec §2.4)."""

    SWA = "swa"  # ratio 0: sliding window only
    FULL = "full"  # KV source: compresses its own KV, owns index keys, runs its own indexer
    REINDEX = "reindex"  # index source that is not a KV source: own indexer query over latest keys
    REUSE = "reuse"  # reads the latest compressed KV and the latest top-k


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower and image sizing (the release's nested `vision_config`, spec §1). Names follow the
    flat `inference/config.json`'s `vision_*` keys without the prefix."""

    n_layers: int = 32
    dim: int = 1024
    n_heads: int = 16
    inter_dim: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024  # a whole span: start + rows x (columns + newline) + end
    min_pixels: int = 295936  # smaller images are scaled up to this area (544^2)
    max_wh_ratio: float | None = None  # wider images are squeezed to this width/height (None: never)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
        for name in ("n_layers", "dim", "n_heads", "inter_dim", "patch_size", "downsample_ratio",
                     "max_image_tokens", "min_pixels"):
            v = getattr(self, name)
            _need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"vision_config.{name}",
                  f"must be a positive integer, got {v!r}")
        _need(self.dim % self.n_heads == 0 and self.head_dim % 4 == 0, "vision_config.hidden_size",
              f"{self.dim} / {self.n_heads} heads must give a head dim divisible by 4 (2D RoPE: half rows, "
              "half columns, in pairs)")
        _need(self.max_image_tokens >= 4, "vision_config.max_image_tokens", "must be >= 4")
        _need(math.isfinite(self.rope_theta) and self.rope_theta > 0, "vision_config.rope_theta",
              "must be finite and > 0")
        _need(self.max_wh_ratio is None or (math.isfinite(self.max_wh_ratio) and self.max_wh_ratio >= 1),
              "vision_config.max_wh_ratio", f"must be null or >= 1, got {self.max_wh_ratio!r}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any] | None) -> "VisionConfig | None":
        """The nested `vision_config`; None (a text-only model) when absent or with num_hidden_layers 0."""
        if not d or d.get("num_hidden_layers", 1) == 0:
            return None
        return cls(**{ours: d[hf] for hf, ours in _HF_VISION_NAMES.items() if hf in d})

    @classmethod
    def from_flat_dict(cls, d: dict[str, Any]) -> "VisionConfig | None":
        """The flat file's `vision_*` keys; None when there are none or vision_n_layers is 0."""
        kw = {k[len("vision_"):]: v for k, v in d.items() if k.startswith("vision_")}
        if "max_n_token" in kw:
            kw["max_image_tokens"] = kw.pop("max_n_token")
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in kw.items() if k in known}
        if not kw or kw.get("n_layers", 1) == 0:
            return None
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        return {"model_type": "deepseek_v41_vision",
                **{hf: getattr(self, ours) for hf, ours in _HF_VISION_NAMES.items()}}


_HF_VISION_NAMES = {
    "num_hidden_layers": "n_layers",
    "hidden_size": "dim",
    "num_attention_heads": "n_heads",
    "intermediate_size": "inter_dim",
    "patch_size": "patch_size",
    "rope_theta": "rope_theta",
    "downsample_ratio": "downsample_ratio",
    "max_image_tokens": "max_image_tokens",
    "min_pixels": "min_pixels",
    "max_wh_ratio": "max_wh_ratio",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    norm_eps: float = 1e-20
    swiglu_limit: float = 10.0
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    gate_temp: float = 1.0
    # attention
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # rope
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_seq_len: int = 1048576
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16_000_000
    engram_compressed_vocab_size: int = 99092
    engram_pad_id: int = 2
    # DSpark (spec §2.8): the draft stages stored as `mtp.0..n_mtp_layers-1`, run as layers n_layers.. (ratio 0)
    n_mtp_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    # images: spans of this id whose embeddings the vision tower and aligner replace (None: text only)
    image_token_id: int = 129264
    vision: VisionConfig | None = VisionConfig()
    # weights as released: FP8 e4m3 with UE8M0 32x32 block scales, routed experts FP4
    dtype: str = "fp8"
    expert_dtype: str = "fp4"

    # ---- derived -------------------------------------------------------------------------

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def hc_mix_dim(self) -> int:
        """Width of the mHC coefficient projection: pre (hc) + post (hc) + comb (hc x hc)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_n_cols(self) -> int:
        """Hash columns per position and Engram layer: (max n-gram - 1) x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def split_layer(self) -> int:
        """First decoder layer: the candidate source (layer 20 in Flash); -1 with no decoder."""
        return self.candidate_source_layer

    @property
    def dspark_stage_config(self) -> "ModelConfig":
        """The config a DSpark stage's MoE runs under: the stages' own expert count and top-k."""
        return _dspark_stage_config(self)

    def role(self, layer: int) -> AttnRole:
        if self.compress_ratios[layer] == 0:
            return AttnRole.SWA
        if layer in self.kv_source_layers:
            return AttnRole.FULL
        if layer in self.index_source_layers:
            return AttnRole.REINDEX
        return AttnRole.REUSE

    def kv_source_of(self, layer: int) -> int:
        """The KV source whose compressed KV (and index keys) `layer` reads."""
        return max(s for s in self.kv_source_layers if s <= layer)

    def index_source_of(self, layer: int) -> int:
        """The index source whose top-k `layer` uses."""
        return max(s for s in self.index_source_layers if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        return 0 <= self.candidate_source_layer < layer and layer in self.index_source_layers

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- validation ----------------------------------------------------------------------

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):  # JSON gives lists; keep the dataclass hashable
                object.__setattr__(self, f.name, tuple(v))
        _validate(self)

    # ---- I/O -----------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Reads either the nested release `config.json` or the flat `inference/config.json`."""
        if "text_config" in d:
            return cls.from_hf_dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        if "n_layers" not in kwargs:
            raise ConfigError("config has neither `text_config` (nested form) nor `n_layers` (flat form)")
        v = d.get("vision", ())  # dataclasses.asdict's form (an orbax checkpoint's config), else `vision_*` keys
        if v == ():
            v = VisionConfig.from_flat_dict(d)
        kwargs["vision"] = VisionConfig(**v) if isinstance(v, dict) else v
        return cls(**_trim_to_backbone(kwargs))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        t = dict(d["text_config"])
        kw: dict[str, Any] = {}
        for hf, ours in _HF_NAMES.items():
            if hf in t:
                kw[ours] = t[hf]
        rs = t.get("rope_scaling") or {}
        if rs:
            if rs.get("type", rs.get("rope_type")) not in ("yarn", None):
                raise ConfigError(f"rope_scaling.type={rs.get('type')!r}: only 'yarn' is supported")
            kw["rope_factor"] = rs.get("factor", cls.rope_factor)
            kw["original_seq_len"] = rs.get("original_max_position_embeddings", cls.original_seq_len)
            kw["beta_fast"] = rs.get("beta_fast", cls.beta_fast)
            kw["beta_slow"] = rs.get("beta_slow", cls.beta_slow)
        if t.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"topk_method={t['topk_method']!r}: only 'noaux_tc' is supported")
        q = d.get("quantization_config") or t.get("quantization_config") or {}
        if q:
            if list(q.get("weight_block_size", [32, 32])) != [32, 32]:
                raise ConfigError(f"quantization_config.weight_block_size={q['weight_block_size']}: expected [32, 32]")
            kw["expert_dtype"] = q.get("expert_dtype", "fp4") or "fp8"
        else:
            kw["dtype"] = "bf16"
            kw["expert_dtype"] = "bf16"
        for k in ("bos_token_id", "eos_token_id"):
            if k in d or k in t:
                kw[k] = t.get(k, d.get(k))
        if "num_hidden_layers" not in kw and "n_layers" not in kw:
            raise ConfigError("text_config.num_hidden_layers is missing")
        kw["vision"] = VisionConfig.from_hf_dict(d.get("vision_config"))
        if "image_token_id" in d:
            kw["image_token_id"] = d["image_token_id"]
        return cls(**_trim_to_backbone(kw))

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The nested release form (compress_ratios lists the DSpark stages too, as the release does)."""
        t: dict[str, Any] = {"model_type": "deepseek_v41_text"}
        for hf, ours in _HF_NAMES.items():
            v = getattr(self, ours)
            t[hf] = list(v) if isinstance(v, tuple) else v
        t["compress_ratios"] += [0] * self.n_mtp_layers  # the DSpark stages are window-only layers
        t.update(
            num_key_value_heads=1,
            hidden_act="silu",
            topk_method="noaux_tc",
            tie_word_embeddings=False,
            rope_scaling={
                "type": "yarn",
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.original_seq_len,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
            },
            num_nextn_predict_layers=self.n_mtp_layers,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )
        d: dict[str, Any] = {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "text_config": t,
            "image_token_id": self.image_token_id,
            "vision_config": {"num_hidden_layers": 0} if self.vision is None else self.vision.to_hf_dict(),
        }
        if self.dtype == "fp8":
            d["quantization_config"] = {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": [32, 32],
                "scale_fmt": "ue8m0",
                "expert_dtype": self.expert_dtype,
            }
        return d


# nested `text_config` name -> our (flat reference) name
_HF_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_lora_rank": "o_lora_rank",
    "o_groups": "o_groups",
    "rms_norm_eps": "norm_eps",
    "swiglu_limit": "swiglu_limit",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "norm_topk_prob": "norm_topk_prob",
    "routed_scaling_factor": "route_scale",
    "sliding_window": "window_size",
    "compress_ratios": "compress_ratios",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "candidate_source_layer_id": "candidate_source_layer",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "max_position_embeddings": "max_seq_len",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_vocab_size": "engram_vocab_size",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "engram_pad_token_id": "engram_pad_id",
    "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_num_experts_per_tok",
}


def _trim_to_backbone(kw: dict[str, Any]) -> dict[str, Any]:
    """The release lists compress_ratios for the DSpark layers too (0: window-only, the only kind a stage is);
    the backbone takes the first n_layers."""
    n = kw.get("n_layers")
    cr = kw.get("compress_ratios")
    if n is not None and cr is not None and len(cr) > n:
        kw["compress_ratios"] = tuple(cr)[:n]
    return kw


def _validate(c: ModelConfig) -> None:
    ints = [f.name for f in dataclasses.fields(c) if f.type in ("int", int)]
    for name in ints:
        v = getattr(c, name)
        _need(isinstance(v, int) and not isinstance(v, bool), name, f"must be an integer, got {v!r}")
    for name in ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "head_dim", "q_lora_rank",
                 "o_lora_rank", "o_groups", "n_routed_experts", "n_activated_experts", "window_size",
                 "hc_mult", "hc_sinkhorn_iters", "index_n_heads", "index_head_dim", "index_topk"):
        _need(getattr(c, name) > 0, name, f"must be > 0, got {getattr(c, name)}")
    n = c.n_layers
    _need(len(c.compress_ratios) == n, "compress_ratios",
          f"needs one entry per layer ({n}), got {len(c.compress_ratios)}")
    _need(all(r in (0, 1, 2) for r in c.compress_ratios), "compress_ratios",
          f"entries must be 0, 1 or 2 (CSA2), got {sorted(set(c.compress_ratios))}")
    _need(c.n_activated_experts <= c.n_routed_experts, "n_activated_experts",
          f"{c.n_activated_experts} > n_routed_experts={c.n_routed_experts}")
    _need(c.n_shared_experts == 1, "n_shared_experts", f"V4.1 has exactly 1 shared expert, got {c.n_shared_experts}")
    _need(c.score_func == "sqrtsoftplus", "score_func", f"only 'sqrtsoftplus' is supported, got {c.score_func!r}")
    _need(c.n_heads % c.o_groups == 0, "o_groups", f"n_heads={c.n_heads} must be divisible by o_groups={c.o_groups}")
    _need(0 < c.rope_head_dim <= min(c.head_dim, c.index_head_dim) and c.rope_head_dim % 2 == 0, "rope_head_dim",
          f"must be even and <= min(head_dim, index_head_dim), got {c.rope_head_dim}")
    for name in ("dim", "head_dim", "q_lora_rank", "moe_inter_dim", "index_head_dim", "o_lora_rank"):
        v = getattr(c, name)
        _need(v % 32 == 0, name, f"must be a multiple of 32 (quantization blocks), got {v}")
    _need((c.n_heads * c.head_dim // c.o_groups) % 32 == 0, "head_dim",
          "n_heads*head_dim/o_groups must be a multiple of 32")
    for s in c.kv_source_layers:
        _need(0 <= s < n and c.compress_ratios[s] > 0, "kv_source_layers",
              f"layer {s} must exist and have compress ratio > 0")
    for s in c.index_source_layers:
        _need(0 <= s < n and c.compress_ratios[s] > 0, "index_source_layers",
              f"layer {s} must exist and have compress ratio > 0")
    _need(set(c.kv_source_layers) <= set(c.index_source_layers), "kv_source_layers",
          "every KV source must also be an index source")
    for layer, r in enumerate(c.compress_ratios):
        if r == 0:
            continue
        srcs = [s for s in c.kv_source_layers if s <= layer]
        _need(bool(srcs) and c.compress_ratios[max(srcs)] == r, "kv_source_layers",
              f"layer {layer} (ratio {r}) needs an earlier KV source of the same ratio")
        isrcs = [s for s in c.index_source_layers if s <= layer]
        _need(bool(isrcs) and max(isrcs) >= max(srcs), "index_source_layers",
              f"layer {layer} needs an index source at or after its KV source {max(srcs)}")
    if c.candidate_source_layer >= 0:
        _need(c.candidate_source_layer in c.kv_source_layers, "candidate_source_layer",
              f"{c.candidate_source_layer} must be a KV source {c.kv_source_layers}")
        _need(c.candidate_topk_blocks > 0 and c.candidate_block_size > 0, "candidate_topk_blocks",
              "candidate_topk_blocks and candidate_block_size must be > 0")
        _need((c.candidate_topk_blocks - 1) * c.candidate_block_size + 1 >= c.index_topk, "candidate_topk_blocks",
              "the candidate pool must hold at least index_topk positions: "
              "(candidate_topk_blocks-1)*candidate_block_size+1 >= index_topk")
        _need(all(r == 1 for r in c.compress_ratios[c.candidate_source_layer:]), "compress_ratios",
              "every layer from the candidate source (first decoder layer) on must have ratio 1")
    _need(len(c.engram_layer_ids) == len(c.engram_num_embeddings), "engram_num_embeddings",
          f"needs one entry per Engram layer {c.engram_layer_ids}")
    for layer in c.engram_layer_ids:
        _need(0 <= layer < n, "engram_layer_ids", f"layer {layer} does not exist")
    if c.engram_layer_ids:
        _need(c.engram_max_ngram_size >= 2, "engram_max_ngram_size", "must be >= 2")
        _need(c.engram_head_dim % 32 == 0, "engram_head_dim", "must be a multiple of 32")
        _need(c.engram_compressed_vocab_size > 0, "engram_compressed_vocab_size", "must be > 0")
        _need(0 <= c.engram_pad_id < c.vocab_size, "engram_pad_id", f"must be a token id < {c.vocab_size}")
        need = engram_primes(c)
        for i, layer in enumerate(c.engram_layer_ids):
            rows = sum(p for per_n in need[i] for p in per_n)
            _need(c.engram_num_embeddings[i] >= rows, "engram_num_embeddings",
                  f"layer {layer} needs >= {rows} rows (sum of its bucket primes), got {c.engram_num_embeddings[i]}")
    _need(c.dtype in ("fp8", "bf16"), "dtype", f"must be 'fp8' or 'bf16', got {c.dtype!r}")
    _need(c.expert_dtype in ("fp4", "fp8", "bf16"), "expert_dtype",
          f"must be 'fp4', 'fp8' or 'bf16', got {c.expert_dtype!r}")
    _need(c.window_size > 0, "window_size", "must be > 0")
    if c.vision is not None:
        _need(0 <= c.image_token_id < c.vocab_size, "image_token_id",
              f"{c.image_token_id} must be a token id < vocab_size={c.vocab_size}")
    _need(c.n_mtp_layers >= 0, "n_mtp_layers", f"must be >= 0, got {c.n_mtp_layers}")
    if c.n_mtp_layers:
        _need(len(c.dspark_target_layer_ids) > 0 and all(0 <= i < n for i in c.dspark_target_layer_ids),
              "dspark_target_layer_ids", f"must name layers of the backbone [0, {n}), got {c.dspark_target_layer_ids}")
        _need(c.dspark_block_size > 0, "dspark_block_size", f"must be > 0, got {c.dspark_block_size}")
        _need(0 <= c.dspark_noise_token_id < c.vocab_size, "dspark_noise_token_id",
              f"must be a token id < {c.vocab_size}, got {c.dspark_noise_token_id}")
        _need(c.dspark_markov_rank > 0, "dspark_markov_rank", f"must be > 0, got {c.dspark_markov_rank}")
        _need(0 < c.dspark_num_experts_per_tok <= c.dspark_n_routed_experts, "dspark_num_experts_per_tok",
              f"must be in (0, dspark_n_routed_experts={c.dspark_n_routed_experts}], "
              f"got {c.dspark_num_experts_per_tok}")


@functools.lru_cache(maxsize=16)
def _dspark_stage_config(c: ModelConfig) -> ModelConfig:
    return c.replace(n_routed_experts=c.dspark_n_routed_experts, n_activated_experts=c.dspark_num_experts_per_tok,
                     n_mtp_layers=0)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    r = math.isqrt(n)
    f = 3
    while f <= r:
        if n % f == 0:
            return False
        f += 2
    return True


@functools.lru_cache(maxsize=16)
def _primes_cached(layer_count: int, max_ngram: int, n_heads: int, vocab: int) -> tuple:
    seen: set[int] = set()
    out = []
    for _ in range(layer_count):
        per_layer = []
        for _ in range(max_ngram - 1):
            cur, sizes = vocab - 1, []
            for _ in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                sizes.append(cur)
            per_layer.append(tuple(sizes))
        out.append(tuple(per_layer))
    return tuple(out)


def engram_primes(c: ModelConfig) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Bucket moduli [engram layer][n-gram size - 2][head]: consecutive unused primes above
    engram_vocab_size - 1, handed out layer by layer, n-gram size, head (spec §2.6 step 5)."""
    return _primes_cached(len(c.engram_layer_ids), c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size)


# ---- presets ---------------------------------------------------------------------------------

def _with_engram_rows(**kw: Any) -> dict[str, Any]:
    """Sizes each Engram table to exactly the sum of its bucket primes, as the release does."""
    probe = ModelConfig(**{**kw, "engram_num_embeddings": (1 << 62,) * len(kw["engram_layer_ids"])})
    kw["engram_num_embeddings"] = tuple(sum(p for per_n in layer for p in per_n) for layer in engram_primes(probe))
    return kw


# Every layer kind of Flash at CPU-test size, each once (the bench preset's plan): SWA-only L0-1; the ratio-2 KV
# source L2 and its reuse layer; the ratio-1 candidate source L4 (the first decoder layer) and its reuse layer; the
# reindex layer L6 and its reuse layer; Engram before L1 and L3, both in the encoder as in Flash. 8 layers, not
# more: the CPU tests are compile-bound and a program's compile time grows with its layers. 16 index heads keep
# float32 top-k free of ties.
_TINY = dict(
    vocab_size=1024,
    dim=256,
    moe_inter_dim=128,
    n_layers=8,
    n_heads=8,
    head_dim=64,
    rope_head_dim=16,
    q_lora_rank=128,
    o_lora_rank=64,
    o_groups=4,
    n_routed_experts=8,
    n_activated_experts=2,
    window_size=128,
    compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1),
    kv_source_layers=(2, 4),
    index_source_layers=(2, 4, 6),
    index_n_heads=16,
    index_head_dim=32,
    index_topk=16,
    candidate_source_layer=4,
    candidate_topk_blocks=4,
    candidate_block_size=8,
    original_seq_len=512,
    max_seq_len=8192,
    engram_layer_ids=(1, 3),
    engram_n_heads=8,
    engram_head_dim=32,
    engram_vocab_size=1000,
    # the tower at toy widths: 4-pixel patches, so a 40x28 test image is a 10x7 grid, padded to 12x9 by the
    # 3x3 merge (both ragged edges exercised) into a 4x3 span of 17 tokens
    image_token_id=1023,  # the built-in tokenizer's <｜deepseek_image｜>
    vision=VisionConfig(n_layers=2, dim=64, n_heads=2, inter_dim=96, patch_size=4, downsample_ratio=3,
                        max_image_tokens=64, min_pixels=576),
    # three DSpark stages reading the last three layers, as in Flash; top-3 of their own 8 experts
    dspark_target_layer_ids=(5, 6, 7),
    dspark_noise_token_id=1015,
    dspark_markov_rank=32,
    dspark_n_routed_experts=8,
)

# Flash's per-layer widths (hidden 5120, 64x512 heads, q-LoRA 1280, 8x1024 output groups, 32x128 indexer,
# 2304-wide experts) with fewer layers and experts, and a smaller Engram bucket range, so that one H200
# holds it in any weight format.
_BENCH = dict(
    n_layers=8,
    compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1),
    kv_source_layers=(2, 4),
    index_source_layers=(2, 4, 6),
    candidate_source_layer=4,
    n_routed_experts=64,
    engram_layer_ids=(1,),
    engram_vocab_size=1_000_000,
    max_seq_len=131072,
    # no DSpark stages by default (3 x 128 experts at Flash widths); .replace(n_mtp_layers=3) adds them
    n_mtp_layers=0,
    dspark_target_layer_ids=(5, 6, 7),
)

# Flash's 40-layer schedule (roles, compress ratios, KV / index sources, the L20 candidate pool and split, Engram
# before L1 and L14) at the tiny preset's widths: what a study of depth-compounding effects (SWA bounded replay:
# docs/REPLAY.md) runs on the CPU. Not for the unit tests: its programs take up to ~80 s each to compile on the
# CPU (XLA -O3), the reason tiny has 8 layers.
_FLASH_SCHEDULE = ("n_layers", "compress_ratios", "kv_source_layers", "index_source_layers",
                   "candidate_source_layer", "engram_layer_ids", "dspark_target_layer_ids")
# max_seq_len (a limit only): room for the study's 8K prompts and their continuations
_TINY40 = {**_TINY, **{k: getattr(ModelConfig, k) for k in _FLASH_SCHEDULE}, "max_seq_len": 16384}

PRESET_NAMES = ("tiny", "tiny40", "bench", "flash")


@functools.lru_cache(maxsize=None)
def preset(name: str) -> ModelConfig:
    """A named built-in config: 'tiny' (CPU tests, built-in tokenizer), 'tiny40' (tiny's widths, Flash's 40-layer
    schedule), 'bench' (Flash widths that fit one H200) or 'flash' (the release)."""
    if name == "flash":
        return ModelConfig()
    if name == "bench":
        return ModelConfig(**_with_engram_rows(**_BENCH))
    if name in ("tiny", "tiny40"):
        from dsv41 import tokenizer  # the compressed-vocab size is a property of the tokenizer

        kw = _with_engram_rows(**(_TINY if name == "tiny" else _TINY40), engram_compressed_vocab_size=1)
        return ModelConfig(**{**kw, "engram_compressed_vocab_size": tokenizer.builtin_compressed_vocab_size()})
    raise ConfigError(f"unknown preset {name!r}; choose one of {list(PRESET_NAMES)}")


def with_schedule(cfg: ModelConfig, name: str) -> ModelConfig:
    """cfg at its widths with preset `name`'s layer schedule (roles, ratios, sources, Engram and DSpark layers):
    e.g. the bench preset's Flash widths on Flash's 40 layers."""
    src = preset(name)
    kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return ModelConfig(**_with_engram_rows(**{**kw, **{k: getattr(src, k) for k in _FLASH_SCHEDULE}}))


def check_layers(cfg: ModelConfig, layers: Sequence[int]) -> None:
    for layer in layers:
        if not 0 <= layer < cfg.n_layers:
            raise ConfigError(f"layer {layer} out of range [0, {cfg.n_layers})")
