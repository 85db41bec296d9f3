"""Per-token cost of the HTTP streaming path: `concurrency` streamed completions of `tokens` tokens each on the
fake engine with no step delay, so the time is the serving stack's (async engine, text pipeline, SSE, HTTP) and
the client's. Run it on two commits to compare them:

    PYTHONPATH=. python tests/serving/stream_overhead.py --concurrency 64 --tokens 256 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
from fake_engine import FakeEngine  # noqa: E402

from serving.api import BackgroundServer  # noqa: E402

log = logging.getLogger("stream_overhead")


async def _level(base_url: str, concurrency: int, tokens: int) -> tuple[float, int]:
    """-> (seconds, SSE token chunks received)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one(i: int) -> int:
            n = 0
            body = {"prompt": f"request {i}", "max_tokens": tokens, "ignore_eos": True, "stream": True}
            async with http.post(base_url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
                async for line in resp.content:
                    n += line.startswith(b'data: {"id"')
            return n

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
        return time.perf_counter() - t0, sum(counts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("dsv41.access").setLevel(logging.WARNING)  # a line per request would drown the numbers
    engine = FakeEngine(max_model_len=args.tokens + 64, max_num_seqs=args.concurrency, step_delay_s=0.0,
                        max_waiting=4 * args.concurrency)
    with BackgroundServer(engine, model_name="tiny") as srv:
        asyncio.run(_level(srv.base_url, 4, 8))  # warm-up
        per_token = []
        for _ in range(args.repeats):
            dt, chunks = asyncio.run(_level(srv.base_url, args.concurrency, args.tokens))
            per_token.append(dt / (args.concurrency * args.tokens) * 1e6)
            log.info("%.2f s, %d chunks: %.1f us per token", dt, chunks, per_token[-1])
    log.info("concurrency %d x %d tokens: median %.1f us per token (min %.1f)", args.concurrency, args.tokens,
             statistics.median(per_token), min(per_token))


if __name__ == "__main__":
    main()
