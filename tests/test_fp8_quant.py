"""The e4m3 quantization kernels (`pbs.kernels.fp8_quant`) against their twin (`pbs.reference.fp8`):
bit for bit, on CPU in the interpreter and on the GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pbs.kernels import fp8_quant as kernel
from pbs.reference import fp8 as twin

pytestmark = pytest.mark.usefixtures("checked_addresses")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, kernel.round_to_e4m3(x).to(tl.float8e4nv), mask=offsets < n)


def test_rounding_matches_torchs_cast_at_every_spacing_and_tie():
    # Every e4m3 value, the midpoints between neighbours (ties), and points just either side of
    # them, positive and negative, subnormals included: torch's cast rounds to nearest, ties to even.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().unique()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids * (1 + 2**-12), mids * (1 - 2**-12), torch.rand(4096) * 448])
    values = torch.cat([values, -values]).to(DEVICE)
    out = torch.empty(values.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    _round_kernel[(triton.cdiv(values.numel(), 1024),)](values, out, values.numel(), BLOCK=1024)
    expected = values.to(torch.float8_e4m3fn)
    # Compared as values: the GPU's cast writes -0.0 as +0.0, which computes the same.
    assert torch.equal(out.float(), expected.float())


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, HARDWARE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, kernel.to_e4m3(x, HARDWARE), mask=offsets < n)


def test_the_cast_the_kernels_use_rounds_and_saturates_as_the_twin():
    # On the GPU the hardware cast (rtne, satfinite), in the interpreter the fp32 rounding: both
    # must give the twin's values, past 448 and at infinities included. (A NaN's value does not
    # matter: it makes its block's scale NaN, which restores it.)
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().unique()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids * (1 + 2**-12), mids * (1 - 2**-12), torch.rand(4096) * 600,
                        torch.tensor([464.0, 480.0, 1e6, float("inf")])])
    values = torch.cat([values, -values]).to(DEVICE)
    out = torch.empty(values.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    _cast_kernel[(triton.cdiv(values.numel(), 1024),)](values, out, values.numel(), BLOCK=1024,
                                                        HARDWARE=DEVICE == "cuda")
    assert torch.equal(out.float(), twin.to_e4m3(values).float())


def _inputs(dtype: torch.dtype, n: int = 200, d: int = 72) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, n, d, generator=gen) * torch.rand(2, 3, n, 1, generator=gen) * 5
    x[0, 0, 5:37] = 0  # zeros inside a block
    x[1, 1, :64] = 0  # a whole block of zeros: scale 1
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("smoothed", [False, True])
def test_block_quantization_equals_the_twin(dtype, smoothed):
    x = _inputs(dtype)
    mean = twin.key_means(x) if smoothed else None
    x8, scales = kernel.quantize_blocks(x, 64, mean)
    expected8, expected_scales = twin.quantize_blocks(x.float() - (mean if smoothed else 0), 64)
    assert scales.shape == (2, 3, 4)  # 200 tokens: three blocks of 64 and a partial one
    assert smoothed or scales[1, 1, 0] == 1.0
    assert torch.equal(scales, expected_scales)
    # Both divide IEEE-rounded (the twin by tensors: PyTorch's CUDA division by a Python scalar is
    # a reciprocal's product) and round to nearest even: the same bits on CPU and GPU.
    assert torch.equal(x8.float(), expected8.float())


def test_a_nan_poisons_its_block_only():
    x = _inputs(torch.float16)
    x[0, 2, 70, 3] = float("nan")
    x8, scales = kernel.quantize_blocks(x, 64)
    restored = twin.dequantize_blocks(x8, scales, 64)
    assert scales[0, 2, 1].isnan() and restored[0, 2, 64:128].isnan().all()
    assert not restored[0, 2, :64].isnan().any() and not restored[0, 2, 128:].isnan().any()
    _, expected_scales = twin.quantize_blocks(x, 64)
    assert expected_scales[0, 2, 1].isnan()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_values_quantized_transposed_equal_the_twin(dtype):
    v = _inputs(dtype, n=150, d=64)
    scales = twin.channel_scales(v)
    vt = kernel.quantize_values_transposed(v, scales)
    assert vt.shape == (2, 3, 64, 150) and vt.stride(-2) % 16 == 0  # rows 16-byte aligned for TMA
    expected = twin.to_e4m3(v.float() / scales[:, :, None, :])
    assert torch.equal(vt.transpose(-1, -2).float(), expected.float())


def test_values_in_wgmma_key_order_are_each_16_keys_reordered_with_zeros_past_the_end():
    v = _inputs(torch.float16, n=150, d=64)
    scales = twin.channel_scales(v)
    natural = kernel.quantize_values_transposed(v, scales)
    reordered = kernel.quantize_values_transposed(v, scales, wgmma_key_order=True)
    assert reordered.shape == (2, 3, 64, 160) and reordered.stride(-2) % 16 == 0
    # Key 16 g + c at column 16 g + (c0, c3, c1, c2) in c's bits: the thread that holds score
    # columns {2t, 2t+1, 2t+8, 2t+9} holds operand positions {4t, ..., 4t+3}.
    column_of_key = [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
    keys = torch.arange(160)
    columns = keys - keys % 16 + torch.tensor(column_of_key)[keys % 16]
    assert sorted(columns.tolist()) == list(range(160))
    assert torch.equal(reordered[..., columns[:150]].float(), natural.float())
    assert torch.equal(reordered[..., columns[150:]].float(), torch.zeros(2, 3, 64, 10, device=DEVICE))


def test_empty_inputs_give_empty_values_and_unit_scales():
    x = torch.zeros(1, 2, 0, 64, dtype=torch.float16, device=DEVICE)
    x8, scales = kernel.quantize_blocks(x, 64)
    assert x8.shape == (1, 2, 0, 64) and scales.shape == (1, 2, 0)


def test_query_pass_writes_each_rows_shift_from_the_unquantized_queries():
    q = _inputs(torch.float16, n=150, d=64)  # 3 query heads over one KV head
    k = _inputs(torch.float16, n=90, d=64)[:, :1] + 2.0
    mean = twin.key_means(k)
    shift = torch.empty(2, 3, 150, dtype=torch.float32, device=DEVICE)
    kernel.quantize_blocks(q, 64, shift_mean=mean, shift=shift)
    expected = torch.einsum("bhnd,bd->bhn", q.float(), mean[:, 0, 0])
    torch.testing.assert_close(shift, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("smoothed", [False, True])
def test_int8_block_quantization_equals_the_twin(smoothed):
    x = _inputs(torch.bfloat16)
    mean = twin.key_means(x) if smoothed else None
    x8, scales = kernel.quantize_blocks(x, 64, mean, fmt="int8")
    expected8, expected_scales = twin.quantize_blocks(x.float() - (mean if smoothed else 0), 64, "int8")
    assert x8.dtype == torch.int8 and x8.abs().max() == 127
    assert torch.equal(scales, expected_scales) and torch.equal(x8, expected8)


def test_int8_block_quantization_with_channel_factors_equals_the_twin():
    # The balance of pbs.reference.fp8.channel_balance, applied in the same pass: K's factors per
    # KV head after its mean, Q's per query head from its KV head's row (3 query heads over 1 here).
    q = _inputs(torch.bfloat16)[:1]
    k = _inputs(torch.bfloat16, n=150)[1:, :1]
    mean = twin.key_means(k)
    q_factor, k_factor = twin.channel_balance(q, k, mean)
    assert q_factor.shape == k_factor.shape == (1, 1, 72) and not torch.equal(k_factor, torch.ones_like(k_factor))
    q8, q_scales = kernel.quantize_blocks(q, 64, fmt="int8", factor=q_factor)
    k8, k_scales = kernel.quantize_blocks(k, 64, mean, fmt="int8", factor=k_factor)
    expected_q8, expected_q_scales = twin.quantize_blocks(q.float() * q_factor[:, :, None, :], 64, "int8")
    expected_k8, expected_k_scales = twin.quantize_blocks((k.float() - mean) * k_factor[:, :, None, :], 64, "int8")
    assert torch.equal(q8, expected_q8) and torch.equal(q_scales, expected_q_scales)
    assert torch.equal(k8, expected_k8) and torch.equal(k_scales, expected_k_scales)
    with pytest.raises(ValueError, match="factor must be a"):
        kernel.quantize_blocks(q, 64, fmt="int8", factor=q_factor[:, :, :8])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_channel_balance_kernel_gives_the_twins_factors(dtype):
    # GQA (4 query heads over 2 KV heads), lengths that split over many programs with a partial
    # last tile, a channel all zeros (factor 1), a NaN in a query and an inf in a key (their
    # channels' factors 1 on both sides), one channel large only in Q, another only in K.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1000, 72, generator=gen)
    k = torch.randn(2, 2, 777, 72, generator=gen) + 0.5
    q[..., 1] *= 30.0
    k[..., 2] *= 30.0
    q[..., 3] = 0.0
    k[..., 4] = 0.0
    q[1, 3, 500, 5] = float("nan")
    k[0, 1, 10, 6] = float("inf")
    q, k = q.to(dtype).to(DEVICE), k.to(dtype).to(DEVICE)
    mean = twin.key_means(k)
    q_factor, k_factor = kernel.channel_balance(q, k, mean)
    expected_q, expected_k = twin.channel_balance(q, k, mean)
    assert q_factor.shape == k_factor.shape == (2, 2, 72)
    assert torch.equal(q_factor, expected_q) and torch.equal(k_factor, expected_k)
    assert k_factor[0, 0, 1] > 2 and k_factor[0, 0, 2] < 0.5  # the test's channels do get balanced
    assert (k_factor[:, :, [3, 4]] == 1).all() and k_factor[1, 1, 5] == 1 and k_factor[0, 1, 6] == 1
    # No rows on one side: the twin's zeros, factor 1 everywhere.
    empty_q, empty_k = kernel.channel_balance(q[:, :, :0], k, mean)
    assert torch.equal(empty_k, torch.ones_like(empty_k)) and torch.equal(empty_q, empty_k)


def test_integer_rounding_takes_ties_to_even():
    values = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4999, 126.5, -126.5], device=DEVICE)
    out = torch.empty(values.shape, dtype=torch.int8, device=DEVICE)
    _round_integer_kernel[(1,)](values, out, values.numel(), BLOCK=16)
    assert out.tolist() == values.round().to(torch.int8).tolist() == [0, 2, 2, 0, -2, -2, 2, 126, -126]


@triton.jit
def _round_integer_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, kernel.round_to_integer(x).to(tl.int8), mask=offsets < n)
