"""The mixture-of-experts layer: a router (float32 logits, softmax then top-k as transformers
routes) and the experts' weights stacked per projection, run by pagedllm.kernels.fused_moe
(Triton grouped GEMMs on CUDA, a torch loop over experts on the CPU).

How the experts land on ranks (tp_size 2, 4 experts of intermediate size I):

    tensor parallel (default):   every rank holds all 4 experts, rows [r*I/2, (r+1)*I/2) of
                                 each expert's gate/up and the same columns of its down
    expert parallel (--enable-expert-parallel):
                                 rank 0 holds experts 0, 1 whole, rank 1 experts 2, 3

Attention stays tensor parallel either way, so after it every rank holds every token's hidden
state: each rank runs its experts (or expert slices) on the tokens routed to them and one
all-reduce sums the partial outputs, the same collective a row-parallel MLP ends with. An
all-to-all dispatch would only pay when ranks hold different tokens (data-parallel attention,
which pagedllm does not have).

Checkpoints name experts one by one (`experts.3.gate_proj.weight`, Mixtral's `w1/w3/w2`) or
stacked (transformers 5: `experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]);
`load_expert_weight` reads only this rank's experts and rows of either.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.kernels import small_m
from pagedllm.kernels._triton import fusion_enabled
from pagedllm.kernels.fused_moe import fused_experts, topk_softmax
from pagedllm.model.layers.linear import copy_checked

# checkpoint projection name -> (our parameter, shard)
_EXPERT_PROJ = {"gate_proj": ("w13_weight", 0), "w1": ("w13_weight", 0), "up_proj": ("w13_weight", 1),
                "w3": ("w13_weight", 1), "down_proj": ("w2_weight", None), "w2": ("w2_weight", None)}
logger = logging.getLogger(__name__)
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# transformers' gate_up_proj / down_proj; GGUF's per-projection stacks (gate_proj.weight ...)
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")


class Router(nn.Module):
    """The gate [E, H] in the model dtype; the logits come out in float32: on CUDA one cuBLAS
    product with float32 output (`torch.mm(..., out_dtype=)`, no cast kernel on the decode
    path), or with PAGEDLLM_SMALL_M_GEMM on for the router, at 1-16 rows the swap-AB kernel
    writing float32 (kernels/small_m.py); elsewhere in float32 arithmetic.
    Unless PAGEDLLM_FUSED_ROUTER=0, `route` also picks the experts of 1-16 tokens of a 16-bit
    model on CUDA in the same launch (small_m.route_small)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.mm_out_dtype = True  # cleared once if this torch lacks mm's out_dtype (decided before graph capture)
        self.small_m_gemm = small_m.enabled("router")
        self.fused_topk = fusion_enabled("ROUTER")

    def route(self, x: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(topk_weights [T, K] float32, topk_ids [T, K] int64) of x [T, H] in one launch, or None
        where the fused router is off or does not apply (forward, then topk_softmax)."""
        if not self.fused_topk:
            return None
        routed = small_m.route_small(x, self.weight, top_k, renormalize)
        return None if routed is None else routed[1:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> logits [T, E] float32
        if self.small_m_gemm:
            config = small_m.pick(x, self.weight)
            if config is not None:
                return small_m.small_m_linear(x, self.weight, None, torch.float32, config)
        if x.is_cuda and x.dtype != torch.float32 and self.mm_out_dtype:
            try:
                return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
            except (RuntimeError, TypeError):
                self.mm_out_dtype = False
        return torch.nn.functional.linear(x.float(), self.weight.float())


class FusedMoE(nn.Module):
    """The experts of one layer. forward returns this rank's partial sum [T, H]; the caller
    all-reduces it (once, together with anything else partial)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, ps: ParallelState = SINGLE, expert_parallel: bool = False):
        super().__init__()
        tp = ps.tp_size
        self.ps = ps
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.expert_parallel = expert_parallel and tp > 1
        if self.expert_parallel:
            if num_experts % tp:
                raise ValueError(f"enable_expert_parallel: {num_experts} experts do not split over "
                                 f"tensor_parallel_size={tp} ranks")
            self.num_local_experts = num_experts // tp
            self.first_expert = ps.tp_rank * self.num_local_experts
            self.inter_per_rank = intermediate_size
            emap = torch.full((num_experts,), -1, dtype=torch.int32)
            emap[self.first_expert : self.first_expert + self.num_local_experts] = torch.arange(
                self.num_local_experts, dtype=torch.int32)
            self.expert_map: torch.Tensor | None = emap  # [E_global] local id or -1
        else:
            if intermediate_size % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide the experts' intermediate size "
                                 f"{intermediate_size} (or use enable_expert_parallel)")
            self.num_local_experts, self.first_expert = num_experts, 0
            self.inter_per_rank = intermediate_size // tp
            self.expert_map = None
        e, i = self.num_local_experts, self.inter_per_rank
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size), requires_grad=False)  # [E, 2I, H]
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i), requires_grad=False)  # [E, H, I]
        # tokens routed to each (global) expert since the last reset, summed on the device
        self.expert_load = torch.zeros(num_experts, dtype=torch.int64)

    # ---- loading ---------------------------------------------------------------------
    def _local(self, expert_id: int) -> int | None:
        local = expert_id - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def load_expert(self, param: nn.Parameter, loaded, shard: int | None, expert_id: int) -> None:
        """One expert's [I, H] gate/up (shard 0/1) or [H, I] down projection."""
        local = self._local(expert_id)
        if local is None:
            return  # another rank's expert
        i = self.inter_per_rank
        start = 0 if self.expert_parallel else self.ps.tp_rank * i
        if shard is None:  # down: [H, I] -> the rank's columns
            copy_checked(param.data[local], loaded.narrow(1, start, i), f"expert {expert_id} down_proj")
        else:
            copy_checked(param.data[local].narrow(0, shard * i, i), loaded.narrow(0, start, i),
                         f"expert {expert_id} {'up' if shard else 'gate'}_proj")

    def load_stacked(self, param: nn.Parameter, loaded, which: str) -> None:
        """All experts at once: gate_up_proj [E, 2I, H], gate_proj / up_proj [E, I, H] or
        down_proj [E, H, I]."""
        if int(loaded.shape[0]) != self.num_experts:
            raise ValueError(f"experts.{which}: checkpoint has {loaded.shape[0]} experts, the model {self.num_experts}")
        e0, n, i = self.first_expert, self.num_local_experts, self.inter_per_rank
        if which in ("gate_proj", "up_proj"):
            dst = param.data.narrow(1, 0 if which == "gate_proj" else i, i)
            src = loaded.narrow(0, e0, n) if self.expert_parallel else loaded.narrow(1, self.ps.tp_rank * i, i)
            copy_checked(dst, src, f"experts.{which}")
            return
        if self.expert_parallel:
            copy_checked(param.data, loaded.narrow(0, e0, n), f"experts.{which}")
            return
        start = self.ps.tp_rank * i
        if which == "down_proj":
            copy_checked(param.data, loaded.narrow(2, start, i), "experts.down_proj")
            return
        full = int(loaded.shape[1]) // 2
        copy_checked(param.data[:, :i], loaded.narrow(1, start, i), "experts.gate_up_proj (gate)")
        copy_checked(param.data[:, i:], loaded.narrow(1, full + start, i), "experts.gate_up_proj (up)")

    # ---- compute ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, H], router_logits: [T, E] float32 -> partial output [T, H]
        topk_weights, topk_ids = topk_softmax(router_logits, self.top_k, self.renormalize)
        return self.run_experts(x, topk_weights, topk_ids, slot_mapping)

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, H], topk_*: [T, K] (global expert ids) -> partial output [T, H]
        emap = self.expert_map
        if emap is not None and emap.device != x.device:
            emap = self.expert_map = emap.to(x.device)
        return fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, emap,
                             self.expert_load, slot_mapping)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert, gated by a sigmoid, set by the model)."""

    def __init__(self, cfg, ps: ParallelState, *, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, expert_parallel: bool):
        super().__init__()
        self.ps = ps
        self.gate = Router(cfg.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, top_k, cfg.hidden_size, intermediate_size, renormalize=renormalize,
                                ps=ps, expert_parallel=expert_parallel)
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None

    def forward(self, x: torch.Tensor, slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, H] -> [T, H] (all-reduced)
        routed = self.gate.route(x, self.experts.top_k, self.experts.renormalize)
        if routed is None:
            partial = self.experts(x, self.gate(x), slot_mapping)
        else:
            partial = self.experts.run_experts(x, *routed, slot_mapping)
        out = self.ps.all_reduce(partial)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def load_expert_weight(params: dict[str, nn.Parameter], modules: dict[str, nn.Module], name: str, tensor) -> str | None:
    """Loads `name` if it is an expert tensor; returns the parameter it went to, or None when
    `name` is not an expert tensor (the caller loads it)."""
    m = _PER_EXPERT.match(name)
    if m is not None:
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        ours, shard = _EXPERT_PROJ[proj]
        target = f"{prefix}.{ours}"
        if target not in params:
            raise ValueError(f"checkpoint tensor {name} has no parameter {target}")
        modules[prefix].load_expert(params[target], tensor, shard, expert)
        return target
    m = _STACKED.match(name)
    if m is not None:
        prefix, which = m.group(1), m.group(2)
        target = f"{prefix}.{'w2_weight' if which == 'down_proj' else 'w13_weight'}"
        if target not in params:
            raise ValueError(f"checkpoint tensor {name} has no parameter {target}")
        modules[prefix].load_stacked(params[target], tensor, which)
        return target
    return None


def param_counts(model_cls, hf_config) -> tuple[int, int]:
    """(total, active per token) parameters of the whole model, whatever this rank holds: the
    model built on the meta device at world size 1 (no memory, no weights); a token activates
    top_k of each MoE layer's experts (and every dense parameter)."""
    with torch.device("meta"):
        model = model_cls(hf_config, SINGLE)
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for mod in model.modules():
        if isinstance(mod, FusedMoE):
            per_expert = (mod.w13_weight.numel() + mod.w2_weight.numel()) // mod.num_experts
            inactive += (mod.num_experts - mod.top_k) * per_expert
    return total, total - inactive


def config_num_experts(hf_config) -> int:
    """Routed experts per MoE layer (Qwen: num_experts, Mixtral: num_local_experts); 0 if dense."""
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0) or 0)


def check_moe_parallel(hf_config, tp: int, expert_parallel: bool) -> None:
    """ValueError unless the experts split over tp ranks: their intermediate size under tensor
    parallelism, their number under expert parallelism. No-op for dense models."""
    num = config_num_experts(hf_config)
    if expert_parallel and not num:
        raise ValueError("enable_expert_parallel needs a mixture-of-experts model")
    if not num or tp == 1:
        return
    if expert_parallel:
        if num % tp:
            raise ValueError(f"enable_expert_parallel: tensor_parallel_size={tp} must divide the model's "
                             f"{num} experts")
        return
    inter = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    if inter % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the experts' intermediate size {inter} "
                         f"(or use enable_expert_parallel)")


def expert_load_modules(model: nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def log_param_counts(model_cls, hf_config, tag: str = "") -> tuple[int, int]:
    total, active = param_counts(model_cls, hf_config)
    logger.info("%sparameters: %.2fB in all, %.2fB active per token (%d of %d experts per layer)",
                                     tag, total / 1e9, active / 1e9, hf_config.num_experts_per_tok,
                                     config_num_experts(hf_config))
    return total, active


class ExpertLoadReader:
    """Tokens routed to each expert, summed over the layers, read without stalling the device:
    on CUDA a copy to pinned host memory is queued behind the work in flight (at most one per
    `interval` seconds) and read once its event has passed, so the value lags by a step or so."""

    def __init__(self, model: nn.Module, interval: float = 1.0):
        self.modules = expert_load_modules(model)
        self.interval = interval
        self.value: list[int] = [0] * (self.modules[0].num_experts if self.modules else 0)
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self._last = 0.0

    def _total(self) -> torch.Tensor:
        return torch.stack([m.expert_load for m in self.modules]).sum(0)  # [E]

    def read(self) -> list[int]:
        if not self.modules:
            return []
        total_dev = self.modules[0].expert_load.device
        if total_dev.type != "cuda":
            self.value = self._total().tolist()
            return self.value
        import time

        if self._pending is not None and self._pending[1].query():
            self.value = self._pending[0].tolist()
            self._pending = None
        now = time.monotonic()
        if self._pending is None and now - self._last >= self.interval:
            self._last = now
            host = torch.empty(len(self.value), dtype=torch.int64, pin_memory=True)
            host.copy_(self._total(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (host, event)
        return self.value

    def reset(self) -> None:
        for m in self.modules:
            m.expert_load.zero_()
        self._pending = None
        self.value = [0] * len(self.value)


def load_per_rank(expert_load: list[int], tp_size: int, expert_parallel: bool) -> list[int]:
    """Tokens routed to each rank's experts: contiguous blocks of E / tp experts under expert
    parallelism; one group otherwise (every rank holds a slice of every expert)."""
    if not expert_load:
        return []
    if not expert_parallel or tp_size == 1:
        return [sum(expert_load)]
    n = len(expert_load) // tp_size
    return [sum(expert_load[r * n : (r + 1) * n]) for r in range(tp_size)]
