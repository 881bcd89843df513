"""`python -m bench.kernels`: every kernel's cases in one table (bench/kernels/all.py)."""

from bench.kernels.all import main

main()
