"""What the engine records about its steps: the stats it reports (`EngineStats`), a log of
the recent steps (`StepRecord`, for the engine page and the iteration metrics) and the host
time of each phase of a step (`StepTiming`, for benchmarks/profile_gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_gpu_blocks: int
    num_free_blocks: int
    # MoE: tokens routed to each expert (summed over layers), and to each rank's experts
    expert_load: list[int] = field(default_factory=list)
    expert_load_per_rank: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One scheduled step, for the engine page and the iteration metrics."""

    index: int  # 1, 2, ... in scheduling order
    time: float  # time.time() when it was scheduled
    num_prefill_tokens: int
    num_decodes: int
    num_tokens: int  # of max_num_batched_tokens
    num_reqs: int


STEP_LOG_LEN = 1024


@dataclass
class StepTiming:
    """Host seconds spent in each phase of `LLMEngine.step`, summed over steps."""

    schedule: float = 0.0
    launch: float = 0.0  # input preparation and the launch of the device work
    collect: float = 0.0  # waiting for a step's sampled tokens
    process: float = 0.0  # appending tokens, stop checks, detokenizing, building outputs
    steps: int = 0

    def summary(self) -> str:
        n = max(self.steps, 1)
        parts = ", ".join(f"{k} {1e3 * getattr(self, k) / n:.2f}" for k in ("schedule", "launch", "collect", "process"))
        return f"{self.steps} steps; host ms per step: {parts}"
