"""Async scheduling against the synchronous engine (same tokens and logits, bit for bit; one read of the device a
step), and the mixed step's budget (a prompt's chunk leaves room for the step's decode rows)."""

import jax
import numpy as np
import pytest
import tiny_engine

from serving.engine.engine import SamplingParams

pytestmark = pytest.mark.xdist_group(tiny_engine.GROUP)


class Sealed:
    """A program's sampled tokens or logits, which the engine may read only through `jax.device_get`."""

    def __init__(self, a):
        self.a = a

    def _read(self, *_, **__):
        raise AssertionError("the engine read a program's output outside its one jax.device_get a step")

    __array__ = __int__ = __index__ = __getitem__ = __iter__ = __len__ = __bool__ = _read

    def copy_to_host_async(self):  # starts the copy; reading it is the device_get's
        self.a.copy_to_host_async()

    def __getattr__(self, name):
        self._read()


class Watched:
    """The engine's programs with their sampled outputs sealed; records the prompt tokens of each prefill chunk."""

    def __init__(self, programs):
        self.programs, self.chunks = programs, []

    def __getattr__(self, name):
        return getattr(self.programs, name)

    def run_full(self, *a, **kw):
        pool, logits, tok = self.programs.run_full(*a, **kw)
        return pool, Sealed(logits), Sealed(tok)

    def run_decoder(self, *a, **kw):
        pool, logits, tok = self.programs.run_decoder(*a, **kw)
        return pool, Sealed(logits), Sealed(tok)

    def sample(self, logits, samp, **kw):  # a program's logits into another program: on the device, no read
        return Sealed(self.programs.sample(logits.a, samp, **kw))

    def run_encoder(self, params, pool, b, **kw):
        self.chunks.append(int(np.max(b.n_valid)))
        return self.programs.run_encoder(params, pool, b, **kw)


@pytest.fixture
def reads(monkeypatch):
    """Counts jax.device_get calls (per step: the test appends a counter before each step) and unseals."""
    counts, real = [0], jax.device_get

    def device_get(tree):
        counts[-1] += 1
        return real(jax.tree_util.tree_map(lambda x: x.a if isinstance(x, Sealed) else x, tree))

    monkeypatch.setattr(jax, "device_get", device_get)
    return counts


prompt = tiny_engine.prompt


# greedy and seeded rows, a two-chunk prompt, stop ids that end a request early, one that ends at its first token,
# and one aborted mid-stream; two slots, so later requests wait for earlier ones to finish
REQUESTS = {
    "a": (prompt(30, 1), SamplingParams(max_tokens=6, ignore_eos=True)),
    "b": (prompt(140, 2), SamplingParams(max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)),
    "c": (prompt(60, 3), SamplingParams(max_tokens=8, stop_token_ids=tuple(range(0, 129280, 2)))),
    "d": (prompt(90, 4), SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)),
    "e": (prompt(20, 5), SamplingParams(max_tokens=1)),
}


def serve(eng, reads=None):
    """Runs REQUESTS; aborts 'd' once 2 of its tokens came back. -> ({id: tokens}, {id: finish reason},
    {id: logits}, [(in flight before the step, device_get calls in it)])."""
    for rid, (ids, s) in REQUESTS.items():
        eng.add_request(rid, ids, s)
    toks = {rid: [] for rid in REQUESTS}
    reasons, per_step = {}, []
    while eng.has_work():
        if reads is not None:
            reads.append(0)
        busy = bool(eng._in_flight)
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        if reads is not None:
            per_step.append((busy, reads[-1]))
        if len(toks["d"]) == 2 and "d" not in reasons:
            eng.abort("d")
            reasons["d"] = "abort"
    logits = {rid: np.stack(v) for rid, v in eng.finished_logits.items()}
    return toks, reasons, logits, per_step


def test_async_scheduling_equals_synchronous(reads):
    want_t, want_r, want_l, _ = serve(tiny_engine.make(async_scheduling=False))
    assert want_r["c"] == "stop" and len(want_t["c"]) < 8 and want_r["e"] == "length" and len(want_t["d"]) == 2
    eng = tiny_engine.make(async_scheduling=True)
    eng.programs = Watched(eng.programs)
    got_t, got_r, got_l, per_step = serve(eng, reads)
    assert got_t == want_t and got_r == want_r
    assert sorted(got_l) == sorted(want_l) and all(np.array_equal(got_l[k], want_l[k]) for k in want_l)
    # one read of the device a step, none before anything ran; steps without a program in flight read nothing
    assert per_step[0] == (False, 0) and all(n == int(busy) for busy, n in per_step), per_step
    assert eng.stats()["running"] == 0 and not eng.has_work()


def test_prefill_chunk_leaves_room_for_decode_rows(reads):
    """A 176-token prompt arriving while a request decodes: chunks of 96 (128 tokens less the decode row, in
    multiples of the smallest bucket, 32), so the step's tokens stay within max_num_batched_tokens; its first
    token's logits match those of 128-token chunks. (Every chunk pads to the same 128-token program.)"""
    eng = tiny_engine.make(min_prefill_bucket=32)
    eng.programs = Watched(eng.programs)
    long = prompt(176, 6)
    eng.add_request("talk", prompt(70, 7), SamplingParams(max_tokens=16, ignore_eos=True))
    eng.step()
    eng.add_request("long", long, SamplingParams(max_tokens=1))
    while eng.has_work():
        eng.step()
    assert eng.programs.chunks == [70, 96, 80]
    alone = tiny_engine.make()
    alone.add_request("long", long, SamplingParams(max_tokens=1))
    while alone.has_work():
        alone.step()
    assert np.abs(eng.finished_logits["long"][0] - alone.finished_logits["long"][0]).max() < 1e-4


def test_prompt_preempted_before_its_first_token_is_read():
    """A prompt finishes its prefill in the step whose decode row needs the last free page: the decode preempts it
    while its first token is still in flight (async). It recomputes from prompt + that token, as the synchronous
    engine's preempted request does: same tokens and logits."""
    runs = []
    for overlap in (False, True):
        eng = tiny_engine.make(async_scheduling=overlap)  # 5 pages of 64 tokens
        eng.add_request("a", prompt(127, 8), SamplingParams(max_tokens=3, ignore_eos=True))  # 2 pages, then a 3rd
        toks = {"a": [o.new_token_ids[0] for o in eng.step()], "b": []}
        eng.add_request("b", prompt(190, 9), SamplingParams(max_tokens=2, ignore_eos=True))  # 3 pages
        while eng.has_work():
            for o in eng.step():
                toks[o.request_id] += o.new_token_ids
        assert eng.counters["preemptions"] == 1
        runs.append((toks, {k: np.stack(v) for k, v in eng.finished_logits.items()}))
    (want, want_l), (got, got_l) = runs
    assert got == want and all(np.array_equal(got_l[k], want_l[k]) for k in want_l)
