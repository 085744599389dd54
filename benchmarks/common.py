"""What the benchmark scripts share: CUDA timing, the cuDNN dense baseline, saving results, and the
Llama-3.1-8B-shaped model with random weights of the multi-GPU benchmarks.

Every result file goes through :func:`save`, which records where the numbers came from: the
command line, the git revision (and whether the working tree had uncommitted changes) and the
time, beside what :func:`environment` says about the machine and the packages.

The scripts run as files, ``python3 benchmarks/<script>.py ...``; each puts the repository root on
``sys.path`` and imports this module as ``benchmarks.common``. They import nothing from one
another, and only public names from ``pbs`` (tests/test_layout_rules.py holds them to it).
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pbs.analysis import result_files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REPEATS = 3  # medians of time_ms
BUSY_GPU_CYCLES = 2_000_000  # queued before a device_ms run: about a millisecond on an H100/H200
GIB = 2**30


def package_version(module: str) -> str | None:
    """``module.__version__``, or None when it is not installed."""
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """The machine and the package versions: ``device`` (the GPU's name, or ``cpu (<processor>)``),
    ``torch``, ``triton``, ``cuda``, ``cudnn``, ``pbs`` and ``python``."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if on_cuda else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if on_cuda else None,
        "pbs": package_version("pbs"),
        "python": platform.python_version(),
    }


def git_revision() -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the checkout the benchmark runs from
    (`pbs.analysis.result_files.git_revision`: ``PBS_GIT_REVISION`` wins when set)."""
    return result_files.git_revision(ROOT)


def provenance() -> dict[str, Any]:
    """``command`` (the command line that ran), ``git_revision``, ``git_dirty`` and ``date`` (UTC)."""
    revision, dirty = git_revision()
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py":  # python -m <package>
        argv[:1] = ["-m", Path(argv[0]).parent.name]
    return {
        "command": shlex.join([Path(sys.executable).name, *argv]),
        "git_revision": revision,
        "git_dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def save(result: dict, path: str | os.PathLike) -> None:
    """Writes ``result`` as JSON with :func:`provenance` added (NaN written as null)."""
    record = {**provenance(), **result}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_without_nan(record), indent=1) + "\n")


def _without_nan(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _without_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_without_nan(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def time_ms(fn: Callable[[], object], budget_ms: float = 1000.0, repeats: int | None = None) -> float:
    """Median of ``repeats`` (default ``REPEATS``) medians of CUDA-event times of ``fn``, each over 5
    to 50 runs that fit ``budget_ms``, L2 flushed before each run (`pbs.testing.benchmark_cuda`):
    run-to-run drift on the GPU machine was larger than the spread within one run."""
    repeats = REPEATS if repeats is None else repeats
    return sorted(_time_once(fn, budget_ms) for _ in range(repeats))[repeats // 2]


def device_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Median CUDA-event time of ``fn`` with the GPU kept busy while the host launches it
    (`pbs.testing.benchmark_cuda_interleaved` with ``BUSY_GPU_CYCLES``, L2 flushed before each
    run): device time alone. :func:`time_ms` times an idle GPU, whose events also hold the host's
    time before the first launch wherever it outlasts the flush (short calls)."""
    from pbs.testing import benchmark_cuda_interleaved

    return benchmark_cuda_interleaved({"fn": fn}, iters=iters, busy_gpu_cycles=BUSY_GPU_CYCLES)["fn"]


def wall_clock_ms(fn: Callable[[], object], budget_ms: float = 0.0, repeats: int | None = None) -> float:
    """One call of ``fn`` by the wall clock: :func:`time_ms`'s stand-in (same signature; the budget
    and the repeats are ignored) in a script's CPU smoke run, which checks its logic, not its speed."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _time_once(fn: Callable[[], object], budget_ms: float) -> float:
    from pbs.testing import benchmark_cuda

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    estimate = (time.perf_counter() - start) * 1e3
    iters = max(5, min(50, int(budget_ms / max(estimate, 1e-3))))
    return benchmark_cuda(fn, warmup=2, iters=iters)


def profile_call(fn: Callable[[], object], device_type: str = "cuda", top: int = 12) -> dict[str, Any]:
    """Where one call of ``fn`` spends its time (after one unprofiled call, which compiles and
    caches), from torch.profiler's events of ``device_type`` (``"cuda"``: the GPU kernels;
    ``"cpu"``: the host's ops, nested ones counted in their callers too).

    Returns:
        ``by_name``: up to ``top`` ``{"name", "ms", "calls"}``, the events summed by name, largest
        ``ms`` first; over all of the call's events, ``events`` (how many), ``event_ms`` (their
        summed durations) and ``span_ms`` (first start to last end). On the GPU, ``span_ms -
        event_ms`` is the time no kernel ran between the call's first and last kernel: the host's
        launches, or a sync inside the call, that the GPU waited for. ``gaps``: up to ``top`` of
        those idle stretches, longest first, each ``{"ms", "after", "before"}`` (the events that
        end and start it), to tell where in the call the GPU waited.
    """
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device_type == "cuda" else ProfilerActivity.CPU
    fn()  # compiled and cached before the profiled call
    if device_type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=[activity]) as prof:
        fn()
        if device_type == "cuda":
            torch.cuda.synchronize()
    events = [event for event in prof.events() if event.device_type.name.lower() == device_type]
    totals: dict[str, list[float]] = {}
    for event in events:
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.time_range.elapsed_us() / 1000.0
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    span_us = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) if events else 0
    return {
        "by_name": [{"name": name, "ms": ms, "calls": calls} for name, (ms, calls) in ranked],
        "events": len(events),
        "event_ms": sum(ms for ms, _ in totals.values()),
        "span_ms": span_us / 1000.0,
        "gaps": idle_gaps([(e.time_range.start, e.time_range.end, e.name) for e in events], top),
    }


def idle_gaps(intervals: list[tuple[float, float, str]], top: int) -> list[dict[str, Any]]:
    """The stretches inside ``intervals`` (``(start_us, end_us, name)``, nested or overlapping
    alike) that none of them covers, longest first, at most ``top``: ``{"ms", "after", "before"}``,
    ``after`` the interval that reached furthest before the stretch, ``before`` the one that ends it."""
    gaps = []
    reach, last = None, None
    for start, end, name in sorted(intervals):
        if reach is not None and start > reach:
            gaps.append({"ms": (start - reach) / 1000.0, "after": last, "before": name})
        if reach is None or end > reach:
            reach, last = end, name
    return sorted(gaps, key=lambda gap: -gap["ms"])[:top]


def host_profile(fn: Callable[[], object], top: int = 15, repeats: int = 5) -> dict[str, Any]:
    """How long the host takes to return from one call of ``fn`` that starts on an idle GPU, and
    where that time goes (after one call that compiles and caches).

    Returns:
        ``return_ms``: the median over ``repeats`` calls of the time until ``fn`` returns (on the
        CPU, the whole call); ``functions``: cProfile's up to ``top`` functions of one more call by
        their own time, ``{"function", "own_us", "calls"}``, largest first (cProfile's hooks slow
        the host, so read them as shares, not times).
    """
    import cProfile
    import pstats

    def settle() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    fn()
    returns = []
    for _ in range(repeats):
        settle()
        start = time.perf_counter()
        fn()
        returns.append((time.perf_counter() - start) * 1e3)
    settle()
    profiler = cProfile.Profile(time.perf_counter)
    profiler.enable()
    fn()
    profiler.disable()
    settle()
    stats = pstats.Stats(profiler).stats
    ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return {
        "return_ms": sorted(returns)[len(returns) // 2],
        "functions": [{"function": f"{Path(file).name}:{line}({name})", "own_us": own * 1e6, "calls": calls}
                      for (file, line, name), (_, calls, own, _, _) in ranked],
    }


class GpuSampler:
    """``nvidia-smi``'s readings of ``fields`` (its ``--query-gpu`` names, comma-separated) on GPU
    ``index`` every ``interval_ms`` while the ``with`` block runs: ``rows``, each reading's fields
    as stripped strings. No rows where ``nvidia-smi`` is missing (a CPU run)."""

    def __init__(self, fields: str, index: int = 0, interval_ms: int = 100):
        self.command = ["nvidia-smi", f"--id={index}", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                        f"-lms={interval_ms}"]
        self.width = len(fields.split(","))
        self.rows: list[list[str]] = []
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "GpuSampler":
        try:
            self._process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except FileNotFoundError:
            return self
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            fields = [field.strip() for field in line.split(",")]
            if len(fields) == self.width:
                self.rows.append(fields)

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            self._reader.join(timeout=5)


def graph_of(fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """``fn`` captured in a CUDA graph after one warm-up call: ``graph.replay()`` runs it again on
    whatever its input buffers hold then."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def load_module_file(name: str, path: str | os.PathLike):
    """The Python module in ``path``, imported under ``name`` (a kernel module's copy from another
    revision, say: its Gluon functions then compile apart from the tree's own)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The kernel benchmark's protocol (bench_kernel.py, bench_fp8.py, ab_kernel.py): one sequence, 32 query heads on 8
# KV heads of dim 128 in bf16, causal, segment 256, block 128, masks of a chosen density.
KERNEL_SHAPE = (1, 32, 8, 128)  # batch, query heads, KV heads, head dim
KERNEL_SEGMENT, KERNEL_BLOCK = 256, 128


def kernel_inputs(n: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel benchmark's q, k, v: ``(1, 32, n, 128)`` and ``(1, 8, n, 128)`` x 2 random normals
    in bf16, seeded by ``n``."""
    batch, heads_q, heads_kv, head_dim = KERNEL_SHAPE
    gen = torch.Generator(device=device).manual_seed(n)
    return tuple(torch.randn(batch, h, n, head_dim, device=device, generator=gen).bfloat16()
                 for h in (heads_q, heads_kv, heads_kv))


# The launch argument that instrumented copies of the Gluon kernel store their clock stamps through:
# the pointer to the LSE's smoothing shift, read by the kernel only when it writes the LSE in e4m3.
STAMPS_ARG = 19


def instrumented_kernel(source: str, workdir: str | os.PathLike, name: str):
    """An instrumented copy of ``pbs/kernels/hopper_attn.py`` (its source after the stamps went in),
    written to ``workdir/name.py`` and imported under ``name``."""
    path = Path(workdir) / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return load_module_file(name, path)


def launch_with_stamps(kernel, call, sms: int, stamps: torch.Tensor, runs: int = 3) -> None:
    """Runs an instrumented copy of the Gluon kernel (`instrumented_kernel`) on a prepared call,
    its stamps going to ``stamps`` (int64 on the GPU); the last of ``runs`` runs (warm caches,
    compiled) leaves them."""
    grid, args, kwargs = kernel.launch_arguments(call, sms)
    args = list(args)
    args[STAMPS_ARG] = stamps
    tile_counter = args[11]
    for _ in range(runs):
        tile_counter.zero_()
        kernel._hopper_block_sparse_attn_fwd[grid](*args, **kwargs)
    torch.cuda.synchronize()


def kernel_plan(q: torch.Tensor, k: torch.Tensor, density: float):
    """The kernel benchmark's plan: ``budget`` blocks of ``density`` on ``last_block``-permuted keys
    (shared by the query heads of a KV head), planned by the reference backend without the
    finiteness check (its inputs are random normals)."""
    import pbs

    config = pbs.PBSConfig(block_size=KERNEL_BLOCK, segment_size=KERNEL_SEGMENT, permuter="last_block", gqa="shared",
                           selector={"name": "budget", "density": density}, backend="reference", check_finite=False)
    return pbs.plan(q, k, config)


def cudnn_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, timer: Callable[[Callable[[], object]], float] = time_ms,
) -> tuple[float, str]:
    """cuDNN SDPA dense causal time (by ``timer``, default :func:`time_ms`) and how GQA ran: natively
    (``"enable_gqa"``) if cuDNN takes it, else on K/V expanded to the query heads (``"expanded K/V"``)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        try:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.cuda.synchronize()
            return timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)), "enable_gqa"
        except RuntimeError:
            group = q.shape[1] // k.shape[1]
            ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return timer(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True)), "expanded K/V"


def packed_prompts(lengths: list[int], heads_q: int, heads_kv: int, head_dim: int
                   ) -> tuple[list[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
    """Structured bf16 prompts (`pbs.testing.make_qkv`, seed ``i`` for prompt ``i``) on the GPU: the
    per-prompt ``(1, H, N, D)`` views and the packed ``(T, H, D)`` q, k, v with their ``cu_seq``."""
    import pbs

    prompts = [pbs.testing.make_qkv(batch=1, heads_q=heads_q, heads_kv=heads_kv, seq_len=n, head_dim=head_dim,
                                    dtype=torch.bfloat16, device="cuda", seed=i) for i, n in enumerate(lengths)]
    q, k, v = (torch.cat([p[j][0].transpose(0, 1) for p in prompts]).contiguous() for j in range(3))
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    views = [tuple(x[b0:b1].transpose(0, 1).unsqueeze(0) for x in (q, k, v)) for b0, b1 in zip(bounds, bounds[1:])]
    return views, (q, k, v, cu)


def torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor,
                 max_q: int, max_k: int) -> Callable[[], torch.Tensor] | None:
    """The dense baseline of PyTorch's ``torch.nn.attention.varlen.varlen_attn`` on packed ``q (T, Hq, D)``
    and ``k, v (T, Hkv, D)`` (K/V repeated to the query heads), causal with the queries aligned to
    the last keys: a call, run once here, or None (the reason printed) where this torch lacks it or
    it does not run."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        print(f"torch {torch.__version__}: no torch.nn.attention.varlen ({error})")
        return None
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = (x.repeat_interleave(group, 1) for x in (k, v))

    def call() -> torch.Tensor:
        return varlen_attn(q, k_rep, v_rep, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0))  # (-1, 0): causal

    try:
        call()
    except Exception as error:  # noqa: BLE001 - a baseline that does not run is reported, not fatal
        print(f"varlen_attn failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
        return None
    return call


def save_figure(fig: Any, path: Path, what: str, dpi: int = 130,
                rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> None:
    """Lays out a matplotlib figure within ``rect`` (figure fractions: room left outside it for a
    figure legend), writes it to ``path`` (creating its folder) and says so."""
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    print(f"{what} -> {path}")


# --------------------------------------------------------------------------------------------
# A Llama-3.1-8B-shaped model with random weights (bench_tensor_parallel.py, bench_cp_ttft.py;
# bench_ttft.py and bench_serve_ttft.py take its sizes alone, with LlamaConfig's other defaults)

LLAMA_8B_SIZES = dict(
    num_hidden_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
)
LLAMA_8B_SHAPE = dict(
    LLAMA_8B_SIZES,
    head_dim=128,
    max_position_embeddings=262144,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# Llama 3.1's RoPE (speed does not depend on it; the shapes are the point)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama_config(shape: dict[str, Any]):
    """A ``LlamaConfig`` of ``shape`` (e.g. `LLAMA_8B_SHAPE`) with `LLAMA3_ROPE`, for transformers 4.x and 5.x."""
    import inspect

    from transformers import LlamaConfig

    kwargs = dict(shape)
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:  # transformers 5.x
        kwargs["rope_parameters"] = dict(LLAMA3_ROPE)
    else:
        kwargs.update(rope_theta=LLAMA3_ROPE["rope_theta"],
                      rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"})
    return LlamaConfig(**kwargs)


def build_llama(config, device: torch.device, seed: int):
    """The whole model, random bf16 weights from ``seed``, created on ``device`` (no CPU copy)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()  # no .to(dtype): it would cast the fp32 rotary frequencies too


class Ranks:
    """This process's place among the ranks (world 1: no process group)."""

    def __init__(self, device_type: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.world > 1:
            import torch.distributed as dist

            kwargs = {"device_id": self.device} if device_type == "cuda" else {}
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo", **kwargs)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (on every rank)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Waits for every rank, then for this rank's GPU work."""
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
        self.sync()

    def sync(self) -> None:
        """Waits for this rank's GPU work (nothing on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize()

    def broadcast_(self, tensor: torch.Tensor) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.broadcast(tensor, src=0)

    def prompt(self, n: int, vocab: int, seed: int) -> torch.Tensor:
        """``(1, n)`` random token ids below ``vocab`` from ``seed + n``: rank 0's on every rank,
        whatever each rank's generator does."""
        gen = torch.Generator(device=self.device).manual_seed(seed + n)
        ids = torch.randint(0, vocab, (1, n), generator=gen, device=self.device)
        self.broadcast_(ids)
        return ids

    def free_memory(self) -> None:
        """Collects garbage and hands the CUDA cache back (between rows, so a row starts clean)."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def peak_gib(self) -> float | None:
        """This rank's peak of allocated GPU memory in GiB (None on the CPU)."""
        return torch.cuda.max_memory_allocated(self.device) / GIB if self.cuda else None

    def close(self, ok: bool) -> None:
        """Leaves together after a run that went well (a rank that exits first can abort the others'
        NCCL); after an error, leaves at once (torchrun then stops the other ranks)."""
        if self.world > 1:
            import torch.distributed as dist

            if ok:
                dist.barrier()
            dist.destroy_process_group()


def relaunch_under_torchrun(script: str, world: int, argv: list[str]) -> int:
    """Runs ``script`` again with ``argv`` in ``world`` processes under torchrun (one node, a free
    port) and returns its exit status: the multi-GPU benchmarks start themselves this way."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(Path(script).resolve()), *argv]
    print(f"starting {world} ranks: {' '.join(command)}", flush=True)
    return subprocess.call(command)


LOGITS_RTOL = 0.02
"""The least bound of a logits check: the largest difference within 2% of the largest logit."""


def compare_logits(single: torch.Tensor, other: torch.Tensor, noise: float | None = None) -> dict[str, Any]:
    """``other``'s last logits ``(vocab,)`` against ``single``'s (the same model in one process).

    They agree when the largest difference is within the larger of ``LOGITS_RTOL`` and twice
    ``noise`` (the same measure between two of PyTorch's dense kernels, `sdpa_kernel_noise`) of the
    largest logit, and the top-1 token is the same unless the single run's top-2 margin is within
    twice the difference.
    """
    diff = float((other - single).abs().max())
    scale = float(single.abs().max())
    top2 = single.topk(2).values
    margin = float(top2[0] - top2[1])
    top1_equal = int(other.argmax()) == int(single.argmax())
    top5 = len(set(other.topk(5).indices.tolist()) & set(single.topk(5).indices.tolist()))
    rel = diff / scale if scale else float("inf")
    bound = LOGITS_RTOL if noise is None else max(LOGITS_RTOL, 2 * noise)
    return {"max_abs_diff": diff, "max_abs_logit": scale, "rel_diff": rel, "top1_equal": top1_equal,
            "top1_margin_single": margin, "top5_overlap": top5, "bound": bound,
            "agree": rel <= bound and (top1_equal or margin <= 2 * diff)}


def sdpa_kernel_noise(last_logits: Callable[[], torch.Tensor], on_cuda: bool) -> dict[str, Any]:
    """What bf16 does to a model's logits when only the attention kernel's order of summation
    changes: ``last_logits()`` (the model's last logits, with SDPA as its attention) under SDPA
    pinned to FlashAttention and to cuDNN (to the math kernel on the CPU), compared.

    Returns ``kernels``, ``rel_diff``, ``max_abs_diff`` and ``top1_equal``, or ``error`` where a
    kernel does not take the inputs.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    second = SDPBackend.CUDNN_ATTENTION if on_cuda else SDPBackend.MATH
    logits = []
    try:
        for backend in (SDPBackend.FLASH_ATTENTION, second):
            with sdpa_kernel([backend]), torch.inference_mode():
                logits.append(last_logits())
    except RuntimeError as error:
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    entry = compare_logits(logits[0], logits[1])
    return {"kernels": ["FLASH_ATTENTION", second.name], "rel_diff": entry["rel_diff"],
            "max_abs_diff": entry["max_abs_diff"], "top1_equal": entry["top1_equal"]}

