"""Benchmarks of the rerope package on a GPU (not part of the installed package).

Run from the repository root: ``python -m benchmarks.attention``, ``python -m benchmarks.decode``,
``python -m benchmarks.hf``.
"""
