"""Regenerates `dsv41/assets/tokenizer.json` (+ `tokenizer_config.json`): the built-in tokenizer of the `tiny` preset.

A byte-level BPE with exactly 1024 ids, shaped like the DeepSeek-V4.1 tokenizer at toy size: ids 0/1/2 are BOS /
EOS / pad inside the BPE table (as in the release); the chat specials the V4.1 encoder uses (TOP_TOKENS) sit at the
top of the id range in the release's relative order; the pre-tokenizer is DeepSeek's (digits in runs of <= 3, a
CJK+kana branch, punctuation-then-letters, ...). The corpus is embedded below (English prose, code, a little
multilingual and chat-format text), so the output depends only on this file and the `tokenizers` version. Run:

    .venv/bin/python dsv41/assets/make_tokenizer.py          # writes the assets
    .venv/bin/python dsv41/assets/make_tokenizer.py --check  # exits 1 if the assets are stale
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

log = logging.getLogger("make_tokenizer")

ASSET_DIR = pathlib.Path(__file__).resolve().parent
VOCAB_SIZE = 1024

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
# (content, special): `special` tokens are dropped by decode(skip_special_tokens=True). <think>, </think> and
# ｜DSML｜ stay visible so that reasoning / tool-call parsing also works on text decoded that way.
TOP_TOKENS = (("<｜System｜>", True), ("<｜User｜>", True), ("<｜Assistant｜>", True), ("<think>", False),
              ("</think>", False), ("｜DSML｜", False), ("<｜latest_reminder｜>", True), ("<｜deepseek_image｜>", True))

# DeepSeek-V3/V4 pre-tokenizer: three isolating regex splits, then byte-level mapping without its own regex.
_DEEPSEEK_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

ENGLISH = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Inference engines turn a trained model into something people can use. They load the weights, schedule requests,
keep a cache of keys and values for every sequence, and sample one token after another until the answer is done.
Most of the time is spent moving memory, not doing arithmetic, so a good engine reads each weight as few times as
possible and keeps the accelerator busy with large batches.

When you write a test, ask what bug it would catch. A test that passes whether or not the code is right protects
nothing. Compare against a slow, obviously correct reference; check the shapes, the dtypes and the edge cases:
empty inputs, a single element, the longest sequence, and values at the boundary of each range.

The weather was cold and clear. She walked along the river, past the old mill and the bridge, and stopped to watch
the boats. Children were playing in the park; their voices carried across the water. By the time she reached the
station the sun had set and the lights of the city were coming on one by one.

History is full of small decisions with large consequences. The printing press, the steam engine and the
transistor each began as a modest improvement to an existing tool. Nobody could predict how far they would go.
Scientists measure, compare and revise. They publish their methods so that others can repeat the experiment and
check the result. If the numbers do not agree, someone has made a mistake, and finding it is part of the work.

Question: What is the capital of France? Answer: Paris. Question: How many days are in a leap year? Answer: 366.
Question: What is 17 times 19? Answer: 323. Question: Which planet is closest to the Sun? Answer: Mercury.
Please summarize the following article in three sentences. Explain your reasoning step by step, then give the
final answer. Let me think about this carefully. First, we need to understand the problem. Second, we consider
the possible approaches. Finally, we choose the simplest one that works and verify it with an example.

Thank you for your message. I have reviewed the document and I agree with most of the proposed changes. However,
I think the second section needs more detail about the timeline and the budget. Could we meet on Monday at 10:30
to discuss it? Best regards, and have a great weekend.

In 2024 the team trained a model with 671 billion parameters on 14.8 trillion tokens. The next version used a
mixture of experts with 384 routed experts and one shared expert, activating six experts for each token.
Attention used a sliding window of 128 positions plus a compressed global memory, so that a context of one
million tokens fits in the cache. Prices rose by 3.5% in March, 2.1% in April and 0.8% in May.

Users often ask short questions, but sometimes they paste long documents, logs or code and ask for a review.
A helpful assistant reads carefully, answers the question that was asked, says when it is unsure, and does not
invent facts. When a tool is available, the assistant may call it and wait for the result before answering.
"""

CODE = '''\
import json
import logging
import numpy as np

log = logging.getLogger(__name__)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax along `axis`."""
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


class Cache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: dict[str, list[int]] = {}

    def get(self, key: str) -> list[int] | None:
        return self.items.get(key)

    def put(self, key: str, value: list[int]) -> None:
        if len(self.items) >= self.capacity:
            oldest = next(iter(self.items))
            del self.items[oldest]
        self.items[key] = value


def load_config(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if "vocab_size" not in config:
        raise ValueError(f"{path}: missing vocab_size")
    return config


for i in range(10):
    if i % 2 == 0:
        print(f"even {i}")
    else:
        print(f"odd {i}")

def main() -> int:
    parser = argparse.ArgumentParser(description="Run the model on a prompt.")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    log.info("batch_size=%d max_tokens=%d", args.batch_size, args.max_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#include <stdio.h>
int main(void) {
    for (int i = 0; i < 16; ++i) {
        printf("%d\\n", i * i);
    }
    return 0;
}

fn add(a: i64, b: i64) -> i64 { a + b }

const total = items.filter((x) => x.price > 0).map((x) => x.price * x.count).reduce((a, b) => a + b, 0);

SELECT name, COUNT(*) AS n FROM users WHERE created_at > '2024-01-01' GROUP BY name ORDER BY n DESC LIMIT 10;

$ git status && git diff --stat
$ python -m pytest -q tests/test_model.py::test_forward
$ ls -la /usr/local/bin | grep python3
$ export CUDA_VISIBLE_DEVICES=0,1
$ pip install numpy==2.1.0 jax[cuda12]

{"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 128,
 "temperature": 0.6, "top_p": 0.95, "stream": true, "tools": [{"type": "function", "function": {"name":
 "get_weather", "description": "Get the current weather in a city", "parameters": {"type": "object",
 "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
 "required": ["city"]}}}]}
'''

MULTILINGUAL = """\
Le chat dort sur le canapé. Où est la bibliothèque ? Nous étudions les réseaux de neurones à l'université.
Der schnelle braune Fuchs springt über den faulen Hund. Übung macht den Meister. Wir müssen die Größe prüfen.
El niño comió una manzana. ¿Dónde está la estación? La canción es muy bonita y el café está caliente.
Быстрая коричневая лиса прыгает через ленивую собаку. Спасибо за помощь.
今天天气很好，我们去公园散步吧。人工智能正在改变世界。模型的参数量很大。
こんにちは、世界。日本語のテキストも少し入れておきます。ありがとうございます。
안녕하세요. 만나서 반갑습니다.
Ελληνικά: καλημέρα κόσμε. العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया।
naïve façade résumé coöperate piñata Ångström Zürich São Paulo Kraków Dvořák
"""

CHAT = """\
<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough \
the reasoning)

You are a helpful assistant.<｜User｜>What is 2 + 2?<｜Assistant｜><think>The user asks a simple sum. 2 + 2 = 4.\
</think>2 + 2 = 4.<｜end▁of▁sentence｜><｜User｜>And the weather in Paris?<｜Assistant｜></think>

<｜DSML｜ calls>
<｜DSML｜ invoke name="get_weather">
<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
</｜DSML｜ invoke>
</｜DSML｜ calls><｜end▁of▁sentence｜><｜User｜><tool_result>{"temperature": 18, "sky": "cloudy"}</tool_result>\
<｜Assistant｜></think>It is 18 degrees and cloudy in Paris.<｜end▁of▁sentence｜>
## Tools

You have access to a set of tools to help answer the user's question. String parameters should be specified as is
and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format.
"""


def corpus() -> list[str]:
    """The training texts, in a fixed order; weights bias merges towards English and code."""
    texts = []
    for weight, block in ((3, ENGLISH), (3, CODE), (2, MULTILINGUAL), (2, CHAT)):
        lines = [ln for ln in block.splitlines(keepends=True) if ln.strip()]
        texts.extend(lines * weight)
    # numbers, dates and identifiers of every digit-run length, generated rather than typed
    texts.extend(f"step {i:05d} loss {1.0 / (i + 1):.4f} lr {3e-4 * (i % 7 + 1):.1e}\n" for i in range(0, 400, 7))
    texts.extend(f"layers.{i}.attn.wq_b.weight layers.{i}.ffn.experts.{i * 3}.w1.scale\n" for i in range(40))
    return texts


def build() -> Tokenizer:
    """Trains the built-in tokenizer; deterministic for a given `tokenizers` version."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in _DEEPSEEK_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    bpe_size = VOCAB_SIZE - len(TOP_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, min_frequency=0, show_progress=False,
                                  special_tokens=[BOS, EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != bpe_size:
        raise RuntimeError(f"BPE training produced {got} ids, wanted {bpe_size}: too small a corpus for the merges")
    for content, special in TOP_TOKENS:  # one at a time so the ids follow TOP_TOKENS order
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    _check(tok)
    return tok


def _check(tok: Tokenizer) -> None:
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, wanted {VOCAB_SIZE}")
    top = VOCAB_SIZE - len(TOP_TOKENS)
    for want, content in [*enumerate((BOS, EOS, PAD)), *((top + i, c) for i, (c, _) in enumerate(TOP_TOKENS))]:
        if tok.token_to_id(content) != want:
            raise RuntimeError(f"{content} has id {tok.token_to_id(content)}, wanted {want}")


def config_json() -> dict:
    """HF-style tokenizer_config.json, so that `transformers.AutoTokenizer` can also load the asset folder."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
            "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "model_max_length": 8192}


def serialized() -> dict[str, str]:
    tok = build()
    return {
        "tokenizer.json": json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1) + "\n",
        "tokenizer_config.json": json.dumps(config_json(), ensure_ascii=False, indent=2) + "\n",
    }


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the assets on disk instead of writing them")
    ap.add_argument("--out", type=pathlib.Path, default=ASSET_DIR)
    args = ap.parse_args(argv)
    files = serialized()
    if args.check:
        stale = [name for name, text in files.items()
                 if not (args.out / name).exists() or (args.out / name).read_text(encoding="utf-8") != text]
        for name in stale:
            log.error("%s is stale: rerun dsv41/assets/make_tokenizer.py", args.out / name)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text, encoding="utf-8")
        log.info("wrote %s (%d bytes)", args.out / name, len(text.encode("utf-8")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
