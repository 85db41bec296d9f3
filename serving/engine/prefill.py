"""A prompt's prefill, the engine's side: the next chunk of each rank's oldest prompt in one call (or several short
prompts a rank in one call of the shared shape), and under SWA bounded replay the encoder chunk by chunk, then the
decoder on the prompt's last `swa_replay_tokens` rows (its tail); the image rows of a chunk."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsv41 import vision
from serving.engine import images as im
from serving.engine import programs
from serving.engine.scheduler import _bucket, _Request


class Prefill:
    """The engine's prefill path (a mixin of `Engine`)."""

    def _prefill(self, queued: dict[int, list[_Request]]) -> list:
        """This step's prefill call over each rank's prompts to fill (oldest first): the shared call when some
        rank has several prompts that it can finish (`_shared_picks`), else the next chunk of each rank's oldest.
        -> the StepOutputs of the first tokens of those whose prefill finished (`Engine._dispatched`: none while
        they are in flight)."""
        picks = self._shared_picks(queued)
        if picks is not None:
            return self._prefill_chunks(picks, *self.shared_prefill)
        oldest = [q[0] for _, q in sorted(queued.items())]
        return self._prefill_chunks([(r, self._chunk_end(r, self._chunk_budget(r.rank))) for r in oldest], 1, None)

    def _shared_picks(self, queued: dict[int, list[_Request]]) -> list[tuple[_Request, int]] | None:
        """(request, chunk end) of the shared call (`EngineConfig.max_prefill_rows`), or None when no rank has two
        prompts for it. A rank's oldest prompt always runs (at most T tokens of it: a long one goes on with its
        next chunk); the next ones join in arrival order while they finish within T tokens, the rank's budget and
        its rows. The oldest runs in every call, so short prompts never starve a long one."""
        if self.shared_prefill is None:
            return None
        R, T = self.shared_prefill
        D, c, u = len(self.ranks), self.max_pages_per_seq, self.usable_shapes
        needs = [("encoder", D * R, T, c), ("decoder", D * R, 1, c)] if self.replay else [("full", D * R, T, c)]
        if u is not None and not u.issuperset(needs):
            return None  # a staged warm-up compiles it still
        picks, several = [], False
        for rank, q in sorted(queued.items()):
            left = self._chunk_budget(rank)
            first = q[0]
            end = self._chunk_end(first, min(left, T))
            picks.append((first, end))
            left -= end - first.computed
            n = 1
            for r in q[1:]:
                if n == R:
                    break
                stop = self._chunk_end(r, self.max_model_len)
                if stop - r.computed <= min(left, T):
                    picks.append((r, stop))
                    left -= stop - r.computed
                    n += 1
            several |= n > 1
        return picks if several else None

    @staticmethod
    def _chunk_end(r: _Request, budget: int) -> int:
        """Where r's next chunk of at most `budget` tokens ends: its prefill's end, or the point where bounded
        replay restarts it as a prefix hit would (`replay_at`)."""
        end = min(r.prefill_len, r.computed + budget)
        if r.replay_at and r.computed < r.replay_at:
            end = min(end, r.replay_at)
        return end

    def _prefill_chunks(self, picks: list[tuple[_Request, int]], per_rank: int, T: int | None) -> list:
        """The chunks [computed, end) of the picked requests (at most per_rank a rank) in one call of per_rank rows
        a rank x T tokens (None: the bucket of the longest chunk)."""
        for r, end in picks:
            self._hold_pages(r, end)
        # holding one request's pages may have preempted another of the picks (the newest on its rank)
        picks = [(r, end) for r, end in picks if self.running.get(r.id) is r]
        if not picks:
            return []
        reqs = [r for r, _ in picks]
        chunks = {r.id: r.token_range(r.computed, end) for r, end in picks}
        ends = {r.id: end for r, end in picks}
        if T is None:
            T = min(self.chunk, _bucket(max(map(len, chunks.values())), self.min_prefill_bucket))
            T = self._usable("encoder" if self.replay else "full", len(self.ranks), T)[1]
        rows = self._placed(reqs, per_rank)
        self.counters["prefill_calls"] += 1
        b = self._batch(rows, chunks, {r.id: r.computed for r in reqs}, T)
        if not self.replay:
            last = [r if r is not None and ends[r.id] == r.prefill_len else None for r in rows]
            samp = self._sampling(last)
            self.pool, logits, tok = self.programs.run_full(self.params, self.pool, b, **self.prefill_static)
            for r in reqs:
                r.computed = ends[r.id]
            return self._first_tokens(last, logits, self._drawn(logits, tok, samp))
        W = self.replay_tokens
        self.pool, h, pre = self.programs.run_encoder(self.params, self.pool, b, **self.static, replay_tokens=W)
        last: list[_Request | None] = [None] * len(rows)
        for i, r in enumerate(rows):
            if r is None:
                continue
            m = min(len(chunks[r.id]), W)  # the chunk's rows among its last W outputs (the rest are padding)
            if r.tail is None:
                r.tail = (h[i], pre[i], m)
            else:
                th, tp = programs.append_tail(r.tail[0], r.tail[1], h[i], pre[i], m)
                r.tail = (th, tp, min(r.tail[2] + m, W))
            r.computed = ends[r.id]
            if r.replay_at and r.computed == r.replay_at:
                self._restart_as_hit(r)
            elif r.computed == r.prefill_len:
                last[i] = r
        done = [r for r in last if r is not None]
        if not done:
            return []
        # the decoder's rows: one a rank unless a shared call finished several prompts on one rank
        last = self._placed(done, 1 if len({r.rank for r in done}) == len(done) else per_rank)
        bd, hp, pp = self._decoder_inputs(last, b.block_table.shape[1])
        samp = self._sampling(last)
        self.pool, logits, tok = self.programs.run_decoder(self.params, self.pool, bd, hp, pp, **self.prefill_static)
        for r in filter(None, last):
            r.tail = None
        return self._first_tokens(last, logits, self._drawn(logits, tok, samp))

    def _chunk_budget(self, rank: int) -> int:
        """Prompt tokens of this step's chunk on `rank`: max_num_batched_tokens less the tokens of the rank's
        decode rows (one each, k + 1 + rerun under speculative decoding), in multiples of the smallest prefill
        bucket and at least one (a prompt progresses however many rows decode). Batch invariant: the whole
        budget (a row's chunks may not depend on the rows beside it). The chunk's program pads it to its bucket."""
        unit = min(self.min_prefill_bucket, self.chunk)
        if self.config.batch_invariant:
            return self.chunk
        rows = sum(1 for r in self.running.values() if r.rank == rank and not r.prefilling)
        return max(unit, (self.chunk - rows * self.decode_tokens) // unit * unit)

    def _decoder_inputs(self, rows: list[_Request | None], ctx_pages: int):
        """The replayed decoder's batch for the rows whose prompt is complete: each runs its last
        Td <= swa_replay_tokens rows (its tail) at positions [N - Td, N), its decoder rings clipped at N - Td."""
        B, L = len(rows), self.cfg.n_layers
        live = next(r for r in rows if r is not None)
        pad_h, pad_p = jnp.zeros_like(live.tail[0]), jnp.zeros_like(live.tail[1])
        pos0, n_valid = np.zeros(B, np.int32), np.zeros(B, np.int32)
        slot, wlo = np.full(B, self.layout.num_slots, np.int32), np.zeros(B, np.int32)
        bt, rlo = np.full((B, ctx_pages), self.layout.num_pages, np.int32), np.zeros((B, L), np.int32)
        for i, r in enumerate(rows):
            if r is None:
                continue
            Td = r.tail[2]
            r.decoder_lo = r.prefill_len - Td
            pos0[i], n_valid[i], slot[i], wlo[i] = r.prefill_len - Td, Td, r.slot, r.write_lo
            bt[i, : len(r.pages)] = r.page_row()
            rlo[i] = self._ring_lo(r)
        # fixed shapes throughout: slicing each tail to its length would compile an op per distinct length
        hp, pp = programs.left_align(jnp.stack([pad_h if r is None else r.tail[0] for r in rows]),
                                     jnp.stack([pad_p if r is None else r.tail[1] for r in rows]), n_valid)
        mask = None
        if any(r is not None and r.images for r in rows):  # bias_vl for the tail's image tokens
            mask = np.zeros(hp.shape[:2], bool)
            for i, r in enumerate(rows):
                m = None if r is None else im.mask(r.images, int(pos0[i]), r.prefill_len)
                if m is not None:
                    mask[i, : len(m)] = m
        b = programs.Batch(np.zeros((B, 1), np.int32), pos0, n_valid, slot, bt, wlo, rlo, [], None, mask)
        return b, hp, pp

    def _first_tokens(self, rows, logits, tok) -> list:
        for r in filter(None, rows):
            self.counters["prefill_tokens"] += r.prefill_len - r.start
            r.image_rows.clear()  # computed again if the request is preempted and prefilled anew
        return self._dispatched(rows, tok, logits)

    def _restart_as_hit(self, r: _Request) -> None:
        """After [0, H) ran, continue as a prefix-cache hit of H tokens would."""
        H = r.replay_at
        r.replay_at = 0
        start = max(0, H - self.replay_tokens)
        r.write_lo, r.start, r.computed, r.tail = H, start, start, None
        r.decoder_lo = 0
        r.history = self._history_before(r, r.start)

    def _image_rows(self, chunks: list, B: int, T: int):
        """The image rows and mask of a prefill chunk (`images.chunk_rows`); each image's span rows are computed
        by the vision program when first needed and kept until its request's prefill ends."""
        by_id = {id(x): r for r in self.running.values() for x in r.images}

        def span_rows(x):
            cache = by_id[id(x)].image_rows
            if id(x) not in cache:
                i = x.inputs
                cache[id(x)] = vision.span_embeddings(self.vision_params, i.patches, i.pos, i.valid, i.merge,
                                                      i.types, cfg=self.cfg, num=self.num)
                self.counters["images_encoded"] += 1
            return cache[id(x)]

        return im.chunk_rows(chunks, span_rows, B, T, self.num.jdtype)
