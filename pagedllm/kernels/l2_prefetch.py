"""L2 prefetch of a byte range on Hopper (sm_90+): `cp.async.bulk.prefetch.L2.global`, one bulk
request per CHUNK bytes, fire-and-forget. The kernel computes nothing: its only effect is that
a later kernel finds the range in L2 instead of HBM, so its torch "reference" is doing nothing,
and its tests check that everything around it computes what it computes without it.

The kernel returns once the requests are issued (a few microseconds, a handful of programs);
the copy engine fills L2 behind it while other kernels run.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK = 16384  # bytes a bulk request asks for
BLOCK = 128  # requests a program issues


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK_: tl.constexpr, BLOCK_: tl.constexpr):
    # base: the range's address (16-byte aligned); nbytes: a multiple of 16
    i = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    offs = i.to(tl.int64) * CHUNK_
    size = tl.maximum(tl.minimum(nbytes - offs, CHUNK_), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        setp.gt.s32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        constraints="=r,l,r",
        args=[base + offs, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@functools.cache
def l2_prefetch_supported(device_index: int) -> bool:
    """Bulk L2 prefetch needs Hopper or newer."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def l2_prefetch(t: torch.Tensor, nbytes: int | None = None) -> None:
    """Asks L2 for the first `nbytes` of `t`'s storage (all of it by default) on the current
    stream; a CUDA tensor on an sm_90+ device."""
    total = t.numel() * t.element_size() if nbytes is None else min(nbytes, t.numel() * t.element_size())
    addr = t.data_ptr()
    # bulk requests want 16-byte alignment of address and size: skip a ragged head and tail
    head = -addr % 16
    total = (total - head) // 16 * 16
    if total <= 0:
        return
    grid = (triton.cdiv(triton.cdiv(total, CHUNK), BLOCK),)
    _l2_prefetch_kernel[grid](addr + head, total, CHUNK_=CHUNK, BLOCK_=BLOCK, num_warps=4)
