"""Where a structured-output step's mask fill goes, and which placement makes it cheap.

Walks R JSON-schema matchers (structured_bench.py's schema, a real tokenizer) token by token,
each step sampling one allowed token per row at random (what a dummy model does), and times the
step's fill under one placement at a time:

    thread      a grammar thread fills all rows (xgrammar's batch fill, --xg-threads threads)
    pinned      the same thread pinned to a core of its own, the main thread kept off that core
    procs:P     P worker processes (spawned, each pinned to a core of its own) own rows i::P:
                they get the step's tokens through a pipe, accept them and fill their rows of a
                shared-memory bitmask

Between steps the main thread does engine-like work of its own (it samples the next tokens
from the [R, V] mask and walks a large Python list), as the engine thread does while the
grammar step runs. Figures: the fill (in the worker), and the main thread's wait for it.

    python benchmarks/grammar_fill_bench.py --tokenizer DIR [--rows 148] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_bench import SCHEMA  # noqa: E402

VOCAB = 49152


def _tokenizer_info(tokenizer_dir: str):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tok, xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)


def _proc_main(conn, tokenizer_dir: str, compiled_json: str, rows: list[int], shm_name: str, n_rows: int,
               core: int | None) -> None:
    from multiprocessing import shared_memory

    import numpy as np
    import xgrammar as xgr

    if core is not None:
        os.sched_setaffinity(0, {core})
    _, info = _tokenizer_info(tokenizer_dir)
    cg = xgr.CompiledGrammar.deserialize_json(compiled_json, info)
    matchers = [xgr.GrammarMatcher(cg) for _ in rows]
    shm = shared_memory.SharedMemory(name=shm_name)
    width = (VOCAB + 31) // 32
    bitmask = torch.from_numpy(np.ndarray((n_rows, width), dtype=np.int32, buffer=shm.buf))
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        t0 = time.perf_counter()
        if msg:
            xgr.BatchGrammarMatcher.batch_accept_token(matchers, [msg[r] for r in rows])
        batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        conn.send(time.perf_counter() - t0)
    del bitmask
    shm.close()


def sample_allowed(bitmask: torch.Tensor, eos: int, rng: torch.Generator, shifts: torch.Tensor) -> list[int]:
    """One allowed token per row, uniformly at random (what a dummy model's sampler does under a
    mask): 64 random candidates a row tested against the mask, the full row only when none is in."""
    R = bitmask.shape[0]
    cand = torch.randint(0, VOCAB, (R, 64), generator=rng)
    ok = ((bitmask.gather(1, cand >> 5) >> (cand & 31)) & 1).bool() & (cand != eos)
    toks = cand[torch.arange(R), ok.int().argmax(1)]
    for r in (~ok.any(1)).nonzero().view(-1).tolist():
        allowed = ((bitmask[r].unsqueeze(-1) >> shifts) & 1).view(-1)[:VOCAB].nonzero().view(-1)
        allowed = allowed[allowed != eos]
        toks[r] = allowed[torch.randint(0, len(allowed), (1,), generator=rng)] if len(allowed) else 0
    return toks.tolist()


def run(args: argparse.Namespace, placement: str, compiled, info, tok) -> dict:
    from multiprocessing import shared_memory

    import numpy as np
    import xgrammar as xgr

    R = args.rows
    width = (VOCAB + 31) // 32
    shm = shared_memory.SharedMemory(create=True, size=R * width * 4)
    bitmask = torch.from_numpy(np.ndarray((R, width), dtype=np.int32, buffer=shm.buf))
    cores = sorted(os.sched_getaffinity(0))
    main_cores = set(cores)
    procs, conns = [], []
    submit = collect = None
    if placement in ("thread", "pinned"):
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(R)]
        batch = None
        box: dict = {}
        go, done = threading.Event(), threading.Event()
        pin = cores[-1] if placement == "pinned" and len(cores) > 1 else None

        def worker(bitmask=bitmask):
            nonlocal batch
            if pin is not None:
                os.sched_setaffinity(0, {pin})
            batch = xgr.BatchGrammarMatcher(max_threads=args.xg_threads)
            while True:
                go.wait()
                go.clear()
                toks = box.get("toks")
                if toks == "stop":
                    return
                t0 = time.perf_counter()
                if toks:
                    xgr.BatchGrammarMatcher.batch_accept_token(matchers, toks)
                batch.batch_fill_next_token_bitmask(matchers, bitmask)
                box["fill"] = time.perf_counter() - t0
                done.set()

        th = threading.Thread(target=worker, daemon=True)
        th.start()
        if pin is not None:
            main_cores.discard(pin)

        def submit(toks):
            box["toks"] = toks
            go.set()

        def collect():
            done.wait()
            done.clear()
            return box["fill"]

        def stop():
            box["toks"] = "stop"
            go.set()
            th.join()
    else:
        P = int(placement.split(":")[1])
        ctx = mp.get_context("spawn")
        blob = compiled.serialize_json()
        for p in range(P):
            parent, child = ctx.Pipe()
            core = cores[-1 - p] if len(cores) > P else None
            if core is not None:
                main_cores.discard(core)
            pr = ctx.Process(target=_proc_main, args=(child, args.tokenizer, blob, list(range(p, R, P)), shm.name, R,
                                                      core), daemon=True)
            pr.start()
            procs.append(pr)
            conns.append(parent)
        for c in conns:
            assert c.recv() == "ready"

        def submit(toks):
            for c in conns:
                c.send(toks)

        def collect():
            return max(c.recv() for c in conns)

        def stop():
            for c in conns:
                c.send(None)
            for pr in procs:
                pr.join()
    os.sched_setaffinity(0, main_cores)
    rng = torch.Generator().manual_seed(args.seed)
    junk = list(range(args.main_work))
    shifts = torch.arange(32, dtype=torch.int32)
    fills, waits = [], []
    toks: list[int] | None = []
    for step in range(args.steps):
        submit(toks)
        sum(junk)  # the engine thread's own work while the grammar step runs
        t0 = time.perf_counter()
        fill = collect()
        wait = time.perf_counter() - t0
        if step >= args.warmup:
            fills.append(fill)
            waits.append(wait)
        toks = sample_allowed(bitmask, tok.eos_token_id, rng, shifts)
    stop()
    os.sched_setaffinity(0, set(cores))
    del bitmask
    shm.close()
    shm.unlink()
    return {"placement": placement, "fill_ms": statistics.median(fills) * 1e3,
            "wait_ms": statistics.median(waits) * 1e3, "us_per_row": statistics.median(fills) * 1e6 / R}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=os.environ.get("PAGEDLLM_TOKENIZER_DIR"))
    p.add_argument("--rows", type=int, default=148)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--xg-threads", type=int, default=1)
    p.add_argument("--main-work", type=int, default=400_000, help="length of the list the main thread sums a step")
    p.add_argument("--placements", default="thread,pinned,procs:2,procs:4,procs:8")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    import xgrammar as xgr

    tok, info = _tokenizer_info(args.tokenizer)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    results = []
    for placement in args.placements.split(","):
        r = run(args, placement, compiled, info, tok)
        results.append(r)
        print(f"{placement:>10}: fill {r['fill_ms']:.2f} ms ({r['us_per_row']:.1f} us a row), "
              f"main thread waited {r['wait_ms']:.2f} ms", flush=True)
    print(f"\n{args.rows} rows, {args.steps} steps ({args.warmup} warm-up), xgrammar threads {args.xg_threads}, "
          f"{len(os.sched_getaffinity(0))} cores")
    print("| placement | fill ms | us a row | main waits ms |\n|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['placement']} | {r['fill_ms']:.2f} | {r['us_per_row']:.1f} | {r['wait_ms']:.2f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    random.seed(0)
    main()
