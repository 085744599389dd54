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
    with pytest.raises(TypeError, match=r"plan must be a pbs.Plan.*return_plan=True\) returns None"):
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
