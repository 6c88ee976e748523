"""Programmatic dependent launch (PDL, Hopper and newer) inside our kernels.

At batch 1 a decode step is hundreds of short kernels in a CUDA graph (Qwen3-30B-A3B: about ten
a layer, 48 layers), and between two of them the GPU drains the first and then launches and ramps
up the second: on the H200 a step's wall time was 3.67 ms against 3.33 ms of kernels. A kernel
launched with PDL (`launch_pdl=True`) may be scheduled as soon as every program of the kernel
before it has called `gdc_launch_dependents` (or exited); it then waits in `gdc_wait` until that
kernel has finished and its memory is visible. Launch and ramp-up overlap the previous kernel's
tail.

The rules a kernel with a PDL switch keeps (`PDL: tl.constexpr`, launched with
`**_triton.pdl(x)`), so that an early start can never read or overwrite data too soon:
1. nothing that an earlier kernel writes is loaded, and nothing is stored or counted (atomics),
   before `pdl_wait`; only index arithmetic, loads of weights and tables, which no kernel
   writes, and loads of the step's inputs (positions, slots, sequence lengths, the decode
   order), which only work without PDL (copies, torch ops) writes before the step's first PDL
   kernel, may come first. A kernel starts only after every program of the kernel before it has
   started, so by induction after that non-PDL work has finished. Such loads go through the L2
   (`.cg`), never a line an SM's L1 kept from an earlier step. The same holds for what earlier
   steps stored: the decode kernel's PRELOAD reads its first tile of the KV cache before its wait,
   in a step of decodes where it alone stores the step's keys (after its wait; the tile's stale
   row of the new key is replaced in registers, attention_decode.py).
2. `pdl_release` may come anywhere (first, here): it only lets the next kernel be scheduled,
   whose own `pdl_wait` still waits for all of this one.
Waiting is transitive: a kernel's wait returns once the kernel before it has finished, and that
one finished only after its own wait had returned. A kernel launched without PDL (cuBLAS, torch)
waits for everything before it as usual.

Both helpers compile to nothing when PDL is False (the interpreter, older GPUs, PAGEDLLM_PDL=0).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Lets the next kernel on the stream be scheduled (it waits in its own pdl_wait)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Waits until the kernel before this one on the stream has finished and its writes are
    visible (rule 1 of the module docstring)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_rows_l2(rows_ptr, row_mask, k_start, k_end, PREFETCH_K: tl.constexpr):
    """Asks L2 for columns [k_start, min(k_end, k_start + PREFETCH_K)) of each weight row
    (rows_ptr: [R] pointers to the rows' first elements; one sm_90 bulk prefetch a row, whole
    16-byte units, fire-and-forget). For a kernel launched with PDL to issue before its
    pdl_wait: the first tiles of its weights stream in while the kernel before it finishes.
    The rows' addresses at k_start must be 16-byte aligned (the caller checks)."""
    elem = rows_ptr.dtype.element_ty.primitive_bitwidth // 8
    cols = tl.minimum(k_end - k_start, PREFETCH_K)
    nbytes = tl.where(row_mask, (cols * elem) // 16 * 16, 0).to(tl.int32)
    addr = (rows_ptr + k_start).to(tl.int64)
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        setp.gt.s32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        constraints="=r,l,r",
        args=[addr, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
