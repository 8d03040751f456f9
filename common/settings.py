"""Settings sections: each component's keys, typed, with their help, their rules and what they do on resume.

A section is a dataclass deriving from `Settings`: its fields made with option() (the default,
the help text --help prints, and what another value does to a resumed run: one of ON_RESUME, or a
function of the other settings where they decide it),
its own rules in validate(), each a require() whose ConfigError names the key; it checks itself
when it is made. So a new key is written in one place, its field, plus its line in
docs/CONFIGURATION.md (tests/test_config.py checks that every key has both).

A section sits beside the component it configures (training/optim/optimizers.py's
OptimizerSettings, data/mixture.py's DataSettings, ...), and that component is handed the section
itself, not the whole configuration. TrainConfig (launch/config.py) holds every section as
a field named for it (cfg.schedule.max_lr) and holds the rules that span sections. The keys users
type stay flat (--max_lr, `max_lr:` in YAML, each declared by the one section it belongs to). The
kit lives in common/, the lowest layer, so that a section can sit in any layer above it.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from typing import ClassVar

from common.errors import ConfigError


# What another value of a key does to a run resumed with it: every field declares one (option's on_resume), and
# the resume warning names the keys whose change makes the steps differ (launch/resume.py's
# warn_on_changed_settings). Beside these two, a field may declare a function of the resumed run's configuration
# (its keys, flat, as users type them) that says whether it does: a key whose effect depends on other settings
# (a feature's settings do nothing while the feature is off; dropout_on below).
ON_RESUME = (
    "trajectory",  # in the training math: resumed with another value, a run's steps differ from an uninterrupted one's
    # never in the training math: where files go, logging, evaluation (which draws from its own generator; the
    # training reseeds dropout every step), diagnostics, checkpoint storage, and what computes the same math
    # rounded differently (the strategy, the chunked loss, activation checkpointing: the same forward again)
    "none",
)


def dropout_on(config: dict) -> bool:
    """on_resume of the keys that change only the rounding (other kernels, other orders of sums) unless dropout is
    on: then which dropout mask falls on which row (micro-batches hold other rows; compiled kernels draw their masks
    apart from eager ones; deterministic mode may pick another attention kernel, which draws its own). Here, in the
    lowest layer, as sections of data/ and of training/ declare it."""
    return config["dropout"] > 0


def option(default, help: str, on_resume: str | Callable[[dict], bool], none: str = "null"):
    """A settings field with its help text beside it (printed by --help). on_resume: what another value does
    to a resumed run, one of ON_RESUME, or a function of that run's configuration (flat) saying whether it
    changes the training math. none: how a user writes the field's None, for a field that takes one
    (`auto` where None means "chosen at launch"; YAML's null, none and auto all read as None)."""
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


class Settings:
    """The base of every settings section (each a dataclass).

    SECTION names the section: its --help group, and the YAML mapping its keys may be nested in;
    SUMMARY says what it configures (under the group's title in --help).
    """

    SECTION: ClassVar[str] = ""
    SUMMARY: ClassVar[str] = ""

    def __post_init__(self) -> None:
        """Resolve and check the values: no float key is inf or nan (where a key can be off, 0 is that value,
        and the range checks would let inf through, inf > 0), then the section's own rules."""
        self.resolve()
        hints = typing.get_type_hints(type(self))
        for key in self.keys():
            value = getattr(self, key)
            if float in typing.get_args(hints[key]) + (hints[key],) and value is not None:
                require(math.isfinite(value), key, f"must be a finite number, got {value}")
        self.validate()

    def resolve(self) -> None:
        """Normalise values in place before validation (a section overrides it where a value needs it)."""

    def validate(self) -> None:
        """This section's rules, each a require(...): a section overrides it."""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The section's keys, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))
