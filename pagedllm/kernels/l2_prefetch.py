"""Asking L2 for a weight that a later kernel of the step streams, from a side stream, while the
memory is otherwise idle (PAGEDLLM_PREFETCH_O).

At batch 1 a decoder layer streams its q/k/v weight, then runs kernels that read little (rotary
and store-KV, attention over a few hundred keys), then streams its o projection's weight. A weight
already in L2 makes the few-row linear faster (benchmarks/l2_bench.py, H100: Qwen3-30B-A3B's o
projection 8.4 -> 6.1 us, Llama-3.1-8B's 13.9 -> 10.6 us), but the kernel that asks for it takes
about as long as the bytes take to arrive (3.7-6 us: the bulk prefetch is paced by the memory), so
it must not sit on the step's chain of kernels: asked from inside the decode kernel it made W2 and
Qwen3-30B-A3B batch 1 slower (RESULTS.md, twenty-fourth session). Here it runs on a side stream
that forks from the step's stream after the q/k/v projection and joins it only at the end of the
model's forward, so no kernel of the chain waits for it; in a CUDA graph the fork and the join are
edges of the graph.

Nothing here imports triton at module import."""

from __future__ import annotations

import torch

from pagedllm.kernels._triton import _pdl_supported, o_prefetch_mode

# programs of the prefetch kernel: few enough to leave the chain's kernels their SMs
PREFETCH_PROGRAMS = 64
_side: dict[int, torch.cuda.Stream] = {}
_pending: set[int] = set()


def prefetch_weight_async(w: torch.Tensor) -> None:
    """Queues a kernel asking L2 for all of w on the device's side stream, after what the current
    stream has queued so far (PAGEDLLM_PREFETCH_O on, an sm_90+ GPU, w contiguous and 16-byte
    aligned; otherwise nothing). The current stream must call `join` before the step ends."""
    if not (w.is_cuda and o_prefetch_mode() and w.is_contiguous() and w.data_ptr() % 16 == 0):
        return
    dev = w.device.index if w.device.index is not None else torch.cuda.current_device()
    if not _pdl_supported(dev):  # sm_90+ (the bulk prefetch) and a triton that has PDL
        return
    from pagedllm.kernels.pdl_triton import prefetch_weight_kernel

    side = _side.get(dev)
    if side is None:
        side = _side[dev] = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        prefetch_weight_kernel[(PREFETCH_PROGRAMS,)](w, w.numel() * w.element_size(), CHUNKS=128, num_warps=4)
    _pending.add(dev)


def join(device: torch.device) -> None:
    """Makes the current stream wait for the prefetches queued on `device` since the last join (a
    CUDA graph's capture must end with every stream it forked joined)."""
    if device.type != "cuda":
        return
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if dev in _pending:
        _pending.discard(dev)
        torch.cuda.current_stream(dev).wait_stream(_side[dev])
