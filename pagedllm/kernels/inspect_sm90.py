"""Compiling Triton kernels for the H200 (sm_90) on a machine without a GPU, and reading back
what the compiler made of them: for tests that check a kernel's PTX (tests/unit/*_interpret.py)
and for benchmarks/decode_resources.py (registers, spills, shared memory per config). Needs
only Triton's bundled toolchain (ptxas, cuobjdump); nothing here runs a kernel."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from typing import Any


def compile_sm90(kernel: Any, signature: dict, constexprs: dict, num_warps: int, num_stages: int,
                 aligned: tuple[str, ...] = (), maxnreg: int | None = None, capability: int = 90) -> Any:
    """`kernel` compiled for sm_90 (or the `capability` given: 80 an A100, 89 an L4), with the
    16-divisibility hints a real launch gives aligned pointers and the integer arguments named in
    `aligned` (without them the loads are neither vectorized nor pipelined, so the code would not be
    what the device runs)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # constexprs left out take their defaults (a launch would), all in parameter order; so do the
    # other parameters with a default that the signature leaves out (a launch that does not pass
    # them: None pointers are constexpr there too)
    constexprs = {p.name: constexprs[p.name] if p.name in constexprs else p.default for p in kernel.params
                  if p.name in constexprs or (p.name not in signature and p.default is not inspect.Parameter.empty)}
    position = {p.name: i for i, p in enumerate(kernel.params)}
    hinted = [n for n, t in signature.items() if t.startswith("*") or n in aligned]
    attrs = {(position[n],): [["tt.divisibility", 16]] for n in hinted}
    types = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(fn=kernel, signature={n: types[n] for n in sorted(types, key=position.__getitem__)},
                    constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:  # ptxas's register cap (a launch's maxnreg=)
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def _on_cubin(compiled: Any, tool: str, *args: str) -> str | None:
    """The output of one of Triton's bundled CUDA tools run on the kernel's cubin (None without it)."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if not os.path.exists(path):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([path, *args, f.name], capture_output=True, text=True).stdout


def resources(compiled: Any) -> dict | None:
    """What cuobjdump reports of a compiled kernel -- registers a thread, stack bytes (spills),
    shared memory bytes -- and whether its PTX has asynchronous copies and 16-byte global loads;
    None without Triton's cuobjdump."""
    usage = _on_cubin(compiled, "cuobjdump", "--dump-resource-usage")
    if usage is None:
        return None
    field = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", usage)}
    ptx = compiled.asm["ptx"]
    return {"regs": field.get("REG", 0), "stack": field.get("STACK", 0),
            "shared": max(field.get("SHARED", 0), compiled.metadata.shared),
            "cp_async": "cp.async" in ptx, "v4": bool(re.search(r"ld\.global[.a-z0-9]*\.v4", ptx))}


def sass(compiled: Any) -> str | None:
    """The kernel's SASS as nvdisasm prints it (None without Triton's nvdisasm)."""
    return _on_cubin(compiled, "nvdisasm", "-c")


def main_loop(sass_text: str) -> Counter:
    """The instructions of the largest loop of a SASS listing (the span of its longest backward
    branch), counted by opcode with the load/store width kept (LDS.U8, LDG.E.128 ...); empty when
    there is no loop. What one thread issues per iteration."""
    label_at: dict[str, int] = {}
    pending: list[str] = []
    insts: list[tuple[int, str]] = []
    for line in sass_text.splitlines():
        line = line.strip()
        label = re.match(r"\.(L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        inst = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if inst:
            addr = int(inst.group(1), 16)
            for name in pending:
                label_at[name] = addr
            pending = []
            insts.append((addr, inst.group(2).strip()))
    span = None
    for addr, text in insts:
        target = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", text)
        if target and label_at.get(target.group(1), addr) < addr:
            lo = label_at[target.group(1)]
            if span is None or addr - lo > span[1] - span[0]:
                span = (lo, addr)
    if span is None:
        return Counter()
    ops = Counter()
    for addr, text in insts:
        if span[0] <= addr <= span[1]:
            op = re.match(r"(?:@!?U?P\w+\s+)?(\S+)", text).group(1)
            ops[op if op.startswith(("LD", "ST")) else op.split(".")[0]] += 1
    return ops


DECODE_STRIDES = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks", "stride_kh",
                  "stride_vb", "stride_vs", "stride_vh", "stride_bt")


def decode_signature(cache: str) -> dict:
    """The runtime arguments of attention_decode's decode kernel, with a `cache` of Triton's
    type name ("bf16", "fp8e4nv")."""
    sig = {"q_ptr": "*bf16", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "block_tables_ptr": "*i32",
           "seq_lens_ptr": "*i32", "order_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32",
           "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "count_ptr": "*i32", "qk_scale": "fp32",
           "v_scale": "fp32"}
    sig.update(dict.fromkeys(DECODE_STRIDES, "i32"), window="i32", soft_cap="fp32")
    return sig
