"""Settings sections: each component's keys, typed, with their help, their rules and what they do on resume.

A section is a `Settings` made with the `section` decorator (a pydantic dataclass). It sits in the
package of the component it configures, in a module that imports no torch (training/optim/settings.py's
OptimizerSettings for optimizers/, ...: the configuration is checked before torch is imported), and
that component is handed the section itself, not the whole configuration. Each key is a field made with
option(): its default, the help --help prints, and what another value does to a resumed run. Every value goes through
Settings.coerce: text (the command line, and YAML's numbers, which launch/config.py's loader keeps as text) as
the field's type reads text, any other value strictly (`true` is no integer); the types below add None's
words, comma-separated lists and a YAML mapping kept as its command-line text. Then the section's
validate() checks its rules, each a require(). A problem is a ConfigError naming the key. So a new key
is its field plus its line in docs/CONFIGURATION.md (tests/test_config.py checks that it has both).
The kit lives in common/, the lowest layer, so that a section can sit in any layer above it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from collections.abc import Callable
from typing import Annotated, ClassVar, TypeVar

import pydantic
import pydantic.dataclasses
from pydantic import BeforeValidator, ConfigDict, TypeAdapter, ValidationError

from common.errors import ConfigError

# What another value of a key does to a run resumed with it, as each field declares it (option's on_resume; the
# resume warning names the keys whose change makes the steps differ), unless a function of the run's flat
# configuration decides it: a key whose effect depends on other settings (dropout_on below).
ON_RESUME = (
    "trajectory",  # in the training math: resumed with another value, a run's steps differ from an uninterrupted one's
    # never in the training math: where files go, logging, evaluation (which draws from its own generator; the
    # training reseeds dropout every step), diagnostics, checkpoint storage, and what computes the same math
    # rounded differently (the strategy, the chunked loss, activation checkpointing: the same forward again)
    "none",
)

# How every value is checked: strictly (a YAML `true` is no integer, 2.5 neither; an integer is a fine float), and
# no float is inf or nan (where a key can be off, 0 is that value, and a range check would let inf through).
CHECKS = ConfigDict(strict=True, allow_inf_nan=False)


def none_word(value):
    """A key whose None means "off" or "chosen at launch" takes, besides YAML's null, the words none, null and auto
    (--help and errors name the one its option's `none` says)."""
    return None if isinstance(value, str) and value.strip().lower() in ("none", "null", "auto") else value


T = TypeVar("T")
OrNone = Annotated[T | None, BeforeValidator(none_word)]  # OrNone[int]: an integer, or None as none_word reads it
# A list of strings: comma-separated as text (--wandb_tags a,b; '' is none), or a YAML list.
Words = Annotated[list[str], BeforeValidator(lambda v: [w for w in v.split(",") if w] if isinstance(v, str) else v)]


def mapping_text(separator: str):
    """The type of a key that names things with values (data_dir's folder:weight, val_sets' name=path): held as
    the command-line text `a<separator>1,b<separator>2`, the form config.yaml and every checkpoint keep; YAML's
    mapping {a: 1, b: 2} is made that text. The key's section reads the text (its names, its values)."""

    def as_text(value):
        if not isinstance(value, dict):
            return value
        for name, entry in value.items():
            if not isinstance(entry, str | int | float):
                raise ValueError(f"expected a mapping of names to values, got {value!r}")
            if "," in f"{name}{entry}":
                raise ValueError(f"{name!r}: {entry!r} holds a comma, which separates the entries")
        return ",".join(f"{name}{separator}{entry}" for name, entry in value.items())

    return Annotated[str, BeforeValidator(as_text)]


def dropout_on(config: dict) -> bool:
    """on_resume of the keys that change only the rounding (other kernels, other orders of sums) unless dropout is
    on: then which dropout mask falls on which row (micro-batches hold other rows; compiled kernels draw their masks
    apart from eager ones; deterministic mode may pick another attention kernel, which draws its own). Here, in the
    lowest layer, as sections of data/ and of training/ declare it."""
    return config["dropout"] > 0


def option(default, help: str, on_resume: str | Callable[[dict], bool], none: str = "null"):
    """A settings field: its default, the help --help prints, on_resume (one of ON_RESUME, or a function of the
    run's flat configuration), and none, how a user writes its None (`auto` where it means "chosen at launch")."""
    if not callable(on_resume) and on_resume not in ON_RESUME:
        raise ValueError(f"on_resume must be one of {', '.join(ON_RESUME)} or a function, got {on_resume!r}")
    metadata = {"help": help, "none": none, "on_resume": on_resume}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def changes_training_math(on_resume: str | Callable[[dict], bool], config: dict) -> bool:
    """Whether another value of a key whose field declares on_resume makes the steps of a run resumed with config
    (its keys, flat) differ from an uninterrupted run's."""
    return on_resume(config) if callable(on_resume) else on_resume == "trajectory"


def require(ok: bool, key: str, message: str) -> None:
    """One rule: a ConfigError `key: message` (one line, exit code 2) unless ok."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


def path_problem(value: str) -> str | None:
    """Why value, a path a user gave, names no file or folder (None: it names one). An unset shell variable
    (`--out_dir "$RUN"`) gives '', which Path reads as the current folder: a run, shards or an export would land
    there unasked, or a checkpoint or data be looked for there."""
    return None if value.strip() else f"{value!r} names no file or folder (an unset shell variable?)"


def require_path(key: str, value: str) -> None:
    """A path key's rule: a ConfigError naming key if value names no file or folder (path_problem)."""
    problem = path_problem(value)
    require(problem is None, key, problem or "")


def path_argument(text: str) -> str:
    """The argparse type of an entry point's path argument: text, or argparse's one-line error naming the argument
    (ArgumentParser: exit 2) when it names no file or folder, as a path key refuses it (path_problem)."""
    if problem := path_problem(text):
        raise argparse.ArgumentTypeError(problem)
    return text


def section(cls: type[T]) -> type[T]:
    """The decorator of every settings section: a pydantic dataclass whose values are checked as CHECKS says, frozen
    once made: a value found at launch (micro_batch_size auto's B) is handed down beside it, never written into it,
    so every reader of a section sees what was validated."""
    return pydantic.dataclasses.dataclass(cls, config=CHECKS, frozen=True)


# how --help (a metavar) and an error (what it expected) name each type a key may take
_KINDS = {bool: ("true|false", "true/false"), int: ("INT", "an integer"), float: ("NUMBER", "a number"),
          str: ("TEXT", "a string"), list: ("A,B,...", "a list of strings")}


@functools.cache
def _type_of(section: type, key: str) -> TypeAdapter:
    """key's type as its section declares it (with OrNone's words, a mapping's text, ...), checked as CHECKS says."""
    return TypeAdapter(typing.get_type_hints(section, include_extras=True)[key], config=CHECKS)


class Settings:
    """The base of every settings section (each made with `section`).

    SECTION names the section: its --help group, and the YAML mapping its keys may be nested in;
    SUMMARY says what it configures (under the group's title in --help).
    """

    SECTION: ClassVar[str] = ""
    SUMMARY: ClassVar[str] = ""

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _as_written(cls, value, info: pydantic.ValidationInfo):
        """Every value a section is made from, through coerce (pydantic's own check of the field then passes)."""
        return cls.coerce(info.field_name, value)

    @classmethod
    def coerce(cls, key: str, value):
        """One value of key, converted and checked by its field's type: text as that type reads text (a string
        stays exactly as written: a prompt may start with a space), any other value strictly, as it is."""
        try:
            return _type_of(cls, key).validate_python(value, strict=not isinstance(value, str))
        except ValidationError as e:
            error = e.errors()[0]
            message = (error["ctx"]["error"] if error["type"] == "value_error"  # a mapping's own check
                       else f"must be a finite number, got {float(value)}" if error["type"] == "finite_number"
                       else f"expected {' or '.join(name for _, name in cls.kinds(key))}, got {value!r}")
            raise ConfigError(f"{key}: {message}") from None

    @classmethod
    def kinds(cls, key: str) -> list[tuple[str, str]]:
        """(metavar, name) of each type key takes: `int | None` is INT, an integer, then None as its option says."""
        hint, none = typing.get_type_hints(cls)[key], cls.__dataclass_fields__[key].metadata["none"]
        types = (hint,) if typing.get_origin(hint) is list else typing.get_args(hint) or (hint,)
        return [_KINDS.get(typing.get_origin(t) or t, (none, none)) for t in types]

    def __post_init__(self) -> None:
        """After each value is checked: the section's own rules."""
        self.validate()

    def validate(self) -> None:
        """This section's rules, each a require(...): a section overrides it."""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The section's keys, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))
