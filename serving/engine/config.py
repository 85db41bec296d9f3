"""Every engine option in one frozen value: `Engine(cfg, params, tokenizer, hasher, config=EngineConfig(...))`.

Names follow vLLM's where it has the option (max_model_len, max_num_seqs, max_num_batched_tokens,
enable_prefix_caching). Checks that need only the options run at construction; those that need the model
(the window, the weights' formats, the device) run in `Engine.__init__`."""

from __future__ import annotations

import dataclasses

from dsv41 import quant
from dsv41.quant import Numerics
from dsv41.sharding import Parallelism
from serving.engine.backends import KernelOptions
from serving.engine.errors import EngineError

# the most of a device's memory the Engram tables may take for decode steps to be fed on it by default
# (`EngineConfig.feeds_on_device`): Flash's tables on 8 data ranks take 17% of an H200
FEED_TABLES_MAX_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config: `{"method": "dspark", "num_speculative_tokens": 5}`. DSpark (the release's
    `mtp.*` stages) drafts a block; each decode step verifies the previous step's drafts and drafts the next
    block in one program. forced_acceptance (benchmarks only: outputs are wrong) takes every draft as if the
    target model had produced it, so the loop runs at full acceptance length on random weights.
    confidence_threshold (None: off, every step verifies all k drafts): each row verifies only the drafts whose
    cumulative confidence (the drafter's confidence head: the product of the sigmoids up to that position, the
    estimated chance that every draft up to it is accepted) is at least this value (0 < t <= 1; 1 verifies none,
    a plain step). Outputs are unchanged (`speculative.verify_lengths`).
    greedy_program: a step whose rows are all greedy runs a variant of the speculative program without sampling
    (one more program a decode batch bucket, compiled at warm-up), and any other step one that samples every row as
    a batch filtering by top-k / top-p would: the host picks the sampling branch, the program branches on no device
    value (`spec_sampling.verify`); off: one program, a `lax.switch` on the batch's branch. None: the platform's
    (`uses_greedy_program`). Tokens unchanged."""

    method: str = "dspark"
    num_speculative_tokens: int = 5
    forced_acceptance: bool = False
    confidence_threshold: float | None = None
    greedy_program: bool | None = None

    def __post_init__(self):
        if self.method != "dspark":
            raise EngineError(f"speculative method {self.method!r}: only 'dspark' (the release's drafter) is built")
        n = self.num_speculative_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise EngineError(f"num_speculative_tokens must be an integer >= 1, got {n!r}")
        if not isinstance(self.forced_acceptance, bool):
            raise EngineError(f"forced_acceptance must be true or false, got {self.forced_acceptance!r}")
        if self.greedy_program not in (None, True, False):
            raise EngineError(f"greedy_program must be true, false or null (the platform's), "
                              f"got {self.greedy_program!r}")
        t = self.confidence_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1):
            raise EngineError(f"confidence_threshold must be a number in (0, 1] (or null: verify every draft), "
                              f"got {t!r}")

    def uses_greedy_program(self, platform: str) -> bool:
        """Whether the host picks a speculative step's sampling branch (`greedy_program`) on `platform` (jax's:
        'cpu', 'gpu'), the platform's where greedy_program is None. A GPU: yes. There XLA reads each `lax.cond` /
        `lax.switch` index on the host, and the sampling's two (`spec_sampling.batch_branch`) were the step's only
        host round trips: without them its call returns once launched, as a plain step's does. On an H100 (bench
        preset, greedy rows, batch 1, k = 5, context 4096) the all-greedy program took 8.77 ms read on the host
        against 9.39 with the switch, and 6.81 ms fed on the device (`device_feed`) against 11.28
        (docs/PERFORMANCE.md section 5). The cost: a step with a sampled row but no top-k / top-p filters anyway
        (sorts the vocabulary rows it samples). The CPU: no; its conds are local, and the variant would only add
        compiles."""
        return self.greedy_program if self.greedy_program is not None else platform != "cpu"

    @classmethod
    def from_json(cls, text: str) -> "SpeculativeConfig":
        """The flag's JSON object; an unknown key or bad value raises EngineError naming it."""
        import json

        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise EngineError(f"--speculative-config is not valid JSON ({e}); e.g. "
                              '\'{"method": "dspark", "num_speculative_tokens": 5}\'') from None
        if not isinstance(d, dict):
            raise EngineError(f"--speculative-config must be a JSON object, got {text!r}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise EngineError(f"--speculative-config: unknown key(s) {unknown}; known: "
                              f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8  # decode slots: sequences running at once
    max_model_len: int | None = None  # None: the model's max_seq_len (also its cap)
    max_num_batched_tokens: int = 512  # the prefill chunk; at least the model's window
    page_tokens: int = 64  # tokens per KV page; even, so ratio-2 compression groups never straddle pages
    num_pages: int | None = None  # None: room for max_num_seqs sequences of max_model_len
    swa_bounded_replay: bool = True  # prompt: all layers to the split, the rest on the last swa_replay_tokens
    # the decoder's share of a replayed prompt: >= the window (more lets the first decoder windows see real
    # context: docs/REPLAY.md), <= max_num_batched_tokens; 128 = vLLM's choice = Flash's window
    swa_replay_tokens: int = 128
    enable_prefix_caching: bool | None = None  # None: on with bounded replay
    max_waiting: int = 1024  # waiting-queue bound; add_request raises QueueFull beyond it
    numerics: Numerics = quant.REFERENCE
    keep_logits: bool = False  # tests and the replay study read the logits behind each token
    # shape buckets: prefill chunks pad to a power of two >= min_prefill_bucket, decode batches to
    # min_decode_bucket times a power of two; fewer buckets mean fewer compiles, bigger ones more padding. Block
    # tables are always max_model_len wide: the context length is read at run time, not compiled in.
    # None: the platform's (`bucket_floors`)
    min_prefill_bucket: int | None = None
    min_decode_bucket: int | None = None
    # short prompts share a prefill call: up to this many a rank, each at most max_num_batched_tokens /
    # max_prefill_rows tokens (rounded down to a bucket), in one program of that shape (one more program, two with
    # bounded replay). Off where that share is below min_prefill_bucket (the CPU's floor is the chunk) and under
    # batch_invariant. 1 (one prompt a rank a call) until the H200 has run the shared shape's kernels and timed it
    max_prefill_rows: int = 1
    # one shape per program, whatever shares the step: prefill at the chunk, decode at max_num_seqs' bucket, every
    # block table max_model_len wide (overrides the two above). A request's logits and tokens are then the same
    # bits alone, in any batch, or after a prefix hit (docs/ARCHITECTURE.md "Batch invariance"); costs padding
    batch_invariant: bool = False
    # kernel choices: 'auto' picks the Pallas kernels where the device, shapes and weights allow
    # (serving/engine/backends.py)
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    mhc_backend: str = "auto"
    router_backend: str = "auto"
    linear_backend: str = "auto"
    kernel_options: KernelOptions = KernelOptions()
    # layers of one kind share one compiled body: their weights stacked and scanned (dsv41/layer_runs.py; compile
    # time ~flat in the layer count). False: every layer unrolled on its own weights. None: `backends.scans_layers`
    # (scanned on the XLA path, unrolled where the Mosaic GPU kernels run)
    scan_layers: bool | None = None
    # a decode step as two programs cut at the split layer (`programs.run_decode_first` / `run_decode_rest`), not
    # one; None: the platform's (`splits_decode`). A speculative step splits the same way (`run_decode_first` /
    # `run_spec_rest`) where DSpark's layers come after the split (`programs.dspark_splits`)
    split_decode: bool | None = None
    # the device mesh, by vLLM's flags: heads / widths / vocabulary split over tensor_parallel_size devices;
    # data_parallel_size ranks each running their own requests on their own KV pool; with enable_expert_parallel
    # the routed experts split over all tensor x data devices. max_num_seqs and num_pages count per data rank.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    all2all_backend: str = "allgather_reducescatter"  # vLLM's --all2all-backend: `sharding.ALL2ALL_BACKENDS`
    # DSpark speculative decoding (None: off): greedy tokens unchanged, sampled ones by rejection sampling
    speculative_config: SpeculativeConfig | None = None
    # vLLM's --async-scheduling: a step's programs run while the caller handles the previous step's tokens (each
    # step() returns the tokens of the programs the step before dispatched); tokens unchanged. Unfed
    # (`device_feed`), speculative decoding steps stay synchronous (Engine.step). Off by default: in a tight decode
    # loop on the H200 it made the step slower (6.60 vs 6.08 ms at batch 1, docs/PERFORMANCE.md section 1) and its
    # serving gain is unmeasured
    async_scheduling: bool = False
    # the next decode step dispatched before the host reads this step's tokens: each row's token is fed on the
    # device (the previous step's sampled ids), its Engram rows hashed and gathered there (the tables in device
    # memory as well as the host's, which prefill keeps reading). The GPU never waits for the host between decode
    # steps; a row that stopped is computed one step more. Implies async scheduling. With speculative decoding each
    # step's chunk (bonus token, drafts, positions) comes from the step before on the device (`programs.SpecFeed`).
    # None: the platform's (`feeds_on_device`)
    device_feed: bool | None = None
    # warm-up's compiled programs kept on disk beside the persistent compilation cache and loaded at the next start
    # without tracing (serving/engine/executables.py); off: every program goes through jit
    program_store: bool = True
    # processes that compile warm-up's programs into the program store while this one draws or loads the weights
    # (serving/engine/precompile.py); 0: warm-up compiles in the engine's own process. Needs the program store and
    # one process; `dsv41 serve` picks `precompile.default_count` when it warms up one device
    compile_workers: int = 0

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(tensor=self.tensor_parallel_size, data=self.data_parallel_size,
                           expert=self.enable_expert_parallel, all2all=self.all2all_backend)

    def __post_init__(self):
        for name in ("batch_invariant", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise EngineError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("split_decode", "device_feed"):
            if getattr(self, name) not in (None, True, False):
                raise EngineError(f"{name} must be True, False or None (the platform's), got {getattr(self, name)!r}")
        for name, lo in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("max_prefill_rows", 1),
                         ("page_tokens", 2), ("max_waiting", 0), ("swa_replay_tokens", 1), ("tensor_parallel_size", 1),
                         ("data_parallel_size", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise EngineError(f"{name} must be an integer >= {lo}, got {v!r}")
        for name in ("max_model_len", "num_pages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise EngineError(f"{name} must be a positive integer or None (the default), got {v!r}")
        if self.swa_replay_tokens > self.max_num_batched_tokens:
            raise EngineError(f"swa_replay_tokens={self.swa_replay_tokens} exceeds max_num_batched_tokens="
                              f"{self.max_num_batched_tokens} (the decoder prefill is at most one chunk); lower it "
                              f"or raise max_num_batched_tokens")
        if self.page_tokens % 2:
            raise EngineError("page_tokens must be even (ratio-2 groups may not straddle pages)")
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise EngineError("speculative_config must be a SpeculativeConfig (SpeculativeConfig.from_json parses "
                              f"the flag's JSON), got {type(self.speculative_config).__name__}")
        n = self.compile_workers
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise EngineError(f"compile_workers must be an integer >= 0, got {self.compile_workers!r}")
        for name in ("min_prefill_bucket", "min_decode_bucket"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise EngineError(f"{name} must be an integer >= 1 or None (the platform's), got {v!r}")

    def bucket_floors(self, platform: str) -> tuple[int, int]:
        """(min_prefill_bucket, min_decode_bucket) on `platform` (jax's: 'cpu', 'gpu'), the platform's where
        None. A GPU: 16 tokens and 1 row, so that short prompts and small batches run programs of their size. The
        CPU: the chunk and max_num_seqs, one prefill chunk and one decode batch. There a step's time is per-operation
        overhead more than rows (the tiny preset's decode step took 34 ms at 1 row and 27 at 8), while each program
        costs 5-10 s of compile at start-up: `dsv41 serve --preset tiny` warms up 3 programs instead of 11. A short
        prompt pays the chunk's padding (tiny: a 20-token prompt's prefill 273 ms at 512 tokens, 103 at 32)."""
        if platform == "cpu":
            floors = (self.max_num_batched_tokens, self.max_num_seqs)
        else:
            floors = (16, 1)
        given = (self.min_prefill_bucket, self.min_decode_bucket)
        return tuple(g if g is not None else f for g, f in zip(given, floors))

    def splits_decode(self, platform: str) -> bool:
        """Whether a decode step runs as two programs cut at the split layer, on `platform` (jax's: 'cpu', 'gpu'),
        the platform's where split_decode is None. A GPU: yes. There start-up waits for the largest decode
        program's compile, and its halves compile side by side in two compile workers: on the H100 (bench preset)
        alone the longer half took 39.0 s of lower + compile against 57.1 s for the one program, and serve's cold
        start to healthy took 109.9 s against 127.6 s on one host; the step 1.02x / 0.94x the one program's time at
        batch 1 / 64, the same logits bit for bit (docs/PERFORMANCE.md section 6). The CPU: no, where the programs
        compile in one process's threads (no compile workers by default): `dsv41 serve --preset tiny` was healthy
        after 40.8 s split against 37.8 s as one program on a 2-core host."""
        return self.split_decode if self.split_decode is not None else platform != "cpu"

    def feeds_on_device(self, platform: str, tables_bytes: int = 0, memory_bytes: int | None = None) -> bool:
        """Whether decode steps take their tokens on the device (`device_feed`) on `platform` (jax's: 'cpu',
        'gpu'), the platform's where device_feed is None. A GPU: yes (speculative decoding too), but not where the
        Engram tables a device would hold (`tables_bytes`: `kv_pool.engram_bytes_per_device`) take more than
        `FEED_TABLES_MAX_SHARE` of its memory (`memory_bytes`; None: unknown). There a decode step's launch (~660
        graph nodes) and the read of its tokens sit between the steps: fed, a step took what the program takes
        queued back to back, 0.59x / 0.70x / 0.68x the synchronous step at batch 1 / 16 / 64 (H100, bench preset),
        and the agentic serving benchmark's TPOT p50 fell 26% (docs/PERFORMANCE.md sections 2 and 5). The cost is
        the tables in device memory too: 5.9 GiB for the bench preset; Flash's 188.8 GiB split over the data
        ranks, 23.6 GiB a GPU on 8 (`dsv41 kv-budget`), but whole on every GPU of tensor parallelism alone, where
        the share keeps them on the host. Speculative decoding fed (its chunks built on the device): an all-greedy
        step is faster than read on the host (6.81 against 8.77 ms at batch 1, 26.20 against 34.10 at batch 64),
        a step with a sampled row slower on one H100 host and faster on another (10.65 against 9.78 ms, 11.58
        against 12.86 at batch 1: fed, XLA updates the step's CUDA graphs every call; bench preset, section 5),
        so a GPU feeds it too. The CPU: no; its steps do not wait on a launch."""
        if self.device_feed is not None:
            return self.device_feed
        fits = memory_bytes is None or tables_bytes <= FEED_TABLES_MAX_SHARE * memory_bytes
        return platform != "cpu" and fits

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}
