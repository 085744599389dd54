"""Bad input gets a clear error that names the argument and what is accepted."""

from __future__ import annotations

import pytest
import torch

import pbs
from tests.helpers import random_qkv


# The dense-by-length rule on the CPU (it applies on CUDA by default): 64 tokens are far below
# min_seq_len, so these calls take the dense path that launches SDPA before the checks.
DENSE_BY_LENGTH_ON_CPU = {"dense_fallback": {"devices": ["cpu"]}}


def _qkv():
    return random_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=64)


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, r"q must have 4 dimensions \(B, Hq, Nq, D\)"),
        (lambda q, k, v: (q, k[0], v), ValueError, r"k must have 4 dimensions"),
        (lambda q, k, v: (q, k, v.int()), TypeError, r"v must have dtype float16, bfloat16 or float32"),
        (lambda q, k, v: (q.numpy(), k, v), TypeError, r"q must be a torch.Tensor"),
        (lambda q, k, v: (q.half(), k, v), ValueError, r"share a dtype.*q: torch.float16"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, r"query heads \(q.shape\[1\] = 3\) must be a multiple of .* \(k.shape\[1\] = 2\)"),
        (lambda q, k, v: (q, k[..., :8], v), ValueError, r"head dim D, got q: 16, k: 8"),
        (lambda q, k, v: (q, k[:, :, :32], v), ValueError, r"k and v must agree"),
        (lambda q, k, v: (q, k[:, :, :32], v[:, :, :32]), ValueError, r"Nq = 64.*Nk = 32"),
        (lambda q, k, v: (torch.cat([q, q]), k, v), ValueError, r"batch sizes differ"),
        (lambda q, k, v: (q.index_fill(2, torch.tensor([5]), float("nan")), k, v), ValueError, r"q contains NaN or inf"),
        (lambda q, k, v: (q, k, v.index_fill(2, torch.tensor([0]), float("inf"))), ValueError, r"v contains NaN or inf"),
        (lambda q, k, v: (q[:, :, :0], k, v), ValueError, r"sequence lengths must be positive"),
    ],
)
@pytest.mark.parametrize("config", [None, DENSE_BY_LENGTH_ON_CPU], ids=["planned", "dense_by_length"])
def test_bad_tensors(mutate, error, message, config):
    # Both paths name the problem: planning checks first; a call too short to plan launches SDPA
    # first and checks after (its errors must be the same).
    q, k, v = mutate(*_qkv())
    with pytest.raises(error, match=message):
        pbs.attention(q, k, v, config)


def test_device_mismatch_is_named():
    q, k, v = _qkv()
    meta = k.to("meta")
    with pytest.raises(ValueError, match=r"one device.*k: meta"):
        pbs.attention(q, meta, v)


def test_finite_check_can_be_disabled():
    q, k, v = _qkv()
    q[0, 0, 3, 0] = float("nan")
    out = pbs.attention(q, k, v, {"check_finite": False, "block_size": 16, "segment_size": 32})
    assert out.shape == q.shape  # no error raised: the caller opted out


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "x"])
def test_bad_scale(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        pbs.attention(q, k, v, scale=scale)


def test_unknown_backend_lists_the_available_ones():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown backend 'nope'; available: auto, hopper, triton, reference, flex"):
        pbs.attention(q, k, v, {"backend": "nope"})


def test_check_finite_default_scans_off_cuda_only():
    config = pbs.PBSConfig()
    assert config.check_finite is None
    assert config.checks_finite(torch.device("cpu"))
    # On CUDA the scan would be a full read of q, k, v and a host sync: off unless asked for.
    assert not config.checks_finite(torch.device("cuda"))
    assert pbs.PBSConfig(check_finite=True).checks_finite(torch.device("cuda"))
    assert not pbs.PBSConfig(check_finite=False).checks_finite(torch.device("cpu"))


def _input_variants():
    """(label, q, k, v, grad_enabled): valid calls and one of each kind of invalid one."""
    q, k, v = _qkv()
    yield "valid", q, k, v, True
    yield "valid GQA 1 kv head", q, k[:, :1], v[:, :1], True
    yield "valid Nq < Nk", q[:, :, 16:], k, v, True
    yield "valid Dv != D", q, k, torch.randn(1, 2, 64, 8), True
    yield "valid fp16", q.half(), k.half(), v.half(), True
    yield "valid parameter subclass", torch.nn.Parameter(q, requires_grad=False), k, v, True
    yield "valid needs grad under no_grad", q.clone().requires_grad_(), k, v, False
    q, k, v = _qkv()
    yield "needs grad", q.clone().requires_grad_(), k, v, True
    yield "non-tensor", q.numpy(), k, v, True
    yield "int dtype", q, k, v.int(), True
    yield "mixed dtypes", q.half(), k, v, True
    yield "rank 3", q[0], k, v, True
    yield "rank 5 v", q, k, v[None], True
    yield "empty batch", q[:0], k[:0], v[:0], True
    yield "zero heads", q[:, :0], k, v, True
    yield "zero kv heads", q, k[:, :0], v[:, :0], True
    yield "heads not a multiple", q[:, :3], k, v, True
    yield "batch differs", torch.cat([q, q]), k, v, True
    yield "k, v lengths differ", q[:, :, :16], k[:, :, :32], v, True
    yield "k, v heads differ", q, k, v[:, :1], True
    yield "head dims differ", q, k[..., :8], v, True
    yield "zero head dim", q[..., :0], k[..., :0], v, True
    yield "zero value dim", q, k, v[..., :0], True
    yield "Nq > Nk", q, k[:, :, :32], v[:, :, :32], True
    yield "empty sequence", q[:, :, :0], k, v, True
    yield "meta k", q, k.to("meta"), v, True
    yield "all meta", q.to("meta"), k.to("meta"), v.to("meta"), True
    yield "sparse q", q.to_sparse(), k, v, True
    yield "sparse v", q, k, v.to_sparse(), True
    yield "nested k", q, _nested(k), v, True


def _nested(x):
    return torch.nested.nested_tensor(list(x.unbind(0)), layout=torch.jagged)


@pytest.mark.parametrize("label, q, k, v, grad_enabled", list(_input_variants()), ids=lambda x: x if isinstance(x, str) else "")
def test_fast_check_agrees_with_the_named_checks(label, q, k, v, grad_enabled):
    # check_qkv runs one fast predicate and, only when it fails, the checks that name the problem:
    # the two must accept exactly the same inputs, or a valid call would hit the "unreachable" line
    # and an invalid one would slip through.
    from pbs.validation import _passes_all_checks, _raise_first_problem

    with torch.set_grad_enabled(grad_enabled):
        fast = _passes_all_checks(q, k, v)
        with pytest.raises((TypeError, ValueError, AssertionError)) as raised:
            _raise_first_problem(q, k, v)
    named_accepts = raised.type is AssertionError and "unreachable" in str(raised.value)
    assert fast == named_accepts, (label, raised.value)
    assert fast == label.startswith("valid"), label


@pytest.mark.parametrize("mutate, message", [
    (lambda q, k, v: (q.clone().requires_grad_(), k, v), r"forward-only"),
    (lambda q, k, v: (q[:, :0], k, v), r"at least one head"),
    (lambda q, k, v: (q[:0], k[:0], v[:0]), r"batch size must be positive"),
    (lambda q, k, v: (q, k, v[..., :0]), r"head dims must be positive"),
    (lambda q, k, v: (q, k, v.to("meta")), r"one device"),
])
def test_dense_by_length_refuses_what_sdpa_would_accept(mutate, message):
    # SDPA runs these (or fails its own way); PBS still refuses them with its own error.
    q, k, v = mutate(*_qkv())
    with pytest.raises(ValueError, match=message):
        pbs.attention(q, k, v, DENSE_BY_LENGTH_ON_CPU)


def test_dense_by_length_launches_before_it_checks(monkeypatch):
    # The checks run while the GPU computes: dense attention is called first, the checks after,
    # and the result is dense attention.
    import pbs.api

    order = []
    real_sdpa, real_check = pbs.api.dense_attention, pbs.api.check_qkv
    monkeypatch.setattr(pbs.api, "dense_attention", lambda *a, **kw: order.append("sdpa") or real_sdpa(*a, **kw))
    monkeypatch.setattr(pbs.api, "check_qkv", lambda *a, **kw: order.append("checks") or real_check(*a, **kw))
    q, k, v = _qkv()
    out, plan = pbs.attention(q, k, v, DENSE_BY_LENGTH_ON_CPU, return_plan=True)
    assert order == ["sdpa", "checks"] and plan.dense_rule == "length"
    torch.testing.assert_close(out, pbs.reference.dense_attention(q, k, v).to(q.dtype), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call", ["attention", "plan"])
@pytest.mark.parametrize("config", [None, DENSE_BY_LENGTH_ON_CPU], ids=["planned", "dense_by_length"])
def test_a_number_as_q_is_named(call, config):
    # Needs pbs.api to check q before it reads q.device (today an AttributeError from api.py).
    _, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got float"):
        if call == "attention":
            pbs.attention(1.0, k, v, config)
        else:
            pbs.plan(1.0, k, config)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("config", [None, DENSE_BY_LENGTH_ON_CPU], ids=["planned", "dense_by_length"])
def test_sparse_tensors_are_refused_by_name(which, config):
    # A sparse COO tensor used to reach the finite check and fail there (aten::aminmax on SparseCPU).
    tensors = dict(zip("qkv", _qkv()))
    tensors[which] = tensors[which].to_sparse()
    with pytest.raises(TypeError, match=rf"{which} must be a strided \(dense\) tensor, got layout torch.sparse_coo"):
        pbs.attention(tensors["q"], tensors["k"], tensors["v"], config)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_nested_and_other_layouts_are_refused_by_name():
    from pbs.validation import check_qkv

    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"k must be a strided \(dense\) tensor, got a nested tensor"):
        check_qkv(q, _nested(k), v)
    with pytest.raises(TypeError, match=r"v must be a strided \(dense\) tensor, got layout torch.sparse_csr"):
        check_qkv(q, k, v[0, 0].to_sparse_csr())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
@pytest.mark.parametrize("entry", ["attention", "attention_lse", "plan"])
def test_nested_inputs_get_the_clear_error_from_every_entry_point(layout, entry):
    # pbs.attention's shape-only dense decision read a nested tensor's sizes before the checks ran:
    # a jagged one failed inside torch ("ge: relation is indeterminate"), a strided one with
    # "NestedTensorImpl doesn't support sizes".
    gen = torch.Generator().manual_seed(0)
    sequences = [[torch.randn(2, n, 16, generator=gen) for n in (96, 160)] for _ in "qkv"]  # (H, N_i, D) each
    nested = [torch.nested.nested_tensor(x, layout=layout) for x in sequences]
    calls = {"attention": lambda: pbs.attention(*nested), "attention_lse": lambda: pbs.attention(*nested, return_lse=True),
             "plan": lambda: pbs.plan(nested[0], nested[1])}
    with pytest.raises(TypeError, match=r"q must be a strided \(dense\) tensor, got a nested tensor.*pbs\.varlen_attention"):
        calls[entry]()


@pytest.mark.parametrize("scale", [1e300, 1e5, 10**400, True], ids=["1e300", "1e5", "10**400", "True"])
def test_a_scale_that_overflows_the_logits_is_refused(scale):
    # Needs pbs.api to take the scale from pbs.validation.check_scale: 1e300 was accepted and
    # every output row was exactly 0.
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"scale must be a positive finite number in \(0, 10000\]"):
        pbs.attention(q, k, v, scale=scale)


def test_check_scale():
    from pbs.validation import MAX_SCALE, check_scale

    assert check_scale(None, 64) == 0.125
    assert check_scale(2, 64) == 2.0 and type(check_scale(2, 64)) is float
    assert check_scale(MAX_SCALE, 64) == MAX_SCALE and check_scale(1e-30, 64) == 1e-30
    for bad in [0, -1.0, float("nan"), float("inf"), float("-inf"), MAX_SCALE * 1.01, 1e300, 10**400, True, False,
                "0.1", torch.tensor(0.1), [0.1]]:
        with pytest.raises(ValueError, match=r"scale must be a positive finite number in \(0, 10000\] or None \(the default head_dim \*\* -0.5 = 0.125\)"):
            check_scale(bad, 64)


def _mask_and_layout(batch=1, heads=2, seq_len=192, block=64):
    from pbs.layout import Layout
    from pbs.types import BlockMask

    layout = Layout(batch, heads, heads, seq_len, seq_len, block, block, segmented=False)
    return BlockMask.from_dense(layout.allowed_blocks().expand(batch, heads, -1, -1).clone(), layout), layout


def test_check_selector_result_accepts_good_results():
    from pbs.validation import check_selector_result

    mask, layout = _mask_and_layout()
    check_selector_result(mask, layout, torch.device("cpu"), "mine")
    check_selector_result(mask.to_dense(), layout, "cpu", "mine")
    given = pbs.BlockMask(mask.counts, mask.indices, layout, full_counts=mask.full_counts.clone())
    check_selector_result(given, layout, "cpu", "mine")
    empty = pbs.BlockMask.from_dense(torch.zeros_like(mask.to_dense()), layout)
    check_selector_result(empty, layout, "cpu", "mine")


@pytest.mark.parametrize("mutate, error, message", [
    (lambda m, l: None, TypeError, r"selector 'mine' returned NoneType"),
    (lambda m, l: m.to_dense().int(), ValueError, r"bool tensor of shape \(B, Hq, Tq, Tk\) = \(1, 2, 3, 3\), got torch.int32"),
    (lambda m, l: m.to_dense()[..., :2], ValueError, r"got torch.bool \(1, 2, 3, 2\)"),
    (lambda m, l: pbs.BlockMask(m.counts.long(), m.indices, l), ValueError, r"whose counts is torch.int64 \(1, 2, 3\); expected int32"),
    (lambda m, l: pbs.BlockMask(m.counts, m.indices[..., :2], l), ValueError, r"whose indices is torch.int16 \(1, 2, 3, 2\); expected int16 or int32 of shape \(1, 2, 3, 3\)"),
    (lambda m, l: pbs.BlockMask(m.counts, m.indices, l, full_counts=m.counts + 1), ValueError, r"invalid values.*full_counts <= counts"),
    (lambda m, l: pbs.BlockMask(m.counts - 1, m.indices, l), ValueError, r"invalid values.*followed by -1"),
    (lambda m, l: pbs.BlockMask(m.counts, m.indices.clamp(min=0), l), ValueError, r"invalid values"),
    (lambda m, l: pbs.BlockMask(m.counts, m.indices, "layout"), ValueError, r"whose layout is a str"),
    (lambda m, l: pbs.BlockMask(m.counts, m.indices, __import__("dataclasses").replace(l, causal=False)), ValueError,
     r"built for another layout: causal=False \(expected True\); build it with inputs.layout"),
], ids=["none", "int_tensor", "short_tensor", "int64_counts", "short_indices", "full_counts_above_counts",
        "entry_past_count", "no_padding", "not_a_layout", "other_layout"])
def test_check_selector_result_names_the_problem(mutate, error, message):
    from pbs.validation import check_selector_result

    mask, layout = _mask_and_layout()
    with pytest.raises(error, match=message):
        check_selector_result(mutate(mask, layout), layout, "cpu", "mine")


@pytest.mark.parametrize("keyword, hint", [
    ("causal", r"PBSConfig\(causal=\.\.\.\), True by default"),
    ("is_causal", r"PBSConfig\(causal=\.\.\.\), True by default"),
    ("softmax_scale", r"scale=\.\.\."),
    ("enable_gqa", r"GQA needs no flag"),
])
@pytest.mark.parametrize("call", ["attention", "plan"])
def test_keywords_from_sdpa_and_flash_attention_get_a_hint(call, keyword, hint):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=rf"pbs.{call}\(\) got an unexpected keyword argument '{keyword}': .*{hint}"):
        if call == "attention":
            pbs.attention(q, k, v, **{keyword: True})
        else:
            pbs.plan(q, k, **{keyword: True})
    with pytest.raises(TypeError, match=rf"unexpected keyword argument 'no_such_thing'$"):
        pbs.attention(q, k, v, no_such_thing=1)
