"""Command-line options derived from a typed config: each flag's type, default and help come from the field.

`config_option(Model, "pool.stall_timeout_s")` is a click option for that (dotted, nested) field: its
type from the annotation (a Literal becomes a choice, `X | None` becomes X, a list repeats the flag), its
default and help from the field, so a setting is declared once, in its pydantic model, and the command
line only names it. The parameter a command receives is the path with `__` for dots; `config_values`
turns those parameters back into the nested dict the model validates. Options that are not settings
(where a secret comes from) stay plain click options in the command.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def field_at(model: type[BaseModel], path: str) -> FieldInfo:
    """The field a dotted path names, through nested models."""
    *parents, name = path.split(".")
    for part in parents:
        model = _unwrap(model.model_fields[part].annotation)
    return model.model_fields[name]


def _unwrap(annotation: Any) -> Any:
    """`X | None` -> X."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _click_type(annotation: Any) -> tuple[Any, bool]:
    """The click type for a field's annotation, and whether the flag repeats (a list)."""
    annotation = _unwrap(annotation)
    if typing.get_origin(annotation) is list:
        return _click_type(typing.get_args(annotation)[0])[0], True
    if typing.get_origin(annotation) is Literal:
        return click.Choice([str(a) for a in typing.get_args(annotation)]), False
    return annotation, False


def config_option(model: type[BaseModel], path: str, *flags: str, help: str | None = None, **overrides):
    """A click option for `path`'s field, named `flags` (first: the flag; more: aliases).

    A bool field whose flag is `--no-X` is a flag that sets it to False; any other bool field is a
    flag that sets it to True. `help` replaces the field's description where the command line says
    more (how to repeat the flag, what 0 means); `overrides` go to click.option unchanged."""
    info = field_at(model, path)
    default = None if info.default is PydanticUndefined else info.default
    kwargs: dict[str, Any] = {"help": help or info.description}
    if _unwrap(info.annotation) is bool:
        kwargs.update(is_flag=True, default=default)
        if flags[0].startswith("--no-"):
            kwargs["flag_value"] = not default
    else:
        click_type, multiple = _click_type(info.annotation)
        required = info.is_required()
        kwargs.update(type=click_type, multiple=multiple, required=required)
        if not required:
            kwargs.update(default=default, show_default=default is not None)
    kwargs.update(overrides)
    return click.option(*flags, path.replace(".", "__"), **kwargs)


def config_values(params: dict[str, Any]) -> dict[str, Any]:
    """Command parameters named `a__b` -> {"a": {"b": value}}, ready for Model.model_validate."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        *parents, leaf = name.split("__")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = list(value) if isinstance(value, tuple) else value
    return out
