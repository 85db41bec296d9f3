#!/usr/bin/env bash
# The standing device runs, one group a device call (10 minutes), from the repository root; logs go to $OUT:
#   tests [SHARD|PATHS]  every kernel's GPU test (tests/pallas_kernels, ~7 min); SHARD 1-8: all @pytest.mark.gpu
#                  tests in eight parts that each fit one device call (the engine's GPU tests, shards 3-8, compile
#                  bench-preset programs, ~2 min a test (6: one test, 2.2-3.5 min); 7 and 8 DSpark fed against
#                  read on the host, through the sampling program and the all-greedy one: ~5 min each); PATHS:
#                  the gpu tests there
#   engine         decode step, XLA path vs the defaults (auto), batch 1/8/64 (~8 min)
#   prefill        prefill with the defaults and XLA, replay on/off, vs the matmul rate
#   buckets        prefill of short prompts (16-512 tokens, replay on) at their own buckets' programs, then every
#                  prompt padded to 128 tokens: what serve's 6 prefill programs buy against 3 (~9 min)
#   width          prefill (1K, 16K tokens, replay on) in engines of 18K and 128K tokens, the encoder indexers over
#                  the whole block table in one pass (+one-pass-indexer) and by the blocks the prompt sees (the
#                  default): a prefill's time should not depend on --max-model-len
#   scan on|off    decode steps (batch 1, 64) at Flash's 40-layer schedule (16 experts a layer to fit), runs of
#                  layers scanned with the kernels (on) or every layer unrolled (off, today's GPU default): what
#                  `backends.scans_layers` decides by; one call each (~4 / ~5.5 min on an H100, run with
#                  XLA_PYTHON_CLIENT_MEM_FRACTION=0.92); SCAN_BATCHES=1 SCAN_LIMIT=280: batch 1 alone (~2.5 min), so
#                  that `scan on` and `scan off` take one call each on one warm machine, or `scan both` (off, then
#                  on, one machine: ~6.5 min on an H100) or `ab scan on` one call
#   split [B]      the decode step cut in two programs at the replay split (the default) against the one program:
#                  each one's compile (fresh processes) and the step's wall time, at batch B (1 or 64: ~5 min each)
#   launch         the decode program called as the engine calls it (a new host-rows buffer a call: XLA updates its
#                  CUDA graph) against the same device buffers every call (bench preset with 8 experts, batch 1; ~2 min)
#   spec [B]       DSpark's verify + draft step against a plain decode step at batch B (default 1; 64: ~7 min), cut at
#                  the split layer (a GPU's default), read on the host and fed on the device (--fed-spec);
#                  the rows greedy: the all-greedy program; SPEC_ARGS=--sampling-program adds both with the
#                  branch on the device (batch 1: ~8 min); SPEC_ARGS="--temperature 1": sampled rows, the program
#                  filtering every row
#   feed [B]       the decode loop with its tokens fed on the device (`--device-feed`) against the synchronous loop,
#                  async scheduling and the program queued back to back (the bound), the step not split, bench preset
#                  with 8 experts, batch B (default 1; ~3 min a batch); FEED_ARGS: e.g. "--temperature 1 --split-decode"
#   dispatch       whether a program's call returns once launched, with each sampling op (sort, top-k, categorical)
#                  after a few ms of GEMMs (each does, on an H100: docs/PERFORMANCE.md section 5); then with
#                  --xla_gpu_enable_cub_radix_sort=false (~1 min)
#   graph          what a CUDA graph's launch costs a node: chains of XLA fusions and of FP8 linear kernels (~1 min)
#   host           a decode step's host time by function, the programs stubbed (bench preset, batch 1/8/64; ~1 min)
#   kernels        each kernel's bench: expert GEMM, FP8 linear, sparse attention, indexer, KV write, mHC, router
#   startup        `dsv41 serve --preset bench --warmup` (serve's defaults + $SERVE_ARGS: the program store and the
#                  compile workers on) to a healthy /health, from an empty compilation cache and then from the one it
#                  filled (~4 min on an H100 host: docs/PERFORMANCE.md section 6), each server's log in
#                  $OUT/serve_{cold,warm}.txt (which program gated /health, and when); fewer programs:
#                  SERVE_ARGS="--min-prefill-bucket 128 --min-decode-bucket 8"; jax's per-lowering kernel names
#                  kept in the kernel hashes (pallas_kernels/kernel_hashes.py): DSV41_STABLE_KERNEL_HASHES=0 before bash
#   compile        where a compile's time goes: the smallest encoder and decode programs' compiles traced (their
#                  host events by name), then XLA's autotuning: the decode program's first step (its compile) and
#                  its step time, batch 1, in engines of 8192 and 131072 tokens (the block table's width), with XLA's
#                  default flags and with --xla_gpu_autotune_level=0 (~6 min)
#   serve          `dsv41 bench serve` against `dsv41 serve --preset bench` with serve's bucket ladder, 16 sequences of up
#                  to 8192 tokens, every program compiled before /health is 200 (~6 min; + $SERVE_ARGS); the load
#                  ($BENCH_ARGS): 16 agentic sessions of 4 turns with 8K-token prompts arriving at 0.5/s (issue
#                  #43's TPOT targets; the server's wheels carried, as for startup)
#   profile        every kernel of a decode step (batch 1, 64) and a prefill, CUPTI
#   timeline       a decode step's GPU gaps and host time (jax.profiler), batch 1 then 64 (~4 min; + $XLA_FLAGS)
#                  ($PROFILE_ARGS: e.g. "--speculative 5 --device-feed", DSpark's step fed on the device)
#   ab GROUP [ARG] GROUP on the code in base/ (another commit's packages, made on this machine before the call:
#                  `rm -rf base && mkdir base && git archive COMMIT dsv41 serving pallas_kernels | tar -x -C base`, and
#                  carried: the run tool's carry ["base"]), then on the tree, one machine: a same-host A/B, logs in
#                  $OUT/base and $OUT/tree (the benches themselves, scripts/, are the tree's)
#   exchange       the expert-parallel token exchanges on every GPU of the machine (2-8: a multi-GPU kind): the
#                  ragged one's GPU test, then both timed at Flash widths, decode and prefill sizes
# Every command has a hard time limit (timeout -k): a kernel that hangs on the device ignores SIGINT/SIGTERM.
# startup and serve run the server, whose packages (FastAPI's stack at pyproject.toml's pins, and aiohttp for the
# benchmark client) the device image lacks: `bash scripts/server_wheels.sh` puts their wheels in .whl/; carry it (the
# run tool's carry [".whl"]) and these groups install it (`server_packages`).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
# (+ wheels installed to a path of their own); AB_FIRST (set by `ab`): a directory whose packages shadow the tree's
export PYTHONUNBUFFERED=1 PYTHONPATH=${AB_FIRST:+$AB_FIRST:}.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}

server_packages() {  # the server's and the benchmark client's packages, from the carried .whl/ where absent
  $PY -c "import fastapi, uvicorn, aiohttp" 2> /dev/null && return
  [ -d .whl ] || { echo "the server's packages are missing: bash scripts/server_wheels.sh, then carry .whl" >&2; exit 2; }
  if [ ! -d /tmp/dsv41_server_packages/fastapi ]; then  # (`ab` runs the group twice on one machine)
    $PY -m pip install -q --no-deps --target /tmp/dsv41_server_packages .whl/*.whl || exit 2
  fi
  export PYTHONPATH=$PYTHONPATH:/tmp/dsv41_server_packages
}

bench() {  # bench SECONDS NAME SCRIPT ARGS...: run a bench under a limit, its log to $OUT/NAME.txt, the table shown
  local limit=$1 name=$2; shift 2
  timeout -k 10 -s INT "$limit" $PY "$@" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$?"
  grep -E "^\||ceilings|FAIL|Error" "$OUT/$name.txt" | tail -40
}

case "${1:-}" in
  tests)
    # tests/serving needs the openai client, absent on the device
    shift
    k=""
    case "${1:-}" in
      1) set -- tests/pallas_kernels/test_{expert_gemm,fp8_linear,codec_ptx,indexer_chunk,indexer_logits,kv_write}.py ;;
      2) set -- tests/pallas_kernels/test_{mhc,router,sparse_attention,topk_select}.py ;;
      3) set -- tests/test_engine_gpu.py; k="layer_by_layer and not indexer-blocks" ;;
      4) set -- tests/test_engine_gpu.py
         k="not layer_by_layer and not all_kernels and not scanned and not shared and not speculative" ;;
      5) set -- tests/test_engine_gpu.py; k="all_kernels" ;;
      6) set -- tests/test_engine_gpu.py; k="scanned" ;;
      7) set -- tests/test_engine_gpu.py; k="shared or indexer-blocks or sampling_program" ;;
      8) set -- tests/test_engine_gpu.py; k="greedy_program" ;;
      "") set -- tests/pallas_kernels ;;
    esac
    timeout -k 10 "${TESTS_TIMEOUT:-580}" $PY -m pytest -q -s -rA --tb=short -m gpu -p no:cacheprovider \
      --durations=0 --ignore=tests/serving ${k:+-k "$k"} "$@" > "$OUT/gpu_tests.txt" 2>&1
    echo "pytest rc=$?"
    grep -E "rel\. max|PASSED|FAILED|ERROR|passed|failed|s call " "$OUT/gpu_tests.txt" | tail -60
    ;;
  engine)
    bench 560 engine scripts/bench_engine.py --backends xla,auto --batches "${ENGINE_BATCHES:-1,8,64}" --skip-prefill \
      --decode-ctx 4096
    ;;
  prefill)
    bench 560 prefill scripts/bench_engine.py --prefill-backends auto,xla --lengths 4096,16384 --backends auto \
      --batches 1 --decode-ctx 4096
    ;;
  buckets)
    for floor in 16 128; do
      bench 330 "buckets$floor" scripts/bench_engine.py --backends "" --prefill-backends auto --weights release \
        --replay on --lengths 16,32,64,128,256,512 --min-prefill-bucket $floor
    done
    ;;
  width)
    bench 560 width scripts/bench_engine.py --backends "" --prefill-backends auto+one-pass-indexer,auto \
      --weights release --replay on --lengths 1024,16384 --prefill-max-model-len 18432,131072
    ;;
  scan)
    case "${2:-}" in on|off) runs=$2 ;; both) runs="off on" ;; *) echo "scan on|off|both" >&2; exit 2 ;; esac
    for run in $runs; do
      flag=--scan-layers; [ "$run" = off ] && flag=--no-scan-layers
      bench "${SCAN_LIMIT:-570}" "scan_$run" scripts/bench_engine.py --schedule flash --experts 16 --weights release \
        --backends auto --batches "${SCAN_BATCHES:-1,64}" --skip-prefill --decode-ctx 4096 $flag
    done
    ;;
  split)
    bench 570 split scripts/bench_decode_split.py --batches "${2:-1}"
    ;;
  launch)
    bench 300 launch scripts/bench_launch.py --experts 8 --batches "${2:-1}" --decode-ctx 4096
    ;;
  spec)  # two engines of the bench preset + DSpark in turn: at jax's default 75% the second ran out of memory (H100)
    XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94} \
      bench 580 "spec${2:-1}" scripts/bench_speculative.py --batches "${2:-1}" --decode-ctx 4096 --k 5 --fed-spec \
        ${SPEC_ARGS:-}
    ;;
  feed)
    bench 400 "feed${2:-1}" scripts/bench_device_feed.py --experts 8 --batches "${2:-1}" --decode-ctx 4096 --steps 20 \
      --blocks 3 --no-split-decode ${FEED_ARGS:-}
    ;;
  dispatch)  # then without XLA's cub sorts (XLA's own sort kernels: no host copy of the rows' offsets)
    bench 170 dispatch scripts/bench_dispatch.py --rows 11 --vocab 129280
    XLA_FLAGS=$(echo ${XLA_FLAGS:-} --xla_gpu_enable_cub_radix_sort=false) \
      bench 170 dispatch_no_cub scripts/bench_dispatch.py --rows 11 --vocab 129280
    ;;
  graph)
    bench 170 graph scripts/bench_graph_launch.py --steps 50,200 --reps 30
    ;;
  host)
    bench 300 host scripts/bench_host.py --preset bench --batches 1,8,64
    ;;
  kernels)
    JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1 bench 150 expert_gemm scripts/bench_expert_gemm.py --out "$OUT" \
      --budget-s 120 --rot 4 --decode-tokens 1,64 --skip-baselines
    bench 60 fp8_linear scripts/bench_fp8_linear.py --rows 1,8,64 --out "$OUT"
    bench 60 sparse_attention scripts/bench_sparse_attention.py --iters 10 --variants "1:10:r,8:10:s,64:2:s"
    bench 60 indexer scripts/bench_indexer.py --out "$OUT/indexer" --budget-s 45 --cases c:64:16,c:64:256,c:8:16,c:1:16
    bench 60 kv_write scripts/bench_kv_write.py --out "$OUT" --budget-s 45
    bench 60 mhc scripts/bench_mhc.py --out "$OUT" --tokens 64,1,512,2048 --budget-s 45
    bench 60 router scripts/bench_router.py --out "$OUT" --budget-s 45
    ;;
  startup)
    server_packages
    bench 580 startup scripts/bench_startup.py --serve --preset bench --serve-timeout 420 --server-logs "$OUT" \
      ${SERVE_ARGS:-}
    ;;
  compile)
    bench 120 compile_trace scripts/bench_startup.py --preset bench --abstract --trace-compile \
      --programs decode,encoder --smallest
    for flag in "" --xla_gpu_autotune_level=0; do
      (  # XLA reads a value that is not a flag (" ") as a file name
        flags=$(echo ${XLA_FLAGS:-} $flag)
        if [ -n "$flags" ]; then export XLA_FLAGS=$flags; else unset XLA_FLAGS; fi
        bench 280 "compile${flag:+_autotune0}" scripts/bench_engine.py --backends auto --weights release --batches 1 \
          --skip-prefill --decode-ctx 4096 --decode-max-model-len 8192,131072
      )
    done
    ;;
  serve)
    server_packages
    args="--preset bench --max-model-len 8192 --max-num-seqs 16 --no-serve-during-warmup"
    $PY -m serving.cli serve $args ${SERVE_ARGS:-} --warmup --port 8123 > "$OUT/server.txt" 2>&1 &
    server=$!
    for _ in $(seq 300); do  # warm-up compiles every program shape first (~3 min cold)
      $PY -c "import urllib.request as u; u.urlopen('http://localhost:8123/health')" 2> /dev/null && break; sleep 1
    done
    timeout -k 10 300 $PY -m serving.cli bench serve --port 8123 --result-dir "$OUT/serve" ${BENCH_ARGS:---max-concurrency 16 \
      --num-turns 4 --think-time 0.3 --shared-prefix-len 1500 --input-len 300 --turn-input-len 100 --output-len 64 \
      --num-warmups 1 --long-prompt-rate 0.5 --long-prompt-len 3000} > "$OUT/serve.txt" 2>&1
    echo "bench serve rc=$?"
    kill "$server"; wait "$server"
    tail -n 25 "$OUT/serve.txt"
    ;;
  profile)
    timeout -k 10 330 $PY scripts/profile_step.py --backend auto --batches 1,64 --prefill 8192 --out "$OUT" \
      > "$OUT/profile.txt" 2>&1
    echo "profile_step rc=$?"
    grep -vE "^20[0-9-]+ [0-9:,]+ |WARNING|^\s*$" "$OUT/profile.txt" | head -120
    ;;
  timeline)
    for B in 1 64; do  # one batch a process: Mosaic's CUPTI reader fails after a trace
      timeout -k 10 220 $PY scripts/profile_step.py --backend auto --weights release --batches $B --prefill 0 \
        --no-parts --timeline --out "$OUT" ${PROFILE_ARGS:-} > "$OUT/timeline$B.txt" 2>&1
      echo "timeline batch $B rc=$?"
      grep -A70 "### timeline" "$OUT/timeline$B.txt" | head -45
    done
    ;;
  ab)
    shift
    if [ ! -d base/serving ]; then
      echo "ab: no base/ here; make it (git archive COMMIT dsv41 serving pallas_kernels | tar -x -C base), carry it" >&2
      exit 2
    fi
    echo "== base"; OUT="$OUT/base" AB_FIRST=base bash "$0" "$@"
    echo "== tree"; OUT="$OUT/tree" bash "$0" "$@"
    ;;
  exchange)
    timeout -k 10 120 $PY -m pytest -q -s -rA -m gpu -p no:cacheprovider tests/test_engine_gpu.py \
      -k ragged_expert_exchange > "$OUT/exchange_test.txt" 2>&1
    echo "pytest rc=$?"; grep -E "ragged exchange|passed|failed|skipped|Error" "$OUT/exchange_test.txt" | tail -8
    bench 440 exchange scripts/bench_expert_exchange.py --out "$OUT" --tokens 1,8,64,512,2048
    ;;
  *)
    echo "usage: $0 tests [SHARD|PATHS]|ab GROUP [ARG]|engine|prefill|buckets|width|scan on|off|split|launch|spec|feed|dispatch|graph|host|kernels|startup|compile|serve|profile|timeline|exchange" >&2
    exit 2
    ;;
esac
