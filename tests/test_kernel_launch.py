"""`pbs.kernels._launch.Relauncher`: Triton's binder once per specialization, the compiled kernel's
own launcher after that. Checked with a stand-in for a ``@triton.jit`` function (on the CPU Triton
only interprets); the density probe's GPU test runs the real thing."""

from __future__ import annotations

import pytest
import torch

from pbs.kernels import _launch
from pbs.kernels._launch import Relauncher, specialization_key


class FakeCompiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        assert len(grid) == 3, "Triton's compiled-kernel launcher reads grid[0], grid[1] and grid[2]"
        return lambda *args: self.log.append(("direct", grid, args))


class FakeJit:
    """Records calls the way ``fn[grid](*args, **kwargs)`` is made and returns a compiled kernel."""

    arg_names = ["x_ptr", "n", "scale", "BLOCK", "CAUSAL"]

    def __init__(self, compiled=True):
        self.log = []
        self.compiled = compiled

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return FakeCompiled(self.log) if self.compiled else None
        return launch


@pytest.fixture
def on_gpu(monkeypatch):
    """As on a GPU: not interpreting, device 0 current."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_launch.torch.cuda, "current_device", lambda: 0)


def test_the_second_call_of_a_specialization_skips_tritons_binder(on_gpu):
    fn = FakeJit()
    launch = Relauncher(fn)
    x = torch.zeros(64)
    launch((4, 2), x, 32, 0.5, options={"num_warps": 4}, BLOCK=128, CAUSAL=True)
    launch((8, 2), x, 48, 0.25, options={"num_warps": 4}, BLOCK=128, CAUSAL=True)
    assert [entry[0] for entry in fn.log] == ["triton", "direct"]
    assert fn.log[0][3] == {"BLOCK": 128, "CAUSAL": True, "num_warps": 4}
    # Signature order, the constexprs after the runtime arguments, the new grid.
    assert fn.log[1] == ("direct", (8, 2, 1), (x, 48, 0.25, 128, True))
    assert launch.direct_launches == 1


@pytest.mark.parametrize(
    "changed",
    [
        dict(x=torch.zeros(64, dtype=torch.float16)),  # dtype
        dict(x=torch.zeros(64)[1:]),  # a pointer off its 16-byte alignment
        dict(n=33),  # no longer divisible by 16
        dict(n=1),  # equal to 1
        dict(n=2**31),  # needs 64 bits
        dict(BLOCK=64),  # a constexpr
        dict(num_warps=8),  # a launch option
    ],
    ids=["dtype", "alignment", "divisibility", "one", "int64", "constexpr", "option"],
)
def test_any_change_triton_specializes_on_goes_through_triton_again(on_gpu, changed):
    base = dict(x=torch.zeros(64), n=32, BLOCK=128, num_warps=4)
    fn = FakeJit()
    launch = Relauncher(fn)
    for values in (base, {**base, **changed}):
        launch((1,), values["x"], values["n"], 0.5, options={"num_warps": values["num_warps"]},
               BLOCK=values["BLOCK"], CAUSAL=False)
    assert [entry[0] for entry in fn.log] == ["triton", "triton"]


def test_another_current_device_goes_through_triton_again(monkeypatch, on_gpu):
    fn = FakeJit()
    launch = Relauncher(fn)
    x = torch.zeros(64)
    launch((1,), x, 32, 0.5, BLOCK=128, CAUSAL=False)
    monkeypatch.setattr(_launch.torch.cuda, "current_device", lambda: 1)
    launch((1,), x, 32, 0.5, BLOCK=128, CAUSAL=False)
    assert [entry[0] for entry in fn.log] == ["triton", "triton"]


def test_interpreted_kernels_always_go_through_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fn = FakeJit()
    launch = Relauncher(fn)
    for _ in range(3):
        launch((1,), torch.zeros(64), 32, 0.5, BLOCK=128, CAUSAL=False)
    assert [entry[0] for entry in fn.log] == ["triton"] * 3
    assert launch.direct_launches == 0


@pytest.mark.parametrize(
    "constexprs",
    [dict(CAUSAL=False, BLOCK=128), dict(BLOCK=128)],
    ids=["out of signature order", "a constexpr left to its default"],
)
def test_calls_whose_arguments_cannot_be_put_in_signature_order_are_never_relaunched(on_gpu, constexprs):
    fn = FakeJit()
    launch = Relauncher(fn)
    for _ in range(2):
        launch((1,), torch.zeros(64), 32, 0.5, **constexprs)
    assert [entry[0] for entry in fn.log] == ["triton", "triton"]


def test_a_launch_that_returns_no_compiled_kernel_is_not_kept(on_gpu):
    fn = FakeJit(compiled=False)
    launch = Relauncher(fn)
    for _ in range(2):
        launch((1,), torch.zeros(64), 32, 0.5, BLOCK=128, CAUSAL=False)
    assert [entry[0] for entry in fn.log] == ["triton", "triton"]


def test_kept_kernels_are_bounded(on_gpu):
    fn = FakeJit()
    launch = Relauncher(fn, max_entries=2)
    for block in (16, 32, 64, 16, 32, 64):
        launch((1,), torch.zeros(64), 32, 0.5, BLOCK=block, CAUSAL=False)
    assert [entry[0] for entry in fn.log] == ["triton"] * 3 + ["direct", "direct", "triton"]


def test_an_argument_without_a_specialization_rule_is_refused():
    with pytest.raises(TypeError, match="no specialization rule for an argument of type str"):
        specialization_key(("text",), {}, {}, 0)
