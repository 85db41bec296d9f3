"""Run the nemo-automodel 0.7.0 PyTorch DeepSeek-V4.1 model on a release-format checkpoint (CPU).

Runs under ``<repo>/.venv-ref/bin/python`` (Python 3.11, built by ``scripts/setup_reference_env.sh``),
never in the project's 3.12 venv. Our tests drive it through ``tests/reference/driver.py``.

    .venv-ref/bin/python tests/reference/nemo_runner.py --checkpoint DIR (--tokens TOKENS.npy | --chat MSGS.json) \
        --out OUT.npz [--dtype float32|bfloat16] [--act-quant] [--dump] [--layer-inputs FORCED.npz]
        [--attn eager|sdpa] [--threads N]

Input
  --checkpoint DIR  ``config.json`` (the released nested layout: top-level ``text_config`` / ``vision_config``;
                    ``quantization_config`` optional), ``tokenizer.json`` (HF fast tokenizer; needed when an Engram
                    layer is active), ``*.safetensors`` (+ optional ``model.safetensors.index.json``) with the released
                    key names (``embed.weight``, ``layers.{l}.attn.wq_a.weight``, ``layers.{l}.ffn.experts.{e}.w1.weight``,
                    ...). F32/BF16 weights; FP8/FP4 weights with ``.scale`` tensors are dequantized by nemo's adapter to
                    the run dtype (untested here). ``mtp.*`` and layers >= num_hidden_layers are ignored; the vision
                    tower (``vision.*``, ``aligner.*``, ``image_*``) is built and loaded only with ``--chat``.
  --tokens FILE     int32/int64 ``[batch, seq]`` token ids (a 1-D array is taken as batch 1). Full sequences from
                    position 0, no padding.
  --dtype           float32: every module stored/computed in fp32 (BF16 checkpoint weights are upcast exactly; F32
                    weights are used as-is). bfloat16: the release layout (bf16 weights and activations, fp32 mHC,
                    sinks, router, compressor projections and head).

  --chat FILE       instead of --tokens: a JSON message list (one conversation) whose content blocks may be
                    ``{"type": "image", "path": FILE}``; nemo's DeepseekV41Processor renders, tokenizes and
                    preprocesses it (chat mode), and the forward takes the images.

Output npz (always): ``logits`` float32 [batch, seq, vocab].
With ``--chat`` also: ``tokens`` int32 [1, s] (image spans expanded), ``vision_token_types`` int32 [1, s] (-1 text,
0 start, 1 image, 2 newline, 3 end), ``pixel_values`` [patches, 3, p, p], ``image_grid_hws`` int64 [images, 2],
``image_embeds`` [span tokens, D] (the embeddings of every span position, in sequence order).
With ``--dump`` also (bf16 tensors are widened to float32; b=batch, s=seq, D=hidden, hd=head_dim, r=ratio):
  tokens                     int32 [b,s]       the input ids
  embed                      [b,s,D]           token embedding (before stream expansion)
  engram{l}.hash_ids         int64 [b,s,24]    logical Engram table rows for layer l (per-layer head offsets added;
                                               order: n-gram 2 heads 0..7, n-gram 3, n-gram 4)
  engram{l}.in / .out        [b,s,4,D]         4 streams before / after the Engram residual of layer l
  layer{l}.block_in_raw      [b,s,4,D]         streams passed to block l (before Engram); only for Engram layers,
                                               elsewhere identical to block_in
  layer{l}.block_in          [b,s,4,D]         streams entering block l after its Engram (= mHC attn-site input)
  layer{l}.pre_mix_in        f32 [b,s,4]       delayed pre-mix used to collapse for attention (previous block's
                                               ffn-site `pre`; one-hot stream 0 at layer 0)
  layer{l}.hc_attn_pre/post  f32 [b,s,4]       attn-site mHC coefficients H_attn(block_in): pre includes +hc_eps,
                                               post = 2*sigmoid(.)
  layer{l}.hc_attn_comb      f32 [b,s,4,4]     Sinkhorn comb, [source stream i, destination stream j]
  layer{l}.attn_in           [b,s,D]           attn_norm(collapse(block_in, pre_mix_in)): attention module input
  layer{l}.q_latent          [b,s,q_lora]      q_norm(wq_a x) (shared by the main and indexer queries)
  layer{l}.kv_normed         [b,s,hd]          kv_norm(wkv x): SWA K=V before RoPE and before the FP8 qdq
  layer{l}.attn_out          [b,s,D]           attention sublayer output (after inverse RoPE, wo_a, wo_b; before
                                               hc expand)
  layer{l}.mid               [b,s,4,D]         streams after the attention expand (X1 = mHC ffn-site input)
  layer{l}.hc_ffn_pre/post/comb                ffn-site mHC coefficients H_ffn(mid); hc_ffn_pre == pre_mix_out
  layer{l}.ffn_in            [b,s,D]           ffn_norm(collapse(mid, hc_attn_pre)): MoE input
  layer{l}.moe.scores        f32 [b,s,E]       router logits x_f32 @ W_g^T (before sqrt-softplus)
  layer{l}.moe.topk_idx      int64 [b,s,k]     selected experts, ordered by biased score (descending)
  layer{l}.moe.topk_weight   f32 [b,s,k]       their weights: sqrt(softplus) / (sum + 1e-20) * route_scale
  layer{l}.moe.shared_out    [b,s,D]           shared expert output
  layer{l}.ffn_out           [b,s,D]           MoE output (routed + shared; before hc expand)
  layer{l}.block_out         [b,s,4,D]         streams leaving block l
  layer{l}.pre_mix_out       f32 [b,s,4]       ffn-site pre handed to the next block (= hc_ffn_pre)
  KV-source layers (Full mode) only:
  layer{l}.compressor_latent [b,s//r,hd]       compressor output: pooled (r=2: softmax-gated in fp32, cast to the run
                                               dtype) or projected (r=1), then RMSNorm; pre-RoPE, not quantized
  layer{l}.compressed_kv     [b,s//r,hd]       compressed KV as attended: RoPE at position g*r (YaRN table) on the
                                               last rope dims, then NVFP4 qdq (e2m1, E4M3 scale per 16)
  layer{l}.index_keys        [b,s//r,idim]     indexer keys: k_norm(wk latent), RoPE at g*r, MXFP4 qdq (UE8M0 per 32)
  Index-source layers (Full and Reindex) only:
  layer{l}.index_weights     [b,s,index_heads] raw weights_proj(x) (before the head_dim^-1/2 * heads^-1/2 scale)
  layer{l}.topk_idxs         int64 [b,s,K]     selected compressed indices, K = min(index_topk, s//r), ascending,
                                               -1 = none (fewer visible/candidate positions than K)
  Candidate-source layer only:
  layer{l}.candidates        bool [b,s,s//r]   candidate mask (top blocks of max-pooled indexer scores, newest visible
                                               block forced), restricted to visible positions
  final_hidden               [b,s,D]           norm(collapse(last block_out, last pre_mix_out)): lm-head input
Reuse layers publish nothing new (they attend with the last source's compressed_kv / topk_idxs).

DSpark (``--dspark-anchors A.npy --dspark-prev P.npy``): nemo's DSpark backbone (``deepseek_v41/dspark.py``, the
``mtp.*`` tensors) drafts one block per anchor from the target features this forward produced (the mean over the
hc copies of the streams entering each ``dspark_target_layer_ids`` layer, concatenated). A: int [b,a] anchor
positions (the block's first input is the token there; its context is the window of positions before it);
P: int [b,a,K] each block position's previous token for the Markov bias (K = dspark_block_size). Adds
  dspark.target_features    [b,s,n*D]         the concatenated mean streams
  dspark.logits             f32 [b,a,K,V]     draft logits: lm_head(final-normed states) + Markov bias of P
  dspark.confidence         f32 [b,a,K]       confidence-head logits

Teacher forcing (``--layer-inputs FILE.npz``): every key present in FILE replaces the matching module input for the
whole forward; the rest of the model runs normally (so later layers see the forced layer's outputs, and state
published by forced source layers is computed from forced inputs). Keys:
  layer{l}.block_in_raw (or layer{l}.block_in for a non-Engram layer)  streams passed to block l
  layer{l}.pre_mix_in                                                  block l's pre-mix
  layer{l}.attn_in                                                     attention module input (post attn_norm)
  layer{l}.ffn_in                                                      MoE input (post ffn_norm)
Arrays are cast to the module's activation dtype (pre-mix stays fp32).

FP8 activations (``--act-quant``): the input of every linear whose release weight is FP8/FP4 (attention wq_a, wq_b,
wkv, wo_b, indexer wq_b, shared and routed experts' w1/w3/w2, Engram wkv) is quantized to FP8 per 32 (UE8M0 scale)
and dequantized before the product, as the official ``Linear`` does with ``act_quant``; nemo itself does not. The
main model's layers only (not the DSpark stages).

Backends: eager attention (fp32 softmax, default) or sdpa; torch linears, torch fp32 RMSNorm, per-expert loop,
no torch.distributed, TorchDynamo disabled (the clamped SwiGLU is otherwise wrapped in torch.compile).
Exit codes: 0 ok, 2 bad input/checkpoint, 3 reference environment missing or broken.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

SETUP_HINT = "reference env missing or broken: run scripts/setup_reference_env.sh"


class InputError(Exception):
    """Bad command-line input or checkpoint contents (exit code 2)."""


def _import_reference():
    try:
        import numpy as np
        import torch
        from safetensors.torch import load_file
        from transformers import PreTrainedTokenizerFast

        from nemo_automodel.components.models.common import BackendConfig
        from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
        from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    except Exception as exc:  # pragma: no cover - environment problem
        print(f"nemo_runner: {SETUP_HINT} ({type(exc).__name__}: {exc})", file=sys.stderr)
        sys.exit(3)
    try:  # nemo reads the deprecated `config.torch_dtype`; keep stderr for real problems
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:  # pragma: no cover
        pass
    return np, torch, load_file, PreTrainedTokenizerFast, BackendConfig, DeepseekV41Config, DeepseekV41ForCausalLM


(np, torch, load_file, PreTrainedTokenizerFast, BackendConfig, DeepseekV41Config, DeepseekV41ForCausalLM) = (
    _import_reference()
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------------------------------------------
# checkpoint
# ----------------------------------------------------------------------------------------------------------------


def build_config(checkpoint: Path, dtype: str, vision: bool = False):
    path = checkpoint / "config.json"
    if not path.is_file():
        raise InputError(f"{path} not found")
    raw = json.loads(path.read_text())
    if "text_config" not in raw:
        raise InputError(f"{path}: expected the released nested layout with a top-level 'text_config'")
    raw.pop("transformers_version", None)
    raw.pop("model_type", None)
    raw.pop("torch_dtype", None)
    text = dict(raw["text_config"])
    text.pop("model_type", None)
    text.pop("torch_dtype", None)
    text.pop("transformers_version", None)
    text["dtype"] = dtype  # nemo builds every module with this storage/compute dtype
    vision = dict(raw.get("vision_config") or {})
    vision.pop("model_type", None)
    if not vision:
        vision["num_hidden_layers"] = 0  # text-only run: do not build the ViT
    raw["text_config"] = text
    raw["vision_config"] = vision
    raw["dtype"] = dtype
    try:
        return DeepseekV41Config(**raw)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{path}: nemo's DeepseekV41Config rejected it: {exc}") from exc


def load_tokenizer(checkpoint: Path):
    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        raise InputError(f"{path} not found (the Engram hashing needs the checkpoint's fast tokenizer)")
    return PreTrainedTokenizerFast(tokenizer_file=str(path))


def checkpoint_files(checkpoint: Path) -> list[Path]:
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({checkpoint / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise InputError(f"{index} names missing shard(s): {missing}")
    else:
        files = sorted(Path(p) for p in glob.glob(str(checkpoint / "*.safetensors")))
    if not files:
        raise InputError(f"no *.safetensors in {checkpoint}")
    return files


def load_weights(model, checkpoint: Path) -> None:
    hf_state = {}
    text_only = model.model.vision is None
    for file in checkpoint_files(checkpoint):
        for key, value in load_file(str(file)).items():
            if key.startswith("mtp.") or (text_only and (key.startswith(("vision.", "aligner.", "image_")))):
                continue  # the DSpark draft is not part of this reference; the tower only when built
            if key in hf_state:
                raise InputError(f"tensor {key} appears in more than one shard")
            hf_state[key] = value
    try:
        native = model.state_dict_adapter.from_hf(hf_state)
    except (ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise InputError(f"nemo's DeepseekV41StateDictAdapter could not convert the checkpoint: {exc}") from exc
    expected = model.state_dict()
    bad_shapes = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in native.items()
        if k in expected and tuple(v.shape) != tuple(expected[k].shape)
    ]
    if bad_shapes:
        raise InputError("shape mismatch between checkpoint and config:\n  " + "\n  ".join(bad_shapes[:20]))
    result = model.load_state_dict(native, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise InputError(
            "checkpoint does not match the model built from config.json:\n"
            f"  missing (model has, checkpoint lacks): {sorted(result.missing_keys)[:40]}\n"
            f"  unexpected (checkpoint has, model lacks): {sorted(result.unexpected_keys)[:40]}"
        )


def disable_cache_qdq() -> None:
    """Make nemo's cache QAT (``quantize_cache``: FP8 SWA KV, NVFP4 compressed KV, MXFP4 indexer Q/K) the identity.

    nemo has no switch for it; ``attention.py`` imports the function by name, so patch that binding.
    """
    from nemo_automodel.components.models.deepseek_v41 import attention

    from nemo_automodel.components.models.deepseek_v41 import dspark

    attention.quantize_cache = lambda values, *, format, block_size: values
    dspark.quantize_cache = attention.quantize_cache


# The modules whose release weights are FP8 (F8_E4M3 + 32x32 UE8M0) or FP4 (I8 e2m1 + UE8M0 per 32), by name in
# nemo's tree (spec §5; `attn.wo_a` is BF16 after the release's convert.py, so it is not among them). The official
# `Linear` quantizes such a layer's input to FP8 per 32 (`act_quant`) before its FP8/FP4 GEMM.
ACT_QUANT_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.indexer.wq_b",
                     "ffn.shared_experts.gate_proj", "ffn.shared_experts.up_proj", "ffn.shared_experts.down_proj",
                     "engram.wkv")


def enable_act_quant(model) -> int:
    """The official FP8 activation quantization before every FP8/FP4 linear (spec §2, §4), which nemo leaves out
    (it multiplies dequantized weights in the run dtype): the input of each `ACT_QUANT_LINEARS` module, and of the
    routed experts' w1/w3 and w2, goes through an FP8 e4m3 quantize-dequantize with a UE8M0 scale per 32 --
    nemo's own `quantize_cache(format="fp8")`, which is the official `act_quant` formula. The router keeps the
    unquantized input (it reads `ffn_in` in fp32, as official). Returns the number of hooked modules."""
    from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

    def fp8(x):
        return quantize_cache(x, format="fp8", block_size=32)

    def quantize_input(module, args):
        return (fp8(args[0]), *args[1:])

    hooked = 0
    for layer in model.model.layers.values():
        for name in ACT_QUANT_LINEARS:
            module = layer
            for part in name.split("."):
                module = getattr(module, part, None)
                if module is None:
                    break
            if module is not None:
                module.register_forward_pre_hook(quantize_input)
                hooked += 1
        experts = layer.ffn.experts
        if not hasattr(experts, "expert_activation_grouped"):
            raise InputError(f"nemo's {type(experts).__name__} has no expert_activation_grouped to quantize w2's input")
        experts.register_forward_pre_hook(quantize_input)  # w1/w3 input: the routed tokens
        activation = experts.expert_activation_grouped  # w2 input: weight * silu(g) * u, in the run dtype
        experts.expert_activation_grouped = lambda h, w, activation=activation: fp8(activation(h, w))
        hooked += 1
    return hooked


def build_model(checkpoint: Path, dtype: str, attn: str, vision: bool = False):
    config = build_config(checkpoint, dtype, vision)
    text = config.text_config
    needs_tokenizer = any(i < text.num_hidden_layers for i in text.engram_layer_ids)
    tokenizer = load_tokenizer(checkpoint) if needs_tokenizer else None
    backend = BackendConfig(
        attn=attn,
        linear="torch",
        rms_norm="torch_fp32",
        rope="torch",
        rope_fusion=False,
        experts="torch",
        dispatcher="torch",
        enable_hf_state_dict_adapter=True,
    )
    torch.manual_seed(0)
    try:
        model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=tokenizer)
    except ValueError as exc:
        raise InputError(f"nemo could not build the model from {checkpoint}/config.json: {exc}") from exc
    load_weights(model, checkpoint)
    model.eval()
    return model


def build_dspark(model, checkpoint: Path, dtype: str):
    """nemo's DSpark backbone with the checkpoint's ``mtp.*`` tensors (through its DSpark state-dict adapter)."""
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import DeepseekV41DSparkStateDictAdapter

    text = model.config.text_config
    if text.num_nextn_predict_layers <= 0:
        raise InputError(f"{checkpoint}/config.json has num_nextn_predict_layers=0: no DSpark stages to run")
    backbone = DeepseekV41DSparkBackbone(text, model.backend)
    hf_state = {}
    for file in checkpoint_files(checkpoint):
        hf_state.update({k: v for k, v in load_file(str(file)).items() if k.startswith("mtp.")})
    adapter = DeepseekV41DSparkStateDictAdapter(text, backbone.moe_config, model.backend,
                                                dtype=DTYPES[dtype])
    try:
        native = adapter.from_hf(hf_state)
    except (ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise InputError(f"nemo's DeepseekV41DSparkStateDictAdapter could not convert mtp.*: {exc}") from exc
    result = backbone.load_state_dict(native, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise InputError(
            "the mtp.* tensors do not match the DSpark stages built from config.json:\n"
            f"  missing: {sorted(result.missing_keys)[:40]}\n  unexpected: {sorted(result.unexpected_keys)[:40]}"
        )
    return backbone.eval()


def run_dspark(model, backbone, tokens, block_ins: dict, anchors, prev) -> dict:
    """One draft block per anchor, as nemo's DSpark training forward builds them (ids, positions, mask)."""
    text = model.config.text_config
    K = text.dspark_block_size
    batch, seq = tokens.shape
    n_anchors = anchors.shape[1]
    if prev.shape != (batch, n_anchors, K):
        raise InputError(f"--dspark-prev: shape {prev.shape}, expected {(batch, n_anchors, K)}")
    feats = torch.cat([block_ins[l].float().mean(dim=2).to(block_ins[l].dtype)
                       for l in text.dspark_target_layer_ids], dim=-1)
    anchors_t = torch.from_numpy(anchors.astype(np.int64))
    tok = torch.from_numpy(tokens)
    ids = torch.full((batch, n_anchors * K), text.dspark_noise_token_id, dtype=torch.long)
    ids[:, ::K] = torch.gather(tok, 1, anchors_t)
    embeds = model.model.embed_tokens(ids)
    keep = torch.ones(batch, n_anchors, dtype=torch.bool)
    out = backbone(
        embeds,
        feats,
        position_ids=backbone.build_position_ids(anchors_t, seq),
        attention_mask=backbone.build_attention_mask(anchors_t, keep, seq, embeds.dtype),
        previous_token_ids=torch.from_numpy(prev.astype(np.int64)).reshape(batch, -1),
    )
    logits = torch.nn.functional.linear(out.normalized_hidden_states.float(), model.lm_head.weight.float())
    logits = logits + out.transition_logits.float()
    return {
        "dspark.target_features": feats.float().numpy(),
        "dspark.logits": logits.reshape(batch, n_anchors, K, -1).numpy(),
        "dspark.confidence": out.confidence_pred.float().reshape(batch, n_anchors, K).numpy(),
    }


# ----------------------------------------------------------------------------------------------------------------
# hooks
# ----------------------------------------------------------------------------------------------------------------


class Recorder:
    """Forward hooks that capture named intermediates (``--dump``) and replace inputs (``--layer-inputs``)."""

    def __init__(self, model, batch: int, seq: int, dump: bool, forced: dict[str, np.ndarray]):
        self.model = model
        self.batch, self.seq = batch, seq
        self.dump = dump
        self.forced = dict(forced)
        self.used: set[str] = set()
        self.out: dict[str, np.ndarray] = {}
        self.handles = []
        self.engram_index = {}
        text = model.config.text_config
        self.text = text
        inner = model.model
        if dump:
            self._hook(inner.embed_tokens, lambda m, a, o: self._put("embed", o))
            self._hook(inner.norm, lambda m, a, o: self._put("final_hidden", o))
            if inner.engram_hash is not None:
                self._hook(inner.engram_hash, self._on_hashes)
        for name, layer in inner.layers.items():
            self._hook_layer(int(name), layer)

    # -- helpers
    def _hook(self, module, fn, pre=False, with_kwargs=False):
        if pre:
            handle = module.register_forward_pre_hook(fn, with_kwargs=with_kwargs)
        else:
            handle = module.register_forward_hook(fn, with_kwargs=with_kwargs)
        self.handles.append(handle)

    def _put(self, name: str, tensor) -> None:
        if tensor is None:
            return
        t = tensor.detach()
        if t.is_floating_point():
            t = t.float()
        array = t.cpu().numpy()
        if name in self.out:
            raise RuntimeError(f"intermediate {name} captured twice (module reused?)")
        self.out[name] = array

    def _tokens_view(self, tensor):
        """[tokens, ...] -> [batch, seq, ...] for MoE-internal tensors."""
        return tensor.reshape(self.batch, self.seq, *tensor.shape[1:])

    def _forced(self, key: str, like):
        value = self.forced.get(key)
        if value is None:
            return None
        if tuple(value.shape) != tuple(like.shape):
            raise InputError(f"--layer-inputs {key}: shape {tuple(value.shape)} != expected {tuple(like.shape)}")
        self.used.add(key)
        return torch.from_numpy(np.ascontiguousarray(value)).to(dtype=like.dtype, device=like.device)

    def _on_hashes(self, module, args, output):
        for index, layer_id in enumerate(self.text.engram_layer_ids):
            if layer_id < self.text.num_hidden_layers:
                self._put(f"engram{layer_id}.hash_ids", output[:, :, index])

    # -- per layer
    def _hook_layer(self, l: int, layer) -> None:
        p = f"layer{l}."
        dump = self.dump
        has_engram = layer.engram is not None

        def block_pre(module, args, kwargs):
            hidden, pre_mix = args[0], args[1]
            raw_key = p + "block_in_raw"
            forced = self._forced(raw_key, hidden)
            if forced is None and not has_engram:
                forced = self._forced(p + "block_in", hidden)
            if forced is not None:
                hidden = forced
            forced_mix = self._forced(p + "pre_mix_in", pre_mix)
            if forced_mix is not None:
                pre_mix = forced_mix
            if dump:
                if has_engram:
                    self._put(raw_key, hidden)
                self._put(p + "pre_mix_in", pre_mix)
            return (hidden, pre_mix, *args[2:]), kwargs

        self._hook(layer, block_pre, pre=True, with_kwargs=True)

        def attn_pre(module, args, kwargs):
            hidden = args[0]
            forced = self._forced(p + "attn_in", hidden)
            if forced is not None:
                hidden = forced
            if dump:
                self._put(p + "attn_in", hidden)
            return (hidden, *args[1:]), kwargs

        self._hook(layer.attn, attn_pre, pre=True, with_kwargs=True)

        def ffn_pre(module, args, kwargs):
            hidden = args[0]
            forced = self._forced(p + "ffn_in", hidden)
            if forced is not None:
                hidden = forced
            if dump:
                self._put(p + "ffn_in", hidden)
            return (hidden, *args[1:]), kwargs

        self._hook(layer.ffn, ffn_pre, pre=True, with_kwargs=True)

        if not dump:
            return
        attn = layer.attn
        if has_engram:

            def engram_post(module, args, output):
                self._put(f"engram{l}.in", args[0])
                self._put(f"engram{l}.out", output)

            self._hook(layer.engram, engram_post)
        self._hook(layer.attn_hc, lambda m, a, o: self._put(p + "block_in", a[0]))
        self._hook(layer.attn_hc, lambda m, a, o: self._put_mix(p + "hc_attn_", o))
        self._hook(layer.ffn_hc, lambda m, a, o: self._put(p + "mid", a[0]))
        self._hook(layer.ffn_hc, lambda m, a, o: self._put_mix(p + "hc_ffn_", o))
        self._hook(attn.q_norm, lambda m, a, o: self._put(p + "q_latent", o))
        self._hook(attn.kv_norm, lambda m, a, o: self._put(p + "kv_normed", o))
        if attn.compressor is not None:
            self._hook(attn.compressor, lambda m, a, o: self._put(p + "compressor_latent", o))
        if attn.indexer is not None:
            self._hook(attn.indexer.weights_proj, lambda m, a, o: self._put(p + "index_weights", o))

        def attn_post(module, args, output):
            self._put(p + "attn_out", output.hidden_states)
            state = output.state
            if module.is_kv_source:
                self._put(p + "compressed_kv", state.compressed_kv)
                self._put(p + "index_keys", state.index_keys)
            if module.is_index_source:
                self._put(p + "topk_idxs", state.topk_indices)
                if module.indexer.is_candidate_source:
                    self._put(p + "candidates", state.candidates)

        self._hook(attn, attn_post)

        gate = layer.ffn.gate

        def gate_pre(module, args):
            x = args[0]
            scores = torch.nn.functional.linear(x.float(), module.weight.float())
            self._put(p + "moe.scores", self._tokens_view(scores))

        def gate_post(module, args, output):
            weights, indices = output[0], output[1]
            self._put(p + "moe.topk_idx", self._tokens_view(indices))
            self._put(p + "moe.topk_weight", self._tokens_view(weights))

        self._hook(gate, gate_pre, pre=True)
        self._hook(gate, gate_post)
        if layer.ffn.shared_experts is not None:
            self._hook(layer.ffn.shared_experts, lambda m, a, o: self._put(p + "moe.shared_out", self._tokens_view(o)))
        self._hook(layer.ffn, lambda m, a, o: self._put(p + "ffn_out", o))

        def block_post(module, args, output):
            self._put(p + "block_out", output[0])
            self._put(p + "pre_mix_out", output[1])

        self._hook(layer, block_post)

    def _put_mix(self, prefix: str, mix) -> None:
        self._put(prefix + "pre", mix.pre)
        self._put(prefix + "post", mix.post)
        self._put(prefix + "comb", mix.comb)

    def check_forced_used(self) -> None:
        unused = sorted(set(self.forced) - self.used)
        if unused:
            raise InputError(f"--layer-inputs keys matched no module input: {unused}")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------


def load_tokens(path: Path, vocab_size: int):
    if not path.is_file():
        raise InputError(f"{path} not found")
    tokens = np.load(path)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[1] == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise InputError(f"{path}: expected integer token ids [batch, seq], got {tokens.dtype} {tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise InputError(f"{path}: token ids must lie in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    return tokens.astype(np.int64)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="release-format checkpoint directory")
    inputs = parser.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--tokens", type=Path, help="int32 .npy [batch, seq]")
    inputs.add_argument("--chat", type=Path, help="JSON message list with image content blocks")
    parser.add_argument("--out", required=True, type=Path, help="output .npz")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--dump", action="store_true", help="also save per-layer intermediates")
    parser.add_argument("--layer-inputs", type=Path, default=None, help="npz of module inputs to force")
    parser.add_argument("--attn", choices=["eager", "sdpa"], default="eager", help="nemo attention backend")
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("DSV41_REF_THREADS", "1")), help="torch intra-op threads"
    )
    parser.add_argument(
        "--act-quant",
        action="store_true",
        help="quantize the input of every FP8/FP4 linear to FP8 per 32, as the official inference code does",
    )
    parser.add_argument(
        "--no-cache-qdq",
        action="store_true",
        help="replace nemo's FP8 SWA / NVFP4 compressed-KV / MXFP4 indexer quantize-dequantize by the identity",
    )
    parser.add_argument("--dspark-anchors", type=Path, default=None, help="int .npy [batch, anchors]: DSpark blocks")
    parser.add_argument("--dspark-prev", type=Path, default=None, help="int .npy [batch, anchors, K]: Markov inputs")
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


def process_chat(model, checkpoint: Path, chat: Path):
    """nemo's processor on a message list -> (the forward's keyword arguments, the arrays to save)."""
    from nemo_automodel.components.models.deepseek_v41.processing import DeepseekV41Processor

    if not chat.is_file():
        raise InputError(f"{chat} not found")
    processor = DeepseekV41Processor(tokenizer=load_tokenizer(checkpoint), config=model.config)
    try:
        batch = processor.apply_chat_template(json.loads(chat.read_text()), tokenize=True, return_dict=True,
                                              return_tensors="pt")
    except (ValueError, TypeError, OSError) as exc:
        raise InputError(f"nemo's processor rejected {chat}: {exc}") from exc
    dtype = model.model.embed_tokens.weight.dtype
    kwargs = {"input_ids": batch["input_ids"], "vision_token_types": batch["vision_token_types"]}
    extra = {"tokens": batch["input_ids"].numpy().astype(np.int32),
             "vision_token_types": batch["vision_token_types"].numpy().astype(np.int32)}
    if "pixel_values" in batch:
        kwargs["pixel_values"] = batch["pixel_values"].to(dtype)
        kwargs["image_grid_hws"] = batch["image_grid_hws"]
        with torch.no_grad():
            embedded = model.model._image_embeddings(kwargs["input_ids"], kwargs["pixel_values"],
                                                     kwargs["image_grid_hws"], kwargs["vision_token_types"])
        extra["pixel_values"] = batch["pixel_values"].float().numpy()
        extra["image_grid_hws"] = batch["image_grid_hws"].numpy()
        extra["image_embeds"] = embedded[kwargs["vision_token_types"] >= 0].float().numpy()
    return kwargs, extra


def run(args) -> None:
    start = time.perf_counter()
    torch.set_num_threads(max(1, args.threads))
    if args.no_cache_qdq:
        disable_cache_qdq()
    if torch.distributed.is_available() and torch.distributed.is_initialized():  # pragma: no cover
        raise InputError("torch.distributed must not be initialized (nemo's Engram would shard its tables)")
    model = build_model(args.checkpoint, args.dtype, args.attn, vision=args.chat is not None)
    if args.act_quant:
        enable_act_quant(model)
    built = time.perf_counter()
    images, extra = {}, {}
    if args.chat is not None:
        images, extra = process_chat(model, args.checkpoint, args.chat)
        tokens = images["input_ids"].numpy()
    else:
        tokens = load_tokens(args.tokens, model.config.text_config.vocab_size)
    forced = {}
    if args.layer_inputs is not None:
        if not args.layer_inputs.is_file():
            raise InputError(f"{args.layer_inputs} not found")
        with np.load(args.layer_inputs) as data:
            forced = {key: data[key] for key in data.files}
    recorder = Recorder(model, tokens.shape[0], tokens.shape[1], args.dump, forced)
    if (args.dspark_anchors is None) != (args.dspark_prev is None):
        raise InputError("--dspark-anchors and --dspark-prev go together")
    block_ins, backbone = {}, None
    if args.dspark_anchors is not None:
        backbone = build_dspark(model, args.checkpoint, args.dtype)
        for l in model.config.text_config.dspark_target_layer_ids:
            layer = model.model.layers[str(l)]
            recorder._hook(layer.attn_hc, lambda m, a, o, l=l: block_ins.__setitem__(l, a[0].detach()))
    with torch.no_grad():
        output = model(**images) if images else model(input_ids=torch.from_numpy(tokens))
        results = {"logits": output.logits.float().numpy(), **extra}
        if backbone is not None:
            anchors, prev = np.load(args.dspark_anchors), np.load(args.dspark_prev)
            if anchors.ndim != 2 or anchors.shape[0] != tokens.shape[0] or not (
                    (0 <= anchors) & (anchors < tokens.shape[1])).all():
                raise InputError(f"--dspark-anchors: expected positions [batch, anchors] < {tokens.shape[1]}")
            results.update(run_dspark(model, backbone, tokens, block_ins, anchors, prev))
    recorder.check_forced_used()
    recorder.remove()
    if args.dump and "tokens" not in results:
        results["tokens"] = tokens.astype(np.int32)
        results.update(recorder.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".partial.npz")
    np.savez(tmp, **results)
    os.replace(tmp, args.out)
    if not args.quiet:
        done = time.perf_counter()
        print(
            f"nemo_runner: {tokens.shape[0]}x{tokens.shape[1]} tokens, {args.dtype}, {len(results)} arrays; "
            f"build+load {built - start:.1f}s, forward {done - built:.1f}s",
            file=sys.stderr,
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except InputError as exc:
        print(f"nemo_runner: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
