#!/usr/bin/env bash
# The device runs that check and time what the CPU cannot, grouped so that each group fits one device call
# (10 minutes). Run from the repository root on the GPU machine; results and logs go to $OUT (default ./out).
#
#   bash scripts/h200_checks.sh tests         # every kernel's GPU tests against its reference (~3 min)
#   bash scripts/h200_checks.sh engine-tests  # engine parts with kernels vs XLA: sites, roundings, per layer (~9 min)
#   bash scripts/h200_checks.sh engine-e2e    # engine end to end with kernels vs XLA, replay on (~7 min)
#   bash scripts/h200_checks.sh engine        # decode step, XLA path vs the defaults (auto), batch 1/8/64 (~8 min)
#   bash scripts/h200_checks.sh release       # decode with the release's weight formats (FP8 linears), as served
#   bash scripts/h200_checks.sh prefill       # prefill with the kernels (auto), replay on/off, vs the matmul rate
#   bash scripts/h200_checks.sh serve         # dsv41 bench serve, replay on vs off, bench preset (~8 min)
#   bash scripts/h200_checks.sh kernels       # router, mHC and indexer top-k benches (~8 min)
#   bash scripts/h200_checks.sh profile       # every kernel of a decode step (batch 1, 64) and a prefill, CUPTI
#   bash scripts/h200_checks.sh expert-gemm   # grouped FP4 GEMM configs at 1 / 64 tokens and 8192-token prefill
#   bash scripts/h200_checks.sh torch         # sparse attention and expert GEMM vs PyTorch on the same GPU (~2 min)
#   bash scripts/h200_checks.sh fp8           # FP8 linear kernel: GPU tests, then vs XLA at Flash's shapes (~4 min)
#   bash scripts/h200_checks.sh fp8-engine    # release weights: decode with the FP8 linear kernel (auto) vs XLA's
#   bash scripts/h200_checks.sh fp8-e2e       # the FP8 linear kernel in the engine: per linear, end to end vs XLA
#   bash scripts/h200_checks.sh engine-runs   # engine runs repeated, XLA vs FP8 linear kernel, logits per step
#   bash scripts/h200_checks.sh index-scores  # prefill indexer scores: XLA float32 / bf16 products, chunk kernel
#   bash scripts/h200_checks.sh chunk-indexer # the chunk indexer kernel's GPU tests, engine layer by layer, then
#                                             # index-scores (~6 min)
#   bash scripts/h200_checks.sh chunk-indexer-engine  # 64K prefill, chunk indexers in XLA vs indexer_chunk
#   bash scripts/h200_checks.sh gaps          # the idle time between a decode step's kernels, from a trace (~5 min)
#   bash scripts/h200_checks.sh graphs        # batch-1 decode under XLA command-buffer (CUDA graph) settings
#   bash scripts/h200_checks.sh flips         # first discrete choice that differs: XLA vs FP8 linear kernel, runs
#   bash scripts/h200_checks.sh kv-flags      # programs.KernelOptions: kernels' GPU tests, engine layer by layer
#   bash scripts/h200_checks.sh kv-flags-time # programs.KernelOptions: decode RoPE fused or not, prefill indexer
#   bash scripts/h200_checks.sh topk          # the top-k threshold kernel: GPU tests, alone, in decode (~10 min)
#   bash scripts/h200_checks.sh decode-variants # FP4 decode instruction variants; PDL on 8 MoE layers (~5 min)
#   bash scripts/h200_checks.sh mma           # the expert GEMM with warp-level mma.sync: GPU tests, engine MoE,
#                                             # 1/8/64 tokens, MoE layer, FP8 linear, SASS (~9 min)
#   bash scripts/h200_checks.sh decoder8      # the FP8 linear kernel's bit layout: GPU tests, with and without decode
#   bash scripts/h200_checks.sh steps         # the expert GEMM at 1 / 64 tokens with 384-768-input steps (~4 min)
#   bash scripts/h200_checks.sh longsteps     # the decode defaults' longer steps: GPU tests, engine MoE, 1/8/64 tokens
#   bash scripts/h200_checks.sh trace         # the expert GEMM's timeline SM by SM at 1 / 8 / 64 tokens (~3 min)
#   bash scripts/h200_checks.sh stream        # stream-K against the chained items at 1-2 tokens: trace, SM clock
#                                             # under load, kernel and whole MoE layer (~4 min)
#   bash scripts/h200_checks.sh accs          # expert GEMM and FP8 linear with an accumulator a K half (~5 min)
#   bash scripts/h200_checks.sh ksplit        # the expert GEMM's K slices at one token; defaults at 1/8/64 (~4 min)
#   bash scripts/h200_checks.sh halves        # the expert GEMM with and without its K halves; 16K prefill (~9 min)
#   bash scripts/h200_checks.sh stages        # the expert GEMM at 1 / 64 tokens with 4 to 10 pipeline stages
#   bash scripts/h200_checks.sh producer      # decode attention: producer alone, consumers alone, kernel (~5 min)
#   bash scripts/h200_checks.sh loads         # plain loads with an L2 prefetch-size hint: past ~3.2 TB/s? (~2 min)
#   bash scripts/h200_checks.sh decode-kernels  # kernel-layout scale bytes (expert GEMM, FP8 linear): GPU tests,
#                                             # times vs the layout before (AB_OLD), attention producer (~9 min)
#   bash scripts/h200_checks.sh decoder       # the FP4 decoder's new bit layout: GPU tests, engine MoE, times;
#                                             # the FP8 linear without its decode (~8 min)
#   bash scripts/h200_checks.sh consumer      # the expert GEMM at one token: without its decode, 3 warpgroups
#   bash scripts/h200_checks.sh items         # one CTA's TMA stream: grids of 33-264 one-token items (~2 min)
#   bash scripts/h200_checks.sh layout        # TMA streaming of expert weights by layout; top-k at 4K context (~3 min)
#
# Every command has a hard time limit (timeout -k): a kernel that hangs on the device ignores SIGINT/SIGTERM.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
PY=${PYTHON:-python3}

case "${1:-}" in
  tests)
    # every kernel against its reference on the device (tests/serving needs the openai client, absent there)
    timeout -k 10 560 $PY -m pytest -q -s -rA --tb=line -m gpu -p no:cacheprovider tests/pallas_kernels \
      > "$OUT/gpu_tests.txt" 2>&1
    echo "pytest rc=$?"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.txt" | tail -40
    ;;
  engine-tests)
    # the engine's parts with the kernels against the XLA path: the fused sites in a block and, on the GPU itself,
    # the roundings XLA's GPU compiler used to fold (quant's formats under jit, nn.linear_f32, the mHC mix); then
    # per layer, MoE, FP8 linears (~9 min; end to end is engine-e2e)
    timeout -k 10 250 $PY -m pytest -q -s -rA --tb=short -p no:cacheprovider \
      tests/test_engine_gpu.py::test_fused_sites_match_xla_in_a_block tests/test_model.py tests/test_quant.py \
      -k "fused_sites or gpu or linear_f32 or mhc_coeff or quant" > "$OUT/engine_tests.txt" 2>&1
    echo "pytest rc=$?"
    grep -E "rel\. max|PASSED|FAILED|ERROR|passed|failed" "$OUT/engine_tests.txt" | tail -30
    # (the first run takes ~90 s; each layer-by-layer case ~100 s, so this one needs the rest of the call)
    timeout -k 10 430 $PY -m pytest -q -s -rA --tb=short -p no:cacheprovider tests/test_engine_gpu.py \
      -k "not all_kernels_end_to_end and not fused_sites" > "$OUT/engine_tests2.txt" 2>&1
    echo "pytest rc=$?"
    grep -E "rel\. max|per-layer|PASSED|FAILED|ERROR|passed|failed" "$OUT/engine_tests2.txt" | tail -30
    ;;
  engine-e2e)
    # the engine end to end, XLA path vs kernels (replay on: auto, and with the fused mHC and router sites)
    # (~7 min; replay off: -k False-auto, another call)
    timeout -k 10 560 $PY -m pytest -q -s -rA --tb=short -p no:cacheprovider tests/test_engine_gpu.py \
      -k "True-auto or True-pallas" > "$OUT/engine_e2e.txt" 2>&1
    echo "pytest rc=$?"
    grep -E "rel\. max|PASSED|FAILED|ERROR|passed|failed" "$OUT/engine_e2e.txt" | tail -20
    ;;
  engine)
    # decode only (the prefill table, replay on vs off, is in docs/PERFORMANCE.md already): 6 engines to compile,
    # ~50 s each on the XLA path and ~90-125 s with the kernels (9, with `pallas`, took more than a call);
    # ENGINE_BATCHES / ENGINE_TIMEOUT: fewer batches to share a call with another group
    timeout -k 10 "${ENGINE_TIMEOUT:-560}" $PY scripts/bench_engine.py --backends xla,auto \
      --batches "${ENGINE_BATCHES:-1,8,64}" --skip-prefill \
      --decode-ctx 4096 > "$OUT/engine_log.txt" 2>&1
    echo "bench_engine rc=$?"
    grep -E "decode |prefill |\| " "$OUT/engine_log.txt" | tail -30
    ;;
  release)
    # what a checkpoint serves: FP8 non-expert linears, dequantized in the jitted step (the bench default: bf16)
    timeout -k 10 560 $PY scripts/bench_engine.py --weights release --backends auto --batches 1,8,64 --skip-prefill \
      --decode-ctx 4096 > "$OUT/release_log.txt" 2>&1
    echo "bench_engine rc=$?"
    grep -E "decode |\| " "$OUT/release_log.txt" | tail -20
    ;;
  prefill)
    # the XLA prefill table is in docs/PERFORMANCE.md (first session); this one runs what `dsv41 serve` runs
    timeout -k 10 560 $PY scripts/bench_engine.py --prefill-backends auto,xla --lengths 4096,16384 --backends auto \
      --batches 1 --decode-ctx 4096 > "$OUT/prefill_log.txt" 2>&1
    echo "bench_engine rc=$?"
    grep -E "prefill |\| " "$OUT/prefill_log.txt" | tail -20
    ;;
  serve)
    timeout -k 10 560 $PY scripts/bench_serve_compare.py --out "$OUT/serve" --preset bench \
      --variant replay= --variant exact=--no-swa-bounded-replay \
      --server-args "--max-model-len 8192 --max-num-seqs 8 --max-num-batched-tokens 2048 --min-prefill-bucket 2048 --min-block-table-pages 128" \
      --bench-args "--max-concurrency 1,4,8 --num-turns 3 --think-time 0.3 --shared-prefix-len 1500 --input-len 300 --turn-input-len 100 --output-len 32 --num-warmups 1" \
      > "$OUT/serve_log.txt" 2>&1
    echo "bench_serve_compare rc=$?"
    grep -E "healthy|warm-up|compiled|\| " "$OUT/serve_log.txt" | tail -20
    for f in "$OUT"/serve/*.server.log; do echo "== $f"; tail -n 5 "$f"; done
    ;;
  kernels)
    timeout -k 10 200 $PY scripts/bench_router.py --out "$OUT" > "$OUT/router_log.txt" 2>&1; echo "router rc=$?"
    tail -c 3000 "$OUT/router_log.txt"
    # 2048 tokens: a prefill chunk, where the XLA path (tensor-core mix dots since the sixth session) may win
    timeout -k 10 150 $PY scripts/bench_mhc.py --out "$OUT" --tokens 64,1,512,2048 > "$OUT/mhc_log.txt" 2>&1; echo "mhc rc=$?"
    tail -c 3000 "$OUT/mhc_log.txt"
    # the indexer's top-k: lax.top_k vs radix select on the kernel's scores (and the kernel again)
    timeout -k 10 150 $PY scripts/bench_indexer.py --out "$OUT/indexer" --cases c:64:16,c:64:256,c:8:16,c:1:16 --no-sweep \
      --no-xla > "$OUT/indexer_log.txt" 2>&1; echo "indexer rc=$?"
    tail -c 3000 "$OUT/indexer_log.txt"
    ;;
  profile)
    timeout -k 10 330 $PY scripts/profile_step.py --backend auto --batches 1,64 --prefill 8192 --out "$OUT" \
      > "$OUT/profile_log.txt" 2>&1
    echo "profile_step rc=$?"
    grep -vE "^20[0-9-]+ [0-9:,]+ |WARNING|^\s*$" "$OUT/profile_log.txt" | head -120
    ;;
  expert-gemm)
    # (a config with 4 compute warpgroups hung on the device: see docs/KERNELS_EXPERT_GEMM.md)
    JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1 timeout -k 10 -s INT 240 $PY scripts/bench_expert_gemm.py --out "$OUT" \
      --budget-s 200 --rot 4 --decode-tokens 1,64 --variants --skip-baselines > "$OUT/eg_log.txt" 2>&1
    echo "bench_expert_gemm rc=$?"
    sed -n '/ceilings measured/,$p' "$OUT/eg_log.txt"
    ;;
  torch)
    # scripts/torch_baselines.py timed beside our kernels, on the same data (decode shapes; the full sets:
    # bench_sparse_attention.py with its default variants, bench_expert_gemm.py without --skip-prefill)
    BENCH_COPY_BYTES=1073741824 timeout -k 5 95 $PY scripts/bench_sparse_attention.py --iters 10 --skip-probe \
      --variants "1:10:r,8:10:s,64:2:s" > "$OUT/sa_log.txt" 2>&1
    echo "bench_sparse_attention rc=$?"
    grep -E "PyTorch|copy ceiling|variant| [0-9]+:[0-9]+:[rs] " "$OUT/sa_log.txt" | tail -14
    JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1 timeout -k 5 -s INT 75 $PY scripts/bench_expert_gemm.py --out "$OUT" \
      --budget-s 55 --rot 4 --decode-tokens 1,64 --skip-baselines --skip-prefill --no-mgpu > "$OUT/eg_log.txt" 2>&1
    echo "bench_expert_gemm rc=$?"
    sed -n '/ceilings measured/,$p' "$OUT/eg_log.txt"
    ;;
  fp8)
    timeout -k 10 150 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu tests/pallas_kernels/test_fp8_linear.py \
      > "$OUT/fp8_tests.txt" 2>&1
    echo "pytest rc=$?"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/fp8_tests.txt" | tail -10
    timeout -k 10 240 $PY scripts/bench_fp8_linear.py --out "$OUT" > "$OUT/fp8_log.txt" 2>&1
    echo "bench_fp8_linear rc=$?"
    grep -E "^\||HBM" "$OUT/fp8_log.txt" | tail -30
    timeout -k 10 100 $PY scripts/check_fp8_linear_repeat.py --reps 100 --rows 1,64,128 2>&1 | grep "^|"
    ;;
  fp8-engine)
    # four engines of ~100 s each (release weights take longer to load and compile): the benchmark alone
    # (ENGINE_BACKENDS=auto: the kernels' row alone, ~4 min)
    timeout -k 10 540 $PY scripts/bench_engine.py --weights release --backends "${ENGINE_BACKENDS:-xla-linears,auto}" \
      --batches 1,64 \
      --skip-prefill --decode-ctx 4096 > "$OUT/fp8_engine_log.txt" 2>&1
    echo "bench_engine rc=$?"
    grep -E "decode |\| " "$OUT/fp8_engine_log.txt" | tail -10
    ;;
  fp8-e2e)
    timeout -k 10 540 $PY -m pytest -q -s -rA --tb=short -p no:cacheprovider tests/test_engine_gpu.py -k fp8 \
      > "$OUT/fp8_engine_tests.txt" 2>&1
    echo "pytest rc=$?"
    grep -E "fp8 linear|engine, FP8|PASSED|FAILED|passed|failed" "$OUT/fp8_engine_tests.txt" | tail -24
    ;;
  engine-runs)
    # XLA linears twice, the FP8 linear kernel twice, one prompt: reproducibility and the kernel's effect per step
    timeout -k 10 300 $PY scripts/compare_engine_runs.py --runs xla,xla,pallas,pallas --steps 5 \
      > "$OUT/engine_runs.txt" 2>&1
    echo "compare_engine_runs rc=$?"
    grep -E "^\||gap" "$OUT/engine_runs.txt"
    ;;
  index-scores|chunk-indexer)
    # a prefill chunk's indexer scores: XLA with float32 / bf16 products and the chunk kernel (indexer_chunk).
    # chunk-indexer first runs the kernel's GPU tests, the indexer's context tests that now go through it, and
    # the engine layer by layer with KernelOptions(prefill_indexer_kernel=True)
    if [ "$1" = chunk-indexer ]; then
      timeout -k 10 240 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu \
        tests/pallas_kernels/test_indexer_chunk.py \
        "tests/pallas_kernels/test_indexer_logits.py::test_gpu_context_flash" \
        "tests/test_engine_gpu.py::test_kv_path_kernels_match_xla_layer_by_layer[False-True-auto]" \
        > "$OUT/chunk_tests.txt" 2>&1
      echo "pytest rc=$?"
      grep -E "PASSED|FAILED|ERROR|passed|failed|layer" "$OUT/chunk_tests.txt" | tail -24
    fi
    timeout -k 10 300 $PY scripts/bench_index_scores.py --entries 4096,16384,65536 > "$OUT/index_scores.txt" 2>&1
    echo "bench_index_scores rc=$?"
    grep -E "^\||TFLOP|failed" "$OUT/index_scores.txt"
    ;;
  chunk-indexer-engine)
    # a 64K prompt (replay) with the chunk's indexers in XLA (default) and through indexer_chunk
    timeout -k 10 560 $PY scripts/bench_engine.py --prefill-backends auto+xla-indexer,auto --lengths 65536 \
      --replay on --backends "" > "$OUT/chunk_engine.txt" 2>&1
    echo "bench_engine rc=$?"; grep -E "^\| auto|TFLOP|TB/s" "$OUT/chunk_engine.txt"
    ;;
  gaps)
    # where the batch-1 step's idle half sits (before Mosaic GPU calls, between small fusions, a few stalls),
    # and whether the GPU waits on the host's launches; batch 64 for contrast (GAPS_BATCHES / GAPS_BACKEND
    # pick others). The .xplane.pb comes back under
    # $OUT/gaps*/trace: `python3 scripts/trace_gaps.py --trace FILE` analyses it again on any machine
    for b in ${GAPS_BATCHES:-1 64}; do
      timeout -k 10 240 $PY scripts/trace_gaps.py --backend ${GAPS_BACKEND:-auto} --batch $b --out "$OUT/gaps$b" \
        > "$OUT/gaps$b.txt" 2>&1
      echo "trace_gaps batch $b rc=$?"
      grep -vE "^20[0-9-]+ [0-9:,]+ |WARNING|^\s*$" "$OUT/gaps$b.txt" | head -60
    done
    ;;
  graphs)
    # a batch-1 step launches ~600 kernels, most under 5 us (docs/PERFORMANCE.md): how much do CUDA graphs recover?
    # Mosaic GPU's custom call is command-buffer compatible (jaxlib/mosaic/gpu/custom_call.cc registers its
    # execute handler with kCmdBufferCompatible), so the kernels can sit inside the graphs; the step's lax.cond
    # (sampling) needs CONDITIONAL, which the default list may lack. With GRAPHS=off: XLA's defaults against
    # command buffers off (the twelfth session's trace: the kernels of a batch-1 step are busy 96% of their span,
    # 2.78 ms, but the call takes 4.39 ms; does recording or updating the graphs fill the difference?)
    all="FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
    second="--xla_gpu_enable_command_buffer=$all --xla_gpu_graph_min_graph_size=1"
    [ "${GRAPHS:-}" = off ] && second="--xla_gpu_enable_command_buffer="
    for flags in "" "$second"; do
      echo "== XLA_FLAGS='$flags'"
      XLA_FLAGS="$flags" timeout -k 10 140 $PY scripts/bench_engine.py --backends auto --batches 1 --skip-prefill \
        --decode-ctx 4096 2>&1 | grep -E "decode auto|Unknown|rror" | tail -3
    done
    ;;
  flips)
    # which selection (indexer top-k, candidates, experts) first differs between runs with and without the FP8
    # linear kernel, and between two kernel runs: a tie, a quantization bin upstream, or a kernel fault
    timeout -k 10 560 $PY scripts/trace_flips.py --runs xla,xla,pallas,pallas --tokens 128,64 \
      > "$OUT/flips.txt" 2>&1
    echo "trace_flips rc=$?"
    grep -E "^\|" "$OUT/flips.txt"
    ;;
  kv-flags)
    # programs.KernelOptions (fuse_rope, prefill_indexer_kernel): their kernels' GPU tests, then the engine layer
    # by layer with each
    timeout -k 10 200 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu \
      tests/pallas_kernels/test_sparse_attention.py tests/pallas_kernels/test_indexer_logits.py \
      -k "fused_rope or context_flash" > "$OUT/flag_tests.txt" 2>&1
    echo "pytest rc=$?"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/flag_tests.txt" | tail -12
    timeout -k 10 340 $PY -m pytest -q -s -rA --tb=short -p no:cacheprovider tests/test_engine_gpu.py \
      -k "layer_by_layer and True" > "$OUT/flag_engine.txt" 2>&1
    echo "pytest rc=$?"
    grep -E "per-layer|PASSED|FAILED|passed|failed" "$OUT/flag_engine.txt" | tail -10
    ;;
  topk)
    # the top-k threshold kernel (topk_select): its GPU tests and the engine layer by layer with it, the top-k
    # alone beside lax / radix on the indexer kernel's scores, then decode with KernelOptions(indexer_topk=
    # "kernel") vs the default
    timeout -k 10 150 $PY -m pytest -q -s -rA --tb=short -p no:cacheprovider -m gpu \
      tests/pallas_kernels/test_topk_select.py \
      "tests/test_engine_gpu.py::test_kv_path_kernels_match_xla_layer_by_layer[True-False-kernel]" \
      > "$OUT/topk_tests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "per-layer|PASSED|FAILED|ERROR|passed|failed" "$OUT/topk_tests.txt" | tail -12
    timeout -k 10 120 $PY scripts/bench_indexer.py --out "$OUT/indexer" --cases c:64:16,c:8:16,c:1:16 --no-sweep \
      --no-xla > "$OUT/indexer_log.txt" 2>&1; echo "indexer rc=$?"
    tail -c 2500 "$OUT/indexer_log.txt"
    timeout -k 10 300 $PY scripts/bench_engine.py --backends auto,auto+kernel-topk --batches 1,64 --skip-prefill \
      --decode-ctx 4096 > "$OUT/topk_engine.txt" 2>&1
    echo "bench_engine rc=$?"; grep -E "^\| auto" "$OUT/topk_engine.txt"
    ;;
  kv-flags-time)
    # programs.KernelOptions: decode with the RoPE in the attention kernel (default) and in XLA, batch 64; a 16K
    # prefill with the chunk's indexers in XLA (default) and through the scoring kernel (a decode row compiles in
    # ~90 s on the device; batch 1 and 64K were run in the ninth session, docs/PERFORMANCE.md)
    timeout -k 10 300 $PY scripts/bench_engine.py --backends auto,auto+unfused-rope --batches 64 --skip-prefill \
      --decode-ctx 4096 > "$OUT/kv_dec.txt" 2>&1
    echo "bench_engine decode rc=$?"; grep -E "^\| auto" "$OUT/kv_dec.txt"
    timeout -k 10 250 $PY scripts/bench_engine.py --prefill-backends auto+xla-indexer,auto --lengths 16384 \
      --replay on --backends "" > "$OUT/kv_pre.txt" 2>&1
    echo "bench_engine prefill rc=$?"; grep -E "^\| auto" "$OUT/kv_pre.txt"
    ;;
  stages)
    # the expert GEMM at one token with deeper pipelines. Batch 1 streams 75 MB (w1/w3) at ~2.2 TB/s against ~3.2
    # at 64 tokens, and with 216 work items on 132 SMs the second wave's 84 SMs each stream no faster than in the
    # first: as if an SM's rate were capped by its 4 stages (~84 KB in flight) rather than by HBM. 5 and 10 stages
    # chain w1/w3's 20 K steps, 9 chains w2's 9 (the others run unchained there); each case checked against the
    # reference (~3 min)
    JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1 timeout -k 5 -s INT 200 $PY scripts/bench_expert_gemm.py --rot 4 \
      --decode-tokens 1,64 --skip-prefill --decode-configs 8x256x4co,8x256x5co,8x256x10co,8x256x3co,8x256x9co \
      --skip-baselines --no-mgpu --no-torch --budget-s 180 --out "$OUT/stages" > "$OUT/stages.txt" 2>&1
    echo "bench_expert_gemm rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/stages.txt" | grep -E "kernel|FAIL"
    ;;
  halves)
    # (run as `owed` in the fourteenth session) the expert GEMM's K halves (KernelConfig.overlap: the second half
    # decodes while the first multiplies): GPU tests, then times with and without at decode (1 / 64 tokens) and at
    # 2048 / 8192-token prefills (Flash's 384 experts); then prefill through the engine (16K prompt, replay on)
    timeout -k 10 100 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu \
      tests/pallas_kernels/test_expert_gemm.py > "$OUT/eg_tests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/eg_tests.txt" | tail -12
    export JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
    timeout -k 5 -s INT 120 $PY scripts/bench_expert_gemm.py --rot 4 --decode-tokens 1,64 --skip-prefill \
      --decode-configs 8x256x4c,8x256x4co,8x256x3c,8x256x3co --skip-baselines --no-mgpu --no-torch --budget-s 100 \
      --out "$OUT/dec" > "$OUT/ov_dec.txt" 2>&1
    echo "decode rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/ov_dec.txt" | grep kernel
    for pre in 2048:64x256x4c,64x256x4co,64x256x3c,64x256x3co 8192:128x128x4,128x128x4o; do
      timeout -k 5 -s INT 100 $PY scripts/bench_expert_gemm.py --decode-tokens "" --prefill-tokens "${pre%%:*}" \
        --prefill-configs "${pre#*:}" --skip-baselines --no-mgpu --no-torch --budget-s 80 \
        --out "$OUT/pre${pre%%:*}" > "$OUT/ov_pre${pre%%:*}.txt" 2>&1
      echo "prefill ${pre%%:*} rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/ov_pre${pre%%:*}.txt" | grep kernel
    done
    timeout -k 10 160 $PY scripts/bench_engine.py --lengths 16384 --replay on --prefill-backends auto \
      --backends "" > "$OUT/prefill16k.txt" 2>&1
    echo "bench_engine prefill rc=$?"; grep -E "^\| auto|HBM" "$OUT/prefill16k.txt"
    ;;
  producer)
    # decode attention's two sides apart: the producer alone (sa.producer_stream) and the consumers alone
    # (KernelConfig(fetch_keys=False), ':nofetch') against the kernel at the same tiles per CTA (batch 64 with 2
    # and 1 key splits: 5 FP4 + 2 FP8 and 10 FP4 tiles a CTA; batch 1: one tile): GPU tests, then times (~5 min)
    timeout -k 10 150 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu \
      tests/pallas_kernels/test_sparse_attention.py -k "producer_stream" > "$OUT/sa_tests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/sa_tests.txt" | tail -12
    BENCH_COPY_BYTES=1073741824 timeout -k 5 200 $PY scripts/bench_sparse_attention.py --iters 10 --skip-probe \
      --variants "64:2:s,64:2:s:nofetch,64:1:s,64:1:s:nofetch,1:10:r,1:10:r:nofetch" \
      --producer 128x5:fp4,128x2:fp8,64x10:fp4,10x1:fp4 > "$OUT/sa_log.txt" 2>&1
    echo "bench_sparse_attention rc=$?"
    grep -E "FAILED|copy ceiling|variant| [0-9]+:[0-9]+:[rs]|producer|CTAs| fp4 | fp8 " "$OUT/sa_log.txt" | tail -20
    ;;
  decode-kernels)
    # The twelfth session's change: the kernel layout stores each scale as the bf16 exponent field of the
    # decoder's multiplier (one integer multiply a word instead of an add, a compare, a select and two shifts)
    # in the FP4 expert GEMM and the FP8 linear. GPU tests; then CUPTI times at 1 / 64 tokens and an 8192-token
    # prefill, after the same bench on the code before the change when $AB_OLD names a copy of it (a folder
    # holding the old pallas_kernels package, untracked so that it travels: `mkdir ab_old && git archive
    # <commit> pallas_kernels | tar -x -C ab_old`); the FP8 linears at Flash's shapes; then decode attention's
    # producer at batch 64 and 1: rows in flight (rpbN) and the L2 prefetch (nopf), never timed before.
    timeout -k 10 120 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu \
      tests/pallas_kernels/test_expert_gemm.py tests/pallas_kernels/test_fp8_linear.py > "$OUT/eg_tests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/eg_tests.txt" | tail -20
    eg=(scripts/bench_expert_gemm.py --rot 4 --decode-tokens 1,64 --skip-baselines --no-mgpu --no-torch)
    if [ -n "${AB_OLD:-}" ]; then
      PYTHONPATH="$AB_OLD:." JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1 timeout -k 5 -s INT 80 $PY "${eg[@]}" \
        --budget-s 60 --skip-prefill > "$OUT/eg_old_log.txt" 2>&1
      echo "bench_expert_gemm (before) rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/eg_old_log.txt"
    fi
    JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1 timeout -k 5 -s INT 130 $PY "${eg[@]}" --budget-s 110 --out "$OUT" \
      > "$OUT/eg_log.txt" 2>&1
    echo "bench_expert_gemm rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/eg_log.txt"
    timeout -k 10 160 $PY scripts/bench_fp8_linear.py --rows 1,64 --out "$OUT" > "$OUT/fp8_log.txt" 2>&1
    echo "bench_fp8_linear rc=$?"; grep -E "^\||HBM" "$OUT/fp8_log.txt" | tail -24
    BENCH_COPY_BYTES=1073741824 timeout -k 5 120 $PY scripts/bench_sparse_attention.py --iters 10 --skip-probe \
      --variants "64:2:s,64:2:s:rpb8,64:2:s:rpb2,64:2:s:nopf,64:1:s:rpb8,1:10:r,1:10:r:rpb8" > "$OUT/sa_log.txt" 2>&1
    echo "bench_sparse_attention rc=$?"
    grep -E "FAILED|copy ceiling|variant| [0-9]+:[0-9]+:[rs]" "$OUT/sa_log.txt" | tail -14
    ;;
  loads)
    # do plain loads with an L2 prefetch-size hint stream past the ~3.2 TB/s that every TMA box, plain load and
    # XLA reduction reached on the H200 (PyTorch's sum: 4.2)? (~2 min)
    timeout -k 10 150 $PY scripts/bench_weight_layout.py --box-rows 128 --box-bytes 128 --stages 4 \
      --ldg 2x8,2x8:128,2x8:256,4x8:256,1x8:256 > "$OUT/loads_log.txt" 2>&1
    echo "bench_weight_layout rc=$?"; grep -vE "^20[0-9-]+ [0-9:,]+ (Unable|WARNING)" "$OUT/loads_log.txt" | tail -12
    ;;
  decoder)
    # the kernel words' bit layout of the twenty-first session (9-10 integer operations a word of 8 weights
    # instead of 15-16; checked on the CPU by the PTX emulator, not yet run on the GPU): the kernel's GPU tests
    # at every config, the MoE through it inside the engine, then the `consumer` times, to compare with that
    # session's 33.1 / 24.4 us (one token, default / no decode) and 949.2 / 738.2 us (64 tokens) (~7 min)
    timeout -k 10 150 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu \
      tests/pallas_kernels/test_expert_gemm.py > "$OUT/eg_tests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/eg_tests.txt" | tail -12
    timeout -k 10 150 $PY -m pytest -q -s -rA --tb=short -p no:cacheprovider tests/test_engine_gpu.py \
      -k moe_kernel > "$OUT/moe_test.txt" 2>&1
    echo "pytest rc=$?"; grep -E "rel\. max|PASSED|FAILED|ERROR|passed|failed" "$OUT/moe_test.txt" | tail -6
    OUT="$OUT" bash "$0" consumer
    # and whether the FP8 linear kernel's decode holds it too (the same kernel with e4m3 words; wrong results
    # in the no-decode column by design)
    timeout -k 10 120 $PY scripts/bench_fp8_linear.py --rows 1,64 --only attn.wq_b,attn.wo_b,engram.wkv \
      --skip-decode --out "$OUT/fp8" > "$OUT/fp8_nodecode.txt" 2>&1
    echo "bench_fp8_linear rc=$?"; grep -E "^\|" "$OUT/fp8_nodecode.txt"
    ;;
  decoder8)
    # the FP8 linear kernel's words in the twenty-second session's bit layout (6 integer operations a word of 4
    # weights instead of 10; checked on the CPU by the PTX emulator): its GPU tests, then its times with and
    # without the decode, to compare with the twenty-first session's (attn.wq_b 18.1 / 15.8 us, attn.wo_b 24.4 /
    # 19.0, engram.wkv 58.7 / 48.3 at one row) (~3 min)
    timeout -k 10 150 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu tests/pallas_kernels/test_fp8_linear.py \
      > "$OUT/fp8_tests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/fp8_tests.txt" | tail -10
    timeout -k 10 120 $PY scripts/bench_fp8_linear.py --rows 1,64 --only attn.wq_b,attn.wo_b,engram.wkv \
      --skip-decode --out "$OUT/fp8" > "$OUT/fp8_nodecode.txt" 2>&1
    echo "bench_fp8_linear rc=$?"; grep -E "^\|" "$OUT/fp8_nodecode.txt"
    ;;
  consumer)
    # what holds a one-token step of the expert GEMM (216 items stream in 17 us with no compute, `items`; the
    # kernel takes 33): the default, the same without the register decode (timing only, KernelConfig.skip_decode:
    # its check fails by design), 3 compute warpgroups, 128-input steps at 8 stages; then 64 tokens, default and no
    # decode. Ran in the twenty-first session with 4 warpgroups too, which hung (now refused) (~4 min)
    export JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
    timeout -k 5 -s INT 170 $PY scripts/bench_expert_gemm.py --rot 4 --decode-tokens 1 --skip-prefill \
      --decode-configs 8x256x4co,8x256x4con,8x128x8co,8x256x4cow3 --skip-baselines --no-mgpu \
      --no-torch --budget-s 150 --out "$OUT/consumer1" > "$OUT/consumer1.txt" 2>&1
    echo "bench_expert_gemm T=1 rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/consumer1.txt" | grep -E "kernel|FAIL"
    timeout -k 5 -s INT 110 $PY scripts/bench_expert_gemm.py --rot 4 --decode-tokens 64 --skip-prefill \
      --decode-configs 8x256x4co,8x256x4con --skip-baselines --no-mgpu --no-torch --budget-s 90 \
      --out "$OUT/consumer64" > "$OUT/consumer64.txt" 2>&1
    echo "bench_expert_gemm T=64 rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/consumer64.txt" | grep -E "kernel|FAIL"
    ;;
  steps)
    # fewer, longer pipeline steps: the one-token kernel without its decode still takes ~0.6 us a 256-input step
    # where the stream needs ~0.3, and an accumulator per K half did not move it (twenty-third session); if the
    # cost is per step (barriers, the wait, the slot hand-back), 512 inputs a step halve it for w1/w3 (10
    # steps: 2 or 5 stages chain them), 384 / 768 for w2 (6 / 3 steps). Checked against the reference (~4 min)
    export JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
    timeout -k 5 -s INT 230 $PY scripts/bench_expert_gemm.py --rot 4 --decode-tokens 1,64 --skip-prefill \
      --decode-configs 8x256x4co,8x512x2co,8x512x5co,8x256x9co,8x384x3co,8x384x6co,8x768x3co --skip-baselines \
      --no-mgpu --no-torch --budget-s 210 --out "$OUT/steps" > "$OUT/steps.txt" 2>&1
    echo "bench_expert_gemm rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/steps.txt" | grep -E "kernel|FAIL"
    grep -E "FAIL|skip|rror" "$OUT/steps.txt" | head -10
    ;;
  longsteps)
    # the decode defaults after `steps` (w2 in 3 steps of 768, w1/w3 in 10 of 512 past one token): their GPU
    # tests, the MoE through them in the engine, then 1 / 8 / 64 tokens against the 256-input steps (~5 min)
    export JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
    timeout -k 10 100 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu \
      tests/pallas_kernels/test_expert_gemm.py -k "test_kernel_gpu and (2560 or 2304)" > "$OUT/ls_tests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/ls_tests.txt" | tail -4
    timeout -k 10 120 $PY -m pytest -q -s -rA --tb=short -p no:cacheprovider tests/test_engine_gpu.py \
      -k moe_kernel > "$OUT/ls_moe.txt" 2>&1
    echo "pytest rc=$?"; grep -E "rel\. max|PASSED|FAILED|ERROR|passed|failed" "$OUT/ls_moe.txt" | tail -6
    timeout -k 5 -s INT 200 $PY scripts/bench_expert_gemm.py --rot 4 --decode-tokens 1,8,64 --skip-prefill \
      --decode-configs 8x256x4co,8x512x5co,8x256x9co,8x768x3co --skip-baselines --no-mgpu --no-torch \
      --budget-s 180 --out "$OUT/longsteps" > "$OUT/longsteps.txt" 2>&1
    echo "bench_expert_gemm rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/longsteps.txt" | grep -E "kernel|FAIL"
    ;;
  trace)
    # the expert GEMM's timeline SM by SM (scripts/trace_expert_gemm.py: Mosaic GPU's on-device trace): the
    # decode defaults with and without their decode at 1 / 8 / 64 tokens, then one token with 64-row items
    # (one compute warpgroup: 432 w1/w3 items, 3.3 waves) (~3 min)
    export JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
    timeout -k 10 150 $PY scripts/trace_expert_gemm.py --tokens 1,8,64 --nodecode --out "$OUT/trace" \
      > "$OUT/trace.txt" 2>&1
    echo "trace_expert_gemm rc=$?"; grep -vE "^\[|^$" "$OUT/trace.txt" | tail -70
    timeout -k 10 90 $PY scripts/trace_expert_gemm.py --tokens 1 --configs 8x256x5cow1,8x256x10cow1,8x768x3cow1 \
      --out "$OUT/trace_wg1" > "$OUT/trace_wg1.txt" 2>&1
    echo "trace_expert_gemm rc=$?"; grep -vE "^\[|^$" "$OUT/trace_wg1.txt" | tail -30
    ;;
  stream)
    # stream-K (KernelConfig.stream) against the chained default at one token: its GPU tests, the trace with the
    # SM clock sampled under back-to-back calls, then the kernel alone and a whole MoE layer with and without it
    # (the split items' partials summed by XLA around the kernel) (~4 min)
    export JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
    timeout -k 10 120 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu tests/pallas_kernels/test_expert_gemm.py \
      -k "cfg12 or cfg13" > "$OUT/stream_tests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/stream_tests.txt" | tail -4
    timeout -k 10 170 $PY scripts/trace_expert_gemm.py --tokens 1 --mats w13 --configs 8x256x4co,8x256x4os,8x512x5os \
      --hold-s 1.5 --out "$OUT/trace" > "$OUT/trace.txt" 2>&1
    echo "trace_expert_gemm rc=$?"; grep -vE "^\[|^$|[Ww]arn" "$OUT/trace.txt" | tail -20
    rm -rf "$OUT/trace/traces"
    timeout -k 10 -s INT 200 $PY scripts/bench_expert_gemm.py --out "$OUT/eg" --decode-tokens 1,2 \
      --decode-configs 8x256x4co,8x256x4os,8x512x5co,8x512x5os,8x768x3co --skip-prefill --skip-baselines --no-torch \
      --no-mgpu --moe 1,2 --moe-variants stream --rot 4 --budget-s 170 > "$OUT/eg.txt" 2>&1
    echo "bench_expert_gemm rc=$?"; grep -E "^moe T=|FAIL" "$OUT/eg.txt"; sed -n '/ceilings measured/,$p' "$OUT/eg.txt"
    ;;
  accs)
    # an accumulator for each K half of a step (KernelConfig.two_accs): is one token held by a step's chain of
    # tk/16 dependent wgmma instructions (the kernel without its decode still takes ~1100 cycles a step on an SM
    # whose stream alone needs ~550)? Its GPU test, then 1 and 64 tokens against the defaults (~5 min)
    export JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
    timeout -k 10 100 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu \
      tests/pallas_kernels/test_expert_gemm.py -k "test_kernel_gpu and 384-cfg8" > "$OUT/accs_test.txt" 2>&1
    echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/accs_test.txt" | tail -3
    timeout -k 5 -s INT 150 $PY scripts/bench_expert_gemm.py --rot 4 --decode-tokens 1,64 --skip-prefill \
      --decode-configs 8x256x4co,8x256x4coa,8x256x9co,8x256x9coa --skip-baselines --no-mgpu --no-torch \
      --budget-s 130 --out "$OUT/accs" > "$OUT/accs.txt" 2>&1
    echo "bench_expert_gemm rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/accs.txt" | grep -E "kernel|FAIL"
    # the FP8 linear kernel (one accumulator, no K halves today) with K halves, and with an accumulator each
    timeout -k 10 150 $PY scripts/bench_fp8_linear.py --rows 1,64 --only attn.wq_b,attn.wo_b,engram.wkv \
      --variants halves,accs --out "$OUT/fp8" > "$OUT/fp8_accs.txt" 2>&1
    echo "bench_fp8_linear rc=$?"; grep -E "^\|" "$OUT/fp8_accs.txt"
    ;;
  ksplit)
    # one token's uneven waves (w1/w3: 216 items on 132 SMs, 2 on 84 of them): K slices even them (ks5: 1080
    # pieces of 4 steps, 8-9 an SM = 1.8 items' time instead of 2; ks10: 1.7), at the price of float32 partials
    # summed outside; timed again now that the decode is cheaper (the eleventh session's were wall clock).
    # Then the defaults at 1 / 8 / 64 tokens, the one-token call broken down by kernel (~4 min)
    export JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
    timeout -k 5 -s INT 200 $PY scripts/bench_expert_gemm.py --rot 4 --decode-tokens 1 --skip-prefill \
      --decode-configs 8x256x4co,8x256x4cok5,8x256x5cok4,8x256x2cok10,8x128x4cok5,8x256x5cok2,8x256x9co,8x256x3cok3,8x256x1cok9 \
      --skip-baselines --no-mgpu --no-torch --budget-s 180 --out "$OUT/ksplit1" > "$OUT/ksplit1.txt" 2>&1
    echo "bench_expert_gemm ksplit T=1 rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/ksplit1.txt" | grep -E "pallas|FAIL"
    timeout -k 5 -s INT 150 $PY scripts/bench_expert_gemm.py --rot 4 --decode-tokens 1,8,64 --skip-prefill \
      --breakdown --skip-baselines --no-mgpu --no-torch --budget-s 130 --out "$OUT/defaults" \
      > "$OUT/defaults.txt" 2>&1
    echo "bench_expert_gemm defaults rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/defaults.txt" | grep -E "pallas|FAIL"
    grep -A12 "whole call" "$OUT/defaults.txt" | head -40
    ;;
  items)
    # does one CTA's stream have a rate of its own, below HBM's? Grids of 33 to 264 items of the one-token expert
    # GEMM's size ([128 rows, 2560 B], 128-byte boxes), a CTA an item, no compute, CUPTI: equal times up to 132
    # items mean each CTA is capped (the one-token GEMM then needs its items balanced over the SMs, not deeper
    # pipelines); 264 items against 132 say whether two CTAs on one SM stream faster than one (~2 min)
    timeout -k 10 200 $PY scripts/bench_weight_layout.py --items 33,66,99,132,165,198,216,264 --stages 2,4,8 \
      > "$OUT/items_log.txt" 2>&1
    echo "bench_weight_layout rc=$?"; grep -vE "^20[0-9-]+ [0-9:,]+ (Unable|WARNING)" "$OUT/items_log.txt" | tail -30
    ;;
  layout)
    # does the expert weights' row-major layout (a box = 128 pieces of 128 bytes) cap the expert GEMM below HBM
    # bandwidth? The same boxes streamed from contiguous tiles, no compute. Then the top-k methods on the rows
    # decode scores at a 4K context (the 'auto' rule was timed at 16K+ only)
    # (LAYOUT_ARGS: e.g. "--box-rows 128,256 --box-bytes 128,256 --stages 2,4 --ldg 1x4,2x4,2x8,4x8": larger
    # boxes, and plain loads from several warpgroups instead of TMA)
    timeout -k 10 200 $PY scripts/bench_weight_layout.py ${LAYOUT_ARGS:-} > "$OUT/layout_log.txt" 2>&1
    echo "bench_weight_layout rc=$?"; grep -vE "^20[0-9-]+ [0-9:,]+ (Unable|WARNING)" "$OUT/layout_log.txt" | tail -40
    timeout -k 10 150 $PY scripts/bench_indexer.py --out "$OUT/indexer" --cases c:64:4,c:8:4,c:1:4,x:64:4,x:1:4 \
      --no-sweep --no-xla > "$OUT/indexer_log.txt" 2>&1; echo "indexer rc=$?"
    grep -E "top-k alone|^mode|^candidates|^context" "$OUT/indexer_log.txt"
    ;;
  decode-variants)
    # the FP4 decode's shifts written for other pipes (the same layout and results), kernel alone at 1 / 8
    # tokens; then 8 MoE layers with and without programmatic dependent launch (~5 min)
    timeout -k 10 480 $PY scripts/bench_decode_variants.py --moe-chain > "$OUT/decode_variants_log.txt" 2>&1
    echo "bench_decode_variants rc=$?"; grep -vE "compile|^W1" "$OUT/decode_variants_log.txt" | tail -30
    ;;
  mma)
    # warp-level mma.sync instead of wgmma (KernelConfig.warp_mma, the decode default): its GPU tests and the MoE
    # through it in the engine; the kernel alone at 1 / 8 / 64 tokens, 1 and 4 accumulators against wgmma (CUPTI);
    # a whole MoE layer at 1 / 2 / 8 tokens; the one-token w1/w3 kernel's registers and SASS by pipe; the FP8
    # linear with it at 1 / 8 rows (~9 min)
    export JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
    timeout -k 10 150 $PY -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu \
      tests/pallas_kernels/test_expert_gemm.py -k "test_kernel_gpu and mma" > "$OUT/mma_tests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/mma_tests.txt" | tail -8
    timeout -k 10 120 $PY -m pytest -q -s -rA --tb=short -p no:cacheprovider tests/test_engine_gpu.py \
      -k moe_kernel > "$OUT/mma_moe.txt" 2>&1
    echo "pytest rc=$?"; grep -E "rel\. max|PASSED|FAILED|ERROR|passed|failed" "$OUT/mma_moe.txt" | tail -6
    cfgs=8x256x4co,8x256x4cm1,8x256x4cm4,8x256x4cm2,8x256x4sm4,8x512x5co,8x512x5cm4,8x768x3co,8x768x3cm1
    timeout -k 5 -s INT 170 $PY scripts/bench_expert_gemm.py --rot 4 --decode-tokens 1,8 --skip-prefill \
      --decode-configs "$cfgs,8x768x3cm4" --skip-baselines --no-mgpu --no-torch --budget-s 150 --out "$OUT/mma" \
      > "$OUT/mma.txt" 2>&1
    echo "bench_expert_gemm rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/mma.txt" | grep -E "kernel|FAIL"
    timeout -k 5 -s INT 130 $PY scripts/bench_expert_gemm.py --rot 2 --decode-tokens 64 --skip-prefill \
      --decode-configs 8x512x5co,8x512x5cm4,8x768x3co,8x768x3cm4 --moe 1,2,8 --moe-variants wgmma \
      --skip-baselines --no-mgpu --no-torch --budget-s 110 --out "$OUT/mma64" > "$OUT/mma64.txt" 2>&1
    echo "bench_expert_gemm rc=$?"; sed -n '/ceilings measured/,$p' "$OUT/mma64.txt" | grep -E "kernel|FAIL|moe|MoE"
    mkdir -p "$OUT/mma_ptx"
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO="$OUT/mma_ptx" timeout -k 5 60 $PY - > "$OUT/mma_ptx.txt" 2>&1 <<'PYEOF'
import jax, jax.numpy as jnp
from pallas_kernels import expert_gemm as eg
sd, e, n, k = jax.ShapeDtypeStruct, 384, 4608, 5120
cfg = eg.default_config(6, n, k, e)
print(cfg)
w = eg.PreparedFp4(jnp.zeros((e, n, k // 2), jnp.uint8), jnp.zeros((e, k // 32, n), jnp.uint8))
g = jnp.zeros((e,), jnp.int32).at[:6].set(1)
jax.block_until_ready(jax.jit(lambda x, w, g: eg.grouped_fp4_matmul_pallas(x, w, g, cfg))(
    jnp.zeros((6, k), jnp.bfloat16), w, g))
PYEOF
    echo "ptx dump rc=$?"; ls "$OUT/mma_ptx" | head; rm -f "$OUT"/mma_ptx/*.txt "$OUT"/mma_ptx/*.mlir "$OUT"/mma_ptx/*.log
    for f in "$OUT"/mma_ptx/*.ptx; do
      $PY scripts/sass_stats.py "$f" --cuda-bin /usr/local/cuda/bin > "$f.stats.txt" 2>&1; head -12 "$f.stats.txt"
    done
    timeout -k 10 100 $PY scripts/bench_fp8_linear.py --rows 1,8 --only attn.wq_b,attn.wo_b,engram.wkv \
      --variants mma --out "$OUT/fp8" > "$OUT/fp8_mma.txt" 2>&1
    echo "bench_fp8_linear rc=$?"; grep -E "^\|" "$OUT/fp8_mma.txt"
    ;;
  *)
    echo "usage: $0 tests|engine-tests|engine|release|prefill|serve|kernels|profile|expert-gemm|torch|fp8|fp8-engine|fp8-e2e|engine-runs|index-scores|chunk-indexer|chunk-indexer-engine|gaps|graphs|flips|kv-flags|kv-flags-time|topk|halves|producer|engine-e2e|loads|decode-kernels|layout|stages|decode-variants|mma" >&2
    exit 2
    ;;
esac
