"""Inline PTX of the Gluon kernel's e4m3 path (`pbs.kernels.hopper_attn` under ``precision="fp8"``).

With both products on e4m3 tensor cores, a step is paced by the softmax's exponentials: one
``MUFU.EX2`` per weight, 64 per thread and step, issued at a quarter of the FMA pipe's rate
(docs/notes.md, "Where a step's cycles go"). Three things here shorten that step:

* `exp2_mixed`: one exponential in four is computed on the FMA pipe by a cubic polynomial
  (`EXP2_POLYNOMIAL`, relative error `EXP2_RELATIVE_ERROR`, far below e4m3's 2^-4), so the
  special-function unit and the FMA pipe work side by side;
* `to_e4m3x4`: the weights stay in float32 until P V and are rounded to e4m3 once, two to an
  instruction (as the CPU twin rounds them), not through float16 first;
* `take_turn` / `pass_turn`: the two consumer warpgroups issue their products in turns (named
  barriers `TURN_BARRIERS`), so one's products do not queue behind the other's while it computes
  its exponentials; in tiles of `TURN_MIN_BLOCKS` selected blocks or more (measured faster than
  turns in every tile).

`exp2_polynomial_reference` replays the polynomial in float32 with torch, for the CPU test that
holds it to its stated error.
"""

from __future__ import annotations

import struct

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# 2^f on f in [-1/2, 1/2]: coefficients from the constant term up, fitted for the least largest
# relative error (Lawson's iteration on 20001 points).
EXP2_POLYNOMIAL = (0.99992809, 0.69326099, 0.24261081, 0.05517144)
EXP2_RELATIVE_ERROR = 7.5e-5  # the polynomial's largest relative error, replayed in float32
# Adding 1.5 * 2^23 to a float32 below 2^22 in magnitude rounds it to an integer j, which lands in
# the sum's low mantissa bits: the sum's bits shifted left by 23 are j's exponent field.
EXP2_ROUNDING_SHIFT = 12582912.0
# Inputs are raised to this first: j = -127 gives the exponent field 0, so -inf (a masked key)
# comes out as 0 exactly; `max.NaN` keeps NaN, and the final multiply carries it out.
EXP2_LOWEST = -127.0
# Named barrier ids of the warpgroups' turns (ids 0-2 are taken by the compiler's own barriers).
TURN_BARRIERS = (14, 15)
# Tiles of fewer selected blocks issue without turns: 0.978-0.994x the time of turns in every
# tile, bit-identical (benchmarks/results/kernel/h200_ab_fp8_turns_from_16.json, 16K-128K).
TURN_MIN_BLOCKS = gl.constexpr(16)


def _ptx_f32(value: float) -> str:
    """``value`` rounded to float32, as a PTX float32 literal (``0fXXXXXXXX``)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


def _exp2_mixed_asm(polynomial_lanes: int = 1) -> str:
    """PTX for four exponentials ($4-$7 -> $0-$3), the last ``polynomial_lanes`` by the polynomial."""
    c0, c1, c2, c3 = (_ptx_f32(c) for c in EXP2_POLYNOMIAL)
    shift = _ptx_f32(EXP2_ROUNDING_SHIFT)
    lanes = []
    for lane in range(4):
        out, x = f"${lane}", f"${lane + 4}"
        if lane < 4 - polynomial_lanes:
            lanes.append(f"ex2.approx.ftz.f32 {out}, {x}; ")
            continue
        lanes.append(
            f"max.NaN.f32 x, {x}, {_ptx_f32(EXP2_LOWEST)}; "
            f"add.rn.f32 t, x, {shift}; sub.rn.f32 j, t, {shift}; sub.rn.f32 f, x, j; "
            f"fma.rn.f32 p, f, {c3}, {c2}; fma.rn.f32 p, p, f, {c1}; fma.rn.f32 p, p, f, {c0}; "
            "mov.b32 e, t; add.s32 e, e, 127; shl.b32 e, e, 23; mov.b32 s, e; "
            f"mul.rn.f32 {out}, p, s; ")
    return "{ .reg .f32 x, t, j, f, p, s; .reg .b32 e; " + "".join(lanes) + "}"


_EXP2_MIXED = gl.constexpr(_exp2_mixed_asm())


def _turn_asm(op: str, barrier: int) -> gl.constexpr:
    """One thread's ``bar.sync``/``bar.arrive`` over both warpgroups' 256 threads, copying its
    two-register token through (the token only gives the instruction operands)."""
    return gl.constexpr(f"bar.{op} {barrier}, 256; mov.b32 $0, $2; mov.b32 $1, $3;")


# Warpgroup w waits on barrier TURN_BARRIERS[w] and arrives on the other's.
_TAKE_TURN_0 = _turn_asm("sync", TURN_BARRIERS[0])
_TAKE_TURN_1 = _turn_asm("sync", TURN_BARRIERS[1])
_PASS_TURN_0 = _turn_asm("arrive", TURN_BARRIERS[1])
_PASS_TURN_1 = _turn_asm("arrive", TURN_BARRIERS[0])


def exp2_polynomial_reference(x: torch.Tensor) -> torch.Tensor:
    """What `exp2_mixed`'s polynomial lane computes, step for step in float32 (any shape)."""
    x = x.float()
    shift = torch.tensor(EXP2_ROUNDING_SHIFT, dtype=torch.float32)
    x = torch.where(torch.isnan(x), x, x.clamp_min(EXP2_LOWEST))
    t = x + shift
    j = t - shift
    f = x - j
    c0, c1, c2, c3 = (torch.tensor(c, dtype=torch.float32) for c in EXP2_POLYNOMIAL)
    p = (c3 * f + c2) * f + c1
    p = p * f + c0
    # The PTX's 32-bit add and shift, wrapping as the GPU's do.
    bits = (((t.view(torch.int32).long() + 127) << 23) & 0xFFFFFFFF)
    exponent = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    return p * exponent


@gluon.jit
def exp2_mixed(x):
    """``2 ** x`` elementwise (float32, any layout): three in four by ``ex2.approx`` (``MUFU.EX2``),
    the fourth by `EXP2_POLYNOMIAL` on the FMA pipe; -inf gives 0 and NaN stays NaN."""
    return gl.inline_asm_elementwise(_EXP2_MIXED, "=r,=r,=r,=r,r,r,r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=4)


@gluon.jit
def to_e4m3x4(p):
    """float32 weights rounded to e4m3 (to nearest even, saturating), four to a register: the
    operand of an e4m3 wgmma. ``cvt...e4m3x2.f32 d, a, b`` puts ``a`` in the upper byte."""
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r", [p], dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def take_turn(token, WG: gl.constexpr):
    """Consumer warpgroup ``WG`` waits until the other has issued its products (`pass_turn`).
    ``token``: a per-row tensor of two elements per thread (one barrier per thread), returned."""
    if WG == 0:
        token = gl.inline_asm_elementwise(_TAKE_TURN_0, "=r,=r,r,r", [token], dtype=gl.int32, is_pure=False, pack=2)
    else:
        token = gl.inline_asm_elementwise(_TAKE_TURN_1, "=r,=r,r,r", [token], dtype=gl.int32, is_pure=False, pack=2)
    return token


@gluon.jit
def pass_turn(token, WG: gl.constexpr):
    """Consumer warpgroup ``WG`` has issued its products: the other's turn (`take_turn`)."""
    if WG == 0:
        token = gl.inline_asm_elementwise(_PASS_TURN_0, "=r,=r,r,r", [token], dtype=gl.int32, is_pure=False, pack=2)
    else:
        token = gl.inline_asm_elementwise(_PASS_TURN_1, "=r,=r,r,r", [token], dtype=gl.int32, is_pure=False, pack=2)
    return token
