"""The int32 counters of the "last program reduces" kernels: a kernel's programs each store a
partial result, then count themselves done on a counter with one acq_rel atomic at gpu scope;
the program that counts last reduces the partials in a fixed order, writes the result and sets
the counter back to zero. Users: the MoE down projection (fused_moe_small_triton.py), split-K
of the swap-AB GEMM and the fused router (swap_gemm_triton.py), the decode attention's splits
(attention_decode.py).

One pool per device, all zero between calls: zeroed once here, then each counter is counted up
and reset within the call that uses it. Every user indexes it from 0, so calls on one device must
not overlap in time: one stream, as the engine runs (a kernel on a second stream at the same time
would count on the same counters; a kernel that dies midway leaves them dirty). Nothing here
imports triton.
"""

from __future__ import annotations

import torch

from pagedllm.kernels._triton import next_power_of_2

# counters a device gets at its first call: enough for any decode batch of the engine (requests x
# kv heads), so that the pool is not reallocated during a CUDA-graph capture (256 KiB)
_MIN_COUNTERS = 1 << 16

# device -> every buffer ever handed out (the largest last); the older ones stay referenced, so
# that a CUDA graph captured with an older, smaller one never writes freed memory
_POOLS: dict[torch.device, list[torch.Tensor]] = {}


def counters(device: torch.device, size: int) -> torch.Tensor:
    """At least `size` int32 counters on `device`, all zero (see the module docstring). Best first
    called before a CUDA-graph capture (a warm-up call does): a pool grown during a capture would
    be allocated from the graph's memory."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one pool
        device = torch.device("cuda", torch.cuda.current_device())
    held = _POOLS.setdefault(device, [])
    if not held or held[-1].numel() < size:
        held.append(torch.zeros(max(_MIN_COUNTERS, next_power_of_2(size)), dtype=torch.int32, device=device))
    return held[-1]
