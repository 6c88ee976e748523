"""Fused kernels. Each op has a plain-torch reference (`*_torch`) that defines it and, on CUDA,
a Triton kernel that must equal it; the dispatching function picks one by device."""

import os

# Triton contracts a * b + c into one fma unless told not to; 3.9 warns that from 3.10 it will not
# by default. The kernels here were tuned (instruction counts, registers) and checked with it on,
# as every Triton before 3.10 compiles them, so it stays on unless the user set the variable. The
# variable is the process's: other Triton kernels in it that do not choose (torch.compile's inductor
# passes its own enable_fp_fusion) keep fusion on too, as before 3.10.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
