"""Metrics measured when /metrics is scraped rather than on the engine's step path: GPU
utilization and memory (NVML, through `nvidia-ml-py`; absent on a machine without an NVIDIA
driver), the KV cache's internal fragmentation, and the cache configuration
(`cache_config_info`, vLLM's name); plus the counter of rejected requests (503s), which the
server increments.

Everything registers in the server's own CollectorRegistry (never the global one).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from pagedllm.engine.snapshot import kv_fragmentation

logger = logging.getLogger(__name__)


class _NVML:
    """NVML handles of the visible GPUs, or none (no driver, no package, no GPU)."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no NVIDIA driver / library: no GPU metrics
            self.handles = []

    def read(self) -> list[tuple[int, float, int, int]]:
        """(index, utilization %, memory used bytes, memory total bytes) per GPU."""
        out = []
        for i, h in enumerate(self.handles):
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(h).gpu
                mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
                out.append((i, float(util), int(mem.used), int(mem.total)))
            except Exception:  # noqa: BLE001 - a GPU that stops answering drops out of the scrape
                continue
        return out


class ScrapeCollector:
    """A prometheus_client collector: its values are read at scrape time."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine  # AsyncLLMEngine
        self.model_name = model_name
        self.nvml = _NVML()

    def describe(self) -> list:
        return []  # values are only known at scrape time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        frag = GaugeMetricFamily(
            "pagedllm:kv_cache_fragmentation_perc",
            "Internal fragmentation of the KV cache: share of the slots in blocks held by running "
            "requests that hold no token. 1 means 100 percent.",
            labels=["model_name"],
        )
        try:
            frag.add_metric([self.model_name], kv_fragmentation(self.engine.engine))
        except Exception:  # noqa: BLE001 - a scrape never fails the server
            logger.debug("kv fragmentation unavailable", exc_info=True)
        yield frag
        gpus = self.nvml.read()
        if gpus:
            util = GaugeMetricFamily("pagedllm:gpu_utilization_perc", "GPU utilization (NVML), 1 means 100 percent.",
                                     labels=["model_name", "gpu"])
            used = GaugeMetricFamily("pagedllm:gpu_memory_used_bytes", "GPU memory in use (NVML).",
                                     labels=["model_name", "gpu"])
            total = GaugeMetricFamily("pagedllm:gpu_memory_total_bytes", "GPU memory (NVML).",
                                      labels=["model_name", "gpu"])
            for i, u, m_used, m_total in gpus:
                util.add_metric([self.model_name, str(i)], u / 100.0)
                used.add_metric([self.model_name, str(i)], m_used)
                total.add_metric([self.model_name, str(i)], m_total)
            yield util
            yield used
            yield total


def register_monitoring(registry: Any, engine: Any, model_name: str) -> Any:
    """Registers the scrape-time gauges and `cache_config_info`; returns the counter of rejected
    requests (label `reason`: queue_full, engine_unavailable) for the server to increment."""
    from prometheus_client import Counter, Gauge

    registry.register(ScrapeCollector(engine, model_name))
    cfg = engine.engine.config
    cc, sc = cfg.cache_config, cfg.scheduler_config
    info = {
        "block_size": str(cc.block_size),
        "num_gpu_blocks": str(engine.engine.num_gpu_blocks),  # summed over data-parallel replicas
        "num_cpu_blocks": str(engine.engine.num_cpu_blocks),
        "enable_prefix_caching": str(cc.enable_prefix_caching),
        "gpu_memory_utilization": str(cc.gpu_memory_utilization),
        "cache_dtype": str(getattr(cc, "cache_dtype", None) or cfg.model_config.dtype),
        "swap_space_bytes": str(cc.swap_space_bytes),
        "max_num_seqs": str(sc.max_num_seqs),
        "max_num_batched_tokens": str(sc.max_num_batched_tokens),
    }
    Gauge("pagedllm:cache_config_info", "Information of the LLMEngine's CacheConfig.", list(info),
          registry=registry).labels(**info).set(1)
    rejected = Counter("pagedllm:request_rejected", "Requests refused with 503 (queue full, engine unavailable).",
                       ["model_name", "reason"], registry=registry)
    for reason in ("queue_full", "engine_unavailable"):
        rejected.labels(model_name=model_name, reason=reason)
    return rejected
