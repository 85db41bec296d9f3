"""Image input against the PyTorch reference (nemo-automodel 0.7.0 `deepseek_v41`, run in .venv-ref).

One reference run (module fixture) on the tiny preset's checkpoint (our writer, dense float32): nemo's processor
renders a chat with a generated 40x28 image (its 10x7 patch grid has ragged edges for the 3x3 merge), its tower
embeds the span and its model gives the logits. We compare the preprocessing (patches, grid, span layout, the
prompt's ids), the span embeddings (tower + aligner + delimiters) and the logits (bias_vl routing and the Engram
skip inside the span), all in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv41 import chat, checkpoint, model, quant, vision
from dsv41 import image_processing as ip
from dsv41 import params as P
from dsv41 import tokenizer as T
from dsv41.config import ModelConfig, VisionConfig, preset
from tests.image_helpers import generated_image
from tests.reference.driver import reference_available, rel, run_reference

# float32 on both sides, as tests/test_reference_equivalence.py
F32_REL = 2e-5


def messages(image: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is in this picture"}, image]}]


def our_prompt(cfg: ModelConfig, data: bytes) -> tuple[np.ndarray, list[model.ImagePlacement], ip.PreparedImage]:
    msgs = messages({"type": "image_url", "image_url": {"url": "data:,"}})
    ids = T.load_tokenizer().encode_segments(chat.encode_chat_segments(msgs))
    prepared = ip.preprocess(ip.decode(data), cfg.vision)
    ids, spans = ip.expand_spans(ids, [prepared.grid], cfg.image_token_id)
    places = [model.ImagePlacement(0, start, ip.vision_inputs(prepared, cfg.vision)) for start, _ in spans]
    return ids[None], places, prepared


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not reference_available():
        pytest.skip("reference env missing: bash scripts/setup_reference_env.sh")
    cfg = preset("tiny")
    params = P.init_params(cfg, seed=5)
    ck = tmp_path_factory.mktemp("vision_ckpt")
    checkpoint.save_checkpoint(params, cfg, ck, dense_dtype="float32", tokenizer_dir=T.BUILTIN_DIR, n_shards=1)
    data = generated_image()
    path = ck / "image.png"
    path.write_bytes(data)
    ref = run_reference(ck, None, "float32", chat=messages({"type": "image", "path": str(path)}), cache_qdq=False)
    return cfg, P.dequantize_params(params, "float32"), data, ref


# one worker runs the module fixture (the PyTorch reference)
pytestmark = pytest.mark.xdist_group("reference")


@pytest.mark.reference
def test_preprocessing_matches_the_reference_processor(setup):
    cfg, _, data, ref = setup
    ids, places, prepared = our_prompt(cfg, data)
    g = prepared.grid
    assert (g.vit_h, g.vit_w) == (7, 10) and (g.llm_h, g.llm_w) == (3, 4)
    assert ref["image_grid_hws"].tolist() == [[g.vit_h, g.vit_w]]
    np.testing.assert_array_equal(prepared.patches, ref["pixel_values"].reshape(g.n_patches, -1))
    np.testing.assert_array_equal(ids, ref["tokens"])
    start, n = places[0].start, g.span_len
    types = np.full(ids.shape[1], -1)
    types[start:start + n] = g.token_types()
    np.testing.assert_array_equal(types, ref["vision_token_types"][0])


@pytest.mark.reference
def test_span_embeddings_match_the_reference(setup):
    cfg, pf, data, ref = setup
    _, places, _ = our_prompt(cfg, data)
    ours = np.asarray(vision.image_span(pf, places[0].inputs, cfg, quant.EXACT_F32))
    assert ours.shape == ref["image_embeds"].shape
    assert rel(ours, ref["image_embeds"]) < F32_REL


@pytest.mark.reference
def test_logits_with_an_image_match_the_reference(setup):
    cfg, pf, data, ref = setup
    ids, places, _ = our_prompt(cfg, data)
    logits = np.asarray(model.forward(pf, cfg, ids, quant.EXACT_F32, images=places))
    assert rel(logits, ref["logits"]) < F32_REL


@pytest.mark.reference
def test_bias_vl_routes_inside_spans_only(setup):
    """Swapping bias for bias_vl moves logits after the span start only where the routing reads them."""
    cfg, pf, data, _ = setup
    ids, places, _ = our_prompt(cfg, data)
    start, n = places[0].start, places[0].inputs.span_len
    base = np.asarray(model.forward(pf, cfg, ids, quant.EXACT_F32, images=places))
    swapped = {**pf, "layers": [{**lp, "ffn": {**lp["ffn"], "gate": {**lp["ffn"]["gate"],
                                                                      "bias_vl": -lp["ffn"]["gate"]["bias_vl"]}}}
                                for lp in pf["layers"]]}
    moved = np.asarray(model.forward(swapped, cfg, ids, quant.EXACT_F32, images=places))
    np.testing.assert_array_equal(moved[:, :start], base[:, :start])
    assert rel(moved[:, start:start + n], base[:, start:start + n]) > 1e-3


def test_padding_bucket_does_not_change_the_span():
    """The same image in a larger bucket (more padding patches, masked out) gives the same rows."""
    cfg = preset("tiny")
    pf = P.init_params(cfg, seed=1, dtype="float32")
    inputs = ip.vision_inputs(ip.preprocess(ip.decode(generated_image(seed=2)), cfg.vision), cfg.vision)
    n = inputs.patches.shape[0]
    pad = n + 64
    bigger = ip.VisionInputs(
        np.concatenate([inputs.patches, np.ones((64, inputs.patches.shape[1]), np.float32)]),
        np.concatenate([inputs.pos, np.full((64, 2), 3, np.int32)]),
        np.concatenate([inputs.valid, np.zeros(64, bool)]),
        np.where(inputs.merge == n, pad, inputs.merge), inputs.types, inputs.span_len)
    a = np.asarray(vision.image_span(pf, inputs, cfg, quant.EXACT_F32))
    b = np.asarray(vision.image_span(pf, bigger, cfg, quant.EXACT_F32))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# (width, height) -> (vit_h, vit_w) as the reference's _plan_image_grid gives them for this config (checked
# in .venv-ref): as is; scaled up to min_pixels; shrunk to the token budget (one row, one column, both)
@pytest.mark.parametrize("size, grid", [((40, 28), (7, 10)), ((1, 1), (6, 6)), ((10, 400), (93, 3)),
                                        ((90, 3000), (93, 3)), ((3000, 90), (3, 100)), ((1000, 999), (20, 21))])
def test_plan_grid_keeps_the_span_in_budget(size, grid):
    v = VisionConfig(n_layers=1, dim=64, n_heads=2, inter_dim=64, patch_size=4, max_image_tokens=64, min_pixels=576)
    g, canvas = ip.plan_grid(*size, v)
    assert g.span_len <= v.max_image_tokens
    assert canvas == (g.vit_w * 4, g.vit_h * 4)
    assert (g.vit_h, g.vit_w) == grid


def test_vision_config_reads_both_release_forms():
    v = preset("flash").vision
    assert ModelConfig.from_dict(preset("flash").to_hf_dict()).vision == v
    flat = {"n_layers": 2, "compress_ratios": [0, 0], "kv_source_layers": [], "index_source_layers": [],
            "candidate_source_layer": -1, "n_mtp_layers": 0, "engram_layer_ids": [], "engram_num_embeddings": [],
            "vision_n_layers": 32, "vision_dim": 1024, "vision_max_n_token": 1024, "vision_min_pixels": 295936}
    assert ModelConfig.from_dict(flat).vision == v
    assert ModelConfig.from_dict({**preset("flash").to_hf_dict(), "vision_config": None}).vision is None
