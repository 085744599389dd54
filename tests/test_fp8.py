"""FP8 and INT8 compute for the selected blocks (`PBSConfig.precision`): the twin's error and invariants
(`pbs.reference.fp8`), the Triton kernel against the twin, the config and the backends' refusals.

Error bound. e4m3 keeps 3 mantissa bits: a value rounds with a relative error of at most 2^-4
(6.25%), about 2.6% RMS on Gaussian data. On standard-normal Q and K (scores of unit scale) the
output's relative (Frobenius) error stays under 8% (it measures 3-4%); on peaked inputs it grows
with the scores' size, since a score ``s`` moves by about ``|s|`` times that. Native fp16 is about
30 times closer, so a "quantization" that did nothing would fail the lower bound.
"""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.kernels.block_sparse_attn import block_sparse_attention
from pbs.planning import permute_keys_and_values
from pbs.reference import block_sparse_attention_reference, fp8
from pbs.testing import make_qkv
from pbs.types import PRECISION_FORMATS

pytestmark = pytest.mark.usefixtures("checked_addresses")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter's bf16 dots are wrong


def _plan(q, k, *, block=32, segment=64, permuter="none", causal=True, density=0.5, precision="native"):
    config = pbs.PBSConfig(block_size=block, segment_size=segment, permuter=permuter, causal=causal,
                           selector={"name": "budget", "density": density}, backend="reference",
                           check_finite=False, precision=precision)
    return pbs.plan(q, k, config)


def _permuted(plan, q, k, v):
    kp, vp = permute_keys_and_values(plan.key_permutation, k, v)
    return plan.query_permutation.apply(q), kp, vp


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _gaussian(seq_len=256, heads_q=4, heads_kv=2, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, seq_len, d, generator=gen) for h in (heads_q, heads_kv, heads_kv))


@pytest.mark.parametrize("precision", ["fp8_qk", "fp8", "int8_qk", "int8_qk_fp8_pv"])
def test_twin_error_is_e4m3s_and_not_natives(precision):
    q, k, v = _gaussian()
    plan = _plan(q, k, density=1.0)
    args = (plan.mask, plan.query_positions(), plan.key_positions())
    truth = block_sparse_attention_reference(q, k, v, *args)
    half = block_sparse_attention_reference(q.half(), k.half(), v.half(), *args)
    quantized = fp8.fp8_block_sparse_attention_reference(q, k, v, *args, precision=precision)
    error = _relative(quantized, truth)
    assert 10 * _relative(half, truth) < error < 0.08


def test_int8_scores_are_closer_than_e4m3_scores():
    """int8 keeps 7 bits against e4m3's 3 on the large values that dominate a dot product: on
    Gaussian blocks its output error is about a third of e4m3's (0.011 against 0.034 measured)."""
    q, k, v = _gaussian(seed=6)
    plan = _plan(q, k, density=1.0)
    args = (plan.mask, plan.query_positions(), plan.key_positions())
    truth = block_sparse_attention_reference(q, k, v, *args)
    e4m3 = _relative(fp8.fp8_block_sparse_attention_reference(q, k, v, *args, precision="fp8_qk"), truth)
    int8 = _relative(fp8.fp8_block_sparse_attention_reference(q, k, v, *args, precision="int8_qk"), truth)
    assert int8 < 0.5 * e4m3


def test_every_precision_of_the_config_has_formats():
    from typing import get_args

    assert set(get_args(pbs.PBSConfig.model_fields["precision"].annotation)) == set(PRECISION_FORMATS)


def test_pv_in_fp8_adds_error_to_qk_in_fp8():
    q, k, v = _gaussian(seed=1)
    plan = _plan(q, k, density=1.0)
    args = (plan.mask, plan.query_positions(), plan.key_positions())
    truth = block_sparse_attention_reference(q, k, v, *args)
    qk_only = _relative(fp8.fp8_block_sparse_attention_reference(q, k, v, *args, precision="fp8_qk"), truth)
    both = _relative(fp8.fp8_block_sparse_attention_reference(q, k, v, *args, precision="fp8"), truth)
    assert qk_only < both < 2 * qk_only


def test_smoothing_takes_a_common_key_offset_out_of_the_error():
    """Every score of a row moves by q . mean(K), which the softmax cancels: a large offset shared
    by all keys changes nothing in fp32, and, smoothed away, nothing in e4m3 either. Quantized
    with it, the keys' own spread would drown in the offset's range."""
    q, k, v = _gaussian(seed=2)
    shifted = k + 4.0 * torch.randn(1, 2, 1, 64, generator=torch.Generator().manual_seed(3))
    plan = _plan(q, k, density=1.0)
    args = (plan.mask, plan.query_positions(), plan.key_positions())
    truth = block_sparse_attention_reference(q, k, v, *args)
    torch.testing.assert_close(block_sparse_attention_reference(q, shifted, v, *args), truth, atol=2e-5, rtol=1e-4)
    smoothed = _relative(fp8.fp8_block_sparse_attention_reference(q, shifted, v, *args, precision="fp8_qk"), truth)
    plain = fp8.fake_quantize_qk(q, shifted, 32)  # what quantizing without the mean would do:
    unsmoothed_k = fp8.dequantize_blocks(*fp8.quantize_blocks(shifted, 32), 32)
    unsmoothed = _relative(block_sparse_attention_reference(plain[0], unsmoothed_k, v, *args), truth)
    assert smoothed < 0.08 and unsmoothed > 2 * smoothed


def test_int8_channel_balance_keeps_the_products_and_takes_an_outlier_channel_out_of_the_error():
    """A key channel ten times the others' range (after the mean) takes int8's 127 steps from the
    rest when K and Q are scaled alone; balanced (K's channel times c, Q's divided by c, c the
    square root of their amax ratio) the two sides share the range and the scores keep their bits."""
    q, k, _ = _gaussian(seed=5)
    k[..., 3] *= 10.0
    mean = fp8.key_means(k)
    q_factor, k_factor = fp8.channel_balance(q, k, mean)
    group = q.shape[1] // k.shape[1]
    q_balanced = q * q_factor.repeat_interleave(group, dim=1)[:, :, None, :]
    k_balanced = (k - mean) * k_factor[:, :, None, :]
    exact = q @ (k - mean).repeat_interleave(group, dim=1).transpose(-1, -2)
    torch.testing.assert_close(q_balanced @ k_balanced.repeat_interleave(group, dim=1).transpose(-1, -2), exact,
                               atol=1e-4, rtol=1e-5)
    q_amax = q_balanced.abs().amax(2).view(1, 2, group, 64).amax(2)
    torch.testing.assert_close(q_amax, k_balanced.abs().amax(2), rtol=1e-5, atol=0)
    assert k_factor[..., 3].max() < 0.5 < k_factor[..., :3].min()

    def score_error(q_hat, k_hat):
        return _relative(q_hat @ k_hat.repeat_interleave(group, dim=1).transpose(-1, -2), exact)

    balanced = score_error(*fp8.fake_quantize_qk(q, k, 32, "int8")[:2])
    alone = score_error(fp8.dequantize_blocks(*fp8.quantize_blocks(q, 32, "int8"), 32),
                        fp8.dequantize_blocks(*fp8.quantize_blocks(k - mean, 32, "int8"), 32))
    assert balanced < 0.5 * alone, (balanced, alone)


def test_a_channel_of_zeros_or_nan_keeps_the_factor_one():
    q, k, _ = _gaussian(seed=6)
    q[..., 0] = 0.0
    k[0, 1, 7, 5] = float("nan")
    q_factor, k_factor = fp8.channel_balance(q, k, fp8.key_means(k))
    assert torch.isfinite(k_factor).all() and torch.isfinite(q_factor).all()
    assert (k_factor[..., 0] == 1).all() and k_factor[0, 1, 5] == 1 and k_factor[0, 0, 5] != 1


def test_the_kernel_path_quantizes_int8_keys_balanced_as_the_twin():
    from pbs.kernels.block_sparse_attn import prepare_call, quantize_call

    q, k, v = (x.half().to(DEVICE) for x in _gaussian(seed=7))
    k[..., 2] *= 8.0
    plan = _plan(q, k, density=1.0)
    call = prepare_call(q, k, v, plan.mask, None, None, None, True, None)
    quantize_call(call, "int8_qk")
    mean = fp8.key_means(k)
    _, k_factor = fp8.channel_balance(q, k, mean)
    expected_k8, expected_scales = fp8.quantize_blocks((k.float() - mean) * k_factor[:, :, None, :], 32, "int8")
    assert torch.equal(call.k, expected_k8) and torch.equal(call.k_scales, expected_scales)


def test_lse_is_of_the_unsmoothed_scores():
    q, k, v = _gaussian(seed=4)
    k = k + 3.0  # a large mean: an LSE that forgot to add the shift back would be off by scale * q . 3
    plan = _plan(q, k, density=0.6)
    args = (plan.mask, plan.query_positions(), plan.key_positions())
    _, lse = block_sparse_attention_reference(q, k, v, *args, return_lse=True)
    _, lse8 = fp8.fp8_block_sparse_attention_reference(q, k, v, *args, return_lse=True, precision="fp8")
    # The LSE's error is the scores' (e4m3 moves a score by a few percent of its size).
    error = (lse8 - lse).abs()
    assert error.median() < 0.05 and error.max() < 0.5
    shift = (q.view(1, 2, 2, 256, 64) * 3.0).sum(-1).abs() * 64**-0.5
    assert shift.median() > 1  # the test would see a missing shift


def test_zero_blocks_and_a_nan_block():
    q, k, v = _gaussian(seed=5)
    q[:, :, :32] = 0  # a zero query block: scale 1, uniform attention, finite output
    q[0, 1, 100, 3] = float("nan")  # poisons its query block (rows 96-127 of head 1) only
    plan = _plan(q.nan_to_num(), k, density=1.0)
    args = (plan.mask, plan.query_positions(), plan.key_positions())
    out = fp8.fp8_block_sparse_attention_reference(q, k, v, *args, precision="fp8")
    assert out[0, 1, 96:128].isnan().all()
    out[0, 1, 96:128] = 0
    assert out.isfinite().all()


# The kernel against its twin (the Triton interpreter on CPU: fp16 at small shapes; bf16 on the GPU).
KERNEL_CASES = {
    "shared_gqa_permuted": dict(seq_len=300, permuter="last_block", density=0.5),
    "cached_prefix": dict(seq_len=300, seq_len_q=150, permuter="none", density=0.6),
    "non_causal": dict(seq_len=200, permuter="none", causal=False, density=0.5),
    "tiles_inside_blocks": dict(seq_len=320, block=128, segment=128, permuter="none", density=0.7, head_dim=64),
}


def _truth_and_twin(plan, q, k, v, dtype: torch.dtype, precision: str):
    """The plan's permuted inputs in ``dtype``, fp32 attention over its mask, and the twin's
    output and LSE in ``precision``."""
    qp, kp, vp = (x.to(dtype) for x in _permuted(plan, q, k, v))
    qpos, kpos, causal = plan.query_positions(), plan.key_positions(), plan.layout.causal
    truth = block_sparse_attention_reference(*(x.float() for x in _permuted(plan, q, k, v)), plan.mask, qpos, kpos,
                                             causal=causal)
    twin, twin_lse = fp8.fp8_block_sparse_attention_reference(qp, kp, vp, plan.mask, qpos, kpos, causal=causal,
                                                              return_lse=True, precision=precision)
    return (qp, kp, vp), truth, twin, twin_lse


def _kernel_positions(plan) -> dict:
    """The kernels' position arguments: None where the plan left that side in order."""
    return dict(query_positions=None if plan.query_permutation.is_identity else plan.query_positions(),
                key_positions=None if plan.key_permutation.is_identity else plan.key_positions())


@pytest.mark.parametrize("case, precision", [
    *((case, precision) for case in KERNEL_CASES for precision in ("fp8_qk", "fp8")),
    # int8 changes only the Q.K^T operands: two cases (GQA, permuted keys; a cached prefix) cover it.
    *((case, precision) for case in ("shared_gqa_permuted", "cached_prefix") for precision in ("int8_qk", "int8_qk_fp8_pv")),
])
def test_kernel_matches_its_twin(case, precision):
    options = dict(KERNEL_CASES[case])
    seq_len, seq_len_q = options.pop("seq_len"), options.pop("seq_len_q", None)
    head_dim = options.pop("head_dim", 32)
    q, k, v = make_qkv(1, 4, 2, seq_len, head_dim, seq_len_q=seq_len_q, seed=7, device=DEVICE)
    k = k + 2.0  # a common offset, which the smoothing must remove in both
    plan = _plan(q, k, **options)
    (qp, kp, vp), truth, twin, twin_lse = _truth_and_twin(plan, q, k, v, KERNEL_DTYPE, precision)
    lse = torch.empty(qp.shape[:3], dtype=torch.float32, device=DEVICE)
    out = block_sparse_attention(qp, kp, vp, plan.mask, **_kernel_positions(plan), causal=plan.layout.causal,
                                 lse=lse, precision=precision)
    twin_error = _relative(twin, truth)
    # Q and K are quantized identically (tests/test_fp8_quant.py), so the scores agree to fp32
    # rounding, and the outputs to the rounding of the output dtype (2^-9 relative in bf16, 2^-12
    # in fp16); the weights P are quantized against the running row max in the kernel and the
    # final one in the twin, which moves single values by one e4m3 step.
    rounding = torch.finfo(KERNEL_DTYPE).eps
    pv_fp8 = precision in ("fp8", "int8_qk_fp8_pv")
    assert _relative(out, twin) < (0.25 if pv_fp8 else 0.02) * twin_error + rounding
    assert _relative(out, truth) < 1.1 * twin_error
    torch.testing.assert_close(lse, twin_lse, atol=2e-3, rtol=1e-4)


def triton_int8_compile_report() -> dict:
    """Compiles the Triton kernel for sm_90 with int8 Q and K and e4m3 P V (run by
    compile_in_subprocess; stand-in tensors, as the quantization pass cannot run there): its opcodes."""
    import collections

    from pbs.kernels import block_sparse_attn
    from tests.sm90_compile import sass, scratch_dir, sm90_driver
    from tests.test_hopper_attn import _stand_in_quantized
    from tests.test_paged import _compile_only

    q, k, v = (x.to(torch.bfloat16) for x in make_qkv(1, 4, 2, 1000, 128, seed=0))
    plan = _plan(q.float(), k.float(), block=128, segment=256, permuter="none", density=0.5)
    call = block_sparse_attn.prepare_call(q, k, v, plan.mask, None, None, None, True, None)
    _stand_in_quantized(call, "int8_qk_fp8_pv")
    compiled = []
    with sm90_driver(), _compile_only(block_sparse_attn, ["_block_sparse_attn_fwd"], compiled):
        block_sparse_attn._launch(call, block_sparse_attn.candidate_configs(torch.int8, 128, False)[0].fitted(128))
    code = sass(compiled[0].asm["cubin"], scratch_dir())
    ops = [line.split()[1] for line in code.splitlines() if line.strip().startswith("/*") and len(line.split()) > 1]
    return dict(collections.Counter(op.split(".")[0] for op in ops))


def test_triton_int8_scores_take_no_conversion_instruction_on_sm90():
    # int8 Q.K^T's int32 scores become float32 by an integer add and a subtraction
    # (pbs.kernels._common.SCORE_OFFSET), not one I2FP each (the quarter-rate pipe of the
    # exponentials): a 64 x 128 tile of 4 warps gives each thread 64 scores per step.
    from tests.sm90_compile import compile_in_subprocess

    ops = compile_in_subprocess("tests.test_fp8:triton_int8_compile_report")
    assert ops.get("IGMMA", 0) + ops.get("IMMA", 0) > 0, ops  # the scores are int8 products
    conversions = sum(count for op, count in ops.items() if op.startswith("I2F"))  # I2F, I2FP
    assert conversions < 16, ops  # 128 I2FP (two loops of 64) before


# The Gluon kernel (Hopper) against the same twin: mask block 128, head dims 64 and 128.
GLUON_CASES = {
    "gqa_permuted": dict(seq_len=1000, head_dim=128, permuter="last_block", density=0.5),
    "cached_prefix": dict(seq_len=1300, seq_len_q=600, head_dim=128, permuter="none", density=0.6),
    "non_causal_d64": dict(seq_len=900, head_dim=64, permuter="none", causal=False, density=0.5),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernel runs on Hopper GPUs")
@pytest.mark.parametrize("case, precision", [(case, p) for case in GLUON_CASES
                                              for p in ("fp8_qk", "fp8", "int8_qk", "int8_qk_fp8_pv")])
def test_gluon_kernel_matches_its_twin(case, precision):
    from pbs.kernels.hopper_attn import hopper_block_sparse_attention

    options = dict(GLUON_CASES[case])
    seq_len, seq_len_q, head_dim = options.pop("seq_len"), options.pop("seq_len_q", None), options.pop("head_dim")
    q, k, v = make_qkv(1, 8, 2, seq_len, head_dim, seq_len_q=seq_len_q, seed=3, device="cuda")
    k = k + 2.0
    plan = _plan(q, k, block=128, segment=256, **options)
    (qp, kp, vp), truth, twin, twin_lse = _truth_and_twin(plan, q, k, v, torch.bfloat16, precision)
    lse = torch.full(qp.shape[:3], float("nan"), dtype=torch.float32, device="cuda")
    out = torch.full_like(qp, float("nan"))  # every element must be written
    hopper_block_sparse_attention(qp, kp, vp, plan.mask, **_kernel_positions(plan), causal=plan.layout.causal,
                                  out=out, lse=lse, precision=precision)
    twin_error = _relative(twin, truth)
    rounding = torch.finfo(torch.bfloat16).eps
    pv_fp8 = PRECISION_FORMATS[precision][1]
    assert _relative(out, twin) < (0.25 if pv_fp8 else 0.02) * twin_error + rounding
    assert _relative(out, truth) < 1.1 * twin_error
    # Hopper's e4m3 wgmma adds its products in fewer bits than fp32 (the twin's exact sums): on
    # the H200 23 of 8000 LSEs of gqa_permuted moved by up to 5.7e-3, the rest by under 2e-3.
    torch.testing.assert_close(lse, twin_lse, atol=1e-2, rtol=1e-4)


def test_backends_that_do_not_compute_a_precision_name_the_field():
    q, k, v = make_qkv(1, 2, 1, 128, 32)
    with pytest.raises(ValueError, match=r"config.precision='fp8'.*backends that do: hopper, triton, reference"):
        pbs.attention(q, k, v, pbs.PBSConfig(precision="fp8", backend="flex"))
    with pytest.raises(ValueError, match=r"config.precision='int8_qk'.*backends that do: hopper, triton, reference"):
        pbs.attention(q, k, v, pbs.PBSConfig(precision="int8_qk", backend="flex"))
    with pytest.raises(ValueError, match="quantizes float16 or bfloat16 inputs"):
        pbs.attention(q, k, v, pbs.PBSConfig(precision="fp8", backend="triton"))


def test_paged_keys_are_refused_by_the_fp8_kernel():
    from pbs.backends.registry import CallSpec, backend_reasons, get_backend

    spec = CallSpec(torch.device("cpu"), torch.float16, 64, 64, 128, page_size=16, precision="fp8_qk")
    assert any("not a paged cache" in r for r in backend_reasons(get_backend("triton"), spec))
    assert any("not a paged cache" in r for r in backend_reasons(get_backend("hopper"), spec))
    capturable = CallSpec(torch.device("cpu"), torch.float16, 64, 64, 128, capturable=True, precision="fp8")
    assert any("not built for the capturable path" in r for r in backend_reasons(get_backend("hopper"), capturable))
    assert not backend_reasons(get_backend("reference"), spec)


def test_auto_runs_the_reference_on_a_gpu_for_native_eager_calls_only():
    from pbs.backends.eligibility import reference_auto_reasons
    from pbs.backends.registry import CallSpec

    def spec(device, **fields):
        return CallSpec(torch.device(device), torch.bfloat16, 128, 128, 128, **fields)

    assert reference_auto_reasons(spec("cuda")) == []
    assert reference_auto_reasons(spec("cpu", precision="fp8", capturable=True)) == []
    quantized = reference_auto_reasons(spec("cuda", precision="fp8"))
    assert "precision 'fp8'" in quantized[0] and "backend='reference'" in quantized[-1]
    assert any("CUDA graph" in r for r in reference_auto_reasons(spec("cuda", capturable=True)))


def test_auto_tries_the_gluon_kernel_first_in_every_quantized_precision():
    # On an H200 the Gluon kernel is 1.02-1.06x the Triton kernel's in e4m3 and 1.02-1.14x in int8
    # from 64K on (benchmarks/results/kernel/fp8_int8_gluon_h200_aad513e.json): auto tries it first.
    from pbs.backends.registry import get_backend, list_backends

    hopper, triton_backend = get_backend("hopper"), get_backend("triton")
    assert list_backends().index("hopper") < list_backends().index("triton")
    assert hopper.not_chosen_by_auto_reasons is None
    quantized = {"fp8_qk", "fp8", "int8_qk", "int8_qk_fp8_pv"}
    assert quantized <= set(hopper.precisions) and quantized <= set(triton_backend.precisions)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernel runs on Hopper GPUs")
def test_gpu_auto_runs_every_quantized_precision_on_the_gluon_kernel():
    q, k, v = make_qkv(1, 8, 2, 1024, 128, seed=0, device="cuda")
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    for precision in ("fp8", "fp8_qk", "int8_qk", "int8_qk_fp8_pv"):
        config = pbs.PBSConfig(precision=precision, dense_fallback={"devices": ()})
        out, plan = pbs.attention(q, k, v, config, return_plan=True)
        twin = pbs.attention(q, k, v, config.model_copy(update={"backend": "reference"}))
        assert plan.backend == "hopper" and torch.isfinite(out).all()
        assert (out - twin).abs().max() < 0.1 * twin.abs().max()


@pytest.mark.gpu
def test_a_capturable_fp8_call_is_refused_before_anything_runs():
    q, k, v = (torch.randn(256, h, 128, dtype=torch.bfloat16, device="cuda") for h in (8, 2, 2))
    cu_seq = torch.tensor([0, 256], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"no backend can run this call.*not built for the capturable path.*"
                                         r"auto does not capture the reference"):
        pbs.varlen_attention(q, k, v, cu_seq, cu_seq, 256, 256, pbs.PBSConfig(precision="fp8"), capturable=True)


def test_config_precision_round_trips_and_is_checked():
    for preset, precision in (("fp8", "fp8"), ("quantized", "int8_qk_fp8_pv")):
        config = pbs.PBSConfig.from_preset(preset)
        assert config.precision == precision and config.selector == pbs.PBSConfig().selector
        assert pbs.PBSConfig.model_validate_json(config.model_dump_json()) == config
    with pytest.raises(ValueError, match="precision"):
        pbs.PBSConfig(precision="int4")


def test_plan_reports_the_precision_that_ran():
    q, k, v = make_qkv(1, 2, 1, 256, 32)
    config = pbs.PBSConfig(block_size=32, segment_size=64, precision="fp8")
    out, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan.precision == "fp8" and plan.backend == "reference"
    native = pbs.attention(q, k, v, config.model_copy(update={"precision": "native"}))
    assert 0 < _relative(out, native) < 0.5
    dense_config = pbs.PBSConfig(block_size=32, segment_size=64, precision="fp8",
                                 dense_fallback={"min_seq_len": 10_000, "devices": ["cpu"]})
    _, dense_plan = pbs.attention(q, k, v, dense_config, return_plan=True)
    assert dense_plan.ran_dense and dense_plan.precision == "native"
