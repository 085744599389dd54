"""Triton kernels and their launchers (each with an eager twin in :mod:`pbs.reference`)."""
