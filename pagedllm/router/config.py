"""The router's configuration: frozen dataclasses built once from a YAML file (or a dict, or
flags) and validated here, so every mistake is a ValueError naming its key
(`tiers[1].backends[0].url: ...`). Nothing here opens a socket.

    host: 127.0.0.1
    port: 8080
    api_key: secret                  # or $PAGEDLLM_ROUTER_API_KEY
    tiers:                           # in escalation order: cheapest first
      - name: edge
        slo_ms: 100                  # the tier's latency objective (metrics, simulate)
        timeout_s: 5                 # to the first byte (a stream) / the whole answer; then retry
                                     # (default: 10 x slo_ms, at least 1 s; 60 s without an SLO)
        backends:
          - {url: "http://10.0.0.1:8000", models: [qwen3-1.7b]}
      - name: center
        backends: [{url: "http://10.0.0.9:8000", models: [llama-70b]}]
    routes:
      - name: auto
        models: [auto]               # the `model` names this route answers
        tiers: [edge, center]
        policy: features             # first | features
        cascade: {min_mean_logprob: -1.5}
        balance: prefix_affinity     # least_load | prefix_affinity | round_robin
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

TIER_POLICIES = ("first", "features")
BALANCE_POLICIES = ("least_load", "prefix_affinity", "round_robin")
PLACEMENTS = ("none", "ray")
# A tier without `timeout_s` waits this many times its SLO for the first byte (at least
# MIN_TIMEOUT_S: a cold prefix or a queue spike is not a failure), or DEFAULT_TIMEOUT_S without one.
SLO_TIMEOUT_FACTOR = 10.0
MIN_TIMEOUT_S = 1.0
DEFAULT_TIMEOUT_S = 60.0

DEFAULT_REFUSAL_PATTERNS = (
    r"\bI(?:'m| am) (?:sorry|unable|not able)\b",
    r"\bI can(?:no|')t (?:help|assist|answer|do that|provide)\b",
    r"\bas an AI\b",
)
DEFAULT_KEYWORDS = (
    "prove", "derive", "analyze", "analyse", "step by step", "explain why", "optimize", "design",
    "compare", "refactor", "debug", "algorithm", "theorem", "architecture", "trade-off",
)


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """A replica the router starts itself (placement: ray): `pagedllm serve MODEL ARGS...`."""

    model: str
    args: tuple[str, ...] = ()
    num_gpus: float = 0.0
    num_cpus: float = 1.0


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """One OpenAI-compatible server: its base URL (no /v1) and the model names it serves (the
    first is the one the router sends when a request names a tier or an alias; none: asked of
    its /v1/models at startup). With placement: ray, `launch` instead of `url` starts it."""

    url: str = ""
    models: tuple[str, ...] = ()
    api_key: str | None = None
    launch: LaunchConfig | None = None


@dataclass(frozen=True, slots=True)
class TierConfig:
    name: str
    backends: tuple[BackendConfig, ...]
    slo_ms: float | None = None
    # Until the response starts (a stream's first byte, a plain answer's whole body); past it the
    # request is retried on another replica or tier. None: from the SLO (see `effective_timeout_s`).
    timeout_s: float | None = None
    # Longest prompt (estimated tokens) the feature policy sends here; longer ones go up.
    max_prompt_tokens: int | None = None
    cost_per_hour: float = 0.0

    @property
    def effective_timeout_s(self) -> float:
        """`timeout_s`, else SLO_TIMEOUT_FACTOR x the SLO (at least MIN_TIMEOUT_S), else 60 s."""
        if self.timeout_s is not None:
            return self.timeout_s
        if self.slo_ms is not None:
            return max(MIN_TIMEOUT_S, SLO_TIMEOUT_FACTOR * self.slo_ms / 1000.0)
        return DEFAULT_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class FeatureConfig:
    """The complexity score: a weighted sum of features each scaled to [0, 1]; the score picks
    the tier through `thresholds` (one per boundary between the route's tiers, ascending)."""

    weights: dict[str, float] = field(default_factory=lambda: {
        "prompt_tokens": 0.3, "max_tokens": 0.2, "turns": 0.1, "code": 0.2, "keywords": 0.2,
    })
    thresholds: tuple[float, ...] = (0.25, 0.6)
    prompt_tokens_scale: int = 2000
    max_tokens_scale: int = 1024
    turns_scale: int = 8
    keywords_scale: int = 3
    keywords: tuple[str, ...] = DEFAULT_KEYWORDS


FEATURE_NAMES = ("prompt_tokens", "max_tokens", "turns", "code", "keywords")


@dataclass(frozen=True, slots=True)
class CascadeConfig:
    """Answer at the lowest tier; escalate to the next when a signal says the answer is weak.
    Applies to non-streaming requests (a stream cannot be taken back once it has started)."""

    min_mean_logprob: float | None = None
    escalate_on_refusal: bool = True
    escalate_on_truncation: bool = False
    refusal_patterns: tuple[str, ...] = DEFAULT_REFUSAL_PATTERNS


@dataclass(frozen=True, slots=True)
class PrefixAffinityConfig:
    """Consistent hashing of the prompt's first blocks (characters, as the router has no
    tokenizer). A target loaded `max_load_imbalance` above the least-loaded replica is skipped
    for least load, as SGLang's cache-aware router does."""

    block_chars: int = 64
    num_blocks: int = 4
    virtual_nodes: int = 64
    max_load_imbalance: float = 8.0


@dataclass(frozen=True, slots=True)
class RouteConfig:
    name: str
    models: tuple[str, ...]
    tiers: tuple[str, ...]
    policy: str = "first"
    features: FeatureConfig = field(default_factory=FeatureConfig)
    cascade: CascadeConfig | None = None
    balance: str = "least_load"
    prefix_affinity: PrefixAffinityConfig = field(default_factory=PrefixAffinityConfig)
    # After a failure before the first byte: try the route's other tiers (upwards, then down).
    fallback: bool = True


@dataclass(frozen=True, slots=True)
class HealthConfig:
    interval_s: float = 2.0
    timeout_s: float = 1.0
    unhealthy_threshold: int = 2   # failed checks in a row that take a backend out
    healthy_threshold: int = 1     # passed checks in a row that put it back
    metrics_interval_s: float = 1.0


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 5     # request failures in a row that open the circuit
    cooldown_s: float = 10.0       # open this long, then one trial request (half open)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    tiers: tuple[TierConfig, ...]
    routes: tuple[RouteConfig, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    default_model: str | None = None
    max_attempts: int = 3
    default_retry_after_s: float = 1.0
    max_request_body_size: int = 8 << 20
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    placement: str = "none"

    def tier(self, name: str) -> TierConfig:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)


# ---- building from a mapping -----------------------------------------------------------------


def _take(data: Any, cls: type, where: str, convert: dict[str, Any] | None = None) -> Any:
    """`cls(**data)` with unknown keys, missing keys and wrong types reported by name."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        if convert and name in convert:
            value = convert[name](value, key)
        kwargs[name] = value
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where or 'config'}: missing key(s) {missing}")
    return cls(**kwargs)


def _number(lo: float | None = None, hi: float | None = None, *, integer: bool = False, strict_lo: bool = False):
    def conv(value: Any, key: str) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            raise ValueError(f"{key}: expected {'an integer' if integer else 'a number'}, got {value!r}")
        if lo is not None and (value <= lo if strict_lo else value < lo):
            raise ValueError(f"{key}: must be {'>' if strict_lo else '>='} {lo}, got {value!r}")
        if hi is not None and value > hi:
            raise ValueError(f"{key}: must be <= {hi}, got {value!r}")
        return value
    return conv


def _optional(conv):
    return lambda value, key: None if value is None else conv(value, key)


def _string(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def _strings(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{key}: expected a non-empty list of strings, got {value!r}")
    return tuple(_string(v, f"{key}[{i}]") for i, v in enumerate(value))


def _choice(allowed: tuple[str, ...]):
    def conv(value: Any, key: str) -> str:
        if value not in allowed:
            raise ValueError(f"{key}: must be one of {list(allowed)}, got {value!r}")
        return value
    return conv


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    return value


def _url(value: Any, key: str) -> str:
    value = _string(value, key).rstrip("/")
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"{key}: expected an http(s) URL such as http://127.0.0.1:8000, got {value!r}")
    if parsed.path.endswith("/v1"):
        value = value[: -len("/v1")]
    return value


def _launch(value: Any, key: str) -> LaunchConfig:
    return _take(value, LaunchConfig, key, {
        "model": _string, "args": lambda v, k: tuple(str(a) for a in (v or ())),
        "num_gpus": _number(0), "num_cpus": _number(0),
    })


def _backend(value: Any, key: str) -> BackendConfig:
    return _take(value, BackendConfig, key, {
        "url": _url, "models": _strings, "api_key": _optional(_string), "launch": _optional(_launch),
    })


def _list(item):
    def conv(value: Any, key: str) -> tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {type(value).__name__}")
        return tuple(item(v, f"{key}[{i}]") for i, v in enumerate(value))
    return conv


def _tier(value: Any, key: str) -> TierConfig:
    tier = _take(value, TierConfig, key, {
        "name": _string, "backends": _list(_backend), "slo_ms": _optional(_number(0, strict_lo=True)),
        "timeout_s": _optional(_number(0, strict_lo=True)), "max_prompt_tokens": _optional(_number(1, integer=True)),
        "cost_per_hour": _number(0),
    })
    if not tier.backends:
        raise ValueError(f"{key}.backends: a tier needs at least one backend")
    return tier


def _weights(value: Any, key: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise ValueError(f"{key}: expected a mapping of feature -> weight")
    unknown = sorted(set(value) - set(FEATURE_NAMES))
    if unknown:
        raise ValueError(f"{key}: unknown feature(s) {unknown}; allowed: {list(FEATURE_NAMES)}")
    return {k: _number(0)(v, f"{key}.{k}") for k, v in value.items()}


def _features(value: Any, key: str) -> FeatureConfig:
    cfg = _take(value, FeatureConfig, key, {
        "weights": _weights,
        "thresholds": _list(_number()),
        "prompt_tokens_scale": _number(1, integer=True), "max_tokens_scale": _number(1, integer=True),
        "turns_scale": _number(1, integer=True), "keywords_scale": _number(1, integer=True),
        "keywords": lambda v, k: tuple(s.lower() for s in _strings(v, k)),
    })
    if list(cfg.thresholds) != sorted(cfg.thresholds):
        raise ValueError(f"{key}.thresholds: must be ascending, got {list(cfg.thresholds)}")
    return cfg


def _cascade(value: Any, key: str) -> CascadeConfig:
    return _take(value, CascadeConfig, key, {
        "min_mean_logprob": _optional(_number()), "escalate_on_refusal": _bool,
        "escalate_on_truncation": _bool, "refusal_patterns": _strings,
    })


def _affinity(value: Any, key: str) -> PrefixAffinityConfig:
    return _take(value, PrefixAffinityConfig, key, {
        "block_chars": _number(1, integer=True), "num_blocks": _number(1, integer=True),
        "virtual_nodes": _number(1, integer=True), "max_load_imbalance": _number(0),
    })


def _route(value: Any, key: str) -> RouteConfig:
    return _take(value, RouteConfig, key, {
        "name": _string, "models": _strings, "tiers": _strings, "policy": _choice(TIER_POLICIES),
        "features": _features, "cascade": _optional(_cascade), "balance": _choice(BALANCE_POLICIES),
        "prefix_affinity": _affinity, "fallback": _bool,
    })


def router_config_from_dict(data: Any, *, where: str = "") -> RouterConfig:
    """Build and cross-check a RouterConfig from a parsed YAML / JSON mapping."""
    cfg = _take(data, RouterConfig, where, {
        "tiers": _list(_tier), "routes": _list(_route), "host": _string,
        "port": _number(0, 65535, integer=True), "api_key": _optional(_string),
        "default_model": _optional(_string), "max_attempts": _number(1, integer=True),
        "default_retry_after_s": _number(0), "max_request_body_size": _number(1, integer=True),
        "health": lambda v, k: _take(v, HealthConfig, k, {
            "interval_s": _number(0, strict_lo=True), "timeout_s": _number(0, strict_lo=True),
            "unhealthy_threshold": _number(1, integer=True), "healthy_threshold": _number(1, integer=True),
            "metrics_interval_s": _number(0, strict_lo=True),
        }),
        "breaker": lambda v, k: _take(v, BreakerConfig, k, {
            "failure_threshold": _number(1, integer=True), "cooldown_s": _number(0),
        }),
        "placement": _choice(PLACEMENTS),
    })
    validate(cfg)
    if cfg.api_key is None and os.environ.get("PAGEDLLM_ROUTER_API_KEY"):
        cfg = dataclasses.replace(cfg, api_key=os.environ["PAGEDLLM_ROUTER_API_KEY"])
    return cfg


def validate(cfg: RouterConfig) -> None:
    if not cfg.tiers:
        raise ValueError("tiers: at least one tier is needed")
    names = [t.name for t in cfg.tiers]
    if len(set(names)) != len(names):
        raise ValueError(f"tiers: duplicate tier names in {names}")
    for ti, tier in enumerate(cfg.tiers):
        for bi, b in enumerate(tier.backends):
            if b.launch is None and not b.url:
                raise ValueError(f"tiers[{ti}].backends[{bi}]: needs a url (or, with placement: ray, a launch section)")
            if b.launch is not None and cfg.placement != "ray":
                raise ValueError(f"tiers[{ti}].backends[{bi}].launch: needs placement: ray")
    route_names = [r.name for r in cfg.routes]
    if len(set(route_names)) != len(route_names):
        raise ValueError(f"routes: duplicate route names in {route_names}")
    claimed: dict[str, str] = {}
    for ri, route in enumerate(cfg.routes):
        for name in route.tiers:
            if name not in names:
                raise ValueError(f"routes[{ri}].tiers: unknown tier {name!r}; tiers are {names}")
        if route.policy == "features" and len(route.features.thresholds) < len(route.tiers) - 1:
            raise ValueError(f"routes[{ri}].features.thresholds: {len(route.tiers)} tiers need "
                             f"{len(route.tiers) - 1} thresholds, got {len(route.features.thresholds)}")
        for m in route.models:
            if m in claimed:
                raise ValueError(f"routes[{ri}].models: {m!r} is already answered by route {claimed[m]!r}")
            claimed[m] = route.name
    if cfg.default_model is not None:
        served = {m for t in cfg.tiers for b in t.backends for m in b.models}
        if cfg.default_model not in claimed and cfg.default_model not in names and cfg.default_model not in served:
            raise ValueError(f"default_model: {cfg.default_model!r} is no route model, tier or served model")


def load_router_config(path: str, overrides: dict[str, Any] | None = None) -> RouterConfig:
    """Read a YAML (or JSON) file; `overrides` (from flags) replace top-level keys."""
    import yaml

    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return router_config_from_dict(data)
