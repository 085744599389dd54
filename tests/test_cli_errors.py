"""The command line answers bad input with one clear line, never a traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pbs.cli import main
from pbs.cli.common import check_device, config_error_message

ROOT = Path(__file__).resolve().parents[1]
CPU_ONLY = not torch.cuda.is_available()


def test_check_device_accepts_cpu():
    assert check_device("cpu") == "cpu"
    assert check_device(" cpu:0 ") == "cpu:0"


# ids spelled out: a test id "gpu" would read as the gpu marker and be skipped on CPU (conftest)
@pytest.mark.parametrize("text", ["gpu", "GPU", "nvidia", "bogus", "cuda:x"], ids=lambda t: f"device={t}")
def test_check_device_rejects_unknown_names(text):
    with pytest.raises(argparse.ArgumentTypeError, match="unknown device .*use cpu, cuda or cuda:N"):
        check_device(text)


@pytest.mark.skipif(not CPU_ONLY, reason="a CUDA device is present")
@pytest.mark.parametrize("text", ["cuda", "cuda:0", "cuda:3"])
def test_check_device_says_when_there_is_no_cuda(text):
    with pytest.raises(argparse.ArgumentTypeError, match="CPU-only build|no CUDA device"):
        check_device(text)


def test_check_device_rejects_devices_that_are_not_here():
    with pytest.raises(argparse.ArgumentTypeError, match="'meta' is not available here"):
        check_device("meta")


COMMANDS = {
    "demo": ["demo"],
    "analyze": ["analyze"],
    "generate": ["generate", "model-dir", "--prompt-file", "prompt.txt"],
    "quality": ["quality"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("device", ["gpu", *(["cuda"] if CPU_ONLY else [])], ids=lambda t: f"device={t}")
def test_every_command_checks_its_device_before_running(command, device, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*COMMANDS[command], "--device", device])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"pbs {command}: error: argument --device: ")
    assert ("unknown device 'gpu'" if device == "gpu" else "CPU-only build") in last or "no CUDA device" in last


@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_demo_checks_the_backend_before_running_anything(backend, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the conftest turns the interpreter on for the tests
    assert main(["demo", "--device", "cpu", "--backend", backend, "--seq-len", "1024"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "[1/" not in captured.err  # no row started, not even dense
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"pbs demo: backend '{backend}' cannot run this call: inputs are on cpu, not CUDA")


def test_demo_reports_a_bad_geometry_in_one_line(capsys):
    assert main(["demo", "--block-size", "100", "--seq-len", "1024"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "pbs demo: block_size must be a power of two between 16 and 1024, got 100\n"


def test_analyze_reports_a_bad_block_size_in_one_line(tmp_path, capsys):
    assert main(["analyze", "--block-size", "100", "--out", str(tmp_path / "out"), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "pbs analyze: block_size must be a power of two between 16 and 1024, got 100\n"
    assert "pydantic" not in captured.err and not (tmp_path / "out").exists()
    assert main(["analyze", "--block-size", "256", "--segment-size", "384", "--quiet"]) == 2
    assert capsys.readouterr().err == "pbs analyze: segment_size (384) must be a multiple of block_size (256)\n"


def test_config_error_message_drops_pydantics_details():
    import pbs

    with pytest.raises(ValueError) as err:
        pbs.PBSConfig(gqa="replicate", selector={"name": "mean_pool", "treshold": 0.5})
    message = config_error_message(err.value)
    assert "\n" not in message and "https://" not in message and "type=" not in message
    assert message.startswith("selector.treshold: unknown field 'treshold'") or "gqa: Input should be" in message
    assert "gqa: Input should be 'per_head' or 'shared'" in message


@pytest.mark.skipif(not CPU_ONLY, reason="a CUDA device is present")
def test_bench_kernel_without_cuda_says_so():
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_kernel.py", "--n", "1024"], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("bench_kernel.py: times CUDA kernels and needs an NVIDIA GPU")


def test_python_dash_m_pbs_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "pbs", "list"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("permuters:")
    usage = subprocess.run([sys.executable, "-m", "pbs", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert usage.stdout.startswith("usage: pbs ")


def test_generate_help_shows_no_rst_markup(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "``" not in capsys.readouterr().out
