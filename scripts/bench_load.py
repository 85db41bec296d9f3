"""Checkpoint load speed: release-format load and orbax save/restore, against the disk's raw read rate.

    python scripts/bench_load.py                  # preset 'bench' (~20 GB on disk), on the GPU machine
    python scripts/bench_load.py --preset tiny    # CPU smoke test

Writes random bytes in the stored formats, evicts them from the page cache (fsync + POSIX_FADV_DONTNEED, no root
needed), times a raw parallel read of the shards, cold and warm `load_checkpoint`, orbax save / cold restore."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import logging
import math
import os
import shutil
import tempfile
import time

import jax
import numpy as np

import timing  # before dsv41: puts the repository on sys.path
from dsv41 import checkpoint as ckpt
from dsv41 import quant
from dsv41.config import preset
from dsv41.params import Params, abstract_params, is_weight_leaf

log = logging.getLogger("bench_load")


def random_params(cfg, seed: int = 0) -> Params:
    """Host numpy arrays of random bytes with the stored-precision tree's shapes and dtypes."""
    rng = np.random.default_rng(seed)

    def fill(s):
        n = math.prod(s.shape) * np.dtype(s.dtype).itemsize
        return np.frombuffer(rng.bytes(n), np.uint8).view(np.dtype(s.dtype)).reshape(s.shape)

    return jax.tree_util.tree_map(fill, abstract_params(cfg))


def files_under(path: str, suffix: str = "") -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(suffix))


def evict(paths: list[str]) -> None:
    """Drops the files' clean pages from the page cache (dirty pages are flushed first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: list[str], threads: int, block: int = 64 << 20) -> tuple[int, float]:
    """Reads every file start to end in `block` chunks, `threads` files at a time -> (bytes, seconds)."""
    def one(p):
        buf = bytearray(max(1, min(block, os.path.getsize(p))))
        n = 0
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
        return n

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(one, paths))
    return total, time.perf_counter() - t0


def device_bytes(params: Params) -> tuple[int, int]:
    """(bytes on devices, bytes of host Engram tables)."""
    dev = host = 0
    for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_weight_leaf):
        arrays = [leaf.weight, leaf.scale] if is_weight_leaf(leaf) else [leaf]
        n = sum(a.size * np.dtype(a.dtype).itemsize for a in arrays)
        if isinstance(leaf, quant.Fp8Rows):
            host += n
        else:
            dev += n
    return dev, host


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench", help="config preset (default: bench)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed after)")
    ap.add_argument("--workers", type=int, default=8, help="load_checkpoint threads, and those of the raw read")
    ap.add_argument("--modes", default="mmap", help=f"load_checkpoint read modes to time, of {list(ckpt.READ_MODES)}")
    ap.add_argument("--no-orbax", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="reuse a release checkpoint already in --dir, and keep it")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every step at INFO

    cfg = preset(args.preset)
    root = args.dir or tempfile.mkdtemp(prefix="dsv41_bench_")
    release, orbax_dir = os.path.join(root, "release"), os.path.join(root, "orbax")
    log.info("devices: %s; writing under %s", jax.devices(), root)
    rows: list[tuple[str, float, float]] = []
    try:
        if not (args.reuse and os.path.exists(os.path.join(release, ckpt.INDEX_NAME))):
            params = random_params(cfg)
            t0 = time.perf_counter()
            ckpt.save_checkpoint(params, cfg, release, n_shards=8, fsync=True)
            size = sum(os.path.getsize(p) for p in files_under(release, ".safetensors"))
            rows.append(("write release (fsync)", size, time.perf_counter() - t0))
            del params
            gc.collect()

        shards = files_under(release, ".safetensors")
        w = args.workers
        for label, threads, cold in ((f"cold, {w} threads", w, True), ("cold, 1 thread", 1, True),
                                     (f"page cache, {w} threads", w, False)):
            if cold:
                evict(shards)
            rows.append((f"raw read, {label}", *raw_read(shards, threads)))
        raw_rate = rows[-3][1] / rows[-3][2]

        # the first transfers of a process set up the runtime's copy machinery (~2 s on an H200): keep that out
        jax.device_put(np.zeros(64 << 20, np.uint8)).block_until_ready()
        loaded = None
        for mode in args.modes.split(","):
            for label, cold in (("cold", True), ("page cache", False)):
                loaded = None
                gc.collect()
                if cold:
                    evict(shards)
                t0 = time.perf_counter()
                _, loaded = jax.block_until_ready(ckpt.load_checkpoint(release, workers=w, progress=False,
                                                                       read_mode=mode))
                dt = time.perf_counter() - t0
                dev, host = device_bytes(loaded)
                rows.append((f"load {mode} x{args.workers}, {label} (+{host / 1e9:.1f} GB mapped)", dev, dt))

        if not args.no_orbax:
            t0 = time.perf_counter()
            ckpt.save_orbax(loaded, cfg, orbax_dir)
            dev, host = device_bytes(loaded)
            rows.append(("orbax save (+ tables as .npy)", dev + host, time.perf_counter() - t0))
            loaded = None
            gc.collect()
            evict(files_under(orbax_dir))
            t0 = time.perf_counter()
            _, restored = ckpt.load_orbax(orbax_dir)
            jax.block_until_ready(restored)
            rows.append(("orbax restore, cold", device_bytes(restored)[0], time.perf_counter() - t0))
            del restored
    finally:
        if not args.reuse:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\n{args.preset} preset, {cfg.n_layers} layers, {cfg.n_routed_experts} experts, "
          f"device {jax.devices()[0].device_kind}")
    timing.print_table(["what", "GB", "s", "GB/s", "x raw"], [
        [what, f"{nbytes / 1e9:.2f}", f"{secs:.2f}", f"{nbytes / max(secs, 1e-9) / 1e9:.2f}",
         f"{nbytes / max(secs, 1e-9) / raw_rate:.2f}"] for what, nbytes, secs in rows])


if __name__ == "__main__":
    main()
