"""Fuzzing the server's own OpenAPI schema (/openapi.json, which describes the request bodies)
with schemathesis: valid and invalid bodies, headers and methods for every operation, a bounded
number of examples each. No answer may be a 5xx, and the server is idle and healthy afterwards."""

from __future__ import annotations

from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from reliability_utils import AUTH, MODEL_NAME, assert_healthy, wait_idle  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MAX_EXAMPLES = 100  # per operation and generation mode: about 15 s in all


@pytest.fixture(scope="module")
def operations(rel_server):
    wait_idle(rel_server)
    schema = schemathesis.openapi.from_url(rel_server.url + "/openapi.json")
    ops = {}
    for result in schema.get_all_operations():
        op = result.ok()
        ops[f"{op.method.upper()} {op.path}"] = op
    return ops


def test_schema_describes_the_request_bodies(operations):
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health"} <= set(operations)
    for name in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert operations[name].body, f"{name} has no request body in the schema: nothing to fuzz"


ROLES = ("system", "user", "assistant")


def _closer_to_valid(case):
    """Positive bodies follow the schema, which cannot say everything the server checks (the
    served model's name, the message roles, the fields it does not support), so most would be
    400s. Nudge them so that the fuzzing reaches the engine more often, for at most 16 tokens."""
    body = case.body
    if isinstance(body, dict):
        if "model" in body:
            body["model"] = MODEL_NAME if len(repr(body)) % 2 else None
        for unsupported in ("logit_bias", "best_of", "suffix", "tools", "response_format"):
            body.pop(unsupported, None)
        for key in ("max_tokens", "max_completion_tokens"):  # bounded work per example
            if not isinstance(body.get(key), int) or body[key] > 16:
                body[key] = 16
        for i, message in enumerate(body.get("messages") or []):
            if isinstance(message, dict):
                message["role"] = ROLES[i % len(ROLES)]
    return case


# schemathesis's own pytest integration does not run on pytest 9; hypothesis drives each
# operation's strategy here instead, with the same check.
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_5xx(operations, rel_server, mode):
    generation_mode = schemathesis.GenerationMode(mode)
    failures = []
    statuses: Counter = Counter()
    for name, op in sorted(operations.items()):
        if mode == "negative" and not op.body and all(
                getattr(p, "location", None) == "path" for p in op.iter_parameters()):
            continue  # nothing to get wrong (a free-form path string such as a model id has no invalid value)
        strategy = op.as_strategy(generation_mode)
        if mode == "positive":
            strategy = strategy.map(_closer_to_valid)

        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        @given(case=strategy)
        def fuzz(case):
            # A valid request fits max_model_len 256; the timeout still bounds a long one.
            response = case.call_and_validate(headers=AUTH, checks=[not_a_server_error], timeout=30)
            statuses[(name, response.status_code)] += 1

        try:
            fuzz()
        except Exception as e:  # noqa: BLE001 - report every operation's failure together
            failures.append(f"{name}: {e}")
    print(mode, sorted(statuses.items()))
    assert failures == [], "\n\n".join(failures)
    assert sum(n for (name, status), n in statuses.items() if name.startswith("POST")) >= MAX_EXAMPLES


def test_idle_and_healthy_after_fuzzing(rel_server):
    wait_idle(rel_server, timeout=30)
    assert_healthy(rel_server)
    assert rel_server.unhandled_errors() == []
