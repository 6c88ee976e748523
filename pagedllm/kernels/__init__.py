"""Fused kernels. Each op has a plain-torch reference (`*_torch`) that defines it and, on CUDA,
a Triton kernel that must equal it; the dispatching function picks one by device."""
