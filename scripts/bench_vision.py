"""Time the vision tower + aligner (dsv41/vision.py `span_embeddings`, one image per call) at the release's sizes.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/bench_vision.py --out $OUT [--sizes 544x544,2048x2048] \
        [--attention xla,cudnn]

Per image size (pixels) and attention implementation (jax.nn.dot_product_attention's: XLA's composition, or
cuDNN's fused kernel): the grid the release's preprocessing gives it, the padded patch bucket the program runs,
the span's tokens; the GPU time of one call (CUPTI kernel sum; wall clock where CUPTI is unavailable), its
compile time, and the FLOPs it performs (linears and attention over the padded bucket, the aligner over the
max_image_tokens span rows) against this run's measured bf16 matmul rate. Random bf16 weights of the flash
preset's vision_config (`--preset tiny` runs the toy tower on a CPU, to check the script).
"""

from __future__ import annotations

import timing  # noqa: I001  (first: puts the repository on sys.path)
import time

import jax
import numpy as np

from dsv41 import image_processing as ip
from dsv41 import params as P
from dsv41 import quant, vision
from dsv41.config import preset
from timing import fmt, log

ROWS: list[dict] = []


def flops(cfg, n_pad: int) -> float:
    """Multiply-adds x 2 of one call: patch embedding, per block qkv / out / attention (QK and PV) / SwiGLU, and
    the aligner's two linears over all max_image_tokens rows."""
    v = cfg.vision
    Dv, F = v.dim, v.inter_dim
    per_block = 2 * n_pad * (3 * Dv * Dv + Dv * Dv + 2 * Dv * F + F * Dv) + 4 * n_pad * n_pad * Dv
    embed = 2 * n_pad * 3 * v.patch_size ** 2 * Dv
    S = v.max_image_tokens
    align = 2 * S * (Dv * v.downsample_ratio ** 2 * cfg.dim + cfg.dim * cfg.dim)
    return embed + v.n_layers * per_block + align


def image_of(width: int, height: int):
    from PIL import Image

    rng = np.random.default_rng(width * 7919 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def main() -> None:
    ap = timing.bench_args(__doc__.split("\n")[0], iters=10, budget_s=480)
    ap.add_argument("--sizes", default="544x544,1024x768,1280x1280,2048x2048",
                    help="image sizes WIDTHxHEIGHT, comma separated")
    ap.add_argument("--preset", default="flash", choices=["flash", "tiny"])
    ap.add_argument("--attention", default="xla,cudnn", help="implementations to time, comma separated")
    args = ap.parse_args()
    cfg = preset(args.preset)
    num = quant.REFERENCE
    ceil = timing.bench_ceilings() if jax.default_backend() == "gpu" else timing.ceilings(quick=True)
    vp = P.init_tree(P.vision_specs(cfg), cfg, seed=0)
    log("vision params", P.count_params(vp) / 1e6, "M values; config", cfg.vision)
    cases = [(size, impl) for size in args.sizes.split(",") for impl in args.attention.split(",")]
    for size, impl in cases:
        if timing.over_budget(args.budget_s, f"{size} {impl}"):
            break
        w, h = (int(s) for s in size.split("x"))
        row = {"size": size, "attention": impl}
        with timing.guarded(f"{size} {impl}", row):
            inp = ip.vision_inputs(ip.preprocess(image_of(w, h), cfg.vision), cfg.vision)
            g = ip.plan_grid(w, h, cfg.vision)[0]
            n_pad = inp.patches.shape[0]
            arrays = [jax.device_put(a) for a in (inp.patches, inp.pos, inp.valid, inp.merge, inp.types)]
            attn = None if impl == "xla" else impl
            fn = jax.jit(lambda p, *a: vision.span_embeddings(p, *a, cfg=cfg, num=num, attention=attn))
            t0 = time.perf_counter()
            jax.block_until_ready(fn(vp, *arrays))
            compile_s = time.perf_counter() - t0
            ms, longest, names = timing.time_gpu(fn, (vp, *arrays), iters=args.iters)
            fl = flops(cfg, n_pad)
            tf = fl / (ms * 1e-3) / 1e12
            row.update(grid=f"{g.vit_h}x{g.vit_w}", patches=g.n_patches, bucket=n_pad, span=g.span_len, ms=ms,
                       longest_ms=longest, how=timing.how(names), compile_s=compile_s, gflop=fl / 1e9,
                       tflops=tf, mm_frac=tf / ceil["mm_TFLOPs"])
        ROWS.append(row)
        timing.write_json(args.out, "bench_vision.json", {"ceilings": ceil, "rows": ROWS})
    print(f"\nvision tower + aligner, one image per call ({args.preset}: {cfg.vision.n_layers} layers x "
          f"{cfg.vision.dim}, patch {cfg.vision.patch_size}); {timing.ceiling_line(ceil)}\n")
    timing.print_table(
        ["image", "attention", "ViT grid", "patches", "bucket", "span tokens", "ms / image", "compile s", "GFLOP",
         "TFLOP/s", "of matmul rate"],
        [[r["size"], r["attention"], r.get("grid", "-"), r.get("patches", "-"), r.get("bucket", "-"),
          r.get("span", "-"), fmt(r.get("ms")), fmt(r.get("compile_s"), "{:.1f}"), fmt(r.get("gflop"), "{:.0f}"),
          fmt(r.get("tflops"), "{:.0f}"), fmt(r.get("mm_frac"), "{:.0%}")] if "error" not in r
         else [r["size"], r["attention"], "error", *["-"] * 8] for r in ROWS])


if __name__ == "__main__":
    main()
