"""Every `EngineArgs` field as a command-line flag, generated from the field's metadata
(engine/arg_utils.py: help, extra spellings, parser, choices, group), and the namespace turned
back into `EngineArgs`. Also the value parsers the server's own flags use, and the help
formatter and parser class of `pagedllm serve` (every default shown; a usage error ends with
one short error line).

No torch, no fastapi: `--help` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any, NoReturn

from pagedllm.config import EngineArgs
from pagedllm.engine.arg_utils import ACCEPTED, PENDING_ARGS, PENDING_SERVER_ARGS, check_pending
from pagedllm.engine.vllm_compat import parse_gib_or_size, parse_size

_HUMAN_INT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*$")
# As vLLM: a lowercase suffix is decimal (4k = 4000), an uppercase one binary (4K = 4096).
_MULTIPLIERS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


# ---- value parsers (argparse `type=`): a bad value is a usage error naming it ---------------------
def human_int(value: str) -> int:
    """An integer, also written with a suffix: 4k = 4000, 4K = 4096, 1m = 10**6, 1M = 2**20."""
    m = _HUMAN_INT.match(value)
    if not m:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 4k or 4K, got {value!r}")
    number = float(m.group(1)) * _MULTIPLIERS[m.group(2)]
    if number != int(number):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}")
    return int(number)


def positive_int(value: str) -> int:
    n = human_int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value!r}")
    return n


def non_negative_int(value: str) -> int:
    n = human_int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return n


def port(value: str) -> int:
    n = human_int(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {value!r}")
    return n


def non_negative_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return x


def fraction(value: str) -> float:
    x = non_negative_float(value)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value!r}")
    return x


def size(value: str) -> int:
    try:
        n = parse_size(value, "size")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB, 10G, 512M or 1073741824, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value!r}")
    return n


def gib_or_size(value: str) -> float:
    try:
        return parse_gib_or_size(value, "size")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB (4) or a size such as 10G, 10GiB or 512M, got {value!r}") from None


def json_value(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected JSON ({e.msg}), got {value!r}") from None


def _int(value: str) -> int:
    return human_int(value) if not value.strip().startswith("-") else -human_int(value.strip()[1:])


_PARSERS: dict[str, Any] = {
    "positive_int": positive_int, "non_negative_int": non_negative_int, "int": _int, "float": float,
    "non_negative_float": non_negative_float, "fraction": fraction, "size": size, "gib_or_size": gib_or_size,
    "json": json_value, "str": str,
}


# ---- help and errors ------------------------------------------------------------------------------
class HelpFormatter(argparse.HelpFormatter):
    """Every option's default is shown (unless its help already says "Default")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "Default" in text or "%(default)" in text or action.default is argparse.SUPPRESS:
            return text
        if not action.option_strings:
            return text
        default = action.default
        if default is None or (isinstance(default, (dict, list, tuple)) and not default):
            shown: Any = "none"
        elif isinstance(default, bool):
            shown = "on" if default else "off"
        elif isinstance(default, (list, tuple)):
            shown = " ".join(map(str, default))
        else:
            shown = default
        return f"{text} (default: {str(shown).replace('%', '%%')})"


class ArgumentParser(argparse.ArgumentParser):
    """A usage error prints one short usage line and, last, the error line (not the usage of
    every flag). No abbreviations: `--max-num-seq` is a typo, not `--max-num-seqs`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_short_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def print_short_usage(self, file: Any = None) -> None:
        print(f"usage: {self.prog} [MODEL] [options]   (see --help)" if self._has_model_tag() else
              f"usage: {self.prog} [options]   (see --help)", file=file or sys.stderr)

    def _has_model_tag(self) -> bool:
        return any(a.dest == "model_tag" for a in self._actions)


# ---- EngineArgs fields as flags --------------------------------------------------------------------
_GROUP_TITLES = {
    "model": "model", "cache": "KV cache", "scheduler": "scheduler", "parallel": "parallelism and device",
    "server": "server", "engine": "engine",
}


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _groups(parser: argparse.ArgumentParser) -> dict[str, Any]:
    found = {g.title: g for g in parser._action_groups}
    return found


def _group(parser: argparse.ArgumentParser, key: str) -> Any:
    title = _GROUP_TITLES.get(key, key)
    return _groups(parser).get(title) or parser.add_argument_group(title)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return None  # a mutable default: None on the CLI, the field's own default when not given
    return None


def add_engine_args(parser: argparse.ArgumentParser, engine_args_cls: type) -> None:
    """One flag per field of `engine_args_cls` (cli=False fields are declared by hand), then one
    per pending argument no field or flag has yet."""
    # the engine's own arguments first, the ones accepted for compatibility after them
    fields = sorted(dataclasses.fields(engine_args_cls), key=lambda f: f.metadata.get("status") == ACCEPTED)
    extra_flags: dict[str, list[str]] = {}
    for f in fields:
        target = f.metadata.get("alias_of")
        if target:
            extra_flags.setdefault(target, []).append(flag_name(f.name))
    for f in fields:
        meta = f.metadata
        if not meta.get("cli", True) or meta.get("alias_of"):
            continue
        default = meta["cli_default"] if meta.get("cli_default", dataclasses.MISSING) is not dataclasses.MISSING \
            else _field_default(f)
        names = [flag_name(f.name), *meta.get("flags", ()), *extra_flags.get(f.name, [])]
        names = [n for n in names if n not in parser._option_string_actions]
        kw: dict[str, Any] = dict(dest=f.name, default=default, help=meta["help"])
        ftype = str(f.type).replace(" ", "")
        parse = meta.get("parse")
        if parse == "optional_token":
            kw.update(nargs="?", const=True)
        elif parse is None and ftype.startswith("bool"):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            if parse is None:
                parse = "json" if ftype.startswith("dict") else "float" if ftype.startswith("float") else \
                    "int" if ftype.startswith("int") else "str"
            kw["type"] = _PARSERS[parse]
        if meta.get("choices"):
            kw["choices"] = [c for c in meta["choices"] if c is not None]
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        _group(parser, meta.get("group", "engine")).add_argument(*names, **kw)
    field_names = {f.name for f in fields}
    pending = []
    for table, title in ((PENDING_ARGS, "engine"), (PENDING_SERVER_ARGS, "server")):
        for name, (vllm_default, feature) in table.items():
            flag = flag_name(name)
            if name in field_names or flag in parser._option_string_actions:
                continue
            pending.append(name)
            kw = dict(dest=name, default=vllm_default, help=f"Not in pagedllm yet ({feature}); "
                      "any value but the default is an error.")
            if isinstance(vllm_default, bool):
                kw["action"] = "store_true"
            elif isinstance(vllm_default, int):
                kw["type"] = human_int
            _group(parser, title).add_argument(flag, **kw)
    parser.set_defaults(_pending_args=tuple(pending))


def engine_kwargs_from_namespace(ns: argparse.Namespace, engine_args_cls: type) -> dict[str, Any]:
    """The EngineArgs keyword arguments of a parsed command line (fields whose flag holds None
    keep their dataclass default when that default is a dict). Raises ValueError for a pending
    argument that was set."""
    flagged = {name: getattr(ns, name) for name in getattr(ns, "_pending_args", ())}
    check_pending(flagged, set(), {**PENDING_ARGS, **PENDING_SERVER_ARGS})
    out: dict[str, Any] = {}
    for f in dataclasses.fields(engine_args_cls):
        if not hasattr(ns, f.name):
            continue
        value = getattr(ns, f.name)
        if value is None and f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            continue
        out[f.name] = value
    return out


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs of a parsed `serve` command line. Raises ValueError for two different models or a
    vLLM flag another issue has not delivered yet."""
    model = getattr(ns, "model_tag", None)
    if model is not None and ns.model is not None and model != ns.model:
        raise ValueError(f"two models given: {model!r} and --model {ns.model!r}")
    kwargs = engine_kwargs_from_namespace(ns, EngineArgs)
    names = ns.served_model_name
    kwargs.update(model=model or ns.model, served_model_name=names[0] if names else None)
    return EngineArgs(**kwargs)


def package_version() -> str:
    try:
        from importlib.metadata import version

        return version("pagedllm")
    except Exception:  # noqa: BLE001 - not installed: running from a checkout
        return "0.1.0"
