"""Whether a checkpoint's entries fit the run that loads them: checked before anything of it is loaded.

A checkpoint whose metadata reads can still hold what its run cannot take: a tensor missing (a full-state load
would fill it from the fresh model, silently), one too many, one of another shape or kind (an optimizer moment
one row longer is only found by the first step, once the log was truncated), a plain entry without the fields its
part reads. Each part of the run says what it takes: a tensor part (training/checkpoint/format.py's TensorPart)
by its `problem`, made of the functions below, any other part by the type its state_dict returns (a TypedDict),
which `value_problem` checks.

A problem is said in words from the entry on, its place in it as subscripts: `['transformer.wte.weight'] is of
shape (3, 3), this run's model's is (64, 16)`, or ` has no 'start_step'`; the caller names the file and the entry.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Collection

import torch


def value_problem(value, hint, where: str = "") -> str | None:
    """What keeps value from being a `hint`: a class (a float may be an int, as JSON writes whole floats; an int is no
    bool), X | None, list[X], dict[str, X] or a TypedDict (each of its fields there, each of its type); None when it
    is one. where: value's place in the entry, as subscripts."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return None
    if origin in (typing.Union, types.UnionType):
        problems = [value_problem(value, arg, where) for arg in args]
        return None if None in problems else problems[0]
    if typing.is_typeddict(hint):
        if not isinstance(value, dict):
            return f"{where} is {described(value)}, expected a dict"
        for key, field in typing.get_type_hints(hint).items():
            if key not in value:
                return f"{where} has no {key!r}"
            if problem := value_problem(value[key], field, f"{where}[{key!r}]"):
                return problem
        return None
    kind = origin or hint
    accepted = (int, float) if kind is float else kind
    if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
        return f"{where} is {described(value)}, expected {article(kind.__name__)}"
    if origin is list:
        return next(filter(None, (value_problem(item, args[0], f"{where}[{i}]") for i, item in enumerate(value))),
                    None)
    if origin is dict:
        return next(filter(None, (value_problem(item, args[1], f"{where}[{key!r}]") for key, item in value.items())),
                    None)
    return None


def tensors_problem(saved, expected: dict[str, torch.Tensor], optional: Collection[str] = ()) -> str | None:
    """saved (an entry of tensors by name: a file's, or meta tensors of a folder's shapes and dtypes) against the run's
    tensors by name: a name it lacks (but the optional ones), one the run has not, or a tensor that does not fit
    (tensor_problem)."""
    if not isinstance(saved, dict):
        return f" is {described(saved)}, expected a dict of tensors"
    for name in expected:
        if name not in saved and name not in optional:
            return f" has no {name!r}"
    for name, value in saved.items():
        if name not in expected:
            return f" holds {name!r}, unknown to this run"
        if problem := tensor_problem(value, expected[name], f"[{name!r}]", "this run's"):
            return problem
    return None


def tensor_problem(value, like: torch.Tensor, where: str, whose: str, scalar: bool = False) -> str | None:
    """value against a tensor it must fit: one of its shape (or, scalar, of none: an optimizer's step count), and of
    its kind (floating point or not; the load casts one float to another: a run may change its dtype)."""
    if not torch.is_tensor(value):
        return f"{where} is {described(value)}, not a tensor"
    if value.shape != like.shape and not (scalar and value.dim() == 0):
        return f"{where} is of shape {tuple(value.shape)}, {whose} is {tuple(like.shape)}"
    if value.is_floating_point() != like.is_floating_point():
        return f"{where} is {value.dtype}, {whose} is {like.dtype}"
    return None


def optimizer_problem(saved, groups: list[list[str]], params: dict[str, torch.Tensor]) -> str | None:
    """saved (an optimizer entry keyed by parameter name: {"state": {name: {field: value}}, "param_groups": [{...,
    "params": [names]}]}) against the run's optimizer: its groups' parameter names, in its order, and the
    parameters by name. A group's names a folder keeps as bytes DCP reads on load (None here) are left to it."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        return " is not an optimizer state (a dict of 'state' and 'param_groups')"
    if len(saved["param_groups"]) != len(groups):
        return f"['param_groups'] holds {len(saved['param_groups'])} groups, this run's optimizer {len(groups)}"
    for i, (group, names) in enumerate(zip(saved["param_groups"], groups)):
        if not isinstance(group, dict):
            return f"['param_groups'][{i}] is {described(group)}, expected a dict"
        held = group.get("params")
        if held is not None and (not isinstance(held, list) or sorted(map(str, held)) != sorted(names)):
            return f"['param_groups'][{i}]['params'] are not the parameters of this run's group {i}"
    for name, fields in saved["state"].items():
        where = f"['state'][{name!r}]"
        if name not in params:
            return f"{where}: {name!r} is no parameter of this run's"
        if not isinstance(fields, dict):
            return f"{where} is {described(fields)}, expected a dict"
        for field, value in fields.items():
            if torch.is_tensor(value) and (problem := tensor_problem(value, params[name], f"{where}[{field!r}]",
                                                                     "its parameter's", scalar=True)):
                return problem
    return None


def described(value) -> str:
    return "None" if value is None else article(type(value).__name__)


def article(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
