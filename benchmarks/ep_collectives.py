"""The collectives an expert-parallel MoE layer could use, timed at Qwen3-30B-A3B's shapes
(hidden 2048, 128 experts, top-8) on 2 ranks: gloo on the CPU (what CI runs), NCCL with
--device cuda on 2 GPUs.

- all-reduce of [T, H] (what pagedllm does: attention is tensor parallel, so every rank already
  holds every token; each rank runs its experts on them and one all-reduce sums the outputs);
- all-gather + reduce-scatter (the same volume, for ranks that each hold T / 2 tokens, as under
  data-parallel attention);
- all-to-all dispatch + combine (each rank holds T / 2 tokens and sends every token to the other
  rank once if any of its k experts lives there, then gets the partial outputs back): sizes known
  only after routing, so the split sizes cross first (one more small exchange).

    python benchmarks/ep_collectives.py                     # gloo, 2 processes on this machine
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, EXPERTS, TOP_K = 2048, 128, 8


def _timed(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _rank(rank: int, world: int, port: int, device: str, tokens: list[int], iters: int, out) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=world)
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(rank)
    rows = []
    for t in tokens:
        x = torch.randn(t, HIDDEN, device=dev)
        half = torch.randn(max(t // world, 1), HIDDEN, device=dev)
        gathered = torch.empty(half.shape[0] * world, HIDDEN, device=dev)
        ids = torch.rand(half.shape[0], EXPERTS, generator=g).topk(TOP_K, dim=1).indices
        # experts [r * E/world, (r+1) * E/world) live on rank r: the tokens that need the other rank
        other = ((ids // (EXPERTS // world)) != rank).any(dim=1)
        send_rows = int(other.sum())
        splits = torch.tensor([0] * world)
        splits[1 - rank] = send_rows

        def all_reduce():
            dist.all_reduce(x)
            sync()

        def gather_scatter():
            dist.all_gather_into_tensor(gathered, half)
            dist.reduce_scatter_tensor(half, gathered)
            sync()

        def all_to_all():
            recv_splits = torch.empty_like(splits)
            dist.all_to_all_single(recv_splits, splits)  # the sizes first
            send = half[other]
            recv = torch.empty(int(recv_splits.sum()), HIDDEN, device=dev)
            dist.all_to_all_single(recv, send, recv_splits.tolist(), splits.tolist())  # dispatch
            back = torch.empty_like(send)
            dist.all_to_all_single(back, recv, splits.tolist(), recv_splits.tolist())  # combine
            sync()

        rows.append((t, _timed(all_reduce, iters), _timed(gather_scatter, iters), _timed(all_to_all, iters),
                     send_rows))
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tokens", default="1,16,256,2048")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    tokens = [int(x) for x in args.tokens.split(",")]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args.device, tokens, args.iters, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    rows = out.get(timeout=600)
    for proc in procs:
        proc.join(60)
    print(f"2 ranks, {args.device} ({'nccl' if args.device == 'cuda' else 'gloo'}), hidden {HIDDEN}, "
          f"{EXPERTS} experts, top-{TOP_K}, float32; median of {args.iters} (ms)")
    print(f"{'tokens':>7} {'all-reduce [T,H]':>17} {'all-gather+reduce-scatter':>26} {'all-to-all x2 (+sizes)':>23} "
          f"{'rows sent':>10}")
    for t, ar, gs, a2a, sent in rows:
        print(f"{t:>7} {ar:>17.3f} {gs:>26.3f} {a2a:>23.3f} {sent:>10}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
