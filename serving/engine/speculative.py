"""Speculative decoding with the release's DSpark drafter, the engine's side: setup and checks, and the decode step
that verifies each row's drafts and drafts the next block (`programs._spec` runs both in one program; where
the decode step is split, a GPU's default (`EngineConfig.splits_decode`), `run_decode_first` then
`programs._spec_rest`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dsv41.config import ModelConfig
from serving.engine import programs
from serving.engine.config import EngineConfig
from serving.engine.errors import EngineError
from serving.engine.scheduler import StepOutput, _Request


def verify_lengths(conf: np.ndarray, threshold: float | None) -> np.ndarray:
    """The drafts each row verifies next step: conf [B, k] (the drafter's confidence logits, float32) -> int [B]:
    the positions whose cumulative confidence prod_{j <= i} sigmoid(conf_j) is >= threshold (all k: None).

    The head is trained (nemo-automodel's DSpark loss) on each position's acceptance rate given the prefix
    before it (1 - TV(p_i, q_i), binary cross-entropy), so the product is the estimated chance that drafts 1 .. i
    are all accepted, which is what verifying draft i can gain; a per-position test would go on verifying
    behind a draft likely to be rejected. Position i's value reads the drafts before it, never d_i itself, which
    keeps the cut exact (`spec_sampling`)."""
    B, k = conf.shape
    if threshold is None:
        return np.full(B, k, np.int32)
    # log-space: the sum of log-sigmoids never rounds up to log 1 = 0 (threshold 1 verifies nothing)
    log_cum = np.cumsum(-np.logaddexp(0.0, -conf.astype(np.float64)), axis=1)
    return np.sum(log_cum >= np.log(threshold), axis=1).astype(np.int32)


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
        overwritten by the tokens that take those positions."""
        k = self.spec_tokens
        rows = self._decode_rows(reqs)
        toks, pos0 = {}, {}
        n_verify = np.zeros(len(rows), np.int32)
        for i, r in enumerate(rows):
            if r is None:
                continue
            a = r.num_tokens - 1  # the anchor: the newest token, whose KV is not in the pool yet
            # a chunk starts at an even position (`programs._spec`): an odd anchor re-runs the token before it
            back = 1 if self.spec_rerun and a % 2 else 0
            n_verify[i] = self._verify_len(r)
            drafts = (r.drafts + [self.cfg.dspark_noise_token_id] * k)[:n_verify[i]]
            toks[r.id] = r.token_range(a - back, a + 1) + drafts
            pos0[r.id] = a - back
            r.history = self._history_before(r, a - back)
        b = self._batch(rows, toks, pos0, self.decode_tokens)
        samp = self._sampling(rows)
        # a row's drafts came from the drafter's last step (whose states the pool holds), or not (after a prefill)
        has_q = np.asarray([r is not None and r.drafts_drawn for r in rows])
        args = (samp, has_q, np.full(len(rows), self.spec.forced_acceptance), n_verify)
        if len(self.decode_kinds) == 2:  # cut at the split layer (`EngineConfig.split_decode`)
            self.pool, h, pre = self.programs.run_decode_first(self.params, self.pool, b, **self.static)
            self.pool, logits, out, acc, nxt, conf = self.programs.run_spec_rest(
                self.params, self.pool, programs.rest_batch(b, self.cfg), h, pre, *args, **self.static,
                spec_tokens=k)
        else:
            self.pool, logits, out, acc, nxt, conf = self.programs.run_spec(self.params, self.pool, b, *args,
                                                                            **self.static, spec_tokens=k)
        out, acc, nxt = np.asarray(out), np.asarray(acc), np.asarray(nxt)
        thr = self.spec.confidence_threshold  # without one, the confidences never leave the device
        n_next = np.full(len(rows), k, np.int32) if thr is None else verify_lengths(np.asarray(conf), thr)
        outs = []
        for i, r in enumerate(rows):
            if r is None:
                continue
            a = r.num_tokens - 1
            new: list[int] = []
            for j in range(int(acc[i]) + 1):
                r.computed = a + j + 1  # the pool holds the anchor and the j drafts accepted before this token
                if self.keep_logits:
                    r.logits.append(np.asarray(logits[i, j]))
                o = self._accept(r, int(out[i, j]))[0]
                new.append(int(out[i, j]))
                if o.finished:
                    break
            r.drafts, r.drafts_drawn = nxt[i, :n_next[i]].tolist(), True
            self.counters["spec_drafts"] += 1
            self.counters["spec_draft_tokens"] += int(n_verify[i])
            self.spec_verified_per_len[n_verify[i]] += 1
            self.counters["spec_accepted_tokens"] += len(new) - 1
            for j in range(len(new) - 1):
                self.spec_accepted_per_pos[j] += 1
            outs.append(dataclasses.replace(o, new_token_ids=new))
        self.counters["decode_steps"] += 1
        return outs
