"""Ranks that disagree, or one rank whose checks fail, raise the same ValueError on every rank.

Before `pbs.distributed.agreement`, each case below hung until the process group's timeout,
aborted the process (gloo's size check) or returned a silently mixed result. Here 2 and 4 gloo
processes run every case in turn, one rank (`odd_rank`) asked something else, and after each a
small all-reduce shows the group still works; at the end an agreeing call runs and is held to one
process. A case that hangs fails its worker after `PG_TIMEOUT`, and the spawn after
`JOIN_TIMEOUT_S`.

Run as a script, this file is one rank (``python tests/test_rank_agreement.py WORKDIR RANK WORLD``).
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_ranks

PG_TIMEOUT = datetime.timedelta(seconds=20)
JOIN_TIMEOUT_S = 50
SMALL = {"block_size": 32, "segment_size": 64, "dense_fallback": {"min_seq_len": 0}}
SEQ_LEN = 8 * 64 + 20  # 8 segments: enough for 4 ranks, and a partial last one
SHAPE = dict(batch=1, head_dim=16)  # D 16: the default scale is 0.25


def odd_rank(world: int) -> int:
    return 1 if world == 2 else 2  # on 4 ranks, the others are 0, 1 and 3: the error groups them


def _mean_pool(threshold: float) -> dict:
    return {**SMALL, "selector": {"name": "mean_pool", "threshold": threshold}}


def _length_rule(min_seq_len: int) -> dict:
    return {**SMALL, "dense_fallback": {"min_seq_len": min_seq_len, "devices": ["cpu"]}}


def _with_nan(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 0, 3, 0] = float("nan")
    return x


# (what the odd rank passes, what the others pass, what every rank's error must contain)
# {odd} and {world} are filled in. Keys: config, scale, q (a function of q).
CP_CASES = {
    "config": ({"config": {**SMALL, "permuter": "last_block", "selector": "mean_pool"}}, {"config": SMALL},
               ['config.permuter.name (', '{odd_rank}: "last_block"', 'config.selector.name (']),
    "min_seq_len": ({"config": _length_rule(0)}, {"config": _length_rule(1 << 20)},
                    ["config.dense_fallback.min_seq_len (", "{odd_rank}: 0"]),
    "block_size": ({"config": {**SMALL, "block_size": 64}}, {"config": SMALL},
                   ["config.block_size (", "{odd_rank}: 64", ": 32"]),
    "threshold": ({"config": _mean_pool(0.5)}, {"config": _mean_pool(0.99)},
                  ["config.selector.threshold (", "{odd_rank}: 0.5", ": 0.99"]),
    "scale": ({"config": SMALL, "scale": 0.5}, {"config": SMALL}, ["disagree on scale (", "{odd_rank}: 0.5", ": 0.25"]),
    "unsupported": ({"config": {**SMALL, "selector": "sampled_rows"}}, {"config": SMALL},
                    ["rank {odd} of {world} failed its input checks: config cannot be planned context-parallel yet"]),
    "nan": ({"config": SMALL, "q": _with_nan}, {"config": SMALL},
            ["rank {odd} of {world} failed its input checks: q contains NaN"]),
    "grad": ({"config": SMALL, "q": lambda x: x.clone().requires_grad_()}, {"config": SMALL},
             ["rank {odd} of {world} failed its input checks: PBS attention is forward-only"]),
}

# Tensor parallelism's check (pbs.integrations.tensor_parallel) on each rank's heads.
TP_CASES = {
    "tp_threshold": ({"config": _mean_pool(0.5)}, {"config": _mean_pool(0.99)},
                     ["tensor-parallel ranks disagree on config.selector.threshold (", "{odd_rank}: 0.5"]),
    "tp_scale": ({"config": SMALL, "scale": 0.5}, {"config": SMALL}, ["tensor-parallel ranks disagree on scale ("]),
    "tp_nan": ({"config": SMALL, "q": _with_nan}, {"config": SMALL},
               ["tensor-parallel rank {odd} of {world} failed its input checks: q contains NaN"]),
    # the odd rank runs SDPA (its q needs grad), the others PBS
    "tp_dispatch": ({"config": SMALL, "dispatch": "needs_grad"}, {"config": SMALL},
                    ['tensor-parallel ranks disagree on dispatch (', '{odd_rank}: "needs_grad"', ': "pbs"']),
    # the odd rank's layer is configured dense
    "tp_dense_layer": ({"config": None, "dispatch": "skipped_layer"}, {"config": SMALL},
                       ["{odd_rank}: no config (a dense layer)", "dispatch ("]),
}

# The odd rank makes a tensor-parallel call while the others make a context-parallel one.
MIXED_CASE = {"call": ["ranks disagree on the call (", '{odd_rank}: "tensor-parallel"', ': "context-parallel"']}

EXPECTED = {name: case[2] for name, case in {**CP_CASES, **TP_CASES}.items()} | MIXED_CASE


def inputs(world: int):
    import pbs

    # 2 query heads and 1 KV head per rank under tensor parallelism
    return pbs.testing.make_qkv(seq_len=SEQ_LEN, heads_q=2 * world, heads_kv=world, seed=4, **SHAPE)


# --------------------------------------------------------------------------------------------
# One rank (run as a script)


def rank_main(workdir: Path, rank: int, world: int) -> None:
    import torch.distributed as dist

    import pbs.distributed as cp
    from pbs.integrations.tensor_parallel import HeadShard, attention_on_shard, check_ranks_agree

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'rendezvous'}", rank=rank, world_size=world,
                            timeout=PG_TIMEOUT)
    odd = rank == odd_rank(world)
    whole = inputs(world)
    cp_shards = [cp.shard_sequence(x, rank, world, segment_size=64) for x in whole]
    # Tensor parallelism: 2 query heads and 1 KV head per rank.
    tp_heads = (whole[0][:, 2 * rank:2 * rank + 2], whole[1][:, rank:rank + 1], whole[2][:, rank:rank + 1])
    shard = HeadShard(rank, world)

    def arguments(case: tuple, q: torch.Tensor) -> dict:
        chosen = case[0] if odd else case[1]
        return {"q": chosen.get("q", lambda x: x)(q), "config": chosen["config"], "scale": chosen.get("scale"),
                "dispatch": chosen.get("dispatch", "pbs")}

    def run_cp(case: tuple) -> None:
        a = arguments(case, cp_shards[0])
        cp.context_parallel_attend(a["q"], *cp_shards[1:], a["config"], scale=a["scale"])

    def run_tp(case: tuple) -> None:
        a = arguments(case, tp_heads[0])
        if a["dispatch"] == "pbs":
            attention_on_shard(a["q"], *tp_heads[1:], a["config"], scale=a["scale"], shard=shard)
        else:
            check_ranks_agree(shard, a["config"], a["q"], *tp_heads[1:], scale=a["scale"], dispatch=a["dispatch"])

    calls = {name: (lambda case=case: run_cp(case)) for name, case in CP_CASES.items()}
    calls |= {name: (lambda case=case: run_tp(case)) for name, case in TP_CASES.items()}
    calls["call"] = lambda: run_tp(TP_CASES["tp_scale"]) if odd else run_cp(CP_CASES["scale"])
    results: dict = {"errors": {}, "group_works": {}}
    try:
        for name, call in calls.items():
            with torch.no_grad() if not name.endswith("grad") else torch.enable_grad():
                try:
                    call()
                    results["errors"][name] = None
                except Exception as error:  # recorded: the test says what is expected
                    results["errors"][name] = (type(error).__name__, str(error))
            total = torch.tensor([rank + 1.0])
            dist.all_reduce(total)
            results["group_works"][name] = float(total) == world * (world + 1) / 2
        # Then calls that agree run as they should.
        with torch.no_grad():
            results["cp_out"] = cp.context_parallel_attend(*cp_shards, SMALL).out
            results["tp_out"] = attention_on_shard(*tp_heads, _mean_pool(0.9), scale=None, shard=shard)[0]
        torch.save(results, workdir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The tests


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks(request, tmp_path_factory):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    world = request.param
    return world, run_ranks(__file__, tmp_path_factory.mktemp(f"agree{world}"), world, timeout=JOIN_TIMEOUT_S)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_rank_raises_the_same_error(ranks, name):
    world, results = ranks
    errors = [r["errors"][name] for r in results]
    assert all(error is not None and error[0] == "ValueError" for error in errors), errors
    assert len({message for _, message in errors}) == 1, f"the ranks' messages differ: {errors}"
    message = errors[0][1]
    odd = odd_rank(world)
    others = ", ".join(str(r) for r in range(world) if r != odd)
    for part in EXPECTED[name]:
        part = part.format(odd=odd, world=world, odd_rank=f"rank {odd}")
        assert part in message, f"{part!r} not in {message!r}"
    if "disagree" in message:
        assert (f"ranks {others}: " if world > 2 else f"rank {others}: ") in message, message
    assert all(r["group_works"][name] for r in results)


def test_agreeing_calls_afterwards_equal_one_process(ranks):
    import pbs
    from pbs.distributed import unshard_sequence

    world, results = ranks
    q, k, v = inputs(world)
    cp_out = unshard_sequence([r["cp_out"] for r in results], segment_size=64)
    torch.testing.assert_close(cp_out, pbs.attention(q, k, v, SMALL), rtol=2e-5, atol=2e-5)
    tp_out = torch.cat([r["tp_out"] for r in results], dim=1)
    torch.testing.assert_close(tp_out, pbs.attention(q, k, v, _mean_pool(0.9)), rtol=2e-5, atol=2e-5)


def test_a_long_failure_message_is_cut_to_fit_the_record():
    from pbs.distributed.agreement import RECORD_BYTES, _decode, _encode

    record = {"call": "context-parallel", "config": None, "config_bytes": 0, "same": [["scale", 0.25]],
              "own": {"Nq": 128}, "failure": "q contains NaN " + "é" * 2000}
    data = _encode(record)
    assert len(data) <= RECORD_BYTES
    row = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    row[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    decoded = _decode(row)
    assert decoded is not None and decoded["failure"].startswith("q contains NaN é") and decoded["failure"].endswith(" ...")
    assert {key: decoded[key] for key in record if key != "failure"} == {key: record[key] for key in record if key != "failure"}
    assert _decode(torch.full((RECORD_BYTES,), 7, dtype=torch.uint8)) is None  # not a record: named, not parsed


@pytest.mark.gpu
def test_one_nccl_rank_keeps_its_record_on_the_gpu(tmp_path):
    """Under NCCL the record lives on the rank's GPU (`record_device`): an agreeing call equals one
    process, a failed check raises the named ValueError, and the group works after it."""
    import torch.distributed as dist

    import pbs
    import pbs.distributed as cp

    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        pytest.skip("needs CUDA and NCCL")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            timeout=PG_TIMEOUT)
    try:
        q, k, v = (x.cuda() for x in inputs(1))
        # every block, so that no threshold can flip between the two paths' rounding
        config = {**SMALL, "selector": {"name": "budget", "density": 1.0},
                  "dense_fallback": {"min_seq_len": 0, "max_density": None}}
        out = cp.context_parallel_attend(q, k, v, config).out
        torch.testing.assert_close(out, pbs.attention(q, k, v, config), rtol=1e-2, atol=1e-2)
        with pytest.raises(ValueError, match="context-parallel rank 0 of 1 failed its input checks: q contains NaN"):
            cp.context_parallel_attend(_with_nan(q), k, v, {**config, "check_finite": True})
        total = torch.ones(1, device="cuda")
        dist.all_reduce(total)
        assert float(total) == 1.0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
