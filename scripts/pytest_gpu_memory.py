"""A pytest plugin that prints the GPU memory PyTorch holds after every test (allocated and
reserved), to find a test that leaves memory behind:

    PYTHONPATH=$PWD:$PWD/scripts python3 -m pytest tests -m gpu -s -p pytest_gpu_memory | grep '\\[gpu memory\\]'
"""

from __future__ import annotations


def pytest_runtest_teardown(item, nextitem):
    import torch

    if torch.cuda.is_available():
        print(f"\n[gpu memory] {item.nodeid}: allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, "
              f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB", flush=True)
