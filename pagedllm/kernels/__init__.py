"""Native kernels by device: `kernels/cpu/` (C++ with AVX-512, built on first use)."""
