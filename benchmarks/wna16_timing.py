"""What the int4 kernel benchmarks share (wna16_bench.py: the K-packed kernels; wna16_swap_bench.py: the
N-major swap-AB ones): each config's product checked against the reference before it is timed in a CUDA
graph of fp8_bench's layers; a wrong one is reported, kept in WRONG, and makes the run exit 1 at its end."""

from __future__ import annotations

import torch
from fp8_bench import graph_time


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
    if err > 0.02:
        raise AssertionError(f"{what}: max error {err:.4f} of the reference's max")
    return err


WRONG: list[str] = []  # the configs whose product failed its check: reported, not timed, and the exit status 1


def time_configs(cfgs: list, one, many, ref: torch.Tensor, label: str) -> list[tuple[float, object]]:
    """(us, config) of each config that compiles and is right, in order: `one(cfg)` checked against
    `ref` first, then `many(cfg)` (every layer) timed in a CUDA graph. A config the compiler refuses
    (shared memory) is skipped with a line; a wrong one too, with a WRONG line, and kept in WRONG
    (the sweep goes on, and the run exits 1 at its end)."""
    timed = []
    for cfg in cfgs:
        try:
            check(one(cfg), ref, f"{label} {cfg}")
            t = graph_time(lambda: many(cfg))
        except AssertionError as e:
            print(f"  WRONG {e}", flush=True)
            WRONG.append(str(e))
            continue
        except Exception as e:  # noqa: BLE001
            print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        print(f"  {label} {cfg}: {t:.1f} us", flush=True)
        timed.append((t, cfg))
    return timed


def time_default_and_best(row: dict, key: str, cfgs: list, one, many, ref: torch.Tensor, label: str) -> bool:
    """time_configs over cfgs, the default first (duplicates dropped): row[key] the default's us
    (NaN if it did not run), row[key + "_best"] / row[key + "_best_cfg"] the fastest. False when no
    config ran."""
    cfgs = list(dict.fromkeys(cfgs))
    timed = time_configs(cfgs, one, many, ref, label)
    if not timed:
        return False
    row[key] = timed[0][0] if timed[0][1] == cfgs[0] else float("nan")
    row[f"{key}_best"], row[f"{key}_best_cfg"] = min(timed, key=lambda tc: tc[0])
    return True


def fields(cfg) -> tuple:
    """A SwapConfig's fields as printed: (block_n, block_k, split_k, warps, stages, block_m[, pairs][, dots])."""
    return (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages, cfg.block_m) + (
        ("pairs",) if cfg.pairs else ()) + ((cfg.dots,) if cfg.dots != "chain" else ())
