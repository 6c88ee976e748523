"""Worker: one device, one rank (a tensor-parallel rank of one pipeline stage). Loads its shard
of the model (its stage's layers), sizes and allocates its part of the paged KV cache (its KV
heads of its layers; and the CPU swap pool), runs block copies for swapping, and hands each
step to its ModelRunner.

Under tensor parallelism every rank gets the same SchedulerOutput, runs the same step and
samples the same tokens (identical gathered logits, identically seeded generators), so the
runners' copies of the requests stay equal without any exchange of sampled tokens; the
executor returns rank 0's output."""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np
import torch

from pagedllm.attention.registry import get_attention_backend, kv_cache_dtype
from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed import SINGLE, ParallelState, kv_heads_per_rank
from pagedllm.model.layers.attention import bind_kv_cache
from pagedllm.model.loader import build_model, torch_dtype
from pagedllm.model.sampler import host_to_device
from pagedllm.worker import cpu_threads
from pagedllm.worker.kv_offset import layer_offsets, maybe_calibrate
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_GiB = 1 << 30
_CPU_DEFAULT_CAP = 4 * _GiB


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * _GiB


def _fmt(n: float) -> str:
    return f"{n / _GiB:.2f} GiB"


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages are not touched (numpy's calloc: the OS maps zero pages
    in on first write), so a CPU KV cache is resident only as far as blocks are used, and
    allocating a few GiB takes no time (torch.zeros writes every page)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


# FP8 (e4m3) arithmetic and conversions: Ada (8.9) and Hopper on; an A100 (8.0) compiles none of the FP8 kernels
FP8_MIN_CAPABILITY = (8, 9)


def fp8_refusal(capability: tuple[int, int], gpu: str, quantization: str | None, cache_dtype: str) -> str | None:
    """Why FP8 weights (quantization "fp8") or an FP8 KV cache cannot run on a GPU of `capability`, naming
    the parameter; None where they can or are not asked for."""
    if capability >= FP8_MIN_CAPABILITY:
        return None
    need = f"needs a GPU of compute capability 8.9 or more (Ada, Hopper); {gpu} is {capability[0]}.{capability[1]}"
    if quantization == "fp8":
        return f"quantization='fp8': FP8 (e4m3) weights {need}; serve the model's 16-bit or a 4-bit checkpoint"
    if cache_dtype.startswith("fp8"):
        return f"kv_cache_dtype={cache_dtype!r}: an FP8 KV cache {need}; use kv_cache_dtype='auto'"
    return None


class Worker:
    def __init__(self, config: EngineConfig, ps: ParallelState = SINGLE):
        """ps: this rank's tensor-parallel state (its group already joined). On CUDA the
        worker runs on the current device: the caller picks it before building the group."""
        self.config = config
        if config.parallel_config.enable_expert_parallel:
            ps = dataclasses.replace(ps, enable_expert_parallel=True)
        self.ps = ps
        self.rank = ps.tp_rank
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")
        )
        mc = config.model_config
        self.num_kv_heads = kv_heads_per_rank(mc.num_kv_heads, ps.tp_size)  # this rank's share
        start, end = ps.layer_range if ps.layer_range is not None else (0, mc.num_layers)
        self.num_layers = end - start  # the layers of this rank's pipeline stage
        t0 = time.time()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            refusal = fp8_refusal(
                torch.cuda.get_device_capability(self.device),
                torch.cuda.get_device_name(self.device),
                getattr(mc.quantization, "name", None),
                config.cache_config.cache_dtype,
            )
            if refusal is not None:
                raise ValueError(refusal)
        logger.info(
            "%sloading %s (%s, %s weights from %s) ...",
            self._tag(),
            mc.architecture,
            mc.dtype,
            mc.load_format,
            mc.model,
        )
        self.model = build_model(mc, config.device, ps)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info(
            "%sloaded %s (%s, %s) in %.1fs: weights %s",
            self._tag(),
            mc.architecture,
            mc.dtype,
            mc.load_format,
            time.time() - t0,
            _fmt(self.weight_bytes),
        )
        from pagedllm.model.layers.fused_moe import ExpertLoadReader, log_param_counts

        self.expert_load_reader = ExpertLoadReader(self.model)
        if self.expert_load_reader.modules:
            log_param_counts(type(self.model), mc.hf_config, self._tag())
        from pagedllm.model.layers.quantization import precision_summary

        head = getattr(self.model, "lm_head", None)
        self.precision = precision_summary(
            mc.dtype,
            mc.quantization,
            config.cache_config.cache_dtype,
            config.device,
            lm_head_quantized=getattr(head, "quant_method", None) is not None,
        )
        logger.info("%sprecision: %s", self._tag(), ", ".join(f"{k} {v}" for k, v in self.precision.items()))
        self.kv_dtype = kv_cache_dtype(config.cache_config.cache_dtype, torch_dtype(mc.dtype))
        self.backend = get_attention_backend(config.attention_backend, config.device)
        self.runner = ModelRunner(config, self.model, self.backend, self.device, ps)
        self.num_gpu_blocks = 0
        self.num_cpu_blocks = 0
        # one CPU process alone: its thread count follows the cores other processes leave free
        alone = self.device.type == "cpu" and ps.tp_size == 1 and ps.pp_size == 1
        governor = cpu_threads.ThreadGovernor() if alone and cpu_threads.enabled() else None
        self.thread_governor = governor if governor is not None and governor.active() else None

    def _tag(self) -> str:
        ps = self.ps
        tag = f"rank {ps.tp_rank}/{ps.tp_size} " if ps.tp_size > 1 else ""
        if ps.pp_size > 1:
            start, end = ps.layer_range or (0, 0)
            tag += f"stage {ps.pp_rank}/{ps.pp_size} (layers {start}-{end - 1}) "
        return tag.rstrip() + ": " if tag else ""

    # ---- sizing ----------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        mc = self.config.model_config
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * self.config.cache_config.block_size * self.num_kv_heads * mc.head_dim * elem

    def determine_num_blocks(self) -> tuple[int, int]:
        """Blocks this rank's memory holds (GPU cache, CPU swap pool). kv_cache_memory is per
        rank, like a GPU's memory; on CPU the default budget is shared by the ranks of the
        machine. The executor gives every rank the minimum over ranks."""
        cc = self.config.cache_config
        per_block = self.bytes_per_block()
        if cc.kv_cache_memory is not None:
            kv_bytes = cc.kv_cache_memory
            activation = 0
        elif self.device.type == "cpu":
            kv_bytes = min(int(_available_ram() * 0.25), _CPU_DEFAULT_CAP) // (self.ps.tp_size * self.ps.pp_size)
            activation = 0
        else:
            kv_bytes, activation = self._profile_cuda()
        num_gpu = max(int(kv_bytes // per_block), 0)
        num_cpu = int(cc.swap_space_bytes // per_block) if self.config.scheduler_config.preemption_mode == "swap" else 0
        mc = self.config.model_config
        tokens = num_gpu * cc.block_size
        logger.info(
            "%sKV cache plan: weights %s, activations %s, KV cache %s = %d blocks x %d tokens = %d tokens "
            "(%d bytes/token); max concurrency at max_model_len=%d: %.2fx; CPU swap pool %d blocks",
            self._tag(),
            _fmt(self.weight_bytes),
            _fmt(activation),
            _fmt(num_gpu * per_block),
            num_gpu,
            cc.block_size,
            tokens,
            per_block // cc.block_size,
            mc.max_model_len,
            tokens / mc.max_model_len,
            num_cpu,
        )
        return num_gpu, num_cpu

    def _profile_cuda(self) -> tuple[int, int]:
        """Run the largest batch the scheduler can form, measure the peak, and give the rest of
        gpu_memory_utilization x total to the cache."""
        from pagedllm.worker.profiling import profile_peak_memory

        total = torch.cuda.get_device_properties(self.device).total_memory
        peak, non_torch = profile_peak_memory(self)
        budget = total * self.config.cache_config.gpu_memory_utilization - peak - non_torch
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={self.config.cache_config.gpu_memory_utilization} leaves no room "
                f"for the KV cache (peak {_fmt(peak)} of {_fmt(total)})"
            )
        return int(budget), peak - self.weight_bytes

    # ---- cache -----------------------------------------------------------------------
    def allocate_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        mc, cc = self.config.model_config, self.config.cache_config
        nl = self.num_layers
        shape = (nl, 2, num_gpu_blocks, cc.block_size, self.num_kv_heads, mc.head_dim)
        t0 = time.time()
        logger.info(
            "%sallocating the KV cache: %s on %s ...",
            self._tag(),
            _fmt(num_gpu_blocks * self.bytes_per_block()),
            self.device,
        )
        if self.device.type == "cpu":
            self.kv_cache = _untouched_zeros(shape, self.kv_dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        bind_kv_cache(
            self.model, [self.kv_cache[i, 0] for i in range(nl)], [self.kv_cache[i, 1] for i in range(nl)], self.backend
        )
        self.cpu_cache: torch.Tensor | None = None
        if num_cpu_blocks > 0:
            cpu_shape = (nl, 2, num_cpu_blocks) + shape[3:]
            pin = self.device.type == "cuda"
            self.cpu_cache = torch.zeros(cpu_shape, dtype=self.kv_dtype, pin_memory=pin)
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        logger.info("%sKV cache allocated in %.1fs", self._tag(), time.time() - t0)
        maybe_calibrate(self)  # FP8 caches: K's offsets (worker/kv_offset.py), before the graphs read them
        if (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and self.backend.name == "triton"
            and self.ps.pp_size == 1
        ):  # the graphs hold the whole model, embedding to logits
            from pagedllm.worker.cuda_graph import DecodeGraphs

            sc = self.config.scheduler_config
            assert self.runner.buffers is not None
            graphs = DecodeGraphs(self.model, self.runner.buffers, min(sc.max_num_seqs, 512), mc.max_model_len,
                                  self.backend, self.config.cache_config.block_size)  # fmt: skip
            t1 = time.time()
            logger.info(
                "%scapturing CUDA graphs of decode steps (up to batch %d) ...", self._tag(), min(sc.max_num_seqs, 512)
            )
            graphs.capture()
            logger.info("%sCUDA graphs captured in %.1fs", self._tag(), time.time() - t1)
            self.runner.graphs = graphs
        if self.device.type == "cuda" and self.backend.name == "triton" and self.ps.pp_size == 1:
            from pagedllm.worker.warmup import warm_mixed_steps

            assert self.runner.buffers is not None
            sc = self.config.scheduler_config
            warm_mixed_steps(self.model, self.backend, self.runner.buffers.block_tables, cc.block_size,
                             sc.max_num_seqs - 1, mc.max_model_len)  # fmt: skip
        self.expert_load_reader.reset()  # the profile run, graph captures and warm-up routed nothing real

    def release_graphs(self) -> None:
        """Drops the captured CUDA graphs (before a tensor-parallel group is torn down: NCCL
        calls captured in them keep the communicator in use)."""
        if self.runner.graphs is not None:
            torch.cuda.synchronize(self.device)
            self.runner.graphs = None

    def k_offsets(self) -> list[torch.Tensor | None]:
        """This rank's FP8-cache K offsets by attention layer (worker/kv_offset.py; None: none)."""
        return layer_offsets(self.model)

    def expert_load(self) -> list[int]:
        """MoE: tokens routed to each expert so far ([] for a dense model); see ExpertLoadReader."""
        return self.expert_load_reader.read()

    def _swap(self, so: SchedulerOutput) -> None:
        if not (so.blocks_to_swap_out or so.blocks_to_swap_in):
            return
        assert self.cpu_cache is not None, "swapping needs the CPU swap pool"
        if so.blocks_to_swap_out:
            src = host_to_device([g for g, _ in so.blocks_to_swap_out], torch.int64, self.device)
            dst = torch.tensor([c for _, c in so.blocks_to_swap_out])
            self.cpu_cache[:, :, dst] = self.kv_cache[:, :, src].to("cpu")
        if so.blocks_to_swap_in:
            src = torch.tensor([c for c, _ in so.blocks_to_swap_in])
            dst = host_to_device([g for _, g in so.blocks_to_swap_in], torch.int64, self.device)
            self.kv_cache[:, :, dst] = self.cpu_cache[:, :, src].to(self.device, non_blocking=True)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(so))

    def launch(self, so: SchedulerOutput):
        if self.thread_governor is not None:
            self.thread_governor.before_step()
        self._swap(so)
        return self.runner.launch(so)

    def collect(self, handle) -> ModelRunnerOutput:
        return self.runner.collect(handle)
