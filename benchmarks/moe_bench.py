"""W5 (MoE) in one process run: Qwen3-30B-A3B with random weights (configs/qwen3-30b-a3b, bf16),
pagedllm against transformers on the same architecture (see docs/benchmarks.md).

1. the experts alone at Qwen3-30B-A3B's shapes (CUDA): microseconds per layer and the bandwidth
   of the expert weights they read, at 1, 8, 64 and 256 tokens (fused_experts_triton's choice and
   the grouped GEMMs), and a few grouped tile configurations at batch 1; with --small-sweep, the
   small-batch path (fused_moe_small_triton.py) against the grouped one at 1, 2, 4, 8 tokens and
   a sweep of its tiles, each checked against the torch reference before it is timed;
2. pagedllm: batch-1 latency (W2's method: a 128-token prompt, 256 output tokens, greedy; ms per
   output token of the decode), then W1 (256 requests, prompts of [100, 1024] random ids,
   max_tokens in [100, 1024], temperature 0.6), then the shortened W1 the peer runs;
3. transformers: batch-1 `generate` (32 new tokens), then continuous batching on the shortened W1
   (the first --peer-num-prompts requests, max_tokens capped at --peer-max-tokens), stopped after
   --peer-deadline seconds: a peer that did not finish is reported as an upper bound of its rate
   (all the tokens it was asked for, over the deadline), so the ratio is a lower bound.

    python benchmarks/moe_bench.py --output-json $OUT/w5.json          # on the H200
    python benchmarks/moe_bench.py --skip-latency --small-sweep --output-json $OUT/moe_small.json  # kernels only
    python benchmarks/moe_bench.py --tiny --w1-num-prompts 4 --peer-num-prompts 2   # CPU smoke test
    python benchmarks/moe_bench.py --skip-kernels --skip-latency --router-ab   # router + top-k, ~20 s

--router-ab: the router's product and top-k at 1, 2, 4 tokens, each of 48 layers with its own gate
weight, in one CUDA graph: cuBLAS (float32 out) + the top-k kernel, the swap-AB kernel + the
top-k kernel (PAGEDLLM_FUSED_ROUTER=0), and the fused router (the default: small_m.route_small,
one launch); the routing checked equal first.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import latency  # noqa: E402
import moe_kernels  # noqa: E402
import throughput  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# a Qwen3-MoE small enough for a CPU smoke run of this script
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=12000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(HERE, "configs", "qwen3-30b-a3b"))
    p.add_argument("--tiny", action="store_true", help="shrink the model (CPU smoke test of this script)")
    p.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency-iters", type=int, default=2)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--w1-num-prompts", type=int, default=256)
    p.add_argument("--peer-num-prompts", type=int, default=64)
    p.add_argument("--peer-max-tokens", type=int, default=128)
    p.add_argument("--peer-deadline", type=float, default=90.0)
    p.add_argument("--peer-latency-tokens", type=int, default=32)
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--small-sweep", action="store_true",
                   help="with the kernel timings: the small-batch path against the grouped one at 1-8 tokens")
    p.add_argument("--skip-latency", action="store_true", help="kernel timings only (no engine)")
    p.add_argument("--router-ab", action="store_true", help="router + top-k: unfused against fused, 1-4 tokens")
    p.add_argument("--skip-w1", action="store_true", help="batch-1 latency only (and the peer's)")
    p.add_argument("--skip-peer-cb", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def _hf_config(args):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(args.model)
    for k, v in (TINY if args.tiny else {}).items():
        setattr(cfg, k, v)
    return cfg


def ours_latency(llm, args, vocab: int) -> dict:
    from pagedllm import SamplingParams

    rng = random.Random(args.seed + 1)
    n = args.output_len

    def prompt():
        return [rng.randrange(min(vocab, 10000)) for _ in range(128)]

    def timed(p, params):
        common.sync()
        t0 = time.perf_counter()
        out = llm.generate([p], params, use_tqdm=False)[0]
        common.sync()
        return time.perf_counter() - t0, out

    timed(prompt(), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    ttft, e2e, tokens = [], [], []
    for _ in range(args.latency_iters):
        t, _ = timed(prompt(), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        e, out = timed(prompt(), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == n
        ttft.append(t)
        e2e.append(e)
        tokens.append(list(out.outputs[0].token_ids))
    lat = latency.summarize("pagedllm LLM.generate", ttft, e2e, n, "W2 method, TTFT from a max_tokens=1 run")
    # greedy ids of the same seeded prompts and weights: two kernel paths can be compared by them
    lat["token_ids"] = tokens
    return lat


def shortened(prompts, max_tokens, args):
    return prompts[: args.peer_num_prompts], [min(m, args.peer_max_tokens) for m in max_tokens[: args.peer_num_prompts]]


# ---- 3. transformers ----------------------------------------------------------------------------
def peer_latency(model, args, vocab: int) -> dict:
    rng = random.Random(args.seed + 2)
    device = model.device
    n = args.peer_latency_tokens

    def timed(max_new):
        ids = torch.tensor([[rng.randrange(min(vocab, 10000)) for _ in range(128)]], device=device)
        gen = common.hf_generation_config(model, 0.0, max_new)
        common.sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        common.sync()
        assert out.shape[1] - ids.shape[1] == max_new
        return time.perf_counter() - t0

    timed(2)
    ttft = [timed(1), timed(1)]
    e2e = [timed(n)] * 2
    return latency.summarize("hf generate (default cache)", ttft, e2e, n, f"{n} new tokens")


def peer_cb(model, prompts, max_tokens, args, log) -> common.Row:
    """Continuous batching in a thread; past the deadline, the upper bound of its rate."""
    result: dict = {}

    def run():
        try:
            result["r"] = common.run_hf_cb(model, prompts, max_tokens, 0.6, warmup_prompt=prompts[0][:16])
        except Exception as ex:  # noqa: BLE001
            result["error"] = f"{type(ex).__name__}: {ex}"

    th = threading.Thread(target=run, daemon=True)
    t0 = time.perf_counter()
    th.start()
    th.join(args.peer_deadline)
    if "r" in result:
        r = result["r"]
        return common.Row(r.name, r.useful_tokens, r.generated_tokens, r.seconds, r.note)
    wanted = sum(max_tokens)
    why = result.get("error", f"not finished after {time.perf_counter() - t0:.0f} s (warm-up included)")
    log(f"transformers continuous batching: {why}")
    return common.Row("hf continuous batching (bound)", wanted, wanted, args.peer_deadline,
                      f"{why}: at most {wanted} tokens in {args.peer_deadline:.0f} s")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    cfg = _hf_config(args)
    report: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                    "machine": common.machine_info()}
    if cuda and not args.skip_kernels:
        log("1. experts alone (grouped: align + gate/up with SiLU-and-mul + down with the routing weight + sum over "
            "k; auto: fused_experts_triton's choice, the small path up to SMALL_MAX_PAIRS pairs)")
        report["kernels"] = moe_kernels.kernel_timings(cfg, log)
        if args.small_sweep:
            report["small_sweep"] = moe_kernels.small_sweep(cfg, log)
    if cuda and args.router_ab:
        report["router_ab"] = moe_kernels.router_timings(cfg, log)
    if args.skip_latency:
        common.write_json(args.output_json, report)
        return

    from pagedllm import LLM

    tmp = tempfile.TemporaryDirectory(prefix="pagedllm-bench-")
    tokenizer = common.synthetic_tokenizer(cfg.vocab_size, common.first_eos(cfg), os.path.join(tmp.name, "tok"))
    t0 = time.perf_counter()
    llm = LLM(args.model, tokenizer=tokenizer, load_format="dummy", dtype=args.dtype, seed=args.seed,
              max_model_len=4096, max_num_seqs=256, gpu_memory_utilization=args.gpu_memory_utilization,
              hf_overrides=TINY if args.tiny else {}, **({} if cuda else {"kv_cache_memory": "256MiB"}))
    log(f"2. pagedllm ready in {time.perf_counter() - t0:.1f} s")
    lat = ours_latency(llm, args, cfg.vocab_size)
    log(f"pagedllm batch 1: {lat['decode_ms_per_token']:.3f} ms/token (iters {lat['decode_ms_all_iters']}), "
        f"TTFT {lat['ttft_ms']:.1f} ms")
    w1 = argparse.Namespace(seed=args.seed, num_prompts=args.w1_num_prompts, prompt_len_range=[100, 1024],
                            output_len_range=[100, 1024])
    prompts, max_tokens = throughput.w1_requests(w1)
    sp, sm = shortened(prompts, max_tokens, args)
    ours_w1 = ours_short = None
    if not args.skip_w1:
        warm = [p[::-1] for p in prompts[:2]]
        ours_w1, _ = throughput.run_ours(llm, prompts, max_tokens, 0.6, warm)
        log(f"pagedllm W1: {ours_w1.useful_tokens} tokens in {ours_w1.seconds:.2f} s = {ours_w1.tok_per_s:.1f} tok/s")
        ours_short, _ = throughput.run_ours(llm, sp, sm, 0.6, warm)
        ours_short.engine = "pagedllm, shortened W1"
        log(f"pagedllm shortened W1 ({len(sp)} requests, max_tokens <= {args.peer_max_tokens}): "
            f"{ours_short.useful_tokens} tokens in {ours_short.seconds:.2f} s = {ours_short.tok_per_s:.1f} tok/s")
    llm.llm_engine.get_stats()  # queues the counters' copy to the host
    common.sync()
    stats = llm.llm_engine.get_stats()
    load = stats.expert_load
    if load:
        log(f"expert load (tokens per expert, all layers): min {min(load)}, max {max(load)}, "
            f"mean {sum(load) / len(load):.0f}; per rank {stats.expert_load_per_rank}")
    report.update(ours_latency=lat, ours_w1=ours_w1, ours_short=ours_short)
    llm.llm_engine.shutdown()
    del llm
    common.release_memory()
    log(f"GPU memory after releasing pagedllm: {common.gpu_allocated_gib()} GiB")

    peer_lat = peer_row = None
    if not args.skip_peer:
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, args.dtype)
        t0 = time.perf_counter()
        torch.manual_seed(args.seed)
        with torch.device("cuda" if cuda else "cpu"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        log(f"3. transformers model built in {time.perf_counter() - t0:.1f} s")
        try:
            peer_lat = peer_latency(model, args, cfg.vocab_size)
            log(f"transformers batch 1: {peer_lat['decode_ms_per_token']:.2f} ms/token")
        except Exception as ex:  # noqa: BLE001
            log(f"transformers generate failed: {type(ex).__name__}: {ex}")
        if not args.skip_peer_cb:
            peer_row = peer_cb(model, sp, sm, args, log)
            log(f"{peer_row.engine}: {peer_row.useful_tokens} tokens in {peer_row.seconds:.2f} s = "
                f"{peer_row.tok_per_s:.1f} tok/s")
        report.update(peer_latency=peer_lat, peer_cb=peer_row)

    log("")
    model_name = os.path.basename(args.model.rstrip("/")) + (" (tiny)" if args.tiny else "")
    log(f"W5 summary ({model_name}, {args.dtype}, dummy weights)")
    log(f"{'figure':<52} {'pagedllm':>12} {'transformers':>14} {'ratio':>8}")
    peer_ms = peer_lat["decode_ms_per_token"] if peer_lat else float("nan")
    log(f"{'batch-1 decode ms/token (<= 2.5)':<52} {lat['decode_ms_per_token']:>12.3f} {peer_ms:>14.2f} "
        f"{peer_ms / lat['decode_ms_per_token']:>7.1f}x")
    if peer_row is not None and ours_w1 is not None:
        log(f"{'W1 tok/s: full (ours) vs shortened (peer) (>= 20x)':<52} {ours_w1.tok_per_s:>12.1f} "
            f"{peer_row.tok_per_s:>14.1f} {ours_w1.tok_per_s / peer_row.tok_per_s:>7.1f}x")
        log(f"{'W1 tok/s: both on the shortened workload':<52} {ours_short.tok_per_s:>12.1f} "
            f"{peer_row.tok_per_s:>14.1f} {ours_short.tok_per_s / peer_row.tok_per_s:>7.1f}x")
    common.print_machine_line(report["machine"])
    report["log"] = lines
    common.write_json(args.output_json, report)
    tmp.cleanup()
    sys.stdout.flush()
    os._exit(0)  # a peer thread past its deadline may still be running


if __name__ == "__main__":
    main()
