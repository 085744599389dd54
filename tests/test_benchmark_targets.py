"""The context-parallel benchmark's reading of its rows: the load-balance target with each GPU's
speed divided out (`benchmarks.bench_context_parallel.speed_normalized_idle`)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_context_parallel import retarget, speed_normalized_idle


def _row(n, method, busy, reason=None):
    return {"seq_len": n, "method": method, "busy_ms_per_rank": busy, "reason": reason,
            "max_idle_share": 1 - min(busy) / max(busy)}


def test_a_slow_gpu_is_divided_out_and_an_unequal_split_is_not():
    # GPU 1 runs 10% slower: the dense row (equal work) and a balanced sparse row show it alike.
    rows = [_row(1024, "pbs_defaults", [100.0, 110.0, 100.0, 100.0], reason="dense"),
            _row(1024, "pbs_budget_0.2", [20.0, 22.0, 20.0, 20.0]),
            # unequal work on rank 3 (30% more), on the same GPUs
            _row(1024, "unbalanced", [20.0, 22.0, 20.0, 26.0])]
    idle = speed_normalized_idle(rows)
    assert rows[1]["max_idle_share"] == pytest.approx(1 - 20 / 22)  # raw: the slow GPU shows
    assert idle["pbs_budget_0.2"] == pytest.approx(0.0, abs=1e-12)
    assert idle["unbalanced"] == pytest.approx(1 - 20 / 26)
    assert "pbs_defaults" not in idle  # the gauge is not scored against itself


def test_lengths_without_a_dense_row_are_skipped_and_the_worst_length_counts():
    rows = [_row(1024, "pbs_budget_0.2", [20.0, 30.0]),  # no gauge at 1024
            _row(2048, "pbs_defaults", [100.0, 100.0], reason="dense"),
            _row(2048, "pbs_budget_0.2", [20.0, 25.0]),
            _row(4096, "pbs_defaults", [100.0, 100.0], reason="dense"),
            _row(4096, "pbs_budget_0.2", [20.0, 21.0])]
    assert speed_normalized_idle(rows) == {"pbs_budget_0.2": pytest.approx(1 - 20 / 25)}


def test_retarget_rewrites_only_the_targets(tmp_path):
    rows = [{**_row(524288, "pbs_defaults", [100.0, 110.0], reason="dense"), "time_ms": 110.0},
            {**_row(524288, "pbs_budget_0.2", [20.0, 22.0]), "time_ms": 22.0}]
    saved = {"rows": rows, "one_gpu": [], "world": 2, "targets": {"old": True}, "git_revision": "abc"}
    path = tmp_path / "cp.json"
    path.write_text(json.dumps(saved))
    retarget(path)
    result = json.loads(path.read_text())
    assert result["git_revision"] == "abc" and result["rows"] == rows
    assert "old" not in result["targets"]
    assert result["targets"]["max_idle_share_per_gpu_speed"] == {"pbs_budget_0.2": pytest.approx(0.0, abs=1e-12)}
