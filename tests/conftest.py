"""Test set-up: without a GPU, Triton kernels run in the interpreter (set before triton is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    # Gluon wraps triton.language's functions when it is first imported, and asserts that they are
    # the interpreter's only while the interpreter is on. Tests that unset TRITON_INTERPRET (the doc
    # examples run as a user would) may be the first to import it, after other tests imported
    # triton.language under the interpreter: importing it here, once, keeps the outcome independent
    # of which tests a process runs, and in which order.
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:  # a Triton without Gluon: pbs.kernels.hopper_attn is then unavailable anyway
        pass

# Under pytest-xdist (README's test command runs the suite on one worker per core, at most 4) each
# worker takes its share of the cores for torch's own threads: as many threads as cores in every
# worker would make them wait on one another in the model and reference tests.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu_check.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# scripts/gpu_tests_parallel.sh runs eight pytest processes on one GPU: each GPU test must fit in
# an eighth of an H200's 140 GiB. At 674d309 one process held 125 GiB and three tests of other
# groups failed for want of memory; with the cap, the test that reaches for more fails itself.
GPU_TEST_MEMORY_GIB = float(os.environ.get("PBS_GPU_TEST_MEMORY_GIB", "16"))


def _free_gpu_memory(drop_last_failure: bool = False):
    """Returns the caching allocator's unused blocks to the driver.

    ``drop_last_failure``: first drops the traceback pytest keeps of the last failed test (in
    ``sys.last_traceback``, for post-mortem debugging, until the next test's call phase, after that
    test's fixtures), and with it the tensors its frames hold: at 3f5d4f6 a 64K-token test that ran
    out of memory kept its tensors alive through the next test, and that test ran out of memory too."""
    import gc
    import sys

    if drop_last_failure:
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            sys.__dict__.pop(name, None)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _gpu_memory_per_test(request):
    """Caps every GPU test's PyTorch memory at `GPU_TEST_MEMORY_GIB` (an allocation past it raises
    ``torch.OutOfMemoryError`` in that test), and frees the caching allocator's unused blocks
    before and after it.

    PyTorch keeps freed device memory reserved for reuse; over a full GPU run on an 80 GB H100 the
    fp32 planning tests left so much reserved that loading the next Triton kernel failed with
    "Triton Error [CUDA]: out of memory" (the driver itself had none left), while each test passed
    alone. Returning the memory between tests keeps them independent of the order they run in.
    ``PBS_GPU_MEMORY_LOG=<file>`` appends each GPU test's peak of reserved memory to that file.
    """
    on_gpu = "gpu" in request.keywords and torch.cuda.is_available()
    if on_gpu:
        _free_gpu_memory(drop_last_failure=True)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, GPU_TEST_MEMORY_GIB * 2**30 / total))
        torch.cuda.reset_peak_memory_stats()
    yield
    if not on_gpu:
        return
    peak_gib = torch.cuda.max_memory_reserved() / 2**30
    _free_gpu_memory()
    if log := os.environ.get("PBS_GPU_MEMORY_LOG"):
        with open(log, "a") as f:
            f.write(f"{peak_gib:8.2f} GiB  {request.node.nodeid}\n")


@pytest.fixture
def checked_addresses():
    """Within the test, every Triton launch in the interpreter fails with `OutOfBoundsAccess` on a
    load, store or atomic outside the storages of its tensors (``tests/interpreter_bounds.py``; a
    no-op on the GPU). A module turns it on for all its tests with
    ``pytestmark = pytest.mark.usefixtures("checked_addresses")``."""
    from tests.interpreter_bounds import checked_addresses as check

    with check():
        yield
