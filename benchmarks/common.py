"""What the benchmark scripts share: machine set-up and description, a tokenizer for model
directories that hold only a config.json, the `transformers` peers (static `generate` batches and
continuous batching), and the result table.

The scripts drive pagedllm only through its public offline API (`LLM`, `SamplingParams`); the
peers run in the same process on the same weights, so a ratio from one run compares like with like.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


# ---- machine ---------------------------------------------------------------------------------
def num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def set_threads(n: int | None = None) -> int:
    """One intra-op thread per core, for our engine and the peers alike."""
    n = n or num_cores()
    torch.set_num_threads(n)
    return n


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cores": num_cores(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    info.update(source_revision())
    return info


def print_machine_line(machine: dict[str, Any]) -> None:
    """The closing line of a benchmark's report: when, where, which versions and commit."""
    print(f"\n{machine['date']}; {machine.get('gpu') or machine['cpu']}; {machine['cores']} cores; torch "
          f"{machine['torch']}, transformers {machine['transformers']}; load avg (1 min) {machine['load_avg_1m']}; "
          f"commit {machine.get('commit', '?')} with {machine.get('pagedllm_uncommitted_changes', '?')} "
          f"uncommitted changes under pagedllm/")


def source_revision() -> dict[str, Any]:
    """The commit measured, and whether pagedllm/ differed from it (others edit the tree)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", root, *a], capture_output=True, text=True,
                                  check=False, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return {}
    dirty = git("status", "--porcelain", "--", "pagedllm")
    return {"commit": commit, "pagedllm_uncommitted_changes": len(dirty.splitlines())}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def graph_time(fn, calls: int = 1, reps: int = 20, rounds: int = 5) -> float:
    """Device us per product of fn(), which runs `calls` products (layers with distinct weights, so
    none is served from L2): captured once in a CUDA graph as decode steps run, replayed `reps`
    times a round; the median of the rounds."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps / calls)
    return sorted(times)[len(times) // 2]


def release_memory() -> None:
    """Drop what a finished phase left behind before the next one sizes its cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_allocated_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.memory_allocated() / (1 << 30), 2)


def _machine_busy_seconds() -> float | None:
    """CPU seconds all processes spent busy since boot (from /proc/stat), or None."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class Stopwatch:
    """Times a phase three ways: wall seconds, this process's CPU seconds (all its threads),
    and the share of the machine's CPU that other processes took meanwhile. On a shared
    machine the last one says how far to trust the wall-clock figure."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    others_busy: float | None = None  # fraction of all cores, 0..1

    def __enter__(self) -> "Stopwatch":
        sync()
        self._busy = _machine_busy_seconds()
        self._cpu = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        sync()
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._cpu
        busy = _machine_busy_seconds()
        if busy is not None and self._busy is not None and self.seconds > 0:
            others = max(0.0, busy - self._busy - self.cpu_seconds)
            self.others_busy = min(1.0, others / (self.seconds * num_cores()))


def wait_for_quiet(max_wait: float, min_idle: float = 0.85, windows: int = 2, window_s: float = 5.0) -> None:
    """Before a timed phase on a shared machine: wait until the CPU has been at least min_idle
    idle for `windows` consecutive windows, or max_wait seconds have passed (then go anyway)."""
    if max_wait <= 0:
        return
    deadline = time.monotonic() + max_wait
    quiet = 0
    while time.monotonic() < deadline:
        b0, t0 = _machine_busy_seconds(), time.monotonic()
        time.sleep(window_s)
        b1, t1 = _machine_busy_seconds(), time.monotonic()
        if b0 is None or b1 is None:
            return
        idle = 1.0 - (b1 - b0) / ((t1 - t0) * num_cores())
        quiet = quiet + 1 if idle >= min_idle else 0
        if quiet >= windows:
            return
    print(f"(the machine did not get quiet within {max_wait:.0f} s; measuring anyway)", flush=True)


# ---- tokenizers for config-only model directories --------------------------------------------
def has_tokenizer_files(model_dir: str) -> bool:
    return os.path.isdir(model_dir) and any(
        os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES
    )


def synthetic_tokenizer(vocab_size: int, eos_token_id: int | None, out_dir: str) -> str:
    """Writes a word-level tokenizer with one token per id ("<t17>") to out_dir.

    A dummy-weight benchmark feeds token ids, so the engine needs a tokenizer only to detokenize
    its outputs; this one covers the whole vocabulary, so detokenizing costs what it would with
    a real one of that size rather than nothing.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = f"<t{eos_token_id}>" if eos_token_id is not None and 0 <= eos_token_id < vocab_size else None
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, unk_token="<t0>")
    os.makedirs(out_dir, exist_ok=True)
    tok.save_pretrained(out_dir)
    return out_dir


def first_eos(cfg: Any) -> int | None:
    eos = getattr(cfg, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        return int(eos[0]) if eos else None
    return eos


# ---- the transformers peers ------------------------------------------------------------------
def hf_model_from_config(model_dir: str, dtype: torch.dtype, device: str, seed: int):
    """The architecture of model_dir with random weights (the peer of load_format="dummy")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def hf_model_from_gguf(gguf_path: str, dtype: torch.dtype, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    return model.to(device).eval()


def hf_generation_config(model, temperature: float, max_new_tokens: int):
    """Greedy when temperature is 0, else plain temperature sampling (no top-k / top-p, as our
    SamplingParams defaults). No EOS: every row runs to max_new_tokens, as with ignore_eos."""
    from transformers import GenerationConfig

    kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": None}
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = first_eos(model.config)
    kw["pad_token_id"] = 0 if pad is None else pad
    return GenerationConfig(**kw)


@dataclass(slots=True)
class PeerResult:
    name: str
    seconds: float
    useful_tokens: int  # each request's own max_tokens, summed
    generated_tokens: int  # rows x steps actually computed, padding waste included
    outputs: list[list[int]] = field(repr=False)
    note: str = ""
    cpu_seconds: float = 0.0
    others_busy: float | None = None


@torch.inference_mode()
def run_hf_static(model, prompts: list[list[int]], max_tokens: list[int], batch_size: int,
                  temperature: float) -> PeerResult:
    """Left-padded static batches in the given order; each batch runs until its longest
    request's max_tokens, and only each request's own max_tokens count as useful."""
    device = model.device
    gen = hf_generation_config(model, temperature, 1)
    pad = gen.pad_token_id
    outputs: list[list[int]] = []
    generated = 0
    watch = Stopwatch().__enter__()
    for s in range(0, len(prompts), batch_size):
        batch, wants = prompts[s : s + batch_size], max_tokens[s : s + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        gen.max_new_tokens = max(wants)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             generation_config=gen)
        new = out[:, width:].tolist()
        if len(new[0]) != max(wants):
            raise RuntimeError(f"peer batch stopped after {len(new[0])} tokens, expected {max(wants)}")
        generated += len(batch) * max(wants)
        outputs.extend(row[:w] for row, w in zip(new, wants))
    watch.__exit__()
    return PeerResult(f"hf generate, static batch {batch_size}", watch.seconds, sum(max_tokens), generated, outputs,
                      cpu_seconds=watch.cpu_seconds, others_busy=watch.others_busy)


@torch.no_grad()  # not inference_mode: CB updates its tensors from its own thread
def run_hf_cb(model, prompts: list[list[int]], max_tokens: list[int], temperature: float,
              cb_kwargs: dict[str, Any] | None = None, warmup_prompt: list[int] | None = None) -> PeerResult:
    """transformers continuous batching (`init_continuous_batching`), per-request max_new_tokens,
    EOS disabled. The manager is built, warmed up and started before the clock starts."""
    import inspect

    gen = hf_generation_config(model, temperature, max(max_tokens))
    init_kw: dict[str, Any] = {"generation_config": gen}
    if cb_kwargs:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        if "continuous_batching_config" in inspect.signature(model.init_continuous_batching).parameters:
            init_kw["continuous_batching_config"] = ContinuousBatchingConfig(**cb_kwargs)
        else:  # older transformers read these from the generation config
            for k, v in cb_kwargs.items():
                setattr(gen, k, v)
    manager = model.init_continuous_batching(**init_kw)
    if hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    try:
        def collect(ids: list[str]) -> dict[str, list[int]]:
            want, done = set(ids), {}
            while want - done.keys():
                res = manager.get_result(timeout=1)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers continuous batching stopped unexpectedly")
                    continue
                if res.is_finished() and res.request_id in want:
                    if getattr(res, "error", None):
                        raise RuntimeError(f"transformers continuous batching: {res.error}")
                    done[res.request_id] = list(res.generated_tokens)
            return done

        # the generation config has no EOS, which the manager turns into -1 (disabled); say it
        # per request too where add_request takes it
        no_eos = {"eos_token_id": -1} if "eos_token_id" in inspect.signature(manager.add_request).parameters else {}
        if warmup_prompt is not None:
            collect([manager.add_request(warmup_prompt, request_id="warmup", max_new_tokens=4, **no_eos)])
        with Stopwatch() as watch:
            ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=m, **no_eos)
                   for i, (p, m) in enumerate(zip(prompts, max_tokens))]
            done = collect(ids)
    finally:
        manager.stop(block=True, timeout=30)
        if hasattr(manager, "destroy"):
            manager.destroy()
    outputs = [done[i] for i in ids]
    for o, m in zip(outputs, max_tokens):
        if len(o) != m:
            raise RuntimeError(f"peer request produced {len(o)} tokens, expected {m}")
    attn = getattr(model.config, "_attn_implementation", "?")
    return PeerResult("hf continuous batching", watch.seconds, sum(max_tokens), sum(max_tokens), outputs,
                      note=f"attn={attn}", cpu_seconds=watch.cpu_seconds, others_busy=watch.others_busy)


# ---- comparing and reporting -----------------------------------------------------------------
def agreement(ours: list[list[int]], peer: list[list[int]]) -> tuple[int, float]:
    """(requests whose outputs are identical, mean fraction of the leading tokens that agree).
    Only meaningful for greedy decoding of the same weights."""
    same, frac = 0, 0.0
    for a, b in zip(ours, peer):
        same += a == b
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        frac += n / max(len(a), 1)
    return same, frac / max(len(ours), 1)


@dataclass(slots=True)
class Row:
    engine: str
    useful_tokens: int
    generated_tokens: int
    seconds: float
    note: str = ""
    cpu_seconds: float = 0.0
    others_busy: float | None = None  # share of the machine's CPU other processes took meanwhile

    @property
    def tok_per_s(self) -> float:
        return self.useful_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tok_per_cpu_s(self) -> float:
        return self.useful_tokens / self.cpu_seconds if self.cpu_seconds > 0 else float("nan")


def print_table(rows: list[Row], ours: Row) -> None:
    """`computed` counts padded rows too; `others` is the share of the machine's CPU that other
    processes used during the phase (0% = a quiet machine)."""
    head = (f"{'engine':<32} {'output tok':>10} {'computed':>9} {'seconds':>8} {'useful tok/s':>13} "
            f"{'ours/peer':>10} {'CPU s':>7} {'tok/CPU s':>10} {'others':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = "" if r is ours else f"{ours.tok_per_s / r.tok_per_s:.2f}x"
        others = "?" if r.others_busy is None else f"{100 * r.others_busy:.0f}%"
        print(f"{r.engine:<32} {r.useful_tokens:>10} {r.generated_tokens:>9} {r.seconds:>8.2f} "
              f"{r.tok_per_s:>13.1f} {ratio:>10} {r.cpu_seconds:>7.1f} {r.tok_per_cpu_s:>10.1f} {others:>7}")
        if r.note:
            print(f"{'':<32}   {r.note}")


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def default(o: Any) -> Any:
        if isinstance(o, Row):
            return {**asdict(o), "tok_per_s": o.tok_per_s, "tok_per_cpu_s": o.tok_per_cpu_s}
        return str(o)

    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2, default=default)
    print(f"wrote {path}")
