"""Host-side (CPU) cost of the reference permuters and selectors, with pytest-benchmark.

Run with ``scripts/bench_cpu.sh`` (results in ``benchmarks/cpu/full_run.json``, git-ignored). The normal
test run skips this folder (``testpaths = ["tests"]``) and disables benchmarks. Nothing here
asserts on time, so timing noise cannot fail it; each benchmark checks that its result is valid.
"""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.components import PermutationInputs, SelectionInputs, permuter_registry, selector_registry
from pbs.config import PBSConfig
from pbs.planning import make_layout

SEQ_LENS = (1024, 4096)
PERMUTERS = ("last_block", "greedy", "key_aware_query")
SELECTORS = ("mean_pool", "antidiagonal")
HEADS_Q, HEADS_KV, HEAD_DIM = 8, 2, 64


@pytest.fixture(scope="module", params=SEQ_LENS, ids=lambda n: f"N{n}")
def qk(request):
    q, k, _ = pbs.testing.make_qkv(heads_q=HEADS_Q, heads_kv=HEADS_KV, seq_len=request.param, head_dim=HEAD_DIM)
    return q, k


@pytest.mark.parametrize("name", PERMUTERS)
def test_reference_permuter(benchmark, qk, name):
    q, k = qk
    config = PBSConfig(permuter=name)
    inputs = PermutationInputs(q=q, k=k, layout=make_layout(q, k, config), gqa=config.gqa, scale=q.shape[-1] ** -0.5)
    permuter = permuter_registry.parse(name)
    benchmark.group = f"permuter N={q.shape[2]}"
    benchmark.extra_info.update(seq_len=q.shape[2], heads_q=HEADS_Q, heads_kv=HEADS_KV, head_dim=HEAD_DIM)
    perms = benchmark(permuter.permute, inputs)

    layout = inputs.layout
    s, g = layout.segment_size, layout.num_full_segments
    for perm, length in ((perms.keys, layout.seq_len_k), (perms.queries, layout.seq_len_q)):
        if perm is None:
            continue
        indices = perm.indices
        assert indices.shape[-1] == length
        # A segmented permutation: every segment holds exactly its own positions, the tail stays put.
        head = indices[..., : g * s].reshape(*indices.shape[:-1], g, s).sort(-1).values
        expected = torch.arange(g * s).view(g, s)
        assert torch.equal(head, expected.expand_as(head))
        assert torch.equal(indices[..., g * s :], torch.arange(g * s, length).expand_as(indices[..., g * s :]))


@pytest.mark.parametrize("name", SELECTORS)
def test_reference_selector(benchmark, qk, name):
    q, k = qk
    config = PBSConfig(permuter="last_block", selector=name)  # the paper's segmented layout
    layout = make_layout(q, k, config)
    b, hq, nq = q.shape[:3]
    inputs = SelectionInputs(
        q=q,
        k=k,
        layout=layout,
        query_positions=torch.arange(nq).expand(b, hq, nq) + layout.query_offset,
        key_positions=torch.arange(k.shape[2]).expand(b, k.shape[1], k.shape[2]),
        scale=q.shape[-1] ** -0.5,
    )
    selector = selector_registry.parse(name)
    benchmark.group = f"selector N={nq}"
    benchmark.extra_info.update(seq_len=nq, heads_q=HEADS_Q, heads_kv=HEADS_KV, head_dim=HEAD_DIM)
    selected = benchmark(selector.select, inputs)

    assert selected.dtype == torch.bool
    assert selected.shape == (b, hq, layout.num_query_blocks, layout.num_key_blocks)
    # Every query block with a candidate keeps at least one (the first segment has none: its
    # blocks are all forced, and forced blocks are added after the selector).
    candidates = layout.candidate_blocks()
    kept = selected & layout.allowed_blocks()
    has_candidates = candidates.any(-1).expand(kept.shape[:-1])
    assert (kept.sum(-1)[has_candidates] >= 1).all()
