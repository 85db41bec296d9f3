"""Start-up compilation: every program an engine's steps can call, compiled and loaded before serving (the
serving analog of capturing CUDA graphs at start-up). `Warmup` is mixed into `Engine`."""

from __future__ import annotations

import concurrent.futures
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine import programs

log = logging.getLogger(__name__)


class Warmup:
    def _padding_call(self, kind: str, B: int, T: int, ctx: int):
        """(jitted program, args, static kwargs) for an all-padding batch of that shape: it writes nothing."""
        P, S, L = self.layout.num_pages, self.layout.num_slots, self.cfg.n_layers
        rows = [] if kind == "decoder" else self._rows([None] * B, [[]] * B, B, T)
        b = programs.Batch(np.zeros((B, T), np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32),
                           np.full(B, S, np.int32), np.full((B, ctx), P, np.int32), np.zeros(B, np.int32),
                           np.zeros((B, L), np.int32), rows)
        samp = self._sampling([None] * B)
        static, progs = self.static, self.programs
        if kind == "encoder":
            return progs.run_encoder, (self.params, self.pool, b), static
        if kind == "decoder":
            W, hc = self.cfg.window_size, self.cfg.hc_mult
            # committed like the step's, which come out of the encoder: a program compiles once per committed /
            # uncommitted signature of its arguments (tests/test_engine.py::test_warmup_leaves_nothing_to_compile)
            on = self.pool.layers[0].swa_q.sharding
            h = jnp.zeros((B, W, hc, self.cfg.dim), self.num.jdtype, device=on)
            pre = jnp.zeros((B, W, hc), jnp.float32, device=on)
            return progs.run_decoder, (self.params, self.pool, b, h, pre, samp), static
        return progs.run_full, (self.params, self.pool, b, samp), static

    def warmup(self, workers: int = 8) -> list[tuple[str, int, int, int]]:
        """Compiles and loads every program of `program_shapes()` so that no request waits for a compile (the
        serving analog of capturing CUDA graphs at start-up). With a persistent compilation cache configured,
        the programs are first compiled in `workers` threads at once (XLA compiles off the GIL), then each runs
        once on an all-padding batch, which loads it from that cache. -> the shapes."""
        shapes = self.program_shapes()
        t0 = time.perf_counter()
        if jax.config.jax_compilation_cache_dir and workers > 1:
            def compile_one(shape):
                fn, args, static = self._padding_call(*shape)
                fn.lower(*args, **static).compile()

            with concurrent.futures.ThreadPoolExecutor(workers) as ex:
                list(ex.map(compile_one, shapes))
            log.info("compiled %d programs in %.1f s (%d threads)", len(shapes), time.perf_counter() - t0, workers)
        for shape in shapes:
            fn, args, static = self._padding_call(*shape)
            out = fn(*args, **static)
            self.pool = out[0]
        jax.block_until_ready(self.pool)
        log.info("warm-up: %d programs ready in %.1f s", len(shapes), time.perf_counter() - t0)
        return shapes
