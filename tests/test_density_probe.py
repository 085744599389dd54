"""The density probe of ``dense_fallback``: its definition, what it tells apart, and its twins
(`pbs.reference.density_probe` and the Triton kernel of `pbs.kernels.density_probe`)."""

from __future__ import annotations

import math
import os

import pytest
import torch

import pbs
from pbs.reference.density_probe import probe_density, sampled_query_blocks

# Every interpreted launch here has its addresses checked (tests/interpreter_bounds.py).
pytestmark = pytest.mark.usefixtures("checked_addresses")


def test_sampled_blocks_are_evenly_spaced_distinct_and_end_at_the_last():
    for tq in (1, 2, 5, 17, 128):
        for p in (1, 2, 3, 16):
            rows = sampled_query_blocks(tq, p).tolist()
            assert rows[-1] == tq - 1 and len(rows) == min(p, tq) and len(set(rows)) == len(rows)
            assert rows == sorted(rows) and (len(rows) == 1 or rows[0] == 0)


def _probe_by_rows(q, k, block, num_blocks, threshold, scale):
    """The density probe written row by row from its definition (pbs.dense.probe_density)."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    tq, tk = -(-nq // block), -(-nk // block)
    p = min(num_blocks, tq)
    rows = [tq - 1] if p == 1 else [math.floor(i * (tq - 1) / (p - 1) + 0.5) for i in range(p)]
    kept = visible_total = 0
    for bi in range(b):
        for h in range(hq):
            keys = k[bi, h // (hq // hkv)].double()
            for i in rows:
                first, last = nk - nq + i * block, nk - nq + min(i * block + block, nq) - 1
                pooled_q = q[bi, h, i * block : min(i * block + block, nq)].double().mean(0)
                visible = [j for j in range(tk) if j * block <= last]
                scores = torch.stack([keys[j * block : (j + 1) * block].mean(0) @ pooled_q * scale for j in visible])
                mass = dict(zip(visible, scores.softmax(0).tolist()))
                forced = {j for j in visible if j == 0 or (j + 1) * block > first}
                covered = sum(mass[j] for j in forced)
                count = len(forced)
                for j in sorted(set(visible) - forced, key=lambda j: -mass[j]):
                    if covered >= threshold:
                        break
                    covered += mass[j]
                    count += 1
                kept += count
                visible_total += len(visible)
    return kept / visible_total


@pytest.mark.parametrize(
    "seq_len, seq_len_q, num_blocks, threshold",
    [(256, None, 4, 0.9), (300, None, 16, 0.8), (300, 130, 3, 0.95), (200, None, 1, 0.5)],
)
def test_density_probe_follows_its_definition(seq_len, seq_len_q, num_blocks, threshold):
    q, k, _ = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=seq_len, seq_len_q=seq_len_q, head_dim=32)
    estimate = probe_density(q, k, block_size=32, num_blocks=num_blocks, threshold=threshold, scale=32**-0.5)
    assert float(estimate) == pytest.approx(_probe_by_rows(q, k, 32, num_blocks, threshold, 32**-0.5), abs=1e-6)


def test_density_probe_separates_flat_from_structured_attention():
    gen = torch.Generator().manual_seed(0)
    flat_q, flat_k = torch.randn(1, 4, 2048, 64, generator=gen), torch.randn(1, 2, 2048, 64, generator=gen)
    q, k, _ = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=2048, head_dim=64)
    args = dict(block_size=64, num_blocks=16, threshold=0.9, scale=64**-0.5)
    assert float(probe_density(flat_q, flat_k, **args)) > 0.85
    assert float(probe_density(q, k, **args)) < 0.5


@pytest.mark.parametrize(
    "seq_len, seq_len_q, num_blocks, threshold, dtype",
    [(256, None, 4, 0.9, torch.float32), (300, None, 16, 0.8, torch.float16), (300, 130, 3, 0.95, torch.float32),
     (200, None, 1, 0.5, torch.float32), (700, None, 8, 0.99, torch.float32)],
)
def test_triton_probe_matches_its_eager_twin(seq_len, seq_len_q, num_blocks, threshold, dtype):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU)")
    from pbs.kernels.density_probe import probe_density_triton

    q, k, _ = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=seq_len, seq_len_q=seq_len_q,
                                   head_dim=32, dtype=dtype)
    args = dict(block_size=32, num_blocks=num_blocks, threshold=threshold, scale=32**-0.5)
    assert probe_density_triton(q, k, **args) == pytest.approx(float(probe_density(q, k, **args)), abs=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [16384, 20000])
def test_gpu_probe_matches_its_eager_twin(seq_len):
    from pbs.kernels.density_probe import probe_density_triton

    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=8, heads_kv=2, seq_len=seq_len, head_dim=128,
                                   dtype=torch.bfloat16, device="cuda")
    args = dict(block_size=128, num_blocks=16, threshold=0.9, scale=128**-0.5)
    assert probe_density_triton(q, k, **args) == pytest.approx(float(probe_density(q, k, **args)), abs=2e-3)
    flat_q, flat_k = torch.randn_like(q), torch.randn_like(k)
    assert probe_density_triton(flat_q, flat_k, **args) > 0.85


def test_triton_probe_reads_keys_of_any_layout():
    # The pooled keys come from a view of k split into blocks: a (B, N, H, D) cache seen as
    # (B, H, N, D) must give the estimate of its contiguous copy.
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU)")
    from pbs.kernels.density_probe import probe_density_triton

    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=256, head_dim=32)
    k_strided = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k_strided.is_contiguous()
    args = dict(block_size=32, num_blocks=4, threshold=0.9, scale=32**-0.5)
    assert probe_density_triton(q, k_strided, **args) == pytest.approx(float(probe_density(q, k, **args)), abs=1e-6)
