"""How far start-up compilation is, as state that other threads read (the server's /health) while the engine
thread warms up, and the one log line per program that says what each cost."""

from __future__ import annotations

import dataclasses
import re
import threading
import time


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    kind: str  # encoder / decoder / full / decode
    B: int  # rows
    T: int  # tokens per row
    pages: int  # block-table pages
    lower_s: float
    compile_s: float
    source: str  # compile_events.HIT / COMPILED / IN_MEMORY


class WarmupProgress:
    """Written by the warming thread, read by any: every read and write holds one lock, and `snapshot()` is a
    copy. Two phases: compiling (programs_compiled counts up; with a persistent cache, in several threads) and
    loading (programs_ready counts up as each program is loaded and run once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._programs = 0
        self._compiled = 0
        self._ready = 0
        self._started: float | None = None
        self._done = False
        self._reports: list[ProgramReport] = []

    def start(self, programs: int) -> None:
        with self._lock:
            self._programs, self._compiled, self._ready = programs, 0, 0
            self._started, self._done, self._reports = time.monotonic(), False, []

    def compiled(self, report: ProgramReport) -> float | None:
        """Counts a compiled program; -> the ETA of the compile phase in seconds (None before the first)."""
        with self._lock:
            self._compiled += 1
            self._reports.append(report)
            return self._eta(self._compiled)

    def loaded(self) -> None:
        with self._lock:
            self._ready += 1

    def finish(self) -> None:
        with self._lock:
            self._done = True

    @property
    def total(self) -> int:
        with self._lock:
            return self._programs

    @property
    def done(self) -> bool:
        with self._lock:
            return self._done

    @property
    def reports(self) -> list[ProgramReport]:
        with self._lock:
            return list(self._reports)

    def _eta(self, count: int) -> float | None:
        if not count or self._started is None:
            return None
        elapsed = time.monotonic() - self._started
        return elapsed / count * (self._programs - count)

    def snapshot(self) -> dict:
        """{"programs_ready", "programs", "programs_compiled", "eta_s" (None: not known yet), "done"}."""
        with self._lock:
            return {"programs_ready": self._ready, "programs": self._programs, "programs_compiled": self._compiled,
                    "eta_s": self._eta(self._compiled), "done": self._done}


def report_line(i: int, n: int, r: ProgramReport, eta_s: float | None) -> str:
    """One warm-up log line: '3/12 decode B=2 T=1 pages=8: compiled, lower 0.31 s, compile 4.20 s, ETA 35 s'."""
    eta = "" if eta_s is None else f", ETA {eta_s:.0f} s"
    return (f"{i}/{n} {r.kind} B={r.B} T={r.T} pages={r.pages}: {r.source}, lower {r.lower_s:.2f} s, "
            f"compile {r.compile_s:.2f} s{eta}")


_REPORT_LINE = re.compile(r"(\d+)/(\d+) (\w+) B=(\d+) T=(\d+) pages=(\d+): ([\w ]+), lower ([\d.]+) s, "
                          r"compile ([\d.]+) s")


def parse_report_line(text: str) -> ProgramReport | None:
    """The `ProgramReport` of a `report_line` found in text (a server's log line), or None."""
    m = _REPORT_LINE.search(text)
    if m is None:
        return None
    kind, B, T, pages, source, lower_s, compile_s = m.groups()[2:]
    return ProgramReport(kind, int(B), int(T), int(pages), float(lower_s), float(compile_s), source)
