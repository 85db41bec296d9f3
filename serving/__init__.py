"""Serving: the engine (serving.engine), its asyncio wrapper (async_engine), the OpenAI-compatible HTTP server
(api), Prometheus metrics (metrics), the agentic load generator (bench) and the `dsv41 serve` / `dsv41 bench
serve` entry points (cli_serve). Import the submodules directly; this package imports nothing heavy on its own.
"""
