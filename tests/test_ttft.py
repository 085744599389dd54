"""`pbs.integrations.ttft`: the one TTFT measurement of ``pbs generate`` and ``benchmarks/bench_ttft.py``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import pbs.integrations.ttft as ttft_module  # noqa: E402
from pbs.integrations.ttft import TTFT, measure_ttft, prefill_first_token  # noqa: E402
from tests.helpers import tiny_model_config  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_model_config("llama"), attn_implementation="sdpa").eval()


def _prompt(length: int = 40) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(1))


class _Counting(torch.nn.Module):
    """Counts forwards and records the keyword arguments of the last one."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model, self.calls, self.kwargs = model, 0, {}

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        self.calls += 1
        self.kwargs = {"use_cache": use_cache, "logits_to_keep": logits_to_keep}
        return self.model(input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep)


def test_first_token_is_the_greedy_token_of_the_full_forward(model):
    ids = _prompt()
    with torch.no_grad():
        expected = model(input_ids=ids).logits[:, -1].argmax(-1)
    assert torch.equal(prefill_first_token(model, ids), expected)


def test_measure_ttft_runs_warmup_plus_repeats_with_a_cache_and_one_position_of_logits(model):
    counting = _Counting(model)
    result = measure_ttft(counting, _prompt(), warmup=2, repeats=3)
    assert counting.calls == 5
    assert counting.kwargs == {"use_cache": True, "logits_to_keep": 1}
    assert isinstance(result, TTFT) and len(result.times) == 3 and all(t > 0 for t in result.times)
    assert result.device_times is None  # CUDA events only on CUDA
    assert result.min <= result.median <= result.max


def test_default_repeats_and_the_long_prefill_rule(model, monkeypatch):
    assert len(measure_ttft(model, _prompt(), warmup=0).times) == ttft_module.DEFAULT_REPEATS
    monkeypatch.setattr(ttft_module, "LONG_PREFILL_S", 0.0)  # every prefill counts as long
    assert len(measure_ttft(model, _prompt(), warmup=0).times) == 3
    assert len(measure_ttft(model, _prompt(), warmup=0, repeats=4).times) == 4  # explicit repeats are kept


def test_models_without_logits_to_keep_get_full_logits():
    class Plain(torch.nn.Module):
        def forward(self, input_ids, use_cache=False):
            logits = torch.zeros(*input_ids.shape, 5)
            logits[:, -1, 3] = 1.0
            return type("Out", (), {"logits": logits})()

    assert prefill_first_token(Plain(), _prompt(7)).tolist() == [3]
    assert len(measure_ttft(Plain(), _prompt(7), warmup=0, repeats=2).times) == 2
