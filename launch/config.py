"""The training configuration: TrainConfig holds one settings section per component as its fields.

Each section (common/settings.py) is declared in its component's package, in a module that imports no torch,
numpy or model.py (its settings.py, or the component's own module where that imports none of them), and so does
this one: the trainer checks a configuration before it imports them (launch/early_checks.py).

    run          out_dir                                     training/checkpoint/settings.py
    data         the shards and the batch geometry           data/settings.py
    model        the architecture, the initial weights       training/run/settings.py (model.py stays pure)
    optimizer    AdamW or Muon + AdamW, gradient clipping    training/optim/settings.py
    schedule     max_steps and the learning-rate schedule    training/optim/schedule.py
    ema          an average of the weights, evaluated beside  training/optim/settings.py
    evaluation   val loss, HellaSwag, samples                evals/settings.py
    checkpoint   cadence, retention, resume, where and how   training/checkpoint/settings.py
    runtime      device, precision, kernels, seed, ranks     runtime/settings.py
    long_run     loss spikes and rollbacks                   training/optim/settings.py
    diagnostics  rank stats, profiler, memory snapshots      training/observe/settings.py
    logging      the console, TensorBoard, W&B               runtime/logger.py

TrainConfig's own validate() holds the rules that span sections. The keys users type stay flat:
TrainConfig(max_lr=1e-3), `--max_lr 1e-3`, `max_lr: 1e-3` in YAML, and config.yaml and every
checkpoint's `config` hold them flat (to_dict), so older run folders and the tools that read them
read the same keys. Precedence: the defaults (the faithful GPT-2 124M recipe) < `--config
FILE.yaml` (flat keys, or a section's keys nested under its name) < `--key value` / `--key=value`.
`--help` lists the keys by section, generated from the fields. The whole configuration is checked
as it is made, before any work starts; a problem is a ConfigError naming the key (one line, exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from common.errors import ConfigError, first_line
from common.settings import Settings, require, require_path
from data.settings import DataSettings, parse_val_sets
from data.tokenizer import GPT2_VOCAB_SIZE
from evals.settings import EvalSettings
from training.checkpoint.settings import CheckpointSettings, RunSettings
from runtime.logger import LoggingSettings
from runtime.settings import STRATEGY_INFO, RuntimeSettings
from training.observe.settings import DiagnosticsSettings
from training.optim.schedule import ScheduleSettings
from training.optim.settings import EMASettings, LongRunSettings, OptimizerSettings
from training.run.settings import ModelSettings


# --- the whole configuration ------------------------------------------------------------------------

@dataclass(init=False, frozen=True)
class TrainConfig:
    """Every section of the configuration, each a field named for it (its SECTION), in this order (the order
    of --help, config.yaml and to_dict). Made from the flat keys users type: TrainConfig(max_lr=1e-3). Frozen,
    as each section is: what a launch finds out (micro_batch_size auto's B) is handed down beside it."""

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
        """keys: flat (max_lr=1e-3, or its text "1e-3"), every other key its default. Each section is made from its
        own keys, converts and checks them (Settings.coerce, then its rules), in the order of the fields; then the
        rules that span sections."""
        for key in keys:
            known_key(key)
        for section in SECTIONS:
            made = section(**{key: keys[key] for key in section.keys() if key in keys})
            object.__setattr__(self, section.SECTION, made)  # frozen: this is where it is made
        self.validate()

    def validate(self) -> None:
        """The rules that span sections (each section checked its own keys when it was made)."""
        for key in PATH_KEYS:
            require_path(key, getattr(getattr(self, SECTION_OF[key].SECTION), key))
        data, model, evaluation = self.data, self.model, self.evaluation
        parse_val_sets(evaluation.val_sets, data.data_dir)
        require(data.seq_len <= model.block_size, "seq_len", f"{data.seq_len} exceeds block_size {model.block_size}")
        for key in ("hellaswag_interval", "sample_interval"):  # they read GPT-2-tokenized text
            require(not getattr(evaluation, key) or model.vocab_size >= GPT2_VOCAB_SIZE, key,
                    f"needs vocab_size >= {GPT2_VOCAB_SIZE} (GPT-2's tokenizer), got {model.vocab_size}; set it to 0")
        if self.runtime.fp8_lm_head:  # FP8 changes the numerics, which the faithful recipe keeps as GPT-2's
            require(self.optimizer.optimizer == "muon", "fp8_lm_head", "is for the modern recipe (optimizer muon, "
                                                                       "configs/*_modern.yaml) only")
            shape = self.model.model_config()
            require(shape.n_embd % 16 == 0 and shape.vocab_size % 16 == 0, "fp8_lm_head",
                    f"needs n_embd and vocab_size multiples of 16 (FP8 matrix products), got {shape.n_embd} and "
                    f"{shape.vocab_size}")
        if self.optimizer.optimizer == "muon":
            require(self.schedule.max_lr > 0, "max_lr", "must be positive with optimizer muon (the schedule scales "
                                                        "muon_lr by lr / max_lr)")

    def resolved_checkpoint_format(self) -> str:
        """file or sharded: the checkpoint section's checkpoint_format, its auto resolved with the runtime
        section's strategy (CheckpointSettings.resolved_format)."""
        return self.checkpoint.resolved_format(STRATEGY_INFO[self.runtime.strategy].default_checkpoint_format)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key, flat, in order: the sections' keys, section by section."""
        return tuple(key for section in SECTIONS for key in section.keys())

    def to_dict(self) -> dict:
        """Every key and its value, flat (config.yaml, a checkpoint's `config`, W&B's config)."""
        return {key: value for section in SECTIONS
                for key, value in dataclasses.asdict(getattr(self, section.SECTION)).items()}


SECTIONS: tuple[type[Settings], ...] = tuple(typing.get_type_hints(TrainConfig).values())
SECTION_NAMED = {section.SECTION: section for section in SECTIONS}
SECTION_OF = {key: section for section in SECTIONS for key in section.keys()}
# The keys that name a file or folder and have no use for '' (an unset variable's value, which Path reads as the
# current folder): a run written there, or data, weights or a checkpoint looked for there. checkpoint_dir,
# hellaswag_path and val_sets say what their '' means; tests/test_config.py finds any other path key.
PATH_KEYS = ("out_dir", "data_dir", "init_from", "resume")


# --- parsing: each key's type converts and checks its values (pydantic) -------------------------------

_FIELDS = {f.name: f for section in SECTIONS for f in dataclasses.fields(section)}  # every key's field
# what another value of each key does to a resumed run (its option's on_resume; the resume warning, launch/resume.py)
ON_RESUME_OF = {key: field.metadata["on_resume"] for key, field in _FIELDS.items()}


def known_key(key: str) -> str:
    """key, or a ConfigError naming it with the keys it may have meant."""
    close = ", ".join(k for k in _FIELDS if key and k.startswith(key[:4]))
    hint = f" (did you mean {close}?)" if close else ""
    require(key in _FIELDS, key or repr(key), f"unknown config key{hint}")
    return key


def coerce(key: str, value):
    """One value of key as its section's coerce converts and checks it (a ConfigError names the key)."""
    return SECTION_OF[known_key(key)].coerce(key, value)


# What PyYAML reads a plain scalar as, but numbers and dates: YAML 1.1's integers take `010` as octal 8, `1:00` as
# base-60 60 and `0b101` as 5, where the command line reads 10 and two errors; its floats and dates read `1:00.5`
# and `2001-12-14` likewise. So a plain scalar that looks like a number or a date stays text, and its key's type
# reads it as it reads the command line's text (Settings.coerce): the same value, or the same error naming the key.
_TEXT_TAGS = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp"}
# YAML's own words for infinity and NaN stay floats, which a float key then refuses as not finite (no key takes one):
# read as text they would be an unexplained "expected a number, got '.inf'".
_NON_FINITE = re.compile(r"^(?:[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader of an open file, with numbers read as the command line reads them, and each mapping's
    keys as written and each given once.

    A key is a name: YAML's own reading of `on`, `yes`, `no`, `null` or `1` as a boolean, null
    or number (which no key's name is) would turn it into something a message cannot name, or
    fail on. PyYAML keeps the last of a key given twice in one mapping, silently dropping the
    first; that is an error, naming the key and both lines. Messages name the file (self.name).
    """

    yaml_implicit_resolvers = {first: [(tag, regexp) for tag, regexp in resolvers if tag not in _TEXT_TAGS]
                               for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def construct_mapping(self, node, deep=False):
        if not isinstance(node, yaml.MappingNode):
            return super().construct_mapping(node, deep)
        lines: dict[str, int] = {}
        for key_node, _ in node.value:  # the keys as written (a merge's, `<<: *base`, may be overridden)
            if key_node.tag != "tag:yaml.org,2002:merge":
                key, line = self._name(key_node), key_node.start_mark.line + 1
                require(key not in lines, key, f"set twice in {self.name} (lines {lines.get(key)} and {line})"
                                               + _SECTION_HINT.get(key, ""))
                lines[key] = line
        self.flatten_mapping(node)  # the merged keys first, so that the mapping's own win
        return {self._name(key_node): self.construct_object(value_node, deep=deep)
                for key_node, value_node in node.value}

    def _name(self, key_node) -> str:
        require(isinstance(key_node, yaml.ScalarNode), "config", f"{self.name} line {key_node.start_mark.line + 1}: "
                f"a key must be a name, not a {'list' if isinstance(key_node, yaml.SequenceNode) else 'mapping'}")
        return key_node.value


_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _NON_FINITE, list("-+."))


# a key named like its section (`model: custom` beside `model: {n_layer: 2}`): say which is which
_SECTION_HINT = {name: f"; `{name}: VALUE` is the key and `{name}:` with keys under it the section of that name: "
                       f"give the key inside the section ({name}: {{{name}: VALUE, ...}})"
                 for name in SECTION_NAMED if name in _FIELDS}


def load_yaml(path: str | Path) -> dict:
    """The keys a YAML file sets, each converted and checked by its field's type (coerce): flat (`max_lr: 6e-4`), or
    nested under its section's name (`schedule: {max_lr: 6e-4}`); a key set twice is an error."""
    require_path("config", str(path))  # before Path, which reads '' as the current folder
    path = Path(path)
    require(path.is_file(), "config", f"no such file {path}")
    try:
        with path.open() as file:
            data = yaml.load(file, _ConfigLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {path} is not valid YAML ({first_line(e)})") from None
    require(isinstance(data, dict), "config", f"{path} must hold a mapping of keys to values")
    values: dict = {}
    for key, value in data.items():
        nested = key in SECTION_NAMED and isinstance(value, dict)  # `model: gpt2` is a key; `model: {...}` a section
        require(nested or key not in SECTION_NAMED or key in _FIELDS, key,
                f"a section: expected a mapping of its keys, got {value!r}")
        for inner, inner_value in value.items() if nested else [(key, value)]:
            owner = SECTION_OF[known_key(inner)].SECTION
            require(not nested or owner == key, inner, f"is a key of section {owner}, not of {key}")
            require(inner not in values, inner, f"set twice in {path}")
            values[inner] = coerce(inner, inner_value)
    return values


# --- the command line -------------------------------------------------------------------------------

USAGE = "train_gpt2.py [--config configs/NAME.yaml] [--key value | --key=value ...]"
DESCRIPTION = """\
Every key below can be set in the YAML file (flat, or nested under its section's name) or on the
command line (the command line wins). Each belongs to one settings section of the code."""
CONFIG_HELP = "YAML keys to start from (given twice: both, the second winning)"


def _pairs(argv: list[str]) -> list[list]:
    """argv as [key, value] pairs, `--key value` or `--key=value`, `-` in a key read as `_` (users type both). A
    value may start with one `-` (-1e-3, -x) but not two: `--seed --max_lr 1` is seed without its value (None). A
    word that is no `--key` and no key's value is [None, word]."""
    pairs: list[list] = []
    for arg in argv:
        if arg.startswith("--") and arg != "--":
            key, equals, value = arg[2:].partition("=")
            pairs.append([key.replace("-", "_"), value if equals else None])
        elif pairs and pairs[-1][0] is not None and pairs[-1][1] is None:
            pairs[-1][1] = arg
        else:
            pairs.append([None, arg])
    return pairs


def wants_help(argv: list[str]) -> bool:
    """Whether argv asks for --help (or -h) anywhere, but as the value of a key (`--sample_prompt -h`)."""
    return any(key == "help" or [key, value] == [None, "-h"] for key, value in _pairs(argv))


def usage() -> str:
    """--help: the keys by section, each with its type, help and default."""
    defaults = TrainConfig().to_dict()
    lines = [f"usage: {USAGE}", "", DESCRIPTION, "", "config file:", "  --config FILE.yaml", _indented(CONFIG_HELP)]
    for section in SECTIONS:
        lines += ["", f"{section.SECTION}:", f"  {section.SUMMARY}", ""]
        for key in section.keys():
            lines += [f"  --{key} {'|'.join(metavar for metavar, _ in section.kinds(key))}",
                      _indented(f"{_FIELDS[key].metadata['help']} (default: {json.dumps(defaults[key])})")]
    return "\n".join(lines) + "\n"


def _indented(text: str) -> str:
    return textwrap.indent(textwrap.fill(text, 92, break_on_hyphens=False), " " * 8)


def parse_args(argv: list[str]) -> TrainConfig:
    """`[--config FILE] [--key value | --key=value ...]` -> a validated TrainConfig: the YAML files' keys (a later
    file's winning), then the command line's (the last of a key winning)."""
    values = {}
    for key, value in sorted(_pairs(argv), key=lambda pair: pair[0] != "config"):  # the files first, in order
        require(key is not None, value, "expected --key value or --key=value")
        require(value is not None, key if key == "config" else known_key(key), "missing value")
        values.update(load_yaml(value) if key == "config" else {key: value})
    return TrainConfig(**values)


def config_yaml(config: TrainConfig | dict) -> str:
    """The configuration as YAML, flat (what `--config` reads back): a TrainConfig's, or a flat one (the trainer's
    run.config, with the B that micro_batch_size auto chose)."""
    return yaml.safe_dump(config if isinstance(config, dict) else config.to_dict(), sort_keys=False)
