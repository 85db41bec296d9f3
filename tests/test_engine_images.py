"""Images through the engine and the server: the engine's prefill (image rows placed at the span, bias_vl inside
it, no Engram there) against the exact full-sequence model, prefix-cache keys that follow the image bytes, and a
chat request with a data: URL image through the HTTP server, with its limits.

The tiny engine of the engine tests (`tiny_engine`, one xdist group): the image steps compile their own variants
of the encoder and decoder programs once, shared by every test here."""

import base64
import http.client
import json

import jax.numpy as jnp
import numpy as np
import pytest
import tiny_engine

from dsv41 import chat, model
from dsv41 import image_processing as ip
from dsv41 import tokenizer as T
from serving.engine.engine import EngineError, SamplingParams
from serving.engine.images import PromptImage, chunk_rows
from tests.image_helpers import generated_image
from tiny_engine import NUM

pytestmark = pytest.mark.xdist_group(tiny_engine.GROUP)

TOL_FORWARD = 1e-3  # as tests/test_engine.py: FP8 KV bins may flip between the engine's and the forward's sums
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def image_prompt(cfg, images: list[bytes], text: str = "describe these", text_first: bool = True):
    pics = [{"type": "image_url", "image_url": {"url": "x"}} for _ in images]
    parts = [{"type": "text", "text": text}] + pics if text_first else pics + [{"type": "text", "text": text}]
    ids = T.load_tokenizer().encode_segments(chat.encode_chat_segments([{"role": "user", "content": parts}]))
    prepared = [ip.preprocess(ip.decode(d), cfg.vision) for d in images]
    ids, spans = ip.expand_spans(ids, [p.grid for p in prepared], cfg.image_token_id)
    return [int(t) for t in ids], [PromptImage.of(s, d, p, cfg.vision) for (s, _), d, p in zip(spans, images, prepared)]


def run(eng, ids, images, sampling=ONE):
    rid = f"r{len(eng.finished_logits)}"
    eng.add_request(rid, ids, sampling, images=images)
    toks = []
    while eng.has_work():
        for o in eng.step():
            toks += o.new_token_ids if o.request_id == rid else []
    return toks, np.stack(eng.finished_logits[rid])


@pytest.fixture(scope="module")
def engine():
    """Bounded replay and the prefix cache, as served (prompts below swa_replay_tokens replay exactly)."""
    return tiny_engine.make(swa_bounded_replay=True, enable_prefix_caching=True)


def forward(ids, images, toks):
    cfg, params = tiny_engine.tiny()
    places = [model.ImagePlacement(0, x.start, x.inputs) for x in images]
    return np.asarray(model.forward(params, cfg, np.asarray([ids + toks[:-1]]), NUM, images=places))[0, len(ids) - 1:]


def test_chunks_take_their_slice_of_each_span():
    """Two images, the second one's span across the first prefill chunk's end (128 tokens): each chunk's rows
    are the spans' rows at its positions (the gather the prefill programs read), nothing elsewhere."""
    cfg, _ = tiny_engine.tiny()
    ids, images = image_prompt(cfg, [generated_image(seed=3), generated_image(72, 40, seed=4)], "x " * 88)
    assert images[1].start < 128 < images[1].end
    S, D = cfg.vision.max_image_tokens, 8
    span = {id(x): np.random.default_rng(k).standard_normal((S, D)).astype(np.float32)
            for k, x in enumerate(images)}
    want = np.zeros((len(ids), D), np.float32)
    for x in images:
        want[x.start:x.end] = span[id(x)][: x.end - x.start]
    for pos0 in (0, 128):  # row 1 of the batch; row 0 is padding
        n = min(128, len(ids) - pos0)
        rows, mask = chunk_rows([None, (pos0, n, tuple(images))], lambda x: jnp.asarray(span[id(x)]), 2, 128,
                                jnp.float32)
        np.testing.assert_array_equal(np.asarray(rows)[1, :n], want[pos0:pos0 + n])
        np.testing.assert_array_equal(mask[1, :n], want[pos0:pos0 + n].any(-1))
        assert not mask[0].any() and not mask[1, n:].any()


def test_replayed_prefill_with_an_image_equals_forward(engine):
    """The encoder places the rows, the replayed decoder routes the span's rows with bias_vl (a prompt within
    swa_replay_tokens replays exactly); then a token decodes after them."""
    cfg, _ = tiny_engine.tiny()
    ids, images = image_prompt(cfg, [generated_image(72, 40, seed=8)], "z " * 30)
    assert len(ids) <= engine.replay_tokens
    toks, logits = run(engine, ids, images, SamplingParams(max_tokens=2, ignore_eos=True))
    assert np.abs(logits - forward(ids, images, toks)).max() < TOL_FORWARD
    assert engine.stats()["images_encoded"] == 1


def test_prefix_cache_keys_follow_the_image_bytes(engine):
    cfg, _ = tiny_engine.tiny()
    a, b = generated_image(seed=5), generated_image(seed=6)
    ids_a, im_a = image_prompt(cfg, [a], "y " * 60, text_first=False)
    ids_b, im_b = image_prompt(cfg, [b], "y " * 60, text_first=False)
    assert ids_a == ids_b and im_a[0].end < 64 < len(ids_a)  # the same ids, the span in the first page
    hits = lambda: engine.stats()["prefix_cache_hit_tokens"]  # noqa: E731
    run(engine, ids_a, im_a)
    before = hits()
    run(engine, ids_b, im_b)
    assert hits() == before  # the other image: its page does not hit
    run(engine, ids_a, [PromptImage.of(im_a[0].start, a, ip.preprocess(ip.decode(a), cfg.vision), cfg.vision)])
    assert hits() - before == 64  # the same image again (bytes, not objects): its page hits


def test_bad_image_spans_are_refused(engine):
    cfg, _ = tiny_engine.tiny()
    ids, images = image_prompt(cfg, [generated_image()])
    with pytest.raises(EngineError, match="image token"):
        engine.add_request("bad", ids[:-20], ONE, images=images)  # the span runs past the prompt
    with pytest.raises(EngineError, match="image token"):
        engine.add_request("bad", [5] * len(ids), ONE, images=images)


# ---- through the server ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(engine):
    from serving.api import BackgroundServer, MediaConfig

    media = MediaConfig(max_image_bytes=8192, max_images=2)
    with BackgroundServer(engine, model_name="tiny", media=media) as srv:
        yield srv


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def chat_body(*urls: str) -> dict:
    parts = [{"type": "text", "text": "what is this"}] + [{"type": "image_url", "image_url": {"url": u}}
                                                          for u in urls]
    return {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 2,
            "temperature": 0}


def post(server, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_chat_with_an_image_through_the_server(server):
    cfg, _ = tiny_engine.tiny()
    data = generated_image(seed=7)
    code, body = post(server, chat_body(data_url(data)))
    assert code == 200, body
    ids, _ = image_prompt(cfg, [data], "what is this")
    assert body["usage"]["prompt_tokens"] == len(ids)  # the span, expanded
    for fmt in ("JPEG", "WEBP"):
        code, body = post(server, chat_body(data_url(_encoded(data, fmt), fmt.lower())))
        assert code == 200, body


def _encoded(png: bytes, fmt: str) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.open(io.BytesIO(png)).save(out, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return out.getvalue()


@pytest.mark.parametrize("urls, needle", [
    ([data_url(b"not an image")], "cannot decode"),
    (["data:image/png;base64,!!!"], "base64"),
    ([data_url(generated_image(400, 300, seed=1))], "--max-image-bytes"),
    ([data_url(generated_image())] * 3, "--max-images-per-request"),
    (["https://example.com/cat.png"], "--allowed-media-domains"),
    (["file:///etc/passwd"], "data:"),
])
def test_image_refusals_name_the_limit(server, urls, needle):
    code, body = post(server, chat_body(*urls))
    assert code == 400, body
    assert needle in body["error"]["message"], body
