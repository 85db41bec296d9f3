"""One engine over several processes (hosts) with `jax.distributed`: a replicated scheduler, driven by process 0.

Every process builds the same `Engine` over the global mesh (`jax.devices()`: every process's devices, the
layouts of `dsv41.sharding` unchanged) and makes the same sequence of engine calls, so that every jitted program
and every eager op on a global array runs on every process with the same shapes, in the same order. The host
scheduler is deterministic given its inputs, so what crosses hosts is those inputs, not its decisions: process 0
(the leader) runs the HTTP server and the engine; before each step it sends the other processes (followers) the
requests added and aborted since the last step, in one small JSON frame over a TCP side channel (`Links`), and
they apply them and run the same step (`follow`). Pages, slots, ranks and batch arrays are then computed on
every host from the same state; each host gathers the Engram rows of its own data ranks and transfers only its
devices' shards of the batch.

Start: each follower connects to the leader's side channel (the coordinator's port + 1), builds its engine and
sends its fingerprint (options, model config, mesh); the leader refuses to start when one differs, naming the
option. Then every process opens the mesh's collectives at once (`open_collectives`). Each step frame carries a
digest of the leader's scheduler state after the previous step; a follower whose own digest differs stops with an
error (it has diverged) rather than run programs that no longer match.

Liveness: both sides send a heartbeat every `HEARTBEAT_S`; a closed connection or `timeout_s` of silence is a
lost process. The leader then fails every request in flight and every new one with 503 naming the process, logs
it and exits non-zero after `grace_s` (its engine thread may be blocked in a collective that will never return,
so it is not waited for). A follower that loses the leader exits non-zero at once.

Shutdown: `Leader.stop_followers()` (after the server drained its requests) sends a stop frame; followers leave
their loop and every process leaves `jax.distributed` together.

Why not `multihost_utils.broadcast_one_to_all`: it is a device collective with fixed shapes (a variable-length
frame needs two), it has no timeout (a dead peer blocks it) and it runs a jitted program per step: 1-4 ms on
two local CPU processes, against a 22-90 us round trip of the side channel for frames of 64 B-16 KB
(scripts/bench_multihost.py). A decode step's frame is ~50 bytes; a new request adds its token ids once.

Not detected: a follower whose process lives (its heartbeats go on) but whose engine thread never reaches a
step's collective; the leader then waits in that collective.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import struct
import threading
import time
import zlib
from typing import Any, Callable

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # both sides send one this often while idle
_LEN = struct.Struct("!I")
_MAX_FRAME = 1 << 30


class LostProcess(RuntimeError):
    """A process of the multi-host engine stopped answering; the engine cannot go on without it."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """This process's place among the engine's processes (`jax.distributed`'s terms).

    coordinator_address: host:port of jax's coordinator on process 0; the side channel listens on the next port.
    timeout_s: silence after which a process counts as lost. grace_s: how long the leader answers 503 after a
    loss before it exits."""

    num_processes: int = 1
    process_id: int = 0
    coordinator_address: str | None = None
    timeout_s: float = 30.0
    grace_s: float = 2.0

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    def channel_address(self) -> tuple[str, int]:
        if not self.coordinator_address or ":" not in self.coordinator_address:
            raise ValueError(f"coordinator address {self.coordinator_address!r}: give host:port")
        host, port = self.coordinator_address.rsplit(":", 1)
        return host.strip("[]"), int(port) + 1


def cluster_env_present() -> bool:
    """Whether the environment describes a multi-process job that `jax.distributed.initialize()` reads with no
    arguments: JAX_COORDINATOR_ADDRESS, or a Slurm or Open MPI job of more than one task. (JAX detects more, such
    as Kubernetes and Cloud TPU, but by asking their APIs: a one-process server there would ask at every start;
    give those the flags.)"""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    for marker, count in (("SLURM_JOB_ID", "SLURM_NTASKS"), ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")):
        if marker in os.environ and os.environ.get(count, "1").isdigit() and int(os.environ[count]) > 1:
            return True
    return False


def initialize(cluster: Cluster | None) -> Cluster | None:
    """`jax.distributed.initialize` for `cluster` (None: from the environment where it describes a multi-process
    job, see `cluster_env_present`). Call before anything touches a device. CPU devices exchange data through
    gloo. -> the cluster as JAX resolved it, or None for one process (nothing initialized)."""
    import jax

    if cluster is None:
        if not cluster_env_present():
            return None
    elif cluster.num_processes <= 1:
        return None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    c = cluster or Cluster()
    kw = {} if cluster is None else {"coordinator_address": c.coordinator_address,
                                     "num_processes": c.num_processes, "process_id": c.process_id}
    jax.distributed.initialize(**kw)
    from jax._src import distributed  # the address JAX resolved (from the environment when not given)

    addr = distributed.global_state.coordinator_address
    out = dataclasses.replace(c, num_processes=jax.process_count(), process_id=jax.process_index(),
                              coordinator_address=addr)
    log.info("process %d of %d (coordinator %s): %d local devices, %d in all", out.process_id, out.num_processes,
             addr, jax.local_device_count(), jax.device_count())
    return out


# ---- the side channel ------------------------------------------------------------------------------------------


def _send(sock: socket.socket, msg: dict, lock: threading.Lock) -> int:
    data = json.dumps(msg, separators=(",", ":")).encode()
    with lock:
        sock.sendall(_LEN.pack(len(data)) + data)
    return len(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > _MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes: not a dsv41 peer")
    return json.loads(_recv_exact(sock, n))


class _Peer:
    """One connection with a heartbeat sender and a reader that records when the peer was last heard."""

    def __init__(self, sock: socket.socket, name: str, on_frame: Callable[[dict], None],
                 on_lost: Callable[[str], None], timeout_s: float):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.name, self.timeout_s = sock, name, timeout_s
        self.lock = threading.Lock()
        self.last_seen = time.monotonic()
        self.lost: str | None = None
        self.closing = False
        self._on_frame, self._on_lost = on_frame, on_lost
        for fn, what in ((self._read, "reader"), (self._beat, "heartbeat")):
            threading.Thread(target=fn, name=f"dsv41-{name}-{what}", daemon=True).start()

    def send(self, msg: dict) -> int:
        if self.lost:
            raise LostProcess(self.lost)
        try:
            return _send(self.sock, msg, self.lock)
        except OSError as e:
            self._lose(f"{self.name}: sending failed ({e})")
            raise LostProcess(self.lost) from None

    def _lose(self, why: str) -> None:
        if self.lost is None and not self.closing:
            self.lost = why
            self._on_lost(why)

    def _read(self) -> None:
        while True:
            try:
                msg = _recv(self.sock)
            except EOFError:
                self._lose(f"{self.name}: its connection closed (the process ended)")
                return
            except (OSError, ValueError) as e:
                self._lose(f"{self.name}: its connection failed ({e})")
                return
            self.last_seen = time.monotonic()
            if msg.get("op") != "heartbeat":
                self._on_frame(msg)

    def _beat(self) -> None:
        while self.lost is None and not self.closing:
            try:
                _send(self.sock, {"op": "heartbeat"}, self.lock)
            except OSError as e:
                self._lose(f"{self.name}: sending failed ({e})")
                return
            time.sleep(HEARTBEAT_S)
            silent = time.monotonic() - self.last_seen
            if silent > self.timeout_s:
                self._lose(f"{self.name}: no heartbeat for {silent:.0f} s")
                return



def _process_name(cluster: Cluster, i: int) -> str:
    return f"process {i} of {cluster.num_processes}"


class Links:
    """The leader's connections to every follower (process id -> `_Peer`). on_lost(process id, why)."""

    def __init__(self, cluster: Cluster, on_lost: Callable[[int, str], None], connect_timeout_s: float = 300.0):
        self.cluster = cluster
        host, port = cluster.channel_address()
        srv = socket.create_server(("", port), reuse_port=False)
        srv.settimeout(connect_timeout_s)
        self.peers: dict[int, _Peer] = {}
        self._ready: dict[int, dict[str, str]] = {}
        self._ready_cv = threading.Condition()
        want = cluster.num_processes - 1
        try:
            while len(self.peers) < want:
                try:
                    sock, addr = srv.accept()
                except socket.timeout:
                    missing = sorted(set(range(1, cluster.num_processes)) - set(self.peers))
                    raise LostProcess(f"processes {missing} did not connect to the leader's side channel on port "
                                      f"{port} within {connect_timeout_s:.0f} s; start them, or check that the "
                                      f"port is reachable from their hosts") from None
                sock.settimeout(10.0)
                try:
                    i = int(_recv(sock)["process_id"])
                except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
                    log.warning("side channel: ignored a connection from %s that is not a dsv41 process (%r)",
                                addr[0], e)
                    sock.close()
                    continue
                if not 0 < i < cluster.num_processes or i in self.peers:
                    raise LostProcess(f"a process connected as process {i} from {addr[0]}, which is "
                                      f"{'taken' if i in self.peers else 'out of range'}; give each process its own "
                                      f"--process-id in [1, {cluster.num_processes})")
                sock.settimeout(None)
                self.peers[i] = _Peer(sock, _process_name(cluster, i), self._frame(i),
                                      lambda why, i=i: on_lost(i, why), cluster.timeout_s)
                log.info("side channel: %s connected from %s", _process_name(cluster, i), addr[0])
        finally:
            srv.close()

    def _frame(self, i: int) -> Callable[[dict], None]:
        def on_frame(msg: dict) -> None:
            if msg.get("op") == "error":
                self.peers[i]._lose(f"{_process_name(self.cluster, i)} failed: {msg.get('message')}")
            elif msg.get("op") == "ready":
                with self._ready_cv:
                    self._ready[i] = msg["fingerprint"]
                    self._ready_cv.notify_all()
        return on_frame

    def check_same_engine(self, mine: dict[str, str], timeout_s: float) -> None:
        """Waits for every follower's engine fingerprint and raises LostProcess naming the first process and the
        options that differ from the leader's: programs that differ would block each other in their collectives."""
        with self._ready_cv:
            if not self._ready_cv.wait_for(lambda: len(self._ready) == len(self.peers) or
                                           any(p.lost for p in self.peers.values()), timeout_s):
                missing = sorted(set(self.peers) - set(self._ready))
                raise LostProcess(f"processes {missing} did not build their engine within {timeout_s:.0f} s")
        for i, p in sorted(self.peers.items()):
            if p.lost:
                raise LostProcess(p.lost)
            diff = sorted(k for k in set(mine) | set(self._ready[i]) if mine.get(k) != self._ready[i].get(k))
            if diff:
                raise LostProcess(f"{_process_name(self.cluster, i)} built a different engine: "
                                  + "; ".join(f"{k}: process 0 {mine.get(k)}, process {i} {self._ready[i].get(k)}"
                                              for k in diff[:6])
                                  + ". Start every process with the same flags")

    def send_all(self, msg: dict) -> int:
        return sum(p.send(msg) for p in self.peers.values())

    def status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"process": i, "alive": p.lost is None, "last_seen_s": round(now - p.last_seen, 3),
                 **({"error": p.lost} if p.lost else {})} for i, p in sorted(self.peers.items())]



# ---- leader and follower -----------------------------------------------------------------------------------------


def fingerprint(engine) -> dict[str, str]:
    """What must be the same on every process for their programs to match: the model, every engine option and
    the mesh."""
    out = {f.name: repr(getattr(engine.config, f.name)) for f in dataclasses.fields(engine.config)}
    out["model config"] = f"{zlib.crc32(repr(engine.cfg).encode()):08x}"
    out["devices"] = repr(None if engine.mesh is None else engine.mesh.devices.shape)
    return out


def open_collectives(mesh) -> None:
    """Runs one all-reduce over each mesh axis and over the whole mesh, on every process at once. CPU collectives
    (gloo) set up the connections of a device group at its first collective and give up after 30 s: were that
    first collective in a serving program, a process that compiled it slower (a compilation cache hit on one,
    a miss on another) would fail the other. Once set up, a collective waits for a late process."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    names = tuple(mesh.axis_names)
    every = PartitionSpec(names)
    x = jax.make_array_from_callback((mesh.size,), NamedSharding(mesh, every),
                                     lambda index: np.ones(len(range(mesh.size)[index[0]]), np.float32))
    for group in [(n,) for n in names if mesh.shape[n] > 1] + [names]:
        f = jax.shard_map(lambda a, g=group: jax.lax.psum(a, g), mesh=mesh, in_specs=every, out_specs=every)
        jax.block_until_ready(jax.jit(f)(x))


def digest(engine) -> int:
    """A checksum of the scheduler state every process must agree on after each step."""
    state = [(r.id, r.rank, r.slot, r.computed, r.num_tokens, len(r.pages), r.pages[-1] if r.pages else -1)
             for r in engine.running.values()]
    return zlib.crc32(repr((state, [r.id for r in engine.waiting])).encode())


class Leader:
    """Process 0's engine: every call that changes the engine's state is recorded and sent to the followers
    before the next step, so they make the same calls; reads (stats, has_work, ...) pass through."""

    def __init__(self, engine, cluster: Cluster, links: Links):
        from serving.engine.errors import EngineError

        if engine.keep_logits:
            raise EngineError("keep_logits reads every rank's logits on the host; it needs one process")
        self.engine, self.cluster, self.links = engine, cluster, links
        self._events: list[list] = []
        self._seq = 0
        self._digest = digest(engine)
        self._stopped = False
        self.frame_bytes = 0  # the last step frame's size, summed over followers
        self.send_s = 0.0  # the last step frame's send time

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, request_id: str, prompt_ids, sampling=None, session: str | None = None,
                    replay_at: int = 0, images=()) -> None:
        from serving.engine.sampling import SamplingParams

        s = sampling or SamplingParams()
        if s.seed is None:  # the engine's default seed hashes the id, and str hashes differ between processes
            s = dataclasses.replace(s, seed=hash(request_id) & 0xFFFFFFFF)
        ids = [int(t) for t in prompt_ids]
        extra = {"images": tuple(images)} if images else {}  # (engines without vision take none)
        self.engine.add_request(request_id, ids, s, session=session, replay_at=replay_at, **extra)
        self._events.append(["add", request_id, ids, dataclasses.asdict(s), session, replay_at,
                             [_image_to_json(im) for im in images]])

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._events.append(["abort", request_id])

    def step(self):
        self._seq += 1
        t = time.perf_counter()
        self.frame_bytes = self.links.send_all({"op": "step", "seq": self._seq, "events": self._events,
                                                "digest": self._digest})
        self.send_s = time.perf_counter() - t
        self._events = []
        try:
            return self.engine.step()
        finally:
            self._digest = digest(self.engine)

    def warmup(self, workers: int = 8, should_stop=None, staged: bool = False):
        """Every process compiles every program; not stopped early (a follower cannot see should_stop, and
        the programs it would run past the leader's stop would wait for the leader forever), nor staged (each
        process's background compiles would end at other steps, and a step's program must be every process's)."""
        self.links.send_all({"op": "warmup", "workers": workers})
        return self.engine.warmup(workers)

    def generate(self, prompt_ids, sampling=None, **kw) -> list[int]:
        """`Engine.generate` through this leader (its requests and steps reach the followers)."""
        from serving.engine.engine import Engine

        return Engine.generate(self, prompt_ids, sampling, **kw)

    def processes(self) -> list[dict[str, Any]]:
        """Every process's state for /health: process 0 (this one) and each follower's link."""
        return [{"process": 0, "alive": True, "last_seen_s": 0.0}] + self.links.status()

    def stop_followers(self) -> None:
        """Tells the followers to leave their loop (after the server drained its requests) and leaves
        `jax.distributed` with them; once."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.links.send_all({"op": "stop"})
        except LostProcess as e:
            log.warning("stopping: %s", e)
            return
        for p in self.links.peers.values():
            p.closing = True
        import jax

        jax.distributed.shutdown()
        log.info("every process stopped")


def _image_to_json(im) -> dict:
    """A `serving.engine.images.PromptImage` as JSON: the follower gets the leader's prepared tower inputs (not the
    URL: a fetch or a decode could differ between hosts)."""
    import base64
    import io

    import numpy as np

    buf = io.BytesIO()
    f = im.inputs
    np.savez(buf, patches=f.patches, pos=f.pos, valid=f.valid, merge=f.merge, types=f.types)
    return {"start": im.start, "span_len": f.span_len, "digest": im.digest.hex(),
            "inputs": base64.b64encode(buf.getvalue()).decode()}


def _image_from_json(d: dict):
    import base64
    import io

    import numpy as np

    from dsv41.image_processing import VisionInputs
    from serving.engine.images import PromptImage

    a = np.load(io.BytesIO(base64.b64decode(d["inputs"])))
    inputs = VisionInputs(*(a[k] for k in ("patches", "pos", "valid", "merge", "types")), span_len=d["span_len"])
    return PromptImage(d["start"], inputs, bytes.fromhex(d["digest"]))


def _apply(engine, events: list[list]) -> None:
    from serving.engine.sampling import SamplingParams

    for ev in events:
        if ev[0] == "add":
            _, rid, ids, s, session, replay_at, images = ev
            s["stop_token_ids"] = tuple(s["stop_token_ids"])
            extra = {"images": tuple(map(_image_from_json, images))} if images else {}
            engine.add_request(rid, ids, SamplingParams(**s), session=session, replay_at=replay_at, **extra)
        elif ev[0] == "abort":
            engine.abort(ev[1])
        else:
            raise ValueError(f"unknown event {ev[0]!r}")


def connect(cluster: Cluster, on_lost: Callable[[str], None], connect_timeout_s: float = 300.0) -> tuple[_Peer, Any]:
    """A follower's link to the leader's side channel -> (peer, queue of the leader's frames)."""
    import queue

    host, port = cluster.channel_address()
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5.0)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise LostProcess(f"cannot reach the leader's side channel at {host}:{port} ({e}); start process 0 "
                                  "first, or check that the port is reachable") from None
            time.sleep(0.2)
    sock.settimeout(None)
    _send(sock, {"process_id": cluster.process_id}, threading.Lock())
    frames: queue.SimpleQueue = queue.SimpleQueue()
    return _Peer(sock, "process 0 (the leader)", frames.put, on_lost, cluster.timeout_s), frames


def follow(engine, peer: _Peer, frames) -> int:
    """A follower's loop: the leader's frames, applied in order, until it says stop. -> exit status (0)."""
    from serving.engine.errors import EngineError

    mine = digest(engine)
    steps = 0
    while True:
        msg = frames.get()
        op = msg["op"]
        if op == "stop":
            log.info("the leader stopped the engine after %d steps", steps)
            peer.closing = True
            return 0
        if op == "warmup":
            engine.warmup(msg.get("workers", 8))
            continue
        if op != "step":
            raise ValueError(f"unknown frame {op!r} from the leader")
        if msg["digest"] != mine:
            why = (f"scheduler state differs from the leader's before step {msg['seq']} (digest {mine} vs "
                   f"{msg['digest']}): the processes run different code or options; start every process from the "
                   "same build with the same flags")
            peer.send({"op": "error", "message": why})
            raise LostProcess(why)
        _apply(engine, msg["events"])
        try:
            engine.step()
        except EngineError as e:  # the leader's step raised the same; its aborts arrive with the next frame
            log.debug("step %d: %s", msg["seq"], e)
        mine = digest(engine)
        steps += 1


# ---- running it ----------------------------------------------------------------------------------------------------

EXIT_LOST = 3  # exit status of a process that lost another


class OnLost:
    """What the leader does when a follower is lost: logs it naming the process, runs `callbacks(why)` (the
    server fails its requests with 503), and exits with EXIT_LOST after `grace_s` (its engine thread may be
    blocked in a collective with the lost process: it is not waited for)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.callbacks: list[Callable[[str], None]] = []
        self.why: str | None = None

    def __call__(self, process: int, why: str) -> None:
        if self.why is not None:
            return
        self.why = f"lost {why}; the engine cannot go on without it: restart every process"
        log.error("%s (exiting in %.0f s)", self.why, self.grace_s)
        for cb in self.callbacks:
            try:
                cb(self.why)
            except Exception:
                log.exception("a lost-process callback raised")
        threading.Timer(self.grace_s, _exit_now, (EXIT_LOST,)).start()


def _exit_now(status: int) -> None:
    logging.shutdown()
    os._exit(status)


def _leader_lost(why: str) -> None:
    log.error("lost %s; this process cannot go on alone: exiting", why)
    _exit_now(EXIT_LOST)


def run(cluster: Cluster | None, build: Callable[[], Any], lead: Callable[[Any], int]) -> int:
    """`build()` the engine on every process; process 0 runs `lead(engine)` (a `Leader` when there are several
    processes), the others follow it until it stops. -> this process's exit status. A start that fails exits at
    once (2: a bad option, EXIT_LOST: a process missing or different): leaving `jax.distributed` normally would
    wait for the other processes."""
    if cluster is None:
        return lead(build())
    import jax

    def build_spanning():
        engine = build()
        n = 1 if engine.mesh is None else engine.mesh.size
        if n != jax.device_count():
            raise SystemExit(f"the engine's layout uses {n} of the {jax.device_count()} devices of the "
                             f"{cluster.num_processes} processes; set --tensor-parallel-size x --data-parallel-size "
                             f"to {jax.device_count()} so that every process holds a part of it")
        return engine

    try:
        if cluster.is_leader:
            on_lost = OnLost(cluster.grace_s)
            links = Links(cluster, on_lost)
            leader = Leader(build_spanning(), cluster, links)
            leader.on_lost = on_lost
            links.check_same_engine(fingerprint(leader.engine), cluster.timeout_s * 10)
            links.send_all({"op": "start"})
            open_collectives(leader.engine.mesh)
        else:
            peer, frames = connect(cluster, _leader_lost)
            engine = build_spanning()
            peer.send({"op": "ready", "fingerprint": fingerprint(engine)})
            if frames.get()["op"] != "start":
                raise LostProcess("the leader's first frame was not 'start': it runs a different dsv41")
            open_collectives(engine.mesh)
    except LostProcess as e:
        log.error("%s", e)
        _exit_now(EXIT_LOST)
    except SystemExit as e:
        log.error("%s", e)
        _exit_now(2)
    except Exception:
        log.exception("process %d failed to start", cluster.process_id)
        _exit_now(2)

    if cluster.is_leader:
        try:
            status = lead(leader)
        finally:
            if on_lost.why is None:
                leader.stop_followers()
        if on_lost.why is not None:  # its timer exits; the collectives of a shutdown would wait for the lost one
            _exit_now(EXIT_LOST)
        return status
    try:
        status = follow(engine, peer, frames)
    except LostProcess as e:
        log.error("%s", e)
        _exit_now(EXIT_LOST)
    except Exception as e:  # the leader learns why at once, rather than from a connection that closes
        log.exception("the engine failed on process %d", cluster.process_id)
        try:
            peer.send({"op": "error", "message": f"{type(e).__name__}: {e}"})
        except LostProcess:
            pass
        _exit_now(1)
    jax.distributed.shutdown()
    return status
