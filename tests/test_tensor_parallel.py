"""Tensor-parallel prefill with ``attn_implementation="pbs"`` through transformers' ``tp_plan="auto"``.

Two CPU processes (gloo) load a tiny random Llama (4 query heads, 2 KV heads: 2:1 on each rank)
with ``DistributedConfig(tp_plan="auto")``, so each rank's attention function gets its own heads
as plain tensors, and PBS plans and runs on them. The logits must equal one process's within fp32
noise, for a config that selects every block (density 1), for a sparse deterministic one
(``last_block`` + ``mean_pool``), and for seeded random components (``random`` + ``budget``), and
every rank must have run PBS (not the SDPA fallback) on every layer.

Direct calls of the attention function on synthetic heads check what the model cannot show on a
random model: ``dense_fallback``'s density rules decide on every rank as one process would (the
per-rank densities straddle the limit), and DTensor inputs sharded on the head axis run PBS on
their local shard.

The workers are this file run as a script (``python tests/test_tensor_parallel.py WORKDIR RANK``),
meeting through a file rendezvous in a temporary directory (no ports to pick).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_model_config

ROOT = Path(__file__).resolve().parents[1]
# A collective that waits longer fails its worker (and so the test) instead of hanging for torch's
# default 30 minutes.
PG_TIMEOUT = datetime.timedelta(seconds=30)
WORLD = 2
SEQ_LEN = 256  # 16 blocks of 16, 8 segments of 32
TOL = 1e-4
SMALL = {"block_size": 16, "segment_size": 32, "backend": "reference"}
MODEL_CONFIGS = {
    "exact": {**SMALL, "permuter": "last_block", "selector": {"name": "budget", "density": 1.0}},
    "sparse": {**SMALL, "permuter": "last_block", "selector": {"name": "mean_pool", "threshold": 0.5}},
    "seeded": {**SMALL, "permuter": "random", "selector": {"name": "budget", "density": 0.5}},
}


def prompt() -> torch.Tensor:
    return torch.randint(3, 128, (1, SEQ_LEN), generator=torch.Generator().manual_seed(1))


def model_logits(model, configs: dict) -> dict:
    """Logits and dispatch records of one prefill per config."""
    import pbs.integrations.transformers as pbs_hf

    results = {}
    for name, config in configs.items():
        pbs_hf.register(config, min_seq_len=32)
        with pbs_hf.trace_dispatch() as calls, torch.no_grad():
            logits = model(input_ids=prompt()).logits
        results[name] = {
            "logits": logits,
            "calls": [[c.layer_idx, c.path, c.reason, c.density, c.tp_rank, c.tp_size] for c in calls],
        }
    return results


# --------------------------------------------------------------------------------------------
# In one process: every registered component plans a head shard as the whole layer does


def _components() -> list[tuple[str, str]]:
    import pbs

    pairs = [(permuter, "mean_pool") for permuter in pbs.list_permuters()]
    return pairs + [("last_block", selector) for selector in pbs.list_selectors() if selector != "mean_pool"]


@pytest.mark.parametrize("permuter, selector", _components())
@pytest.mark.parametrize("gqa", ["shared", "per_head"])
def test_head_shards_plan_as_the_whole_layer(permuter, selector, gqa):
    """PBS on each of two head shards (inside `head_shard`) equals PBS on all heads, sliced."""
    import pbs
    from pbs.reference.seeded import head_shard

    q, k, v = pbs.testing.make_qkv(seq_len=160, heads_q=4, heads_kv=2, head_dim=16)
    config = {**SMALL, "permuter": permuter, "selector": selector, "gqa": gqa}
    whole = pbs.attention(q, k, v, config)
    for rank in range(WORLD):
        with head_shard(rank, WORLD):
            part = pbs.attention(q[:, 2 * rank : 2 * rank + 2], k[:, rank : rank + 1], v[:, rank : rank + 1], config)
        assert float((part - whole[:, 2 * rank : 2 * rank + 2]).abs().max()) < 1e-5, (permuter, selector, gqa, rank)


# --------------------------------------------------------------------------------------------
# The worker: one rank


def synthetic_heads():
    """q, k, v whose first two query heads (rank 0's) are structured and last two (rank 1's) nearly flat."""
    import pbs

    q, k, v = pbs.testing.make_qkv(seq_len=SEQ_LEN, heads_q=4, heads_kv=2, head_dim=16)
    q[:, 2:] = 0.01 * torch.randn(q[:, 2:].shape, generator=torch.Generator().manual_seed(3))
    return q, k, v


def density_rule_cases(rank: int) -> dict:
    """``dense_fallback`` with limits between the whole layer's density and one rank's.

    Returns, per case, the path this rank took through the attention function, the path one
    process takes on all heads, the path `pbs.attention` alone would take on this rank's heads
    (per-rank decisions: the bug being guarded against), and the largest output difference.
    """
    import pbs
    import pbs.dense
    import pbs.integrations.transformers as pbs_hf
    from pbs.config import DenseFallback

    q, k, v = synthetic_heads()
    hq, hkv = q.shape[1] // WORLD, k.shape[1] // WORLD
    mine = (slice(None), slice(rank * hq, (rank + 1) * hq))
    mine_kv = (slice(None), slice(rank * hkv, (rank + 1) * hkv))
    base = {**SMALL, "selector": {"name": "mean_pool", "threshold": 0.9}, "backend": "auto"}
    has_probe = "probe_blocks" in DenseFallback.model_fields

    def ranks_view(measure) -> tuple[float, list[float]]:
        local = [measure(q[:, r * hq : (r + 1) * hq], k[:, r * hkv : (r + 1) * hkv]) for r in range(WORLD)]
        return measure(q, k), local

    plan_config = {**base, "dense_fallback": {"min_seq_len": 0, "devices": ["cpu"], "planning_cost_pairs": 0,
                                              **({"probe_blocks": 0} if has_probe else {})}}
    whole, local = ranks_view(lambda q_, k_: pbs.plan(q_, k_, plan_config).density)
    limits = {"plan_above": (whole + max(local)) / 2, "plan_below": (whole + min(local)) / 2}
    configs = {name: {**plan_config, "dense_fallback": {**plan_config["dense_fallback"], "max_planned_density": limit}}
               for name, limit in limits.items()}
    if has_probe:
        probe_config = {**base, "dense_fallback": {"min_seq_len": 0, "devices": ["cpu"], "probe_blocks": 16,
                                                   "planning_cost_pairs": 0}}
        whole, local = ranks_view(
            lambda q_, k_: float(pbs.reference.density_probe.probe_density(q_, k_, block_size=16, num_blocks=16, threshold=0.9, scale=0.25))
        )
        for name, limit in {"probe_above": (whole + max(local)) / 2, "probe_below": (whole + min(local)) / 2}.items():
            configs[name] = {**probe_config, "dense_fallback": {**probe_config["dense_fallback"], "max_density": limit}}

    module = LAYER_MODULE
    cases = {}
    for name, config in configs.items():
        pbs_hf.register(config)  # its dense_fallback.min_seq_len (0) is the integration's too
        with pbs_hf.trace_dispatch() as calls, torch.no_grad():
            out, _ = pbs_hf.pbs_attention_forward(module, q[mine], k[mine_kv], v[mine_kv], None)
        single, plan = pbs.attention(q, k, v, config, return_plan=True)
        _, own_plan = pbs.attention(q[mine], k[mine_kv], v[mine_kv], config, return_plan=True)
        cases[name] = {
            "path": calls[0].path,
            "detail": calls[0].detail,
            "single_path": "sdpa" if plan is None or plan.fallback else "pbs",
            "per_rank_path": "sdpa" if own_plan is None or own_plan.fallback else "pbs",
            "max_diff": float((out.transpose(1, 2) - single[mine]).abs().max()),
        }
    return cases


def dtensor_cases(rank: int) -> dict:
    """The attention function on DTensor inputs: head-sharded, replicated, sequence-sharded."""
    import pbs
    import pbs.integrations.transformers as pbs_hf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (WORLD,))
    q, k, v = synthetic_heads()
    config = MODEL_CONFIGS["sparse"]
    pbs_hf.register(config, min_seq_len=32)
    single = pbs.attention(q, k, v, config).transpose(1, 2)  # (B, N, Hq, D)
    cases = {}
    for name, placement in {"heads": Shard(1), "replicated": Replicate(), "sequence": Shard(2)}.items():
        q_d, k_d, v_d = (DTensor.from_local(t, mesh, [Replicate()]).redistribute(mesh, [placement]) for t in (q, k, v))
        with pbs_hf.trace_dispatch() as calls, torch.no_grad():
            try:
                out, _ = pbs_hf.pbs_attention_forward(LAYER_MODULE, q_d, k_d, v_d, None)
                full = out.full_tensor() if isinstance(out, DTensor) else out
                error = None
                diff = float((full - single).abs().max())
            except Exception as exc:  # recorded: the parent decides what is acceptable
                error, diff = f"{type(exc).__name__}: {exc}", None
        cases[name] = {
            "calls": [[c.path, c.reason, c.tp_rank, c.tp_size] for c in calls],
            "error": error,
            "max_diff": diff,
            "output_is_dtensor": error is None and isinstance(out, DTensor),
            "placements": [(type(p).__name__, getattr(p, "dim", None)) for p in out.placements] if error is None and isinstance(out, DTensor) else None,
        }
    return cases


def disagreement_cases(model, rank: int) -> dict:
    """Ranks asked different things raise the same ValueError through the model's attention function.

    ``config``: the ranks registered different thresholds (a whole prefill); ``dispatch``: rank 1's
    q needs grad, so it would run SDPA where rank 0 runs PBS. After each, a prefill on agreeing
    ranks runs (the group still works)."""
    import pbs.integrations.transformers as pbs_hf

    q, k, v = synthetic_heads()
    mine = (q[:, 2 * rank:2 * rank + 2], k[:, rank:rank + 1], v[:, rank:rank + 1])
    sparse = MODEL_CONFIGS["sparse"]

    def prefill_with_other_thresholds():
        pbs_hf.register({**sparse, "selector": {"name": "mean_pool", "threshold": 0.5 + 0.4 * rank}}, min_seq_len=32)
        with torch.no_grad():
            model(input_ids=prompt())

    def one_rank_needs_grad():
        pbs_hf.register(sparse, min_seq_len=32)
        with torch.enable_grad():
            pbs_hf.pbs_attention_forward(LAYER_MODULE, mine[0].clone().requires_grad_(rank == 1), *mine[1:], None)

    cases = {}
    for name, call in {"config": prefill_with_other_thresholds, "dispatch": one_rank_needs_grad}.items():
        try:
            call()
            error = None
        except Exception as exc:  # recorded: the parent decides what is acceptable
            error = (type(exc).__name__, str(exc))
        pbs_hf.register(sparse, min_seq_len=32)
        with torch.no_grad():
            after = model(input_ids=prompt()).logits
        cases[name] = {"error": error, "after": after}
    return cases


LAYER_MODULE = None


def worker(workdir: Path, rank: int) -> None:
    global LAYER_MODULE
    import logging

    import torch.distributed as dist
    import transformers

    import pbs.integrations.transformers as pbs_hf

    log_lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log_lines.append(record.getMessage())

    logging.getLogger("pbs.integrations.transformers").addHandler(Collect())
    logging.getLogger("pbs.integrations.transformers").setLevel(logging.INFO)

    dist.init_process_group("gloo", init_method=f"file://{workdir / 'rendezvous'}", rank=rank, world_size=WORLD,
                            timeout=PG_TIMEOUT)
    try:
        pbs_hf.register()
        kwargs = {"attn_implementation": "pbs", "dtype": torch.float32}
        if hasattr(transformers, "DistributedConfig"):
            kwargs["distributed_config"] = transformers.DistributedConfig(tp_plan="auto", tp_size=WORLD)
        else:  # transformers 4.x
            kwargs.update(tp_plan="auto", tp_size=WORLD)
        model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "model", **kwargs).eval()
        attention = model.model.layers[1].self_attn
        LAYER_MODULE = attention
        results = {
            "rank": rank,
            "heads_local": attention.q_proj.weight.to_local().shape[0] // attention.head_dim,
            "models": model_logits(model, MODEL_CONFIGS),
            "density_rule": density_rule_cases(rank),
            "dtensor": dtensor_cases(rank),
            "disagreement": disagreement_cases(model, rank),
        }
        # a decode step, to see the fallback logged once on this rank
        pbs_hf.register(MODEL_CONFIGS["exact"], min_seq_len=32)
        with torch.no_grad():
            ids = prompt()[:, :64]
            results["generated"] = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False
            )[0, 64:].tolist()
        results["log"] = log_lines
        torch.save(results, workdir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The test


def _gloo_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    if not _gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import pbs.integrations.transformers as pbs_hf

    workdir = tmp_path_factory.mktemp("tp")
    torch.manual_seed(0)
    pbs_hf.register()
    model = transformers.AutoModelForCausalLM.from_config(tiny_model_config("llama"), attn_implementation="pbs").float().eval()
    model.save_pretrained(workdir / "model")

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(workdir), str(rank)],
            cwd=ROOT,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{output[-6000:]}"

    single = model_logits(model, MODEL_CONFIGS)
    with torch.no_grad():
        ids = prompt()[:, :64]
        pbs_hf.register(MODEL_CONFIGS["exact"], min_seq_len=32)
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)[0, 64:]
    ranks = [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {"single": single, "ranks": ranks, "generated": generated.tolist(), "workdir": workdir}


def test_each_rank_holds_its_share_of_the_heads(tp_run):
    assert [r["heads_local"] for r in tp_run["ranks"]] == [2, 2]


@pytest.mark.parametrize("name", list(MODEL_CONFIGS))
def test_tp_logits_equal_one_process(tp_run, name):
    single = tp_run["single"][name]
    # one process: PBS on both layers, over all 4 heads
    assert [(c[1], c[4]) for c in single["calls"]] == [("pbs", None), ("pbs", None)]
    for rank, result in enumerate(tp_run["ranks"]):
        run = result["models"][name]
        # PBS ran on every layer of every rank, on that rank's heads (no SDPA fallback)
        assert [(c[0], c[1], c[4], c[5]) for c in run["calls"]] == [(0, "pbs", rank, WORLD), (1, "pbs", rank, WORLD)], run
        diff = float((run["logits"] - single["logits"]).abs().max())
        assert diff < TOL, f"rank {rank}: logits differ by {diff}"
    # each rank's density is that of its heads: their mean is one process's density
    for layer in range(2):
        rank_densities = [r["models"][name]["calls"][layer][3] for r in tp_run["ranks"]]
        assert sum(rank_densities) / WORLD == pytest.approx(single["calls"][layer][3], abs=1e-6)
    densities = [c[3] for r in tp_run["ranks"] for c in r["models"][name]["calls"]]
    if name == "exact":
        assert densities == [1.0] * 4
    else:
        assert max(densities) < 1.0


def test_density_rules_decide_as_one_process(tp_run):
    cases = [r["density_rule"] for r in tp_run["ranks"]]
    assert set(cases[0]) >= {"plan_above", "plan_below"}
    for name in cases[0]:
        per_rank = [c[name] for c in cases]
        single_path = per_rank[0]["single_path"]
        assert single_path == ("pbs" if name.endswith("above") else "sdpa"), per_rank
        assert [c["path"] for c in per_rank] == [single_path] * WORLD, per_rank
        for rank, case in enumerate(per_rank):
            assert case["max_diff"] < TOL, (name, rank, case)
        if single_path == "sdpa":
            assert "tensor-parallel ranks" in per_rank[0]["detail"]
        # without averaging over the ranks one rank would have decided otherwise: the case is real
        assert {c["per_rank_path"] for c in per_rank} == {"pbs", "sdpa"}, per_rank


def test_dtensor_inputs(tp_run):
    for rank, result in enumerate(tp_run["ranks"]):
        heads, replicated, sequence = (result["dtensor"][k] for k in ("heads", "replicated", "sequence"))
        assert heads["error"] is None and heads["output_is_dtensor"]
        assert heads["calls"] == [["pbs", None, rank, WORLD]]
        assert heads["max_diff"] < TOL
        assert replicated["error"] is None and replicated["output_is_dtensor"]
        assert replicated["calls"] == [["pbs", None, None, None]]  # every head on every rank
        assert replicated["max_diff"] < TOL
        # sharded over the sequence: gathered, PBS on every head, the output sharded again over the sequence
        assert sequence["calls"] == [["pbs", None, None, None]]
        assert sequence["error"] is None and sequence["output_is_dtensor"] and sequence["max_diff"] < TOL
        assert sequence["placements"] == [("Shard", 1)]
        assert heads["placements"] == [("Shard", 2)] and replicated["placements"] == [("Replicate", None)]
    assert sum("are gathered to every rank" in line for line in tp_run["ranks"][0]["log"]) == 1


def test_fallbacks_are_logged_once_per_rank(tp_run):
    for rank, result in enumerate(tp_run["ranks"]):
        assert result["generated"] == tp_run["generated"]
        decode = [line for line in result["log"] if "'decode'" in line]
        assert len(decode) == 1, result["log"]  # once on this rank, not once per layer or token
        assert f"tensor-parallel rank {rank} of {WORLD}" in decode[0]


def test_ranks_that_disagree_raise_the_same_error(tp_run):
    expected = {"config": "tensor-parallel ranks disagree on config.selector.threshold (rank 0: 0.5; rank 1: 0.9)",
                "dispatch": 'tensor-parallel ranks disagree on dispatch (rank 0: "pbs"; rank 1: "needs_grad")'}
    for name, text in expected.items():
        errors = [r["disagreement"][name]["error"] for r in tp_run["ranks"]]
        assert errors[0] is not None and errors[0][0] == "ValueError" and text in errors[0][1], errors
        assert errors[1] == errors[0]
        # then the ranks agree again, and the prefill gives one process's logits
        for result in tp_run["ranks"]:
            diff = float((result["disagreement"][name]["after"] - tp_run["single"]["sparse"]["logits"]).abs().max())
            assert diff < TOL, (name, diff)


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer for the tiny model's 128 ids (``w0`` .. ``w123`` and 4 specials)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[PAD]", "[EOS]", "[BOS]", "[UNK]"] + [f"w{i}" for i in range(124)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", bos_token="[BOS]", unk_token="[UNK]"
    ).save_pretrained(path)


def test_pbs_generate_tp(tp_run, tmp_path, capsys):
    """``pbs generate --tp 2`` relaunches itself under torchrun and prints what one process prints."""
    pytest.importorskip("tokenizers")
    from pbs.cli import main

    model_dir = tp_run["workdir"] / "model"
    save_tokenizer(model_dir)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(" ".join(f"w{(7 * i) % 124}" for i in range(200)))
    args = ["generate", str(model_dir), "--prompt-file", str(prompt_file), "--max-new-tokens", "4", "--quiet"]
    args += ["--config", json.dumps(MODEL_CONFIGS["sparse"]), "--min-seq-len", "32", "--warmup", "0", "--repeats", "1"]
    assert main(args + ["--json", str(tmp_path / "single.json")]) == 0
    capsys.readouterr()
    proc = subprocess.run(
        [sys.executable, "-m", "pbs", *args, "--tp", "2", "--json", str(tmp_path / "tp.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("--- answer (pbs) ---") == 1  # rank 0 prints, rank 1 does not
    assert "200 prompt tokens, float32 on 2 tensor-parallel ranks (cpu on rank 0)" in out
    assert "PBS ran on 2 of 2 layers of the prefill" in out
    single, tp = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("single", "tp"))
    assert (single["tp"], tp["tp"]) == (1, 2)
    for attention in ("sdpa", "pbs"):
        assert tp["results"][attention]["answer"] == single["results"][attention]["answer"]
    # rank 0 shows the density of the whole layer (both ranks' heads), as one process does
    assert tp["results"]["pbs"]["mean_density"] == pytest.approx(single["results"]["pbs"]["mean_density"], abs=1e-6)
    assert tp["results"]["pbs"]["mean_density"] < 1.0


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]))
