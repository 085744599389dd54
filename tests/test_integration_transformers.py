"""``attn_implementation="pbs"`` in transformers: exactness, fallbacks, the mask function, ``pbs generate``.

Tiny randomly initialised Llama and Qwen2 models (GQA: 4 query heads, 2 KV heads) with PBS set to
select every block, so PBS must equal SDPA up to fp32 noise wherever it runs.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import pbs  # noqa: E402
import pbs.integrations.transformers as pbs_hf  # noqa: E402
from pbs.cli import main  # noqa: E402
from pbs.integrations.dispatch import FALLBACK_REASONS, PBSIntegrationConfig  # noqa: E402
from tests.helpers import save_tiny_model_and_tokenizer, tiny_model_config  # noqa: E402

# Every block, through the paper's permutation (named: exactness must hold through permuted K/V).
EXACT = {"permuter": "last_block", "selector": {"name": "budget", "density": 1.0}, "block_size": 16, "segment_size": 32,
         "backend": "reference"}
PROMPT_LEN = 100  # not a multiple of the block size
TOL = 1e-4
MODEL_KINDS = ["llama", "qwen2"]


def tiny_model(kind: str, **overrides):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_model_config(kind, **overrides), attn_implementation="sdpa")
    return model.float().eval()


@pytest.fixture(scope="module", params=MODEL_KINDS)
def model(request):
    return tiny_model(request.param)


@pytest.fixture(autouse=True)
def exact_pbs():
    """Every test starts from the exact config (and a fresh once-per-reason log)."""
    pbs_hf.register(EXACT, min_seq_len=32, min_query_len=2)
    yield


def prompt(length: int = PROMPT_LEN, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def forward(model, implementation: str, **inputs):
    pbs_hf.switch_attention(model, implementation)
    # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns, and
    # goes in 5.40); older versions know only the old one.
    if "past_key_values" in inputs and "cache" in inspect.signature(type(model).forward).parameters:
        inputs["cache"] = inputs.pop("past_key_values")
    with torch.no_grad():
        return model(**inputs)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_prefill_runs_pbs_and_matches_sdpa(model):
    ids = prompt()
    expected = forward(model, "sdpa", input_ids=ids).logits
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=ids).logits
    assert [(c.layer_idx, c.q_len, c.kv_len, c.path) for c in calls] == [
        (0, PROMPT_LEN, PROMPT_LEN, "pbs"),
        (1, PROMPT_LEN, PROMPT_LEN, "pbs"),
    ]
    assert all(c.density == 1.0 for c in calls)
    assert max_diff(got, expected) < TOL


def test_generate_matches_sdpa_and_decodes_with_sdpa(model):
    ids = prompt()
    kwargs = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    pbs_hf.switch_attention(model, "sdpa")
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    pbs_hf.switch_attention(model, "pbs")
    with pbs_hf.trace_dispatch() as calls, torch.no_grad():
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    assert {c.path for c in calls if c.q_len == PROMPT_LEN} == {"pbs"}
    decode = [c for c in calls if c.q_len == 1]
    assert decode and all(c.path == "sdpa" and c.reason == "decode" for c in decode)


def test_padded_batch_falls_back_to_sdpa_and_matches(model, caplog):
    ids = prompt(batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding in the second row
    expected = forward(model, "sdpa", input_ids=ids, attention_mask=mask).logits
    with caplog.at_level(logging.INFO, logger="pbs.integrations.transformers"):
        with pbs_hf.trace_dispatch() as calls:
            got = forward(model, "pbs", input_ids=ids, attention_mask=mask).logits
    assert calls and all(c.path == "sdpa" and c.reason == "attention_mask" for c in calls)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one log line per reason, not per layer"
    assert "padding" in warnings[0].getMessage()
    assert max_diff(got[mask.bool()], expected[mask.bool()]) < TOL


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_padded_generate_matches_sdpa(model, cache):
    ids = prompt(batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    kwargs = dict(max_new_tokens=4, do_sample=False, attention_mask=mask, pad_token_id=0, cache_implementation=cache)
    pbs_hf.switch_attention(model, "sdpa")
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    pbs_hf.switch_attention(model, "pbs")
    with pbs_hf.trace_dispatch() as calls, torch.no_grad():
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    assert {c.reason for c in calls} == {"attention_mask", "decode"}


def test_unpadded_batch_runs_pbs(model):
    ids = prompt(batch=2)
    expected = forward(model, "sdpa", input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert {c.path for c in calls} == {"pbs"}
    assert max_diff(got, expected) < TOL


def test_chunk_after_cached_prefix_runs_pbs_and_matches(model):
    ids = prompt()
    prefix, chunk = ids[:, :70], ids[:, 70:]
    expected = forward(model, "sdpa", input_ids=ids).logits[:, 70:]
    past = forward(model, "pbs", input_ids=prefix, use_cache=True).past_key_values
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=chunk, past_key_values=past, use_cache=True).logits
    assert [(c.q_len, c.kv_len, c.path) for c in calls] == [(30, PROMPT_LEN, "pbs")] * 2
    assert max_diff(got, expected) < TOL


def test_decode_after_prefix_uses_sdpa(model):
    ids = prompt()
    expected = forward(model, "sdpa", input_ids=ids).logits[:, -1]
    past = forward(model, "pbs", input_ids=ids[:, :-1], use_cache=True).past_key_values
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=ids[:, -1:], past_key_values=past, use_cache=True).logits[:, -1]
    assert [(c.q_len, c.kv_len, c.reason) for c in calls] == [(1, PROMPT_LEN, "decode")] * 2
    assert max_diff(got, expected) < TOL


def test_short_chunk_after_prefix_falls_back_with_a_bottom_right_mask(model):
    pbs_hf.register(EXACT, min_seq_len=32, min_query_len=8)
    ids = prompt()
    expected = forward(model, "sdpa", input_ids=ids).logits[:, -4:]
    past = forward(model, "pbs", input_ids=ids[:, :-4], use_cache=True).past_key_values
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=ids[:, -4:], past_key_values=past, use_cache=True).logits
    assert {c.reason for c in calls} == {"short_chunk"}
    assert max_diff(got, expected) < TOL


def test_register_twice_is_harmless_and_the_latest_config_wins(model):
    pbs_hf.register({"selector": {"name": "budget", "density": 0.5}, "block_size": 16, "segment_size": 32})
    latest = pbs_hf.register(EXACT, min_seq_len=32, min_query_len=2)
    assert pbs_hf.registered_config() == latest
    assert transformers.AttentionInterface._global_mapping["pbs"] is pbs_hf.pbs_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionMaskInterface._global_mapping["pbs"] is pbs_hf.pbs_mask
    ids = prompt()
    expected = forward(model, "sdpa", input_ids=ids).logits
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=ids).logits
    assert all(c.density == 1.0 for c in calls)
    assert max_diff(got, expected) < TOL


def test_default_backend_runs_inside_the_model():
    # backend "auto": Triton on CUDA; on CPU the conftest routes it through the Triton interpreter
    model = tiny_model("llama")
    pbs_hf.register({**EXACT, "backend": "auto"}, min_seq_len=32)
    ids = prompt(64)
    expected = forward(model, "sdpa", input_ids=ids).logits
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=ids).logits
    assert {c.path for c in calls} == {"pbs"}
    assert max_diff(got, expected) < TOL


def test_default_config_runs_inside_the_model(model):
    # The default components (preset vertical_slash_pooled) at test-sized blocks. A random model's
    # attention is flat: its vertical and slash lines reach 0.75 only with every key and offset,
    # so the defaults keep every block here, and the logits are SDPA's.
    pbs_hf.register({"block_size": 16, "segment_size": 32, "backend": "reference"}, min_seq_len=32)
    assert pbs_hf.registered_config().pbs.selector == pbs.PBSConfig().selector
    ids = prompt(200)
    expected = forward(model, "sdpa", input_ids=ids).logits
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=ids).logits
    assert [c.path for c in calls] == ["pbs"] * 2
    assert all(c.density == 1.0 for c in calls)
    assert max_diff(got, expected) < TOL


def test_paper_selector_runs_and_stays_close_to_sdpa(model):
    # last_block + mean_pool (the paper's method; the previous defaults), at test-sized blocks
    paper = {"permuter": "last_block", "selector": "mean_pool"}
    pbs_hf.register({**paper, "block_size": 16, "segment_size": 32, "backend": "reference"}, min_seq_len=32)
    ids = prompt(200)  # long enough for the threshold to drop blocks of a random model's flat attention
    expected = forward(model, "sdpa", input_ids=ids).logits
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=ids).logits
    assert {c.path for c in calls} == {"pbs"}
    assert all(0.5 < c.density < 1 for c in calls)
    assert 1e-5 < pbs.testing.relative_error(got, expected) < 0.1


def test_from_pretrained_with_attn_implementation_pbs(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="pbs")
    assert loaded.config._attn_implementation == "pbs"
    with pbs_hf.trace_dispatch() as calls, torch.no_grad():
        loaded(input_ids=prompt())
    assert {c.path for c in calls} == {"pbs"}


def test_skipped_layers_short_sequences_and_overrides(model):
    pbs_hf.register(EXACT, min_seq_len=32, skip_first_layers=1)
    with pbs_hf.trace_dispatch() as calls:
        forward(model, "pbs", input_ids=prompt())
    assert [(c.path, c.reason) for c in calls] == [("sdpa", "skipped_layer"), ("pbs", None)]

    pbs_hf.register(EXACT, min_seq_len=32, skip_first_layers=1, layer_overrides={0: EXACT, 1: None})
    with pbs_hf.trace_dispatch() as calls:
        forward(model, "pbs", input_ids=prompt())
    assert [(c.path, c.reason) for c in calls] == [("pbs", None), ("sdpa", "skipped_layer")]

    pbs_hf.register(EXACT, min_seq_len=200)
    with pbs_hf.trace_dispatch() as calls:
        forward(model, "pbs", input_ids=prompt())
    assert {c.reason for c in calls} == {"short_sequence"}


def test_sliding_window_layers_fall_back_and_match_sdpa():
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=40, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    ids = prompt()
    expected = forward(model, "sdpa", input_ids=ids).logits
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=ids).logits
    assert [(c.path, c.reason) for c in calls] == [("pbs", None), ("sdpa", "sliding_window")]
    assert max_diff(got, expected) < TOL


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_idx, self.is_causal, self.num_key_value_groups = 0, True, 2


def test_softcap_falls_back_to_eager_with_the_cap():
    q, k, v = (torch.randn(1, h, 40, 16, generator=torch.Generator().manual_seed(h)) for h in (4, 2, 2))
    with pbs_hf.trace_dispatch() as calls:
        out, weights = pbs_hf.pbs_attention_forward(_Layer(), q, k, v, None, scaling=0.25, softcap=2.0)
    assert calls[0].reason == "softcap" and weights is None
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.tanh(q @ kk.transpose(2, 3) * 0.25 / 2.0) * 2.0
    scores = scores.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    expected = (scores.softmax(-1) @ vv).transpose(1, 2)
    assert out.shape == (1, 40, 4, 16) and max_diff(out, expected) < 1e-5


def test_dropout_non_causal_and_gradient_calls_fall_back():
    q, k, v = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    with pbs_hf.trace_dispatch() as calls:
        pbs_hf.pbs_attention_forward(_Layer().eval(), q, k, v, None, dropout=0.1)
        pbs_hf.pbs_attention_forward(_Layer(), q, k, v, None, is_causal=False)
        out, _ = pbs_hf.pbs_attention_forward(_Layer(), q.requires_grad_(), k, v, None)
    assert [c.reason for c in calls] == ["dropout", "not_causal", "needs_grad"]
    out.sum().backward()  # the kernels are forward-only, so a call that needs gradients runs SDPA
    assert q.grad is not None


def mask_call(q_length: int, q_offset: int, kv_length: int, attention_mask: torch.Tensor):
    """Calls pbs_mask as this transformers version's create_causal_mask does."""
    import inspect

    from transformers import masking_utils

    if "q_length" in inspect.signature(masking_utils.sdpa_mask).parameters:  # transformers 5
        sizes = dict(q_length=q_length, q_offset=q_offset)
    else:
        sizes = dict(cache_position=torch.arange(q_offset, q_offset + q_length))
    return pbs_hf.pbs_mask(
        batch_size=attention_mask.shape[0],
        kv_length=kv_length,
        kv_offset=0,
        mask_function=masking_utils.causal_mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=True,
        device="cpu",
        **sizes,
    )


def test_mask_function_is_none_only_for_unpadded_causal_calls_with_queries_at_the_end():
    full = torch.ones(2, 100, dtype=torch.bool)
    assert mask_call(100, 0, 100, full) is None
    # a chunk after a cached prefix: SDPA would materialise a mask, PBS needs none
    assert mask_call(30, 70, 100, full) is None
    padded = full.clone()
    padded[1, :5] = False
    mask = mask_call(100, 0, 100, padded)
    assert mask.shape == (2, 1, 100, 100) and mask.dtype == torch.bool and not mask[1, 0, :, :5].any()
    # a static cache's first prefill: queries at the start of longer keys, so never None
    static = mask_call(30, 0, 100, full[:, :30])
    assert static is not None and static.shape == (2, 1, 30, 100) and not static[:, :, :, 30:].any()


def test_config_coercion_and_errors():
    assert pbs_hf.register(pbs.PBSConfig(**EXACT)).pbs == pbs.PBSConfig(**EXACT)
    assert pbs_hf.register(json.dumps(EXACT), skip_first_layers=3).skip_first_layers == 3
    assert pbs_hf.register({"pbs": EXACT, "min_seq_len": 64}).min_seq_len == 64
    assert pbs_hf.register("pbs_paper", min_seq_len=64).pbs == pbs.PBSConfig.from_preset(
        "pbs_paper", dense_fallback={"min_seq_len": 64})
    with pytest.raises(ValueError, match="neither a preset name"):
        pbs_hf.register("pbs-paper")
    with pytest.raises(ValueError, match="mixes PBSIntegrationConfig fields"):
        pbs_hf.register({"block_size": 16, "min_seq_len": 64})
    with pytest.raises(TypeError, match="unknown keyword arguments"):
        pbs_hf.register(EXACT, skip_layers=2)
    with pytest.raises(ValueError, match="causal must be True"):
        PBSIntegrationConfig(pbs={"causal": False})
    with pytest.raises(ValueError, match="layer indices >= 0"):
        PBSIntegrationConfig(layer_overrides={-1: None})
    with pytest.raises(TypeError, match="config must be"):
        pbs_hf.register(3)
    round_trip = PBSIntegrationConfig(pbs=EXACT, layer_overrides={2: None, 3: EXACT})
    assert PBSIntegrationConfig.model_validate_json(round_trip.model_dump_json()) == round_trip
    assert set(FALLBACK_REASONS) >= {"decode", "attention_mask", "sliding_window", "softcap", "short_sequence"}


def test_by_depth_gives_the_first_sixth_the_defaults_and_the_rest_the_deep_preset():
    deep = pbs.PBSConfig.from_preset("vertical_slash_pooled_deep")
    assert deep.selector.selectors[0].threshold == 0.6 and deep.selector.selectors[1] == pbs.PBSConfig().selector.selectors[1]
    smollm2 = PBSIntegrationConfig.by_depth(30)  # the model the rule was read off: layers 0-4 keep 0.75
    assert [smollm2.config_for_layer(i) == pbs.PBSConfig() for i in (0, 4, 5, 29)] == [True, True, False, False]
    assert smollm2.config_for_layer(5) == deep and smollm2.config_for_layer(None) == deep
    assert sorted(PBSIntegrationConfig.by_depth(18).layer_overrides) == [0, 1, 2]  # ceil(18 / 6)
    assert sorted(PBSIntegrationConfig.by_depth(32).layer_overrides) == [0, 1, 2, 3, 4, 5]  # ceil(32 / 6)
    assert PBSIntegrationConfig.by_depth(4, leading_share=0).layer_overrides == {}
    skipping = PBSIntegrationConfig.by_depth(30, skip_first_layers=2)  # skipped layers stay dense
    assert [skipping.config_for_layer(i) for i in (0, 1)] == [None, None] and skipping.config_for_layer(2) == pbs.PBSConfig()
    # The other fields pass through: the one length knob reaches the leading layers too, and an
    # explicit override wins over a leading layer's entry.
    custom = PBSIntegrationConfig.by_depth(12, deep=EXACT, leading="pbs_paper", min_seq_len=64, layer_overrides={1: None})
    assert custom.config_for_layer(0).dense_fallback.min_seq_len == 64 and custom.config_for_layer(0).gqa == "per_head"
    assert custom.config_for_layer(1) is None and custom.config_for_layer(2) == pbs.PBSConfig(
        **EXACT, dense_fallback={"min_seq_len": 64})
    assert PBSIntegrationConfig.model_validate_json(custom.model_dump_json()) == custom
    for bad, match in (({"num_layers": 0}, "num_layers must be an int >= 1"),
                       ({"num_layers": 6.0}, "num_layers must be an int >= 1"),
                       ({"num_layers": 6, "leading_share": 1.5}, r"leading_share must be a number in \[0, 1\]"),
                       ({"num_layers": 6, "pbs": EXACT}, "deep= and leading=, not pbs=")):
        with pytest.raises(ValueError, match=match):
            PBSIntegrationConfig.by_depth(**bad)


def test_import_pbs_does_not_import_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"  # makes any import of it fail
        "import pbs, pbs.cli, pbs.integrations.transformers, pbs.integrations.dispatch\n"
        "pbs.cli.build_parser()\n"
        "try:\n    pbs.integrations.transformers.register()\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'pbs-attn[hf]'" in out


def test_pbs_generate_cli(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    save_tiny_model_and_tokenizer(model_dir)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(" ".join(f"w{(7 * i) % 124}" for i in range(90)))
    result = tmp_path / "result.json"
    args = ["generate", str(model_dir), "--prompt-file", str(prompt_file), "--max-new-tokens", "4"]
    args += ["--config", json.dumps(EXACT), "--min-seq-len", "32", "--device", "cpu", "--warmup", "0"]
    assert main(args + ["--repeats", "3", "--json", str(result)]) == 0
    out = capsys.readouterr().out
    assert "90 prompt tokens" in out and "TTFT (s)" in out and "--- answer (pbs) ---" in out
    assert "PBS ran on 2 of 2 layers" in out and "answers: identical" in out
    pbs_line = next(line for line in out.splitlines() if line.startswith("pbs  "))
    assert pbs_line.endswith("x)") and "x (" in pbs_line  # the speed-up with its spread
    payload = json.loads(result.read_text())
    assert payload["results"]["pbs"]["mean_density"] == 1.0 and payload["results"]["sdpa"]["ttft_s"] > 0
    for row in payload["results"].values():
        assert len(row["ttft_runs_s"]) == 3 and row["ttft_min_s"] <= row["ttft_s"] <= row["ttft_max_s"]
    assert payload["results"]["pbs"]["fallbacks"] == {}


def test_pbs_generate_shows_no_speedup_when_pbs_did_not_run(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    save_tiny_model_and_tokenizer(model_dir)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(" ".join(f"w{(7 * i) % 124}" for i in range(90)))
    result = tmp_path / "result.json"
    args = ["generate", str(model_dir), "--prompt-file", str(prompt_file), "--max-new-tokens", "2", "--quiet"]
    args += ["--config", json.dumps(EXACT), "--min-seq-len", "1000", "--device", "cpu", "--warmup", "0"]
    assert main(args + ["--repeats", "2", "--json", str(result)]) == 0
    out = capsys.readouterr().out
    pbs_line = next(line for line in out.splitlines() if line.startswith("pbs  "))
    assert "none: PBS did not run" in pbs_line and "x" not in pbs_line.split()[-1]
    assert "PBS did not run: all 2 layers of the prefill fell back to dense SDPA" in out
    assert "short_sequence on 2 layer(s)" in out and "90 < min_seq_len=1000" in out
    fallbacks = json.loads(result.read_text())["results"]["pbs"]["fallbacks"]
    assert fallbacks["short_sequence"]["layers"] == [0, 1]
    assert fallbacks["short_sequence"]["details"] == ["90 < min_seq_len=1000"]


def test_pbs_generate_verbose_lists_every_layer(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    save_tiny_model_and_tokenizer(model_dir)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(" ".join(f"w{(7 * i) % 124}" for i in range(90)))
    args = ["generate", str(model_dir), "--prompt-file", str(prompt_file), "--max-new-tokens", "2", "--quiet"]
    args += ["--config", json.dumps(EXACT), "--min-seq-len", "32", "--skip-first-layers", "1", "--device", "cpu"]
    assert main(args + ["--warmup", "0", "--repeats", "1", "--pbs-only", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "PBS ran on 1 of 2 layers of the prefill, mean density 1.000; dense on the others:" in out
    assert "skipped_layer on 1 layer(s)" in out and "(layer 0)" in out
    assert "  layer 0: sdpa (skipped_layer)" in out and "  layer 1: pbs, density 1.000" in out


def test_prefill_progress_reports_layers_of_long_forwards():
    import io

    from pbs.integrations.ttft import PrefillProgress, measure_ttft

    model = tiny_model("llama")
    stream = io.StringIO()
    progress = PrefillProgress(model, stream=stream, after_s=0.0, every_s=0.0)
    pbs_hf.switch_attention(model, "sdpa")
    ttft = measure_ttft(model, prompt(), warmup=1, repeats=2, progress=progress, label="sdpa prefill")
    assert len(ttft.times) == 2 and ttft.min <= ttft.median <= ttft.max
    lines = stream.getvalue().splitlines()
    labels = [line.split(": ")[1] for line in lines]
    assert labels == ["sdpa prefill warm-up 1/1"] * 2 + ["sdpa prefill timed 1/2"] * 2 + ["sdpa prefill timed 2/2"] * 2
    assert all(line.split(": ")[2].startswith(f"layer {i % 2 + 1}/2, ") for i, line in enumerate(lines))
    assert not model._forward_hooks and all(not layer._forward_hooks for layer in model.model.layers)
    quiet = io.StringIO()
    measure_ttft(model, prompt(), warmup=0, repeats=1, progress=PrefillProgress(model, stream=quiet))
    assert quiet.getvalue() == ""  # short prefills stay silent


def test_pbs_generate_cli_rejects_bad_input(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "--prompt-file", str(tmp_path / "p.txt")]) == 2
    assert "local model directory" in capsys.readouterr().err
    (tmp_path / "p.txt").write_text("w1")
    assert main(["generate", str(tmp_path), "--prompt-file", str(tmp_path / "p.txt"), "--config", "{bad"]) == 2
    assert "invalid --config" in capsys.readouterr().err


def test_one_length_knob_decides(model):
    # The integration's min_seq_len is dense_fallback.min_seq_len of the configs it builds: before,
    # dense_fallback's own default (16384) overrode min_seq_len=32 inside pbs.attention, silently.
    on_cpu = {**EXACT, "backend": "auto", "dense_fallback": {"devices": ["cpu"], "max_density": None}}
    config = pbs_hf.register(on_cpu, min_seq_len=32, min_query_len=2, layer_overrides={1: EXACT})
    assert config.pbs.dense_fallback.min_seq_len == 32 and config.layer_overrides[1].dense_fallback.min_seq_len == 32
    with pbs_hf.trace_dispatch() as calls:
        forward(model, "pbs", input_ids=prompt())
    assert [(c.path, c.reason) for c in calls] == [("pbs", None)] * 2

    # Without the keyword the config's own value decides, in the integration too, on every device
    # and backend (EXACT runs the reference backend, which pbs.attention never falls back from).
    pbs_hf.register({**EXACT, "dense_fallback": {"min_seq_len": 10_000}}, min_query_len=2)
    ids = prompt()
    expected = forward(model, "sdpa", input_ids=ids).logits
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=ids).logits
    assert [(c.path, c.reason, c.detail) for c in calls] == [("sdpa", "short_sequence", "100 < min_seq_len=10000")] * 2
    assert max_diff(got, expected) < TOL

    # Both given: the same value is fine, another is an error that names both.
    assert pbs_hf.register({**EXACT, "dense_fallback": {"min_seq_len": 64}}, min_seq_len=64).pbs.dense_fallback.min_seq_len == 64
    with pytest.raises(ValueError, match=r"min_seq_len=32 disagrees with pbs.dense_fallback.min_seq_len=64"):
        pbs_hf.register({**EXACT, "dense_fallback": {"min_seq_len": 64}}, min_seq_len=32)
    with pytest.raises(ValueError, match=r"disagrees with layer_overrides\[3\].dense_fallback.min_seq_len=0"):
        PBSIntegrationConfig(min_seq_len=32, layer_overrides={3: {"dense_fallback": {"min_seq_len": 0}}})
    # A keyword replaces the value an earlier min_seq_len wrote (it was not the config's own).
    again = pbs_hf.register(PBSIntegrationConfig(pbs=EXACT, min_seq_len=64), min_seq_len=128)
    assert again.pbs.dense_fallback.min_seq_len == 128
    assert PBSIntegrationConfig.model_validate_json(again.model_dump_json()) == again


def test_trace_records_the_dense_fallback_of_pbs_attention(model):
    # PBSConfig.dense_fallback (here applied on CPU) makes pbs.attention run SDPA itself, here by
    # the density probe before planning: the trace says so instead of failing on a missing plan,
    # and the logits are SDPA's.
    # (the probe covers a selector's threshold: budget selectors, such as EXACT's, are not probed)
    policy = {"min_seq_len": 0, "max_density": 0.5, "devices": ["cpu"], "probe_blocks": 16, "planning_cost_pairs": 0}
    probed = {**EXACT, "selector": {"name": "mean_pool", "threshold": 0.99}}
    pbs_hf.register({**probed, "backend": "auto", "dense_fallback": policy}, min_query_len=2)
    ids = prompt()
    expected = forward(model, "sdpa", input_ids=ids).logits
    with pbs_hf.trace_dispatch() as calls:
        got = forward(model, "pbs", input_ids=ids).logits
    assert [(c.path, c.reason) for c in calls] == [("sdpa", "dense_fallback")] * 2
    assert "density probe" in calls[0].detail
    assert max_diff(got, expected) < TOL


@pytest.mark.parametrize("probe_blocks", [0, 16])
def test_dense_fallback_is_logged_at_warning_without_a_trace(model, caplog, probe_blocks):
    # by density this time: every block selected (density 1) is above max_planned_density (0.95); with the
    # probe on, the probe (about 0.9 on a random model) says so before planning (it covers a
    # selector's threshold, so that case selects by one: budget selectors are not probed)
    policy = {"min_seq_len": 0, "max_density": 0.5, "devices": ["cpu"], "probe_blocks": probe_blocks,
              "planning_cost_pairs": 0}
    selector = {"name": "mean_pool", "threshold": 0.99} if probe_blocks else EXACT["selector"]
    pbs_hf.register({**EXACT, "selector": selector, "backend": "auto", "dense_fallback": policy}, min_query_len=2)
    with caplog.at_level(logging.INFO, logger="pbs.integrations.transformers"):
        forward(model, "pbs", input_ids=prompt())  # no trace_dispatch: the log alone must tell
    (record,) = [r for r in caplog.records if r.name == "pbs.integrations.transformers"]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "dense_fallback" in message
    if probe_blocks:
        # The probe's own number is recorded (before, a generic sentence stood in for it on CPU).
        assert re.search(r"the density probe estimates [01]\.\d{3}, above dense_fallback.max_density = 0.5", message)
    else:
        assert "density 1.000 is above dense_fallback.max_planned_density = 0.95" in message


def test_fallbacks_are_warned_once_per_reason_and_per_model(caplog):
    pbs_hf.register(EXACT, min_seq_len=200, min_query_len=2)
    first, second = tiny_model("llama"), tiny_model("qwen2")
    with caplog.at_level(logging.INFO, logger="pbs.integrations.transformers"):
        for _ in range(2):
            forward(first, "pbs", input_ids=prompt())
        forward(second, "pbs", input_ids=prompt())
        forward(first, "pbs", input_ids=prompt(batch=2), attention_mask=torch.ones(2, PROMPT_LEN).long())
    records = [r for r in caplog.records if r.name == "pbs.integrations.transformers"]
    assert all(r.levelno == logging.WARNING for r in records)
    messages = [r.getMessage() for r in records]
    assert len(messages) == 2, messages  # short_sequence once for each model, not once per layer or call
    assert all("shorter than min_seq_len (100 < min_seq_len=200)" in m for m in messages)
    assert "llama" in messages[0] and "qwen2" in messages[1]
    caplog.clear()
    pbs_hf.register(EXACT, min_seq_len=200, min_query_len=2)  # re-arms
    with caplog.at_level(logging.INFO, logger="pbs.integrations.transformers"):
        forward(first, "pbs", input_ids=prompt())
    assert len([r for r in caplog.records if r.name == "pbs.integrations.transformers"]) == 1


def test_the_fallback_detail_is_built_only_where_it_is_read(monkeypatch, caplog):
    # A short prompt falls back in every layer of every call; the detail text is built for the
    # first log of its reason (and for traces), not for every layer.
    pbs_hf.register(EXACT, min_seq_len=200, min_query_len=2)
    built = []
    real = pbs_hf._fallback_detail
    monkeypatch.setattr(pbs_hf, "_fallback_detail", lambda *a: built.append(a[0]) or real(*a))
    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="pbs.integrations.transformers"):
        for _ in range(3):
            forward(model, "pbs", input_ids=prompt())
    assert built == ["short_sequence"]
    assert any("100 < min_seq_len=200" in r.getMessage() for r in caplog.records)
    with pbs_hf.trace_dispatch() as calls:
        forward(model, "pbs", input_ids=prompt())
    assert calls and all(c.detail == "100 < min_seq_len=200" for c in calls)


def test_no_process_group_means_no_shard_and_no_walk_over_parameters():
    # Without torch.distributed initialized no DTensor can be sharded: the layer's parameters
    # (walked in every call otherwise) are not read.
    from pbs.integrations.tensor_parallel import head_shard_of

    import torch.distributed.tensor  # noqa: F401 - makes DTensor importable, as transformers does

    class Untouchable(torch.nn.Module):
        def parameters(self, recurse=True):
            raise AssertionError("parameters were walked")

    assert not torch.distributed.is_initialized()
    assert head_shard_of(Untouchable(), 4) is None


def test_decode_and_configured_dense_layers_are_info(model, caplog):
    pbs_hf.register(EXACT, min_seq_len=32, skip_first_layers=1)
    ids = prompt()
    with caplog.at_level(logging.INFO, logger="pbs.integrations.transformers"):
        pbs_hf.switch_attention(model, "pbs")
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    levels = {r.getMessage().split("reason ")[1].split(",")[0]: r.levelno for r in caplog.records
              if r.name == "pbs.integrations.transformers"}
    assert levels == {"'skipped_layer'": logging.INFO, "'decode'": logging.INFO}
