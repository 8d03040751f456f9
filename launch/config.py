"""The training configuration: one settings section per component, held by TrainConfig as its fields.

Every key is a typed dataclass field with its help text and what another value does to a resumed
run beside it (common/settings.py's option), declared by the one section of the component it
configures, and checked by that section's validate(). TrainConfig holds each section as a field
named for it (cfg.schedule.max_lr, cfg.checkpoint.keep_last), and its own validate() holds the
rules that span sections. A component is handed its own section (and any key of another section
it needs, as a value), never the whole configuration. The sections, and where each is declared:

    run          out_dir                                     training/checkpoint/run_folder.py
    data         the shards and the batch geometry           data/mixture.py
    model        the architecture, the initial weights       training/run/weights.py (model.py stays pure)
    optimizer    AdamW or Muon + AdamW, gradient clipping    training/optim/optimizers.py
    schedule     max_steps and the learning-rate schedule    training/optim/schedule.py
    ema          an average of the weights, evaluated beside  training/optim/ema.py
    evaluation   val loss, HellaSwag, samples                evals/settings.py
    checkpoint   cadence, retention, resume, where and how   training/checkpoint/checkpointer.py
    runtime      device, precision, kernels, seed, ranks     training/distributed/runtime_settings.py
    long_run     loss spikes and rollbacks                   training/optim/spikes.py
    diagnostics  rank stats, profiler, memory snapshots      training/observe/diagnostics.py
    logging      the console, TensorBoard, W&B               training/core/logger.py

The keys users type stay flat: TrainConfig(max_lr=1e-3), `--max_lr 1e-3`, `max_lr: 1e-3` in YAML,
and config.yaml and every checkpoint's `config` hold them flat (to_dict), so older run folders and
checkpoints, and the tools that read them, read the same keys. Precedence: the defaults (the
faithful GPT-2 124M recipe) < `--config FILE.yaml` (flat keys, or a section's keys nested under
its name) < `--key value` / `--key=value`. The command line is parsed by argparse, generated from
the sections (one argument group each: `--help` lists the keys by section), and every value is
converted by its field's type; the whole configuration is validated as it is made, before any
work starts. A problem is a `ConfigError` whose message names the key: the trainer prints it on
one line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from common.errors import ArgumentParser, ConfigError, first_line
from common.settings import Settings, require
from data.mixture import DataSettings, mapping_text, parse_val_sets
from data.tokenizer import GPT2_VOCAB_SIZE
from evals.settings import EvalSettings
from training.checkpoint.checkpointer import CheckpointSettings
from training.checkpoint.run_folder import RunSettings
from training.core.logger import LoggingSettings
from training.distributed.runtime_settings import RuntimeSettings
from training.distributed.strategies import STRATEGIES
from training.observe.diagnostics import DiagnosticsSettings
from training.optim.ema import EMASettings
from training.optim.optimizers import OptimizerSettings
from training.optim.schedule import ScheduleSettings
from training.optim.spikes import LongRunSettings
from training.run.weights import ModelSettings


# --- the whole configuration ------------------------------------------------------------------------

@dataclass(init=False)
class TrainConfig:
    """Every section of the configuration, each a field named for it (its SECTION), in this order (the order
    of --help, config.yaml and to_dict). Made from the flat keys users type: TrainConfig(max_lr=1e-3)."""

    run: RunSettings
    data: DataSettings
    model: ModelSettings
    optimizer: OptimizerSettings
    schedule: ScheduleSettings
    ema: EMASettings
    evaluation: EvalSettings
    checkpoint: CheckpointSettings
    runtime: RuntimeSettings
    long_run: LongRunSettings
    diagnostics: DiagnosticsSettings
    logging: LoggingSettings

    def __init__(self, **keys):
        """keys: flat (max_lr=1e-3), every other key its default. Each section is made from its own keys, and
        checks them, in the order of the fields; then the rules that span sections."""
        for key in keys:
            known_key(key)
        for section in SECTIONS:
            setattr(self, section.SECTION, section(**{key: keys[key] for key in section.keys() if key in keys}))
        self.validate()

    def validate(self) -> None:
        """The rules that span sections (each section checked its own keys when it was made)."""
        data, model, evaluation = self.data, self.model, self.evaluation
        parse_val_sets(evaluation.val_sets, data.data_dir)
        require(data.seq_len <= model.block_size, "seq_len", f"{data.seq_len} exceeds block_size {model.block_size}")
        for key in ("hellaswag_interval", "sample_interval"):  # they read GPT-2-tokenized text
            require(not getattr(evaluation, key) or model.vocab_size >= GPT2_VOCAB_SIZE, key,
                    f"needs vocab_size >= {GPT2_VOCAB_SIZE} (GPT-2's tokenizer), got {model.vocab_size}; set it to 0")
        if self.optimizer.optimizer == "muon":
            require(self.schedule.max_lr > 0, "max_lr", "must be positive with optimizer muon (the schedule scales "
                                                        "muon_lr by lr / max_lr)")

    def resolved_checkpoint_format(self) -> str:
        """file or sharded: the checkpoint section's checkpoint_format, its auto resolved with the runtime
        section's strategy (CheckpointSettings.resolved_format)."""
        return self.checkpoint.resolved_format(STRATEGIES[self.runtime.strategy].default_checkpoint_format)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key, flat, in order: the sections' keys, section by section."""
        return tuple(key for section in SECTIONS for key in section.keys())

    def sections(self) -> tuple[Settings, ...]:
        return tuple(getattr(self, section.SECTION) for section in SECTIONS)

    def to_dict(self) -> dict:
        """Every key and its value, flat (config.yaml, a checkpoint's `config`, W&B's config)."""
        return {key: value for section in self.sections() for key, value in dataclasses.asdict(section).items()}


SECTIONS: tuple[type[Settings], ...] = tuple(typing.get_type_hints(TrainConfig).values())
SECTION_NAMED = {section.SECTION: section for section in SECTIONS}
SECTION_OF = {key: section for section in SECTIONS for key in section.keys()}


# --- what a changed key does to a run's steps (the resume warning, launch/resume.py) ----------------
# Each key's field declares it (option's on_resume: one of common/settings.py's ON_RESUME, or a function of the
# other settings); key -> its declaration.
ON_RESUME_OF = {f.name: f.metadata["on_resume"] for section in SECTIONS for f in dataclasses.fields(section)}

# --- parsing --------------------------------------------------------------------------------------

_FIELDS = {f.name: f for section in SECTIONS for f in dataclasses.fields(section)}  # every key's field
_HINTS = {key: hint for section in SECTIONS for key, hint in typing.get_type_hints(section).items()}
MAPPING_SEPARATORS = {"data_dir": ":", "val_sets": "="}  # keys that YAML may give as a mapping: {a: b} is "a<sep>b"
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _base_types(key: str) -> tuple[type, ...]:
    """The concrete types a field accepts: `int | None` -> (int, NoneType)."""
    hint = _HINTS[key]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return tuple(typing.get_origin(a) or a for a in typing.get_args(hint))
    return (origin or hint,)


def known_key(key: str) -> str:
    """key, or a ConfigError naming it with the keys it may have meant."""
    if key not in _FIELDS:
        close = [k for k in _FIELDS if key and k.startswith(key[:4])]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"{key or repr(key)}: unknown config key{hint}")
    return key


def coerce(key: str, value):
    """Check (a YAML value) or convert (command-line text) one value to its field's type.

    Text is converted by the field's type, from the command line and from YAML alike: PyYAML
    reads `6e-4` (no dot) as a string, and users write floats every way. Strings stay exactly
    as written (a prompt may start with a space).
    """
    accepted = _base_types(known_key(key))
    if isinstance(value, dict) and key in MAPPING_SEPARATORS:  # a YAML mapping: stored as its command-line text
        return mapping_text(key, value, MAPPING_SEPARATORS[key])
    if isinstance(value, str):
        return _from_text(key, value, accepted)
    # a YAML value: already typed; ints are fine for floats, but bools are not ints
    if value is None and type(None) in accepted:
        return None
    if isinstance(value, bool):
        if bool in accepted:
            return value
    elif isinstance(value, int) and (int in accepted or float in accepted):
        return float(value) if int not in accepted else value
    elif isinstance(value, float) and float in accepted:
        return value
    elif isinstance(value, list) and list in accepted and all(isinstance(v, str) for v in value):
        return value
    raise ConfigError(f"{key}: expected {_type_name(key, accepted)}, got {value!r}")


def _from_text(key: str, value: str, accepted: tuple[type, ...]):
    if str in accepted:
        return value
    text = value.strip()
    if type(None) in accepted and text.lower() in ("none", "null", "auto"):
        return None
    if bool in accepted:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
    elif int in accepted:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            pass
    elif float in accepted:
        try:
            return float(text.replace("_", ""))
        except ValueError:
            pass
    elif list in accepted:
        return [t for t in text.split(",") if t]
    raise ConfigError(f"{key}: expected {_type_name(key, accepted)}, got {text!r}")


def _type_name(key: str, accepted: tuple[type, ...]) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
             list: "a list of strings", type(None): _FIELDS[key].metadata["none"]}
    return " or ".join(names[t] for t in accepted)


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with each mapping's keys as written and each given once.

    A key is a name: YAML's own reading of `on`, `yes`, `no`, `null` or `1` as a boolean, null
    or number (which no key's name is) would turn it into something a message cannot name, or
    fail on. PyYAML keeps the last of a key given twice in one mapping, silently dropping the
    first; that is an error, naming the key and both lines. `path` names the file in messages.
    """

    path: Path

    def construct_mapping(self, node, deep=False):
        if not isinstance(node, yaml.MappingNode):
            return super().construct_mapping(node, deep)
        lines: dict[str, int] = {}
        for key_node, _ in node.value:  # the keys as written (a merge's, `<<: *base`, may be overridden)
            if key_node.tag != "tag:yaml.org,2002:merge":
                key, line = self._name(key_node), key_node.start_mark.line + 1
                if key in lines:
                    raise ConfigError(f"{key}: set twice in {self.path} (lines {lines[key]} and {line})"
                                      + _SECTION_HINT.get(key, ""))
                lines[key] = line
        self.flatten_mapping(node)  # the merged keys first, so that the mapping's own win
        return {self._name(key_node): self.construct_object(value_node, deep=deep)
                for key_node, value_node in node.value}

    def _name(self, key_node) -> str:
        if not isinstance(key_node, yaml.ScalarNode):
            raise ConfigError(f"config: {self.path} line {key_node.start_mark.line + 1}: a key must be a name, "
                              f"not a {'list' if isinstance(key_node, yaml.SequenceNode) else 'mapping'}")
        return key_node.value


# a key named like its section (`model: custom` beside `model: {n_layer: 2}`): say which is which
_SECTION_HINT = {name: f"; `{name}: VALUE` is the key and `{name}:` with keys under it the section of that name: "
                       f"give the key inside the section ({name}: {{{name}: VALUE, ...}})"
                 for name in SECTION_NAMED if name in _FIELDS}


def load_yaml(path: str | Path) -> dict:
    """The keys a YAML file sets, each checked against its field's type: flat (`max_lr: 6e-4`), or nested
    under its section's name (`schedule: {max_lr: 6e-4}`); a key set twice is an error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: no such file {path}")
    try:
        loader = _ConfigLoader(path.read_text())
        loader.path = path
        try:
            data = loader.get_single_data() or {}
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {path} is not valid YAML ({first_line(e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of keys to values")
    pairs = []
    for key, value in data.items():
        section = SECTION_NAMED.get(key)
        if section is None or not isinstance(value, dict):  # `model: gpt2` is a key; `model: {...}` a section
            require(section is None or key in _FIELDS, key, f"a section: expected a mapping of its keys, got {value!r}")
            pairs.append((key, value))
            continue
        for inner, inner_value in value.items():
            owner = SECTION_OF.get(known_key(inner))
            require(owner is section, inner, f"is a key of section {owner.SECTION}, not of {key}")
            pairs.append((inner, inner_value))
    values: dict = {}
    for key, value in pairs:
        require(key not in values, key, f"set twice in {path}")
        values[key] = coerce(key, value)
    return values


# --- the command line: argparse, generated from the sections ------------------------------------------

USAGE = "train_gpt2.py [--config configs/NAME.yaml] [--key value | --key=value ...]"
DESCRIPTION = """\
Every key below can be set in the YAML file (flat, or nested under its section's name) or on the
command line (the command line wins). Each belongs to one settings section of the code."""
_METAVARS = {bool: "true|false", int: "INT", float: "NUMBER", str: "TEXT", list: "A,B,..."}


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="train_gpt2.py", usage=USAGE, description=DESCRIPTION, add_help=False,
                            allow_abbrev=False, argument_default=argparse.SUPPRESS, exit_on_error=False)
    parser.add_argument_group("config file").add_argument(
        "--config", action="append", metavar="FILE.yaml", help="YAML keys to start from (given twice: both, the "
                                                               "second winning)")
    for section in SECTIONS:
        group = parser.add_argument_group(section.SECTION, section.SUMMARY)
        for f in dataclasses.fields(section):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            group.add_argument(f"--{f.name}", type=functools.partial(coerce, f.name),
                               metavar="|".join(_METAVARS.get(t, f.metadata["none"]) for t in _base_types(f.name)),
                               help=f"{f.metadata['help']} (default: {json.dumps(default)})".replace("%", "%%"))
    return parser


def _argparse_form(argv: list[str]) -> list[str]:
    """argv as argparse reads it: `-` in a key as `_` (users type both), and `--key VALUE` as `--key=VALUE`
    where VALUE starts with one `-` (-1e-3, -inf, -x: argparse would take it for an option)."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            key, equals, value = arg[2:].partition("=")
            arg = f"--{key.replace('-', '_')}{equals}{value}"
        elif arg.startswith("-") and not arg.startswith("--") and out and _takes_value(out[-1]):
            out[-1] = f"{out[-1]}={arg}"
            continue
        out.append(arg)
    return out


def _takes_value(arg: str) -> bool:
    """Whether arg is a `--key` still waiting for its value."""
    return arg.startswith("--") and "=" not in arg and arg[2:] in (_FIELDS.keys() | {"config"})


def wants_help(argv: list[str]) -> bool:
    """Whether argv asks for --help (or -h) anywhere, but as the value of a key (`--sample_prompt -h`)."""
    return any(arg in ("-h", "--help") for arg in _argparse_form(argv))


def usage() -> str:
    """--help: the keys by section, each with its type, help and default."""
    return _parser().format_help()


def parse_args(argv: list[str]) -> TrainConfig:
    """`[--config FILE] [--key value | --key=value ...]` -> a validated TrainConfig."""
    try:
        given, rest = _parser().parse_known_args(_argparse_form(argv))
    except argparse.ArgumentError as e:  # the one argparse raises here: a key without its value
        key = (e.argument_name or "").lstrip("-")
        raise ConfigError(f"{key}: {'missing value' if 'expected one' in e.message else e.message}") from None
    if rest:
        if rest[0].startswith("--") and rest[0] != "--":
            known_key(rest[0][2:].partition("=")[0])  # raises: argparse knows every key
        raise ConfigError(f"{rest[0]}: expected --key value or --key=value")
    values: dict = {}
    given = vars(given)
    for path in given.pop("config", []):
        values.update(load_yaml(path))
    return TrainConfig(**{**values, **given})


def config_yaml(config: TrainConfig) -> str:
    """The resolved configuration as YAML, flat (what `--config` reads back)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
