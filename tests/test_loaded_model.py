"""A loaded checkpoint carries its own tokenizer's Engram classes: the README's lines run on a release-format
checkpoint whose tokenizer is not the built-in one, and hash as the engine does."""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest
import tokenizers

from dsv41 import checkpoint as ckpt
from dsv41 import model, ngram_hash
from dsv41 import tokenizer as T
from dsv41.config import ConfigError, preset
from dsv41.params import init_params


def _own_tokenizer(out_dir, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` ids, the built-in special names at 0-2 and words paired by case
    ('w7' / 'W7' share an Engram class), so its class count and class order both differ from the built-in's."""
    vocab = {T.BOS_TOKEN: 0, T.EOS_TOKEN: 1, T.PAD_TOKEN: 2}
    for i in range(3, vocab_size):
        vocab[f"{'w' if i % 2 else 'W'}{vocab_size - i // 2}"] = i
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=T.PAD_TOKEN))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    name = "tokenizer_config.json"
    shutil.copyfile(os.path.join(T.BUILTIN_DIR, name), os.path.join(out_dir, name))


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(path, cfg, written params, the tokenizer's token map): the tiny model sized to its own tokenizer."""
    tok_dir = tmp_path_factory.mktemp("tok")
    tiny = preset("tiny")
    _own_tokenizer(tok_dir, tiny.vocab_size)
    token_map, n_classes = T.build_compressed_token_map(T.load_tokenizer(tok_dir))
    assert n_classes != tiny.engram_compressed_vocab_size  # a different tokenizer indeed
    cfg = dataclasses.replace(tiny, engram_compressed_vocab_size=n_classes)
    params = init_params(cfg, seed=3)
    path = ckpt.save_checkpoint(params, cfg, tmp_path_factory.mktemp("release") / "ck", tokenizer_dir=tok_dir,
                                n_shards=2)
    return path, cfg, params, token_map


def test_readme_lines_on_a_checkpoint_with_its_own_tokenizer(release, tmp_path):
    path, cfg_written, params, token_map = release
    token_ids = np.random.default_rng(0).integers(0, cfg_written.vocab_size, (2, 24)).astype(np.int32)
    with pytest.raises(ConfigError, match="carry no 'engram_token_map'"):  # the tree as written: built-in classes
        model.forward(params, cfg_written, token_ids)

    # the README's lines, verbatim
    from dsv41 import load_checkpoint, forward
    cfg, params = load_checkpoint(path)
    logits = forward(params, cfg, token_ids)

    assert cfg == cfg_written
    np.testing.assert_array_equal(params[model.TOKEN_MAP_KEY], token_map)
    explicit = ngram_hash.NgramHasher(cfg, token_map)
    with_explicit = model.forward(params, cfg, token_ids, hasher=explicit)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(with_explicit))
    # one hasher per loaded map, the one the engine takes (Engine.from_checkpoint passes hasher_for(params))
    assert model.hasher_for(params, cfg) is model.hasher_for(params, cfg)
    np.testing.assert_array_equal(model.hasher_for(params, cfg).hash_ids(token_ids), explicit.hash_ids(token_ids))

    # `dsv41 convert` (save_orbax) keeps the map; an orbax copy without it derives it from the tokenizer there
    orbax = ckpt.save_orbax(params, cfg, tmp_path / "orbax")
    ocfg, restored = load_checkpoint(orbax)
    np.testing.assert_array_equal(restored[model.TOKEN_MAP_KEY], token_map)
    np.testing.assert_array_equal(np.asarray(forward(restored, ocfg, token_ids)), np.asarray(logits))
    os.remove(os.path.join(orbax, "engram", ckpt._TOKEN_MAP_FILE))
    assert model.TOKEN_MAP_KEY not in load_checkpoint(orbax)[1]
    shutil.copyfile(os.path.join(path, "tokenizer.json"), os.path.join(orbax, "tokenizer.json"))
    np.testing.assert_array_equal(load_checkpoint(orbax)[1][model.TOKEN_MAP_KEY], token_map)


def test_checkpoint_engine_programs_are_the_abstract_engines(release):
    """An engine loaded from a checkpoint keys each program in the program store as `Engine.abstract` over its config
    does: the programs compile workers store while the weights load are the ones the loaded engine runs."""
    from serving.engine import executables
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine

    path, cfg, _, _ = release
    config = EngineConfig(max_num_seqs=2, max_model_len=128)

    def keys(eng):
        out = []
        for shape in eng.program_shapes():
            fn, (params, pool, *args), static = eng._padding_call(*shape)
            out.append(executables.key(fn.name, *fn._args(params, pool, tuple(args), static), fn.compiler_options))
        return out

    loaded = Engine.from_checkpoint(path, config=config)
    assert keys(loaded) == keys(Engine.abstract(ckpt.read_config(path), config, checkpoint=path))


def test_engine_from_checkpoint_hashes_with_the_loaded_map(release):
    """The engine built from the checkpoint hashes prompts with the checkpoint tokenizer's classes (its programs
    read the rows `eng.hasher` gives: tests/test_engine.py checks those against the full forward)."""
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine

    path, cfg, _, token_map = release
    eng = Engine.from_checkpoint(path, config=EngineConfig(max_num_seqs=1, max_model_len=64))
    np.testing.assert_array_equal(eng.hasher.token_map, token_map)
    ids = np.random.default_rng(1).integers(3, cfg.vocab_size, (1, 20)).astype(np.int32)
    np.testing.assert_array_equal(eng.hasher.hash_ids(ids), ngram_hash.NgramHasher(cfg, token_map).hash_ids(ids))
