"""Speculative decoding with the release's DSpark drafter, the engine's side: setup and checks, and the decode step
that verifies each row's drafts and drafts the next block (`programs._spec` runs both in one program; where
the decode step is split, a GPU's default (`EngineConfig.splits_decode`), `run_decode_first` then
`programs._spec_rest`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41.config import ModelConfig
from serving.engine import programs, spec_sampling
from serving.engine.config import EngineConfig
from serving.engine.errors import EngineError
from serving.engine.scheduler import StepOutput, _Request


@functools.partial(jax.jit, static_argnames="threshold")
def verify_lengths(conf: jax.Array, threshold: float | None) -> jax.Array:
    """The drafts each row verifies next step: conf [B, k] (the drafter's confidence logits) -> int32 [B]: the
    positions whose cumulative confidence prod_{j <= i} sigmoid(conf_j) is >= threshold (all k: None). On the
    device: a fed step (`programs.SpecFeed`) takes it from the step before without a read.

    The head is trained (nemo-automodel's DSpark loss) on each position's acceptance rate given the prefix
    before it (1 - TV(p_i, q_i), binary cross-entropy), so the product is the estimated chance that drafts 1 .. i
    are all accepted, which is what verifying draft i can gain; a per-position test would go on verifying
    behind a draft likely to be rejected. Position i's value reads the drafts before it, never d_i itself, which
    keeps the cut exact (`spec_sampling`)."""
    B, k = conf.shape
    if threshold is None:
        return jnp.full(B, k, jnp.int32)
    # log-space: the sum of log-sigmoids never rounds up to log 1 = 0 (threshold 1 verifies nothing)
    log_cum = jnp.cumsum(-jnp.logaddexp(0.0, -conf.astype(jnp.float32)), axis=1)
    return jnp.sum(log_cum >= np.float32(np.log(threshold)), axis=1).astype(jnp.int32)


class Speculative:
    """The engine's speculative decoding (a mixin of `Engine`; `spec` None: off)."""

    def _init_speculative(self, cfg: ModelConfig, config: EngineConfig) -> None:
        self.spec = config.speculative_config
        self.spec_tokens = self.spec.num_speculative_tokens if self.spec else 0
        if self.spec is not None:
            self._check_speculative(cfg, self.params, config)
        # a prefill under speculative decoding also seeds the DSpark rings
        self.prefill_static = self.static if self.spec is None else {**self.static, "dspark_seed": True}
        # tokens a decode row runs: 1, or the anchor and k drafts, and with ratio-2 layers one more (a speculative
        # chunk starts at an even position: `programs._spec`)
        self.spec_rerun = any(r > 1 for r in cfg.compress_ratios)
        self.decode_tokens = 1 if self.spec is None else self.spec_tokens + 1 + int(self.spec_rerun)
        self.step_advance = self.spec_tokens + 1  # the most tokens a decode step adds to a row
        # how often the draft at each block position was accepted (vLLM's per-position count), and how many
        # blocks verified each number of drafts 0 .. k (all k without confidence_threshold)
        self.spec_accepted_per_pos = [0] * self.spec_tokens
        self.spec_verified_per_len = [0] * (self.spec_tokens + 1)

    @staticmethod
    def _check_speculative(cfg: ModelConfig, params: dict, config: EngineConfig) -> None:
        k = config.speculative_config.num_speculative_tokens
        if cfg.n_mtp_layers == 0 or "mtp" not in params:
            raise EngineError("speculative decoding with DSpark needs the model's DSpark stages (mtp.*), and this "
                              "config has n_mtp_layers=0; use a checkpoint or preset with them, or leave "
                              "--speculative-config out")
        if k > cfg.dspark_block_size:
            raise EngineError(f"num_speculative_tokens={k} exceeds DSpark's block of {cfg.dspark_block_size}; "
                              f"give at most {cfg.dspark_block_size}")
        if config.swa_bounded_replay and min(cfg.dspark_target_layer_ids) < cfg.split_layer:
            raise EngineError(f"DSpark reads layers {cfg.dspark_target_layer_ids}, and under SWA bounded replay "
                              f"layers before {cfg.split_layer} never see a prompt's last tokens in one program; "
                              "use --no-swa-bounded-replay with this model")

    def _verify_len(self, r: _Request) -> int:
        """The drafts r's next step verifies: all k, or with confidence_threshold the ones `verify_lengths` kept
        (none after a prefill: no drafter confidence yet). 0 with speculation off."""
        if self.spec is None or self.spec.confidence_threshold is None:
            return self.spec_tokens
        return min(len(r.drafts), self.spec_tokens)

    def _decode_speculative(self, reqs: list[_Request]) -> list[StepOutput]:
        """One speculative step (`programs._spec`): each row verifies its drafts (`_verify_len`) and takes the
        accepted ones and the target's next token; the pool already holds the next block's drafts' context. Pages
        cover the verified drafts' positions (`Engine._decode` holds them); what rejected drafts wrote there is
        overwritten by the tokens that take those positions. With device_feed the step is dispatched before the
        host reads the one in flight: a row continuing it takes its chunk from that step's outputs on the device
        (`programs.SpecFeed`), and its tokens are read by the next engine step (-> [])."""
        k, fed = self.spec_tokens, self.device_feed
        rows = self._decode_rows(reqs)
        toks, pos0 = {}, {}
        n_verify = np.zeros(len(rows), np.int32)
        if fed:
            index, history = self._feed_arrays(len(rows))
            first_index, first_col = np.full(len(rows), -1, np.int32), np.zeros(len(rows), np.int32)
        for i, r in enumerate(rows):
            if r is None:
                continue
            if fed and r.in_flight and r.drafts_drawn:  # continues the speculative step in flight
                a = r.num_tokens - 1  # that step's anchor
                toks[r.id], pos0[r.id], index[i], n_verify[i] = [r.last_token], a, r.fed_row, -1
                if self.hasher is not None:
                    history[i] = self._history_before(r, a)[0]
                continue
            # the anchor: the newest token, whose KV is not in the pool yet (fed: a prefill's first token, unread)
            a = r.num_tokens - 1 + r.in_flight
            # a chunk starts at an even position (`programs._spec`): an odd anchor re-runs the token before it
            back = 1 if self.spec_rerun and a % 2 else 0
            n_verify[i] = self._verify_len(r)
            drafts = (r.drafts + [self.cfg.dspark_noise_token_id] * k)[:n_verify[i]]
            anchor = [0] if r.in_flight else r.token_range(a, a + 1)
            toks[r.id], pos0[r.id] = r.token_range(a - back, a) + anchor + drafts, a - back
            if not fed:
                r.history = self._history_before(r, a - back)
                continue
            if r.in_flight:
                first_index[i], first_col[i] = r.fed_row, back
            if self.hasher is not None:
                history[i] = self._history_before(r, a - back)[0]
        b = self._batch(rows, toks, pos0, self.decode_tokens, engram=not fed)
        if fed:
            b = dataclasses.replace(b, feed=programs.SpecFeed(*self._spec_prev, self._first, index, first_index,
                                                              first_col, history, rerun=self.spec_rerun))
        samp = self._sampling(rows)
        # a row's drafts came from the drafter's last step (whose states the pool holds), or not (after a prefill)
        has_q = np.asarray([r is not None and r.drafts_drawn for r in rows])
        args = (samp, has_q, np.full(len(rows), self.spec.forced_acceptance), np.maximum(n_verify, 0))
        static = self.spec_static(self._greedy_program(samp, b.tokens.shape))
        if len(self.decode_kinds) == 2:  # cut at the split layer (`EngineConfig.split_decode`)
            self.pool, h, pre = self.programs.run_decode_first(self.params, self.pool, b, **self.static)
            self.pool, logits, out, acc, nxt, conf = self.programs.run_spec_rest(
                self.params, self.pool, programs.rest_batch(b, self.cfg), h, pre, *args, **static)
        else:
            self.pool, logits, out, acc, nxt, conf = self.programs.run_spec(self.params, self.pool, b, *args,
                                                                            **static)
        spec = (out, acc, nxt, self._next_verify(conf))
        self.counters["decode_steps"] += 1
        if fed:
            self._dispatched_spec(rows, spec, logits, n_verify)
            return []
        return self._accept_spec(rows, jax.device_get(spec), logits, n_verify)

    def _greedy_program(self, samp: programs.Sampling, shape: tuple[int, int]) -> bool:
        """Whether a step of these sampling rows and batch shape [B, T] runs the all-greedy program
        (`SpeculativeConfig.greedy_program`): every row greedy, and the program usable (a staged warm-up may still
        be compiling it: until then the sampling program serves)."""
        if self.greedy_kind is None or spec_sampling.row_branches(samp)[0].any():
            return False
        u = self.usable_shapes
        return u is None or (self.greedy_kind, *shape, self.max_pages_per_seq) in u

    def _next_verify(self, conf: jax.Array) -> jax.Array | np.ndarray:
        """The drafts each row's next step verifies, from its drafter's confidences conf [B, k]: `verify_lengths` on
        the device with a confidence threshold, else all k, a host constant (the confidences never leave the
        device, and no program runs for them)."""
        thr = self.spec.confidence_threshold
        if thr is None:
            return np.full(conf.shape[0], self.spec_tokens, np.int32)
        return verify_lengths(conf, thr)

    def _accept_spec(self, rows: list, spec: tuple, logits, n_verify: np.ndarray,
                     preempted: frozenset = frozenset()) -> list[StepOutput]:
        """A speculative step's outputs read (spec: out, accepted, next drafts, how many of them the next step
        verifies; host arrays), each row's tokens accepted. rows: the step's (None: nothing to take; the rows
        numbered in `preempted` take their tokens as a preempted request's). n_verify: the drafts each row verified
        (-1: those `_verify_len` gives now, a fed row that continued the step before)."""
        out, acc, nxt, n_next = spec
        outs = []
        for i, r in enumerate(rows):
            if r is None:
                continue
            n_ver = self._verify_len(r) if n_verify[i] < 0 else int(n_verify[i])
            a = r.num_tokens - 1
            new: list[int] = []
            for j in range(int(acc[i]) + 1):
                if self.keep_logits:
                    r.logits.append(np.asarray(logits[i, j]))
                if i in preempted:
                    o = self._accept_preempted(r, int(out[i, j]))[0]
                else:
                    r.computed = a + j + 1  # the pool holds the anchor and the j drafts accepted before this token
                    o = self._accept(r, int(out[i, j]))[0]
                new.append(int(out[i, j]))
                if o.finished:
                    break
            r.drafts, r.drafts_drawn = nxt[i, :n_next[i]].tolist(), True
            self.counters["spec_drafts"] += 1
            self.counters["spec_draft_tokens"] += n_ver
            self.spec_verified_per_len[n_ver] += 1
            self.counters["spec_accepted_tokens"] += len(new) - 1
            for j in range(len(new) - 1):
                self.spec_accepted_per_pos[j] += 1
            outs.append(dataclasses.replace(o, new_token_ids=new))
        return outs
