"""NaN in, NaN out (issue 37, point 2): a query whose scores hold a NaN gets a NaN output row and a
NaN LSE on every backend, ``-inf`` stays reserved for "saw no key", and `pbs.merge_attention_states`
carries NaN on and refuses ``+inf``.

The inputs are causal with every allowed block selected, so the keys each query sees are known
exactly: key ``j`` is seen by the queries at positions ``>= j``. Segments of 128 tokens keep the
first two query blocks away from every key of the second segment, on every backend.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pbs

# The interpreter's row max of an all-NaN row warns; the kernels' NaN handling is what is tested.
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on a CPU-only machine
EVERY_BLOCK = {
    "block_size": 64, "segment_size": 128, "permuter": "none", "selector": {"name": "budget", "density": 1.0},
    "check_finite": False, "dense_fallback": {"min_seq_len": 0, "max_density": None, "max_planned_density": None},
}
BACKENDS = [("reference", torch.float32), ("triton", torch.float32), ("triton", torch.float16)]
BACKEND_IDS = ["reference", "triton-fp32", "triton-fp16"]
N = 256
BAD_KEY = 150  # in the second segment: seen by queries 150..255, never by queries 0..127


def _inputs(device, dtype):
    q, k, v = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=N, head_dim=16, seed=5)
    return [x.to(device, dtype) for x in (q, k, v)]


def _attend(backend, dtype, poison, config=EVERY_BLOCK):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    q, k, v = _inputs(device, dtype)
    poison(q, k, v)
    out, lse, plan = pbs.attention(q, k, v, {**config, "backend": backend}, return_lse=True, return_plan=True)
    assert plan.backend == backend
    return out.float().cpu(), lse.cpu()


def _rows_all_nan(x):
    """Per (batch, head, query): whether every entry of the row is NaN."""
    return x.isnan().all(-1)


@pytest.mark.parametrize("backend, dtype", BACKENDS, ids=BACKEND_IDS)
def test_a_nan_in_one_query_row_gives_that_row_nan_and_no_other(backend, dtype):
    def poison(q, k, v):
        q[0, 1, 200, 3] = float("nan")

    out, lse = _attend(backend, dtype, poison)
    expected = torch.zeros(1, 4, N, dtype=torch.bool)
    expected[0, 1, 200] = True
    assert torch.equal(_rows_all_nan(out), expected) and torch.equal(out.isnan().any(-1), expected)
    assert torch.equal(lse.isnan(), expected)
    assert torch.isfinite(lse[~expected]).all()


@pytest.mark.parametrize("backend, dtype", BACKENDS, ids=BACKEND_IDS)
def test_a_nan_key_gives_nan_to_the_queries_that_see_it_and_to_no_other(backend, dtype):
    def poison(q, k, v):
        k[0, 0, BAD_KEY, 0] = float("nan")  # KV head 0: query heads 0 and 1

    out, lse = _attend(backend, dtype, poison)
    expected = torch.zeros(1, 4, N, dtype=torch.bool)
    expected[0, :2, BAD_KEY:] = True
    assert torch.equal(_rows_all_nan(out), expected) and torch.equal(out.isnan().any(-1), expected)
    assert torch.equal(lse.isnan(), expected)
    assert torch.isfinite(lse[~expected]).all()


@pytest.mark.parametrize("backend, dtype", BACKENDS, ids=BACKEND_IDS)
def test_a_nan_value_gives_nan_to_the_queries_that_see_its_key_with_finite_lse(backend, dtype):
    def poison(q, k, v):
        v[0, 1, BAD_KEY] = float("nan")  # KV head 1: query heads 2 and 3

    out, lse = _attend(backend, dtype, poison)
    nan_rows = _rows_all_nan(out)[0]
    assert nan_rows[2:, BAD_KEY:].all()
    # Queries of tiles that never load the key stay finite: the other KV head, and the first segment.
    # (Queries 128..149 share a tile with the key on the kernels, where 0 * NaN in P V is NaN.)
    assert not out[0, :2].isnan().any() and not out[0, 2:, :128].isnan().any()
    assert torch.isfinite(lse).all()  # the scores are finite


@pytest.mark.parametrize("backend, dtype", BACKENDS, ids=BACKEND_IDS)
def test_a_query_that_sees_no_key_keeps_lse_minus_inf_and_output_zero_beside_a_nan(backend, dtype):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    q, k, v = _inputs(device, dtype)
    config = {**EVERY_BLOCK, "backend": backend, "force_sink_block": False}
    plan = pbs.plan(q, k, config, return_lse=True)
    selected = plan.mask.to_dense().clone()
    selected[:, :, 1] = False  # query block 1 (queries 64..127) sees no key
    plan = dataclasses.replace(plan, mask=pbs.BlockMask.from_dense(selected, plan.layout))
    q[0, 0, 100] = float("nan")  # sees no key: its NaN scores are never formed
    q[0, 0, 200] = float("nan")
    out, lse = pbs.run(plan, q, k, v, return_lse=True)
    out, lse = out.float().cpu(), lse.cpu()
    assert torch.isneginf(lse[0, :, 64:128]).all() and (out[0, :, 64:128] == 0).all()
    assert out[0, 0, 200].isnan().all() and lse[0, 0, 200].isnan()
    assert out.isnan().any(-1).sum() == 1 and lse.isnan().sum() == 1
    seen_keys = torch.ones(1, 4, N, dtype=torch.bool)
    seen_keys[..., 64:128] = False
    seen_keys[0, 0, 200] = False
    assert torch.isfinite(lse[seen_keys]).all()


@pytest.mark.parametrize("backend", ["reference", "triton", "auto-dense"])
def test_a_chunk_after_a_prefix_and_the_dense_fallback_carry_nan_too(backend):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    q, k, v = _inputs(device, torch.float32)
    k[0, 0, 100, 5] = float("nan")
    chunk = q[:, :, -64:]  # queries 192..255: every one sees key 100
    config = {**EVERY_BLOCK, "backend": backend}
    if backend == "auto-dense":  # dense by length: every allowed block on the backend auto picks, for the LSE
        config = {**EVERY_BLOCK, "backend": "auto", "dense_fallback": {"min_seq_len": 10**6, "devices": ["cpu"]}}
    out, lse, plan = pbs.attention(chunk, k, v, config, return_lse=True, return_plan=True)
    assert plan.ran_dense == (backend == "auto-dense")
    assert out[0, :2].isnan().all() and lse[0, :2].isnan().all()
    assert torch.isfinite(out[0, 2:]).all() and torch.isfinite(lse[0, 2:]).all()


def test_varlen_gives_nan_to_the_sequence_that_holds_it_only():
    from tests.test_serving import make_sequences, pack

    sequences = make_sequences([(40, 40), (30, 90)], heads_q=2, heads_kv=1, seed=3)
    sequences[1][1][0, 0, 70, 0] = float("nan")  # sequence 1's queries are its positions 60..89
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    # mean_pool, which the capturable path plans: key block 4 (keys 64..79) is on the diagonal of both
    # query blocks of sequence 1, so it is selected whatever the NaN does to the block scores.
    config = {**EVERY_BLOCK, "backend": "reference", "block_size": 16, "segment_size": 16, "selector": "mean_pool"}
    for capturable in (False, True):
        out, lse = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, return_lse=True,
                                        capturable=capturable)
        seen = torch.zeros(70, dtype=torch.bool)
        seen[40 + 10:] = True  # queries at positions 70..89 of sequence 1
        assert torch.equal(out.isnan().all(-1).all(-1), seen) and torch.equal(out.isnan().any(-1).any(-1), seen)
        assert torch.equal(lse.isnan().all(0), seen) and torch.isfinite(lse[:, ~seen]).all()


# -- merge_attention_states ------------------------------------------------------------------------
def _parts(layout):
    """Two clean parts of 4 queries: ``(o_a, lse_a, o_b, lse_b)``, batched or packed."""
    gen = torch.Generator().manual_seed(2)
    o_a, o_b = torch.randn(2, 1, 3, 4, 8, generator=gen)
    lse_a, lse_b = torch.randn(2, 1, 3, 4, generator=gen)
    if layout == "packed":
        return o_a[0].transpose(0, 1).contiguous(), lse_a[0], o_b[0].transpose(0, 1).contiguous(), lse_b[0]
    return o_a, lse_a, o_b, lse_b


def _row(x, layout, head, query):
    return x[query, head] if layout == "packed" else x[0, head, query]


def _lse_entry(lse, layout, head, query):
    return lse[head, query] if layout == "packed" else lse[0, head, query]


@pytest.mark.parametrize("layout", ["batched", "packed"])
def test_merge_carries_nan_on(layout):
    """Pins what the merge already did (the kernels' -inf LSE for NaN rows was what hid them)."""
    o_a, lse_a, o_b, lse_b = _parts(layout)
    lse_b[..., 0, 3] = float("-inf")  # query 3 of head 0 sees no key on side b
    lse_a[..., 0, 3] = float("nan")  # and holds a NaN on side a
    lse_a[..., 1, 2] = float("nan")  # query 2 of head 1: a NaN LSE beside a finite one
    lse_b[..., 2, 1] = 30.0  # query 1 of head 2: side a's weight rounds to 0, and 0 * NaN is still NaN
    _row(o_a, layout, 2, 1)[5] = float("nan")
    o, lse = pbs.merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert _row(o, layout, 0, 3).isnan().all() and _lse_entry(lse, layout, 0, 3).isnan()
    assert _row(o, layout, 1, 2).isnan().all() and _lse_entry(lse, layout, 1, 2).isnan()
    assert _row(o, layout, 2, 1)[5].isnan() and torch.isfinite(_lse_entry(lse, layout, 2, 1))
    assert o.isnan().sum() == 2 * o.shape[-1] + 1 and lse.isnan().sum() == 2


@pytest.mark.parametrize("layout", ["batched", "packed"])
def test_merge_refuses_a_positive_infinite_lse_by_name(layout):
    o_a, lse_a, o_b, lse_b = _parts(layout)
    index = (2, 1) if layout == "packed" else (0, 2, 1)
    lse_b[index] = float("inf")
    with pytest.raises(ValueError, match=rf"lse_b holds \+inf \(first at index \({', '.join(map(str, index))}\)\)"):
        pbs.merge_attention_states(o_a, lse_a, o_b, lse_b)
    with pytest.raises(ValueError, match=r"lse_a holds \+inf"):
        pbs.merge_attention_states(o_b, lse_b, o_a, lse_a)
    # Unchecked (the CUDA default), the row comes out NaN, output and LSE, never a number.
    o, lse = pbs.merge_attention_states(o_a, lse_a, o_b, lse_b, check_lse=False)
    assert _row(o, layout, 2, 1).isnan().all() and _lse_entry(lse, layout, 2, 1).isnan()
    assert o.isnan().sum() == o.shape[-1] and lse.isnan().sum() == 1


@pytest.mark.parametrize("backend, dtype", BACKENDS, ids=BACKEND_IDS)
def test_a_nan_query_is_not_replaced_by_the_other_part_when_merged(backend, dtype):
    """The issue's case: the Triton kernel gave a NaN row an LSE of -inf, so the merge took the
    other part's row and the NaN vanished."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    q, k, v = _inputs(device, dtype)
    q[0, 3, 200, 0] = float("nan")
    chunk = q[:, :, -64:]  # queries 192..255
    config = {**EVERY_BLOCK, "backend": backend}
    prefix = pbs.attention(chunk, k[:, :, :128], v[:, :, :128], {**config, "causal": False}, return_lse=True)
    own = pbs.attention(chunk, k[:, :, 128:], v[:, :, 128:], config, return_lse=True)
    o, lse = pbs.merge_attention_states(*prefix, *own)
    expected = torch.zeros(1, 4, 64, dtype=torch.bool, device=o.device)
    expected[0, 3, 200 - 192] = True
    assert torch.equal(o.isnan().all(-1), expected) and torch.equal(o.isnan().any(-1), expected)
    assert torch.equal(lse.isnan(), expected)


# -- the GPU kernels -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "hopper"])
def test_gpu_kernels_give_nan_rows_a_nan_lse(backend):
    if backend == "hopper" and pbs.backends.eligibility.gluon_kernel_reasons(
            pbs.backends.CallSpec.of(torch.zeros(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16), 64, 128)):
        pytest.skip("the Gluon kernel cannot run on this GPU")
    q, k, v = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=1024, head_dim=64, dtype=torch.bfloat16,
                                   device="cuda", seed=5)
    q[0, 1, 700, 3] = float("nan")
    k[0, 1, 600, 0] = float("nan")  # KV head 1: query heads 2 and 3, queries 600..1023
    config = {**EVERY_BLOCK, "block_size": 128, "segment_size": 256, "backend": backend, "force_sink_block": False}
    out, lse, plan = pbs.attention(q, k, v, config, return_lse=True, return_plan=True)
    assert plan.backend == backend
    expected = torch.zeros(1, 4, 1024, dtype=torch.bool, device="cuda")
    expected[0, 1, 700] = True
    expected[0, 2:, 600:] = True
    assert torch.equal(out.isnan().all(-1), expected) and torch.equal(out.isnan().any(-1), expected)
    assert torch.equal(lse.isnan(), expected) and torch.isfinite(lse[~expected]).all()
    # A query block that sees no key keeps -inf and 0 beside them.
    selected = plan.mask.to_dense().clone()
    selected[:, :, 5] = False  # queries 640..767, among them the NaN query 700
    empty = dataclasses.replace(plan, mask=pbs.BlockMask.from_dense(selected, plan.layout))
    out, lse = pbs.run(empty, q, k, v, return_lse=True)
    assert torch.isneginf(lse[0, :, 640:768]).all() and (out[0, :, 640:768] == 0).all()
    assert lse[0, 2:, 768:].isnan().all() and torch.isfinite(lse[0, :2, 768:]).all()
