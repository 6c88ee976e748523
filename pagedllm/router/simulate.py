"""`pagedllm router simulate`: replay a trace through a route's policy and per-tier latency
curves, offline, and report mean / P50 / P99 latency, SLO attainment and cost per tier — the way
to check a claim like the founding document's (820 ms -> 290 ms, -42% hardware) before buying.

The tier choice is the router's own code (`Planner` for model names, the complexity score for
`policy: features`); the cascade escalates an answer with the probability the curves give a tier
(`weak_fraction`). Each tier is `replicas` servers with `max_num_seqs` slots (continuous
batching); a request admitted with b requests running on its replica takes

    ttft_ms.base + ttft_ms.per_prompt_token * prompt_tokens + (output_tokens - 1) * tpot_ms(b)

where tpot_ms is piecewise linear through the measured [batch size, ms per token] points. A
request that finds every replica full waits in its tier's FIFO queue.

Curves file (YAML), one entry per tier of the router config:

    tiers:
      edge: {ttft_ms: {base: 10, per_prompt_token: 0.01}, tpot_ms: [[1, 2.0], [64, 4.0]],
             max_num_seqs: 64, replicas: 2, cost_per_hour: 0.8, weak_fraction: 0.1}

Trace (JSONL), one request a line: {"arrival_s", "prompt_tokens", "output_tokens"} and,
optionally, "model", "max_tokens", "turns", "has_code", "keyword_hits". Or a synthetic trace:
--rate, --num-requests, --mix simple=0.6,medium=0.3,complex=0.1, over request classes that the
curves file may redefine (`classes: {simple: {prompt_tokens: [20, 150], output_tokens: [10, 40],
turns: [1, 1], code: 0.0, keyword_hits: [0, 0]}, ...}`).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import json
import random
import sys
from dataclasses import dataclass, field
from typing import Any

from pagedllm.router.config import RouterConfig, load_router_config
from pagedllm.router.features import RequestFeatures, complexity_score, tier_index_for_score
from pagedllm.router.policy import Planner, RouteError

# Synthetic request classes: (prompt tokens range, output tokens range, turns range, code
# probability, keyword hits range).
_CLASSES = {
    "simple": ((20, 150), (10, 40), (1, 1), 0.0, (0, 0)),
    "medium": ((200, 900), (40, 150), (1, 3), 0.1, (0, 1)),
    "complex": ((900, 3000), (150, 400), (1, 6), 0.5, (2, 4)),
}


@dataclass(frozen=True, slots=True)
class TierCurve:
    tpot_points: tuple[tuple[float, float], ...]   # (batch size, ms per output token), ascending
    ttft_base_ms: float = 0.0
    ttft_per_prompt_token_ms: float = 0.0
    max_num_seqs: int = 256
    replicas: int = 1
    cost_per_hour: float = 0.0
    weak_fraction: float = 0.0

    def tpot_ms(self, batch: int) -> float:
        xs = [p[0] for p in self.tpot_points]
        i = bisect.bisect_left(xs, batch)
        if i == 0:
            return self.tpot_points[0][1]
        if i == len(xs):
            return self.tpot_points[-1][1]
        (x0, y0), (x1, y1) = self.tpot_points[i - 1], self.tpot_points[i]
        return y0 + (y1 - y0) * (batch - x0) / (x1 - x0)

    def service_ms(self, prompt_tokens: int, output_tokens: int, batch: int) -> float:
        ttft = self.ttft_base_ms + self.ttft_per_prompt_token_ms * prompt_tokens
        return ttft + max(output_tokens - 1, 0) * self.tpot_ms(batch)


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    model: str | None = None
    max_tokens: int | None = None
    turns: int = 1
    has_code: bool = False
    keyword_hits: int = 0


@dataclass(slots=True)
class TierReport:
    name: str
    requests: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    slo_ms: float | None = None
    replicas: int = 0
    cost_per_hour: float = 0.0

    def summary(self, duration_s: float) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)
        pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0)
        within = sum(1 for x in lat if self.slo_ms is not None and x <= self.slo_ms)
        return {
            "tier": self.name, "requests": len(lat), "mean_ms": round(sum(lat) / len(lat), 1) if lat else 0.0,
            "p50_ms": round(pct(0.5), 1), "p99_ms": round(pct(0.99), 1),
            "slo_ms": self.slo_ms, "slo_attainment": round(within / len(lat), 3) if lat and self.slo_ms else None,
            "replicas": self.replicas, "cost_per_hour": round(self.replicas * self.cost_per_hour, 3),
            "cost": round(self.replicas * self.cost_per_hour * duration_s / 3600, 4),
        }


def load_curves(path: str, cfg: RouterConfig) -> dict[str, TierCurve]:
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    tiers = data.get("tiers")
    if not isinstance(tiers, dict):
        raise ValueError(f"{path}: expected a `tiers:` mapping of tier name -> curve")
    curves = {}
    for t in cfg.tiers:
        if t.name not in tiers:
            raise ValueError(f"{path}: tiers.{t.name}: no curve for this tier of the router config")
        c = dict(tiers[t.name])
        where = f"{path}: tiers.{t.name}"
        points = c.pop("tpot_ms", None)
        if not isinstance(points, list) or not points:
            raise ValueError(f"{where}.tpot_ms: expected a list of [batch size, ms per token] points")
        ttft = c.pop("ttft_ms", {}) or {}
        known = {"max_num_seqs", "replicas", "cost_per_hour", "weak_fraction"}
        unknown = sorted(set(c) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}")
        curves[t.name] = TierCurve(
            tpot_points=tuple(sorted((float(a), float(b)) for a, b in points)),
            ttft_base_ms=float(ttft.get("base", 0.0)), ttft_per_prompt_token_ms=float(ttft.get("per_prompt_token", 0.0)),
            max_num_seqs=int(c.get("max_num_seqs", 256)), replicas=int(c.get("replicas", len(t.backends))),
            cost_per_hour=float(c.get("cost_per_hour", t.cost_per_hour)), weak_fraction=float(c.get("weak_fraction", 0.0)),
        )
        if curves[t.name].replicas < 1 or curves[t.name].max_num_seqs < 1:
            raise ValueError(f"{where}: replicas and max_num_seqs must be >= 1")
    return curves


def load_trace(path: str) -> list[TraceRequest]:
    fields = {f.name for f in dataclasses.fields(TraceRequest)}
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                unknown = sorted(set(row) - fields)
                if unknown:
                    raise ValueError(f"{path}:{n}: unknown key(s) {unknown}")
                out.append(TraceRequest(**row))
    return sorted(out, key=lambda r: r.arrival_s)


def load_classes(path: str) -> dict[str, tuple]:
    """The curves file's optional `classes:` (name -> prompt_tokens, output_tokens, turns as
    [lo, hi], code as a probability, keyword_hits as [lo, hi]), over the built-in ones."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = (yaml.safe_load(f) or {}).get("classes") or {}
    classes = dict(_CLASSES)
    for name, c in data.items():
        unknown = sorted(set(c) - {"prompt_tokens", "output_tokens", "turns", "code", "keyword_hits"})
        if unknown:
            raise ValueError(f"{path}: classes.{name}: unknown key(s) {unknown}")
        classes[name] = (tuple(c["prompt_tokens"]), tuple(c["output_tokens"]), tuple(c.get("turns", (1, 1))),
                         float(c.get("code", 0.0)), tuple(c.get("keyword_hits", (0, 0))))
    return classes


def synthetic_trace(rate: float, num_requests: int, mix: dict[str, float], seed: int,
                    classes: dict[str, tuple] | None = None) -> list[TraceRequest]:
    """Poisson arrivals at `rate` req/s; each request drawn from a class of `mix`."""
    classes = classes or _CLASSES
    rng = random.Random(seed)
    names, weights = list(mix), list(mix.values())
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        (p0, p1), (o0, o1), (t0, t1), code_p, (k0, k1) = classes[rng.choices(names, weights)[0]]
        out.append(TraceRequest(arrival_s=round(t, 4), prompt_tokens=rng.randint(p0, p1),
                                output_tokens=rng.randint(o0, o1), turns=rng.randint(t0, t1),
                                has_code=rng.random() < code_p, keyword_hits=rng.randint(k0, k1)))
    return out


def choose_tiers(planner: Planner, cfg: RouterConfig, route_model: str, r: TraceRequest,
                 served: dict[str, list[str]]) -> tuple[list[str], bool]:
    """The route's tiers from the chosen one up (the cascade's path), and whether it cascades."""
    plan = planner.plan({"model": r.model or route_model, "prompt": ""}, served)
    tiers = list(plan.route.tiers)
    start = tiers.index(plan.tiers[0])
    if plan.route.policy == "features":
        f = RequestFeatures(prompt_chars=0, prompt_tokens=r.prompt_tokens, max_tokens=r.max_tokens or r.output_tokens,
                            turns=r.turns, has_code=r.has_code, keyword_hits=r.keyword_hits, text="")
        start = tier_index_for_score(complexity_score(f, plan.route.features), plan.route.features.thresholds, len(tiers))
        while start < len(tiers) - 1 and (cfg.tier(tiers[start]).max_prompt_tokens or 1 << 62) < r.prompt_tokens:
            start += 1
    return tiers[start:], plan.route.cascade is not None


def simulate(cfg: RouterConfig, curves: dict[str, TierCurve], trace: list[TraceRequest], *, route_model: str,
             seed: int = 0) -> dict[str, Any]:
    planner = Planner(cfg)
    served: dict[str, list[str]] = {}
    for t in cfg.tiers:
        for b in t.backends:
            for m in b.models:
                served.setdefault(m, []).append(t.name)
    rng = random.Random(seed)
    active = {name: [0] * c.replicas for name, c in curves.items()}   # running requests per replica
    queues: dict[str, list[int]] = {name: [] for name in curves}
    reports = {t.name: TierReport(t.name, slo_ms=t.slo_ms, replicas=curves[t.name].replicas,
                                  cost_per_hour=curves[t.name].cost_per_hour) for t in cfg.tiers}
    paths: list[list[str]] = []
    cascades: list[bool] = []
    events: list[tuple[float, int, int, str, int]] = []   # (time_ms, seq, request, kind, replica)
    seq = 0
    for i, r in enumerate(trace):
        try:
            path, cascade = choose_tiers(planner, cfg, route_model, r, served)
        except RouteError as e:
            raise ValueError(f"trace request {i}: {e.message}") from None
        paths.append(path)
        cascades.append(cascade)
        heapq.heappush(events, (r.arrival_s * 1000.0, seq, i, "arrive", -1))
        seq += 1
    stage = [0] * len(trace)
    escalations = 0

    def start(i: int, tier: str, replica: int, now: float) -> None:
        nonlocal seq
        c = curves[tier]
        active[tier][replica] += 1
        r = trace[i]
        done = now + c.service_ms(r.prompt_tokens, r.output_tokens, active[tier][replica])
        heapq.heappush(events, (done, seq, i, "finish", replica))
        seq += 1

    def dispatch(i: int, now: float) -> None:
        tier = paths[i][stage[i]]
        replica = min(range(len(active[tier])), key=active[tier].__getitem__)
        if active[tier][replica] < curves[tier].max_num_seqs:
            start(i, tier, replica, now)
        else:
            queues[tier].append(i)

    qpos = {name: 0 for name in curves}
    while events:
        now, _, i, kind, replica = heapq.heappop(events)
        if kind == "arrive":
            dispatch(i, now)
            continue
        tier = paths[i][stage[i]]
        active[tier][replica] -= 1
        if qpos[tier] < len(queues[tier]):
            nxt = queues[tier][qpos[tier]]
            qpos[tier] += 1
            start(nxt, tier, replica, now)
        if cascades[i] and stage[i] + 1 < len(paths[i]) and rng.random() < curves[tier].weak_fraction:
            stage[i] += 1
            escalations += 1
            dispatch(i, now)
            continue
        reports[tier].latencies_ms.append(now - trace[i].arrival_s * 1000.0)
    duration_s = max((r.arrival_s for r in trace), default=0.0)
    everything = [x for rep in reports.values() for x in rep.latencies_ms]
    overall = TierReport("all", latencies_ms=everything).summary(duration_s)
    tiers = [rep.summary(duration_s) for rep in reports.values()]
    cost_per_hour = sum(t["cost_per_hour"] for t in tiers)
    return {"requests": len(trace), "duration_s": round(duration_s, 1), "escalations": escalations,
            "mean_ms": overall["mean_ms"], "p50_ms": overall["p50_ms"], "p99_ms": overall["p99_ms"],
            "cost_per_hour": round(cost_per_hour, 3),
            "cost_per_1k_requests": round(cost_per_hour * duration_s / 3600 / max(len(trace), 1) * 1000, 4),
            "tiers": tiers}


def single_tier_config(cfg: RouterConfig, tier: str) -> RouterConfig:
    """The baseline: every request to `tier` (a route `all` over it alone)."""
    from pagedllm.router.config import RouteConfig

    return dataclasses.replace(cfg, tiers=(cfg.tier(tier),), default_model=None,
                               routes=(RouteConfig(name="all", models=("all",), tiers=(tier,)),))


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", dest="sim_config", required=True, help="The router config (tiers, routes).")
    p.add_argument("--curves", required=True, help="YAML of per-tier latency curves and costs (see the module doc).")
    p.add_argument("--trace", default=None, help="JSONL trace; without one a synthetic trace is drawn.")
    p.add_argument("--model", default="auto", help="The `model` a trace request without one asks for.")
    p.add_argument("--rate", type=float, default=10.0, help="Synthetic trace: arrivals per second (Poisson).")
    p.add_argument("--num-requests", type=int, default=2000, help="Synthetic trace: number of requests.")
    p.add_argument("--mix", default="simple=0.6,medium=0.3,complex=0.1", help="Synthetic trace: class shares.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", default=None, metavar="TIER", help="Also run everything on TIER alone and compare.")
    p.add_argument("--baseline-replicas", type=int, default=None, help="Replicas of the baseline tier (default: its curve's).")
    p.add_argument("--write-trace", default=None, help="Save the (synthetic) trace as JSONL.")
    p.add_argument("--json", action="store_true", help="Print the report as JSON.")


def _mix(value: str, classes: dict[str, tuple]) -> dict[str, float]:
    out = {}
    for part in value.split(","):
        name, _, share = part.partition("=")
        if name not in classes:
            raise ValueError(f"--mix: unknown class {name!r}; classes: {list(classes)}")
        out[name] = float(share)
    return out


def _table(title: str, rep: dict[str, Any]) -> str:
    lines = [f"{title}: {rep['requests']} requests over {rep['duration_s']} s, {rep['escalations']} escalations; "
             f"mean {rep['mean_ms']} ms, P50 {rep['p50_ms']} ms, P99 {rep['p99_ms']} ms; "
             f"cost {rep['cost_per_hour']}/h, {rep['cost_per_1k_requests']} per 1k requests",
             f"  {'tier':<10}{'requests':>9}{'mean ms':>10}{'P50 ms':>10}{'P99 ms':>10}{'SLO ms':>8}{'in SLO':>8}"
             f"{'replicas':>9}{'cost/h':>8}"]
    for t in rep["tiers"]:
        slo = "-" if t["slo_ms"] is None else f"{t['slo_ms']:g}"
        att = "-" if t["slo_attainment"] is None else f"{100 * t['slo_attainment']:.0f}%"
        lines.append(f"  {t['tier']:<10}{t['requests']:>9}{t['mean_ms']:>10}{t['p50_ms']:>10}{t['p99_ms']:>10}"
                     f"{slo:>8}{att:>8}{t['replicas']:>9}{t['cost_per_hour']:>8}")
    return "\n".join(lines)


def run_simulate(ns: argparse.Namespace) -> int:
    try:
        cfg = load_router_config(ns.sim_config)
        curves = load_curves(ns.curves, cfg)
        if ns.trace:
            trace = load_trace(ns.trace)
        else:
            classes = load_classes(ns.curves)
            trace = synthetic_trace(ns.rate, ns.num_requests, _mix(ns.mix, classes), ns.seed, classes)
    except (ValueError, OSError, KeyError, TypeError) as e:
        print(f"pagedllm router simulate: error: {e}", file=sys.stderr)
        return 2
    if ns.write_trace:
        with open(ns.write_trace, "w", encoding="utf-8") as f:
            for r in trace:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
    report: dict[str, Any] = {"policy": simulate(cfg, curves, trace, route_model=ns.model, seed=ns.seed)}
    if ns.baseline:
        base_cfg = single_tier_config(cfg, ns.baseline)
        base_curves = {ns.baseline: curves[ns.baseline]}
        if ns.baseline_replicas:
            base_curves[ns.baseline] = dataclasses.replace(curves[ns.baseline], replicas=ns.baseline_replicas)
        base_trace = [dataclasses.replace(r, model="all") for r in trace]
        base = simulate(base_cfg, base_curves, base_trace, route_model="all", seed=ns.seed)
        report["baseline"] = base
        report["mean_latency_ratio"] = round(report["policy"]["mean_ms"] / base["mean_ms"], 3) if base["mean_ms"] else None
        report["cost_ratio"] = round(report["policy"]["cost_per_hour"] / base["cost_per_hour"], 3) \
            if base["cost_per_hour"] else None
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        print(_table("policy", report["policy"]))
        if "baseline" in report:
            print(_table(f"baseline (all on {ns.baseline})", report["baseline"]))
            print(f"mean latency {report['policy']['mean_ms']} ms vs {report['baseline']['mean_ms']} ms "
                  f"(x{report['mean_latency_ratio']}); cost x{report['cost_ratio']}")
    return 0
