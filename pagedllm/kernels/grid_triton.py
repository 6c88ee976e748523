"""The grid barrier of the persistent decode kernels (wna16_chain_triton.py): one launch runs several
dependent stages (a projection whose input another projection's programs write), its programs all
resident at once (one an SM at most), so that a program can wait for all the others in the middle
of the kernel instead of at a kernel boundary -- and load the next stage's weights, which do not
depend on anything, before it waits.

A barrier is an int32 counter of kernels/counters.py's pool (zero between calls): each program
counts itself done with `grid_arrive` (its stores published first) and `grid_wait`s until the count
reaches the programs'. The kernel's last program to finish sets its counters back to zero
(`grid_reset`), as the pool's other users do, so a CUDA graph replays it with no memset.

Under the Triton interpreter the programs run one after another, so a program could never see the
others arrive: the kernels run each stage as a launch of its own there (their STAGE argument)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grid_arrive(bar_ptr):
    """Counts this program done with the stage bar_ptr guards: every thread's stores before the
    count, whose release publishes them at gpu scope."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def grid_wait(bar_ptr, target):
    """Spins until bar_ptr's count reaches target (at once for a target of 0); acquire: what the
    counted programs stored is visible to the loads after it (through L2: cache_modifier ".cg")."""
    seen = 0  # (a target of 0: nothing to wait for, no atomic)
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def grid_reset(bar_ptr, BARRIERS: tl.constexpr):
    """At a program's end: counts it on the counter after the kernel's BARRIERS barriers; the last
    program of the grid (every other one past every barrier) sets them all back to zero."""
    tl.debug_barrier()
    done = tl.atomic_add(bar_ptr + BARRIERS, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        zeros = tl.zeros([triton.next_power_of_2(BARRIERS + 1)], dtype=tl.int32)
        offs = tl.arange(0, triton.next_power_of_2(BARRIERS + 1))
        tl.store(bar_ptr + offs, zeros, mask=offs <= BARRIERS)
