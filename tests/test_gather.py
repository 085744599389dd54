"""`pbs.kernels.gather.gather_kv` against its eager twin `pbs.reference.gather.gather_kv` and
`Permutation.apply`, through the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from pbs.testing import make_qkv
from tests.test_block_sparse_attn import DEVICE, make_plan


@pytest.mark.parametrize("heads, gqa", [(2, "shared"), (4, "per_head")])
def test_gather_kv_matches_permutation_apply(heads, gqa):
    from pbs.kernels.gather import gather_kv

    q, k, v = make_qkv(heads_q=4, heads_kv=2, seq_len=200, head_dim=32, seed=11, device=DEVICE)
    v = v[..., :16]  # a value head dim unlike the key one, and a strided view
    plan = make_plan(q, k, permuter="random", gqa=gqa)
    assert plan.key_permutation.heads == heads
    k_perm, v_perm = gather_kv(plan.key_permutation.indices, k, v)
    assert torch.equal(k_perm, plan.key_permutation.apply(k))
    assert torch.equal(v_perm, plan.key_permutation.apply(v))
    from pbs.reference.gather import gather_kv as eager_twin

    k_ref, v_ref = eager_twin(plan.key_permutation.indices, k, v)
    assert torch.equal(k_perm, k_ref) and torch.equal(v_perm, v_ref)
