"""Test-only fault injection for the AsyncLLMEngine's loop (the server reads a spec from
$PAGEDLLM_TEST_FAULT): a chosen engine step raises, or kills the loop, before it runs."""

from __future__ import annotations

from dataclasses import dataclass


class InjectedEngineDeath(BaseException):
    """Raised by a `die:N` StepFault: a BaseException, so that it passes the per-step handler
    and kills the engine loop as an unrecoverable engine error would."""


@dataclass(frozen=True, slots=True)
class StepFault:
    """Test-only fault injection, parsed from a spec such as "step:3" or "step:3,die:40":

    - `step:N`: the N-th engine step raises RuntimeError instead of running; the requests in
      flight fail with RequestFailedError and the loop goes on.
    - `die:N`: the N-th engine step kills the engine loop (the engine is then dead).

    Steps are counted from 1 over the calls of `LLMEngine.step()` made by the loop.
    """

    fail_steps: frozenset[int] = frozenset()
    die_steps: frozenset[int] = frozenset()

    ENV_VAR = "PAGEDLLM_TEST_FAULT"

    @classmethod
    def parse(cls, spec: str) -> StepFault:
        fail: set[int] = set()
        die: set[int] = set()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, number = item.partition(":")
            if kind not in ("step", "die") or not number.isdigit() or int(number) < 1:
                raise ValueError(f"{cls.ENV_VAR}: expected items such as 'step:3' or 'die:10' (N >= 1), got {item!r}")
            (fail if kind == "step" else die).add(int(number))
        return cls(frozenset(fail), frozenset(die))

    def before_step(self, step: int) -> None:
        if step in self.die_steps:
            raise InjectedEngineDeath(f"injected engine death at step {step}")
        if step in self.fail_steps:
            raise RuntimeError(f"injected fault at step {step}")
