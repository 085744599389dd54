"""`pbs.varlen_attention` over a paged KV cache (issue 28, point 2): paged (pages in a random
order) == contiguous, the kernels and planners that read pages in place against their contiguous
runs and the reference, the dispatch of paged calls, and the errors that name the bad argument.

Spare pages and the rows past each sequence's end are filled with NaN: a kernel that read them
for their values, or a sequence that read another's page, would show it in the output.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import pbs
import pbs.dense
from pbs.backends import CallSpec, resolve_backend
from pbs.backends.eligibility import flex_reasons, gluon_kernel_reasons, triton_kernel_reasons
from pbs.components import SelectionInputs
from pbs.types import PagedTensor
from tests.helpers import assert_max_abs_error_within_torch
from tests.test_serving import make_sequences, pack

# Every interpreted launch here has its addresses checked (tests/interpreter_bounds.py).
pytestmark = pytest.mark.usefixtures("checked_addresses")

REFERENCE = {"backend": "reference"}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Lengths around the default block of 128 and a chunk after a cached prefix (len_q < len_k).
LENGTHS = [(1, 1), (127, 127), (128, 128), (129, 129), (300, 300), (40, 260)]


def paged_cache(sequences, page_size, seed=0, spare_pages=3):
    """The keys and values of ``sequences`` (``(q, k, v)``, each ``(1, H, n, D)``) in one paged
    cache whose pages are handed out in a random order (``torch.randperm``).

    Returns:
        ``(k_cache, v_cache, block_table, seqused_k)``: the caches ``(num_pages, page_size, Hkv, D)``,
        NaN wherever no sequence wrote, the ``(N, max_pages)`` int32 table (unused entries -1) and
        the ``(N,)`` int32 key lengths.
    """
    _, k0, v0 = sequences[0]
    device, dtype = k0.device, k0.dtype
    pages_per_sequence = [-(-s[1].shape[2] // page_size) for s in sequences]
    num_pages = sum(pages_per_sequence) + spare_pages
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    max_pages = max(pages_per_sequence) + 1  # one entry more than any sequence needs: never read
    block_table = torch.full((len(sequences), max_pages), -1, dtype=torch.int32)
    caches = [torch.full((num_pages, page_size, x.shape[1], x.shape[3]), float("nan"), dtype=dtype, device=device)
              for x in (k0, v0)]
    for i, (_, k, v) in enumerate(sequences):
        for j in range(pages_per_sequence[i]):
            page = order.pop()
            block_table[i, j] = page
            for cache, x in zip(caches, (k, v)):
                rows = x[0, :, j * page_size:(j + 1) * page_size].transpose(0, 1)
                cache[page, :rows.shape[0]] = rows
    seqused_k = torch.tensor([s[1].shape[2] for s in sequences], dtype=torch.int32)
    return caches[0], caches[1], block_table.to(device), seqused_k.to(device)


def paged_arguments(sequences, page_size, seed=0):
    """The arguments of a paged `pbs.varlen_attention` call, as keywords."""
    q, _, _, cu_seq_q, _, max_q, max_k = pack(sequences)
    k_cache, v_cache, block_table, seqused_k = paged_cache(sequences, page_size, seed)
    return dict(q=q, k=k_cache, v=v_cache, cu_seq_q=cu_seq_q, cu_seq_k=None, max_q=max_q, max_k=max_k,
                block_table=block_table, seqused_k=seqused_k)


class PlanSpy:
    """Records the plan of every `DensePolicy.attend` call (both the contiguous and the paged
    path go through it when the backend is named)."""

    def __init__(self, monkeypatch):
        self.plans = []
        real = pbs.dense.DensePolicy.attend

        def spy(policy, q, k, v, scale):
            attended = real(policy, q, k, v, scale)
            self.plans.append(attended.plan)
            return attended

        monkeypatch.setattr(pbs.dense.DensePolicy, "attend", spy)


def check_paged_equals_contiguous(sequences, config, page_size, monkeypatch, exact=True):
    """Runs the batch contiguous and paged; the same plans, and the same outputs and LSE."""
    contiguous_spy = PlanSpy(monkeypatch)
    out, lse = pbs.varlen_attention(*pack(sequences), config, return_lse=True)
    monkeypatch.undo()
    paged_spy = PlanSpy(monkeypatch)
    paged_out, paged_lse = pbs.varlen_attention(**paged_arguments(sequences, page_size), config=config,
                                                return_lse=True)
    monkeypatch.undo()
    assert len(paged_spy.plans) == len(contiguous_spy.plans)
    for paged_plan, plan in zip(paged_spy.plans, contiguous_spy.plans):
        assert (paged_plan is None) == (plan is None)
        if plan is not None:
            assert paged_plan.backend == plan.backend
            assert torch.equal(paged_plan.mask.to_dense(), plan.mask.to_dense())
    assert not paged_out.isnan().any()
    if exact:
        assert torch.equal(paged_out, out) and torch.equal(paged_lse, lse)
    else:
        torch.testing.assert_close(paged_out, out)
        torch.testing.assert_close(paged_lse, lse)
    return paged_spy.plans


# -- paged == contiguous through pbs.varlen_attention ---------------------------------------------
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_paged_equals_contiguous_on_the_reference_backend(page_size, group, monkeypatch):
    heads_kv = 2 if group == 1 else 1
    sequences = make_sequences(LENGTHS, heads_q=group * heads_kv, heads_kv=heads_kv, seed=group)
    # Lines would keep a key in every block of random inputs: pooled blocks select sparsely here
    # (the union of both is held to the reference in the planner test below).
    config = {**REFERENCE, "block_size": 32, "selector": {"name": "mean_pool", "threshold": 0.3}}
    plans = check_paged_equals_contiguous(sequences, config, page_size, monkeypatch)
    assert any(plan.density < 1 for plan in plans)  # sparse: the selection really read the keys


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_equals_contiguous_on_the_triton_backend(dtype, page_size, monkeypatch):
    # The Triton kernel reads the pages in place (in the interpreter on the CPU): tiles inside one
    # page (128) and tiles spanning pages, read row by row (16).
    sequences = make_sequences([(1, 1), (129, 129), (40, 200)], heads_q=4, heads_kv=1, dtype=dtype, seed=2,
                               device=DEVICE)
    config = {"backend": "triton", "selector": {"name": "budget", "density": 0.6}}
    check_paged_equals_contiguous(sequences, config, page_size, monkeypatch)


@pytest.mark.parametrize("precision", ["fp8_qk", "fp8"])
def test_paged_equals_contiguous_in_a_quantized_precision(precision, monkeypatch):
    # The quantization pass needs the contiguous sequence (K's mean, V's channel scales): the pages
    # are gathered at planning, and the kernel then quantizes exactly what the contiguous call does.
    sequences = make_sequences([(1, 1), (129, 129), (40, 200)], heads_q=4, heads_kv=1, dtype=torch.float16, seed=4,
                               device=DEVICE)
    config = {"backend": "triton", "precision": precision, "selector": {"name": "budget", "density": 0.6}}
    plans = check_paged_equals_contiguous(sequences, config, 16, monkeypatch)
    assert all(plan.config.precision == precision for plan in plans)


def test_paged_with_a_permuter_that_reorders_keys_equals_contiguous(monkeypatch):
    config = {**REFERENCE, "block_size": 32, "segment_size": 64, "permuter": "last_block", "gqa": "per_head",
              "selector": {"name": "mean_pool", "threshold": 0.5}}
    sequences = make_sequences([(300, 300), (64, 64), (90, 250)], heads_q=4, heads_kv=2, seed=3)
    plans = check_paged_equals_contiguous(sequences, config, 16, monkeypatch)
    assert any(not plan.key_permutation.is_identity for plan in plans)


def test_paged_dense_fallback_runs_every_block_on_a_backend_that_reads_pages(monkeypatch):
    # The length rule on the CPU: the short sequence runs dense, as a full mask on the reference
    # backend (SDPA cannot read pages), the long one is planned.
    config = {"block_size": 32, "dense_fallback": {"devices": ["cpu"], "min_seq_len": 200, "max_density": None}}
    sequences = make_sequences([(100, 100), (300, 300)], seed=6)
    out = pbs.varlen_attention(*pack(sequences), config)
    spy = PlanSpy(monkeypatch)
    paged_out = pbs.varlen_attention(**paged_arguments(sequences, 16), config=config)
    assert spy.plans[0] is None and spy.plans[1] is not None
    torch.testing.assert_close(paged_out, out)  # SDPA against every block on the reference


@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_at_full_density_equals_dense_attention(page_size):
    sequences = make_sequences([(1, 1), (129, 129), (60, 400)], heads_q=4, heads_kv=1, seed=7)
    arguments = paged_arguments(sequences, page_size)
    out = pbs.varlen_attention(**arguments, config={**REFERENCE, "selector": {"name": "budget", "density": 1.0}})
    for (sq, sk, sv), got in zip(sequences, out.split([s[0].shape[2] for s in sequences])):
        assert_max_abs_error_within_torch(got.transpose(0, 1).unsqueeze(0), sq, sk, sv)


def test_paged_writes_into_out_and_skips_empty_query_sequences():
    sequences = make_sequences([(40, 40), (0, 7), (10, 30)], seed=8)
    arguments = paged_arguments(sequences, 16)
    out = torch.full((50, 4, 16), float("nan"))
    assert pbs.varlen_attention(**arguments, config=REFERENCE, out=out) is out
    assert not out.isnan().any()


def test_paged_values_may_have_their_own_head_dim():
    gen = torch.Generator().manual_seed(11)
    q, k = torch.randn(1, 4, 70, 16, generator=gen), torch.randn(1, 2, 70, 16, generator=gen)
    v = torch.randn(1, 2, 70, 32, generator=gen)
    arguments = paged_arguments([(q, k, v)], 16)
    out = pbs.varlen_attention(**arguments, config=REFERENCE)
    torch.testing.assert_close(out, pbs.attention(q, k, v, REFERENCE)[0].transpose(0, 1))


# -- the kernels and planners that read pages, against their contiguous runs -----------------------
def _one_sequence_in_pages(x, page_size, seed=0):
    """``x`` ``(1, H, n, D)`` as a poisoned cache and its table row (with a stale entry after)."""
    cache, _, table, _ = paged_cache([(x, x, x)], page_size, seed)
    return cache, table[0]


@pytest.mark.parametrize("page_size", [16, 64, 128])  # rows through pointers; tiles in one page (64-key tiles here)
@pytest.mark.parametrize("seq_len,seq_len_q", [(200, 200), (129, 60)])
def test_the_attention_kernel_reads_pages_in_place(page_size, seq_len, seq_len_q):
    from pbs.kernels.block_sparse_attn import block_sparse_attention
    from pbs.planning import full_plan

    q, k, v = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=seq_len, seq_len_q=seq_len_q, head_dim=32,
                                   dtype=torch.float32, seed=page_size, device=DEVICE)
    plan = full_plan(q, k, pbs.PBSConfig(backend="triton"), 32)
    k_cache, table = _one_sequence_in_pages(k, page_size)
    v_cache, _ = _one_sequence_in_pages(v, page_size)
    lse, paged_lse = (torch.empty(q.shape[:3], device=DEVICE) for _ in range(2))
    out = block_sparse_attention(q, k, v, plan.mask, lse=lse)
    paged = block_sparse_attention(q, k_cache, v_cache, plan.mask, lse=paged_lse, block_table=table)
    assert torch.equal(paged, out) and torch.equal(paged_lse, lse)


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("seq_len,seq_len_q", [(200, 200), (129, 60)])
def test_block_means_and_line_scores_read_pages_in_place(monkeypatch, page_size, seq_len, seq_len_q):
    import pbs.kernels.vertical_slash as vertical_slash
    from pbs.kernels.block_means import block_means
    from pbs.kernels.vertical_slash import line_scores
    from pbs.planning import make_layout

    q, k, _ = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=seq_len, seq_len_q=seq_len_q, head_dim=32,
                                   dtype=torch.float32, seed=1, device=DEVICE)
    cache, table = _one_sequence_in_pages(k, page_size)
    assert torch.equal(block_means(cache, 32, block_table=table, seq_len=seq_len), block_means(k, 32))
    layout = make_layout(q, k, pbs.PBSConfig())
    paged = line_scores(q, cache, layout, 32**-0.5, 64, block_table=table)
    assert torch.equal(paged, line_scores(q, k, layout, 32**-0.5, 64))
    if page_size == 16:  # both query heads of a KV head on one read of the pages
        monkeypatch.setattr(vertical_slash, "LINES_HEADS_PER_PROGRAM", 2)
        stacked = line_scores(q, cache, layout, 32**-0.5, 64, block_table=table)
        torch.testing.assert_close(stacked, paged, rtol=0, atol=1e-6)


# -- addresses: no kernel touches memory outside its tensors (tests/interpreter_bounds.py) --------
@pytest.mark.parametrize("page_size", [None, 16, 64, 128])  # contiguous; rows through pointers; tiles in a page
def test_the_attention_kernel_reads_in_bounds_even_ahead_of_its_pipelined_loops(page_size):
    # The GPU fault of test_gpu_paged_equals_contiguous_in_bf16 on an H100 ("an illegal memory
    # access"): the kernel reads its block lists and the block table with inline PTX (unmasked),
    # and the software pipeliner runs those reads num_stages - 1 steps past each loop's end, where
    # the list entry is a -1 pad (table read before the table) or, after the lists' last row, past
    # the tensor (whatever follows: a page index anywhere). pipelined_loops replays those steps.
    from pbs.kernels import block_sparse_attn
    from pbs.kernels.block_sparse_attn import block_sparse_attention
    from pbs.planning import full_plan
    from tests.interpreter_bounds import checked_addresses, pipelined_loops

    for len_q, len_k in [(1, 1), (129, 129), (40, 200)]:
        q, k, v = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=len_k, seq_len_q=len_q, head_dim=16,
                                       dtype=torch.float32, seed=len_k)
        # Every visible block: the last query block lists all Tk blocks, the earlier ones end in pads.
        mask = full_plan(q, k, pbs.PBSConfig(backend="triton"), 128).mask
        if page_size is not None:
            (k, table), (v, _) = (_one_sequence_in_pages(x, page_size) for x in (k, v))
        with checked_addresses(), pipelined_loops(block_sparse_attn, stages=3):
            block_sparse_attention(q, k, v, mask, block_table=None if page_size is None else table)


@pytest.mark.parametrize("preset,page_size", [("vertical_slash_pooled", 16), ("pbs_paper", 128)])
def test_the_gpu_paged_test_stays_in_bounds_in_the_interpreter(preset, page_size, monkeypatch):
    # test_gpu_paged_equals_contiguous_in_bf16 on the CPU: the Triton planners (line scores, block
    # means, block sets, threshold selection, last_block) and the attention kernel, contiguous and
    # paged, on the GPU test's short and odd lengths, every address checked (pytestmark).
    monkeypatch.setattr("pbs.planning.planning_family", lambda backend, device: backend.plans_with)
    config = pbs.PBSConfig.from_preset(preset, backend="triton", **NO_FALLBACK)
    lengths = [(1, 1), (129, 129), (0, 17), (100, 1000)]
    sequences = structured_sequences(lengths, seed=21, heads_q=4, heads_kv=2, head_dim=16, dtype=torch.float16,
                                     device="cpu")
    plans = check_paged_equals_contiguous(sequences, config, page_size, monkeypatch)
    assert any(plan.density < 1 for plan in plans if plan is not None)


@contextlib.contextmanager
def _compile_only(module, names, compiled):
    """Within the block, a launch of ``module``'s kernels ``names`` compiles them (``warmup``) and
    appends the compiled kernel to ``compiled`` instead of running it."""
    real = {name: getattr(module, name) for name in names}

    class CompileOnly:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: compiled.append(self.kernel.warmup(*args, grid=grid, **kwargs))

    for name in names:
        setattr(module, name, CompileOnly(real[name]))
    try:
        yield
    finally:
        for name in names:
            setattr(module, name, real[name])


def paged_compile_report(page_sizes: list[int]) -> dict:
    """Compiles, for sm_90 (run by compile_in_subprocess), the paged variants of the attention
    kernel (bf16, D 128, the GPU's 128x128 tiles), the block means and the line scores: their
    registers and spills per page size."""
    from pbs.kernels import block_means, block_sparse_attn, hopper_attn, vertical_slash
    from pbs.planning import full_plan, make_layout
    from tests.sm90_compile import resource_usage, scratch_dir, sm90_driver

    q, k, v = (x.to(torch.bfloat16) for x in pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=1000, head_dim=128))
    plan = full_plan(q, k, pbs.PBSConfig(backend="reference"), 128)
    report = {}
    for page_size in page_sizes:
        pages = -(-1000 // page_size)
        cache = torch.zeros(pages + 2, page_size, 2, 128, dtype=torch.bfloat16)
        table = torch.arange(pages, dtype=torch.int32)
        compiled = []
        with sm90_driver():
            with _compile_only(block_sparse_attn, ["_block_sparse_attn_fwd"], compiled):
                block_sparse_attn.block_sparse_attention(q, cache, cache, plan.mask, block_table=table,
                                                         config=block_sparse_attn.KernelConfig(128, 128, 8, 3))
            if page_size < 128:  # one code path for every page size: compiled once
                with _compile_only(block_means, ["_block_means_kernel"], compiled):
                    block_means.block_means(cache, 128, block_table=table, seq_len=1000)
                with _compile_only(vertical_slash, ["_row_stats", "_row_lines"], compiled):
                    vertical_slash.line_scores(q, cache, make_layout(q, k, pbs.PBSConfig()), 0.1, 64,
                                               block_table=table)
        report[str(page_size)] = [resource_usage(c.asm["cubin"], scratch_dir()) for c in compiled]
        if hopper_attn.gluon_page_size_ok(page_size):
            call = block_sparse_attn.prepare_call(q, cache, cache, plan.mask, None, None, None, True, None, table)
            grid, args, kwargs = hopper_attn.launch_arguments(call, sm_count=132)
            with sm90_driver():
                gluon = hopper_attn._hopper_block_sparse_attn_fwd.warmup(*args, grid=grid, **kwargs)
            report[f"hopper {page_size}"] = [resource_usage(gluon.asm["cubin"], scratch_dir())]
    # The same kernel on contiguous keys: what its partitions' captured arguments take on the stack.
    call = block_sparse_attn.prepare_call(q, k, v, plan.mask, None, None, None, True, None)
    grid, args, kwargs = hopper_attn.launch_arguments(call, sm_count=132)
    with sm90_driver():
        gluon = hopper_attn._hopper_block_sparse_attn_fwd.warmup(*args, grid=grid, **kwargs)
    report["hopper contiguous"] = [resource_usage(gluon.asm["cubin"], scratch_dir())]
    return report


def test_the_paged_kernels_compile_for_sm90_without_spills():
    # The GPU's own code path (the interpreter runs none of it): TMA loads from a page (128) and
    # row loads through the block table (16), compiled for an H100 with Triton's ptxas; and the
    # Gluon kernel's producer reading pages of 128 (one copy per block) and of 16 and 64 (one copy
    # per page, 8 and 2 per block).
    from tests.sm90_compile import compile_in_subprocess

    report = compile_in_subprocess("tests.test_paged:paged_compile_report", page_sizes=[16, 64, 128])
    assert sorted(report) == ["128", "16", "64", "hopper 128", "hopper 16", "hopper 64", "hopper contiguous"]
    for name, kernels in report.items():
        assert len(kernels) == {"16": 4, "64": 4, "128": 1}.get(name, 1)
        assert all(usage["LOCAL"] == 0 for usage in kernels), f"register spills ({name}): {kernels}"
    for page_size in (16, 64, 128):
        gluon = report[f"hopper {page_size}"][0]
        assert gluon["REG"] <= 168  # as the contiguous Gluon kernel (tests/test_hopper_attn.py)
    # The kernel's stack holds the arguments its partitions capture (a few words each, read once
    # when a partition starts); paging adds the block table and the last page's descriptor to them.
    # Beyond those, the producer's 24 registers hold one page lookup ...
    captures = report["hopper contiguous"][0]["STACK"]
    assert report["hopper 128"][0]["STACK"] <= captures + 8
    # ... and a block of small pages keeps its lookups in 24 bytes of stack at most (the producer's
    # own registers do not hold them all; 88 bytes before K and V shared each lookup).
    assert report["hopper 16"][0]["STACK"] <= captures + 8 + 24 and report["hopper 64"][0]["STACK"] <= captures + 8 + 24


def _selection_inputs(q, k, paged_k=None, block=32):
    from pbs.planning import build_plan

    config = pbs.PBSConfig(block_size=block, backend="reference")
    plan, q_perm, _, _ = build_plan(q, k, config, q.shape[-1] ** -0.5)
    return SelectionInputs(q=q_perm, k=None if paged_k else k, source_k=None if paged_k else k, paged_k=paged_k,
                           key_permutation=plan.key_permutation, layout=plan.layout,
                           query_positions=plan.query_positions(), key_positions=plan.key_positions(),
                           scale=q.shape[-1] ** -0.5)


@pytest.mark.parametrize("page_size,seq_len_q", [(16, None), (128, 90)])
def test_the_paged_triton_planner_selects_what_the_reference_selects(page_size, seq_len_q):
    # The default selector's planner (the lines with the pooled blocks merged into their
    # compaction) reads the keys from the pages; the reference reads the contiguous keys.
    from pbs.backends import planner_for
    from pbs.reference.block_sets import finalize_selection

    q, k, _ = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=260, seq_len_q=seq_len_q, head_dim=32,
                                   dtype=torch.float32, seed=5, device=DEVICE)
    cache, table = _one_sequence_in_pages(k, page_size)
    selector = pbs.PBSConfig(selector={"name": "union", "selectors": [
        {"name": "vertical_slash", "threshold": 0.6}, {"name": "mean_pool", "threshold": 0.6}]}).selector
    paged = planner_for("selector", "union", "triton")(selector, _selection_inputs(q, k, PagedTensor(cache, table, 260)))
    inputs = _selection_inputs(q, k)
    reference = finalize_selection(selector.select(inputs), inputs.layout, inputs.key_positions, True)
    assert torch.equal(paged.to_dense(), reference.to_dense())
    assert paged.density() < 1


def test_paged_selection_inputs_gather_the_pages_for_readers_that_cannot_read_them():
    q, k, _ = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=100, head_dim=16, seed=2)
    cache, table = _one_sequence_in_pages(k, 16)
    inputs = _selection_inputs(q, k, PagedTensor(cache, table, 100))
    assert torch.equal(inputs.k, k) and inputs.source_k is inputs.k


# -- dispatch: which backend can read pages ---------------------------------------------------------
def test_which_backends_read_pages_is_their_eligibility():
    def spec(page_size):
        return CallSpec(torch.device("cpu"), torch.float16, 64, 64, 128, page_size=page_size)

    # triton reads any page size, the Gluon kernel pages of whole 128-key blocks or whole pages of
    # a block (16 to 64 rows), flex none.
    assert not any("page" in reason for reason in triton_kernel_reasons(spec(16)))
    for page_size in (2, 8, 96):
        assert any(f"page_size {page_size} of the paged cache is neither a multiple of 128 nor a power of two "
                   "from 16 to 64" in r for r in gluon_kernel_reasons(spec(page_size))), page_size
    for page_size in (16, 32, 64, 128, 256):
        assert not any("page" in reason for reason in gluon_kernel_reasons(spec(page_size))), page_size
    assert any("not pages of a paged cache" in reason for reason in flex_reasons(spec(128)))
    assert not any("page" in reason for reason in gluon_kernel_reasons(spec(None)) + flex_reasons(spec(None)))
    assert resolve_backend("auto", spec(16)).name == "reference"  # the interpreter is never auto's choice


@pytest.mark.parametrize("backend, reason", [
    ("flex", r"not pages of a paged cache"),
    ("hopper", r"page_size 8 of the paged cache is neither a multiple of 128 nor a power of two from 16 to 64"),
])
def test_a_backend_that_cannot_read_these_pages_says_so(backend, reason):
    arguments = paged_arguments(make_sequences([(20, 20)], dtype=torch.float16), 8)
    with pytest.raises(ValueError, match=rf"backend '{backend}' cannot run this call: .*{reason}"):
        pbs.varlen_attention(**arguments, config={"backend": backend})


# -- bad input: each error names the argument and what it accepts ---------------------------------
def _good_paged_arguments():
    return paged_arguments(make_sequences([(3, 20), (4, 4)], heads_q=4, heads_kv=2, seed=9), 16)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32)


def _cache(num_pages=5, page_size=16, heads=2, dim=16, dtype=torch.float32):
    return torch.zeros(num_pages, page_size, heads, dim, dtype=dtype)


BAD_PAGED_INPUTS = {
    "block_table int64": (dict(block_table=_int32([[0, 1], [2, -1]]).long()), TypeError,
                          r"block_table must have dtype torch.int32 .* got torch.int64"),
    "block_table on another device": (dict(block_table=_int32([[0, 1], [2, -1]]).to("meta")), ValueError,
                                      r"block_table must be on q's device cpu, got meta"),
    "block_table 1-D": (dict(block_table=_int32([0, 1])), ValueError,
                        r"block_table must have shape \(N, max_pages\) with N = 2 sequences"),
    "block_table rows != N": (dict(block_table=_int32([[0, 1]])), ValueError,
                              r"block_table must have shape \(N, max_pages\) with N = 2 sequences .* got shape \(1, 2\)"),
    "seqused_k int64": (dict(seqused_k=torch.tensor([20, 4])), TypeError,
                        r"seqused_k must have dtype torch.int32 .* got torch.int64"),
    "seqused_k on another device": (dict(seqused_k=_int32([20, 4]).to("meta")), ValueError,
                                    r"seqused_k must be on q's device cpu, got meta"),
    "seqused_k of the wrong length": (dict(seqused_k=_int32([20, 4, 1])), ValueError,
                                      r"seqused_k must have shape \(N,\) with N = 2 sequences"),
    "seqused_k missing": (dict(seqused_k=None), ValueError, r"seqused_k is required with a paged cache"),
    "seqused_k without a block table": (dict(block_table=None, k=torch.zeros(24, 2, 16), v=torch.zeros(24, 2, 16),
                                             cu_seq_k=_int32([0, 20, 24])), ValueError,
                                        r"seqused_k is read only with a paged cache \(block_table=...\)"),
    "cu_seq_k with a block table": (dict(cu_seq_k=_int32([0, 20, 24])), ValueError,
                                    r"cu_seq_k must be None with a paged cache \(block_table\)"),
    "k_cache 3-D": (dict(k=torch.zeros(5, 16, 2)), ValueError,
                    r"k must have 4 dimensions \(num_pages, page_size, Hkv, D\)"),
    "v_cache 5-D": (dict(v=torch.zeros(5, 16, 2, 16, 1)), ValueError,
                    r"v must have 4 dimensions \(num_pages, page_size, Hkv, Dv\)"),
    "page_size mismatch": (dict(v=_cache(page_size=32)), ValueError,
                           r"k and v caches must have one page_size .* got k: 16, v: 32"),
    "page_size not a power of two": (dict(k=_cache(page_size=24), v=_cache(page_size=24)), ValueError,
                                     r"page_size .* must be a power of two \(e.g. 16, 64, 128 or 256.*got page_size = 24"),
    "num_pages mismatch": (dict(v=_cache(num_pages=4)), ValueError, r"same positive num_pages, got k: 5, v: 4"),
    "cache heads differ": (dict(v=_cache(heads=1)), ValueError, r"same number of heads Hkv, got k: 2, v: 1"),
    "cache dtypes differ": (dict(v=_cache(dtype=torch.float16)), ValueError,
                            r"q, k_cache and v_cache must share a dtype"),
    "q heads not a multiple of the cache's": (dict(k=_cache(heads=3), v=_cache(heads=3)), ValueError,
                                              r"q.shape\[1\] = 4\) must be a positive multiple .*k.shape\[2\] = 3"),
    "page index negative": (dict(block_table=_int32([[0, -1], [2, 3]])), ValueError,
                            r"block_table\[0, 1\] = -1 is not a page of the cache: .* 0 \.\. num_pages - 1 = 4"),
    "page index past the cache": (dict(block_table=_int32([[0, 1], [5, 3]])), ValueError,
                                  r"block_table\[1, 0\] = 5 is not a page of the cache"),
    "seqused_k above what the pages hold": (dict(seqused_k=_int32([33, 4])), ValueError,
                                            r"seqused_k\[0\] = 33 is more than the pages of block_table hold: "
                                            r"max_pages \* page_size = 2 \* 16 = 32"),
    "seqused_k negative": (dict(seqused_k=_int32([20, -1])), ValueError, r"seqused_k\[1\] = -1 is negative"),
    "queries longer than their keys": (dict(seqused_k=_int32([20, 3])), ValueError,
                                       r"sequence 1 has len_q = 4 queries and seqused_k\[1\] = 3 keys"),
    "max_k below the longest seqused_k": (dict(max_k=19), ValueError,
                                          r"max_k must be at least the longest key sequence, 20, got max_k = 19"),
}


def test_the_good_paged_arguments_run():
    arguments = _good_paged_arguments()
    assert arguments["block_table"].shape == (2, 3)
    arguments["block_table"] = arguments["block_table"][:, :2].clamp(min=0)  # the shape the cases change from
    arguments["k"], arguments["v"] = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 0, 0, 5 - x.shape[0]))
                                      for x in (arguments["k"], arguments["v"]))
    assert pbs.varlen_attention(**arguments, config=REFERENCE).shape == (7, 4, 16)


@pytest.mark.parametrize("case", sorted(BAD_PAGED_INPUTS))
def test_paged_varlen_names_the_bad_argument(case):
    change, error, message = BAD_PAGED_INPUTS[case]
    arguments = _good_paged_arguments()
    # Five pages of 16 rows, two table entries per sequence (sequence 0 uses pages 0 and 1,
    # sequence 1 page 2), so that every case changes one thing.
    arguments.update(k=_cache().uniform_(), v=_cache().uniform_(), block_table=_int32([[0, 1], [2, -1]]))
    arguments.update(change)
    with pytest.raises(error, match=message):
        pbs.varlen_attention(**arguments, config=REFERENCE)


def test_stale_table_entries_past_a_sequence_s_pages_are_never_read():
    arguments = _good_paged_arguments()
    arguments["block_table"][:, -1] = 10**6  # past the cache, but past every sequence's pages too
    pbs.varlen_attention(**arguments, config=REFERENCE)


# -- on the GPU ------------------------------------------------------------------------------------
GPU_LENGTHS = [(1, 1), (129, 129), (5000, 5000), (3000, 9000), (0, 17), (1000, 2048)]
NO_FALLBACK = {"dense_fallback": {"min_seq_len": 0, "max_density": None, "max_planned_density": None}}


def structured_sequences(lengths, seed, heads_q=8, heads_kv=2, head_dim=128, dtype=torch.bfloat16, device="cuda"):
    """`make_sequences` with the structured workload of `pbs.testing.make_qkv` (heavy hitters,
    slashes, local windows), on which the default selector is sparse (on random inputs its lines
    keep a key in every block); sequences without queries come from `make_sequences`."""
    sequences = []
    for i, (len_q, len_k) in enumerate(lengths):
        if len_q == 0:
            sequences += make_sequences([(0, len_k)], heads_q, heads_kv, head_dim, dtype, seed + i, device)
        else:
            sequences.append(pbs.testing.make_qkv(heads_q=heads_q, heads_kv=heads_kv, seq_len=len_k, seq_len_q=len_q,
                                                  head_dim=head_dim, dtype=dtype, device=device, seed=seed + i))
    return sequences


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("preset", ["vertical_slash_pooled", "pbs_paper"])
def test_gpu_paged_equals_contiguous_in_bf16(page_size, preset, monkeypatch):
    # The Triton planners read the pages in place on the GPU (line scores, block means), so the
    # masks must still be the contiguous ones, and the kernel's output too.
    config = pbs.PBSConfig.from_preset(preset, backend="triton", **NO_FALLBACK)
    sequences = structured_sequences(GPU_LENGTHS, seed=21)
    # The masks must be equal; the outputs within rounding (pages of 16 are read through pointers,
    # which the compiler may stage differently from the contiguous tiles' TMA loads).
    plans = check_paged_equals_contiguous(sequences, config, page_size, monkeypatch, exact=False)
    assert any(plan.density < 1 for plan in plans if plan is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["fp8", "quantized"])
def test_gpu_paged_equals_contiguous_in_a_quantized_preset_on_autos_kernel(preset, monkeypatch):
    # The pages gathered at planning: auto's kernel (the Gluon one on Hopper) quantizes and runs
    # exactly what it does on the contiguous batch, in e4m3 and in int8.
    config = pbs.PBSConfig.from_preset(preset, **NO_FALLBACK)
    sequences = structured_sequences([(4096, 4096), (100, 5000), (129, 1000)], seed=23)
    plans = check_paged_equals_contiguous(sequences, config, 64, monkeypatch)
    assert {plan.backend for plan in plans} == {"hopper" if _gluon_runs_here() else "triton"}
    assert {plan.config.precision for plan in plans} == {config.precision}


def _gluon_runs_here() -> bool:
    probe = torch.zeros(1, 1, 128, 128, device="cuda", dtype=torch.bfloat16)
    return not gluon_kernel_reasons(CallSpec.of(probe, 128, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 128, 256])
def test_gpu_auto_runs_paged_calls_on_a_backend_that_reads_pages(page_size, monkeypatch):
    # auto: the Gluon kernel on Hopper for pages it reads (16 and up), else the Triton kernel;
    # either gives what it gives on the contiguous batch.
    config = pbs.PBSConfig(**NO_FALLBACK)
    sequences = structured_sequences([(4096, 4096), (100, 5000), (129, 1000)], seed=22)
    spy = PlanSpy(monkeypatch)
    paged_out = pbs.varlen_attention(**paged_arguments(sequences, page_size), config=config)
    monkeypatch.undo()
    backend = "hopper" if _gluon_runs_here() else "triton"
    assert {plan.backend for plan in spy.plans} == {backend}
    assert not paged_out.isnan().any()  # the last pages' stale NaN rows stay out
    out = pbs.varlen_attention(*pack(sequences), config={**config.model_dump(), "backend": backend})
    torch.testing.assert_close(paged_out, out)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
def test_gpu_gluon_kernel_reads_pages_in_place(page_size, monkeypatch):
    if not _gluon_runs_here():
        pytest.skip("the Gluon kernel cannot run on this GPU")
    config = pbs.PBSConfig(backend="hopper", **NO_FALLBACK)
    sequences = structured_sequences(GPU_LENGTHS, seed=24)
    check_paged_equals_contiguous(sequences, config, page_size, monkeypatch, exact=False)


@pytest.mark.gpu
def test_gpu_paged_defaults_with_the_dense_fallback_stay_close_to_contiguous():
    # Defaults: short sequences run dense (every block on the Triton kernel for pages, cuDNN SDPA
    # contiguous), long ones are probed and planned from the pages.
    sequences = structured_sequences([(1, 1), (2000, 2000), (300, 40000)], seed=23)
    out = pbs.varlen_attention(*pack(sequences))
    paged_out = pbs.varlen_attention(**paged_arguments(sequences, 64))
    torch.testing.assert_close(paged_out, out, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 128])
def test_gpu_density_probe_reads_pages_in_place(page_size):
    from pbs.kernels.density_probe import probe_density_triton

    q, k, _ = pbs.testing.make_qkv(heads_q=8, heads_kv=2, seq_len=20000, seq_len_q=20000, head_dim=128,
                                   dtype=torch.bfloat16, seed=3, device="cuda")
    cache, table = _one_sequence_in_pages(k, page_size)
    args = dict(block_size=128, num_blocks=16, threshold=0.9, scale=128**-0.5)
    paged = probe_density_triton(q, cache, **args, block_table=table, seq_len_k=20000)
    # The pooled keys come from the block-means kernel paged and from a PyTorch mean contiguous:
    # equal up to rounding, which may move a block across the threshold, not more.
    assert paged == pytest.approx(probe_density_triton(q, k, **args), abs=0.01)
