"""Config parsing and validation; every YAML file in configs/ is loaded and checked."""

from __future__ import annotations

import dataclasses
import datetime
import math
import re
import subprocess
import sys
import typing

import pytest
import yaml

from conftest import REPO, train_here
from slowness import guard
from runtime.settings import MAX_HANG_TIMEOUT_MINUTES
from launch.config import (SECTION_OF, SECTIONS, ConfigError, TrainConfig, config_yaml, load_yaml,
                           parse_args, usage)
from runtime.logger import LoggingSettings
from training.optim.schedule import ScheduleSettings, learning_rate
from training.optim.settings import LongRunSettings, OptimizerSettings
from training.run.settings import PRESET_NAMES
from model import PRESETS


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    cfg = parse_args(["--config", str(path)])
    assert cfg.data.total_batch_size % (cfg.data.micro_batch_size * cfg.data.seq_len) == 0
    assert cfg.data.grad_accum_steps(1) >= 1
    with open(path) as f:
        for key in yaml.safe_load(f):
            assert key in TrainConfig.keys()


def test_gpt2_124m_yaml_is_the_default_recipe():
    from_yaml = parse_args(["--config", str(REPO / "configs" / "gpt2_124m.yaml")])
    assert from_yaml == TrainConfig()
    d = TrainConfig()
    model, data, schedule, adamw = d.model, d.data, d.schedule, d.optimizer
    assert (model.vocab_size, model.block_size, data.total_batch_size, schedule.max_lr, schedule.min_lr,
            schedule.warmup_steps, schedule.max_steps) == (50304, 1024, 524288, 6e-4, 6e-5, 715, 19073)
    assert (adamw.weight_decay, adamw.beta1, adamw.beta2, adamw.adam_eps, adamw.grad_clip, d.evaluation.eval_interval,
            d.checkpoint.checkpoint_interval) == (0.1, 0.9, 0.95, 1e-8, 1.0, 250, 5000)
    assert model.model_config().n_layer == 12 and model.model_config().n_embd == 768


def test_command_line_overrides_yaml_and_both_syntaxes_work(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_lr: 1.0e-3\nmicro_batch_size: 8\ncompile: true\nwandb_tags: [a, b]\n")
    cfg = parse_args(["--config", str(path), "--max_lr=2e-3", "--seed", "7", "--wandb_tags", "x,y"])
    assert (cfg.schedule.max_lr, cfg.data.micro_batch_size, cfg.runtime.compile, cfg.runtime.seed,
            cfg.logging.wandb_tags) == (2e-3, 8, True, 7, ["x", "y"])
    assert parse_args(["--compile", "auto"]).runtime.compile is None
    assert parse_args(["--max_lr", "1"]).schedule.max_lr == 1.0
    assert isinstance(parse_args(["--max_lr", "1"]).schedule.max_lr, float)


@pytest.mark.parametrize("argv,message", [
    (["--lerning_rate", "1"], "lerning_rate: unknown config key"),
    (["--max_lr", "fast"], "max_lr: expected a number, got 'fast'"),
    (["--micro_batch_size", "2.5"], "micro_batch_size: expected an integer"),
    (["--compile", "maybe"], "compile: expected true/false"),
    (["--model", "gpt5"], "model: unknown model 'gpt5'"),
    (["--model", "custom", "--n_layer", "2"], "n_head: must be set when model is custom"),
    (["--n_layer", "2"], "n_layer: only used with model=custom"),
    (["--model", "custom", "--n_layer", "2", "--n_head", "3", "--n_embd", "64"], "n_embd: 64 is not divisible by n_head 3"),
    (["--seq_len", "2048"], "seq_len: 2048 exceeds block_size 1024"),
    (["--total_batch_size", "1000"], "total_batch_size: 1000 is not a multiple of seq_len 1024"),
    (["--max_steps", "0"], "max_steps: must be positive"),
    (["--min_lr", "1e-2"], "min_lr: 0.01 is above max_lr"),
    (["--device", "tpu"], "device: unknown device 'tpu'"),
    (["--dtype", "float8"], "dtype: unknown dtype"),
    (["--wandb_mode", "cloud"], "wandb_mode: unknown mode"),
    (["--beta2", "1.0"], "beta2: must be in [0, 1)"),
    (["--vocab_size", "1000"], "hellaswag_interval: needs vocab_size >= 50257 (GPT-2's tokenizer), got 1000"),
    (["--vocab_size", "1000", "--hellaswag_interval", "0"], "sample_interval: needs vocab_size >= 50257"),
    (["max_lr", "1"], "max_lr: expected --key value"),
    (["--seed"], "seed: missing value"),
])
def test_bad_values_name_the_key(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)


def test_yaml_types_are_checked(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: true\n")
    with pytest.raises(ConfigError, match="max_steps: expected an integer, got True"):
        load_yaml(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_yaml(path)
    with pytest.raises(ConfigError, match="config: no such file"):
        load_yaml(tmp_path / "missing.yaml")


def test_grad_accum_must_divide_exactly():
    cfg = TrainConfig(total_batch_size=524288, micro_batch_size=64, seq_len=1024)
    assert cfg.data.grad_accum_steps(8) == 1 and cfg.data.grad_accum_steps(1) == 8
    with pytest.raises(ConfigError, match="total_batch_size: 524288 is not divisible by micro_batch_size"):
        cfg.data.grad_accum_steps(3)


def test_a_validated_configuration_cannot_be_written_to():
    """What a launch finds out (micro_batch_size auto's B) is handed down beside the configuration, never written
    into it: every section, and the configuration itself, refuses a write, so nothing read later can differ from
    what was validated."""
    import dataclasses

    cfg = TrainConfig(micro_batch_size="auto")
    for section in SECTIONS:
        key = section.keys()[0]
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(cfg, section.SECTION), key, getattr(getattr(cfg, section.SECTION), key))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data = cfg.data
    assert cfg.data.micro_batch_size is None


def test_the_model_section_names_model_pys_presets():
    """The section knows the presets by name without importing model.py (torch); model_config takes their shapes."""
    assert PRESET_NAMES == tuple(PRESETS)
    for name, shape in PRESETS.items():
        config = TrainConfig(model=name).model.model_config()
        assert dict(n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd) == shape


@pytest.mark.slow
def test_trainer_reports_config_errors_on_one_line_with_exit_code_2():
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt2.py"), "--max_lr", "fast"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: max_lr: expected a number, got 'fast'"
    assert "Traceback" not in proc.stderr
    helped = subprocess.run([sys.executable, str(REPO / "train_gpt2.py"), "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--total_batch_size" in helped.stdout


@pytest.mark.slow
def test_the_configuration_is_read_without_torch():
    """launch/config.py and every settings section import neither torch, numpy nor the model, and nor do the
    trainer's early checks torch: train_gpt2.py checks its arguments before it imports them (seconds)."""
    code = "\n".join([
        "import sys",
        "from launch.config import parse_args, usage",
        "usage()",
        "parse_args(['--config', 'configs/demo.yaml', '--max_steps', '1', '--optimizer', 'muon', '--strategy', 'fsdp'])",
        "print(sorted(name for name in ('torch', 'numpy', 'model') if name in sys.modules))",
        "import launch.early_checks",
        "print(sorted(name for name in ('torch', 'model') if name in sys.modules))",
    ])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=guard(60))
    assert (proc.returncode, proc.stdout) == (0, "[]\n[]\n"), proc.stderr[-2000:]


def test_every_float_spelling_is_accepted_from_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_lr: 6e-4\nmin_lr: 6E-5\nweight_decay: .1\nadam_eps: 1e-8\ngrad_clip: 1\n")
    values = load_yaml(path)  # each as the command line's text (PyYAML alone reads `6e-4`, no dot, as a string)
    assert values == {"max_lr": 6e-4, "min_lr": 6e-5, "weight_decay": 0.1, "adam_eps": 1e-8, "grad_clip": 1.0}
    path.write_text("max_lr: fast\n")
    with pytest.raises(ConfigError, match="max_lr: expected a number, got 'fast'"):
        load_yaml(path)


# Numbers as YAML 1.1 (PyYAML) would read them otherwise: octal, sexagesimal, binary, hex; and the spellings both read
@pytest.mark.parametrize("key,text", [
    *[("seed", text) for text in ("010", "0010", "-010", "0b101", "0x10", "0o10", "1:00", "1_000", "+5", "0", "1e3",
                                  "2001-12-14")],
    *[("warmup_steps", text) for text in ("010", "1:00", "1:00:00", "0b101", "0x1f")],
    *[("peak_flops", text) for text in ("010.5", "1:00.5", "1_0.5", "6e-4", ".5", "1.", "010", "0x10", "1:00")],
    *[("wandb_run_name", text) for text in ("010", "1:00", "0x10", "1e3", "2001-12-14")],  # text stays text
    *[("wandb_tags", text) for text in ("[010, 1:00]", "010")],
])
def test_a_yaml_number_reads_as_the_command_line_reads_it(key, text, tmp_path):
    """YAML's `seed: 010` was 8 and `warmup_steps: 1:00` 60 (YAML 1.1's octal and base 60), where `--seed 010` is 10
    and `--warmup_steps 1:00` an error: the same value, or the same error naming the key, from both."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: {text}\n")
    outcomes = []
    for argv in (["--config", str(path)], [f"--{key}", text.strip("[]").replace(", ", ",")]):
        try:
            outcomes.append(parse_args(argv).to_dict()[key])
        except ConfigError as e:
            outcomes.append(f"error: {e}")
    from_yaml, from_command_line = outcomes
    assert from_yaml == from_command_line


def test_a_yaml_weight_reads_as_the_command_line_reads_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data_dir: {data/a: 010, data/b: 1:00}\nval_sets: {a: 010}\n")
    assert load_yaml(path) == {"data_dir": "data/a:010,data/b:1:00", "val_sets": "a=010"}


def test_string_values_are_kept_exactly_as_written():
    assert parse_args(["--sample_prompt", ""]).evaluation.sample_prompt == ""
    assert parse_args(["--sample_prompt", " to be"]).evaluation.sample_prompt == " to be"  # a leading space is a token
    assert parse_args(["--sample_prompt= or not "]).evaluation.sample_prompt == " or not "


@pytest.mark.parametrize("seed,ok", [(-1, False), (0, True), (2**64 - 1, True), (2**64, False)])
def test_seed_must_fit_every_generator_it_feeds(seed, ok):
    if ok:
        assert parse_args(["--seed", str(seed)]).runtime.seed == seed
    else:
        with pytest.raises(ConfigError, match=r"seed: must be in \[0, 2\*\*64\)"):
            parse_args(["--seed", str(seed)])


def test_help_lists_every_key_once_under_its_section():
    """--help (generated from the sections) groups the keys by the section that declares them."""
    under: dict[str, list[str]] = {}
    group = None
    for line in usage().splitlines():
        if line and not line.startswith(" "):
            group = line.removesuffix(":")  # a group's title (or the usage line and the description)
        elif found := re.match(r"  --(\w+) ", line):
            under.setdefault(found[1], []).append(group)
    assert under == {"config": ["config file"], **{key: [section.SECTION] for section in SECTIONS
                                                   for key in section.keys()}}
    flat = "".join(usage().split())  # --help wraps the help text
    for f in (f for section in SECTIONS for f in dataclasses.fields(section)):
        assert "".join(f.metadata["help"].split()) in flat, f.name


def test_the_configuration_table_lists_every_key_once_under_its_section():
    table = (REPO / "docs" / "CONFIGURATION.md").read_text()
    documented, section = [], None
    for row in table.splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`"):  # | section (its first row only) | keys | meaning |
            section = cells[0] or section
            documented += [(key, section) for key in re.findall(r"`(\w+)`", cells[1])]
    assert sorted(documented) == sorted((key, section.SECTION) for section in SECTIONS for key in section.keys())


def test_the_sections_partition_the_keys():
    """TrainConfig declares no key itself: each is a field of exactly one section, in the sections' order."""
    assert [key for section in SECTIONS for key in section.keys()] == list(TrainConfig.keys())
    names = [section.SECTION for section in SECTIONS]
    assert len(set(names)) == len(names) == 12 and "config" not in names
    cfg = TrainConfig()
    assert [f.name for f in dataclasses.fields(TrainConfig)] == names  # cfg.schedule: the schedule section
    for section in SECTIONS:
        assert getattr(cfg, section.SECTION) == section(), section.SECTION  # a section stands alone, with its defaults
        assert type(getattr(cfg, section.SECTION)) is section


@pytest.mark.parametrize("section,values,message", [
    (OptimizerSettings, dict(beta2=1.0), "beta2: must be in [0, 1), got 1.0"),
    (ScheduleSettings, dict(max_lr=math.inf), "max_lr: must be a finite number, got inf"),
    (ScheduleSettings, dict(min_lr=1e-2), "min_lr: 0.01 is above max_lr 0.0006"),
    (LongRunSettings, dict(rollback_after=2), "rollback_after: counts skipped steps, so it needs spike_skip: true"),
    (LoggingSettings, dict(wandb_mode="cloud"), "wandb_mode: unknown mode 'cloud'"),
])
def test_a_section_checks_its_own_keys(section, values, message):
    with pytest.raises(ConfigError) as caught:
        section(**values)
    assert str(caught.value).startswith(message)
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**values)  # the same rule, the same message
    assert str(caught.value).startswith(message)


def test_the_rules_that_span_sections_are_trainconfigs():
    from data.settings import DataSettings

    assert DataSettings(seq_len=2048).seq_len == 2048  # the data section alone cannot know block_size
    with pytest.raises(ConfigError, match="^seq_len: 2048 exceeds block_size 1024$"):
        TrainConfig(seq_len=2048)
    assert ScheduleSettings(max_lr=0.0, min_lr=0.0).max_lr == 0  # nor the schedule the optimizer
    with pytest.raises(ConfigError, match="^max_lr: must be positive with optimizer muon"):
        TrainConfig(optimizer="muon", max_lr=0.0, min_lr=0.0)


def test_the_schedule_is_handed_its_section():
    schedule = TrainConfig(max_steps=100, warmup_steps=10, lr_schedule="wsd").schedule
    assert [schedule.lr(s) for s in range(105)] == [learning_rate(s, 10, 100, 6e-4, 6e-5, "wsd", 0.2, "linear")
                                                   for s in range(105)]


def test_yaml_keys_may_be_nested_under_their_section(tmp_path):
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("model: custom\nn_layer: 2\nn_head: 2\nn_embd: 64\noptimizer: adamw\nmax_lr: 1e-3\nseed: 3\n")
    nested.write_text("model: {model: custom, n_layer: 2, n_head: 2, n_embd: 64}\noptimizer: {optimizer: adamw}\n"
                      "schedule:\n  max_lr: 1e-3\nseed: 3\n")
    assert load_yaml(nested) == load_yaml(flat)
    assert parse_args(["--config", str(nested)]) == parse_args(["--config", str(flat)])
    for text, message in [("schedule: {beta2: 0.9}\n", "beta2: is a key of section optimizer, not of schedule"),
                          ("schedule: {lerning_rate: 1}\n", "lerning_rate: unknown config key"),
                          ("max_lr: 1e-3\nschedule: {max_lr: 2e-3}\n", "max_lr: set twice in "),
                          ("checkpoint: 5\n", "checkpoint: a section: expected a mapping of its keys, got '5'"),
                          ("model: [gpt2]\n", "model: expected a string, got ['gpt2']")]:
        nested.write_text(text)
        with pytest.raises(ConfigError) as caught:
            load_yaml(nested)
        assert str(caught.value).startswith(message), text


@pytest.mark.parametrize("text,message", [
    ("on: true\n", "on: unknown config key"),  # YAML reads on, yes, no (and null, 1) as no name: kept as written
    ("yes: 1\n", "yes: unknown config key"),
    ("1: 2\n", "1: unknown config key"),
    ("null: 1\n", "null: unknown config key"),
    ("'': 1\n", "'': unknown config key"),  # not every key as the one it may have meant
    ("? [a, b]\n: 1\n", "config: {path} line 1: a key must be a name, not a list"),
    ("max_lr: 1e-3\nmax_lr: 2e-3\n", "max_lr: set twice in {path} (lines 1 and 2)"),  # PyYAML keeps the last
    ("schedule:\n  max_lr: 1e-3\n  max_lr: 2e-3\n", "max_lr: set twice in {path} (lines 2 and 3)"),
    ("schedule: {max_lr: 1e-3}\nschedule: {min_lr: 1e-4}\n", "schedule: set twice in {path} (lines 1 and 2)"),
    # model is a key and a section: either one silently dropped the other
    ("model: custom\nmodel:\n  n_layer: 2\n", "model: set twice in {path} (lines 1 and 2); `model: VALUE` is the key "
                                             "and `model:` with keys under it the section of that name: give the key "
                                             "inside the section (model: {{model: VALUE, ...}})"),
    ("model:\n  n_layer: 2\nmodel: custom\n", "model: set twice in {path} (lines 1 and 3); `model: VALUE` is the key"),
], ids=["on", "yes", "1", "null", "empty", "a list", "flat twice", "nested twice", "a section twice", "model key, then section",
        "model section, then key"])
def test_a_yaml_key_that_is_no_name_or_is_given_twice_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        parse_args(["--config", str(path)])
    assert str(caught.value).startswith(message.format(path=path)) and "\n" not in str(caught.value)


def test_names_in_a_yaml_mapping_value_are_kept_as_written(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("val_sets:\n  on: /x\n  2023: /y\nschedule:\n  <<: {max_lr: 1e-3, min_lr: 1e-4}\n  max_lr: 2e-3\n")
    assert load_yaml(path) == {"val_sets": "on=/x,2023=/y", "max_lr": 2e-3, "min_lr": 1e-4}  # a merge's key overridden


@pytest.mark.parametrize("argv,value", [
    (["--max-lr", "1e-3"], ("max_lr", 1e-3)),  # - or _ in a key
    (["--max-lr=1e-3"], ("max_lr", 1e-3)),
    (["--sample_prompt", "-x"], ("sample_prompt", "-x")),  # a value starting with - is a value
    (["--sample_prompt", "- x"], ("sample_prompt", "- x")),
    (["--seed", "3", "--seed", "4"], ("seed", 4)),  # the last one wins
    (["--wandb_tags", ""], ("wandb_tags", [])),
    (["--wandb_tags", "a,b"], ("wandb_tags", ["a", "b"])),
    (["--max_steps", "1_000"], ("max_steps", 1000)),  # numbers as Python writes them
    (["--max_lr", ".5"], ("max_lr", 0.5)),
    (["--max_lr", "6E-4"], ("max_lr", 6e-4)),
    (["--peak_flops", "1_000.5"], ("peak_flops", 1000.5)),
    *[(["--compile", word], ("compile", word in ("true", "yes", "on", "1"))) for word in
      ("true", "false", "yes", "no", "on", "off", "1", "0")],
    *[(["--compile", word], ("compile", None)) for word in ("auto", "null", "none", "None")],
])
def test_command_line_spellings(argv, value):
    key, expected = value
    assert parse_args(argv).to_dict()[key] == expected


@pytest.mark.parametrize("argv,message", [
    (["--min_lr", "-1e-3"], "min_lr: must be >= 0, got -0.001"),  # -1e-3 is a value, not an option
    (["--max", "1"], "max: unknown config key (did you mean max_steps, max_lr, max_rollbacks?)"),  # no abbreviations
    (["--help"], "help: unknown config key"),  # train_gpt2.main answers --help before it parses (wants_help)
    (["--seed", "--max_lr", "1"], "seed: missing value"),
    (["--config"], "config: missing value"),
    (["--max_lr", "1", "extra"], "extra: expected --key value or --key=value"),
    (["--"], "--: expected --key value or --key=value"),
])
def test_command_line_mistakes_are_one_line_naming_the_key(argv, message):
    with pytest.raises(ConfigError) as caught:
        parse_args(argv)
    assert str(caught.value) == message


@pytest.mark.parametrize("keys,message", [
    (dict(max_steps=2.5), "max_steps: expected an integer, got 2.5"),
    (dict(max_steps=True), "max_steps: expected an integer, got True"),  # a bool is no number
    (dict(max_lr=True), "max_lr: expected a number, got True"),
    (dict(compile=1), "compile: expected true/false or null, got 1"),
    (dict(model=["gpt2"]), "model: expected a string, got ['gpt2']"),
    (dict(out_dir=None), "out_dir: expected a string, got None"),
    (dict(wandb_tags=[1]), "wandb_tags: expected a list of strings, got [1]"),
    (dict(seq_len="x"), "seq_len: expected an integer, got 'x'"),
    (dict(data_dir={"a": [1]}), "data_dir: expected a mapping of names to values, got {'a': [1]}"),
])
def test_values_given_in_code_are_checked_like_the_command_lines(keys, message):
    """TrainConfig(**keys) and a section made alone check each value's type as the command line and YAML do (it
    took max_steps=2.5 or True, and a string, unchecked, to fail later or never)."""
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**keys)
    assert str(caught.value) == message
    with pytest.raises(ConfigError) as caught:
        SECTION_OF[next(iter(keys))](**keys)
    assert str(caught.value) == message


def test_values_given_in_code_may_be_written_as_users_write_them():
    cfg = TrainConfig(max_lr="6e-4", max_steps="1_000", micro_batch_size="auto", compile="on", wandb_tags="a,b",
                      data_dir={"data/a": 0.7, "data/b": 3}, val_sets={"a": "data/a", "b": "data/b"})
    assert (cfg.schedule.max_lr, cfg.schedule.max_steps, cfg.data.micro_batch_size, cfg.runtime.compile,
            cfg.logging.wandb_tags) == (6e-4, 1000, None, True, ["a", "b"])
    assert (cfg.data.data_dir, cfg.evaluation.val_sets) == ("data/a:0.7,data/b:3", "a=data/a,b=data/b")
    assert cfg == TrainConfig(**cfg.to_dict()) and TrainConfig(max_lr=1).schedule.max_lr == 1.0  # ints are numbers


# every float key, found from the field types (not from the list config.py keeps), so a new one is covered
FLOAT_KEYS = [key for section in SECTIONS for key, hint in typing.get_type_hints(section).items()
              if hint is float or float in typing.get_args(hint)]


def test_the_float_keys_are_found():
    assert {"max_lr", "hang_timeout_minutes", "peak_flops", "straggler_factor"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_no_float_key_takes_a_non_finite_value(key, value, tmp_path):
    with pytest.raises(ConfigError) as caught:
        parse_args([f"--{key}", value])
    assert str(caught.value) == f"{key}: must be a finite number, got {float(value)}"
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: {value.replace('inf', '.inf').replace('nan', '.nan')}\n")  # YAML's spellings
    with pytest.raises(ConfigError, match=f"^{key}: must be a finite number"):
        parse_args(["--config", str(path)])


def test_a_hang_timeout_that_would_overflow_is_one_line_at_start_up(capfd):
    """It used to pass, then crash every rank after the first step: timedelta(minutes=1e300) overflows."""
    assert train_here(["--hang_timeout_minutes", "1e300"]) == 2
    assert capfd.readouterr().err == (f"error: hang_timeout_minutes: must be positive and at most "
                                      f"{MAX_HANG_TIMEOUT_MINUTES} (a year), got 1e+300\n")
    assert train_here(["--hang_timeout_minutes", "inf"]) == 2
    assert capfd.readouterr().err == "error: hang_timeout_minutes: must be a finite number, got inf\n"
    with pytest.raises(ConfigError, match="hang_timeout_minutes: must be positive and at most"):
        parse_args(["--hang_timeout_minutes", str(MAX_HANG_TIMEOUT_MINUTES + 1)])
    longest = parse_args(["--hang_timeout_minutes", str(MAX_HANG_TIMEOUT_MINUTES)]).runtime.hang_timeout_minutes
    assert datetime.timedelta(minutes=longest) == datetime.timedelta(days=365)  # what the trainer builds from it


@pytest.mark.parametrize("given,stored", [
    ("ckpts", "{cwd}/ckpts"), ("./a/../ckpts/", "{cwd}/ckpts"), ("file://ckpts", "file://{cwd}/ckpts"),
    ("file://./ckpts", "file://{cwd}/ckpts"), ("", ""), ("/abs/ckpts", "/abs/ckpts"),
    ("file:///abs/ckpts", "file:///abs/ckpts"), ("s3://bucket/run", "s3://bucket/run"),
])
def test_a_relative_checkpoint_dir_is_stored_absolute(given, stored, tmp_path, monkeypatch):
    """Resolved against the folder the trainer starts in, so config.yaml names the place for tools run elsewhere."""
    monkeypatch.chdir(tmp_path)
    cfg = parse_args(["--checkpoint_dir", given])
    assert cfg.checkpoint.checkpoint_dir == stored.format(cwd=tmp_path)
    written = tmp_path / "config.yaml"
    written.write_text(config_yaml(cfg))  # what the trainer writes into the run folder
    assert yaml.safe_load(written.read_text())["checkpoint_dir"] == cfg.checkpoint.checkpoint_dir
    monkeypatch.chdir(tmp_path.parent)
    assert parse_args(["--config", str(written)]) == cfg  # read back from elsewhere: the same place


def test_every_key_is_classified_by_what_it_does_to_a_resumed_run():
    """A new key must say whether it changes the training math (the resume warning tells users which did): always,
    never, or as a function of the other settings, which reads only keys there are."""
    from common.settings import ON_RESUME, changes_training_math
    from launch.config import ON_RESUME_OF

    assert ON_RESUME_OF.keys() == set(TrainConfig.keys())
    config = TrainConfig().to_dict()
    for key, declared in ON_RESUME_OF.items():
        assert declared in ON_RESUME or callable(declared), key
        assert changes_training_math(declared, config) in (True, False), key


class Warnings:
    """A RunLogger's warn, collected."""

    def __init__(self):
        self.lines: list[str] = []

    def warn(self, text: str) -> None:
        self.lines.append(text)


def resume_warnings(saved: dict, **now) -> list[str]:
    from launch.resume import warn_on_changed_settings

    logger = Warnings()
    warn_on_changed_settings(TrainConfig(**now).to_dict(), TrainConfig(**saved).to_dict(), logger.warn)
    return logger.lines


def test_a_resume_that_changes_no_math_key_says_so():
    storage_and_logging = dict(out_dir="/runs/b", checkpoint_dir="/ckpts/b", checkpoint_format="sharded",
                               checkpoint_async=False, final_checkpoint=False, strategy="fsdp", log_interval=10,
                               eval_interval=100, hellaswag_interval=0, sample_interval=0, wandb=True,
                               tensorboard=True, hang_timeout_minutes=30.0, rank_stats_interval=0, loss_chunk_size=0,
                               micro_batch_size=16, compile=True, checkpoint_interval=100)
    (line,) = resume_warnings(dict(out_dir="/runs/a", checkpoint_dir="/ckpts/a"), **storage_and_logging)
    assert line.startswith("resuming with settings that differ from the checkpoint's: out_dir '/runs/a' -> '/runs/b', ")
    for key, value in storage_and_logging.items():
        assert f" {key} " in line and f"-> {value!r}" in line, key
    assert line.endswith("(this run uses the new values; none of them changes the training math)")
    assert "differ from an uninterrupted run" not in line


def test_a_resume_that_changes_math_keys_names_them():
    (line,) = resume_warnings({}, max_lr=3e-4, log_interval=10)
    assert line == ("resuming with settings that differ from the checkpoint's: max_lr 0.0006 -> 0.0003, log_interval "
                    "1 -> 10 (this run uses the new values; max_lr changes the training math: the steps after the "
                    "resume differ from an uninterrupted run)")
    (line,) = resume_warnings({}, seed=7, beta2=0.5)
    assert line.endswith("(this run uses the new values; beta2, seed change the training math: the steps after the "
                         "resume differ from an uninterrupted run)")
    assert resume_warnings({}, resume="never") == []  # resume is how a run picks its checkpoint: never named


@pytest.mark.parametrize("saved,now,math", [
    ({}, dict(micro_batch_size=16), False),  # without dropout: the same rows in a step, summed in another order
    (dict(dropout=0.1), dict(dropout=0.1, micro_batch_size=16), True),  # with it: other masks on the rows
    ({}, dict(compile=True), False),
    (dict(dropout=0.1), dict(dropout=0.1, compile=True), True),
    (dict(dropout=0.1), dict(dropout=0.1, micro_batch_size_fallback=8), False),  # B itself is named where it changed
    ({}, dict(checkpoint_interval=100), False),  # without rollbacks the cadence changes no step
    (dict(rollback_on_nonfinite=True), dict(rollback_on_nonfinite=True, checkpoint_interval=100), True),
    ({}, dict(max_rollbacks=1), False),
    (dict(rollback_on_nonfinite=True), dict(rollback_on_nonfinite=True, max_rollbacks=1), True),
    # issue 52: spike settings while spike_skip is off are never read (the losses are bitwise equal)
    ({}, dict(spike_window=16, spike_threshold=3.0), False),
    (dict(spike_skip=True), dict(spike_skip=True, spike_window=16), True),
    (dict(spike_skip=True), dict(spike_skip=True, spike_threshold=3.0), True),
    (dict(spike_skip=True), dict(spike_skip=True, rollback_after=2), True),
    ({}, dict(spike_skip=True, spike_window=16), True),  # the switch itself changes the math
    ({}, dict(muon_lr=0.01, muon_momentum=0.9, muon_weight_decay=0.1), False),  # adamw reads none of them
    (dict(optimizer="muon"), dict(optimizer="muon", muon_lr=0.01), True),
    ({}, dict(cooldown_frac=0.5, cooldown_shape="1-sqrt"), False),  # the cosine schedule has no cooldown
    (dict(lr_schedule="wsd"), dict(lr_schedule="wsd", cooldown_frac=0.5), True),
])
def test_keys_that_change_the_math_only_with_another_setting(saved, now, math):
    (line,) = resume_warnings(saved, **now)
    assert ("the steps after the resume differ from an uninterrupted run" in line) is math
    assert ("none of them changes the training math" in line) is not math


# --- issue 44: --help anywhere, what --help says of auto values ---------------------------------------------

@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--config", "configs/demo.yaml", "--help"],
                                  ["--max_lr", "1e-3", "-h", "--seed", "1"]])
def test_help_anywhere_in_the_command_prints_the_usage(argv, capfd):
    """Before: only as the first argument (`--config configs/demo.yaml --help` was `error: help: unknown config key`)."""

    assert train_here(argv) == 0
    out, err = capfd.readouterr()
    assert out.startswith("usage: train_gpt2.py") and not err


def test_a_key_whose_value_is_minus_h_is_not_a_help_request():
    from launch.config import wants_help

    assert not wants_help(["--sample_prompt", "-h"]) and wants_help(["--sample_prompt", "x", "-h"])


def test_help_shows_what_each_key_accepts_and_auto_is_auto():
    """micro_batch_size takes an integer or auto (its None): --help said INT|null, an error said `or null`."""
    assert "--micro_batch_size INT|auto" in usage() and "--n_layer INT|null" in usage()
    assert parse_args(["--micro_batch_size", "auto"]).data.micro_batch_size is None
    with pytest.raises(ConfigError, match="micro_batch_size: expected an integer or auto, got 'x'"):
        parse_args(["--micro_batch_size", "x"])


def test_help_and_the_configuration_table_say_alike_what_dtype_auto_picks(monkeypatch):
    """Before: --help said bf16 on CPUs where it is faster, CONFIGURATION.md bf16 wherever the hardware has it."""
    import torch

    from runtime import runtime

    cpu_rule = "on CPUs with AMX, and on AMD CPUs with AVX512-BF16, where it is faster, else float32"
    table = " ".join((REPO / "docs" / "CONFIGURATION.md").read_text().split())
    assert cpu_rule in " ".join(usage().split()) and cpu_rule in table
    for native, picked in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda native=native: native)
        assert runtime.resolve_dtype("auto", torch.device("cpu")) == picked
    assert runtime.resolve_dtype("auto", torch.device("mps")) == "float32"
    assert "MPS: float32" in usage() and "on MPS float32" in table


@pytest.mark.parametrize("key", ["out_dir", "data_dir", "init_from", "resume"])
@pytest.mark.parametrize("value", ["", " "])
def test_a_path_key_that_names_nothing_is_refused(key, value, tmp_path):
    """`--out_dir "$RUN"` with RUN unset gave out_dir '', which is the current folder: the run was written there."""
    message = f"{key}: {value!r} names no file or folder (an unset shell variable?)"
    with pytest.raises(ConfigError) as caught:
        parse_args([f"--{key}", value])
    assert str(caught.value) == message
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: {value!r}\n")
    with pytest.raises(ConfigError) as caught:
        parse_args(["--config", str(path)])
    assert str(caught.value) == message


def test_every_path_key_refuses_nothing_or_says_what_it_means():
    """A key whose help names a file, folder or path either refuses '' or documents what its '' means
    (checkpoint_dir's out_dir/checkpoints, hellaswag_path's download): a new path key is covered."""
    path_keys = [key for section in SECTIONS for key in section.keys() if re.search(r"_(dir|path)$", key)
                 or re.search(r"\b(folder|path|file)\b|\.pt\b", section.__dataclass_fields__[key].metadata["help"])]
    assert {"out_dir", "data_dir", "init_from", "resume", "checkpoint_dir", "hellaswag_path"} <= set(path_keys)
    for key in path_keys:
        if "''" not in SECTION_OF[key].__dataclass_fields__[key].metadata["help"]:
            with pytest.raises(ConfigError, match=f"^{key}: "):
                parse_args([f"--{key}", ""])


def test_an_empty_config_path_is_refused():
    with pytest.raises(ConfigError) as caught:
        parse_args(["--config", ""])
    assert str(caught.value) == "config: '' names no file or folder (an unset shell variable?)"
