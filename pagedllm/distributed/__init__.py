"""Tensor-parallel state and its collectives.

`ParallelState` is an object handed to the layers (no module-level globals, no default
process group), so two engines, each with its own ranks, can live in one process. At world
size 1 every collective is a no-op and no process group exists.

Each engine makes its own rendezvous: the executor hosts a `TCPStore` on a port the OS picks
(port 0), every rank connects to it and builds a gloo (CPU) or NCCL (CUDA) group over a key
prefix of its own. Nothing is fixed (no port, no shared-memory name), so engines never collide.

Ranks are numbered `pp_rank * tp_size + tp_rank` (distributed/pipeline.py): each pipeline
stage has its own tensor-parallel group (key prefix "tp{stage}" in the same store), and all
ranks of the engine share one more group ("pp") for the point-to-point sends of hidden states
from a stage to the next.
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
    pp_rank: int = 0
    pp_size: int = 1
    # the layers this stage owns, [start, end); None: all of them (no pipeline)
    layer_range: tuple[int, int] | None = None
    pp_group: Any = None  # c10d backend over all tp_size * pp_size ranks, for send/recv

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def owns_layer(self, index: int) -> bool:
        return self.layer_range is None or self.layer_range[0] <= index < self.layer_range[1]

    def send_to_next_stage(self, tensors: list[torch.Tensor]) -> None:
        """Sends contiguous tensors to this rank's peer in the next stage (blocks until sent)."""
        dst = self.rank + self.tp_size
        for i, t in enumerate(tensors):
            self.pp_group.send([t.contiguous()], dst, i).wait()

    def recv_from_prev_stage(self, tensors: list[torch.Tensor]) -> None:
        """Fills `tensors` (allocated by the caller with the agreed shapes) from the peer in
        the previous stage."""
        src = self.rank - self.tp_size
        for i, t in enumerate(tensors):
            self.pp_group.recv([t], src, i).wait()

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
        for g in (self.group, self.pp_group):
            if g is not None and hasattr(g, "abort"):
                g.abort()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Releases the group without waiting on the other ranks, and returns within `timeout`
        seconds whatever the library does. NCCL's shutdown waits for every rank to make the same
        call, so an NCCL group is aborted (local); on two H200s even that once blocked, so the
        teardown runs in a daemon thread and is left behind, with a warning, if it does not
        return in time (the process's exit frees what it holds). gloo's shutdown is local."""
        groups = [g for g in (self.group, self.pp_group) if g is not None]
        if not groups:
            return

        def teardown() -> None:
            for group in groups:
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


def _new_group(store: Any, name: str, rank: int, size: int, device: str, local_ip: str) -> Any:
    import torch.distributed as dist

    timeout = collective_timeout()
    prefixed = dist.PrefixStore(name, store)
    if device == "cuda":
        if not dist.is_nccl_available():
            raise RuntimeError("tensor parallelism on CUDA needs a torch built with NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(prefixed, rank, size, opts)


def init_parallel_state(rank: int, world_size: int, store_host: str, store_port: int, device: str,
                        local_ip: str = "127.0.0.1", group_name: str = "tp",
                        pp_size: int = 1, pp_layer_partition: tuple[int, ...] = (),
                        num_layers: int = 0) -> ParallelState:
    """Joins this engine's groups (blocks until every rank has joined): the tensor-parallel
    group of this rank's pipeline stage and, with pp_size > 1, the pipeline group of all ranks.
    world_size counts all ranks (tp_size x pp_size).

    device: "cpu" -> gloo, bound to local_ip (the loopback for ranks on one machine);
    "cuda" -> NCCL on the current CUDA device (set it first).
    """
    from pagedllm.distributed.pipeline import rank_coords, stage_layers

    if world_size == 1:
        return SINGLE
    import torch.distributed as dist

    tp_size = world_size // pp_size
    pp_rank, tp_rank = rank_coords(rank, tp_size)
    store = dist.TCPStore(store_host, store_port, None, False, timeout=datetime.timedelta(seconds=60))
    group = None
    if tp_size > 1:
        name = group_name if pp_size == 1 else f"{group_name}{pp_rank}"
        group = _new_group(store, name, tp_rank, tp_size, device, local_ip)
    pp_group = _new_group(store, "pp", rank, world_size, device, local_ip) if pp_size > 1 else None
    layer_range = stage_layers(pp_layer_partition, pp_rank, num_layers) if pp_size > 1 else None
    ps = ParallelState(tp_rank=tp_rank, tp_size=tp_size, group=group, pp_rank=pp_rank, pp_size=pp_size,
                       layer_range=layer_range, pp_group=pp_group)
    # NCCL connects lazily; one collective now makes a broken setup fail here, not mid-step
    probe = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu")
    if pp_group is not None:
        pp_group.allreduce([probe]).wait()
        expected = world_size
    else:
        ps.all_reduce(probe)
        expected = tp_size
    if int(probe.item()) != expected:
        raise RuntimeError(f"parallel group self-test failed: sum of ones is {probe.item()}, not {expected}")
    return ps


def init_engine_parallel_state(config: Any, rank: int, store_host: str, store_port: int,
                               local_ip: str = "127.0.0.1") -> ParallelState:
    """init_parallel_state for rank `rank` of an engine built from `config` (an EngineConfig)."""
    pc = config.parallel_config
    return init_parallel_state(rank, pc.world_size, store_host, store_port, config.device, local_ip=local_ip,
                               pp_size=pc.pipeline_parallel_size, pp_layer_partition=pc.pp_layer_partition,
                               num_layers=config.model_config.num_layers)
