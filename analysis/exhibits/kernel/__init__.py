"""Kernels: the microbenchmark, kernel breakdowns, plan host time, Amdahl, profiler traces, the hardware limit."""
