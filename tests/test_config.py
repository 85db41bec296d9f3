import json

import pytest

from dsv41.config import AttnRole, ConfigError, ModelConfig, engram_primes, preset


def test_flash_values_and_roles():
    c = preset("flash")
    assert (c.dim, c.n_layers, c.n_heads, c.head_dim, c.n_routed_experts) == (5120, 40, 64, 512, 384)
    assert c.role(0) is AttnRole.SWA and c.role(2) is AttnRole.FULL and c.role(3) is AttnRole.REUSE
    assert c.role(20) is AttnRole.FULL and c.role(24) is AttnRole.REINDEX and c.role(25) is AttnRole.REUSE
    assert c.kv_source_of(23) == 20 and c.index_source_of(27) == 24 and c.split_layer == 20
    assert c.uses_candidates(24) and not c.uses_candidates(20) and not c.uses_candidates(14)
    rows = [sum(p for per_n in layer for p in per_n) for layer in engram_primes(c)]
    assert rows == [384006168, 384016682] and engram_primes(c)[0][0][0] == 16000057


def test_tiny_has_every_layer_kind():
    c = preset("tiny")
    roles = [c.role(i) for i in range(c.n_layers)]
    assert set(roles) == set(AttnRole)
    assert 2 in c.compress_ratios and 1 in c.compress_ratios and len(c.engram_layer_ids) == 2
    assert any(c.uses_candidates(i) for i in range(c.n_layers))


def test_tiny40_has_flash_schedule_at_tiny_widths():
    t40, flash, tiny = preset("tiny40"), preset("flash"), preset("tiny")
    assert t40.n_layers == flash.n_layers == 40
    for i in range(40):
        assert t40.role(i) is flash.role(i), i
        assert t40.compress_ratios[i] == flash.compress_ratios[i], i
        assert (i in t40.engram_layer_ids) == (i in flash.engram_layer_ids), i
        assert t40.uses_candidates(i) == flash.uses_candidates(i), i
        if flash.compress_ratios[i]:
            assert t40.kv_source_of(i) == flash.kv_source_of(i), i
            assert t40.index_source_of(i) == flash.index_source_of(i), i
    assert t40.candidate_source_layer == t40.split_layer == flash.split_layer == 20
    assert (t40.dim, t40.n_heads, t40.head_dim, t40.window_size) == (tiny.dim, tiny.n_heads, tiny.head_dim,
                                                                     tiny.window_size)
    assert t40.engram_num_embeddings == tiny.engram_num_embeddings


def test_nested_and_flat_forms_round_trip():
    c = preset("flash")
    d = c.to_hf_dict()
    assert d["text_config"]["compress_ratios"][40:] == [0, 0, 0]  # the release lists the 3 DSpark layers too
    assert d["text_config"]["num_nextn_predict_layers"] == c.n_mtp_layers == 3
    assert ModelConfig.from_dict(d) == c
    flat = {k: (list(v) if isinstance(v, tuple) else v) for k, v in c.__dict__.items()}
    assert ModelConfig.from_dict(flat) == c


def test_from_json_reports_the_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_json(p)


@pytest.mark.parametrize("change, field", [
    (dict(compress_ratios=(0,) * 39), "compress_ratios"),
    (dict(n_activated_experts=500), "n_activated_experts"),
    (dict(o_groups=7), "o_groups"),
    (dict(kv_source_layers=(2, 8, 14)), "kv_source_layers"),  # layers 20+ (ratio 1) lose their source
    (dict(candidate_topk_blocks=10), "candidate_topk_blocks"),
    (dict(engram_num_embeddings=(100, 100)), "engram_num_embeddings"),
    (dict(score_func="softmax"), "score_func"),
    (dict(dim=5000), "dim"),
    (dict(n_heads="64"), "n_heads"),
    (dict(dspark_target_layer_ids=(38, 39, 40)), "dspark_target_layer_ids"),
    (dict(dspark_num_experts_per_tok=200), "dspark_num_experts_per_tok"),
])
def test_bad_fields_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        preset("flash").replace(**change)


def test_missing_layers_field():
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ModelConfig.from_dict({"text_config": {"hidden_size": 5120}})
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("huge")
    json.dumps(preset("tiny").to_hf_dict())
