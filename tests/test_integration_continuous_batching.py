"""transformers' continuous batching through PBS: ``generate_batch`` under ``"pbs_flash_varlen"``.

A tiny random Llama (GQA 4:2, 2 layers) generates for prompts of 40, 100 and 170 tokens with the
cache and batch sizes chosen so that one step holds several requests: the 170-token prompt is cut
into a chunk of 128 and a chunk of 42 after 128 cached tokens, and later steps mix a decode token,
a chunk after a cached prefix and a whole prompt. With every block selected, PBS must give SDPA's
greedy tokens. `attend_packed` is also checked alone against `pbs.attention` per request and
against eager attention for the dense paths (sliding window, softcap), and `unpack_call` against a
paged cache of transformers 5.17's convention (this environment runs 5.24).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "ContinuousBatchingConfig"):
    pytest.skip("this transformers has no continuous batching", allow_module_level=True)

import pbs  # noqa: E402
import pbs.integrations.continuous_batching as cb  # noqa: E402
import pbs.integrations.transformers as pbs_hf  # noqa: E402
from tests.helpers import tiny_model_config  # noqa: E402

EXACT = {"permuter": "last_block", "selector": {"name": "budget", "density": 1.0}, "block_size": 16, "segment_size": 32,
         "backend": "reference"}
SPARSE = {"permuter": "last_block", "selector": {"name": "mean_pool", "threshold": 0.5}, "block_size": 16,
          "segment_size": 32, "backend": "reference"}
PROMPT_LENGTHS = (40, 100, 170)
MAX_NEW_TOKENS = 8


# Continuous batching runs on the GPU where there is one (it asks for CUDA streams there), so the
# model goes there too; CUDA graphs off, since this route reads each step's lengths on the host.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = tiny_model_config("llama")
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval().to(DEVICE)


@pytest.fixture(autouse=True)
def exact_pbs():
    pbs_hf.register(EXACT, min_seq_len=1, min_query_len=2)
    yield


def prompts() -> list[list[int]]:
    return [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in PROMPT_LENGTHS]


def batching_config():
    """A small cache, and at most 128 tokens per step so that steps mix requests. The page size is
    ``page_size`` in 5.24 and ``block_size`` in 5.17."""
    fields = {f.name for f in dataclasses.fields(transformers.ContinuousBatchingConfig)}
    page = {"page_size": 64} if "page_size" in fields else {"block_size": 64}
    graphs = {"use_cuda_graph": False} if DEVICE == "cuda" and "use_cuda_graph" in fields else {}
    return transformers.ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=128, **page, **graphs)


def generate_batch(model, implementation: str) -> list[list[int]]:
    pbs_hf.switch_attention(model, implementation)
    generation = transformers.GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None,
                                               pad_token_id=0)
    outputs = model.generate_batch(prompts(), generation_config=generation, continuous_batching_config=batching_config(),
                                   progress_bar=False)
    tokens = [output.generated_tokens for output in outputs.values()]  # in the order of the prompts
    assert [len(t) for t in tokens] == [MAX_NEW_TOKENS] * len(PROMPT_LENGTHS), "a request failed: see the log"
    return tokens


def test_full_density_generate_batch_gives_sdpas_tokens_and_runs_prefills_through_varlen(model, monkeypatch):
    expected = generate_batch(model, "sdpa")
    varlen_calls = []

    def spy(q, k, v, cu_seq_q, cu_seq_k, *args, **kwargs):
        varlen_calls.append((cu_seq_q.tolist(), cu_seq_k.tolist()))
        # The boundaries unpack_call read once are handed on: varlen checks them, reads nothing.
        assert [list(b) for b in kwargs["host_bounds"]] == list(varlen_calls[-1])
        return pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, *args, **kwargs)

    device_reads = []
    real_read = pbs.serving.varlen.read_bounds
    monkeypatch.setattr(pbs.serving.varlen, "read_bounds", lambda *a: device_reads.append(1) or real_read(*a))
    monkeypatch.setattr(cb, "varlen_attention", spy)
    with pbs_hf.trace_dispatch() as calls:
        got = generate_batch(model, pbs_hf.CONTINUOUS_BATCHING_NAME)
    assert got == expected

    assert calls and {c.layer_idx for c in calls} == {0, 1}
    prefill = [c for c in calls if c.q_len > 1]
    decode = [c for c in calls if c.q_len == 1]
    assert all(c.path == "pbs" and c.density == 1.0 for c in prefill)
    assert all(c.path == "sdpa" and c.reason == "decode" for c in decode)
    for layer in (0, 1):  # every prompt token ran PBS, and every generated token but the first decoded
        assert sum(c.q_len for c in prefill if c.layer_idx == layer) == sum(PROMPT_LENGTHS)
        assert len([c for c in decode if c.layer_idx == layer]) == len(PROMPT_LENGTHS) * (MAX_NEW_TOKENS - 1)
    assert any(c.q_len < c.kv_len for c in prefill), "no chunk after a cached prefix: the step sizes changed"
    assert any(c.request and c.request > 0 for c in prefill), "no step packed several prefills"
    assert varlen_calls, "PBS requests must run through pbs.varlen_attention"
    assert not device_reads, "varlen_attention read the boundaries again (a second sync per layer)"


def test_sparse_config_generates_and_follows_the_layer_rules(model, caplog):
    pbs_hf.register(SPARSE, min_seq_len=64, skip_first_layers=1, min_query_len=2)
    with caplog.at_level(logging.INFO, logger="pbs.integrations.transformers"):
        with pbs_hf.trace_dispatch() as calls:
            generate_batch(model, pbs_hf.CONTINUOUS_BATCHING_NAME)
    prefill = [c for c in calls if c.q_len > 1]
    assert {c.reason for c in prefill if c.layer_idx == 0} == {"skipped_layer"}
    layer_1 = [c for c in prefill if c.layer_idx == 1]
    # The 40-token prompt is below min_seq_len; the longer prompts' requests run sparse.
    assert {c.reason for c in layer_1 if c.kv_len < 64} == {"short_sequence"}
    assert {c.path for c in layer_1 if c.kv_len >= 64} == {"pbs"}
    assert min(c.density for c in layer_1 if c.path == "pbs") < 1.0
    logged = {r.getMessage().split("(reason ")[1].split(",")[0] for r in caplog.records if "(reason " in r.getMessage()}
    assert {"'skipped_layer'", "'short_sequence'", "'decode'"} <= logged


def test_outside_continuous_batching_the_name_runs_as_pbs(model):
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kwargs = dict(max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    pbs_hf.switch_attention(model, "sdpa")
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    pbs_hf.switch_attention(model, pbs_hf.CONTINUOUS_BATCHING_NAME)
    with pbs_hf.trace_dispatch() as calls, torch.no_grad():
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    assert {(c.path, c.request) for c in calls if c.q_len == 100} == {("pbs", None)}
    pbs_hf.switch_attention(model, "sdpa")


def test_the_name_is_registered_and_switched_to_directly(model):
    """transformers' own setter tries to import a FlashAttention kernel for any name holding "flash"
    (5.17 and 5.24 alike), so `switch_attention` writes the config itself."""
    name = pbs_hf.CONTINUOUS_BATCHING_NAME
    assert "flash" in name and not any(ch.isdigit() for ch in name)
    assert transformers.AttentionInterface._global_mapping[name] is pbs_hf.pbs_continuous_batching_forward
    pbs_hf.switch_attention(model, "sdpa")
    with pytest.raises(ValueError, match="flash attention"):
        model.set_attn_implementation(name)
    pbs_hf.switch_attention(model, name)
    assert model.config._attn_implementation == pbs_hf.continuous_batching_implementation()
    assert all(layer.self_attn.config._attn_implementation == model.config._attn_implementation
               for layer in model.model.layers)
    pbs_hf.switch_attention(model, "sdpa")
    assert model.config._attn_implementation == "sdpa"


# -- attend_packed and unpack_call alone --------------------------------------------------------------

HEADS_Q, HEADS_KV, HEAD_DIM = 4, 2, 16


def packed_step(requests: list[tuple[int, int]], padding: int = 0, seed: int = 0):
    """Random ``query (1, Hq, Tq + padding, D)`` and keys, values packed for ``(q_len, kv_len)``
    requests, with their boundaries."""
    generator = torch.Generator().manual_seed(seed)
    total_q = sum(q for q, _ in requests)
    total_k = sum(k for _, k in requests)
    query = torch.randn(1, HEADS_Q, total_q + padding, HEAD_DIM, generator=generator)
    key = torch.randn(1, HEADS_KV, total_k + padding, HEAD_DIM, generator=generator)
    value = torch.randn(1, HEADS_KV, total_k + padding, HEAD_DIM, generator=generator)
    bounds_q, bounds_k = [0], [0]
    for q_len, kv_len in requests:
        bounds_q.append(bounds_q[-1] + q_len)
        bounds_k.append(bounds_k[-1] + kv_len)
    return query, cb.PackedBatch(key, value, bounds_q, bounds_k)


def eager_request(query, batch, i, *, sliding_window=None, softcap=None):
    """Request ``i`` by eager attention: ``(q_len, Hq, D)``."""
    q = query[:, :, batch.bounds_q[i] : batch.bounds_q[i + 1]]
    k = batch.key[:, :, batch.bounds_k[i] : batch.bounds_k[i + 1]].repeat_interleave(HEADS_Q // HEADS_KV, dim=1)
    v = batch.value[:, :, batch.bounds_k[i] : batch.bounds_k[i + 1]].repeat_interleave(HEADS_Q // HEADS_KV, dim=1)
    q_len, kv_len = q.shape[2], k.shape[2]
    scores = q @ k.transpose(2, 3) * HEAD_DIM**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(kv_len - q_len, kv_len)[:, None]
    keys = torch.arange(kv_len)[None, :]
    visible = keys <= positions
    if sliding_window is not None:
        visible &= keys > positions - sliding_window
    out = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
    return out[0].transpose(0, 1)


def test_attend_packed_equals_pbs_attention_per_request_and_dense_elsewhere():
    # A prompt, a decode token, a chunk after a cached prefix, nothing new, a short dense prompt,
    # a decode token, a second prompt; then padding rows as a captured step has.
    requests = [(96, 96), (1, 57), (32, 80), (0, 0), (20, 20), (1, 130), (64, 64)]
    query, batch = packed_step(requests, padding=5)
    config = pbs.PBSConfig(**SPARSE)
    configs = [config, None, config, None, None, None, config]
    out, measured = cb.attend_packed(query, batch, configs, measure=True)
    assert out.shape == (1, query.shape[2], HEADS_Q, HEAD_DIM)
    for i, ((q_len, _), request_config) in enumerate(zip(requests, configs)):
        rows = out[0, batch.bounds_q[i] : batch.bounds_q[i + 1]]
        if request_config is not None:
            q = query[:, :, batch.bounds_q[i] : batch.bounds_q[i + 1]]
            k = batch.key[:, :, batch.bounds_k[i] : batch.bounds_k[i + 1]]
            v = batch.value[:, :, batch.bounds_k[i] : batch.bounds_k[i + 1]]
            solo, plan = pbs.attention(q, k, v, request_config, return_plan=True)
            torch.testing.assert_close(rows, solo[0].transpose(0, 1))
            assert measured[i] == cb.Measured(plan.density, None)
        elif q_len:
            torch.testing.assert_close(rows, eager_request(query, batch, i), atol=1e-5, rtol=1e-5)
    assert set(measured) == {0, 2, 6}
    assert torch.equal(out[0, batch.bounds_q[-1] :], torch.zeros(5, HEADS_Q, HEAD_DIM))


@pytest.mark.parametrize("dense", [{"sliding_window": 24}, {"softcap": 5.0}, {"sliding_window": 24, "softcap": 5.0}])
def test_attend_packed_dense_requests_keep_the_window_and_the_softcap(dense):
    requests = [(40, 40), (1, 70), (16, 50), (1, 10)]
    query, batch = packed_step(requests, seed=1)
    out, _ = cb.attend_packed(query, batch, [None] * len(requests), **dense)
    for i in range(len(requests)):
        rows = out[0, batch.bounds_q[i] : batch.bounds_q[i + 1]]
        torch.testing.assert_close(rows, eager_request(query, batch, i, **dense), atol=1e-5, rtol=1e-5)


class PagedCacheOf517:
    """The part of transformers 5.17's ``PagedAttentionCache`` the attention function uses: ``update``
    writes the new keys and returns every request's keys, ``(Tk, Hkv, D)``."""

    def __init__(self, key, value):
        self.key, self.value, self.calls = key, value, []

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        self.calls.append((tuple(key_states.shape), layer_idx, read_index, write_index))
        return self.key[0].transpose(0, 1), self.value[0].transpose(0, 1)


def test_unpack_call_updates_a_517_paged_cache_and_reads_per_type_boundaries():
    requests = [(8, 30), (1, 12)]
    query, batch = packed_step(requests)
    cache = PagedCacheOf517(batch.key, batch.value)
    layer = torch.nn.Module()
    layer.layer_idx = 3
    new_keys = torch.randn(1, HEADS_KV, 9, HEAD_DIM)
    kwargs = {
        "cache": cache, "read_index": ["r"], "write_index": ["w"], "block_table": None,
        "cu_seq_lens_q": torch.tensor([0, 8, 9], dtype=torch.int32),
        "cu_seq_lens_k": {"full_attention": torch.tensor([0, 30, 42], dtype=torch.int32)},
        "max_seqlen_q": 8, "max_seqlen_k": {"full_attention": 30},
    }
    unpacked = cb.unpack_call(layer, new_keys, new_keys, kwargs)
    assert cache.calls == [((1, HEADS_KV, 9, HEAD_DIM), 3, ["r"], ["w"])]
    assert torch.equal(unpacked.key, batch.key) and torch.equal(unpacked.value, batch.value)
    assert (unpacked.bounds_q, unpacked.bounds_k) == ([0, 8, 9], [0, 30, 42])
    assert cb.unpack_call(layer, new_keys, new_keys, {"position_ids": None}) is None


def test_packed_calls_refuse_what_they_cannot_serve(model):
    layer = model.model.layers[0].self_attn
    query, batch = packed_step([(4, 4)])
    packed = {"cu_seq_lens_q": torch.tensor([0, 4], dtype=torch.int32),
              "cu_seq_lens_k": torch.tensor([0, 4], dtype=torch.int32)}
    with pytest.raises(NotImplementedError, match="block table"):
        pbs_hf.pbs_continuous_batching_forward(layer, query, batch.key, batch.value, None, block_table=torch.zeros(1),
                                               **packed)
    with pytest.raises(NotImplementedError, match="attention mask"):
        pbs_hf.pbs_continuous_batching_forward(layer, query, batch.key, batch.value, torch.ones(1, 1, 4, 4), **packed)
    with pytest.raises(ValueError, match="cu_seq_lens_k ends at 9"):
        bad = {**packed, "cu_seq_lens_k": torch.tensor([0, 9], dtype=torch.int32)}
        pbs_hf.pbs_continuous_batching_forward(layer, query, batch.key, batch.value, None, **bad)
