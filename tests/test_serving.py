"""The serving entry points: `pbs.varlen_attention` over packed sequences and
`pbs.merge_attention_states` (ARCHITECTURE.md point 11: varlen == per-sequence loop, LSE ==
logsumexp, merged partials == full)."""

from __future__ import annotations

import pytest
import torch

import pbs
import pbs.serving.varlen
from tests.helpers import assert_max_abs_error_within_torch

# Tests that read the log-sum-exp wait for pbs.attention(..., return_lse=True).
try:
    _q = torch.zeros(1, 1, 1, 16)
    pbs.attention(_q, _q, _q, {"backend": "reference"}, return_lse=True)
    HAS_LSE = True
except TypeError:
    HAS_LSE = False
needs_lse = pytest.mark.skipif(not HAS_LSE, reason="pbs.attention(..., return_lse=True) is not there yet")

REFERENCE = {"backend": "reference"}
# The Triton backend runs on the GPU where there is one, else in Triton's interpreter
# (tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL_BLOCKS = {"selector": {"name": "budget", "density": 1.0}}  # every causally allowed block


# -- building packed batches -----------------------------------------------------------------------
def make_sequences(lengths, heads_q=4, heads_kv=2, head_dim=16, dtype=torch.float32, seed=0, device="cpu"):
    """One ``(q, k, v)`` per ``(len_q, len_k)``, each ``(1, H, n, D)`` as `pbs.attention` takes it."""
    gen = torch.Generator().manual_seed(seed)
    sequences = []
    for len_q, len_k in lengths:
        q = torch.randn(1, heads_q, len_q, head_dim, generator=gen).to(dtype)
        k = torch.randn(1, heads_kv, len_k, head_dim, generator=gen).to(dtype)
        v = torch.randn(1, heads_kv, len_k, head_dim, generator=gen).to(dtype)
        sequences.append((q.to(device), k.to(device), v.to(device)))
    return sequences


def cumulative(lengths) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(list(lengths), dtype=torch.int32).cumsum(0)
    return out


def pack(sequences):
    """Packed ``q (Tq, Hq, D)``, ``k, v (Tk, Hkv, D)`` and the arguments after them."""
    to_tokens = lambda x: x[0].transpose(0, 1)  # (1, H, n, D) -> (n, H, D)
    q = torch.cat([to_tokens(s[0]) for s in sequences])
    k = torch.cat([to_tokens(s[1]) for s in sequences])
    v = torch.cat([to_tokens(s[2]) for s in sequences])
    lengths_q = [s[0].shape[2] for s in sequences]
    lengths_k = [s[1].shape[2] for s in sequences]
    cu_seq_q, cu_seq_k = cumulative(lengths_q).to(q.device), cumulative(lengths_k).to(q.device)
    return q, k, v, cu_seq_q, cu_seq_k, max(lengths_q), max(lengths_k)


def per_sequence(packed: torch.Tensor, cu_seq: torch.Tensor) -> list[torch.Tensor]:
    bounds = cu_seq.tolist()
    return [packed[start:end] for start, end in zip(bounds, bounds[1:])]


class AttentionSpy:
    """Stands in for `pbs.attention` inside `pbs.varlen_attention`: calls it with the plan
    returned too, and records each call's plan and views."""

    def __init__(self, monkeypatch):
        self.plans, self.calls = [], []
        real = pbs.serving.varlen.attention

        def spy(q, k, v, config=None, **kwargs):
            *result, plan = real(q, k, v, config, return_plan=True, **kwargs)
            self.plans.append(plan)
            self.calls.append((q, k, v))
            return result[0] if len(result) == 1 else tuple(result)

        monkeypatch.setattr(pbs.serving.varlen, "attention", spy)


def assert_same_plan(actual, expected):
    assert (actual is None) == (expected is None)
    if expected is None:
        return
    assert actual.density == expected.density
    assert torch.equal(actual.mask.to_dense(), expected.mask.to_dense())
    assert torch.equal(actual.key_permutation.indices, expected.key_permutation.indices)
    assert actual.backend == expected.backend


def check_varlen_equals_loop(sequences, config, monkeypatch):
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    spy = AttentionSpy(monkeypatch)
    out = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config)
    monkeypatch.undo()
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.dtype == q.dtype
    expected_plans = []
    for (sq, sk, sv), got in zip(sequences, per_sequence(out, cu_seq_q)):
        if sq.shape[2] == 0:
            assert got.numel() == 0
            continue
        expected, plan = pbs.attention(sq, sk, sv, config, return_plan=True)
        expected_plans.append(plan)
        assert torch.equal(got, expected[0].transpose(0, 1))
    assert len(spy.plans) == len(expected_plans)  # empty sequences are skipped
    for actual, expected in zip(spy.plans, expected_plans):
        assert_same_plan(actual, expected)
    return out, spy


# -- varlen == a per-sequence loop of pbs.attention ------------------------------------------------
@pytest.mark.parametrize("group", [1, 4, 8])
def test_varlen_equals_a_loop_of_attention_per_sequence(group, monkeypatch):
    # Lengths around the default block of 128, an empty query sequence, ~1000 tokens, and chunks
    # after a cached prefix (len_q < len_k).
    lengths = [(1, 1), (127, 127), (0, 40), (128, 128), (129, 129), (1000, 1000), (37, 300), (128, 700)]
    heads_kv = 1 if group == 8 else 2
    sequences = make_sequences(lengths, heads_q=group * heads_kv, heads_kv=heads_kv, seed=group)
    check_varlen_equals_loop(sequences, REFERENCE, monkeypatch)


def test_varlen_with_a_permuting_sparse_config_equals_the_loop(monkeypatch):
    config = {**REFERENCE, "block_size": 32, "segment_size": 64, "permuter": "last_block",
              "selector": {"name": "mean_pool", "threshold": 0.5}}
    sequences = make_sequences([(300, 300), (64, 64), (90, 250)], heads_q=4, heads_kv=2, seed=3)
    _, spy = check_varlen_equals_loop(sequences, config, monkeypatch)
    assert any(plan.density < 1 for plan in spy.plans)  # sparse: the plans really differ per sequence


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_varlen_on_the_triton_backend_equals_the_loop(dtype, monkeypatch):
    config = {"backend": "triton", "block_size": 32, "segment_size": 64,
              "selector": {"name": "budget", "density": 0.5}}
    sequences = make_sequences([(65, 65), (0, 10), (20, 100)], heads_q=4, heads_kv=1, head_dim=16, dtype=dtype, seed=4,
                               device=TRITON_DEVICE)
    _, spy = check_varlen_equals_loop(sequences, config, monkeypatch)
    assert {plan.backend for plan in spy.plans} == {"triton"}


def test_varlen_passes_zero_copy_views_of_the_packed_tensors(monkeypatch):
    sequences = make_sequences([(50, 80), (30, 30)], heads_q=8, heads_kv=2)
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    spy = AttentionSpy(monkeypatch)
    pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, REFERENCE)
    (q0, k0, v0), (q1, k1, v1) = spy.calls
    assert q0.shape == (1, 8, 50, 16) and k0.shape == (1, 2, 80, 16)  # GQA: K/V keep their 2 heads
    assert q1.data_ptr() == q[50:].data_ptr() and k1.data_ptr() == k[80:].data_ptr() and v1.data_ptr() == v[80:].data_ptr()


def test_a_sequence_does_not_depend_on_the_rest_of_the_batch():
    lengths = [(200, 200), (1, 1), (64, 300), (0, 5), (129, 129)]
    sequences = make_sequences(lengths, seed=5)
    config = {**REFERENCE, "block_size": 32, "segment_size": 64}
    out = pbs.varlen_attention(*pack(sequences), config)
    order = [3, 2, 4, 0, 1]
    shuffled = [sequences[i] for i in order]
    out_shuffled = pbs.varlen_attention(*pack(shuffled), config)
    alone = per_sequence(out, pack(sequences)[3])
    moved = per_sequence(out_shuffled, pack(shuffled)[3])
    for position, index in enumerate(order):
        assert torch.equal(moved[position], alone[index])


def test_dense_fallback_is_decided_per_sequence(monkeypatch):
    # The length rule on CPU: the short sequence runs dense SDPA (no plan), the long ones are planned
    # (the density rules are off: on random inputs the probe would send them to SDPA too).
    config = {"block_size": 32, "segment_size": 64,
              "dense_fallback": {"devices": ["cpu"], "min_seq_len": 200, "max_density": None}}
    sequences = make_sequences([(100, 100), (300, 300), (50, 250)], seed=6)
    _, spy = check_varlen_equals_loop(sequences, config, monkeypatch)
    assert [plan.dense_rule for plan in spy.plans] == ["length", None, None]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_varlen_at_full_density_equals_dense_attention(dtype):
    lengths = [(1, 1), (127, 127), (129, 129), (0, 3), (60, 400)]
    sequences = make_sequences(lengths, heads_q=4, heads_kv=1, dtype=dtype, seed=7)
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    out = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, {**REFERENCE, **ALL_BLOCKS})
    for (sq, sk, sv), got in zip(sequences, per_sequence(out, cu_seq_q)):
        if sq.shape[2]:
            # Within 2x PyTorch's own error at this dtype, against float64 (bottom-right causal).
            assert_max_abs_error_within_torch(got.transpose(0, 1).unsqueeze(0), sq, sk, sv)


def test_varlen_writes_into_the_given_out():
    sequences = make_sequences([(40, 40), (0, 7), (10, 30)], seed=8)
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"))  # poisoned: every row must be written
    result = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, REFERENCE, out=out)
    assert result is out and not out.isnan().any()
    torch.testing.assert_close(out, pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, REFERENCE),
                               rtol=0, atol=0)


def test_a_batch_of_empty_query_sequences_gives_an_empty_output():
    q = torch.zeros(0, 4, 16)
    k = v = torch.randn(9, 2, 16)
    cu_seq_q = torch.zeros(3, dtype=torch.int32)
    cu_seq_k = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, 0, 5, REFERENCE)
    assert out.shape == (0, 4, 16)


@pytest.mark.parametrize("capturable", [False, True])
def test_keys_that_no_query_reads_are_not_checked_for_nan(capturable):
    """The eager call skips a sequence without queries, keys and all; the capturable one agrees."""
    sequences = make_sequences([(20, 40), (0, 30), (10, 10)], heads_q=2, heads_kv=1, seed=4)
    sequences[1][1][0, 0, 5, 0] = float("nan")  # sequence 1 has no queries
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    config = {"block_size": 16, "segment_size": 16, "backend": "reference"}  # check_finite: on off CUDA
    out = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, capturable=capturable)
    assert torch.isfinite(out).all()
    k[75, 0, 0] = float("nan")  # a key of sequence 2 (keys 70..79), which has queries
    with pytest.raises(ValueError, match="k contains NaN or inf values"):
        pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, capturable=capturable)


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("lengths", [[(0, 4), (0, 5)], [(3, 4), (0, 5)]], ids=["empty", "non-empty"])
def test_varlen_refuses_inputs_that_require_grad_even_when_every_sequence_is_empty(lengths, capturable):
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(make_sequences(lengths, seed=5))
    config = {"block_size": 16, "segment_size": 16, "backend": "reference"}
    with pytest.raises(ValueError, match="forward-only"):
        pbs.varlen_attention(q, k.requires_grad_(), v, cu_seq_q, cu_seq_k, max_q, max_k, config, capturable=capturable)


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_refuses_meta_tensors_by_name(paged):
    q = torch.empty(7, 4, 16, device="meta")
    cu_seq_q = torch.tensor([0, 3, 7], dtype=torch.int32, device="meta")
    if paged:
        cache = torch.empty(4, 16, 2, 16, device="meta")
        arguments = dict(k=cache, v=cache, cu_seq_k=None, block_table=torch.zeros(2, 2, dtype=torch.int32, device="meta"),
                         seqused_k=torch.tensor([5, 4], dtype=torch.int32, device="meta"))
    else:
        kv = torch.empty(9, 2, 16, device="meta")
        arguments = dict(k=kv, v=kv, cu_seq_k=torch.tensor([0, 5, 9], dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="meta tensors are not supported"):
        pbs.varlen_attention(q=q, cu_seq_q=cu_seq_q, max_q=4, max_k=5, config=REFERENCE, **arguments)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton", "hopper"])
def test_varlen_on_the_gpu_equals_the_loop(backend, monkeypatch):
    # Strided views of packed tensors reach the GPU kernels (the Gluon one reads through TMA).
    if backend == "hopper" and pbs.backends.eligibility.gluon_kernel_reasons(
            pbs.backends.CallSpec.of(torch.zeros(1, 1, 128, 64, device="cuda", dtype=torch.float16), 64, 128)):
        pytest.skip("the Gluon kernel cannot run on this GPU")
    config = {"backend": backend, "dense_fallback": {"min_seq_len": 0, "max_density": None, "max_planned_density": None}}
    lengths = [(1, 1), (129, 129), (0, 9), (1000, 1000), (300, 2100)]
    sequences = [tuple(x.cuda() for x in s)
                 for s in make_sequences(lengths, heads_q=8, heads_kv=2, head_dim=64, dtype=torch.float16, seed=15)]
    _, spy = check_varlen_equals_loop(sequences, config, monkeypatch)
    assert not any(plan.ran_dense for plan in spy.plans)
    if backend != "auto":
        assert {plan.backend for plan in spy.plans} == {backend}


@pytest.mark.gpu
def test_varlen_refuses_cuda_graph_capture():
    sequences = make_sequences([(8, 8)], dtype=torch.float16)
    args = [x.cuda() if isinstance(x, torch.Tensor) else x for x in pack(sequences)]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="CUDA graph"):
        with torch.cuda.graph(graph, stream=stream):
            pbs.varlen_attention(*args)


# -- bad input: each error names the argument and what it accepts ------------------------------------
def _good_arguments():
    sequences = make_sequences([(3, 5), (4, 4)], heads_q=4, heads_kv=2, seed=9)
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    return dict(q=q, k=k, v=v, cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, max_q=max_q, max_k=max_k)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32)


BAD_VARLEN_INPUTS = {
    "cu_seq_q not starting at 0": (dict(cu_seq_q=_int32([1, 3, 7])), ValueError, r"cu_seq_q must start at 0, got cu_seq_q\[0\] = 1"),
    "cu_seq_q decreasing": (dict(cu_seq_q=_int32([0, 8, 7])), ValueError, r"cu_seq_q must be non-decreasing .* cu_seq_q\[1\] = 8 > cu_seq_q\[2\] = 7"),
    "cu_seq_q not ending at Tq": (dict(cu_seq_q=_int32([0, 3, 6])), ValueError, r"cu_seq_q must end at the packed length Tq = 7"),
    "cu_seq_k not ending at Tk": (dict(cu_seq_k=_int32([0, 5, 8])), ValueError, r"cu_seq_k must end at the packed length Tk = 9"),
    "cu_seq lengths differ": (dict(cu_seq_k=_int32([0, 5, 9, 9])), ValueError, r"same length N \+ 1 .* got 3 and 4"),
    "cu_seq_q int64": (dict(cu_seq_q=torch.tensor([0, 3, 7])), TypeError, r"cu_seq_q must have dtype torch.int32 .* got torch.int64"),
    "cu_seq_k float": (dict(cu_seq_k=torch.tensor([0.0, 5.0, 9.0])), TypeError, r"cu_seq_k must have dtype torch.int32"),
    "cu_seq_q on another device": (dict(cu_seq_q=_int32([0, 3, 7]).to("meta")), ValueError, r"cu_seq_q must be on q's device cpu, got meta"),
    "cu_seq_k 2-D": (dict(cu_seq_k=_int32([[0, 5, 9]])), ValueError, r"cu_seq_k must be 1-D of shape \(N \+ 1,\)"),
    "cu_seq_q a list": (dict(cu_seq_q=[0, 3, 7]), TypeError, r"cu_seq_q must be a torch.Tensor, got list"),
    "q 4-D": (dict(q=torch.zeros(1, 4, 7, 16)), ValueError, r"q must have 3 dimensions \(Tq, Hq, D\)"),
    "k 2-D": (dict(k=torch.zeros(9, 16)), ValueError, r"k must have 3 dimensions \(Tk, Hkv, D\)"),
    "v 4-D": (dict(v=torch.zeros(9, 2, 16, 1)), ValueError, r"v must have 3 dimensions \(Tk, Hkv, Dv\)"),
    "q int": (dict(q=torch.zeros(7, 4, 16, dtype=torch.int32)), TypeError, r"q must have dtype float16, bfloat16 or float32"),
    "heads not dividing": (dict(q=torch.zeros(7, 3, 16)), ValueError, r"q.shape\[1\] = 3\) must be a positive multiple .*\(k\.shape\[1\] = 2"),
    "k and v heads differ": (dict(v=torch.zeros(9, 1, 16)), ValueError, r"k and v must agree in \(Tk, Hkv\)"),
    "head dims differ": (dict(k=torch.zeros(9, 2, 8), v=torch.zeros(9, 2, 8)), ValueError, r"q and k must share the head dim D, got q: 16, k: 8"),
    "dtypes differ": (dict(v=torch.zeros(9, 2, 16, dtype=torch.float16)), ValueError, r"q, k and v must share a dtype"),
    "len_q > len_k": (dict(cu_seq_q=_int32([0, 6, 7]), ), ValueError, r"sequence 0 has len_q = 6 queries and len_k = 5 keys: .* len_q <= len_k"),
    "queries without keys": (dict(cu_seq_k=_int32([0, 9, 9])), ValueError, r"sequence 1 has len_q = 4 queries and len_k = 0 keys: it has queries but no keys"),
    "max_q too small": (dict(max_q=3), ValueError, r"max_q must be at least the longest query sequence, 4, got max_q = 3"),
    "max_k too small": (dict(max_k=4), ValueError, r"max_k must be at least the longest key sequence, 5, got max_k = 4"),
    "max_q a float": (dict(max_q=4.0), TypeError, r"max_q must be an int"),
    "max_k a tensor": (dict(max_k=torch.tensor(5)), TypeError, r"max_k must be an int"),
}


@pytest.mark.parametrize("case", sorted(BAD_VARLEN_INPUTS))
def test_varlen_names_the_bad_argument(case):
    change, error, message = BAD_VARLEN_INPUTS[case]
    arguments = {**_good_arguments(), **change}
    with pytest.raises(error, match=message):
        pbs.varlen_attention(**arguments, config=REFERENCE)


@pytest.mark.parametrize("out, error, message", [
    (torch.zeros(7, 4, 8), ValueError, r"out must have shape \(Tq, Hq, Dv\) = \(7, 4, 16\)"),
    (torch.zeros(7, 4, 16, dtype=torch.float16), ValueError, r"q's dtype torch.float32"),
    ("buffer", TypeError, r"out must be a torch.Tensor or None, got str"),
])
def test_varlen_checks_the_given_out(out, error, message):
    with pytest.raises(error, match=message):
        pbs.varlen_attention(**_good_arguments(), config=REFERENCE, out=out)


def test_varlen_checks_the_scale_even_when_every_sequence_is_empty():
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        pbs.varlen_attention(torch.zeros(0, 2, 16), torch.zeros(3, 2, 16), torch.zeros(3, 2, 16),
                             _int32([0, 0]), _int32([0, 3]), 0, 3, REFERENCE, scale=-1.0)


def test_the_good_arguments_of_the_bad_input_tests_run():
    assert pbs.varlen_attention(**_good_arguments(), config=REFERENCE).shape == (7, 4, 16)


# -- merging partial results -----------------------------------------------------------------------
def attention_and_lse_float64(q, k, v, key_slice, causal=True):
    """Causal attention of ``q (B, H, N, D)`` over the keys ``key_slice`` of ``k, v (B, H, N, D)``
    (queries and keys at positions 0..N-1), by an explicit float64 softmax: ``(o, lse)``, ``o = 0``
    and ``lse = -inf`` for a query that sees none of those keys."""
    n = q.shape[2]
    scores = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    keep = torch.zeros(n, n, dtype=torch.bool)
    keep[:, key_slice] = True
    if causal:
        keep &= torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1))  # rows without keys: all 0
    return probs @ v.double(), lse


def to_packed(o, lse):
    """Batched ``o (1, H, N, D)``, ``lse (1, H, N)`` as packed ``o (N, H, D)``, ``lse (H, N)``."""
    return o[0].transpose(0, 1), lse[0]


@pytest.mark.parametrize("layout", ["batched", "packed"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_merging_prefix_and_suffix_equals_attention_over_all_keys(layout, dtype):
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 3, 50, 8, generator=gen) for _ in range(3))
    full, full_lse = attention_and_lse_float64(q, k, v, slice(None))
    # Causal: the first 20 queries see no suffix key, so their suffix LSE is -inf.
    prefix = attention_and_lse_float64(q, k, v, slice(0, 20))
    suffix = attention_and_lse_float64(q, k, v, slice(20, None))
    assert torch.isneginf(suffix[1][..., :20]).all()
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    parts = [(o.to(dtype), lse.to(lse_dtype)) for o, lse in (prefix, suffix)]
    if layout == "packed":
        parts = [to_packed(*part) for part in parts]
        full, full_lse = to_packed(full, full_lse)
    (o_a, lse_a), (o_b, lse_b) = parts
    o, lse = pbs.merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert o.dtype == dtype and o.shape == full.shape and lse.dtype == lse_dtype and lse.shape == full_lse.shape
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(o.double(), full, rtol=0, atol=tolerance)
    torch.testing.assert_close(lse.double(), full_lse, rtol=0, atol=1e-5 if lse_dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("layout", ["batched", "packed"])
def test_merging_two_sides_without_keys_gives_zero_and_minus_infinity(layout):
    o = torch.randn(4, 2, 8) if layout == "packed" else torch.randn(1, 2, 4, 8)
    lse = torch.full((2, 4) if layout == "packed" else (1, 2, 4), float("-inf"))
    lse[..., 0] = 1.5  # one query does see keys on side a
    o_b = torch.full_like(o, float("nan"))  # an unwritten row of a side without keys is ignored
    merged, merged_lse = pbs.merge_attention_states(o, lse, o_b, lse.clone().fill_(float("-inf")))
    assert not merged.isnan().any() and not merged_lse.isnan().any()
    first = merged[0] if layout == "packed" else merged[..., 0, :]
    rest = merged[1:] if layout == "packed" else merged[..., 1:, :]
    torch.testing.assert_close(first, o[0] if layout == "packed" else o[..., 0, :])
    assert (rest == 0).all() and torch.isneginf(merged_lse[..., 1:]).all() and (merged_lse[..., 0] == 1.5).all()


def test_merge_writes_into_out_which_may_be_o_a():
    o_a, o_b = torch.randn(2, 3, 5, 4).half(), torch.randn(2, 3, 5, 4).half()
    lse_a, lse_b = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    expected, expected_lse = pbs.merge_attention_states(o_a, lse_a, o_b, lse_b)
    o, lse = pbs.merge_attention_states(o_a, lse_a, o_b, lse_b, out=o_a)
    assert o is o_a
    assert torch.equal(o, expected) and torch.equal(lse, expected_lse)


def _merge_arguments():
    return dict(o_a=torch.zeros(6, 2, 4), lse_a=torch.zeros(2, 6), o_b=torch.zeros(6, 2, 4), lse_b=torch.zeros(2, 6))


BAD_MERGE_INPUTS = {
    "o_a not a tensor": (dict(o_a=[0.0]), TypeError, r"o_a must be a torch.Tensor, got list"),
    "o_a 2-D": (dict(o_a=torch.zeros(6, 8)), ValueError, r"o_a must be batched \(B, H, N, D\) .* or packed \(T, H, D\)"),
    "o_a int": (dict(o_a=torch.zeros(6, 2, 4, dtype=torch.int32)), TypeError, r"o_a must have dtype float16, bfloat16, float32 or float64"),
    "o_b shape": (dict(o_b=torch.zeros(5, 2, 4)), ValueError, r"o_b must have o_a's shape \(6, 2, 4\)"),
    "o_b dtype": (dict(o_b=torch.zeros(6, 2, 4, dtype=torch.float16)), ValueError, r"o_b must have o_a's shape .* and dtype torch.float32"),
    "lse_a in (T, H)": (dict(lse_a=torch.zeros(6, 2)), ValueError, r"lse_a must have shape \(2, 6\) .* \(o \(T, H, D\) with lse \(H, T\)\), got \(6, 2\)"),
    "lse_b batched shape": (dict(o_a=torch.zeros(1, 2, 6, 4), o_b=torch.zeros(1, 2, 6, 4), lse_a=torch.zeros(1, 2, 6),
                                 lse_b=torch.zeros(2, 6)), ValueError, r"lse_b must have shape \(1, 2, 6\)"),
    "lse_a float16": (dict(lse_a=torch.zeros(2, 6, dtype=torch.float16)), TypeError, r"lse_a must have dtype float32 \(or float64\), got torch.float16"),
    "lse dtypes differ": (dict(lse_b=torch.zeros(2, 6, dtype=torch.float64)), TypeError, r"lse_a and lse_b must share a dtype"),
    "lse_b on meta": (dict(lse_b=torch.zeros(2, 6, device="meta")), ValueError, r"must be on one device, got o_a: cpu, lse_a: cpu, o_b: cpu, lse_b: meta"),
    "out shape": (dict(out=torch.zeros(6, 2, 5)), ValueError, r"out must have o_a's shape \(6, 2, 4\), dtype torch.float32"),
    "out not a tensor": (dict(out=1.0), TypeError, r"out must be a torch.Tensor or None, got float"),
}


@pytest.mark.parametrize("case", sorted(BAD_MERGE_INPUTS))
def test_merge_names_the_bad_argument(case):
    change, error, message = BAD_MERGE_INPUTS[case]
    arguments = {**_merge_arguments(), **change}
    out = arguments.pop("out", None)
    with pytest.raises(error, match=message):
        pbs.merge_attention_states(**arguments, out=out)


# -- the log-sum-exp (waits for pbs.attention(..., return_lse=True)) ---------------------------------
def masked_scores_logsumexp(q, k, plan, scale=None):
    """``logsumexp`` of the scaled scores over the keys a plan lets each query attend to (every
    causally allowed key for ``plan=None``: dense attention), in float64: ``(1, Hq, Nq)`` in the
    original query order. Queries are the last ``Nq`` of the ``Nk`` positions."""
    _, heads_q, nq, d = q.shape
    nk = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    query_positions = torch.arange(nk - nq, nk, device=q.device).expand(1, heads_q, nq)
    key_positions = torch.arange(nk, device=q.device).expand(1, k.shape[1], nk)
    keep_blocks = None
    if plan is not None:  # the plan's mask is over permuted slots: score in that order
        q, k = plan.query_permutation.apply(q), plan.key_permutation.apply(k)
        query_positions, key_positions = plan.query_positions(), plan.key_positions()
        bs = plan.layout.block_size
        keep_blocks = plan.mask.to_dense().repeat_interleave(bs, -2)[..., :nq, :].repeat_interleave(bs, -1)[..., :nk]
    group = heads_q // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    key_positions = key_positions.repeat_interleave(group, dim=1)
    keep = key_positions.unsqueeze(-2) <= query_positions.unsqueeze(-1)  # causal on original positions
    if keep_blocks is not None:
        keep = keep & keep_blocks
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    lse = scores.masked_fill(~keep, float("-inf")).logsumexp(-1)
    if plan is None:
        return lse
    # Slot j holds original query plan.query_permutation.indices[..., j].
    return torch.empty_like(lse).scatter_(-1, plan.query_permutation.indices.expand_as(lse), lse)


@needs_lse
@pytest.mark.parametrize("config", [
    {**REFERENCE, **ALL_BLOCKS},
    {**REFERENCE, "block_size": 32, "segment_size": 64, "permuter": "last_block", "selector": {"name": "budget", "density": 0.4}},
    {"backend": "triton", "block_size": 32, "segment_size": 64, "selector": {"name": "budget", "density": 0.5}},
], ids=["full", "sparse-permuted", "triton"])
def test_attention_lse_equals_logsumexp_of_the_masked_scores(config):
    device = TRITON_DEVICE if config["backend"] == "triton" else "cpu"
    (q, k, v), = make_sequences([(70, 200)], heads_q=4, heads_kv=2, seed=11, device=device)
    out, lse, plan = pbs.attention(q, k, v, config, return_lse=True, return_plan=True)
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 70)
    torch.testing.assert_close(lse.double(), masked_scores_logsumexp(q, k, plan), rtol=0, atol=1e-4)


@needs_lse
def test_varlen_lse_equals_the_loop_and_logsumexp(monkeypatch):
    config = {**REFERENCE, "block_size": 32, "segment_size": 64, "selector": {"name": "budget", "density": 0.5}}
    sequences = make_sequences([(1, 1), (0, 9), (129, 129), (40, 300)], heads_q=4, heads_kv=1, seed=12)
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    spy = AttentionSpy(monkeypatch)
    out, lse = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, return_lse=True)
    monkeypatch.undo()
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    assert torch.equal(out, pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config))
    plans = iter(spy.plans)
    bounds = cu_seq_q.tolist()
    for (sq, sk, sv), start, end in zip(sequences, bounds, bounds[1:]):
        if start == end:
            continue
        _, expected_lse = pbs.attention(sq, sk, sv, config, return_lse=True)
        assert torch.equal(lse[:, start:end], expected_lse[0])
        torch.testing.assert_close(lse[:, start:end].double(), masked_scores_logsumexp(sq, sk, next(plans))[0],
                                   rtol=0, atol=1e-4)


@needs_lse
def test_dense_fallback_returns_the_dense_lse():
    config = {"dense_fallback": {"devices": ["cpu"], "min_seq_len": 1000}}
    (q, k, v), = make_sequences([(30, 100)], seed=13)
    out, lse, plan = pbs.attention(q, k, v, config, return_lse=True, return_plan=True)
    assert plan.dense_rule == "length"
    torch.testing.assert_close(lse.double(), masked_scores_logsumexp(q, k, None), rtol=0, atol=1e-4)


@needs_lse
def test_merging_a_cached_prefix_and_a_causal_chunk_equals_attention_over_both():
    # Chunked prefill: the chunk's queries see every prefix key (non-causal part) and their own
    # keys causally; at full density the merged parts equal one call over all keys.
    (q, k, v), = make_sequences([(48, 160)], heads_q=4, heads_kv=2, seed=14)
    prefix, chunk = slice(0, 112), slice(112, 160)
    dense = {**REFERENCE, **ALL_BLOCKS}
    o_prefix, lse_prefix = pbs.attention(q, k[:, :, prefix], v[:, :, prefix], {**dense, "causal": False}, return_lse=True)
    o_chunk, lse_chunk = pbs.attention(q, k[:, :, chunk], v[:, :, chunk], dense, return_lse=True)
    o, lse = pbs.merge_attention_states(o_prefix, lse_prefix, o_chunk, lse_chunk)
    full, full_lse = pbs.attention(q, k, v, dense, return_lse=True)
    torch.testing.assert_close(o, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-5)


def test_host_bounds_replace_the_device_read_and_are_checked(monkeypatch):
    """A caller that holds the boundaries on the host (a plan made once per forward) passes them:
    the result is the same, nothing is read on the device, and wrong values are named."""
    sequences = make_sequences([(40, 40), (0, 9), (10, 30)], seed=21)
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    bounds = (cu_seq_q.tolist(), cu_seq_k.tolist())
    expected = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, REFERENCE)
    monkeypatch.setattr(pbs.serving.varlen, "read_bounds", lambda *a: pytest.fail("read on the device"))
    out = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, REFERENCE, host_bounds=bounds)
    assert torch.equal(out, expected)
    bad = {
        "must start at 0": ([1, 40, 40, 50], bounds[1]),
        "must end at the packed length": (bounds[0], [0, 40, 49, 78]),
        "must hold the 4 values": (bounds[0][:3], bounds[1]),
        "sequence 2 has len_q = 10 queries and len_k = 0 keys": (bounds[0], [0, 40, 79, 79]),
        "must be a pair": bounds[0],
    }
    for message, value in bad.items():
        with pytest.raises((ValueError, TypeError), match=message):
            pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, REFERENCE, host_bounds=value)
    with pytest.raises(ValueError, match="host_bounds is taken without capturable"):
        pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, REFERENCE, host_bounds=bounds,
                             capturable=True)


def test_host_bounds_of_a_paged_call_replace_its_device_read_and_are_checked(monkeypatch):
    """A paged call takes ``(cu_seq_q's values, seqused_k's values)``: the same result with no read
    of the lengths on the device (a serving engine knows them per step, so each layer's call
    syncs nothing for them), and the paged checks still name wrong values and pages."""
    from tests.test_paged import paged_cache

    sequences = make_sequences([(40, 40), (0, 9), (10, 30)], seed=22)
    q, _, _, cu_seq_q, _, max_q, max_k = pack(sequences)
    k_cache, v_cache, table, seqused_k = paged_cache(sequences, 16)
    args = (q, k_cache, v_cache, cu_seq_q, None, max_q, max_k, REFERENCE)
    expected = pbs.varlen_attention(*args, block_table=table, seqused_k=seqused_k)
    bounds = (cu_seq_q.tolist(), seqused_k.tolist())
    monkeypatch.setattr(pbs.serving.varlen, "read_paged_bounds", lambda *a: pytest.fail("read on the device"))
    out = pbs.varlen_attention(*args, block_table=table, seqused_k=seqused_k, host_bounds=bounds)
    assert torch.equal(out, expected)
    bad_table = table.clone()
    bad_table[2, 1] = k_cache.shape[0]
    bad = {
        "must hold the 4 values of cu_seq_q and the 3 of seqused_k": (bounds[0], bounds[1] + [5]),
        r"sequence 2 has len_q = 10 queries and seqused_k\[2\] = 5 keys": (bounds[0], [40, 9, 5]),
        "is more than the pages of block_table hold": (bounds[0], [40, 9, 10_000]),
        "must end at the packed length": ([0, 40, 40, 49], bounds[1]),
    }
    for message, value in bad.items():
        with pytest.raises(ValueError, match=message):
            pbs.varlen_attention(*args, block_table=table, seqused_k=seqused_k, host_bounds=value)
    with pytest.raises(ValueError, match=r"block_table\[2, 1\] = \d+ is not a page of the cache"):
        pbs.varlen_attention(*args, block_table=bad_table, seqused_k=seqused_k, host_bounds=bounds)
