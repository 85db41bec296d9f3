from __future__ import annotations

import argparse

import pytest

from serving.cli_serve import add_bench_args, add_serve_args, bench_config, engine_kwargs, run_bench, served_model_name


def _serve(argv):
    return add_serve_args(argparse.ArgumentParser()).parse_args(argv)


def test_serve_flags_map_to_engine_kwargs():
    args = _serve(["--preset", "tiny", "--port", "9001", "--max-model-len", "2048", "--max-num-seqs", "4",
                   "--max-num-batched-tokens", "256", "--no-swa-bounded-replay", "--no-enable-prefix-caching"])
    assert (args.host, args.port) == ("127.0.0.1", 9001)
    assert engine_kwargs(args) == {"max_model_len": 2048, "max_num_seqs": 4, "max_num_batched_tokens": 256,
                                   "swa_bounded_replay": False, "enable_prefix_caching": False}
    assert engine_kwargs(_serve([])) == {}
    assert served_model_name(args) == "tiny"
    assert served_model_name(_serve(["--checkpoint", "/ckpt/flash/"])) == "flash"
    assert (_serve([]).engram_tables, _serve(["--engram-tables", "mmap"]).engram_tables) == ("ram", "mmap")
    assert engine_kwargs(_serve(["--engram-transfer", "overlap"])) == {"engram_transfer": "overlap"}


def test_serve_flag_errors_name_the_flag():
    with pytest.raises(SystemExit, match="--attention-backend: not supported"):
        engine_kwargs(_serve(["--attention-backend", "pallas"]), accepted={"max_model_len"})
    with pytest.raises(SystemExit, match="--max-num-seqs 0"):
        engine_kwargs(_serve(["--max-num-seqs", "0"]))
    with pytest.raises(SystemExit):  # argparse: --checkpoint and --preset exclude each other
        _serve(["--checkpoint", "x", "--preset", "tiny"])


def test_bench_flags(fake_server, tmp_path):
    parser = add_bench_args(argparse.ArgumentParser())
    args = parser.parse_args(["--base-url", fake_server.base_url, "--max-concurrency", "1,2", "--num-sessions", "2",
                              "--num-turns", "2", "--think-time", "0", "--shared-prefix-len", "20", "--input-len", "5",
                              "--turn-input-len", "3", "--output-len", "2", "--metric-percentiles", "50,95",
                              "--num-warmups", "1"])
    cfg = bench_config(args)
    assert cfg.max_concurrency == (1, 2) and cfg.percentiles == (50.0, 95.0) and cfg.ignore_eos
    assert cfg.num_warmups == 1
    assert run_bench(args) == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-concurrency", "0"])
    dead = parser.parse_args(["--port", "1", "--num-turns", "1", "--max-concurrency", "1", "--request-timeout", "5"])
    assert run_bench(dead) == 1  # nothing listens there: a clear log line, exit 1
