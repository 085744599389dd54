"""The kernels' shared constants and helpers (`pbs.kernels._common`), each kept in one place."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pbs.kernels import _common

PBS = Path(__file__).resolve().parents[1] / "pbs"

# A definition that must appear once in the package, in pbs/kernels/_common.py.
SHARED = {
    "LOG2_E": r"^\s*LOG2_E\s*=",
    "FAR_FUTURE value": r"^\s*_?FAR_FUTURE\s*=.*<<",
    "interpreting": r"^def _?interpreting\(",
    "tma_strides": r"^def _?tma_strides\(",
    "tma_descriptor": r"^def _?(tma_)?descriptor\(",
    "pow2_at_least": r"^def _?pow2_at_least\(",
}


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PBS)): p.read_text() for p in sorted(PBS.rglob("*.py"))}


def test_shared_helpers_are_defined_once():
    sources = _sources()
    for name, pattern in SHARED.items():
        where = [path for path, text in sources.items() if re.search(pattern, text, re.MULTILINE)]
        assert where == ["kernels/_common.py"], f"{name} is defined in {where}, expected only kernels/_common.py"


def test_kernels_read_no_environment_knobs():
    """Kernel choices are arguments (``kernel=``, ``config=``, ``gpu_tile=``), not environment
    variables; only Triton's own TRITON_INTERPRET is read, in one place."""
    readers = [
        path for path, text in _sources().items()
        if path.startswith("kernels/") and path != "kernels/_common.py" and "os.environ" in text
    ]
    assert readers == []
    assert re.findall(r"os\.environ\.get\(\"(\w+)\"", (PBS / "kernels" / "_common.py").read_text()) == ["TRITON_INTERPRET"]


def test_far_future_survives_the_kernels_int32_cast():
    far = torch.tensor([_common.FAR_FUTURE], dtype=torch.int64)
    assert far.to(torch.int32).item() == _common.FAR_FUTURE  # 1 << 62 would wrap to 0 here
    assert _common.FAR_FUTURE > 1 << 24  # above any position a test or a real model reaches


def test_flex_pads_positions_with_the_shared_far_future():
    from pbs.kernels.flex import _padded_positions

    padded = _padded_positions(torch.arange(5).view(1, 1, 5), 8)
    assert padded.tolist() == [[[0, 1, 2, 3, 4] + [_common.FAR_FUTURE] * 3]]


def test_tma_strides_make_size_one_dims_contiguous():
    x = torch.zeros(1, 4, 10, 8)[:, 1:2]  # (1, 1, 10, 8) with the strides of a (1, 4, 10, 8) tensor
    assert x.stride() == (320, 80, 8, 1)
    assert _common.tma_strides(x) == [80, 80, 8, 1]


def _kernel_launches(source: str) -> list:
    """The ``_kernel[grid](...)`` calls of a module (a private jit function indexed by its grid)."""
    import ast

    return [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name)
            and node.func.value.id.startswith("_")]


def test_every_kernel_launch_passes_the_compile_options():
    # Fused multiply-adds are asked for at every launch, not left to Triton's default (which
    # Triton 3.10 turns off). The Gluon kernel's launches take them from `_arguments`' kwargs.
    missing = []
    for name, source in _sources().items():
        for call in _kernel_launches(source):
            spread = [k.value.id for k in call.keywords if k.arg is None and hasattr(k.value, "id")]
            if "COMPILE_OPTIONS" not in spread and not (name == "kernels/hopper_attn.py" and spread == ["kwargs"]):
                missing.append(f"{name}:{call.lineno}")
    assert not missing, missing
    assert len([c for s in _sources().values() for c in _kernel_launches(s)]) >= 20


def test_the_gluon_kernels_launch_arguments_carry_the_compile_options():
    from pbs.kernels import hopper_attn

    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    gate = torch.zeros(32, dtype=torch.int32)
    _, _, kwargs = hopper_attn.dense_launch_arguments(q, q, q, torch.empty_like(q), scale=0.1, causal=True,
                                                      sm_count=132, gate=gate, gate_limit=1 << 19)
    assert {k: kwargs[k] for k in _common.COMPILE_OPTIONS} == _common.COMPILE_OPTIONS == {"enable_fp_fusion": True}
