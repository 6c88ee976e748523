"""On a GPU: how many e4m3 values the RMSNorm kernel that writes FP8 rows (norm_triton
rms_norm_fp8_triton, PAGEDLLM_FUSED_NORM_FP8) rounds differently from the norm kernel followed by the
per-token quantization kernel, and the exact value there (RESULTS.md, nineteenth session).

    PYTHONPATH=. python benchmarks/fp8_norm_diag.py
"""

from __future__ import annotations

import torch


def main() -> None:
    from pagedllm.kernels.fp8_triton import per_token_quant_triton
    from pagedllm.kernels.norm_triton import rms_norm_fp8_triton, rms_norm_triton

    g = torch.Generator().manual_seed(0)
    for dt in (torch.float16, torch.bfloat16):
        x = (torch.randn(70, 4096, generator=g) * 2).to("cuda", dt)
        w = (torch.rand(4096, generator=g) + 0.5).to("cuda", dt)
        (q, s), _ = rms_norm_fp8_triton(x, None, w, 1e-6)
        y = rms_norm_triton(x, w, 1e-6)
        uq, us = per_token_quant_triton(y)
        d = q.view(torch.uint8) != uq.view(torch.uint8)
        print(dt, "scales equal", torch.equal(s, us), "bytes differ", int(d.sum()), "of", d.numel(),
              "fused", q.float()[d][:4].tolist(), "unfused", uq.float()[d][:4].tolist(),
              "y/s", (y.float() / us)[d][:4].tolist(), flush=True)


if __name__ == "__main__":
    main()
