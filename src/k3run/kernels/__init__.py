"""Compute kernels: each op lives in kernels/<op>/ with a fp32 torch oracle (ref.py), optional fast
implementations, and an __init__ that picks one per call site."""
