"""GPU benchmark scripts (run each as ``python3 benchmarks/<script>.py``; see docs/benchmarks.md),
what they share (`benchmarks.common`), their results (``benchmarks/results/``) and the CPU
pytest-benchmark suite (``benchmarks/cpu/``)."""
