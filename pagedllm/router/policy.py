"""From a request to a Plan: which route answers its `model`, which tiers to try in which
order, whether a cascade judges the answer, and the prefix key for affinity. Also the cascade's
confidence signal on an answer. Pure functions over the config; no I/O.

How a `model` name resolves, first match wins:
  1. a route's `models` (an alias such as `auto`): that route's policy over its tiers;
  2. a tier's name: that tier (fallback to none other);
  3. a model a backend serves: the backends that serve it, tier by tier;
  4. otherwise 404 `model_not_found`. No `model`: `default_model` when configured.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pagedllm.router.config import CascadeConfig, RouteConfig, RouterConfig
from pagedllm.router.features import complexity_score, extract_features, prefix_key, tier_index_for_score


class RouteError(Exception):
    """A request the router cannot place: answered in OpenAI's error shape with `status_code`."""

    def __init__(self, message: str, status_code: int = 400, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.code, self.param = message, status_code, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status_code < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class Plan:
    route: RouteConfig
    tiers: list[str]                 # to try in order: the chosen tier first, then the fallbacks
    served_model: str | None         # only backends serving this name, and it is sent as is
    cascade: CascadeConfig | None    # judge answers below the route's last tier
    prefix_key: int | None
    score: float | None


def implicit_route(name: str, tiers: tuple[str, ...]) -> RouteConfig:
    return RouteConfig(name=name, models=(name,), tiers=tiers, policy="first", fallback=len(tiers) > 1)


class Planner:
    """Holds the config and the implicit routes built from it (tier names, served names)."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.routes = {m: r for r in cfg.routes for m in r.models}
        self.tier_routes = {t.name: implicit_route(t.name, (t.name,)) for t in cfg.tiers}
        self._served_routes: dict[str, RouteConfig] = {}
        self.refusals = {
            r.name: re.compile("|".join(f"(?:{p})" for p in r.cascade.refusal_patterns), re.IGNORECASE)
            for r in cfg.routes if r.cascade is not None and r.cascade.refusal_patterns
        }

    def served_route(self, model: str, served: dict[str, list[str]]) -> RouteConfig | None:
        tiers = served.get(model)
        if not tiers:
            return None
        route = self._served_routes.get(model)
        if route is None or route.tiers != tuple(tiers):
            route = self._served_routes[model] = implicit_route(model, tuple(tiers))
        return route

    def plan(self, body: dict[str, Any], served: dict[str, list[str]]) -> Plan:
        """`served`: model name -> the tiers (in config order) with a backend serving it."""
        model = body.get("model")
        if model is None:
            model = self.cfg.default_model
            if model is None:
                raise RouteError("the request names no model; set `model`", param="model", code="model_required")
        if not isinstance(model, str):
            raise RouteError(f"model: expected a string, got {type(model).__name__}", param="model")
        served_model = None
        route = self.routes.get(model) or self.tier_routes.get(model)
        if route is None:
            route = self.served_route(model, served)
            served_model = model
        if route is None:
            raise RouteError(f"The model `{model}` does not exist.", 404, code="model_not_found", param="model")
        stream = bool(body.get("stream"))
        tiers = list(route.tiers)
        start, score, key = 0, None, None
        need_features = route.policy == "features" or route.balance == "prefix_affinity"
        if need_features:
            features = extract_features(body, route.features.keywords)
            if route.policy == "features":
                score = complexity_score(features, route.features)
                start = tier_index_for_score(score, route.features.thresholds, len(tiers))
                while start < len(tiers) - 1 and _too_long(self.cfg, tiers[start], features.prompt_tokens):
                    start += 1
            if route.balance == "prefix_affinity":
                key = prefix_key(features.text, route.prefix_affinity)
        order = tiers[start:] + tiers[:start][::-1] if route.fallback else [tiers[start]]
        cascade = route.cascade if not stream and start < len(tiers) - 1 else None
        return Plan(route=route, tiers=order, served_model=served_model, cascade=cascade, prefix_key=key, score=score)

    def escalation(self, plan: Plan, from_tier: str) -> str | None:
        """The tier above `from_tier` in the plan's route, if any."""
        tiers = plan.route.tiers
        i = tiers.index(from_tier)
        return tiers[i + 1] if i + 1 < len(tiers) else None

    def weak_answer(self, plan: Plan, answer: dict[str, Any]) -> str | None:
        """Why the cascade should escalate this answer ("logprob", "refusal", "truncated"), or None."""
        cfg = plan.cascade
        if cfg is None:
            return None
        refusal = self.refusals.get(plan.route.name)
        for choice in answer.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if cfg.escalate_on_truncation and choice.get("finish_reason") == "length":
                return "truncated"
            text = choice.get("text")
            if text is None:
                text = (choice.get("message") or {}).get("content") or ""
            if cfg.escalate_on_refusal and refusal is not None and refusal.search(text):
                return "refusal"
            if cfg.min_mean_logprob is not None:
                mean = mean_logprob(choice)
                if mean is not None and mean < cfg.min_mean_logprob:
                    return "logprob"
        return None


def _too_long(cfg: RouterConfig, tier: str, prompt_tokens: int) -> bool:
    limit = cfg.tier(tier).max_prompt_tokens
    return limit is not None and prompt_tokens > limit


def mean_logprob(choice: dict[str, Any]) -> float | None:
    """Mean log probability of a choice's sampled tokens (completions' `token_logprobs`, chat's
    `logprobs.content[].logprob`); None without logprobs or tokens."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    values = lp.get("token_logprobs")
    if values is None:
        values = [e.get("logprob") for e in lp.get("content") or [] if isinstance(e, dict)]
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def request_logprobs(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], bool]:
    """The body asking for the sampled tokens' logprobs (the cascade's signal), and whether the
    client asked for them itself (if not, they are removed from the answer)."""
    if chat:
        if body.get("logprobs"):
            return body, True
        return {**body, "logprobs": True}, False
    if body.get("logprobs") is not None:
        return body, True
    return {**body, "logprobs": 0}, False


def strip_logprobs(answer: dict[str, Any]) -> dict[str, Any]:
    for choice in answer.get("choices") or []:
        if isinstance(choice, dict) and "logprobs" in choice:
            choice["logprobs"] = None
    return answer
