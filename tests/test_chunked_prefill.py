"""Chunked prefill: a prompt prefilled chunk by chunk against the growing cache.

At full density every chunk attends to every earlier key, so the chunks together give the one-shot
output within kernel noise. With a sparse config each chunk is planned on its own, over its own
queries (the density probe and the selectors see only the chunk's rows); that is where chunked and
one-shot selections may differ (docs/serving.md)."""

from __future__ import annotations

import pytest
import torch

import pbs

FULL = {"selector": {"name": "budget", "density": 1.0}, "block_size": 64, "segment_size": 128}
# The Triton kernel runs on the GPU where there is one, in the interpreter on CPU-only machines.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _chunked(q, k, v, config, chunk):
    """Output and LSE of ``q``'s rows, chunk by chunk: chunk ``[s, e)`` against keys ``[0, Nk - Nq + e)``."""
    nq, nk = q.shape[2], k.shape[2]
    prefix = nk - nq
    outs, lses = [], []
    for start in range(0, nq, chunk):
        end = min(nq, start + chunk)
        out, lse = pbs.attention(q[:, :, start:end], k[:, :, : prefix + end], v[:, :, : prefix + end], config,
                                 return_lse=True)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


@pytest.mark.parametrize("backend, dtype", [("reference", torch.float32), ("triton", torch.float16)])
@pytest.mark.parametrize("chunk", [128, 200, 1000])
def test_chunked_prefill_at_full_density_equals_one_shot(backend, dtype, chunk):
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=1000, head_dim=32, dtype=dtype, seed=4,
                                   device=TRITON_DEVICE if backend == "triton" else "cpu")
    config = {**FULL, "backend": backend}
    one_shot, one_shot_lse = pbs.attention(q, k, v, config, return_lse=True)
    chunked, chunked_lse = _chunked(q, k, v, config, chunk)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(chunked.float(), one_shot.float(), atol=tolerance, rtol=0)
    torch.testing.assert_close(chunked_lse, one_shot_lse, atol=tolerance, rtol=0)
    dense = pbs.reference.dense_attention(q.float(), k.float(), v.float())
    assert (chunked.float() - dense).abs().max().item() < (1e-5 if dtype == torch.float32 else 5e-3)


def test_chunked_prefill_after_a_cached_prefix_equals_one_shot():
    """A chunked prompt that itself follows a cached prefix (Nq < Nk from the start)."""
    q, k, v = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=1, seq_len=900, seq_len_q=600, head_dim=16, seed=6)
    config = {**FULL, "backend": "reference"}
    one_shot = pbs.attention(q, k, v, config)
    chunked, _ = _chunked(q, k, v, config, 256)
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=0)


def test_a_sparse_chunk_is_planned_over_its_own_queries():
    """With a sparse selector a chunk's plan covers only the chunk's query blocks, and its causal
    range is the chunk's: the mask has Tq(chunk) rows and sees the whole prefix."""
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=1024, head_dim=32, seed=5)
    config = {"selector": {"name": "mean_pool", "threshold": 0.9}, "block_size": 64, "segment_size": 128,
              "backend": "reference"}
    plan = pbs.plan(q[:, :, 768:], k, config)
    assert plan.mask.shape[2] == 256 // 64 and plan.layout.query_offset == 768
    one_shot = pbs.plan(q, k, config)
    assert one_shot.mask.shape[2] == 1024 // 64
