"""Built-in tokenizer asset, the wrapper, the streaming detokenizer and the Engram compressed-token map."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import unicodedata

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from dsv41 import tokenizer as T

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "dsv41" / "assets" / "make_tokenizer.py"

TEXTS = [
    "",
    " ",
    "Hello, world!",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\r\n",
    "1234567890 12 345 6789",
    "def f(x):\n    return x ** 2  # square\n",
    "naïve café Zürich Ångström",
    "今天天气很好，こんにちは、세계 Привет",
    "emoji 😀👍🏽 and symbols ∑∫ ≠ ≤",
    "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>ok<｜end▁of▁sentence｜>",
]


def _load_script():
    spec = importlib.util.spec_from_file_location("make_tokenizer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- the asset -----------------------------------------------------------------------------------


def test_builtin_layout():
    tok = T.load_tokenizer()
    assert tok.vocab_size == len(tok) == 1024
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.id_to_token(0) == T.BOS_TOKEN and tok.id_to_token(1) == T.EOS_TOKEN and tok.id_to_token(2) == T.PAD_TOKEN
    top = ["<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜",
           "<｜latest_reminder｜>", "<｜deepseek_image｜>"]
    assert [tok.token_to_id(t) for t in top] == list(range(1016, 1024))
    # tags the chat parser reads must survive decode(skip_special_tokens=True); role markers must not
    assert tok.special_ids == {0, 1, 2, 1016, 1017, 1018, 1022, 1023}
    assert tok.token_to_id("<think>") not in tok.special_ids


def test_asset_regenerates_exactly():
    """The committed asset is what the script builds (deterministic training, nothing edited by hand)."""
    files = _load_script().serialized()
    for name, text in files.items():
        assert (T.BUILTIN_DIR / name).read_text(encoding="utf-8") == text, f"{name} is stale"
    assert len((T.BUILTIN_DIR / "tokenizer.json").read_bytes()) < 300_000


def test_pretokenizer_is_deepseeks():
    spec = json.loads((T.BUILTIN_DIR / "tokenizer.json").read_text(encoding="utf-8"))["pre_tokenizer"]
    kinds = [p["type"] for p in spec["pretokenizers"]]
    assert kinds == ["Split", "Split", "Split", "ByteLevel"]
    assert spec["pretokenizers"][0]["pattern"]["Regex"] == r"\p{N}{1,3}"
    assert spec["pretokenizers"][3]["use_regex"] is False


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(text):
    tok = T.load_tokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 1024 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True) == [0, *ids]


def test_specials_are_single_ids_and_digits_split():
    tok = T.load_tokenizer()
    ids = tok.encode("<｜begin▁of▁sentence｜><｜User｜>x<｜Assistant｜><think>")
    assert ids[:2] == [0, 1017] and ids[-2:] == [1018, 1019]
    # digit runs are cut into pieces of at most 3 before BPE
    pieces = [tok.decode([i]) for i in tok.encode("1234567")]
    assert "".join(pieces) == "1234567" and all(len(p) <= 3 for p in pieces)
    assert tok.decode(tok.encode("a<｜User｜>b"), skip_special_tokens=True) == "ab"


def test_load_paths(tmp_path):
    a = T.load_tokenizer(T.BUILTIN_DIR)
    b = T.load_tokenizer(T.BUILTIN_DIR / "tokenizer.json")
    assert a.encode(TEXTS[7]) == b.encode(TEXTS[7]) == T.load_tokenizer().encode(TEXTS[7])
    with pytest.raises(T.TokenizerError, match="no tokenizer.json"):
        T.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(T.TokenizerError, match="not a readable"):
        T.load_tokenizer(tmp_path)


def test_load_without_pad_token_falls_back(tmp_path):
    """A tokenizer without `<｜▁pad▁｜>` takes pad from tokenizer_config.json (DeepSeek names EOS there)."""
    tok = _byte_level_tokenizer(["a", "b", "<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": "</s>"}), encoding="utf-8")
    t = T.load_tokenizer(tmp_path)
    assert (t.bos_id, t.eos_id, t.pad_id) == (2, 3, 3)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(T.TokenizerError, match="BOS/EOS"):
        T.load_tokenizer(tmp_path)


# ---- streaming detokenizer -------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_matches_decode(text):
    tok = T.load_tokenizer()
    ids = tok.encode(text)
    sd = tok.decode_stream()
    pieces = [sd.feed(i) for i in ids]
    pieces.append(sd.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_holds_partial_characters():
    tok = T.load_tokenizer()
    ids = tok.encode("😀")
    # byte-level BPE at this size cannot hold the 4-byte emoji in one token: the test needs the split case
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])
    sd = tok.decode_stream()
    assert sd.feed(ids[0]) == ""
    assert sd.feed(ids[1:]) == "😀"
    sd = tok.decode_stream()
    sd.feed(ids[0])
    assert "\ufffd" in sd.flush()  # at the end, what is left comes out as replacement characters


def test_stream_decoder_skip_special():
    tok = T.load_tokenizer()
    ids = tok.encode("<｜Assistant｜>hé<｜end▁of▁sentence｜>")
    sd = tok.decode_stream(skip_special_tokens=True)
    assert "".join(sd.feed(i) for i in ids) + sd.flush() == "hé"


# ---- Engram compressed-token map -------------------------------------------------------------------


def _byte_level_tokenizer(texts: list[str]) -> tokenizers.Tokenizer:
    """A byte-level BPE whose id i decodes to texts[i] (no merges needed to decode)."""
    b2u = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    vocab: dict[str, int] = {}
    for t in texts:
        vocab.setdefault("".join(b2u[b] for b in t.encode("utf-8")) if not t.startswith("#") else t[1:], len(vocab))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def test_compressed_map_collapses_variants():
    words = ["The", "the", " the", "THE", "\tthe\n", "thé", "ＴＨＥ",  # 0-6: one class
             " ", "  ", "\n", " \t\r\n",  # 7-10: whitespace-only tokens keep a lone space
             "cafe", "Café", "CAFÉ",  # 11-13
             "\u0301",  # 14: normalizes to nothing -> keyed by its own text
             "#Ã",  # 15: the lone byte 0xC3 (byte-level char "Ã"): decodes to U+FFFD -> keyed by raw token
             "Ã",  # 16: the real character, which normalizes to "a"
             "a", "dog", " dog"]
    tok = _byte_level_tokenizer(words)
    assert tok.decode([15]) == "\ufffd"
    m, n = T.build_compressed_token_map(tok)
    assert m.dtype == np.int64 and m.shape == (len(words),)
    assert set(m[0:7]) == {0}
    assert set(m[7:11]) == {1}
    assert m[11] == m[12] == m[13] == 2
    assert m[14] == 3 and m[15] == 4  # distinct classes of their own
    assert m[16] == m[17] == 5  # "Ã" and "a"
    assert m[18] == m[19] == 6
    assert n == 7


def test_compressed_map_accepts_wrapper_and_backend():
    tok = T.load_tokenizer()
    a, na = T.build_compressed_token_map(tok)
    b, nb = T.build_compressed_token_map(tok.backend)
    assert na == nb and np.array_equal(a, b)
    with pytest.raises(TypeError, match="tokenizers.Tokenizer"):
        T.build_compressed_token_map(object())


def _reference_key(tok, i: int) -> str:
    """Spec §2.6 step 1 written with Python's unicodedata, independent of `tokenizers.normalizers`."""
    text = tok.decode([i], skip_special_tokens=False)
    if "\ufffd" in text:
        return "raw:" + tok.id_to_token(i)
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if unicodedata.category(c) != "Mn").lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    s = s if s == " " else s.strip()
    return s or text


def test_builtin_map_matches_independent_reference():
    tok = T.load_tokenizer()
    m, n = T.builtin_compressed_token_map()
    keys = [_reference_key(tok.backend, i) for i in range(tok.vocab_size)]
    first: dict[str, int] = {}
    want = np.array([first.setdefault(k, len(first)) for k in keys])
    assert np.array_equal(m, want)
    assert n == len(first) == T.builtin_compressed_vocab_size() == int(m.max()) + 1
    assert n < tok.vocab_size  # case/space variants exist in the built-in vocab


def test_tiny_preset_uses_builtin_size():
    from dsv41.config import preset

    cfg = preset("tiny")
    assert cfg.vocab_size == 1024
    assert cfg.engram_compressed_vocab_size == T.builtin_compressed_vocab_size()
