"""What every child process of the engine shares, the tensor/pipeline ranks of
executor/multiproc.py and the data-parallel replicas of engine/dp_replica.py: exiting with the
parent, a send that does not raise on a closed pipe, the CPU threads a rank gets, and how an exit
status reads in an error."""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import threading


def cpu_threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def exit_with_parent() -> None:
    """In a child: a thread that ends the process when its parent dies."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)  # the engine is gone: nothing will ever ask this rank for anything again

    threading.Thread(target=watch, name="pagedllm-parent-watch", daemon=True).start()


def send_quietly(conn, msg) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
