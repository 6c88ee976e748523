"""Calls between @triton.jit functions pass every constexpr parameter that has a default.

Triton 3.6 (the GPU image's) does not bind a called device function's defaulted constexpr the way
the 3.9 here does: a string default reaches the callee as a plain str and compiling fails
("'str' object has no attribute 'type'"); the same kernels compile here. So a helper's default
that its callers leave out is a kernel that works on this machine and on no GPU: every decode
kernel failed to compile on the H200 from 3148ace (the K/V loads' `CACHE` left to its default
"") until 72849f4. Only a string default was seen to fail (an int one compiled); the check asks every
defaulted constexpr to be passed, which costs the callers nothing. Launches (`kernel[grid](...)`) bind
defaults on the host and are not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pagedllm"


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d).split("(")[0].split(".")[-1] for d in fn.decorator_list)


def _defaulted_constexprs(fn: ast.FunctionDef) -> list[tuple[int, str]]:
    """(position, name) of the parameters annotated tl.constexpr that have a default."""
    args = fn.args.args
    first = len(args) - len(fn.args.defaults)
    return [(i, a.arg) for i, a in enumerate(args)
            if i >= first and a.annotation is not None and "constexpr" in ast.unparse(a.annotation)]


def _jit_functions(trees: dict[Path, ast.Module]) -> list[tuple[Path, ast.FunctionDef]]:
    return [(path, node) for path, tree in trees.items() for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and _is_jit(node)]


def omitted_defaults(package: Path) -> list[str]:
    """Each call inside a jit function to a jit function of the package (by name) that leaves out a
    defaulted constexpr parameter: "file:line name(missing, ...)"."""
    trees = {p: ast.parse(p.read_text()) for p in sorted(package.rglob("*.py"))}
    functions = _jit_functions(trees)
    defaults: dict[str, list[list[tuple[int, str]]]] = {}
    for _, fn in functions:
        defaults.setdefault(fn.name, []).append(_defaulted_constexprs(fn))
    found = []
    for path, fn in functions:
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in defaults):
                continue
            keywords = {k.arg for k in call.keywords}
            for params in defaults[call.func.id]:
                missing = [n for i, n in params if i >= len(call.args) and n not in keywords]
                if missing:
                    where = f"{path.relative_to(package.parent)}:{call.lineno}"
                    found.append(f"{where} {call.func.id}({', '.join(missing)})")
    return found


def test_device_calls_pass_their_constexpr_defaults():
    assert omitted_defaults(PACKAGE) == []


def test_the_check_finds_an_omitted_default(tmp_path):
    """The pattern 3148ace shipped (a helper's CACHE left to its default) is reported; passed, it is not."""
    src = '''
import triton
import triton.language as tl


@triton.jit
def _rows(p, offs, CACHE: tl.constexpr = ""):
    return tl.load(p + offs, cache_modifier=CACHE)


@triton.jit
def _kernel(p, o):
    offs = tl.arange(0, 16)
    tl.store(o + offs, _rows(p, offs))
    tl.store(o + offs, _rows(p, offs, ".cg"))
    tl.store(o + offs, _rows(p, offs, CACHE=""))
'''
    (tmp_path / "k.py").write_text(src)
    assert omitted_defaults(tmp_path) == [f"{tmp_path.name}/k.py:14 _rows(CACHE)"]
