"""The inline PTX of the Gluon kernel's e4m3 path (:mod:`pbs.kernels.hopper_e4m3`).

The GPU tests hold the kernel's output to its CPU twin; these hold the polynomial exponential to
its stated error on the CPU: once through the float32 replay, and once by executing the PTX
string the kernel compiles (the polynomial lane, instruction by instruction), so that the
constants in the assembly and the ones the replay and the docs quote cannot drift apart.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from pbs.kernels import hopper_e4m3
from pbs.kernels.hopper_e4m3 import EXP2_RELATIVE_ERROR, exp2_polynomial_reference


def _run_polynomial_lane(x: np.ndarray) -> np.ndarray:
    """Executes the PTX of `exp2_mixed` for its fourth lane ($7 -> $3) on float32 inputs.

    Registers hold 32-bit patterns. Only the instructions the string holds are known (an unknown
    one fails the test). Float operations are computed in float64 and rounded once to float32:
    exact for these float32 operands (the fma's product has 48 bits)."""
    asm = hopper_e4m3._EXP2_MIXED.value
    regs = {"$7": x.astype(np.float32).view(np.uint32)}

    def bits(operand: str) -> np.ndarray:
        if operand.startswith("0f"):
            return np.full(x.shape, int(operand[2:], 16), dtype=np.uint32)
        return regs[operand]

    def floats(operand: str) -> np.ndarray:
        return bits(operand).view(np.float32).astype(np.float64)

    body = asm.strip().removeprefix("{").removesuffix("}")
    for statement in (s.strip() for s in body.split(";")):
        if not statement or statement.startswith(".reg"):
            continue
        opcode, operands = statement.split(None, 1)
        dst, *src = (o.strip() for o in operands.split(","))
        if opcode == "ex2.approx.ftz.f32":
            continue  # the MUFU lanes
        with np.errstate(invalid="ignore", over="ignore"):
            if opcode == "max.NaN.f32":
                a, b = floats(src[0]), floats(src[1])
                out = np.where(np.isnan(a) | np.isnan(b), np.nan, np.maximum(a, b))
            elif opcode in ("add.rn.f32", "sub.rn.f32", "mul.rn.f32"):
                a, b = floats(src[0]), floats(src[1])
                out = {"add": a + b, "sub": a - b, "mul": a * b}[opcode[:3]]
            elif opcode == "fma.rn.f32":
                out = floats(src[0]) * floats(src[1]) + floats(src[2])
            elif opcode == "mov.b32":
                regs[dst] = bits(src[0])
                continue
            elif opcode in ("add.s32", "shl.b32"):
                wide = bits(src[0]).astype(np.int64)
                wide = wide + int(src[1]) if opcode == "add.s32" else wide << int(src[1])
                regs[dst] = (wide & 0xFFFFFFFF).astype(np.uint32)
                continue
            else:
                raise AssertionError(f"the replay does not know {opcode!r}")
        regs[dst] = out.astype(np.float32).view(np.uint32)
    return regs["$3"].view(np.float32)


def _relative_error(approx: np.ndarray, x: np.ndarray) -> float:
    truth = np.exp2(x.astype(np.float64))
    return float(np.max(np.abs(approx.astype(np.float64) / truth - 1.0)))


# Scores minus the row max, times log2(e), plus the 448 gain: weights run from 2^8.8 down to the
# smallest e4m3 can hold (2^-9) and below, where both give a weight e4m3 rounds to 0.
_RANGE = np.linspace(-126.0, 8.81, 400_001, dtype=np.float32)


def test_the_e4m3_kernels_polynomial_exp2_is_within_its_stated_error():
    replay = exp2_polynomial_reference(torch.from_numpy(_RANGE)).numpy()
    assert _relative_error(replay, _RANGE) <= EXP2_RELATIVE_ERROR
    # Well inside e4m3's own rounding (3 mantissa bits: up to 2^-4 relative).
    assert EXP2_RELATIVE_ERROR < 2.0**-4 / 100


def test_the_ptx_the_kernel_compiles_is_the_replayed_polynomial():
    lane = _run_polynomial_lane(_RANGE)
    assert _relative_error(lane, _RANGE) <= EXP2_RELATIVE_ERROR
    replay = exp2_polynomial_reference(torch.from_numpy(_RANGE)).numpy()
    np.testing.assert_allclose(lane, replay, rtol=2e-7, atol=0)


@pytest.mark.parametrize("run", ["replay", "ptx"])
def test_masked_keys_give_zero_and_nan_stays_nan(run):
    x = np.array([-np.inf, np.nan, -127.0, -126.6, -1000.0, 0.0], dtype=np.float32)
    out = (exp2_polynomial_reference(torch.from_numpy(x)).numpy() if run == "replay" else _run_polynomial_lane(x))
    assert out[0] == 0.0 and np.isnan(out[1])
    assert out[2] == 0.0 and out[3] == 0.0 and out[4] == 0.0  # below 2^-126.5: 0, as e4m3 rounds it
    assert abs(out[5] - 1.0) <= EXP2_RELATIVE_ERROR


def test_the_polynomial_takes_one_lane_in_four_and_the_turns_pair_up():
    asm = hopper_e4m3._EXP2_MIXED.value
    assert re.findall(r"ex2\.approx\.ftz\.f32 (\$\d)", asm) == ["$0", "$1", "$2"]
    first, second = hopper_e4m3.TURN_BARRIERS
    # Warpgroup 0 waits on the first barrier and arrives on the second; warpgroup 1 the other way.
    assert hopper_e4m3._TAKE_TURN_0.value.startswith(f"bar.sync {first}, 256;")
    assert hopper_e4m3._PASS_TURN_0.value.startswith(f"bar.arrive {second}, 256;")
    assert hopper_e4m3._TAKE_TURN_1.value.startswith(f"bar.sync {second}, 256;")
    assert hopper_e4m3._PASS_TURN_1.value.startswith(f"bar.arrive {first}, 256;")
