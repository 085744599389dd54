"""Quantization of Q, K and V to e4m3 (and of Q and K to int8) for the quantized attention
kernel, with the scales of `pbs.reference.fp8` (its eager twin): per-block Q and smoothed-K
scales, per-channel V scales.

One program handles one block of ``block_size`` tokens of one (batch, head), held in registers:
one read for its amax, its values and its scale. V is written transposed, ``(B, Hk, Dv, N)``,
because the tensor cores take an e4m3 right-hand operand only with its reduction axis (the
tokens, for P.V) contiguous: the tile is transposed in registers, so that the stores run along
the tokens. int8's channel balance (`channel_balance`) reads Q and K once more for their
per-channel extremes, split over many programs per head.

Divisions are IEEE-rounded (``div_rn``: the GPU's default one is approximate). On the GPU the
hardware cast rounds to the nearest e4m3 value (ties to even, saturating); Triton's CPU
interpreter does not carry a mantissa that rounds up into the exponent, so there the rounding is
done in fp32 arithmetic first (`round_to_e4m3`), and the CPU tests see the GPU's numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pbs.kernels._common import COMPILE_OPTIONS, interpreting, pow2_at_least

E4M3_MAX = tl.constexpr(448.0)
INT8_MAX = tl.constexpr(127.0)


@triton.jit
def round_to_e4m3(y):
    """``y`` (float32, ``|y| <= 448`` or NaN) rounded to the nearest e4m3 value, ties to even."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    # e4m3 keeps 3 mantissa bits; below its smallest normal (2^-6) the spacing stays 2^-9.
    exponent = tl.maximum(exponent, 127 - 6)
    spacing = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
    r = tl.abs(y) * ((254 - (exponent - 3)) << 23).to(tl.float32, bitcast=True)  # / spacing, exactly
    f = tl.floor(r + 0.5)
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    f = tl.where(((f - r) == 0.5) & odd, f - 1.0, f)
    return tl.where(bits < 0, -f * spacing, f * spacing)  # the sign bit: -0.0 stays -0.0


@triton.jit
def to_e4m3(y, HARDWARE: tl.constexpr):
    """``y`` (float32) as e4m3: nearest value, ties to even, saturating at +-448 (NaN stays NaN).
    ``HARDWARE``: the GPU's cast does all of it; otherwise (the interpreter) `round_to_e4m3`."""
    if HARDWARE:
        return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return round_to_e4m3(_saturate(y)).to(tl.float8e4nv)


@triton.jit
def round_to_integer(y):
    """``y`` (float32) rounded to the nearest integer, ties to even (as ``torch.round``)."""
    f = tl.floor(y + 0.5)
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where(((f - y) == 0.5) & odd, f - 1.0, f)


@triton.jit
def _saturate(y):
    # tl.minimum would turn NaN into the bound; comparisons leave it NaN.
    y = tl.where(y > E4M3_MAX, E4M3_MAX, y)
    return tl.where(y < -E4M3_MAX, -E4M3_MAX, y)


@triton.jit
def _program_block(heads, num_blocks):
    """``(batch, head, block)`` of this program: blocks fastest, then heads, then the batch."""
    i_pid = tl.program_id(0)
    i_rest = i_pid // num_blocks
    return i_rest // heads, i_rest % heads, i_pid % num_blocks


@triton.jit
def _quantize_blocks_kernel(
    x_ptr, mean_ptr, out_ptr, scale_ptr,
    stride_xb, stride_xh, stride_xn,
    stride_ob, stride_oh, stride_on,
    stride_mb, stride_mh,
    stride_sb, stride_sh,
    shift_ptr, dot_mean_ptr, stride_db, stride_dh, group,
    factor_ptr, stride_fb, stride_fh, factor_group,
    heads, seq_len, dim, num_blocks,
    BLOCK: tl.constexpr, COLS: tl.constexpr, SUBTRACT_MEAN: tl.constexpr,
    WRITE_SHIFT: tl.constexpr, SCALE_CHANNELS: tl.constexpr, INT8: tl.constexpr, HARDWARE_CAST: tl.constexpr,
):
    i_b, i_h, i_blk = _program_block(heads, num_blocks)
    o_d = tl.arange(0, COLS)
    m_d = o_d < dim
    o_n = i_blk * BLOCK + tl.arange(0, BLOCK)
    m = (o_n < seq_len)[:, None] & m_d[None, :]
    p_x = x_ptr + i_b.to(tl.int64) * stride_xb + i_h.to(tl.int64) * stride_xh
    b_x = tl.load(p_x + o_n.to(tl.int64)[:, None] * stride_xn + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    if WRITE_SHIFT:
        # Each query row's q . mean(K) of its KV head: the smoothing's shift of its scores.
        b_dot_mean = tl.load(dot_mean_ptr + i_b.to(tl.int64) * stride_db + (i_h // group).to(tl.int64) * stride_dh
                             + o_d, mask=m_d, other=0.0)
        tl.store(shift_ptr + (i_b * heads + i_h).to(tl.int64) * seq_len + o_n,
                 tl.sum(b_x * b_dot_mean[None, :], 1), mask=o_n < seq_len)
    if SUBTRACT_MEAN:
        b_mean = tl.load(mean_ptr + i_b.to(tl.int64) * stride_mb + i_h.to(tl.int64) * stride_mh + o_d, mask=m_d,
                         other=0.0)
        b_x = tl.where(m, b_x - b_mean[None, :], 0.0)
    if SCALE_CHANNELS:
        b_factor = tl.load(factor_ptr + i_b.to(tl.int64) * stride_fb + (i_h // factor_group).to(tl.int64) * stride_fh
                           + o_d, mask=m_d, other=1.0)
        b_x = b_x * b_factor[None, :]
    poisoned = tl.max(tl.max((b_x != b_x).to(tl.int32), 1), 0)
    block_amax = tl.max(tl.max(tl.where(b_x == b_x, tl.abs(b_x), 0.0), 1), 0)
    largest = INT8_MAX if INT8 else E4M3_MAX
    scale = tl.where(block_amax > 0, tl.math.div_rn(block_amax, largest), 1.0)
    scale = tl.where(poisoned > 0, float("nan"), scale)
    tl.store(scale_ptr + i_b.to(tl.int64) * stride_sb + i_h.to(tl.int64) * stride_sh + i_blk, scale)
    b_y = tl.math.div_rn(b_x, scale)
    p_out = out_ptr + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh
    p_out = p_out + o_n.to(tl.int64)[:, None] * stride_on + o_d[None, :]
    if INT8:
        b_y = tl.where(b_y > INT8_MAX, INT8_MAX, tl.where(b_y < -INT8_MAX, -INT8_MAX, b_y))
        tl.store(p_out, round_to_integer(b_y).to(tl.int8), mask=m)
    else:
        tl.store(p_out, to_e4m3(b_y, HARDWARE_CAST), mask=m)


@triton.jit
def _channel_amax_kernel(
    x_ptr, shift_ptr, amax_ptr,
    stride_xb, stride_xh, stride_xn, stride_sb, stride_sh, stride_ab, stride_ah,
    heads, group, seq_len, dim, rows_per_program,
    ROWS: tl.constexpr, COLS: tl.constexpr, SHIFT: tl.constexpr,
):
    # One (batch, head) and one run of rows per program; the programs' maxima meet in float32
    # atomics, exact in any order (a max rounds nothing). NaN counts as inf: the factor it gives
    # is 1 either way, as the twin's NaN gives.
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // heads, i_bh % heads
    o_d = tl.arange(0, COLS)
    m_d = o_d < dim
    p_x = x_ptr + i_b.to(tl.int64) * stride_xb + i_h.to(tl.int64) * stride_xh
    if SHIFT:
        b_shift = tl.load(shift_ptr + i_b.to(tl.int64) * stride_sb + (i_h // group).to(tl.int64) * stride_sh + o_d,
                          mask=m_d, other=0.0)
    b_amax = tl.zeros([ROWS, COLS], dtype=tl.float32)  # reduced over the rows once, after the loop
    start = tl.program_id(1) * rows_per_program
    for row in range(start, tl.minimum(start + rows_per_program, seq_len), ROWS):
        o_n = row + tl.arange(0, ROWS)
        m = (o_n < seq_len)[:, None] & m_d[None, :]
        b_x = tl.load(p_x + o_n.to(tl.int64)[:, None] * stride_xn + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        if SHIFT:
            b_x = b_x - b_shift[None, :]
        b_x = tl.where(b_x == b_x, tl.abs(b_x), float("inf"))
        b_amax = tl.maximum(b_amax, tl.where(m, b_x, 0.0))
    tl.atomic_max(amax_ptr + i_b.to(tl.int64) * stride_ab + (i_h // group).to(tl.int64) * stride_ah + o_d,
                  tl.max(b_amax, 0), mask=m_d, sem="relaxed")


@triton.jit
def _balance_factors_kernel(amax_ptr, factor_ptr, pair_stride, size, COLS: tl.constexpr):
    o = tl.program_id(0) * COLS + tl.arange(0, COLS)
    m = o < size
    q_amax = tl.load(amax_ptr + o, mask=m, other=1.0)
    k_amax = tl.load(amax_ptr + pair_stride + o, mask=m, other=1.0)
    k_factor = tl.math.sqrt_rn(tl.math.div_rn(q_amax, k_amax))
    k_factor = tl.where((k_factor > 0) & (k_factor < float("inf")), k_factor, 1.0)  # NaN compares false
    tl.store(factor_ptr + o, tl.math.div_rn(tl.full([COLS], 1.0, tl.float32), k_factor), mask=m)
    tl.store(factor_ptr + pair_stride + o, k_factor, mask=m)


@triton.jit
def _quantize_values_kernel(
    v_ptr, scale_ptr, out_ptr,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_od,
    stride_sb, stride_sh,
    heads, seq_len, stored_len, dim, num_blocks,
    ROWS: tl.constexpr, COLS: tl.constexpr, WGMMA_ORDER: tl.constexpr, HARDWARE_CAST: tl.constexpr,
):
    i_b, i_h, i_blk = _program_block(heads, num_blocks)
    o_d = tl.arange(0, COLS)
    m_d = o_d < dim
    o_n = i_blk * ROWS + tl.arange(0, ROWS)
    m = (o_n < seq_len)[:, None] & m_d[None, :]
    b_scale = tl.load(scale_ptr + i_b.to(tl.int64) * stride_sb + i_h.to(tl.int64) * stride_sh + o_d, mask=m_d,
                      other=1.0)
    p_v = v_ptr + i_b.to(tl.int64) * stride_vb + i_h.to(tl.int64) * stride_vh
    b_v = tl.load(p_v + o_n.to(tl.int64)[:, None] * stride_vn + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_y = to_e4m3(tl.math.div_rn(b_v, b_scale[None, :]), HARDWARE_CAST)
    if WGMMA_ORDER:
        # Key c of each 16 (bits c3 c2 c1 c0) to position (c2 c1 c3 c0): c0 + 2 c3 + 4 c1 + 8 c2.
        b_y = b_y.reshape([ROWS // 16, 2, 2, 2, 2, COLS]).permute(0, 2, 3, 1, 4, 5).reshape([ROWS, COLS])
        # Keys past the end are zeros (loaded as 0), up to the stored length.
        m_store = (o_n < stored_len)[None, :] & m_d[:, None]
    else:
        m_store = (o_n < seq_len)[None, :] & m_d[:, None]
    p_o = out_ptr + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh
    tl.store(p_o + o_d[:, None].to(tl.int64) * stride_od + o_n[None, :], tl.trans(b_y), mask=m_store)


def _warps(tile_elements: int) -> int:
    """Warps for a program that holds a whole tile in registers: 64 float32 values per thread
    (a 128 x 128 tile on 8 warps), between 4 and 16 warps."""
    return max(4, min(16, tile_elements // (64 * 32)))


def byte_buffer(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float8_e4m3fn,
                last_multiple: int = 16) -> torch.Tensor:
    """An uninitialized one-byte-per-value (e4m3 or int8) ``shape`` view whose rows start 16-byte
    aligned (for TMA): the last dim is allocated rounded up to ``last_multiple``."""
    padded = -(-shape[-1] // last_multiple) * last_multiple
    return torch.empty(*shape[:-1], padded, dtype=dtype, device=device)[..., : shape[-1]]


def quantize_blocks(x: torch.Tensor, block_size: int, mean: torch.Tensor | None = None,
                    shift_mean: torch.Tensor | None = None, shift: torch.Tensor | None = None, fmt: str = "e4m3",
                    factor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, H, N, D)`` (any float dtype; last dim contiguous) -> ``(x8, scales)``: e4m3 (or
    ``fmt="int8"``: int8) values of ``(x - mean) * factor`` (``mean`` ``(B, H, 1, D)`` float32, or
    None; ``factor`` the ``(B, Hf, D)`` float32 channel factors of `pbs.reference.fp8.channel_balance`,
    head ``h`` taking row ``h // (H // Hf)``, or None) and ``(B, H, ceil(N / block_size))`` float32
    scales, as `pbs.reference.fp8.quantize_blocks` of the same values.

    With ``shift_mean`` (the ``(B, Hk, 1, D)`` key mean, ``H % Hk == 0``), also writes each row's
    ``x . shift_mean[head // (H // Hk)]`` into ``shift`` (contiguous ``(B, H, N)`` float32) from the
    unquantized ``x``: the smoothing's shift of a query's scores, which its LSE adds back."""
    b, h, n, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_blocks = -(-n // block_size)
    if fmt not in ("e4m3", "int8"):
        raise ValueError(f"fmt must be 'e4m3' or 'int8', got {fmt!r}")
    out = byte_buffer((b, h, n, d), x.device, torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
    scales = torch.empty(b, h, num_blocks, dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out, scales.fill_(1.0)
    mean_arg = mean if mean is not None else scales
    write_shift = shift_mean is not None
    if write_shift and (shift is None or tuple(shift.shape) != (b, h, n) or not shift.is_contiguous()
                        or shift.dtype != torch.float32):
        raise ValueError(f"shift must be a contiguous ({b}, {h}, {n}) float32 tensor when shift_mean is given")
    if factor is not None and (factor.dim() != 3 or factor.shape[0] != b or factor.shape[2] != d or h % factor.shape[1]
                               or factor.dtype != torch.float32 or factor.stride(-1) != 1):
        raise ValueError(f"factor must be a (B={b}, Hf, D={d}) float32 tensor with H={h} a multiple of Hf, got "
                         f"{tuple(factor.shape)} {factor.dtype}")
    _quantize_blocks_kernel[(b * h * num_blocks,)](
        x, mean_arg, out, scales,
        *x.stride()[:3], *out.stride()[:3],
        *((mean.stride(0), mean.stride(1)) if mean is not None else (0, 0)),
        *scales.stride()[:2],
        shift if write_shift else scales, shift_mean if write_shift else scales,
        *((shift_mean.stride(0), shift_mean.stride(1), h // shift_mean.shape[1]) if write_shift else (0, 0, 1)),
        factor if factor is not None else scales,
        *((factor.stride(0), factor.stride(1), h // factor.shape[1]) if factor is not None else (0, 0, 1)),
        h, n, d, num_blocks,
        BLOCK=block_size, COLS=pow2_at_least(d), SUBTRACT_MEAN=mean is not None,
        WRITE_SHIFT=write_shift, SCALE_CHANNELS=factor is not None, INT8=fmt == "int8", HARDWARE_CAST=not interpreting(),
        num_warps=_warps(block_size * pow2_at_least(d)),
        **COMPILE_OPTIONS,
    )
    return out, scales


def channel_balance(q: torch.Tensor, k: torch.Tensor, mean: torch.Tensor, rows: int = 64, programs: int = 1056,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`pbs.reference.fp8.channel_balance` in four launches (the twin's factors, bit for bit):
    ``q`` ``(B, Hq, Nq, D)``, ``k`` ``(B, Hk, Nk, D)``, ``mean`` its ``(B, Hk, 1, D)`` float32
    key mean -> ``(q_factor, k_factor)``, float32 ``(B, Hk, D)`` each (views of one buffer).

    Each extreme is one read of Q or K split over enough programs to fill the GPU (the twin's
    dozen small PyTorch operations cost about 0.3 ms of launches at any length)."""
    b, hq, _, d = q.shape
    hk = k.shape[1]
    amax = torch.zeros(2, b, hk, d, dtype=torch.float32, device=q.device)  # |Q| and |K - mean| per channel
    for i, (x, heads, shift) in enumerate(((q, hq, None), (k, hk, mean))):
        n = x.shape[2]
        if n == 0:
            continue  # zeros, as the twin's
        if x.stride(-1) != 1:
            x = x.contiguous()
        # About ``programs`` programs in all (eight per SM of an H100/H200: 1056 read 1.3x faster than 528 on
        # an H200), each at least one tile of rows.
        splits = max(1, min(-(-n // rows), -(-programs // (b * heads))))
        rows_per_program = -(-(-(-n // splits)) // rows) * rows
        _channel_amax_kernel[(b * heads, -(-n // rows_per_program))](
            x, shift if shift is not None else amax, amax[i],
            *x.stride()[:3], *((shift.stride(0), shift.stride(1)) if shift is not None else (0, 0)),
            *amax[i].stride()[:2], heads, heads // hk, n, d, rows_per_program,
            ROWS=rows, COLS=pow2_at_least(d), SHIFT=shift is not None,
            num_warps=_warps(rows * pow2_at_least(d)),
            **COMPILE_OPTIONS,
        )
    factors = torch.empty_like(amax)
    size = b * hk * d
    if size:
        cols = 1024
        _balance_factors_kernel[(-(-size // cols),)](amax, factors, size, size, COLS=cols, **COMPILE_OPTIONS)
    return factors[0], factors[1]


def quantize_values_transposed(v: torch.Tensor, scales: torch.Tensor, wgmma_key_order: bool = False) -> torch.Tensor:
    """``(B, Hk, N, Dv)`` and its ``(B, Hk, Dv)`` `pbs.reference.fp8.channel_scales` -> the e4m3
    values ``v / scale`` laid out ``(B, Hk, Dv, N)`` (rows 16-byte aligned).

    ``wgmma_key_order``: for the Gluon kernel, whose e4m3 weights reach the tensor cores with
    each 16 keys reordered (`pbs.kernels.hopper_attn._weights`): key ``16 g + c`` is stored at
    column ``16 g + (c0 + 2 c3 + 4 c1 + 8 c2)`` (``c``'s bits), and the result is
    ``(B, Hk, Dv, ceil(N / 16) * 16)``, the keys past ``N`` zeros."""
    b, h, n, d = v.shape
    if v.stride(-1) != 1:
        v = v.contiguous()
    stored_len = -(-n // 16) * 16 if wgmma_key_order else n
    out = byte_buffer((b, h, d, stored_len), v.device)
    if v.numel() == 0:
        return out
    rows = 128
    num_blocks = -(-n // rows)
    _quantize_values_kernel[(b * h * num_blocks,)](
        v, scales, out, *v.stride()[:3], *out.stride()[:3], *scales.stride()[:2], h, n, stored_len, d, num_blocks,
        ROWS=rows, COLS=pow2_at_least(d), WGMMA_ORDER=wgmma_key_order, HARDWARE_CAST=not interpreting(),
        num_warps=_warps(rows * pow2_at_least(d)),
        **COMPILE_OPTIONS,
    )
    return out
