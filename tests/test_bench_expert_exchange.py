"""scripts/bench_expert_exchange.py on 8 CPU devices (tiny widths): both exchanges run, agree, and fill the table
a multi-GPU run reports."""

import jax
import pytest

import bench_expert_exchange as bee

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS host device count)")


def test_bench_runs_both_exchanges_and_counts_the_rows():
    rows = bee.main(["--preset", "tiny", "--tokens", "3", "--iters", "1", "--link-mib", "1", "--out", ""])
    by = {r["exchange"]: r for r in rows}
    assert set(by) == {"allgather_reducescatter", "ragged_all_to_all"}
    ag, ra = by["allgather_reducescatter"], by["ragged_all_to_all"]
    assert ag["rows_a_rank"] == 8 * 3
    # top-2 of 8 experts over 8 ranks (one expert each): every token to 2 ranks
    assert ra["rows_a_rank"] == 2 * 3 and ra["mb_there"] < ag["mb_there"]
