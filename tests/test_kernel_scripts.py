"""The GPU machine's kernel scripts that instrument a copy of the Gluon kernel: their anchors still
name lines of the kernel, the instrumented copy compiles for sm_90, and their summaries read lock
step and ping-pong apart (no GPU needed)."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

from tests.sm90_compile import compile_in_subprocess

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel_source() -> str:
    return (ROOT / "pbs" / "kernels" / "hopper_attn.py").read_text()


@pytest.mark.parametrize("name", ["kernel_tile_stamps", "kernel_softmax_windows"])
def test_instrumentation_finds_its_anchors_in_the_kernel(name):
    source = _kernel_source()
    instrumented = _script(name).instrumented_source(source)
    assert instrumented.count("%clock64") > source.count("%clock64")


def _stamps(offset: int, steps: int = 40, tiles: int = 3) -> torch.Tensor:
    """Synthetic stamps: a step every 1000 cycles, a 400-cycle softmax window (exponentials issued
    after 100 cycles, the previous P V retired after 300), keys ready 500 cycles after the previous
    step's weights and the products issued 20 cycles later, the second warpgroup ``offset`` cycles
    after the first."""
    windows = _script("kernel_softmax_windows")
    stamps = torch.zeros(tiles, 2, windows.STEPS, windows.SLOTS, dtype=torch.int64)
    stamps[:, 0, 0, 0] = steps
    for i in range(1, steps):
        for wg, start in ((0, 1000 * i), (1, 1000 * i + offset)):
            stamps[:, wg, i] = torch.tensor([start, start + 100, start + 300, start + 400, start - 100, start - 80])
    return stamps


def test_softmax_windows_read_lock_step_and_ping_pong_apart():
    summarize = _script("kernel_softmax_windows").summarize
    lock_step, ping_pong = summarize(_stamps(0)), summarize(_stamps(500))
    assert lock_step["steps"] == ping_pong["steps"] == 3 * 39
    assert lock_step["step_cycles"] == ping_pong["step_cycles"] == 1000
    assert lock_step["softmax_window_cycles_wg1"] == 400
    assert [lock_step[f"{a}->{b}_cycles_wg0"] for a, b in [("scores", "exponentials"), ("exponentials", "pv_retired"),
                                                           ("pv_retired", "weights")]] == [100, 200, 100]
    assert [lock_step[f"{part}_cycles_wg0"] for part in ("weights->next keys_ready", "keys_ready->issued",
                                                         "issued->scores")] == [500, 20, 80]
    assert (lock_step["offset_over_step_median"], lock_step["share_overlapping_over_half"]) == (0.0, 1.0)
    assert (ping_pong["offset_over_step_median"], ping_pong["share_overlapping_over_half"]) == (0.5, 0.0)


def test_softmax_windows_ignore_steps_past_a_tiles_count():
    stamps = _stamps(0)
    stamps[:, 0, 0, 0] = 2  # one stamped step per tile; the rest are leftovers of a longer tile
    assert _script("kernel_softmax_windows").summarize(stamps)["steps"] == 3


def compile_softmax_windows(precision: str) -> dict:
    """Compiles the instrumented kernel for sm_90 (run by compile_in_subprocess)."""
    from benchmarks.common import STAMPS_ARG, instrumented_kernel
    from pbs.kernels.block_sparse_attn import prepare_call
    from pbs.testing import make_qkv
    from tests.sm90_compile import resource_usage, scratch_dir, sm90_driver
    from tests.test_block_sparse_attn import make_plan
    from tests.test_hopper_attn import _stand_in_quantized

    windows = _script("kernel_softmax_windows")
    kernel = instrumented_kernel(windows.instrumented_source(_kernel_source()), scratch_dir(), "hopper_windows")
    q, k, v = (x.to(torch.bfloat16) for x in make_qkv(heads_q=4, heads_kv=2, seq_len=1000, head_dim=128, seed=0))
    plan = make_plan(q.float(), k.float(), block=128, segment=256, permuter="last_block", causal=True)
    call = prepare_call(q, k, v, plan.mask, None, plan.key_positions(), None, True, None)
    if precision != "native":
        _stand_in_quantized(call, precision)
    grid, args, kwargs = kernel.launch_arguments(call, sm_count=132)
    args = list(args)
    args[STAMPS_ARG] = torch.zeros(8, dtype=torch.int64)
    with sm90_driver():
        compiled = kernel._hopper_block_sparse_attn_fwd.warmup(*args, grid=grid, **kwargs)
    return {"usage": resource_usage(compiled.asm["cubin"], scratch_dir()),
            "clock_reads": compiled.asm["ptx"].count("%clock64")}


def test_softmax_windows_kernel_compiles_for_sm90_with_its_stamps():
    report = compile_in_subprocess("tests.test_kernel_scripts:compile_softmax_windows", precision="fp8")
    assert report["usage"]["LOCAL"] == 0
    assert report["clock_reads"] == 12  # six stamps, in each consumer warpgroup's copy of the loop


def test_the_stamps_go_through_the_lse_shift_pointer():
    # The stamping scripts put their buffer at launch argument STAMPS_ARG, which must be the
    # pointer the kernel reads only when it writes the LSE in e4m3 (else the stamps overwrite an
    # argument the kernel uses).
    from benchmarks.common import STAMPS_ARG
    from pbs.kernels import hopper_attn
    from pbs.kernels.block_sparse_attn import prepare_call
    from pbs.testing import make_qkv
    from tests.test_block_sparse_attn import make_plan
    from tests.test_hopper_attn import _stand_in_quantized

    q, k, v = (x.to(torch.bfloat16) for x in make_qkv(heads_q=4, heads_kv=2, seq_len=300, head_dim=128, seed=0))
    plan = make_plan(q.float(), k.float(), block=128, segment=256, permuter="last_block", causal=True)
    call = prepare_call(q, k, v, plan.mask, None, plan.key_positions(), None, True, None)
    call.lse = torch.empty(q.shape[:3], dtype=torch.float32)
    _stand_in_quantized(call, "fp8")
    _, args, _ = hopper_attn.launch_arguments(call, sm_count=132)
    assert args[STAMPS_ARG] is call.lse_shift


def test_a_timeline_keeps_one_tiles_steps_and_the_plot_draws_it(tmp_path):
    import json
    import subprocess
    import sys

    windows = _script("kernel_softmax_windows")
    stamps = _stamps(500)
    stamps[1, 0, 0, 0] = 30  # tiles 0 and 2 have the most steps: the first of them is drawn
    line = windows.timeline(stamps)
    assert line["rank"] == 0 and line["points"] == windows.POINTS
    assert len(line["cycles"][0]) == windows.TIMELINE_STEPS
    assert line["cycles"][0][0] == [0, 100, 300, 400, -100, -80]
    assert line["cycles"][1][0] == [500, 600, 800, 900, 400, 420]
    assert line["cycles"][0][1][0] == 1000  # the next step, a step later
    result = {"device": "a synthetic GPU", "rows": [
        {"n": 32768, "density": 1.0, "precision": precision, **windows.summarize(stamps), "timeline": line}
        for precision in ("native", "fp8")]}
    (tmp_path / "windows.json").write_text(json.dumps(result))
    out = tmp_path / "windows.png"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot_softmax_windows.py"), str(tmp_path / "windows.json"),
                    "--out", str(out)], check=True, capture_output=True)
    assert out.stat().st_size > 10_000


def _ab_kernel():
    spec = importlib.util.spec_from_file_location("benchmarks_ab_kernel", ROOT / "benchmarks" / "ab_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ab_kernel_reads_variants_and_compares_each_with_before():
    ab = _ab_kernel()
    assert ab.parse_variants(["pingpong=/tmp/a.py", "cvt=/tmp/b.py"]) == {"pingpong": "/tmp/a.py", "cvt": "/tmp/b.py"}
    for bad in (["pingpong"], ["=/tmp/a.py"], ["after=/tmp/a.py"], ["x=/tmp/a.py", "x=/tmp/b.py"]):
        with pytest.raises(SystemExit, match="NAME=FILE"):
            ab.parse_variants(bad)
    out = torch.ones(2, 3)
    outs = {"before": out, "after": out.clone(), "same": out.clone(), "off": out + 0.25}
    ms = {"before": 2.0, "after": 2.0, "same": 1.0, "off": 3.0}
    point = {"variants": ab.variant_point(ms, outs)}
    assert set(point["variants"]) == {"same", "off"}  # before and after have their own fields
    assert point["variants"]["same"] == {"ms": 1.0, "over_before": 0.5, "identical": True, "max_abs_diff": 0.0}
    assert point["variants"]["off"]["identical"] is False and point["variants"]["off"]["max_abs_diff"] == 0.25
    assert ab.describe(point) == "; same 1.000 ms (0.500x), identical; off 3.000 ms (1.500x), differs by up to 0.25"
    # "after" gets the same comparison in its own fields (its printed line says how far it is off).
    nan_where_before_has_one = out.clone()
    nan_where_before_has_one[0, 0] = float("nan")
    assert ab.against_before(nan_where_before_has_one, out) == {"identical": False, "max_abs_diff": float("inf")}
    assert ab.same_or_difference(ab.against_before(out + 0.5, out)) == "differs by up to 0.5"


def _source_page_rows() -> list[list[str]]:
    """A synthetic ncu source page: a tile loop (0x00-0x60) around a block loop (0x10-0x40) that waits
    for S, and code outside both; samples by stall reason per instruction."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_wait", "stall_mio",
              "stall_barrier", "stall_wait (Not Issued)"]
    body = [("0x00", "MOV R1, R2", 5, 5, 0, 0), ("0x10", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ", 2, 2, 0, 0),
            ("0x20", "WARPGROUP.DEPBAR.LE gsb0, 0x1", 10, 0, 0, 10), ("0x30", "MUFU.EX2 R5, R5", 8, 6, 2, 0),
            ("0x40", "@P0 BRA 0x10", 0, 0, 0, 0), ("0x50", "WARPGROUP.DEPBAR.LE gsb0, 0x1", 4, 0, 0, 4),
            ("0x60", "@P1 BRA 0x0", 1, 1, 0, 0), ("0x70", "EXIT", 50, 50, 0, 0)]
    return [["Kernel Name", "k", ""], header] + [[a, s, str(t), str(w), str(m), str(b), "0"] for a, s, t, w, m, b in body]


def test_ncu_summary_finds_the_block_loop_and_splits_its_samples():
    summary = _script("ncu_stall_summary")
    instructions = summary.source_page(_source_page_rows())
    assert summary.block_loops(instructions) == [(1, 4)]  # the loop around it overlaps it
    loop = summary.summarize_loop(instructions, 1, 4, total=80.0)
    assert loop["instructions"] == 4 and loop["share_of_kernel_samples"] == 20 / 80
    assert loop["by_reason"] == {"barrier": 0.5, "wait": 0.4, "mio": 0.1}
    assert loop["by_opcode"]["MUFU"] == {"share": 0.4, "main_reasons": {"wait": 0.75, "mio": 0.25}}
    assert loop["by_opcode"]["WARPGROUP"]["share"] == 0.5


def test_profile_call_sums_one_calls_events_by_name_largest_first():
    from benchmarks.common import profile_call

    def time_by_name(fn, device_type, top):
        return profile_call(fn, device_type, top)["by_name"]

    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def call():
        for _ in range(3):
            torch.mm(a, b)
        return torch.add(a, b)

    table = time_by_name(call, device_type="cpu", top=50)
    by_name = {row["name"]: row for row in table}
    assert by_name["aten::mm"]["calls"] == 3 and by_name["aten::add"]["calls"] == 1  # one profiled call, not the warm-up
    assert [row["ms"] for row in table] == sorted((row["ms"] for row in table), reverse=True)
    assert by_name["aten::mm"]["ms"] > 0
    assert len(time_by_name(call, device_type="cpu", top=1)) == 1


def test_profile_call_counts_every_event_and_the_time_between_them():
    import time

    from benchmarks.common import profile_call

    a = torch.randn(64, 64)

    def call():
        torch.mm(a, a)
        time.sleep(0.05)  # nothing runs here: inside the span, outside the events
        return torch.mm(a, a)

    profiled = profile_call(call, device_type="cpu", top=1)
    assert len(profiled["by_name"]) == 1 and profiled["events"] >= 2
    assert profiled["event_ms"] >= profiled["by_name"][0]["ms"] > 0
    assert profiled["span_ms"] >= 50 and profiled["span_ms"] - profiled["event_ms"] >= 40
    (gap,) = profiled["gaps"]  # top=1: the sleep between the two products
    assert gap["ms"] >= 40 and gap["after"].startswith("aten::") and gap["before"].startswith("aten::")


def test_idle_gaps_skip_what_nested_or_overlapping_intervals_cover():
    from benchmarks.common import idle_gaps

    intervals = [(0, 10_000, "a"), (2_000, 4_000, "inside a"), (9_000, 12_000, "overlaps a"),
                 (15_000, 16_000, "b"), (16_500, 17_000, "c")]
    assert idle_gaps(intervals, top=5) == [{"ms": 3.0, "after": "overlaps a", "before": "b"},
                                           {"ms": 0.5, "after": "b", "before": "c"}]
    assert idle_gaps(intervals, top=1) == [{"ms": 3.0, "after": "overlaps a", "before": "b"}]
    assert idle_gaps([(0, 5, "x")], top=3) == []


def test_host_profile_times_the_return_and_names_the_functions_by_own_time():
    from benchmarks.common import host_profile

    def slow_python():
        total = 0
        for i in range(300_000):  # all of it the function's own time: no calls inside
            total += i * i
        return total

    def call():
        slow_python()
        return torch.ones(4).sum()

    host = host_profile(call, top=3, repeats=3)
    first = host["functions"][0]
    assert "slow_python" in first["function"] and first["calls"] == 1
    assert first["own_us"] >= 0.5 * sum(row["own_us"] for row in host["functions"])
    assert host["return_ms"] > 0 and len(host["functions"]) == 3


def test_qk_quantization_error_is_zero_for_exact_scores_and_smaller_balanced():
    from benchmarks.qk_quantization_error import SCHEMES, quantized_qk, weight_error

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 300, 64, generator=gen), torch.randn(1, 2, 300, 64, generator=gen)
    k[..., 7] *= 12.0  # one key channel with ten times the others' range
    assert weight_error(q, k, q.float(), k.float()) < 1e-6
    errors = {label: weight_error(q, k, *quantized_qk(q, k, *scheme)) for label, scheme in SCHEMES.items()}
    assert 0 < errors["int8, balanced channels (shipped)"] < 0.6 * errors["int8, block scales alone (before)"]


def test_bench_quantize_pass_times_every_piece_and_both_balances_agree(tmp_path):
    from benchmarks import bench_quantize_pass
    from benchmarks.common import wall_clock_ms

    calls = []

    def timer(fn):
        calls.append(fn)
        return wall_clock_ms(fn)

    result = bench_quantize_pass.main(["--n", "300", "--json", str(tmp_path / "q.json")], timer=timer,
                                      device_timer=wall_clock_ms, device="cpu")
    (point,) = result["points"]
    names = ["key_mean", "balance_kernel", "balance_pytorch", "fp8_pass", "int8_qk_fp8_pv_pass"]
    assert all(point[f"{name}_idle_ms"] > 0 and point[f"{name}_device_ms"] > 0 for name in names)
    assert len(calls) == len(names) and (tmp_path / "q.json").exists()
    kernel_factors, twin_factors = calls[1](), calls[2]()  # the same factors, whichever times
    assert all(torch.equal(a, b) for a, b in zip(kernel_factors, twin_factors))


def _fake_nvidia_smi(folder: Path, lines: list[str]) -> None:
    """An ``nvidia-smi`` on PATH that prints ``lines`` and then waits to be stopped, as ``-lms`` does."""
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in lines) + "exec sleep 30\n")
    script.chmod(0o755)


def test_gpu_sampler_keeps_the_rows_of_the_asked_width(tmp_path, monkeypatch):
    from benchmarks.common import GpuSampler

    _fake_nvidia_smi(tmp_path, ["1980, 130.5", "1590, 701.2", "garbage", "1, 2, 3"])
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with GpuSampler("clocks.sm,power.draw", index=0, interval_ms=50) as sampler:
        deadline = time.monotonic() + 10
        while len(sampler.rows) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sampler.rows == [["1980", "130.5"], ["1590", "701.2"]]
    assert "--id=0" in sampler.command and "-lms=50" in sampler.command


def test_gpu_sampler_without_nvidia_smi_has_no_rows(tmp_path, monkeypatch):
    from benchmarks.common import GpuSampler

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    with GpuSampler("clocks.sm") as sampler:
        pass
    assert sampler.rows == []


def test_bench_sustained_reads_the_drift_of_back_to_back_calls(tmp_path):
    from benchmarks import bench_sustained

    summary = bench_sustained.drift([10.0, 11.0, 12.0, 12.5], bench_sustained.readings(
        [["1980", "300"], ["[N/A]", "1"], ["1600", "700"]]))
    assert summary["first_ms"] == 10.0 and summary["steady_ms"] == 12.25
    assert summary["steady_over_first"] == pytest.approx(1.225)
    assert (summary["sm_clock_mhz_max"], summary["sm_clock_mhz_last"], summary["power_w_max"]) == (1980, 1600, 700)

    result = bench_sustained.main(["--n", "300", "--calls", "3", "--pause", "0", "--json", str(tmp_path / "s.json")],
                                  device="cpu")
    (point,) = result["points"]
    for name in ("pbs_run", "cudnn"):
        assert len(point[name]["calls_ms"]) == 3 and point[name]["first_ms"] == point[name]["calls_ms"][0] > 0
    assert 0 < point["density"] <= 1 and (tmp_path / "s.json").exists()
    with pytest.raises(SystemExit):
        bench_sustained.main(["--calls", "1"], device="cpu")


@pytest.fixture
def far_lines_module():
    """benchmarks/quality_far_lines.py, whose import registers the experimental ``far_lines``
    selector: taken out of the registry again afterwards, so later tests see the library's own."""
    import benchmarks.quality_far_lines as module
    from pbs.components import selector_registry

    yield module
    selector_registry.unregister("far_lines")


def test_far_lines_keep_every_near_offset_and_the_far_ones_by_their_own_share(far_lines_module):
    far_offsets = far_lines_module.far_offsets

    slash = torch.tensor([[[0.5, 0.2, 0.1, 0.15, 0.05, 0.0],    # far shares 1/3, 1/2, 1/6, 0
                           [0.9, 0.1, 0.0, 0.0, 0.0, 0.0]]])   # no far attention at all
    kept = far_offsets(slash, 0.6, near=2)
    # 0.5 of the far share is not 0.6: the next largest joins; the zero share never does
    assert kept[0, 0].tolist() == [True, True, True, True, False, False]
    assert kept[0, 1].tolist() == [True, True, False, False, False, False]
    assert far_offsets(slash, 0.4, near=2)[0, 0].tolist() == [True, True, False, True, False, False]
