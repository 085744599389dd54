"""Time to first token under load through ``pbs serve``: SDPA against PBS, concurrent long prompts.

A Llama-3.1-8B-shaped model (32 layers, hidden 4096, 32 query heads, 8 KV heads, head dim 128, MLP
14336, vocab 128256) with **random bf16 weights** is saved to a folder with a word-level tokenizer
(one token per word ``w0`` ... ``w128255``, so a prompt of N words is N tokens). For each row, ``pbs
serve`` is started on that folder as a subprocess, warmed up with one request of the longest
length (which also compiles PBS's Triton kernels), and then sent ``--requests`` streaming
``/v1/completions`` requests at once, with lengths cycling through ``--lengths``. Random weights
measure speed, not accuracy: the default selector keeps nearly every block of a random model's
flat attention, so ``pbs_default`` runs close to dense, and the forced-density ``budget`` row is
the speed to read.

Rows (every one with the same continuous-batching settings: ``--max-batch-tokens`` new tokens a
step, a KV cache sized for all requests at once, CUDA graphs off):
    sdpa            ``pbs serve --attention sdpa``: transformers' SDPA in continuous batching
    pbs_budget_0.2  PBS at a forced density of 0.2 (``last_block`` permutation, ``budget`` selector);
                    dense below 32768 keys, so a chunk of a long prompt runs PBS once the keys
                    before it and its own reach 32768
    pbs_default     ``pbs serve`` with the PBS defaults (dense below 32768 keys as well)

A request's TTFT is the time from sending it to its first streamed token; the scheduler prefills
the requests in chunks of ``--max-batch-tokens`` tokens, mostly one after another, so the later
requests wait for the earlier ones. Each row records every request's TTFT, their p50 and p95
(linear interpolation), and throughput: prompt tokens per second up to the last first token, and
generated tokens per second up to the last answer.

    python benchmarks/bench_serve_ttft.py           # about 5-8 minutes on one H100 (estimated)
    python benchmarks/bench_serve_ttft.py --smoke   # the same steps on the CPU, tiny model, seconds

Writes ``benchmarks/results/serving/serve_ttft_<device>.json`` (``--smoke``: a file in the
temporary directory unless ``--out`` is given) and prints a table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_serve_ttft.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import LLAMA_8B_SIZES, RESULTS, ROOT, environment, save  # noqa: E402

MODEL_SHAPE = LLAMA_8B_SIZES
SMOKE_SHAPE = dict(
    num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    vocab_size=512,
)
# The pbs serve flags of each row (besides the model, the device and the batching settings), in the
# order they run: the defaults last, as a random model's attention is nearly flat and they run near dense.
ROWS: dict[str, list[str]] = {
    "sdpa": ["--attention", "sdpa"],
    "pbs_budget_0.2": ["--config", json.dumps({"permuter": "last_block", "selector": {"name": "budget", "density": 0.2}})],
    "pbs_default": [],
}
START_TIMEOUT_S = 600


# --------------------------------------------------------------------------------------------
# The model folder


def save_model(directory: Path, shape: dict[str, int], device: str) -> None:
    """A Llama of ``shape`` with random weights, saved with a word-level tokenizer of its vocabulary.

    Reuses ``directory`` when it holds a model of this shape already (the file ``saved``, written last,
    names the shape).
    """
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    marker, saved = directory / "saved", " ".join(f"{key}={value}" for key, value in sorted(shape.items()))
    if marker.is_file() and marker.read_text() == saved:
        return
    directory.mkdir(parents=True, exist_ok=True)
    words = {f"w{i}": i for i in range(shape["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(directory)
    # No end-of-sequence token: every answer runs to max_tokens.
    config = transformers.LlamaConfig(**shape, max_position_embeddings=131072, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(directory)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    marker.write_text(saved)


def prompt_text(n_tokens: int, vocab: int, seed: int) -> str:
    """``n_tokens`` words of the word-level vocabulary, a different sequence per ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return " ".join(f"w{i}" for i in torch.randint(0, vocab, (n_tokens,), generator=generator).tolist())


# --------------------------------------------------------------------------------------------
# The server and its clients


class Server:
    """``python -m pbs serve ... --port 0`` in a subprocess, its output kept in ``log``."""

    def __init__(self, argv: list[str], log: Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1"}
        self.log = log
        self._file = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "pbs", "serve", *argv, "--port", "0"], cwd=ROOT,
                                     env=env, stdout=self._file, stderr=subprocess.STDOUT, text=True)
        self.host, self.port = self._wait_listening()

    def _wait_listening(self) -> tuple[str, int]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = re.search(r"listening on http://(\S+):(\d+)/v1", self.log.read_text())
            if found:
                return found.group(1).strip("[]"), int(found.group(2))
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"pbs serve did not start; its output:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: the server's own Ctrl-C path
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._file.close()


@dataclass
class Answer:
    """One streamed completion, timed by the client (``time.perf_counter`` seconds)."""

    prompt_tokens: int
    sent: float
    first_token: float | None = None
    done: float | None = None
    completion_tokens: int = 0
    error: str | None = None


def stream_completion(host: str, port: int, prompt: str, n_tokens: int, max_tokens: int, answer: Answer,
                      start: threading.Barrier) -> None:
    """Sends one streaming ``/v1/completions`` request (after ``start``) and fills ``answer``."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    connection = http.client.HTTPConnection(host, port, timeout=START_TIMEOUT_S)
    try:
        start.wait()
        answer.sent = time.perf_counter()
        connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            answer.error = f"HTTP {response.status}: {response.read()[:500]!r}"
            return
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data:"))
            if "error" in chunk:
                answer.error = str(chunk["error"])
                return
            if answer.first_token is None and any(choice.get("text") for choice in chunk.get("choices", [])):
                answer.first_token = time.perf_counter()
            if chunk.get("usage"):
                answer.completion_tokens = chunk["usage"]["completion_tokens"]
                if chunk["usage"]["prompt_tokens"] != n_tokens:
                    answer.error = f"the server counted {chunk['usage']['prompt_tokens']} prompt tokens, not {n_tokens}"
        answer.done = time.perf_counter()
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()


def run_load(host: str, port: int, lengths: list[int], vocab: int, max_tokens: int, seed: int) -> list[Answer]:
    """``len(lengths)`` streaming requests sent at once; their `Answer` s in the order of ``lengths``."""
    prompts = [prompt_text(n, vocab, seed + i) for i, n in enumerate(lengths)]
    answers = [Answer(prompt_tokens=n, sent=0.0) for n in lengths]
    start = threading.Barrier(len(lengths))
    threads = [threading.Thread(target=stream_completion, args=(host, port, p, n, max_tokens, a, start))
               for p, n, a in zip(prompts, lengths, answers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


# --------------------------------------------------------------------------------------------
# Statistics


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(answers: list[Answer]) -> dict[str, Any]:
    """p50/p95/mean TTFT (ms) and throughput of one load; ``error`` where a request failed."""
    failed = [a.error or "no token streamed" for a in answers if a.error or a.first_token is None or a.done is None]
    if failed:
        return {"error": failed[0], "failed_requests": len(failed)}
    start = min(a.sent for a in answers)
    ttft_ms = [(a.first_token - a.sent) * 1e3 for a in answers]  # type: ignore[operator]
    last_first, last_done = max(a.first_token for a in answers), max(a.done for a in answers)  # type: ignore[type-var]
    prompt_tokens, completion_tokens = sum(a.prompt_tokens for a in answers), sum(a.completion_tokens for a in answers)
    return {
        "ttft_p50_ms": percentile(ttft_ms, 50),
        "ttft_p95_ms": percentile(ttft_ms, 95),
        "ttft_mean_ms": sum(ttft_ms) / len(ttft_ms),
        "ttft_ms": ttft_ms,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "prefill_tokens_per_s": prompt_tokens / (last_first - start),
        "output_tokens_per_s": completion_tokens / (last_done - start),
        "wall_s": last_done - start,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'attention':<16} {'TTFT p50 ms':>12} {'p95 ms':>10} {'vs sdpa p50':>12} {'prefill tok/s':>14} "
             f"{'out tok/s':>10}  note"]
    base = next((r.get("ttft_p50_ms") for r in rows if r["attention"] == "sdpa"), None)
    for r in rows:
        if "ttft_p50_ms" not in r:
            lines.append(f"{r['attention']:<16} {'-':>12} {'-':>10} {'':>12} {'':>14} {'':>10}  {r.get('error', '')}")
            continue
        speedup = f"{base / r['ttft_p50_ms']:.2f}x" if base else ""
        lines.append(f"{r['attention']:<16} {r['ttft_p50_ms']:>12.1f} {r['ttft_p95_ms']:>10.1f} {speedup:>12} "
                     f"{r['prefill_tokens_per_s']:>14.0f} {r['output_tokens_per_s']:>10.1f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------


def device_slug(device: str) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="a 2-layer model on the CPU with short prompts: the same steps in seconds, for tests")
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt tokens, cycled over the requests "
                        "(default 16384 32768 49152 65536; --smoke: 48 80 112 144)")
    parser.add_argument("--requests", type=int, help="concurrent requests (default 8; --smoke: 4)")
    parser.add_argument("--max-tokens", type=int, help="tokens generated per request (default 16; --smoke: 4)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--max-batch-tokens", type=int, help="new tokens per step (default 8192; --smoke: 64)")
    parser.add_argument("--min-seq-len", type=int,
                        help="the PBS rows' --min-seq-len (default: the config's, 32768; --smoke: 1)")
    parser.add_argument("--model-dir", type=Path,
                        help="where the model is saved, or reused if it is there (default: a folder in the "
                             "temporary directory)")
    parser.add_argument("--budget-s", type=float, default=480, help="skip the rows left after this many seconds")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/serving/serve_ttft_<device>.json)")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --smoke, on the CPU)")
    shape = SMOKE_SHAPE if args.smoke else MODEL_SHAPE
    lengths_cycle = args.lengths or ([48, 80, 112, 144] if args.smoke else [16384, 32768, 49152, 65536])
    n_requests = args.requests or (4 if args.smoke else 8)
    lengths = [lengths_cycle[i % len(lengths_cycle)] for i in range(n_requests)]
    max_tokens = args.max_tokens or (4 if args.smoke else 16)
    max_batch_tokens = args.max_batch_tokens or (64 if args.smoke else 8192)
    min_seq_len = args.min_seq_len if args.min_seq_len is not None else (1 if args.smoke else None)
    page = 32 if args.smoke else 256
    # Room for every request at once (and the warm-up's, freed before the load starts).
    num_blocks = sum(-(-(n + max_tokens) // page) for n in lengths) + 8
    batching = ["--max-batch-tokens", str(max_batch_tokens), "--page-size", str(page), "--num-blocks", str(num_blocks)]
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"pbs-bench-serve-{'smoke' if args.smoke else 'llama8b'}"

    import transformers

    began = time.perf_counter()
    save_model(model_dir, shape, device)
    print(f"model saved to {model_dir} after {time.perf_counter() - began:.0f} s; requests of {lengths} tokens, "
          f"{max_tokens} generated each", flush=True)
    rows: list[dict[str, Any]] = []
    logs = Path(tempfile.mkdtemp(prefix="pbs-bench-serve-logs-"))
    for row in args.rows:
        result: dict[str, Any] = {"attention": row, "flags": ROWS[row]}
        rows.append(result)
        if time.perf_counter() - began > args.budget_s:
            result["error"] = "skipped: time budget spent"
            continue
        flags = [*ROWS[row], *(["--min-seq-len", str(min_seq_len)] if min_seq_len and row != "sdpa" else [])]
        result["flags"] = flags
        started = time.perf_counter()
        try:
            server = Server([str(model_dir), "--device", device, *batching, *flags], logs / f"{row}.log")
        except RuntimeError as exc:
            result["error"] = str(exc).splitlines()[0]
            result["server_log_tail"] = str(exc).splitlines()[-20:]
            print(exc, flush=True)
            continue
        try:
            result["server_start_s"] = time.perf_counter() - started
            warm = run_load(server.host, server.port, [max(lengths)], shape["vocab_size"], 2, seed=1000)
            result["warmup_ms"] = summarize(warm).get("ttft_p50_ms")
            result.update(summarize(run_load(server.host, server.port, lengths, shape["vocab_size"], max_tokens, 0)))
        finally:
            server.stop()
        # Why PBS ran dense where it did: the integration logs each reason once ("pbs: dense attention ...").
        result["server_notes"] = [line for line in server.log.read_text().splitlines() if line.startswith("pbs: ")]
        print(format_table([result]).splitlines()[1], flush=True)

    payload = {
        "benchmark": "bench_serve_ttft",
        "note": "random weights: measures speed, not accuracy" + (" (smoke run: tiny model on the CPU)" if args.smoke else ""),
        **environment(device),
        "transformers": transformers.__version__,
        "model": {**shape, "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
                  "dtype": "bfloat16" if device == "cuda" else "float32", "weights": "random"},
        "requests": lengths,
        "max_tokens": max_tokens,
        "batching": {"max_batch_tokens": max_batch_tokens, "page_size": page, "num_blocks": num_blocks,
                     "cuda_graphs": False},
        "total_seconds": time.perf_counter() - began,
        "rows": rows,
    }
    out = args.out or (Path(tempfile.gettempdir()) / "serve_ttft_smoke.json" if args.smoke
                       else RESULTS / "serving" / f"serve_ttft_{device_slug(device)}.json")
    save(payload, out)
    print(f"\nTTFT under load through pbs serve, {payload['device']}, {n_requests} concurrent requests\n"
          f"{format_table(rows)}\nwrote {out}")
    return 0 if all("ttft_p50_ms" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
