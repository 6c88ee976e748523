"""The CPU worker's thread governor: it leaves a core that another process keeps busy, and the
thread count it picks does not change what the projections compute."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from pagedllm.kernels import cpu_gemm
from pagedllm.worker import cpu_threads


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_busy_seconds_advance_with_work():
    b0 = cpu_threads.machine_busy_seconds()
    if b0 is None:
        pytest.skip("no /proc/stat")
    _spin(0.3)
    assert cpu_threads.machine_busy_seconds() - b0 >= 0.2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="written for the 2-core machine")
def test_governor_leaves_the_core_another_process_keeps_busy(two_threads):
    gov = cpu_threads.ThreadGovernor(window=0.5)
    assert gov.active() and gov.max_threads == 2
    spinner = mp.get_context("spawn").Process(target=_spin, args=(4.0,))
    spinner.start()
    try:
        time.sleep(1.5)  # the child starts, then spins through a whole window
        gov._mark = gov._sample()
        time.sleep(1.0)
        assert gov.before_step() == 1
        assert torch.get_num_threads() == 1
    finally:
        spinner.join()
    # within [1, max] whatever the machine does; never above the count it started with
    time.sleep(0.6)
    assert 1 <= gov.before_step() <= 2


@pytest.mark.skipif(not cpu_gemm.available(), reason="no MKL packed GEMM")
@pytest.mark.parametrize("rows", [3, 32, 200])
def test_projection_bits_do_not_depend_on_threads(two_threads, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=g)
    x = torch.randn(rows, 576, generator=g)
    packed = cpu_gemm.PackedWeight(w)
    got = {}
    for n in (1, 2):
        torch.set_num_threads(n)
        got[n] = cpu_gemm.linear(x, w, None, packed if rows <= cpu_gemm.MAX_PACKED_ROWS else None)
    assert torch.equal(got[1], got[2])
