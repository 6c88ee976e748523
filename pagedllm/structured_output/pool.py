"""Grammar worker processes: the matchers of constrained requests live in P processes of their
own, and a step's masks are filled by all of them at once into one shared-memory bitmask.

Why processes (benchmarks/grammar_fill_bench.py, RESULTS.md): filling a JSON-schema row's mask
costs xgrammar ~7-13 us with its data in cache and 35-40 us inside the engine on the H200 host,
where the grammar thread shares the interpreter (its Python parts wait for the GIL while the
engine thread runs) and its core's caches with the engine; xgrammar's own batch fill does not
scale over threads there. A worker process has neither problem: it owns its rows' matchers,
sits pinned to a core of its own, and P of them split the rows.

    runner (engine thread)        new / release / accept  ──▶  queued per worker
    grammar step (grammar thread) flush: (queued ops, rows to fill) ──▶ worker w: apply, fill
                                  ◀── fill seconds (only workers with rows to fill answer)
                                  copy the filled rows of the shared bitmask out

A request is owned by one worker (the one with the fewest live grammars when it arrives); the
worker compiles its grammar from the request's spec (xgrammar's compiler, cached in the worker:
~20 ms once per distinct grammar per worker, while the engine compiled it already to validate
it) and builds the matcher from the output so far, so preemption needs nothing else. Messages to
one worker are applied in order, so an accept queued by `collect` lands before the next fill.
The workers are plain subprocesses (`python -c`, so a user's script is never imported in them),
each holding one end of a socket pair (its descriptor passed at spawn); the bitmask is a file
in /dev/shm that each maps shared. A worker exits when its connection closes (the engine exited
or died).

PAGEDLLM_GRAMMAR_PROCS=N sets the count (0: matchers in the engine process, as on the CPU);
the default on CUDA is min(4, cores // 4) on hosts with at least 8 cores, else 0.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.structured_output.matcher import GRAMMAR_TIMES, bitmask_width

logger = logging.getLogger(__name__)

_NEW, _DROP, _ACCEPT = 0, 1, 2


def default_num_procs(device_type: str) -> int:
    env = os.environ.get("PAGEDLLM_GRAMMAR_PROCS")
    if env is not None:
        return max(0, int(env))
    if device_type != "cuda":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(4, cores // 4) if cores >= 8 else 0


@dataclass(slots=True, eq=False)
class RemoteGrammar:
    """A request's matcher, held by worker `worker` under id `gid`."""

    worker: int
    gid: int


class GrammarPool:
    def __init__(self, tokenizer_info_json: str, vocab_size: int, max_rows: int, num_procs: int) -> None:
        import tempfile
        from multiprocessing.connection import Pipe

        assert num_procs >= 1
        self.max_rows = max_rows
        width = bitmask_width(vocab_size)
        # the shared bitmask: a file in /dev/shm (memory), mapped shared here and in each worker;
        # removed once the workers have mapped it (the mappings outlive the name)
        fd, self._shm_path = tempfile.mkstemp(prefix="pagedllm-grammar-",
                                              dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.ftruncate(fd, max_rows * width * 4)
        os.close(fd)
        self.bitmask = torch.from_file(self._shm_path, shared=True, size=max_rows * width,
                                       dtype=torch.int32).view(max_rows, width)
        self.bitmask.fill_(-1)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        pin = len(cores) >= 2 * num_procs + 2  # room left for the engine's own threads
        # Plain subprocesses, not multiprocessing's spawn: spawn imports the parent's __main__ in
        # each child, which re-runs a user's script that builds its LLM at top level. Each gets
        # one end of a socket pair: nothing else can connect to it.
        self._tokenizer_info_json = tokenizer_info_json
        self._procs = []
        self._conns: list[Any] = []
        for w in range(num_procs):
            core = cores[-1 - w] if pin else -1
            ours, theirs = Pipe(duplex=True)
            fd = theirs.fileno()
            env = dict(os.environ, PAGEDLLM_GRAMMAR_WORKER=f"{core} {self._shm_path} {max_rows} {vocab_size} {fd}",
                       OMP_NUM_THREADS="1")
            self._procs.append(subprocess.Popen(
                [sys.executable, "-c", "from pagedllm.structured_output.pool import _worker_entry; _worker_entry()"],
                env=env, stdin=subprocess.DEVNULL, pass_fds=(fd,)))
            theirs.close()
            self._conns.append(ours)
        self._ops: list[list[tuple]] = [[] for _ in range(num_procs)]
        self._live = [0] * num_procs
        self._next_gid = 0
        self._lock = threading.Lock()  # the engine thread queues while a grammar thread flushes
        self._started = False
        self._finalizer = weakref.finalize(self, _shutdown, self._conns, self._procs, self._shm_path)

    @property
    def num_procs(self) -> int:
        return len(self._conns)

    def _wait_started(self) -> None:
        """Waits for each worker's hello and hands it the tokenizer (at the first fill); a worker
        that died or stays silent for 120 s is an error."""
        if self._started:
            return
        for expect in ("hello", "ready"):
            for w, c in enumerate(self._conns):
                msg = None
                try:
                    if c.poll(120):
                        msg = c.recv()
                except (EOFError, OSError):
                    pass
                if msg != expect:
                    raise RuntimeError(f"grammar worker {w} failed to start (exit code {self._procs[w].poll()}): "
                                       f"{msg if msg is not None else 'no answer'}")
                if expect == "hello":
                    c.send(self._tokenizer_info_json)
        _remove(self._shm_path)
        self._started = True

    # ---- engine thread -------------------------------------------------------------------
    def new(self, so: Any, compiled: Any, output_token_ids: list[int]) -> RemoteGrammar:
        """`compiled` is unused: the owning worker compiles `so` itself (see the module docstring)."""
        with self._lock:
            w = min(range(len(self._live)), key=self._live.__getitem__)
            self._live[w] += 1
            gid = self._next_gid
            self._next_gid += 1
            self._ops[w].append((_NEW, gid, so, list(output_token_ids)))
        return RemoteGrammar(w, gid)

    def release(self, g: RemoteGrammar) -> None:
        with self._lock:
            self._live[g.worker] -= 1
            self._ops[g.worker].append((_DROP, g.gid))

    def accept(self, grammars: list[RemoteGrammar], tokens: list[int]) -> None:
        """grammars[i] accepts tokens[i], at the workers' next message (before any later fill)."""
        per: list[tuple[list[int], list[int]]] = [([], []) for _ in self._conns]
        for g, t in zip(grammars, tokens):
            per[g.worker][0].append(g.gid)
            per[g.worker][1].append(t)
        with self._lock:
            for w, (gids, toks) in enumerate(per):
                if gids:
                    self._ops[w].append((_ACCEPT, gids, toks))

    # ---- the grammar step ----------------------------------------------------------------
    def fill(self, grammars: list[RemoteGrammar], pin: bool) -> torch.Tensor:
        """[G, W] int32 on the host: row g allows what grammars[g] allows next."""
        if len(grammars) > self.max_rows:
            raise RuntimeError(f"{len(grammars)} constrained rows in one step, the pool holds {self.max_rows}")
        self._wait_started()
        fills: list[tuple[list[int], list[int]]] = [([], []) for _ in self._conns]
        for row, g in enumerate(grammars):
            fills[g.worker][0].append(g.gid)
            fills[g.worker][1].append(row)
        with self._lock:
            msgs = [(ops, gids, rows) for ops, (gids, rows) in zip(self._ops, fills)]
            self._ops = [[] for _ in self._conns]
        waiting = []
        for w, (ops, gids, rows) in enumerate(msgs):
            if ops or gids:
                self._conns[w].send((ops, gids, rows, bool(gids)))
                if gids:
                    waiting.append(w)
        worst = 0.0
        for w in waiting:
            reply = self._conns[w].recv()
            if isinstance(reply, str):
                raise RuntimeError(f"grammar worker {w} failed: {reply}")
            worst = max(worst, reply)
        GRAMMAR_TIMES["worker_fill"] += worst
        out = torch.empty((len(grammars), self.bitmask.shape[1]), dtype=torch.int32, pin_memory=pin)
        out.copy_(self.bitmask[: len(grammars)])
        return out

def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _shutdown(conns: list, procs: list, shm_path: str) -> None:
    for c in conns:
        try:
            c.send(None)
            c.close()
        except (OSError, BrokenPipeError):
            pass
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    _remove(shm_path)


def _worker_entry() -> None:
    """A grammar worker's process (started by GrammarPool with its facts in the environment)."""
    from multiprocessing.connection import Connection

    core, shm_path, rows, vocab, fd = os.environ.pop("PAGEDLLM_GRAMMAR_WORKER").split()
    width = bitmask_width(int(vocab))
    bitmask = torch.from_file(shm_path, shared=True, size=int(rows) * width, dtype=torch.int32).view(int(rows), width)
    conn = Connection(int(fd))
    try:
        conn.send("hello")
        info_json = conn.recv()
    except (EOFError, OSError):  # the engine is gone
        return
    if info_json is None:  # shut down before the first fill
        return
    try:
        _worker_main(conn, info_json, int(vocab), bitmask, None if core == "-1" else int(core))
    except (BrokenPipeError, ConnectionResetError):  # the engine closed its end: nothing to answer
        pass


def _worker_main(conn: Any, tokenizer_info_json: str, vocab_size: int, bitmask: torch.Tensor,
                 core: int | None) -> None:
    try:
        os.environ["PAGEDLLM_GRAMMAR_THREADS"] = "1"  # matcher.fill_rows' batch fill: this process's core only
        torch.set_num_threads(1)
        if core is not None:
            os.sched_setaffinity(0, {core})
        import xgrammar as xgr

        from pagedllm.structured_output.manager import StructuredOutputManager
        from pagedllm.structured_output.matcher import RequestGrammar, accept_tokens, fill_rows, new_matcher

        info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
        mgr = StructuredOutputManager(None, vocab_size, frozenset(), max_threads=1, tokenizer_info=info)
        grammars: dict[int, RequestGrammar] = {}
        view = bitmask.numpy()
    except Exception as e:  # noqa: BLE001 - reported to the engine, which raises it
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        ops, gids, rows, reply = msg
        try:
            t0 = time.perf_counter()
            for op in ops:
                if op[0] == _NEW:
                    _, gid, so, tokens = op
                    grammars[gid] = RequestGrammar(new_matcher(mgr.compile(so)), tokens)
                elif op[0] == _DROP:
                    grammars.pop(op[1], None)
                else:  # a request released since its step launched: its tokens go nowhere
                    live = [(grammars[g], t) for g, t in zip(op[1], op[2]) if g in grammars]
                    accept_tokens([g for g, _ in live], [t for _, t in live])
            if gids:
                view[rows] = -1
                fill_rows(bitmask, [grammars[g] for g in gids], rows)
            if reply:
                conn.send(time.perf_counter() - t0)
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001
            logger.exception("grammar worker failed")
            if reply:
                conn.send(f"{type(e).__name__}: {e}")
