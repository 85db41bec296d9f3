"""scripts/timing.py: the engine benches' shared flags."""

import timing


def test_engine_args_give_the_model_to_time():
    """--schedule puts another preset's layers at --preset's widths, --experts shrinks the routed experts, and
    --scan-layers / --no-scan-layers / neither reach EngineConfig.scan_layers as True / False / None."""
    ap = timing.engine_args("doc", batches="1")
    args = ap.parse_args(["--preset", "tiny", "--schedule", "flash", "--experts", "4", "--no-scan-layers"])
    cfg, tiny = timing.model_config(args), timing.preset("tiny")
    assert (cfg.n_layers, cfg.dim, cfg.n_routed_experts) == (timing.preset("flash").n_layers, tiny.dim, 4)
    assert args.scan_layers is False
    plain = ap.parse_args(["--preset", "tiny"])
    assert timing.model_config(plain) == tiny and plain.scan_layers is None
    assert ap.parse_args(["--scan-layers"]).scan_layers is True
