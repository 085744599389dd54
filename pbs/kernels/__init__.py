"""Triton and Gluon kernels and their launchers, each with an eager twin in `pbs.reference`.

Launchers take tensors, a `pbs.layout.Layout` and plain arguments and return tensors; they import
nothing from the floors above (components, the dispatch layer, planning, the entry points), which
`tests/test_layout_rules.py` checks. Which kernel runs a call, and the planners that call them,
live in `pbs.backends`.

Triton is imported only when a kernel module is, so ``import pbs`` works without it.
"""
