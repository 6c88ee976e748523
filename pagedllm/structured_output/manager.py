"""StructuredOutputManager: compiles a request's grammar with xgrammar, caches the result.

Compilation runs where the caller is: the server calls `compile` from its thread pool before
the request reaches the engine, so the step loop only ever sees cache hits; the offline engine
compiles in `add_request`. A grammar that does not compile raises `ValueError` naming
`structured_outputs` and the engine's message (a 400 from the server), and nothing else is
touched. The cache is an LRU of compiled grammars keyed by the request's spec; xgrammar keeps a
second cache of its own below it.

Why xgrammar (measured on SmolLM2's 49,152-token vocabulary, a nested JSON schema with a
pattern, one thread; see benchmarks/RESULTS.md): compile 7 ms (llguidance 1.3 ms), next-token
mask median 1.8 us / max 85 us (llguidance 15.9 us / 1.4 ms); JSON schema, regex, EBNF and Lark,
and a threaded batch fill. The mask is what runs every step, so xgrammar.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

from pagedllm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHE_SIZE = 512
# Whitespace characters allowed at one place of a JSON text: room for any indentation a model
# writes, yet a model that only wants spaces (a random one, a looping one) must move on.
_MAX_WHITESPACE = 24
_ENGINE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # "[22:01:55] /project/cpp/x.cc:94: "


def _choice_grammar(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def looks_like_lark(grammar: str) -> bool:
    """EBNF (GBNF) rules use `::=`; Lark rules use `name: ...`."""
    return "::=" not in grammar


class StructuredOutputManager:
    """One per engine (and per worker process that needs to compile for itself)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], max_threads: int = 8,
                 tokenizer_info: Any = None):
        """`tokenizer_info`: an xgrammar TokenizerInfo to use as it is (a grammar worker process
        gets its engine's); else one is built from `tokenizer` and the EOS ids."""
        import xgrammar as xgr

        self.vocab_size = vocab_size
        if tokenizer_info is None:
            # an EOS id past the model's vocabulary (a config whose vocabulary was cut) can never
            # be sampled: a grammar that ends there would allow no token at all
            stops = sorted(t for t in eos_token_ids if t < vocab_size)
            tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                stop_token_ids=stops or None)
        self.tokenizer_info = tokenizer_info
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_cache_hits = 0

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The compiled grammar of `so` (also stored in `so.compiled`); ValueError if it does
        not compile."""
        if so.compiled is not None:
            return so.compiled
        key = so.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
        if hit is None:
            try:
                hit = self._compile(so)
            except (RuntimeError, ValueError, TypeError) as e:
                msg = _ENGINE_PREFIX.sub("", str(e).strip().splitlines()[-1]) if str(e).strip() else type(e).__name__
                raise ValueError(f"structured_outputs: the {so.kind} grammar does not compile: {msg}") from None
            with self._lock:
                self._cache[key] = hit
                self.num_compiled += 1
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        so.compiled = hit
        return hit

    def _compile(self, so: StructuredOutputsParams) -> Any:
        c = self.compiler
        kind = so.kind
        if kind == "json":
            kwargs: dict[str, Any] = {"any_whitespace": not so.disable_any_whitespace}
            if so.disable_any_whitespace:
                kwargs["separators"] = (",", ":")
            else:
                kwargs["max_whitespace_cnt"] = _MAX_WHITESPACE
            return c.compile_json_schema(so.spec, **kwargs)
        if kind == "json_object":
            if so.disable_any_whitespace:
                return c.compile_builtin_json_grammar()
            return c.compile_json_schema('{"type": "object"}', max_whitespace_cnt=_MAX_WHITESPACE)
        if kind == "regex":
            return c.compile_regex(so.regex)
        if kind == "choice":
            return c.compile_grammar(_choice_grammar(so.choice))
        if kind == "grammar":
            g = so.grammar
            return c.compile_lark(g) if looks_like_lark(g) else c.compile_grammar(g)
        if kind == "structural_tag":
            return c.compile_structural_tag(so.structural_tag)
        raise ValueError(f"structured_outputs: unknown kind {kind!r}")
