"""Compile a Triton or Gluon kernel for sm_90 on a machine without a GPU (compile only, no launch).

Triton compiles through its own bundled ``ptxas``; only the runtime's view of "the current device"
needs a stand-in, which :func:`sm90_driver` swaps in for the duration of a ``with`` block. The
test suite runs Triton in its interpreter (``TRITON_INTERPRET=1``, set before triton is imported),
under which nothing compiles, so :func:`compile_in_subprocess` does the work in a fresh process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def _fake_driver():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class _Utils:
        @staticmethod
        def load_binary(*args, **kwargs):
            raise RuntimeError("compile-only driver: there is no GPU to load a kernel on")

        @staticmethod
        def get_device_properties(*args):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    class Sm90CompileOnlyDriver(DriverBase):
        def __init__(self):
            self.target = GPUTarget("cuda", 90, 32)
            self.utils = _Utils()

        @staticmethod
        def is_active():
            return True

        def get_current_target(self):
            return self.target

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cuda

        def get_benchmarker(self):
            raise RuntimeError("compile-only driver")

        def get_empty_cache_for_benchmark(self):
            raise RuntimeError("compile-only driver")

        def clear_cache(self, cache):
            pass

        def map_python_to_cpp_type(self, ty):
            from triton.backends.nvidia.driver import ty_to_cpp

            return ty_to_cpp(ty)

    return triton, Sm90CompileOnlyDriver()


@contextlib.contextmanager
def sm90_driver():
    """Within the block, ``kernel.warmup(..., grid=...)`` compiles for an H100/H200 (sm_90)."""
    triton, driver = _fake_driver()
    previous = triton.runtime.driver._active
    triton.runtime.driver.set_active(driver)
    try:
        yield
    finally:
        triton.runtime.driver._active = previous


def resource_usage(cubin: bytes, tmp_path) -> dict[str, int]:
    """``REG``, ``LOCAL`` (spill bytes) and ``SHARED`` of a cubin, from the bundled cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|LOCAL|SHARED|STACK):(\d+)", text)}


def sass(cubin: bytes, tmp_path) -> str:
    """The cubin's SASS, from the bundled nvdisasm."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    path = tmp_path / "kernel_sass.cubin"
    path.write_bytes(cubin)
    return subprocess.run([tool, "-c", str(path)], capture_output=True, text=True, check=True).stdout


def compile_in_subprocess(function: str, env: dict[str, str] | None = None, **kwargs) -> dict:
    """``function(**kwargs)`` (``"module:name"``, returning a JSON-able dict) in a fresh Python
    without the interpreter, so that Triton really compiles; ``env``: further environment
    variables for it."""
    module, name = function.split(":")
    code = (
        "import json, sys, importlib; "
        f"result = getattr(importlib.import_module({module!r}), {name!r})(**json.loads(sys.argv[1])); "
        "print('RESULT' + json.dumps(result))"
    )
    env = {**os.environ, **(env or {}), "TRITON_INTERPRET": "0"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True,
                          env=env, cwd=root)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if done.returncode != 0 or not lines:
        raise AssertionError(f"compiling {function}({kwargs}) failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT"):])


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="pbs-sm90-"))
