"""The options' flags on the command line: each option's field declares its flag (see
onnxshrink.options.Flag), its default, type and choices; the parser is built from the fields
and the options are built back from what was parsed, both by this module alone."""

from __future__ import annotations

import argparse
from dataclasses import Field, fields
from typing import Any, TypeVar

from onnxshrink.options import Flag, choices_of, flag_of, is_switch, number_of

Options = TypeVar("Options")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, kind: type) -> None:
    """Offer every option of `kind` (ShrinkOptions, PruneOptions) that has a flag, in field
    order; each is parsed into the attribute of the option's name."""
    for option in fields(kind):
        flag = flag_of(option)
        if flag is not None:
            parser.add_argument(*flag.names, dest=option.name, **_how(option, flag))


def _how(option: Field[Any], flag: Flag) -> dict[str, Any]:
    """argparse's keywords for one option."""
    default: Any = option.default
    if is_switch(option):
        given = (not default) if flag.gives is None else flag.gives
        return {"action": "store_const", "const": given, "default": default, "help": flag.help}
    how: dict[str, Any] = {"default": default, "metavar": flag.metavar, "help": flag.help}
    if flag.several:
        how["nargs"] = "+"
    if flag.extend:  # the values given add up, from an empty list
        how["action"] = "extend"
        how["default"] = list(default or [])
    if number_of(option) is not None:
        how["type"] = number_of(option)
    if choices_of(option) is not None:
        how["choices"] = choices_of(option)
    return how


def flag_name(kind: type, name: str) -> str:
    """The (first) flag the option `name` of `kind` is given by, e.g. "--masks-out"."""
    flag = next((flag_of(f) for f in fields(kind) if f.name == name), None)
    assert flag is not None, f"{kind.__name__}.{name} has no flag"
    return flag.names[0]


def options_from(args: argparse.Namespace, kind: type[Options], **given: Any) -> Options:
    """The `kind` of options the parsed `args` say, each flagged option read as its flag says
    (files loaded, shapes parsed, in field order); `given` sets the options with no flag."""
    values = dict(given)
    for option in fields(kind):  # type: ignore[arg-type]
        flag = flag_of(option)
        if flag is not None:
            values[option.name] = _read(flag, getattr(args, option.name))
    return kind(**values)


def _read(flag: Flag, value: Any) -> Any:
    """A parsed value as its option holds it."""
    if flag.reads == "shapes":
        from onnxshrink.proof.inputs import parse_shapes

        return parse_shapes(value)
    if flag.reads == "inputs":
        from onnxshrink.proof.inputs import load_inputs

        return [load_inputs(value)] if value else None
    return value
