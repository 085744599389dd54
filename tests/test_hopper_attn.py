"""The warp-specialized Gluon kernel for Hopper (:mod:`pbs.kernels.hopper_attn`).

On CPU it cannot run (Gluon has no interpreter), so the CPU tests compile it for sm_90 with
Triton's bundled ptxas and check what the compiler made of it, and check the dispatch. On an
H100/H200 (``gpu`` tests, scripts/gpu_check.sh) it gets the same differential checks as the
Triton kernel: reference fed the same mask, error judged against PyTorch's at the dtype, output
poisoned with NaN first so that every element must be written.
"""

from __future__ import annotations

import re

import pytest
import torch

from pbs.backends import CallSpec
from pbs.kernels.block_sparse_attn import block_sparse_attention, prepare_call
from pbs.testing import make_qkv
from pbs.types import PRECISION_FORMATS, BlockMask
from pbs.kernels.hopper_e4m3 import TURN_MIN_BLOCKS
from tests.sm90_compile import compile_in_subprocess
from tests.test_block_sparse_attn import _gpu_inputs, check_kernel, make_plan

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _stand_in_quantized(call, precision: str) -> None:
    """What `quantize_call` leaves in a call, in shapes and dtypes only (its Triton pass cannot
    run here: the compile has no GPU and no interpreter)."""
    from pbs.kernels.fp8_quant import byte_buffer

    qk_format, pv_fp8 = PRECISION_FORMATS[precision]
    qk_dtype = torch.int8 if qk_format == "int8" else torch.float8_e4m3fn
    b, hq, nq, d = call.q.shape
    hk, nk, dv = call.k.shape[1], call.k.shape[2], call.v.shape[-1]
    blocks = call.mask.layout.block_size
    call.q, call.k = (byte_buffer(shape, call.q.device, qk_dtype) for shape in ((b, hq, nq, d), (b, hk, nk, d)))
    call.q_scales = torch.ones(b, hq, -(-nq // blocks))
    call.k_scales = torch.ones(b, hk, -(-nk // blocks))
    if call.lse is not None:
        call.lse_shift = torch.zeros(b, hq, nq)
    if pv_fp8:
        call.v, call.v_scales, call.pv_fp8 = byte_buffer((b, hk, dv, nk), call.q.device), torch.ones(b, hk, dv), True


def compile_report(head_dim: int, causal: bool, stages: int, dense: bool = False, lse: bool = False,
                   ragged: bool = False, precision: str = "native") -> dict:
    """Compiles the kernel for sm_90 (run by compile_in_subprocess): resources and SASS markers.
    ``dense``: the gated dense mode that `pbs.dense.DensePolicy.probe` launches; ``lse``: the
    variant that also writes the log-sum-exp; ``ragged``: a ragged batch written packed
    (``row_starts``), as the capturable path launches it; ``precision``: ``"fp8_qk"`` or
    ``"fp8"``, the e4m3 variants, or ``"int8_qk"``, ``"int8_qk_fp8_pv"``, int8 Q and K."""
    from pbs.kernels import hopper_attn
    from tests.sm90_compile import resource_usage, sass, scratch_dir, sm90_driver

    q, k, v = make_qkv(heads_q=4, heads_kv=2, seq_len=1000, head_dim=head_dim, seed=0)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    if dense:
        gate = torch.zeros(32, dtype=torch.int32)
        grid, args, kwargs = hopper_attn.dense_launch_arguments(
            q, k, v, torch.empty_like(q), scale=0.1, causal=causal, sm_count=132, gate=gate, gate_limit=1 << 19,
            stages=stages)
    else:
        # Permuted queries and keys, a partial last key block: every constexpr branch of the kernel.
        plan = make_plan(q.float(), k.float(), block=128, segment=256, permuter="key_aware_query", causal=causal)
        call = prepare_call(q, k, v, plan.mask, plan.query_positions(), plan.key_positions(), None, causal, None)
        if lse:
            call.lse = torch.empty(q.shape[:3], dtype=torch.float32)
        if precision != "native":
            _stand_in_quantized(call, precision)
        row_starts = torch.tensor([0, 1000], dtype=torch.int32) if ragged else None
        grid, args, kwargs = hopper_attn.launch_arguments(call, sm_count=132, stages=stages, row_starts=row_starts)
    with sm90_driver():
        compiled = hopper_attn._hopper_block_sparse_attn_fwd.warmup(*args, grid=grid, **kwargs)
    cubin = compiled.asm["cubin"]
    scratch = scratch_dir()
    code = sass(cubin, scratch)
    markers = ("SETMAXREG.DEALLOC", "SETMAXREG.TRY_ALLOC", "HGMMA.64x128x16.F32.BF16", "QGMMA.64x128x32.F32.E4M3.E4M3",
               "IGMMA.64x128x32.S8.S8", "WARPGROUP.DEPBAR.LE gsb0, 0x1", "SYNCS.ARRIVE", "SYNCS.PHASECHK", "UTMASTG")
    opcodes = [line.split()[1] for line in code.splitlines() if line.strip().startswith("/*") and len(line.split()) > 1]
    ptx = compiled.asm["ptx"]
    return {"usage": resource_usage(cubin, scratch), "shared": compiled.metadata.shared,
            "markers": {m: m in code for m in markers},
            "tile_claims": sorted(set(re.findall(r"atom\.global\.gpu\.[a-z_]+\.add", ptx))),
            "counts": {**{op: sum(o == op for o in opcodes) for op in ("PRMT", "SHFL.IDX", "FFMA", "FMUL", "FADD")},
                       "I2F*": sum(o.startswith("I2F") for o in opcodes)},  # I2F, I2FP: integer to float
            "ptx": {name: len(re.findall(pattern, ptx)) for name, pattern in _E4M3_PTX.items()}}


# What `pbs.kernels.hopper_e4m3` puts in the PTX of the e4m3 (fp8) variant.
_E4M3_PTX = {"turns_taken": r"bar\.sync 1[45], 256", "turns_passed": r"bar\.arrive 1[45], 256",
             "polynomial_exp2": r"max\.NaN\.f32", "mufu_exp2": r"ex2\.approx",
             "e4m3_from_f32": r"cvt\.rn\.satfinite\.e4m3x2\.f32", "e4m3_from_f16": r"cvt\.rn\.satfinite\.e4m3x2\.f16x2",
             # a tile's block count against TURN_MIN_BLOCKS, below which it issues without turns
             "turn_guard": rf"setp\.lt\.s32\s+%p\d+, %r\d+, {TURN_MIN_BLOCKS.value};"}


@pytest.mark.parametrize(
    "head_dim, causal, stages, dense, lse, ragged, precision",
    [(128, True, 2, False, False, False, "native"), (128, True, 3, False, False, False, "native"),
     (64, False, 2, False, False, False, "native"), (128, True, 3, True, False, False, "native"),
     (128, True, 3, False, True, False, "native"), (128, True, 3, False, True, True, "native"),
     (128, True, 3, False, True, False, "fp8"), (128, True, 3, False, True, False, "int8_qk_fp8_pv")],
    ids=["d128-causal", "d128-3stages", "d64-noncausal", "d128-dense-gated", "d128-lse", "d128-lse-ragged",
         "d128-lse-fp8", "d128-lse-int8-qk"],
)
def test_compiles_for_sm90_warp_specialized_without_spills(head_dim, causal, stages, dense, lse, ragged, precision):
    report = compile_in_subprocess("tests.test_hopper_attn:compile_report", head_dim=head_dim, causal=causal,
                                   stages=stages, dense=dense, lse=lse, ragged=ragged, precision=precision)
    usage, markers = report["usage"], report["markers"]
    assert usage["LOCAL"] == 0, f"register spills: {usage}"
    assert usage["REG"] <= 168, usage  # 12 warps x 32 x 168 registers fit an SM
    assert report["shared"] <= 232448, "more shared memory than an H100/H200 SM has"
    # Registers move from the producer warp to the consumer warpgroups (setmaxnreg) ...
    assert markers["SETMAXREG.DEALLOC"] and markers["SETMAXREG.TRY_ALLOC"]
    # ... the consumers use Hopper's asynchronous warpgroup MMA (bf16; e4m3 for both products under
    # fp8, int8 for S and e4m3 for P V under int8_qk_fp8_pv), with S = QK^T of one block retired
    # while P V of the previous one may still run (wait with one group outstanding) ...
    qk_format, pv_fp8 = PRECISION_FORMATS[precision]
    assert markers["HGMMA.64x128x16.F32.BF16"] == (precision == "native")
    assert markers["QGMMA.64x128x32.F32.E4M3.E4M3"] == pv_fp8
    assert markers["IGMMA.64x128x32.S8.S8"] == (qk_format == "int8")
    # int8 scores become float32 by an integer add (`_float_scores`), not one conversion each
    # (I2FP, on the quarter-rate pipe of the exponentials: 64 per thread and step; the few left
    # convert positions and counts).
    assert report["counts"]["I2F*"] < 16, report["counts"]
    assert markers["WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    # ... and the partitions hand buffers over through mbarriers.
    assert markers["SYNCS.ARRIVE"] and markers["SYNCS.PHASECHK"]
    # The output leaves through shared memory by a TMA store where the tiles' rows are the output's
    # (not a ragged batch's packed rows) and it has the keys' dtype (not under e4m3).
    assert markers["UTMASTG"] == (not ragged and precision == "native")
    # Tiles are claimed from the global counter with relaxed atomics: a ticket publishes no data,
    # and an acquire would hold back the producer's list reads behind the claim's round trip.
    assert report["tile_claims"] == ["atom.global.gpu.relaxed.add"]
    # The softmax weights reach P V's operand registers in the thread that computed them: no
    # shuffles, and no byte-by-byte repacking of e4m3 weights (585 PRMT and 68 SHFL.IDX before
    # `_weights` reordered the keys and `_operand` packed four to a register).
    assert report["counts"]["SHFL.IDX"] <= 8 and report["counts"]["PRMT"] <= 32, report["counts"]
    # Under fp8 (`pbs.kernels.hopper_e4m3`): the warpgroups issue their products in turns (one
    # turn each for a tile's first S, each later S with the previous P V, and the last P V; one
    # more passed at the start and taken at the end) in tiles of TURN_MIN_BLOCKS blocks or more
    # (the count compared with it), one exponential in four of the weights is a
    # polynomial, and the weights are rounded to e4m3 from float32 once.
    ptx = report["ptx"]
    fp8 = pv_fp8
    assert (ptx["turns_taken"] > 0) == fp8 and ptx["turns_taken"] == ptx["turns_passed"], ptx
    assert (ptx["turn_guard"] > 0) == fp8, ptx
    assert (ptx["polynomial_exp2"] > 0) == fp8 and ptx["e4m3_from_f16"] == 0, ptx
    assert (ptx["e4m3_from_f32"] > 0) == fp8, ptx
    if fp8:
        # Three MUFU exponentials per polynomial one, besides each row's rescale factor.
        assert 3 * ptx["polynomial_exp2"] < ptx["mufu_exp2"] < 3.5 * ptx["polynomial_exp2"], ptx


def test_the_kernel_fuses_multiply_adds_whatever_tritons_default():
    # Triton 3.10 turns floating-point fusion off by default (TRITON_DEFAULT_FP_FUSION); the
    # launches ask for it (pbs.kernels._common.COMPILE_OPTIONS), so the SASS does not change.
    reports = [compile_in_subprocess("tests.test_hopper_attn:compile_report", env=env, head_dim=64, causal=False,
                                     stages=2) for env in ({"TRITON_DEFAULT_FP_FUSION": "1"},
                                                           {"TRITON_DEFAULT_FP_FUSION": "0"})]
    fused, default_off = (r["counts"] for r in reports)
    assert fused["FFMA"] > 0 and default_off == fused, (fused, default_off)


def test_int8_scores_become_float32_by_one_integer_add_and_lose_the_offset_in_the_exponent():
    # `_float_scores` and `_softmax_step` under int8 Q and K, replayed in float32 (the Gluon kernel
    # has no interpreter): every int32 score of head dims up to 256 comes out exact, and the
    # offset taken off in the exponent moves a weight by far less than int8's own error (~1e-2).
    from pbs.kernels._common import SCORE_OFFSET, SCORE_OFFSET_BITS

    limit = 256 * 127 * 127  # the largest |Q.K^T| of int8 rows at head dim 256
    gen = torch.Generator().manual_seed(0)
    s = torch.cat([torch.tensor([-limit, -1, 0, 1, limit], dtype=torch.int32),
                   torch.randint(-limit, limit + 1, (4096,), generator=gen, dtype=torch.int32)])
    as_float = (s + SCORE_OFFSET_BITS).view(torch.float32)
    assert torch.equal(as_float.double() - SCORE_OFFSET, s.double())
    # A step's exponents: scale = softmax scale * log2(e) * two block scales of amax / 127.
    scale = torch.tensor(128**-0.5 * 1.4426950408889634 * (4.0 / 127) ** 2, dtype=torch.float32)
    offset = SCORE_OFFSET * scale
    m = (as_float.max() * scale - offset).clamp_min(-1e30)
    x = as_float * scale - (m + offset)  # unfused: rounded twice, where the kernel's FMA rounds once
    exact = s.double() * scale.double() - m.double()
    weight_error = (torch.exp2(x.double()) / torch.exp2(exact) - 1).abs().max().item()
    assert weight_error < 2e-4, weight_error


def test_quantized_for_this_kernel_v_is_in_its_wgmma_key_order():
    # The e4m3 weights reach the tensor cores with each 16 keys reordered (`_weights`), so the
    # values this kernel reads must be stored that way: what `quantize_for_hopper` leaves.
    from pbs.kernels import fp8_quant
    from pbs.kernels.hopper_attn import quantize_for_hopper
    from pbs.reference import fp8 as twin

    q, k, v = (x.to(torch.float16) for x in make_qkv(heads_q=4, heads_kv=2, seq_len=200, head_dim=64, seed=0))
    plan = make_plan(q.float(), k.float(), block=128, segment=256, permuter="none", causal=True)
    call = prepare_call(q, k, v, plan.mask, None, None, None, True, None)
    quantize_for_hopper(call, "fp8")
    expected = fp8_quant.quantize_values_transposed(v, twin.channel_scales(v), wgmma_key_order=True)
    assert call.pv_fp8 and call.v.shape == (1, 2, 64, 208)  # 200 keys padded to 13 x 16
    assert torch.equal(call.v.float(), expected.float())
    native = prepare_call(q, k, v, plan.mask, None, None, None, True, None)
    quantize_for_hopper(native, "native")
    assert native.v is v or torch.equal(native.v, v)


def test_without_usable_gluon_auto_takes_triton_and_hopper_says_why(monkeypatch):
    import sys

    from pbs.backends import eligibility

    monkeypatch.setitem(sys.modules, "pbs.kernels.hopper_attn", None)  # importing it now fails
    eligibility._gluon_kernel_module.cache_clear()
    eligibility._gluon_kernel_reasons.cache_clear()
    try:
        spec = CallSpec(torch.device("cuda", 0), torch.bfloat16, 128, 128, 128)
        assert any("this Triton has no usable Gluon" in r for r in eligibility.gluon_kernel_reasons(spec))
        assert any("no usable Gluon" in r for r in eligibility.gated_dense_reasons(spec)) or eligibility.interpreting()
    finally:
        eligibility._gluon_kernel_module.cache_clear()
        eligibility._gluon_kernel_reasons.cache_clear()


def test_dense_mode_refuses_a_wrong_output_or_gate_by_name():
    from pbs.kernels.hopper_attn import dense_launch_arguments

    q, k, v = (x.half() for x in make_qkv(heads_q=2, heads_kv=1, seq_len=256, head_dim=64, seed=0))
    args = dict(scale=0.125, causal=True, sm_count=132)
    with pytest.raises(ValueError, match=r"out must be a \(1, 2, 256, 64\) torch.float16 tensor"):
        dense_launch_arguments(q, k, v, torch.empty_like(q, dtype=torch.float32), **args)
    for gate in (torch.zeros(2, dtype=torch.int32), torch.zeros(32, dtype=torch.int64)):
        with pytest.raises(ValueError, match="gate must be the density probe's int32 buffer"):
            dense_launch_arguments(q, k, v, torch.empty_like(q), gate=gate, **args)


def test_support_reasons_name_the_limits():
    from pbs.backends.eligibility import gluon_kernel_reasons

    q = torch.zeros(1, 2, 256, 96, dtype=torch.float32)
    reasons = " / ".join(gluon_kernel_reasons(CallSpec.of(q, 64, 64)))
    for part in ("not CUDA", "float32", "(96, 64)", "mask block 64"):
        assert part in reasons


# GPU: differential checks on an H100/H200 (run by scripts/gpu_check.sh).

needs_hopper = pytest.mark.skipif(torch.cuda.is_available() and not ON_HOPPER, reason="needs a Hopper GPU")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "batch, seq_len, seq_len_q, heads_q, heads_kv, head_dim, gqa, permuter, density, causal",
    [
        (1, 65536, None, 32, 8, 128, "shared", "last_block", 0.3, True),
        (1, 16384 + 100, 4096 + 37, 32, 8, 128, "per_head", "last_block", 0.5, True),
        (1, 8192, None, 8, 2, 64, "shared", "key_aware_query", 0.3, True),
        (2, 4096 + 17, None, 8, 2, 128, "shared", "last_block", 0.4, False),
        (2, 4096 + 17, None, 8, 2, 64, "shared", "random", 1.0, True),
    ],
)
def test_gpu_hopper_matches_reference(batch, seq_len, seq_len_q, heads_q, heads_kv, head_dim, gqa, permuter, density, causal):
    q, k, v = _gpu_inputs(batch, heads_q, heads_kv, seq_len, head_dim, seq_len_q)
    plan = make_plan(q, k, block=128, segment=256, permuter=permuter, gqa=gqa, density=density, causal=causal)
    for dtype in (torch.bfloat16, torch.float16):
        check_kernel(plan, q, k, v, dtype, kernel="hopper")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_hopper_arbitrary_masks_and_empty_rows(causal):
    q, k, v = _gpu_inputs(1, 4, 2, 2048 + 50, 128, seed=3)
    plan = make_plan(q, k, block=128, segment=256, permuter="random", causal=causal)
    layout = plan.layout
    gen = torch.Generator().manual_seed(0)
    dense = torch.rand(layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks, generator=gen) < 0.6
    dense[:, 0, 3] = False  # a query block that selects nothing
    dense[:, 1, :] = True  # every block, future ones included: a long masked tail (full_counts)
    out = check_kernel(plan, q, k, v, torch.bfloat16, mask=BlockMask.from_dense(dense.cuda(), layout), kernel="hopper")
    assert out[:, 0, 3 * 128 : 4 * 128].abs().max() == 0


@pytest.mark.gpu
@needs_hopper
def test_gpu_hopper_writes_a_ragged_batch_packed_from_its_own_rows():
    """``row_starts``: the packed queries read in place, each entry's real rows, and only they,
    landing at their packed offsets, equal to the padded launch's rows (the same tiles, computed
    alike), the LSE likewise; an entry with no rows takes nothing. The packed buffers start as NaN,
    so every element must be written."""
    from pbs.kernels.hopper_attn import hopper_block_sparse_attention

    q, k, v = _gpu_inputs(3, 4, 2, 2048, 128, seed=5)
    plan = make_plan(q, k, block=128, segment=256, permuter="random", causal=True)
    layout = plan.layout
    dense = torch.rand(layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks,
                       generator=torch.Generator().manual_seed(1)) < 0.5
    dense[..., 0] = True  # padded rows' lists too: the kernel must pass over them by the lengths alone
    mask = BlockMask.from_dense(dense.cuda(), layout)
    args = (q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, plan.query_positions(), plan.key_positions())
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
    padded = hopper_block_sparse_attention(*args, lse=lse)
    lengths = [1000, 0, 2048]
    starts = torch.tensor([0, 1000, 1000, 3048], dtype=torch.int32, device="cuda")
    packed = torch.full((3048, 4, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    packed_lse = torch.full((4, 3048), float("nan"), device="cuda")
    packed_q = torch.cat([args[0][b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])  # (3048, 4, 128)
    ragged = (packed_q, *args[1:])
    returned = hopper_block_sparse_attention(*ragged, out=packed, lse=packed_lse, row_starts=starts)
    assert returned is packed
    expected = torch.cat([padded[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])
    expected_lse = torch.cat([lse[b, :, :n] for b, n in enumerate(lengths)], dim=1)
    assert torch.equal(packed, expected) and torch.equal(packed_lse, expected_lse)
    with pytest.raises(ValueError, match=r"out must be a \(3048, 4, 128\)"):
        hopper_block_sparse_attention(*ragged, row_starts=starts)
    with pytest.raises(ValueError, match=r"row_starts must be a \(4,\) int32"):
        hopper_block_sparse_attention(*ragged, out=packed, row_starts=starts.long())
    with pytest.raises(ValueError, match=r"q must be \(Tq, 4, D\)"):
        hopper_block_sparse_attention(*args, out=packed, row_starts=starts)


@pytest.mark.gpu
@needs_hopper
def test_gpu_hopper_reads_the_masks_split():
    """As the Triton kernel's test: the unmasked/masked split comes from ``mask.full_counts``;
    claiming every block full drops the per-token check, claiming none full changes nothing."""
    import dataclasses

    from pbs.reference import block_sparse_attention_reference
    from pbs.testing import relative_error

    q, k, v = _gpu_inputs(1, 4, 2, 2048, 128, seed=5)
    plan = make_plan(q, k, block=128, segment=256, permuter="random", density=1.0)
    mask = plan.mask
    qp, kp, vp = q, plan.key_permutation.apply(k), plan.key_permutation.apply(v)
    qpos, kpos = plan.query_positions(), plan.key_positions()

    def run(m):
        from pbs.kernels.hopper_attn import hopper_block_sparse_attention

        return hopper_block_sparse_attention(qp.bfloat16(), kp.bfloat16(), vp.bfloat16(), m, None, kpos).float()

    causal = block_sparse_attention_reference(qp, kp, vp, mask, qpos, kpos, causal=True)
    unchecked = block_sparse_attention_reference(qp, kp, vp, mask, qpos, kpos, causal=False)
    assert relative_error(run(mask), causal) < 2e-2
    out = run(dataclasses.replace(mask, full_counts=mask.counts.clone()))
    assert relative_error(out, unchecked) < 2e-2 and relative_error(out, causal) > 0.05
    assert relative_error(run(dataclasses.replace(mask, full_counts=torch.zeros_like(mask.counts))), causal) < 2e-2


@pytest.mark.gpu
@needs_hopper
def test_gpu_auto_picks_hopper_and_agrees_with_triton(monkeypatch):
    q, k, v = (x.bfloat16() for x in _gpu_inputs(1, 8, 2, 8192, 128, seed=4))
    plan = make_plan(q.float(), k.float(), block=128, segment=256, density=0.3)
    kp, vp = plan.key_permutation.apply(k), plan.key_permutation.apply(v)
    kpos = plan.key_positions()
    calls = []
    from pbs.kernels import hopper_attn

    from pbs.backends import resolve_backend

    assert resolve_backend("auto", CallSpec.of(q, v.shape[-1], 128)).name == "hopper"
    real = hopper_attn.launch_hopper
    monkeypatch.setattr(hopper_attn, "launch_hopper", lambda *a, **kw: (calls.append(1), real(*a, **kw)))
    auto = hopper_attn.hopper_block_sparse_attention(q, kp, vp, plan.mask, None, kpos)
    assert calls, "the Hopper launcher did not launch the Gluon kernel"
    triton_out = block_sparse_attention(q, kp, vp, plan.mask, None, kpos)
    assert len(calls) == 1
    assert (auto.float() - triton_out.float()).abs().max() < 2e-2


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "batch, seq_len, seq_len_q, heads_q, heads_kv, head_dim, causal",
    [
        (1, 4096 + 50, None, 8, 2, 128, True),
        (2, 2048 + 17, 1000 + 3, 4, 2, 64, True),  # queries after a cached prefix
        (2, 2048 + 17, None, 4, 4, 128, False),
    ],
)
def test_gpu_dense_mode_matches_torch_and_its_gate_decides(batch, seq_len, seq_len_q, heads_q, heads_kv, head_dim,
                                                           causal):
    """The dense mode that `pbs.dense.DensePolicy.probe` starts before reading the probe: every
    visible key with no mask read, within torch's error at the dtype; with a gate, it computes only
    when the counters say dense, by the same integer rule as the host (`probe_says_dense`)."""
    from pbs.dense import probe_gate_limit, probe_says_dense
    from pbs.kernels._common import sm_count
    from pbs.kernels.hopper_attn import launch_hopper_dense
    from tests.helpers import assert_max_abs_error_within_torch

    q, k, v = _gpu_inputs(batch, heads_q, heads_kv, seq_len, head_dim, seq_len_q, seed=6)
    scale = head_dim**-0.5
    for dtype in (torch.bfloat16, torch.float16):
        qd, kd, vd = (x.to(dtype) for x in (q, k, v))
        out = torch.full_like(qd, float("nan"))
        launch_hopper_dense(qd, kd, vd, out, scale=scale, causal=causal, sm_count=sm_count(q.device))
        assert not out.isnan().any(), "some output element was never written"
        assert_max_abs_error_within_torch(out, qd, kd, vd, causal=causal)

    qd, kd, vd = (x.to(torch.bfloat16) for x in (q, k, v))
    limit = probe_gate_limit(0.8)
    for kept, visible in ((80, 100), (81, 100), (0, 7), (7, 7)):
        gate = torch.zeros(32, dtype=torch.int32, device="cuda")
        gate[0], gate[1] = kept, visible
        out = torch.full_like(qd, float("nan"))
        launch_hopper_dense(qd, kd, vd, out, scale=scale, causal=causal, sm_count=sm_count(q.device), gate=gate,
                            gate_limit=limit)
        if probe_says_dense(kept, visible, 0.8):
            assert not out.isnan().any()
            assert_max_abs_error_within_torch(out, qd, kd, vd, causal=causal)
        else:
            assert out.isnan().all(), f"a closed gate ({kept}/{visible}) must leave the output untouched"
    assert [probe_says_dense(a, b, 0.8) for a, b in ((80, 100), (81, 100), (0, 7), (7, 7))] == [False, True, False, True]


def test_a_launch_builds_its_shared_memory_layouts_once_per_shape():
    # Gluon works a layout out through its constexpr machinery (about 40 us a call on the CPU),
    # several per launch: the launch keeps them per shape and dtype, so a second launch of the same
    # shapes builds none.
    from pbs.kernels import hopper_attn

    q, k, v = (x.to(torch.bfloat16) for x in make_qkv(heads_q=4, heads_kv=2, seq_len=300, head_dim=64, seed=0))
    plan = make_plan(q.float(), k.float(), block=128, segment=256, permuter="none", causal=True)
    call = prepare_call(q, k, v, plan.mask, None, None, None, True, None)
    hopper_attn.launch_arguments(call, sm_count=132)
    built = hopper_attn._swizzled_layout.cache_info().misses
    grid, args, kwargs = hopper_attn.launch_arguments(call, sm_count=132)
    assert hopper_attn._swizzled_layout.cache_info().misses == built
    assert kwargs["O_TMA"] and args[4].layout == args[0].layout  # the output's copy: Q's tile shape and layout
