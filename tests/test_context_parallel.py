"""Context-parallel PBS prefill (`pbs.distributed`) against one process, with gloo on the CPU.

2 and 4 processes each take their zigzag shard of one structured sequence (fp32, GQA 4:2) and run
`pbs.distributed.context_parallel_attend` for every case below; the test then holds each rank's
output shard to the one-process `pbs.attention` (fp32 noise), its two chunks' masks to the rows of
the one-process `pbs.plan` mask (the same blocks), and its dense decision to the one-process one.
Lengths are uneven: whole segments left over for some ranks, and a partial last segment.

Run as a script, this file is one rank of such a run (``python test_context_parallel.py WORKDIR
RANK WORLD``).
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_ranks

ROOT = Path(__file__).resolve().parents[1]
# A collective that waits longer fails its worker (and so the test) instead of hanging for torch's
# default 30 minutes.
PG_TIMEOUT = datetime.timedelta(seconds=30)

SHAPE = dict(batch=1, heads_q=4, heads_kv=2, head_dim=32)
# Uneven on purpose: 2 ranks get 9 whole segments + 100 tokens (a leftover segment and a partial
# last one); 4 ranks get 8 whole segments + 44 tokens.
SEQ_LENS = {2: 9 * 256 + 100, 4: 8 * 256 + 44}
SPARSE = {"min_seq_len": 0}  # plan on the CPU (the dense policy's length rule would skip it)
CASES = {
    # every allowed block: the output is dense causal attention
    "full": {"selector": {"name": "budget", "density": 1.0}, "dense_fallback": SPARSE},
    # the paper's unpermuted MeanPooling: pooled keys of every rank
    "mean_pool": {"selector": {"name": "mean_pool", "threshold": 0.9}, "dense_fallback": SPARSE},
    # the defaults (union of vertical_slash and mean_pool): last rows broadcast, line scores summed,
    # pooled keys gathered
    "defaults": {"dense_fallback": SPARSE},
    # the paper's preset: last_block key order (per-head GQA) scored over every rank's keys
    "pbs_paper": {"permuter": "last_block", "selector": "mean_pool", "gqa": "per_head", "dense_fallback": SPARSE},
    "last_block_shared": {"permuter": "last_block", "gqa": "shared", "dense_fallback": SPARSE},
    # XAttention's estimator: planned on the gathered keys of the prefix (it reads the keys themselves)
    "xattention": {"selector": {"name": "antidiagonal", "threshold": 0.9}, "dense_fallback": SPARSE},
    "pbs_xattention": {"permuter": "last_block", "selector": "antidiagonal", "dense_fallback": SPARSE},
    # the dense policy on the CPU: the probe over the whole sequence, and the length rule
    "probe": {"selector": {"name": "mean_pool", "threshold": 0.9},
              "dense_fallback": {"min_seq_len": 0, "devices": ["cpu"], "max_density": 0.3, "planning_cost_pairs": 0}},
    "planned_density": {"selector": {"name": "budget", "density": 1.0},
                        "dense_fallback": {"min_seq_len": 0, "devices": ["cpu"], "max_planned_density": 0.9,
                                           "planning_cost_pairs": 0}},
    "length": {"dense_fallback": {"min_seq_len": 1 << 20, "devices": ["cpu"]}},
    # the whole sequence's Nq x Nk (not a rank's chunk) is below the planning cost
    "planning_cost": {"dense_fallback": {"min_seq_len": 0, "devices": ["cpu"]}},
}


# The triton backend in the Triton interpreter (2 ranks): small blocks and segments keep it quick.
INTERPRETER_LEN = 4 * 128 + 3 * 64 + 40
_SMALL = {"backend": "triton", "block_size": 32, "segment_size": 64, "dense_fallback": SPARSE,
          "selector": {"name": "union", "selectors": [{"name": "vertical_slash", "threshold": 0.75, "last_rows": 16},
                                                      {"name": "mean_pool", "threshold": 0.9}]}}
INTERPRETER_CASES = {"defaults": _SMALL, "last_block": {**_SMALL, "permuter": "last_block", "gqa": "per_head"}}


# Two sequences in one call: each is planned on its own, on every rank as in one process.
BATCH2_CASES = ("defaults", "pbs_paper")


def inputs(world: int, batch: int = 1):
    import pbs

    return pbs.testing.make_qkv(seq_len=SEQ_LENS[world], seed=3, **{**SHAPE, "batch": batch})


# --------------------------------------------------------------------------------------------
# One rank (run as a script)


def rank_main(workdir: Path, rank: int, world: int) -> None:
    import torch.distributed as dist

    import pbs.distributed as cp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'rendezvous'}", rank=rank, world_size=world,
                            timeout=PG_TIMEOUT)
    try:
        q, k, v = inputs(world)
        q, k, v = (cp.shard_sequence(x, rank, world) for x in (q, k, v))
        results = {}
        for name, config in CASES.items():
            res = cp.context_parallel_attend(q, k, v, config, return_lse=name == "defaults")
            results[name] = {
                "out": res.out, "lse": res.lse, "reason": res.reason, "chunks": res.chunks,
                "masks": [None if p is None else p.mask.to_dense() for p in res.plans],
                "orders": [None if p is None else p.key_permutation.indices for p in res.plans],
            }
        batch2 = [cp.shard_sequence(x, rank, world) for x in inputs(world, batch=2)]
        results["batch2"] = {}
        for name in BATCH2_CASES:
            res = cp.context_parallel_attend(*batch2, CASES[name])
            results["batch2"][name] = {"out": res.out, "masks": [p.mask.to_dense() for p in res.plans],
                                       "chunks": res.chunks}
        results["errors"] = error_cases(q, k, v, rank, world)
        if world == 2 and os.environ.get("TRITON_INTERPRET") == "1":
            import pbs

            whole = pbs.testing.make_qkv(seq_len=INTERPRETER_LEN, seed=2, **SHAPE)
            results["interpreter"] = {}
            for name, config in INTERPRETER_CASES.items():
                shards = (cp.shard_sequence(x, rank, world, segment_size=config["segment_size"]) for x in whole)
                res = cp.context_parallel_attend(*shards, config)
                results["interpreter"][name] = {"out": res.out, "chunks": res.chunks,
                                                "masks": [p.mask.to_dense() for p in res.plans]}
        torch.save(results, workdir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def error_cases(q, k, v, rank: int, world: int) -> dict[str, str]:
    import pbs.distributed as cp

    errors = {}
    calls = {
        "unsupported": lambda: cp.context_parallel_attention(q, k, v, {"selector": "sampled_rows"}),
        # every rank drops a different number of tokens: the split is no longer the zigzag one
        "not_zigzag": lambda: cp.context_parallel_attention(q[:, :, rank:], k[:, :, rank:], v[:, :, rank:]),
        "heads": lambda: cp.context_parallel_attention(q[:, : 2 + 2 * (rank % 2)], k, v),
        "too_short": lambda: cp.context_parallel_attention(q[:, :, :300], k[:, :, :300], v[:, :, :300]),
    }
    for name, call in calls.items():
        try:
            call()
        except (ValueError, RuntimeError) as error:
            errors[name] = str(error)
    return errors


# --------------------------------------------------------------------------------------------
# The tests


def _gloo_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def _spawn(workdir: Path, world: int) -> list[dict]:
    return run_ranks(__file__, workdir, world, timeout=150)


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def cp_run(request, tmp_path_factory):
    if not _gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    world = request.param
    return world, _spawn(tmp_path_factory.mktemp(f"cp{world}"), world)


@functools.lru_cache(maxsize=None)
def _one_process(world: int, name: str):
    import pbs
    from pbs.dense import DensePolicy

    q, k, v = inputs(world)
    config = pbs.PBSConfig.coerce(CASES[name])
    attended = pbs.api.attend(q, k, v, DensePolicy(config, return_lse=name == "defaults"))
    return q, k, attended, pbs.plan(q, k, config)


def _join(ranks: list[dict], name: str, key: str) -> torch.Tensor:
    from pbs.distributed import unshard_sequence

    return unshard_sequence([r[name][key] for r in ranks])


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_equals_one_process(cp_run, name):
    world, ranks = cp_run
    q, _, attended, _ = _one_process(world, name)
    out = _join(ranks, name, "out")
    assert out.shape == attended.out.shape
    torch.testing.assert_close(out, attended.out, rtol=2e-5, atol=2e-5)
    if name == "defaults":
        torch.testing.assert_close(_join(ranks, name, "lse"), attended.lse, rtol=2e-5, atol=2e-5)
    if name == "full":
        dense = torch.nn.functional.scaled_dot_product_attention(
            q, *(x.repeat_interleave(2, dim=1) for x in inputs(world)[1:]), is_causal=True)
        torch.testing.assert_close(out, dense, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_dense_decision_equals_one_process(cp_run, name):
    world, ranks = cp_run
    _, _, attended, _ = _one_process(world, name)
    reasons = {r[name]["reason"] for r in ranks}
    assert len(reasons) == 1, f"ranks decided differently: {reasons}"
    (reason,) = reasons
    assert (reason is None) == (attended.reason is None), (reason, attended.reason)
    expected_dense = {"probe", "planned_density", "length", "planning_cost"}
    assert (reason is not None) == (name in expected_dense), reason
    if name == "planning_cost":
        assert reason == attended.reason  # the whole sequence's Nq x Nk, as one process sees it
    elif reason is not None and name != "length":
        assert f"over the {world} context-parallel ranks" in reason


@pytest.mark.parametrize("name", ["full", "mean_pool", "defaults", "pbs_paper", "last_block_shared", "xattention",
                                  "pbs_xattention"])
def test_masks_are_the_rows_of_the_one_process_mask(cp_run, name):
    world, ranks = cp_run
    _, _, _, plan = _one_process(world, name)
    whole = plan.mask.to_dense()  # (B, Hq, Tq, Tk)
    bs = plan.layout.block_size
    assert 0 < plan.density <= 1
    for rank, result in enumerate(ranks):
        for (start, end), mask, order in zip(result[name]["chunks"], result[name]["masks"], result[name]["orders"]):
            # the same key order (keys sorted inside each segment by the last block's attention)
            assert torch.equal(order, plan.key_permutation.indices[..., :end])
            rows = whole[:, :, start // bs: -(-end // bs)]
            tk = mask.shape[-1]
            assert tk == -(-end // bs)
            assert torch.equal(mask, rows[..., :tk]), f"rank {rank}, chunk [{start}, {end}): masks differ"
            assert not rows[..., tk:].any()


@pytest.mark.parametrize("name", BATCH2_CASES)
def test_a_batch_of_two_equals_one_process(cp_run, name):
    # B = 2: both sequences' outputs and masks equal one process on the same batch.
    import pbs
    from pbs.dense import DensePolicy
    from pbs.distributed import unshard_sequence

    world, ranks = cp_run
    q, k, v = inputs(world, batch=2)
    config = pbs.PBSConfig.coerce(CASES[name])
    attended = pbs.api.attend(q, k, v, DensePolicy(config))
    assert attended.reason is None  # planned, not dense: the masks below are what is compared
    out = unshard_sequence([r["batch2"][name]["out"] for r in ranks])
    assert out.shape == (2, *attended.out.shape[1:])
    torch.testing.assert_close(out, attended.out, rtol=2e-5, atol=2e-5)
    whole = pbs.plan(q, k, config).mask.to_dense()
    bs = config.block_size
    assert not torch.equal(whole[0], whole[1])  # two different sequences, two different masks
    for result in ranks:
        for (start, end), mask in zip(result["batch2"][name]["chunks"], result["batch2"][name]["masks"]):
            assert torch.equal(mask, whole[:, :, start // bs: -(-end // bs), : mask.shape[-1]])


def test_chunks_follow_the_zigzag_rule(cp_run):
    from pbs.distributed import chunk_bounds

    world, ranks = cp_run
    bounds = chunk_bounds(SEQ_LENS[world], world)
    assert all(start % 256 == 0 for start, _ in bounds) and bounds[-1][1] == SEQ_LENS[world]
    for rank, result in enumerate(ranks):
        assert result["full"]["chunks"] == (bounds[rank], bounds[2 * world - 1 - rank])


def test_errors_name_the_problem(cp_run):
    world, ranks = cp_run
    for result in ranks:
        errors = result["errors"]
        assert "selector 'sampled_rows' does not declare the whole-sequence summaries" in errors["unsupported"]
        assert "zigzag split" in errors["not_zigzag"] and "shard_sequence" in errors["not_zigzag"]
        assert errors["heads"].startswith("context-parallel ranks disagree on Hq (")
        assert f"too short to split over {world} ranks" in errors["too_short"]


def _components(config: dict) -> set[tuple[str, str]]:
    import pbs

    parsed = pbs.PBSConfig(**config)
    pending, found = [parsed.selector], {("permuter", parsed.permuter.name)}
    while pending:
        selector = pending.pop()
        found.add(("selector", selector.name))
        pending.extend(getattr(selector, "selectors", ()))
    return found


def _registered() -> list[tuple[str, str]]:
    import pbs

    return [("selector", n) for n in pbs.list_selectors()] + [("permuter", n) for n in pbs.list_permuters()]


@pytest.mark.parametrize("kind, name", _registered())
def test_every_registered_component_runs_over_ranks_or_is_refused_by_its_declaration(kind, name):
    """The registry drives this (issue 36): a component context parallelism takes (from its
    declaration: a selector's ``sequence_summaries``, a permuter's planner in the
    ``CONTEXT_PARALLEL`` family) must be one the spawned ranks hold to one process (`CASES`);
    the others get a refusal that names them."""
    import pbs
    from pbs.distributed import unsupported_reasons

    config = {"permuter": "none", "selector": name} if kind == "selector" else {"permuter": name}
    reasons = unsupported_reasons(pbs.PBSConfig(**config))
    if reasons:
        assert any(f"{kind} {name!r}" in reason for reason in reasons), reasons
    else:
        covered = set().union(*(_components(case) for case in CASES.values()))
        assert (kind, name) in covered, f"{kind} {name!r} is taken by context parallelism but no CASES entry runs it"


def test_shard_helpers_round_trip_and_balance():
    from pbs.distributed import chunk_bounds, shard_length, shard_sequence, unshard_sequence

    x = torch.arange(8 * 256 * 3 + 5 * 256 + 77).view(1, 1, -1, 1)
    for world in (1, 2, 3, 4):
        shards = [shard_sequence(x, r, world) for r in range(world)]
        assert torch.equal(unshard_sequence(shards), x)
        lengths = [shard_length(x.shape[2], r, world) for r in range(world)]
        assert [s.shape[2] for s in shards] == lengths
        assert max(lengths) - min(lengths) <= 256 + 77  # at most one leftover segment and the tail
    with pytest.raises(ValueError, match="too short to split over 4 ranks"):
        chunk_bounds(7 * 256, 4)
    with pytest.raises(ValueError, match=r"shards\[0\]"):
        unshard_sequence([x[:, :, :1024], x[:, :, :1000]])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (CPU runs)")
def test_triton_backend_in_the_interpreter_equals_one_process(cp_run):
    """The GPU path on the CPU: the triton planners read the summaries (the union's fused lines,
    mean_pool's pooled keys, a last_block order) and the Triton kernel runs each chunk against
    the gathered prefix (``Nq < Nk``, strided keys)."""
    import pbs
    from pbs.distributed import unshard_sequence
    from pbs.dense import DensePolicy

    world, ranks = cp_run
    if world != 2:
        pytest.skip("run on 2 ranks only (the interpreter is slow)")
    q, k, v = pbs.testing.make_qkv(seq_len=INTERPRETER_LEN, seed=2, **SHAPE)
    for name, config in INTERPRETER_CASES.items():
        config = pbs.PBSConfig.coerce(config)
        attended = pbs.api.attend(q, k, v, DensePolicy(config))
        assert attended.plan is not None and attended.plan.backend == "triton"
        out = unshard_sequence([r["interpreter"][name]["out"] for r in ranks], segment_size=config.segment_size)
        torch.testing.assert_close(out, attended.out, rtol=2e-5, atol=2e-5)
        whole, bs = attended.plan.mask.to_dense(), config.block_size
        for result in ranks:
            for (start, end), mask in zip(result["interpreter"][name]["chunks"], result["interpreter"][name]["masks"]):
                assert torch.equal(mask, whole[:, :, start // bs: -(-end // bs), : mask.shape[-1]]), name


def test_uninitialised_group_is_named():
    import pbs.distributed as cp

    q, k, v = inputs(2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp.context_parallel_attention(q, k, v)


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
