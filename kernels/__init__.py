"""rl4bit.kernels: formats (reference + Triton)."""
