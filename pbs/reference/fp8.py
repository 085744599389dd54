"""FP8 (e4m3) compute for the selected blocks, fake-quantized in PyTorch: the FP8 kernel's eager twin.

The scales are the contract the FP8 kernel (`pbs.kernels.fp8_quant` and the ``FP8`` paths of
`pbs.kernels.block_sparse_attn`) is held to:

* **Q**: one scale per (batch, query head, query block of ``block_size`` slots), ``amax / 448``
  over the block's rows and channels (448 is e4m3's largest finite value);
* **K**: first *smoothed*, its mean over the tokens subtracted per (batch, KV head, channel).
  Every score of a query then moves by the same ``q . mean``, which the softmax cancels, while the
  channels that carry a large common offset (frequent in real models' keys) stop spending e4m3's
  range on it. Then one scale per (batch, KV head, key block), like Q;
* **int8 channel balance** (``int8_qk``, ``int8_qk_fp8_pv``): before their block scales, each
  channel ``d`` of smoothed K is multiplied by ``c_d`` and of Q by ``1 / c_d``, per (batch, KV
  head), with ``c_d = sqrt(amax_q[d] / amax_k[d])`` over the tokens (and the KV head's query heads):
  ``q . k`` keeps its value, and both sides' channels get the same range (SmoothQuant's
  migration between the operands of a product). int8's 127 even steps otherwise go to the few
  channels with the largest values, and the rest lose their bits (`channel_balance`);
* **P** (``precision="fp8"`` only): the unnormalized probabilities ``exp(s - max)`` lie in
  ``[0, 1]`` and are quantized with the fixed scale ``1 / 448``; the row sums stay in fp32;
* **V** (``precision="fp8"`` only): one scale per (batch, KV head, channel), ``amax / 448`` over
  the tokens, since P.V sums over tokens and a per-channel scale factors out of that sum.

A block whose amax is 0 gets the scale 1 (nothing to divide). Values are rounded to the nearest
e4m3 value (ties to even), and clamped to +-448 first, where a quotient rounds a hair past it.

Cost model of the quantization the kernel path runs before attention: one read of K for its mean,
then one pass that reads Q, K and V and writes them in e4m3 (half the bytes of bf16), plus scale
vectors of ``N / block_size`` floats per head; the attention then reads half the K/V bytes.

The log-sum-exp is of the scores the model would see, so the smoothing's row shift
``scale * q . mean`` is added back, computed from the unquantized ``q`` (the kernel writes it in
the pass that quantizes Q).

NaN spreads further than in native precision, which keeps it to the rows that attend to it: a NaN
in a block of Q makes that block's scale, and so the block, NaN; a NaN or inf key makes its KV
head's mean, and so every score of the head, NaN; a NaN in V makes its channel NaN in every row
of the head (``precision="fp8"``).
"""

from __future__ import annotations

from typing import Literal

import torch

from pbs.reference.block_sparse_attn import block_sparse_attention_reference
from pbs.types import PRECISION_FORMATS, BlockMask

E4M3_MAX = 448.0
"""The largest finite ``torch.float8_e4m3fn`` value."""

INT8_MAX = 127.0
"""The largest magnitude of the symmetric int8 grid Q and K use under the ``int8_qk`` precisions."""

Precision = Literal["native", "fp8_qk", "fp8", "int8_qk", "int8_qk_fp8_pv"]




def block_scales(x: torch.Tensor, block_size: int, fmt: str = "e4m3") -> torch.Tensor:
    """Per-block scales along the token axis.

    Args:
        x: ``(B, H, N, D)``.
        block_size: tokens per block; a last, partial block covers the remaining tokens.
        fmt: ``"e4m3"`` (scale ``amax / 448``) or ``"int8"`` (``amax / 127``).

    Returns:
        ``(B, H, ceil(N / block_size))`` float32: ``amax / 448`` (or ``/ 127``) of each block, 1
        where it is 0, NaN where the block holds a NaN.
    """
    b, h, n, d = x.shape
    blocks = -(-n // block_size)
    padded = torch.zeros(b, h, blocks * block_size, d, dtype=torch.float32, device=x.device)
    padded[:, :, :n] = x.float().abs()
    amax = padded.view(b, h, blocks, block_size * d).amax(-1)
    return _scale_of(amax, INT8_MAX if fmt == "int8" else E4M3_MAX)


def channel_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-channel e4m3 scales over the tokens: ``(B, H, N, D)`` -> ``(B, H, D)`` float32 (NaN for
    a channel that holds a NaN)."""
    if x.shape[-2] == 0:
        return torch.ones(x.shape[:2] + x.shape[-1:], dtype=torch.float32, device=x.device)
    return _scale_of(torch.linalg.vector_norm(x, ord=float("inf"), dim=-2, dtype=torch.float32))


def _scale_of(amax: torch.Tensor, largest: float = E4M3_MAX) -> torch.Tensor:
    # amax > 0 is false for NaN, which must stay NaN: it marks the block or channel as poisoned.
    # A tensor divisor: PyTorch's CUDA division by a Python scalar multiplies by its reciprocal,
    # one ulp off the IEEE quotient the kernel computes, and on peaked attention one ulp of a scale
    # moves values across e4m3 rounding boundaries.
    quotient = amax / torch.full_like(amax, largest)
    return torch.where((amax > 0) | amax.isnan(), quotient, torch.ones_like(amax))


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any float dtype, already divided by its scale) rounded to e4m3 values: float8_e4m3fn."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def to_int8(x: torch.Tensor) -> torch.Tensor:
    """``x`` (already divided by its scale) rounded to the nearest integer (ties to even) in
    [-127, 127]: int8. NaN gives an arbitrary integer (its block's NaN scale restores the NaN)."""
    return x.float().clamp(-INT8_MAX, INT8_MAX).round().to(torch.int8)


def quantize_blocks(x: torch.Tensor, block_size: int, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, H, N, D)`` -> ``(x8, scales)``: e4m3 (or ``fmt="int8"``: int8) values and the
    `block_scales` that restore them (``x ~ x8 * scales`` per block)."""
    scales = block_scales(x, block_size, fmt)
    per_token = scales.repeat_interleave(block_size, dim=2)[:, :, : x.shape[2], None]
    quotient = x.float() / per_token
    return (to_int8(quotient) if fmt == "int8" else to_e4m3(quotient)), scales


def dequantize_blocks(x8: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """The float32 values ``x8 * scale`` of `quantize_blocks`' output."""
    per_token = scales.repeat_interleave(block_size, dim=2)[:, :, : x8.shape[2], None]
    return x8.float() * per_token


def key_means(k: torch.Tensor) -> torch.Tensor:
    """The smoothing offset: ``(B, Hk, N, D)`` -> ``(B, Hk, 1, D)`` float32 mean over the tokens."""
    if k.shape[2] == 0:
        return k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3], dtype=torch.float32)
    return k.mean(dim=2, keepdim=True, dtype=torch.float32)


BALANCED_FORMATS = ("int8",)
"""The formats of Q and K whose channels are balanced first (`channel_balance`)."""


def channel_balance(q: torch.Tensor, k: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The channel factors of int8 Q and smoothed K: ``q * q_factor`` and ``(k - mean) * k_factor``
    have the same largest magnitude per channel (the square root of the two), and their dot
    products are ``q . (k - mean)`` (up to one rounding of ``q_factor = 1 / k_factor``).

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hk, Nk, D)``; mean: its `key_means`, ``(B, Hk, 1, D)`` float32.

    Returns:
        ``(q_factor, k_factor)``: float32 ``(B, Hk, D)`` each, 1 for a channel that is all zeros,
        or not finite, on either side (NaN and inf spread as without the balance).
    """
    b, hq, _, d = q.shape
    hk = k.shape[1]
    # Extremes in the inputs' own dtype (no float32 copy of Q or K; exact once converted).
    q_amax = torch.zeros(b, hk, d, dtype=torch.float32, device=q.device)
    if q.shape[2]:
        q_low, q_high = torch.aminmax(q, dim=2)
        q_amax = torch.maximum(q_high.float(), -q_low.float()).view(b, hk, hq // hk, d).amax(2)
    k_amax = torch.zeros_like(q_amax)
    if k.shape[2]:
        k_low, k_high = torch.aminmax(k, dim=2)
        # max |k - mean| as the pass computes it: rounding is monotonic, so it is one of the extremes'.
        k_amax = torch.maximum(k_high.float() - mean[:, :, 0], mean[:, :, 0] - k_low.float())
    # PyTorch's float32 sqrt on the CPU is not correctly rounded (about 15% of values 1 ulp off);
    # through float64 it is, as the kernels' sqrt_rn.
    k_factor = torch.sqrt((q_amax / k_amax).double()).float()
    k_factor = torch.where(torch.isfinite(k_factor) & (k_factor > 0), k_factor, torch.ones_like(k_factor))
    return 1.0 / k_factor, k_factor


def smoothed_inputs(q: torch.Tensor, k: torch.Tensor, mean: torch.Tensor, balanced: bool,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the block scales quantize: float32 ``q`` and ``k - mean`` (``mean`` its `key_means`),
    each channel times its `channel_balance` factor where ``balanced`` (query head ``h`` taking its
    KV head's row). Shapes as ``q`` ``(B, Hq, Nq, D)`` and ``k`` ``(B, Hk, Nk, D)``."""
    q_in, k_in = q.float(), k.float() - mean
    if balanced:
        q_factor, k_factor = channel_balance(q, k, mean)
        q_in = q_in * q_factor.repeat_interleave(q.shape[1] // k.shape[1], dim=1)[:, :, None, :]
        k_in = k_in * k_factor[:, :, None, :]
    return q_in, k_in


def fake_quantize_qk(q: torch.Tensor, k: torch.Tensor, block_size: int, fmt: str = "e4m3",
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q and smoothed K as the quantized kernel computes with them (``fmt`` ``"e4m3"`` or ``"int8"``).

    Returns:
        ``(q_hat, k_hat, mean)``: float32 ``(B, Hq, Nq, D)`` and ``(B, Hk, Nk, D)`` quantized values
        times their block scales, and the ``(B, Hk, 1, D)`` key mean. ``q_hat . k_hat``
        approximates ``q . (k - mean)``: in e4m3 ``q_hat`` approximates ``q`` and ``k_hat``
        ``k - mean``; in int8 they approximate the balanced ``q * q_factor`` and
        ``(k - mean) * k_factor`` (`channel_balance`).
    """
    mean = key_means(k)
    q_in, k_in = smoothed_inputs(q, k, mean, fmt in BALANCED_FORMATS)
    q8, q_scales = quantize_blocks(q_in, block_size, fmt)
    k8, k_scales = quantize_blocks(k_in, block_size, fmt)
    return dequantize_blocks(q8, q_scales, block_size), dequantize_blocks(k8, k_scales, block_size), mean


def fake_quantize_values(v: torch.Tensor) -> torch.Tensor:
    """V as the FP8 P.V product reads it: e4m3 with per-channel scales, as float32."""
    scales = channel_scales(v)[:, :, None, :]
    return to_e4m3(v.float() / scales).float() * scales


def fake_quantize_probs(probs: torch.Tensor) -> torch.Tensor:
    """Softmax rows ``(..., N)`` with their unnormalized weights ``exp(s - max)`` quantized with
    the fixed scale 1/448 (the normalizer stays exact, as the kernel keeps it in fp32).

    A softmax row's largest entry is ``1 / l``, so ``probs / max`` is ``exp(s - max)`` in [0, 1].
    """
    row_max = probs.amax(-1, keepdim=True)
    row_max = torch.where(row_max > 0, row_max, torch.ones_like(row_max))
    weights = probs / row_max
    return to_e4m3(weights * E4M3_MAX).float() / E4M3_MAX * row_max


def fp8_block_sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
    precision: Precision = "fp8",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`pbs.reference.block_sparse_attention_reference` with the FP8 kernel's quantization.

    Args:
        q, k, v, mask, query_positions, key_positions, scale, causal, return_lse: as
            `block_sparse_attention_reference` (``q`` ``(B, Hq, Nq, D)``, ``k`` ``(B, Hk, Nk, D)``,
            ``v`` ``(B, Hk, Nk, Dv)``, in permuted order).
        precision: ``"fp8_qk"``: Q and smoothed K in e4m3, P.V in float32; ``"fp8"``: P and V in
            e4m3 too; ``"int8_qk"`` / ``"int8_qk_fp8_pv"``: Q and smoothed K in int8 (scales
            ``amax / 127``), P.V in float32 / e4m3; ``"native"``: no quantization (the plain
            reference).

    Returns:
        ``(B, Hq, Nq, Dv)`` float32 (and the ``(B, Hq, Nq)`` LSE with ``return_lse``).
    """
    if precision not in PRECISION_FORMATS:
        raise ValueError(f"precision must be one of {list(PRECISION_FORMATS)}, got {precision!r}")
    qk_format, pv_fp8 = PRECISION_FORMATS[precision]
    if qk_format is None:
        return block_sparse_attention_reference(q, k, v, mask, query_positions, key_positions, scale, causal,
                                                return_lse)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    block_size = mask.layout.block_size
    q_hat, k_hat, mean = fake_quantize_qk(q, k, block_size, qk_format)
    v_used = fake_quantize_values(v) if pv_fp8 else v
    result = block_sparse_attention_reference(
        q_hat, k_hat, v_used, mask, query_positions, key_positions, scale, causal, return_lse,
        probs_transform=fake_quantize_probs if pv_fp8 else None,
    )
    if not return_lse:
        return result
    out, lse = result
    b, hq, nq, d = q.shape
    hk = k.shape[1]
    # The smoothing moved every score of a row by scale * q . mean; the LSE is of the unshifted
    # scores, with the shift from the unquantized q (ranks with other keys, hence other means,
    # merge their LSEs: an error in it would weigh their partial results wrongly).
    shift = torch.einsum("bhgnd,bhd->bhgn", q.float().view(b, hk, hq // hk, nq, d), mean[:, :, 0]).reshape(b, hq, nq)
    return out, lse + scale * shift
