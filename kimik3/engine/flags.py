"""``EngineArgs`` on the command line: one flag per field (``max_model_len`` -> ``--max-model-len``), its help
and type from the field's metadata (``args.py``), for every ``kimik3`` subcommand that builds an engine."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from kimik3.engine.args import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser, *, positional_model: bool = False,
                    skip: tuple[str, ...] = (), overrides: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """Add every ``EngineArgs`` field as a flag (``max_model_len`` -> ``--max-model-len``).

    ``positional_model``: also take the model as the first positional argument (``kimik3 serve MODEL``,
    as ``vllm serve MODEL``); ``--model`` keeps working. ``skip``: fields a command does not take.
    ``overrides``: a command's own defaults (its help says so).
    """
    overrides = overrides or {}
    group = parser.add_argument_group("engine")
    if positional_model:
        group.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                           help="checkpoint directory (same as --model)")
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        meta = dict(f.metadata)
        flag = "--" + f.name.replace("_", "-")
        names = [flag, *meta.pop("aliases", ())]
        kw: dict[str, Any] = {"default": f.default, "help": meta.pop("help"), "dest": f.name}
        if f.name in overrides:
            kw["default"] = overrides[f.name]
            kw["help"] = re.sub(r"\(default: [^)]*\)$", f"(default: {overrides[f.name]} for this command)", kw["help"])
        if f.type in ("bool", bool, "bool | None"):      # bool | None: None (the default) = auto
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = meta.pop("type", None) or (int if f.type in ("int", int) else str)
            kw.update(meta)
        group.add_argument(*names, **kw)
    return parser


def merge_model_tag(args: argparse.Namespace) -> None:
    """``serve MODEL`` and ``serve --model MODEL`` are one setting; both at once must agree."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ValueError(f"the model is given twice and differently: {tag!r} (positional) and --model "
                         f"{args.model!r}; give it once")
    args.model = tag
