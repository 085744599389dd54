"""Context-parallel prefill of a transformers model (`pbs.integrations.context_parallel`).

2 and 4 CPU processes (gloo) each hold the whole tiny random Llama (2 layers, hidden 64, 4 query
heads, 2 KV heads, fp32) and their zigzag shard of one prompt, and run `context_parallel_prefill`.
The ranks' logits, joined with `unshard_sequence`, must equal one process's logits within fp32
noise, and every rank must get the last position's logits:

* ``dense``: the defaults at a length below ``min_seq_len``: the dense path, against SDPA;
* ``full``: planned at density 1 (``budget`` 1.0), against SDPA;
* ``defaults``: the defaults with ``min_seq_len`` lowered so that they plan, against one process
  with ``attn_implementation="pbs"`` and the same config;
* ``sparse``: ``last_block`` + ``mean_pool`` 0.5 (density well below 1), against ``"pbs"``.

Lengths 2,048 (8 segments: the shortest prompt 4 ranks take) and 3,000 (11 segments and 184
tokens: a partial last segment and leftover segments). The workers are this file run as a script
(``python tests/test_integration_context_parallel.py WORKDIR RANK WORLD``), meeting through a file
rendezvous.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_ranks, tiny_model_config

ROOT = Path(__file__).resolve().parents[1]
# A collective that waits longer fails its worker (and so the test) instead of hanging for torch's
# default 30 minutes.
PG_TIMEOUT = datetime.timedelta(seconds=30)
LENGTHS = (2048, 3000)
TOL = 1e-4
CONFIGS = {
    "dense": ({}, {}),
    "full": ({"selector": {"name": "budget", "density": 1.0}}, {"min_seq_len": 256}),
    "defaults": ({}, {"min_seq_len": 256}),
    "sparse": ({"permuter": "last_block", "selector": {"name": "mean_pool", "threshold": 0.5}}, {"min_seq_len": 256}),
}
SDPA_REFERENCE = {"dense", "full"}  # the others are held to one process's "pbs" with the same config


def prompt(n: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n))


def worker(workdir: Path, rank: int, world: int) -> None:
    import torch.distributed as dist
    import transformers

    import pbs.integrations.context_parallel as pbs_cp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'rendezvous'}", rank=rank, world_size=world,
                            timeout=PG_TIMEOUT)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            workdir / "model", dtype=torch.float32, attn_implementation="sdpa").eval()
        results: dict = {"rank": rank, "runs": {}}
        for name, (config, fields) in CONFIGS.items():
            pbs_cp.register_context_parallel(config, **fields)
            for n in LENGTHS:
                out = pbs_cp.context_parallel_prefill(model, prompt(n), keep="all")
                results["runs"][name, n] = {
                    "logits": out.logits, "last": out.last_logits, "positions": out.positions,
                    "layers": [(c.layer_idx, c.path, c.reason, c.density, c.seq_len) for c in out.layers],
                }
        # keep="last": no full logits, the same last position on every rank (the dense path)
        pbs_cp.register_context_parallel()
        out = pbs_cp.context_parallel_prefill(model, prompt(LENGTHS[-1]))
        results["last_only"] = {"logits": out.logits, "last": out.last_logits}
        results["attn_after"] = model.config._attn_implementation
        results["disagreement"] = disagreement_cases(model, rank, world)
        torch.save(results, workdir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def disagreement_cases(model, rank: int, world: int) -> dict:
    """Ranks asked different things raise the same ValueError, and the group works after it:
    ``min_seq_len`` (one rank would go dense by length, the others plan) through a prefill and
    through the attention function, ``dropout`` on the last rank only, and through a prefill one
    token changed, or a prompt too short for the group, on the last rank."""
    import pbs.integrations.context_parallel as pbs_cp
    from pbs.distributed import shard_length

    odd = rank == world - 1
    layer = model.model.layers[0].self_attn
    n_local = shard_length(LENGTHS[0], rank, world)
    q, k = torch.randn(1, 4, n_local, 16), torch.randn(1, 2, n_local, 16)

    def other_min_seq_len():
        pbs_cp.register_context_parallel({}, min_seq_len=256 if odd else 1 << 20)
        pbs_cp.context_parallel_prefill(model, prompt(LENGTHS[0]))

    def other_min_seq_len_in_a_layer():
        pbs_cp.register_context_parallel({}, min_seq_len=256 if odd else 1 << 20)
        pbs_cp.pbs_context_parallel_forward(layer, q, k, k, None)

    def dropout_on_one_rank():
        pbs_cp.register_context_parallel()
        pbs_cp.pbs_context_parallel_forward(layer, q, k, k, None, dropout=0.1 if odd else 0.0)

    def another_prompt():
        ids = prompt(LENGTHS[0])
        if odd:
            ids[0, 5] += 1
        pbs_cp.context_parallel_prefill(model, ids)

    def too_short_on_one_rank():
        pbs_cp.context_parallel_prefill(model, prompt(256 if odd else LENGTHS[0]))

    cases = {}
    for name, call in {"min_seq_len": other_min_seq_len, "layer_min_seq_len": other_min_seq_len_in_a_layer,
                       "dropout": dropout_on_one_rank, "prompt": another_prompt,
                       "too_short": too_short_on_one_rank}.items():
        try:
            call()
            cases[name] = None
        except Exception as exc:  # recorded: the parent decides what is acceptable
            cases[name] = (type(exc).__name__, str(exc))
    pbs_cp.register_context_parallel()
    cases["after"] = pbs_cp.context_parallel_prefill(model, prompt(LENGTHS[0])).last_logits
    return cases


def _gloo_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def _single(model) -> dict:
    """One process's logits per config and length: SDPA, or "pbs" with the same config."""
    import pbs.integrations.transformers as pbs_hf

    out = {}
    for name, (config, fields) in CONFIGS.items():
        if name in SDPA_REFERENCE:
            pbs_hf.switch_attention(model, "sdpa")
        else:
            pbs_hf.register(config, **fields)
            pbs_hf.switch_attention(model, "pbs")
        for n in LENGTHS:
            with pbs_hf.trace_dispatch() as calls, torch.no_grad():
                logits = model(input_ids=prompt(n), use_cache=False).logits
            out[name, n] = {"logits": logits, "paths": [c.path for c in calls]}
    pbs_hf.switch_attention(model, "sdpa")
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    if not _gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_model_config("llama", max_position_embeddings=4096), attn_implementation="sdpa").float().eval()
    path = tmp_path_factory.mktemp("cp_model")
    model.save_pretrained(path / "model")
    return path, model, _single(model)


def _run(workdir: Path, world: int) -> list[dict]:
    return run_ranks(__file__, workdir, world, timeout=240)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def cp_run(request, model_dir):
    base, _, single = model_dir
    workdir = base / f"world{request.param}"
    workdir.mkdir()
    (workdir / "model").symlink_to(base / "model")
    return request.param, _run(workdir, request.param), single


@pytest.mark.parametrize("name", list(CONFIGS))
def test_unsharded_logits_equal_one_process(cp_run, name):
    from pbs.distributed import unshard_sequence

    world, ranks, single = cp_run
    for n in LENGTHS:
        runs = [r["runs"][name, n] for r in ranks]
        joined = unshard_sequence([run["logits"] for run in runs], dim=1)
        reference = single[name, n]["logits"]
        assert joined.shape == reference.shape
        diff = float((joined - reference).abs().max())
        assert diff < TOL, f"{name}, N={n}, world {world}: logits differ by {diff}"
        assert torch.equal(unshard_sequence([run["positions"] for run in runs], dim=0), torch.arange(n))
        for rank, run in enumerate(runs):
            # the last position's logits on every rank, equal to one process's
            assert float((run["last"] - reference[:, -1]).abs().max()) < TOL, (name, n, rank)
            assert torch.equal(run["last"], runs[0]["last"])
            layers = run["layers"]
            assert [c[0] for c in layers] == [0, 1] and all(c[4] == n for c in layers)
            if name == "dense":
                assert [(c[1], c[2]) for c in layers] == [("dense", "short_sequence")] * 2, layers
            else:
                assert [c[1] for c in layers] == ["pbs", "pbs"], layers
            if name == "full":
                assert [c[3] for c in layers] == [1.0, 1.0]
        if name == "sparse":
            # sparse on every rank, and one process planned too (not a dense fallback on both sides)
            assert all(c[3] < 0.9 for run in runs for c in run["layers"]), [run["layers"] for run in runs]
        if name not in SDPA_REFERENCE:
            assert single[name, n]["paths"] == ["pbs", "pbs"]


def test_last_only_and_model_restored(cp_run):
    world, ranks, single = cp_run
    reference = single["dense", LENGTHS[-1]]["logits"][:, -1]
    for r in ranks:
        assert r["last_only"]["logits"] is None
        assert float((r["last_only"]["last"] - reference).abs().max()) < TOL
        assert r["attn_after"] == "sdpa"


def test_ranks_that_disagree_raise_the_same_error(cp_run):
    world, ranks, single = cp_run
    others = "rank 0" if world == 2 else "ranks " + ", ".join(map(str, range(world - 1)))
    expected = {
        "min_seq_len": f"pbs_context_parallel prefill ranks disagree on config.min_seq_len ({others}: 1048576; "
                       f"rank {world - 1}: 256)",
        "layer_min_seq_len": f"pbs_context_parallel layer ranks disagree on config.dense_fallback.min_seq_len "
                             f"({others}: 1048576; rank {world - 1}: 256)",
        "dropout": f"pbs_context_parallel layer rank {world - 1} of {world} failed its input checks: "
                   "pbs_context_parallel (layer 0): attention dropout 0.1",
        "prompt": "pbs_context_parallel prefill ranks disagree on input_ids checksum (",
        "too_short": f"pbs_context_parallel prefill rank {world - 1} of {world} failed its input checks: a sequence of "
                     f"256 tokens is too short to split over {world} ranks",
    }
    for name, text in expected.items():
        errors = [r["disagreement"][name] for r in ranks]
        assert errors[0] is not None and errors[0][0] == "ValueError" and text in errors[0][1], errors
        assert all(error == errors[0] for error in errors)
    reference = single["dense", LENGTHS[0]]["logits"][:, -1]
    for r in ranks:  # the group works afterwards: the dense path gives one process's last logits
        assert float((r["disagreement"]["after"] - reference).abs().max()) < TOL


def test_refusals_without_a_group(model_dir):
    import pbs.integrations.context_parallel as pbs_cp

    _, model, _ = model_dir
    pbs_cp.register_context_parallel()
    with pytest.raises(RuntimeError, match="process group"):
        pbs_cp.context_parallel_prefill(model, prompt(2048))
    with pytest.raises(ValueError, match="cannot be planned context-parallel"):
        pbs_cp.register_context_parallel({"selector": "sampled_rows"})
    with pytest.raises(ValueError, match="same segment_size"):
        pbs_cp.register_context_parallel({"pbs": {}, "layer_overrides": {1: {"segment_size": 512}}})
    q = torch.randn(1, 4, 256, 16)
    k = torch.randn(1, 2, 512, 16)
    layer = model.model.layers[0].self_attn
    with pytest.raises(NotImplementedError, match="cached prefix"):
        pbs_cp.pbs_context_parallel_forward(layer, q, k, k, None)
    with pytest.raises(ValueError, match="attention mask"):
        pbs_cp.pbs_context_parallel_forward(layer, q, k[:, :, :256], k[:, :, :256], torch.ones(1, 1, 256, 256))


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
