"""Shared serving fixtures. Every server listens on 127.0.0.1 on a free port and stops at the end of its scope.

- `fake_server`: the HTTP stack over FakeEngine (scripted replies, fault injection, millisecond steps): the fast
  protocol tests.
- `tiny_server`: the HTTP stack over the real `Engine.from_preset("tiny")`, shared by the whole session so its
  programs compile once; its shapes are kept few (one prefill width, one block-table width, max_num_seqs 2)
  because every new prefill length bucket / batch bucket / context-page bucket costs a CPU compile of several
  seconds, and the tests that use it are one xdist group (one worker). The persistent JAX compilation cache
  makes later runs faster.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # fake_engine

from fake_engine import FakeEngine  # noqa: E402
from serving_helpers import MODEL  # noqa: E402

from serving.api import BackgroundServer  # noqa: E402

REPLIES = {
    "SAY_TOOL": 'Let me check.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
                '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
                '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
                '</｜DSML｜ invoke>\n</｜DSML｜ calls>',
    "SAY_THINK": "I should greet them.</think>Hello there!",
    "SAY_STOP": "alpha beta STOP gamma delta",
    "SAY_SPECIAL": "one<｜User｜>two<｜begin▁of▁sentence｜>three",
}

# one prefill width (the 128-token chunk), one block-table width (all 16 pages of 1024 tokens) and one decode
# width (2 rows; one sequence pads to it): every request shape reuses the same few compiled programs (a CPU
# compile of one is ~10 s; a padded tiny step is not)
TINY_ENGINE_KW = dict(max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=128, min_prefill_bucket=128,
                      min_decode_bucket=2)


@pytest.fixture(scope="session")
def fake_server():
    with BackgroundServer(FakeEngine(replies=REPLIES, max_model_len=1024), model_name=MODEL) as srv:
        yield srv


@pytest.fixture(scope="session")
def tiny_server():
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine  # the root conftest turned on the persistent compilation cache

    with BackgroundServer(Engine.from_preset("tiny", config=EngineConfig(**TINY_ENGINE_KW)), model_name=MODEL) as srv:
        yield srv
