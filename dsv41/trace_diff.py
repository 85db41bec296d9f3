"""Two traced forwards (`model.forward_with_trace`) compared where they can legitimately part: the discrete
choices. Indexer top-k, layer-20-style candidate blocks and the routed experts are selections; float32 (or a
kernel's) summation order moves scores by ulps, and where two scores tie that closely a correct model may keep
either. A flip at (row, position) changes that position's output and, through the KV it writes, every later
position of the row; positions before it are unaffected. So a comparison finds each row's first flip, checks
that it was a tie, and compares values only before it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

SELECTIONS = ("topk", "candidates", "moe.experts")

# scores(layer, name, row, pos) -> the scores run `a` chose from at that query ([N] float), or None
ScoresFn = Callable[[int, str, int, int], "np.ndarray | None"]


@dataclasses.dataclass(frozen=True)
class Flip:
    """A row's first differing selection: run a kept `a_only`, run b kept `b_only` instead. `spread` is the
    relative spread of all those entries' scores in run a (a tie: ~1e-7; None where the trace has no scores)."""

    layer: int
    name: str
    row: int
    pos: int
    a_only: np.ndarray
    b_only: np.ndarray
    spread: float | None


def index_scores(trace: dict) -> ScoresFn:
    """Scores of the indexer top-k from a trace (`layerN.index_scores`); other selections: None."""
    def get(layer, name, row, pos):
        key = f"layer{layer}.index_scores"
        return np.asarray(trace[key])[row, pos] if name == "topk" and key in trace else None
    return get


def first_flips(a: dict, b: dict, n_layers: int, scores: ScoresFn | None = None) -> dict[int, Flip]:
    """Per batch row, the first (lowest position, then lowest layer) selection that differs between traces a
    and b; rows where every selection agrees are absent."""
    scores = scores or index_scores(a)
    out: dict[int, Flip] = {}
    for i in range(n_layers):
        for name in SELECTIONS:
            key = f"layer{i}.{name}"
            if key not in a:
                continue
            sa, sb = np.asarray(a[key]), np.asarray(b[key])
            rows, seq = sa.shape[:2]
            diff = (sa != sb).reshape(rows, seq, -1).any(-1)
            for row in range(rows):
                stop = out[row].pos if row in out else seq
                for p in np.flatnonzero(diff[row, :stop]):
                    flip = _flip(i, name, row, int(p), sa[row, p], sb[row, p], scores)
                    if flip is not None:
                        out[row] = flip
                        break
    return out


def _flip(layer: int, name: str, row: int, pos: int, ka: np.ndarray, kb: np.ndarray, scores: ScoresFn) -> Flip | None:
    """The flip at one position, or None where both runs kept the same set in another order (a top-k of scores
    that moved by ulps may list its picks in another order; attention and the MoE use them as a set)."""
    ka, kb = ka.reshape(-1), kb.reshape(-1)
    if name == "candidates":  # a mask over positions, not ids
        ka, kb = np.flatnonzero(ka), np.flatnonzero(kb)
    a_only, b_only = np.setdiff1d(ka, kb), np.setdiff1d(kb, ka)
    a_only, b_only = a_only[a_only >= 0], b_only[b_only >= 0]  # -1: not visible
    if not (a_only.size or b_only.size):
        return None
    s = scores(layer, name, row, pos)
    spread = None
    if s is not None:
        v = np.asarray(s, np.float64)[np.concatenate([a_only, b_only])]
        spread = float(np.ptp(v) / max(np.abs(v).max(), 1e-30))
    return Flip(layer, name, row, pos, a_only, b_only, spread)


def compared_prefix(flips: dict[int, Flip], rows: int, seq: int) -> np.ndarray:
    """int [rows]: how many leading positions of each row are untouched by a flip."""
    return np.asarray([flips[r].pos if r in flips else seq for r in range(rows)])
