"""dsv41.dspark against nemo-automodel's DSpark backbone (`deepseek_v41/dspark.py`, run in .venv-ref).

Both sides read the same release-format checkpoint of the tiny preset (written by our writer, dense float32, its
three `mtp.*` stages included) and run in float32 without the cache quantization. Each row of the batch drafts a
block at three anchors: near the start (a context shorter than the window), past the window (its context clipped
to the last 128 positions) and at the last position. The Markov inputs handed to the reference are the anchor
and our own greedy drafts, so the reference's logits must also pick those drafts: the sequential draft is checked
too.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv41 import checkpoint, dspark, model, quant
from dsv41 import params as P
from dsv41.config import preset
from dsv41.tokenizer import BUILTIN_DIR
from tests.reference.driver import reference_available, rel, run_reference

pytestmark = [
    pytest.mark.reference,
    pytest.mark.skipif(not reference_available(), reason="reference env missing: bash scripts/setup_reference_env.sh"),
    pytest.mark.xdist_group("reference"),
]

SEQ = 160
ANCHORS = np.array([[4, 140, SEQ - 1], [37, 131, SEQ - 1]])
# float32 on both sides through the target model and three stages; observed: features, logits and confidence
# 0.6e-6 .. 1.3e-6 relative. The bound is the main model's (tests/test_reference_equivalence.py).
F32_REL = 2e-5


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    import jax
    import jax.numpy as jnp

    cfg = preset("tiny")
    params = P.init_params(cfg, seed=5)
    ck = tmp_path_factory.mktemp("dspark_ckpt")
    checkpoint.save_checkpoint(params, cfg, ck, dense_dtype="float32", tokenizer_dir=BUILTIN_DIR, n_shards=1)
    pf = P.dequantize_params(params, "float32")
    num = quant.EXACT_F32
    ids = np.random.default_rng(11).integers(3, cfg.vocab_size, (2, SEQ)).astype(np.int32)

    B, A = ANCHORS.shape
    rows = np.repeat(np.arange(B), A)  # one block per (row, anchor)

    @jax.jit  # one compile: op by op, the three stages compiled ~340 small programs (17.6 s in a CI run)
    def draft(pf, block_ins, ids):
        feats = dspark.target_features(block_ins)
        pos = jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), (B, SEQ))
        kv = dspark.context_kv(pf, dspark.project_context(pf, feats, cfg, num), pos, cfg, num)
        anchor_ids = ids[rows, ANCHORS.reshape(-1)]
        states = dspark.draft_states(pf, [k[rows] for k in kv], pos[rows], anchor_ids,
                                     jnp.asarray(ANCHORS.reshape(-1)), cfg, num)
        drafts, logits, conf = dspark.draft_tokens(pf, states, anchor_ids, cfg, num)
        prev = jnp.concatenate([anchor_ids[:, None], drafts[:, :-1]], axis=1)
        return feats, drafts, logits, conf, prev, *dspark.draft_logits(pf, states, prev, cfg, num)

    _, trace = model.forward_with_trace(pf, cfg, ids, num)
    block_ins = [trace[f"layer{l}.block_in"] for l in cfg.dspark_target_layer_ids]
    feats, drafts, logits, conf, prev, forced_logits, forced_conf = jax.device_get(
        draft(model.strip_tables(pf)[0], block_ins, jnp.asarray(ids)))
    K = cfg.dspark_block_size
    ours = {
        "drafts": np.asarray(drafts).reshape(B, A, K),
        "logits": np.asarray(logits).reshape(B, A, K, -1),
        "confidence": np.asarray(conf).reshape(B, A, K),
        "forced_logits": np.asarray(forced_logits).reshape(B, A, K, -1),
        "forced_confidence": np.asarray(forced_conf).reshape(B, A, K),
        "target_features": np.asarray(feats),
    }
    ref = run_reference(ck, ids, "float32", cache_qdq=False, dspark_anchors=ANCHORS,
                        dspark_prev=prev.reshape(B, A, K))
    return cfg, ours, ref


def test_target_features(both):
    _, ours, ref = both
    assert rel(ours["target_features"], ref["dspark.target_features"]) < F32_REL


def test_draft_logits_and_confidence(both):
    _, ours, ref = both
    assert ours["forced_logits"].shape == ref["dspark.logits"].shape
    for a in range(ANCHORS.shape[1]):
        assert rel(ours["forced_logits"][:, a], ref["dspark.logits"][:, a]) < F32_REL, a
        assert rel(ours["forced_confidence"][:, a], ref["dspark.confidence"][:, a]) < F32_REL, a


def test_sequential_greedy_drafts(both):
    """Each drafted token is the reference's argmax given the tokens drafted before it (the Markov bias reads the
    previous draft); the sequential logits are the teacher-forced ones."""
    _, ours, ref = both
    np.testing.assert_allclose(ours["logits"], ours["forced_logits"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours["confidence"], ours["forced_confidence"], rtol=1e-6, atol=1e-6)
    top2 = -np.sort(-ref["dspark.logits"], axis=-1)[..., :2]
    # no near-tie that the two sides' float32 differences (~1e-6 relative) could flip
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-5 * np.abs(top2[..., 0]).max()
    np.testing.assert_array_equal(ours["drafts"], ref["dspark.logits"].argmax(-1))
