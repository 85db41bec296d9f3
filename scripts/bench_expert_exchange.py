#!/usr/bin/env python3
"""Time the expert-parallel token exchanges (`--all2all-backend`: `sharding.ExpertParallel`) on every local device:
DEP with the data-parallel size = the device count, the routed experts split over them.

    PYTHONPATH=. python3 scripts/bench_expert_exchange.py [--tokens 1,8,64,512,2048] [--experts N]

One MoE layer's routed experts at the preset's widths (release FP4; the engine's expert op: the grouped FP4 kernel
on a GPU), T tokens a rank routed to top-k distinct experts drawn uniformly. For each exchange: the op's median
time, the same op with the experts' GEMMs left out (the exchange and its bookkeeping alone), the rows a rank sends
and the bytes it moves each way, and those bytes over the exchange-alone time against the link rate of an
all-gather timed in the same run. Both exchanges are checked against each other first (the same partial sums
added in another order). On a CPU (XLA_FLAGS=--xla_force_host_platform_device_count=8, --preset tiny) the ragged
exchange runs through its all-gather form: a smoke run, not a measurement.
"""

from __future__ import annotations

import dataclasses
import functools

import timing  # noqa: I001  (first: puts the repository on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dsv41 import moe, sharding
from dsv41 import params as P
from dsv41.config import preset
from dsv41.quant import Fp4Weight
from serving.engine import backends
from serving.engine.config import EngineConfig
from timing import log

P_DATA = PartitionSpec(sharding.DATA)


def parse(argv=None):
    ap = timing.bench_args(__doc__, iters=20)
    ap.add_argument("--preset", default="flash", help="the widths (tiny for a CPU smoke run)")
    ap.add_argument("--tokens", default="1,8,64,512,2048", help="tokens a rank (decode rows or a prefill chunk)")
    ap.add_argument("--experts", type=int, help="routed experts (default: the preset's; a multiple of the devices)")
    ap.add_argument("--link-mib", type=int, default=256, help="a rank's block in the all-gather timed for the link")
    return ap.parse_args(argv)


def expert_weights(cfg, par, mesh, seed=0) -> dict:
    """A MoE layer's routed experts (release FP4, random), each device drawing its own shard."""
    specs = P.layer_specs(cfg, cfg.n_layers - 1)["ffn"]["experts"]
    key = jax.random.key(seed)
    out = {}
    for i, (name, s) in enumerate(specs.items()):
        E, N, K = s.shape
        shapes = [(E, N, K // 2), (E, N, K // 32)]
        sh = NamedSharding(mesh, sharding.mesh_spec(s.axes, mesh, par, shapes))
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        packed = jax.jit(lambda k: jax.random.bits(k, shapes[0], jnp.uint8), out_shardings=sh)(k1)
        scale = jax.jit(lambda k: jax.random.randint(k, shapes[1], 117, 125).astype(jnp.uint8), out_shardings=sh)(k2)
        out[name] = Fp4Weight(packed, scale)
    return out


def routing(cfg, ranks: int, T: int, seed: int):
    """x [ranks * T, D] bf16, weights float32 and distinct expert ids int32 [ranks * T, k]."""
    rng = np.random.default_rng(seed)
    n, k = ranks * T, cfg.n_activated_experts
    idx = np.argsort(rng.random((n, cfg.n_routed_experts)), axis=1)[:, :k].astype(np.int32)
    w = rng.random((n, k)).astype(np.float32)
    x = (rng.standard_normal((n, cfg.dim)) * 0.5).astype(jnp.bfloat16)
    return x, w / w.sum(1, keepdims=True), idx


def rows_sent(idx: np.ndarray, ranks: int, T: int, n_local: int) -> tuple[float, float]:
    """(rows, rows to other ranks) a rank sends under the ragged exchange, the mean over ranks (= the mean it
    receives): each token once to every rank that holds one of its experts."""
    owner = idx // n_local
    every = [[set(row) for row in owner[r * T:(r + 1) * T]] for r in range(ranks)]
    return (float(np.mean([sum(map(len, e)) for e in every])),
            float(np.mean([sum(len(s - {r}) for s in e) for r, e in enumerate(every)])))


def exchange_only(x, w, idx, experts, cfg, num, permutation=None):
    """An `Ops.routed_experts` with no GEMM: the exchange and its bookkeeping alone."""
    del idx, experts, cfg, num, permutation
    return x.astype(jnp.float32) * w.sum(-1, keepdims=True)


def program(op, experts, cfg, num, mesh):
    specs = jax.tree_util.tree_map(lambda a: sharding.manual_spec(a.sharding), experts)
    f = jax.shard_map(lambda e, x, w, i: op(x, w, i, e, cfg, num), mesh=mesh,
                      in_specs=(specs, P_DATA, P_DATA, P_DATA), out_specs=P_DATA, axis_names={sharding.DATA})
    return jax.jit(f)


def link_rate(mesh, mib: int, iters: int) -> float:
    """GB/s a device receives in an all-gather of `mib` MiB a rank (bus bytes: (ranks - 1) / ranks of the
    gathered bytes)."""
    n = mesh.devices.size
    rows = mib * 2**20 // 4096
    a = jax.device_put(np.zeros((n * rows, 1024), np.float32), NamedSharding(mesh, P_DATA))
    g = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, sharding.DATA, tiled=True), mesh=mesh,
                              in_specs=P_DATA, out_specs=P_DATA, axis_names={sharding.DATA}))
    g(a).block_until_ready()
    s = timing.median_wall_s(lambda: g(a).block_until_ready(), iters)
    return (n - 1) * mib * 2**20 / s / 1e9


def exchange_bytes(name: str, ranks: int, T: int, rows: float, D: int, k: int) -> tuple[float, float]:
    """(MB a rank receives from the others on the way there, on the way back): bf16 rows and their routing there,
    float32 partial sums back. rows: the ragged exchange's rows to other ranks."""
    if name == "allgather_reducescatter":
        there, back = (ranks - 1) * T * (2 * D + 8 * k), (ranks - 1) * T * 4 * D
    else:
        there, back = rows * (2 * D + 8 * k), rows * 4 * D
    return there / 1e6, back / 1e6


def main(argv=None):
    args = parse(argv)
    n = len(jax.devices())
    if n < 2:
        raise SystemExit(f"expert parallelism needs 2 or more devices, {n} here (on a CPU: "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    cfg = preset(args.preset)
    if args.experts:
        cfg = dataclasses.replace(cfg, n_routed_experts=args.experts)
    num = EngineConfig().numerics
    gpu = jax.default_backend() == "gpu"
    par = sharding.Parallelism(data=n, expert=True)
    par.validate(cfg, n)
    mesh = sharding.make_mesh(par)
    experts = expert_weights(cfg, par, mesh)
    inner = moe.routed_experts
    if gpu:  # the engine's expert op: the grouped FP4 kernel on its prepared weights
        experts = backends.prepare_experts({"layers": [{"ffn": {"experts": experts}}]})["layers"][0]["ffn"]["experts"]
        inner = backends.routed_experts_op
    n_local = cfg.n_routed_experts // n
    log(f"{n} {jax.devices()[0].device_kind} devices, {args.preset}: D {cfg.dim}, {cfg.n_routed_experts} experts "
        f"({n_local} a rank), top-{cfg.n_activated_experts}" + ("" if gpu else " (CPU: the ragged exchange through "
                                                                  "its all-gather form, a smoke run)"))
    link = link_rate(mesh, args.link_mib, args.iters)
    log(f"link: all-gather of {args.link_mib} MiB a rank, {link:.1f} GB/s received a device")
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, P_DATA))
    rows, results = [], []
    for T in map(int, args.tokens.split(",")):
        x, w, idx = routing(cfg, n, T, seed=T)
        arrays = [put(a) for a in (x, w, idx)]
        sent, to_others = rows_sent(idx, n, T, n_local)
        outs = {}
        for name in sharding.ALL2ALL_BACKENDS:
            p = dataclasses.replace(par, all2all=name)
            full = program(backends.expert_parallel(inner, p), experts, cfg, num, mesh)
            bare = program(backends.expert_parallel(exchange_only, p), experts, cfg, num, mesh)
            outs[name] = np.asarray(full(experts, *arrays), np.float32)
            bare(experts, *arrays).block_until_ready()
            t_full = timing.median_wall_s(lambda: full(experts, *arrays).block_until_ready(), args.iters)
            t_bare = timing.median_wall_s(lambda: bare(experts, *arrays).block_until_ready(), args.iters)
            there, back = exchange_bytes(name, n, T, to_others, cfg.dim, cfg.n_activated_experts)
            gbs = (there + back) / 1e3 / t_bare
            row = dict(tokens=T, exchange=name, op_ms=t_full * 1e3, exchange_ms=t_bare * 1e3,
                       rows_a_rank=sent if name != "allgather_reducescatter" else n * T, mb_there=there,
                       mb_back=back, gb_s=gbs, of_link=gbs / link)
            results.append(row)
            rows.append([T, name, f"{row['op_ms']:.3f}", f"{row['exchange_ms']:.3f}", f"{row['rows_a_rank']:.0f}",
                         f"{there:.2f} / {back:.2f}", f"{gbs:.1f}", f"{gbs / link:.0%}"])
            timing.write_json(args.out, "expert_exchange.json", dict(link_gb_s=link, rows=results))
        a, b = outs.values()
        err = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
        if not err <= 1e-5:
            raise SystemExit(f"T={T}: the exchanges disagree (max rel. diff {err:.2e})")
    timing.print_table(["tokens a rank", "exchange", "op ms", "exchange alone ms", "rows in a rank",
                        "MB in a rank there / back", "GB/s", "of link"], rows, "rlrrrrrr")
    return results


if __name__ == "__main__":
    main()
