"""How an engine argument is declared, and what happens to the vLLM arguments pagedllm does not
act on. Pure Python (no torch): the CLI imports it for `--help`.

Every `EngineArgs` field is declared with `arg(...)` (or `accepted(...)`), which puts its help
text, CLI spelling and parser into the field's metadata; `entrypoints/engine_cli.py` turns every
field into a `pagedllm serve` flag from that metadata, so adding an engine argument is adding one
dataclass field:

    max_num_seqs: int = arg(256, "Most requests running at once.", parse="positive_int")

A field is one of:
- honoured (`arg`): the engine acts on it;
- accepted (`accepted`): a vLLM argument that has no meaning here; a value other than the
  default is accepted and logged once, in a line that says what pagedllm does instead;
- pending (`PENDING_ARGS`, not a field): a vLLM argument another issue is delivering. Its default
  passes; any other value is a `ValueError` naming the feature (never "unknown argument"). The
  engineer who delivers it adds the field (the field then wins) and deletes the entry.
Anything else is unknown and fails loudly, with the closest spelling when there is one.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

HONOURED = "honoured"
ACCEPTED = "accepted"

# Parser names the CLI knows (entrypoints/engine_cli.py); None: derived from the field's type.
PARSERS = (
    "positive_int",
    "non_negative_int",
    "int",
    "float",
    "non_negative_float",
    "fraction",
    "size",
    "gib_or_size",
    "json",
    "str",
    "optional_token",
)

_MISSING = dataclasses.MISSING


def arg(
    default: Any = _MISSING,
    help: str = "",
    *,
    default_factory: Any = _MISSING,
    flags: Iterable[str] = (),
    choices: Iterable[Any] | None = None,
    parse: str | None = None,
    group: str = "engine",
    cli: bool = True,
    cli_default: Any = _MISSING,
    alias_of: str | None = None,
    status: str = HONOURED,
    note: str | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field of EngineArgs with what its CLI flag needs.

    flags: extra spellings besides `--the-field-name` (e.g. the seed documents' `--max-seq-length`);
    parse: one of PARSERS (a usage error at parse time for a bad value); cli=False: the CLI
    declares this one by hand; cli_default: the flag's default when it differs from the field's;
    alias_of: this field is another spelling of that field (its flag is added to that field's).
    """
    if not help:
        raise ValueError("arg: every engine argument needs a help text")
    if parse is not None and parse not in PARSERS:
        raise ValueError(f"arg: parse must be one of {PARSERS}, got {parse!r}")
    meta = {
        "help": help,
        "flags": tuple(flags),
        "choices": None if choices is None else tuple(choices),
        "parse": parse,
        "group": group,
        "cli": cli,
        "cli_default": cli_default,
        "alias_of": alias_of,
        "status": status,
        "note": note,
        "metavar": metavar,
    }
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def accepted(default: Any, help: str, note: str, **kw: Any) -> Any:
    """A vLLM argument accepted for compatibility: `note` says what pagedllm does instead; it is
    logged once when the value differs from the default."""
    return arg(
        default,
        f"{help} Accepted for vLLM compatibility: {note}",
        status=ACCEPTED,
        note=note,
        group=kw.pop("group", "vLLM compatibility (accepted, logged)"),
        **kw,
    )


# name -> (vLLM's default, the feature that will deliver it)
PENDING_ARGS: dict[str, tuple[Any, str]] = {}
# Server (frontend) flags other issues are delivering, with the same rule.
PENDING_SERVER_ARGS: dict[str, tuple[Any, str]] = {
    "reasoning_parser": (None, "reasoning parsers (the structured outputs / tools issue)"),
}


def pending_error(name: str, value: Any, table: Mapping[str, tuple[Any, str]] = PENDING_ARGS) -> ValueError:
    feature = table[name][1]
    return ValueError(
        f"{name}={value!r}: {feature} is not in pagedllm yet; leave {name} at its default ({table[name][0]!r})"
    )


def check_pending(
    values: Mapping[str, Any], fields: set[str], table: Mapping[str, tuple[Any, str]] = PENDING_ARGS
) -> None:
    """Raises for a pending argument set to anything but vLLM's default."""
    for name, value in values.items():
        if name in table and name not in fields and value != table[name][0]:
            raise pending_error(name, value, table)


def split_engine_kwargs(cls: type, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The kwargs of `LLM(...)` that are `cls` fields. Pending ones at their default are dropped,
    any other value of them raises; an unknown name raises, suggesting the closest field."""
    fields = {f.name for f in dataclasses.fields(cls)}
    check_pending(kwargs, fields)
    out: dict[str, Any] = {}
    unknown = []
    for name, value in kwargs.items():
        if name in fields:
            out[name] = value
        elif name not in PENDING_ARGS:
            unknown.append(name)
    if unknown:
        hints = []
        for name in sorted(unknown):
            close = difflib.get_close_matches(name, sorted(fields | set(PENDING_ARGS)), n=1)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise ValueError(f"unknown engine arguments: {', '.join(hints)}")
    return out


def log_accepted(args: Any) -> list[str]:
    """Logs once per accepted-only argument that differs from its default; returns the lines."""
    lines = []
    for f in dataclasses.fields(args):
        if f.metadata.get("status") != ACCEPTED:
            continue
        default = f.default if f.default is not _MISSING else f.default_factory()  # type: ignore[misc,operator]
        value = getattr(args, f.name)
        if value != default:
            lines.append(f"{f.name}={value!r} accepted for vLLM compatibility: {f.metadata['note']}")
    for line in lines:
        logger.info("%s", line)
    return lines
