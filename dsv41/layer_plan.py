"""What each layer's compressed (global) attention branch does, decided in one place (spec §2.4), and the carry
that hands its results to the later layers. The full-sequence model (`model.attention_full`) and the engine's
cached attention (serving/engine/programs.py) both read a layer's `LayerPlan` and thread a `Carry`.
"""

from __future__ import annotations

import dataclasses

import jax

from dsv41.config import AttnRole, ModelConfig


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Static per layer: which parts of the compressed branch it runs and whose compressed KV it reads."""

    layer: int
    ratio: int  # compress ratio (0: sliding window only)
    kv_source: int | None  # the KV source layer whose compressed KV / index keys it reads; None: SWA-only
    writes_kv: bool  # a KV source: compresses its own KV and computes its index keys
    runs_indexer: bool  # scores the index keys with its own queries and selects its own top-k
    makes_candidates: bool  # the candidate source: its scores also pick the candidate pool later indexers score
    uses_candidates: bool  # an indexer after the candidate source: scores the candidates only

    @property
    def swa_only(self) -> bool:
        return self.kv_source is None

    @classmethod
    def of(cls, cfg: ModelConfig, layer: int) -> LayerPlan:
        role = cfg.role(layer)
        if role is AttnRole.SWA:
            return cls(layer, 0, None, False, False, False, False)
        runs = role in (AttnRole.FULL, AttnRole.REINDEX)
        return cls(layer, cfg.compress_ratios[layer], cfg.kv_source_of(layer), writes_kv=role is AttnRole.FULL,
                   runs_indexer=runs, makes_candidates=runs and layer == cfg.candidate_source_layer,
                   uses_candidates=runs and cfg.uses_candidates(layer))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carry:
    """What a layer's compressed branch hands to the layers after it; None until a layer sets it. The candidates
    come in one of two forms: an entry mask (`model.forward`, which scores the whole context at once) or block
    ids (the engine, which scores it block by block)."""

    comp_kv: jax.Array | None = None  # [B, G, Dh] the latest KV source's compressed KV, post-RoPE (full sequence)
    index_k: jax.Array | None = None  # [B, G, ID] its index keys (full sequence; the engine reads the pool)
    topk: jax.Array | None = None  # int32 [B, S, K] the latest indexer's entry ids, -1 = none
    cand_mask: jax.Array | None = None  # bool [B, S, G] the candidate source's entries (model.forward)
    cand_blocks: jax.Array | None = None  # int32 [B, S, NB] the candidate source's block ids (the engine)
