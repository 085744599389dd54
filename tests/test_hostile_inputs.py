"""Hostile and unusual inputs: each gets a clear error naming the problem, or the right answer."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

import pbs
from pbs.components import PermuterConfig, Permutations, SelectorConfig, permuter_registry, selector_registry
from pbs.types import Permutation
from tests.helpers import random_qkv, small_config


def _register_permuter(name, make_indices):
    assert name == "hostile_test_permuter"
    """A custom permuter whose key indices come from ``make_indices(n) -> (N,) tensor`` (or any object)."""

    class Custom(PermuterConfig):
        name: Literal["hostile_test_permuter"] = "hostile_test_permuter"

        def permute(self, inputs):
            n = inputs.layout.seq_len_k
            heads = inputs.key_heads
            out = make_indices(n)
            if isinstance(out, torch.Tensor) and out.dim() == 1:
                out = Permutation.from_indices(out.expand(inputs.layout.batch, heads, n).clone())
                return Permutations(keys=out)
            return out

    permuter_registry.register(Custom)
    return Custom


@pytest.fixture
def custom_name():
    name = "hostile_test_permuter"
    yield name
    permuter_registry.unregister(name)


def _swap(n, a, b):
    idx = torch.arange(n)
    idx[a], idx[b] = idx[b].clone(), idx[a].clone()
    return idx


@pytest.mark.parametrize(
    "make_indices, message",
    [
        (lambda n: _swap(n, 10, 100), r"invalid key permutation.*inside their own segment"),  # crosses segments
        (lambda n: torch.arange(n).index_fill(0, torch.tensor([5]), 6), r"invalid key permutation.*bijection"),
        (lambda n: _swap(n, n - 1, n - 2), r"invalid key permutation"),  # moves the unpermuted tail
    ],
)
def test_permutation_that_breaks_the_segment_rule_is_refused(custom_name, make_indices, message):
    _register_permuter(custom_name, make_indices)
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=300)
    with pytest.raises(ValueError, match=message):
        pbs.attention(q, k, v, small_config(permuter=custom_name, gqa="per_head"))


def test_a_valid_custom_permutation_is_accepted(custom_name):
    _register_permuter(custom_name, lambda n: _swap(n, 10, 20))  # both in segment 0 of 64 tokens
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=300)
    config = small_config(permuter=custom_name, gqa="per_head", selector={"name": "budget", "density": 1.0})
    out = pbs.attention(q, k, v, config)
    torch.testing.assert_close(out, pbs.reference.dense_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_out_of_range_indices_get_a_clear_error(custom_name):
    _register_permuter(custom_name, lambda n: torch.arange(n) + 1)
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=128)
    with pytest.raises(ValueError, match=r"Permutation indices must lie in 0..127"):
        pbs.attention(q, k, v, small_config(permuter=custom_name, gqa="per_head"))


def test_permuter_returning_a_raw_tensor_is_named(custom_name):
    _register_permuter(custom_name, lambda n: Permutations(keys=torch.arange(n)[None, None]))
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=128)
    with pytest.raises(TypeError, match=r"permuter 'hostile_test_permuter' returned keys=Tensor"):
        pbs.attention(q, k, v, small_config(permuter=custom_name))


def test_permuter_returning_something_else_is_named(custom_name):
    _register_permuter(custom_name, lambda n: torch.arange(n)[None, None].clone().expand(1, 2, n))
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=128)
    with pytest.raises(TypeError, match=r"returned Tensor; permute\(\) must return pbs.Permutations"):
        pbs.attention(q, k, v, small_config(permuter=custom_name, gqa="per_head"))


def test_selector_returning_none_is_named():
    class NoneSelector(SelectorConfig):
        name: Literal["hostile_none"] = "hostile_none"

        def select(self, inputs):
            return None

    selector_registry.register(NoneSelector)
    try:
        q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=128)
        with pytest.raises(TypeError, match=r"selector 'hostile_none' returned NoneType"):
            pbs.attention(q, k, v, small_config(selector="hostile_none"))
    finally:
        selector_registry.unregister("hostile_none")


def test_run_without_a_plan_is_named():
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=128)
    with pytest.raises(TypeError, match=r"plan must be a pbs.Plan from pbs.plan\(\) or attention\(\.\.\., return_plan=True\), got NoneType"):
        pbs.run(None, q, k, v)


@pytest.mark.parametrize(
    "shape_q, shape_kv, message",
    [
        ((0, 2, 64, 16), (0, 2, 64, 16), r"batch size must be positive"),
        ((1, 0, 64, 16), (1, 2, 64, 16), r"at least one head"),
    ],
)
def test_empty_batch_or_heads(shape_q, shape_kv, message):
    q, k = torch.randn(shape_q), torch.randn(shape_kv)
    with pytest.raises(ValueError, match=message):
        pbs.attention(q, k, k.clone())


def test_meta_tensors_are_refused_clearly():
    q = torch.empty(1, 2, 64, 16, device="meta")
    for check_finite in (True, False):
        with pytest.raises(ValueError, match=r"meta tensors are not supported"):
            pbs.attention(q, q, q, {"check_finite": check_finite})


def test_inputs_that_need_grad_are_refused_as_forward_only():
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=64)
    q.requires_grad_()
    with pytest.raises(ValueError, match=r"forward-only"):
        pbs.attention(q, k, v)
    with torch.no_grad():
        out = pbs.attention(q, k, v, small_config())
    assert out.grad_fn is None


def test_two_classes_from_one_factory_cannot_share_a_name():
    def make():
        class Factory(SelectorConfig):
            name: Literal["hostile_factory"] = "hostile_factory"

        return Factory

    selector_registry.register(make())
    try:
        with pytest.raises(ValueError, match=r"already registered.*different class object"):
            selector_registry.register(make())
    finally:
        selector_registry.unregister("hostile_factory")


@pytest.fixture
def float64_default():
    """Runs the test body's second half under ``torch.set_default_dtype(torch.float64)``."""
    before = torch.get_default_dtype()
    yield lambda: torch.set_default_dtype(torch.float64)
    torch.set_default_dtype(before)


def _plan_arrays(plan):
    return plan.key_permutation.indices, plan.query_permutation.indices, plan.mask.counts, plan.mask.indices


@pytest.mark.parametrize(
    "component",
    [("permuter", name) for name in pbs.list_permuters()] + [("selector", name) for name in pbs.list_selectors()],
    ids=lambda c: f"{c[0]}-{c[1]}",
)
def test_float64_default_dtype_gives_the_same_plan(component, float64_default):
    # Components make their float tensors in an explicit dtype: under a float64 default dtype a
    # torch.full without dtype made float64 block means (key_aware_query failed in einsum) and
    # a seeded torch.rand drew other values (random chose another order).
    kind, name = component
    q, k, _ = random_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=512, head_dim=32)
    others = {"permuter": "last_block", "selector": "mean_pool"}
    config = pbs.PBSConfig(
        block_size=64, segment_size=128, backend="reference", gqa="per_head", **{**others, kind: name}
    )
    expected = _plan_arrays(pbs.plan(q, k, config))
    float64_default()
    got = _plan_arrays(pbs.plan(q, k, config))
    for what, a, b in zip(("key permutation", "query permutation", "counts", "indices"), expected, got):
        assert torch.equal(a, b), what


class _CustomSelector(SelectorConfig):
    """Base of the selectors below: ``select`` returns what ``make(inputs)`` gives."""

    name: Literal["hostile_selector"] = "hostile_selector"


@pytest.fixture
def custom_selector():
    """Registers ``hostile_selector`` returning ``make(inputs)``; yields a function taking ``make``."""

    def register(make):
        class Custom(_CustomSelector):
            def select(self, inputs):
                return make(inputs)

        selector_registry.register(Custom, overwrite=True)

    yield register
    selector_registry.unregister("hostile_selector")


def _every_allowed_block(inputs) -> pbs.BlockMask:
    layout = inputs.layout
    shape = (layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks)
    return pbs.BlockMask.from_dense(inputs.allowed_blocks().expand(shape).clone(), layout)


def _replaced(mask, **fields):
    return pbs.BlockMask(**{"counts": mask.counts, "indices": mask.indices, "layout": mask.layout, **fields})


def _shifted_layout(mask):
    import dataclasses

    return _replaced(mask, layout=dataclasses.replace(mask.layout, seq_len_k=mask.layout.seq_len_k + 64))


def _index_past_the_end(mask):
    indices = mask.indices.clone()
    indices[..., -1, 0] = mask.layout.num_key_blocks  # the last query block's list has every block
    return _replaced(mask, indices=indices)


def _count_past_the_end(mask):
    return _replaced(mask, counts=mask.counts + mask.layout.num_key_blocks)


def _descending(mask):
    return _replaced(mask, indices=mask.indices.flip(-1).clone())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda i: torch.zeros(_every_allowed_block(i).shape, dtype=torch.bool, device="meta"),
         r"selector 'hostile_selector' returned its mask on meta; it must be on cpu"),
        (lambda i: _every_allowed_block(i).to("meta"),
         r"selector 'hostile_selector' returned a BlockMask whose counts lies on meta; it must be on cpu"),
        (lambda i: _shifted_layout(_every_allowed_block(i)),
         r"selector 'hostile_selector' returned a BlockMask built for another layout: seq_len_k=256 \(expected 192\)"),
        (lambda i: _index_past_the_end(_every_allowed_block(i)),
         r"selector 'hostile_selector' returned a BlockMask with invalid values.*in 0..2 in ascending order"),
        (lambda i: _count_past_the_end(_every_allowed_block(i)),
         r"selector 'hostile_selector' returned a BlockMask with invalid values: counts must lie in 0..3"),
        (lambda i: _descending(_every_allowed_block(i)),
         r"selector 'hostile_selector' returned a BlockMask with invalid values.*ascending order"),
        (lambda i: _replaced(_every_allowed_block(i), indices=_every_allowed_block(i).indices.long()),
         r"selector 'hostile_selector' returned a BlockMask whose indices is torch.int64 .*expected int16 or int32"),
    ],
    ids=["bool_on_meta", "block_mask_on_meta", "other_layout", "index_out_of_range", "count_out_of_range",
         "descending", "int64_indices"],
)
def test_a_bad_selector_result_is_named(custom_selector, make, message):
    # Needs pbs.planning.run_selector to call pbs.validation.check_selector_result on the result.
    custom_selector(make)
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=192)
    config = small_config(block_size=64, segment_size=64, selector="hostile_selector")
    with pytest.raises(ValueError, match=message):
        pbs.plan(q, k, config)
    with pytest.raises(ValueError, match=message):
        pbs.attention(q, k, v, config)


def test_a_valid_custom_block_mask_is_accepted(custom_selector):
    custom_selector(_every_allowed_block)
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=192)
    plan = pbs.plan(q, k, small_config(block_size=64, segment_size=64, selector="hostile_selector"))
    assert plan.density == 1.0
