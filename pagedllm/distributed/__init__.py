"""Tensor-parallel state and its collectives.

`ParallelState` is an object handed to the layers (no module-level globals, no default
process group), so two engines, each with its own ranks, can live in one process. At world
size 1 every collective is a no-op and no process group exists.

Each engine makes its own rendezvous: the executor hosts a `TCPStore` on a port the OS picks
(port 0), every rank connects to it and builds a gloo (CPU) or NCCL (CUDA) group over a key
prefix of its own. Nothing is fixed (no port, no shared-memory name), so engines never collide.

Ranks are numbered `pp_rank * tp_size + tp_rank`; with pipeline parallelism (not there yet)
each stage would get its own tensor-parallel group from the same store.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_TIMEOUT_S = 600.0


def collective_timeout() -> datetime.timedelta:
    """How long a collective may wait for a peer that is alive but stuck (a peer that dies is
    noticed at once: its sockets close). $PAGEDLLM_DIST_TIMEOUT_S overrides the default."""
    return datetime.timedelta(seconds=float(os.environ.get("PAGEDLLM_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


@dataclass(frozen=True, slots=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    # the c10d backend (ProcessGroupGloo / ProcessGroupNCCL) of this rank's tensor-parallel
    # group; None at tp_size 1 (and in tests that only shard weights)
    group: Any = None
    # MoE layers place whole experts on the ranks of this group instead of slicing each one
    enable_expert_parallel: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; every rank gets the same bits."""
        if self.tp_size == 1:
            return x
        self.group.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., N] on every rank -> [..., tp_size * N], rank r's part at [r * N, (r + 1) * N)
        if self.tp_size == 1:
            return x
        # one flat buffer (all_gather_into_tensor): no per-rank copies, and NCCL captures it
        # in a CUDA graph (the LM head runs inside the decode graphs)
        n = x.shape[-1]
        flat = x.reshape(-1, n).contiguous()  # [M, N]
        out = torch.empty((self.tp_size * flat.shape[0], n), dtype=x.dtype, device=x.device)
        self.group._allgather_base(out, flat).wait()
        # [tp, M, N] -> [M, tp, N] -> [..., tp * N]
        out = out.view(self.tp_size, flat.shape[0], n).transpose(0, 1)
        return out.reshape(*x.shape[:-1], self.tp_size * n)

    def barrier(self) -> None:
        if self.tp_size > 1:
            self.group.barrier().wait()

    def abort(self) -> None:
        """Unblocks collectives waiting on a dead peer (NCCL; gloo notices closed sockets)."""
        if self.group is not None and hasattr(self.group, "abort"):
            self.group.abort()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Releases the group without waiting on the other ranks, and returns within `timeout`
        seconds whatever the library does. NCCL's shutdown waits for every rank to make the same
        call, so an NCCL group is aborted (local); on two H200s even that once blocked, so the
        teardown runs in a daemon thread and is left behind, with a warning, if it does not
        return in time (the process's exit frees what it holds). gloo's shutdown is local."""
        if self.group is None:
            return
        group = self.group

        def teardown() -> None:
            try:
                if type(group).__name__ == "ProcessGroupNCCL" and hasattr(group, "abort"):
                    group.abort()
                elif hasattr(group, "shutdown"):
                    group.shutdown()
            except RuntimeError:
                pass  # already aborted

        t = threading.Thread(target=teardown, name="pagedllm-group-teardown", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            logging.getLogger(__name__).warning(
                "tensor-parallel group of rank %d did not shut down in %.0f s; left to the process's exit",
                self.tp_rank, timeout)


SINGLE = ParallelState()


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads a rank holds: split when there are at least as many as ranks, else one head
    replicated over tp_size // num_kv_heads ranks."""
    return max(1, num_kv_heads // tp_size)


def check_tp_divides(tp_size: int, num_heads: int, num_kv_heads: int) -> None:
    """Raises ValueError unless the attention heads split evenly over tp_size ranks."""
    if num_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide the model's num_attention_heads={num_heads}"
        )
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide the model's num_key_value_heads={num_kv_heads}"
        )
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must be a multiple of the model's num_key_value_heads="
            f"{num_kv_heads} (each KV head is replicated over tensor_parallel_size / num_key_value_heads ranks)"
        )


def create_store(host: str = "127.0.0.1") -> "torch.distributed.TCPStore":
    """The rendezvous of one engine's ranks: a TCPStore server on a port the OS picks (read it
    back from `.port`). It listens on every interface, so ranks on other nodes reach it by
    this node's address."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)


def init_parallel_state(rank: int, world_size: int, store_host: str, store_port: int, device: str,
                        local_ip: str = "127.0.0.1", group_name: str = "tp") -> ParallelState:
    """Joins this engine's tensor-parallel group (blocks until every rank has joined).

    device: "cpu" -> gloo, bound to local_ip (the loopback for ranks on one machine);
    "cuda" -> NCCL on the current CUDA device (set it first).
    """
    if world_size == 1:
        return SINGLE
    import torch.distributed as dist

    timeout = collective_timeout()
    store = dist.TCPStore(store_host, store_port, None, False, timeout=datetime.timedelta(seconds=60))
    prefixed = dist.PrefixStore(group_name, store)
    if device == "cuda":
        if not dist.is_nccl_available():
            raise RuntimeError("tensor parallelism on CUDA needs a torch built with NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
        opts._timeout = timeout
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    ps = ParallelState(tp_rank=rank, tp_size=world_size, group=group)
    # NCCL connects lazily; one collective now makes a broken setup fail here, not mid-step
    probe = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu")
    ps.all_reduce(probe)
    if int(probe.item()) != world_size:
        raise RuntimeError(f"tensor-parallel group self-test failed: sum of ones is {probe.item()}, not {world_size}")
    return ps
