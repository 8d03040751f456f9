"""What a launch checks before it imports torch: its configuration, the packages it names, the files it reads.

Importing torch and the training stack takes seconds (tens on a slow or busy machine); a key typo, a bad YAML
value or a missing data folder needs none of it to be found. So train_gpt2.py's first statement after the
launcher's is check_before_imports(__name__, check_command_line): run as a script, it checks its command line here
(launch/config.py, the settings sections and this module import neither torch nor the model) and a mistake is its
one `error:` line and exit code at once; only then does the script import the rest. main() checks the same again
(check_launch, milliseconds), since tests and tools call it without the script's first lines.

The files are checked as the trainer will open them, with the same errors: a resume path that names nothing, an
init_from that names no file, folder or preset, and data_dir's folders and the val sets without their shards
(data/shards.py, numpy alone). Only where every rank of the launch runs on this node: across nodes a file one
node lacks is found after the ranks connect, and shared with all of them (launch/build.py), so that no node is
left waiting for one that stopped before it connected.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from common.errors import NODE_RANKS, ConfigError, held_alike_by
from common.settings import require
from data.settings import parse_sources, parse_val_sets
from data.shards import find_shards, val_shards
from launch.config import TrainConfig, parse_args, usage, wants_help
from launch.estimate import estimate_flags, estimate_text, wants_estimate
from launch.estimate import usage as estimate_usage
from training.checkpoint.settings import no_checkpoint_at
from runtime.logger import TENSORBOARD_MISSING
from runtime.storage import filesystem, is_url
from training.run.settings import PRESET_NAMES, unknown_init_from


def check_command_line(argv: list[str]) -> None:
    """The trainer's command line, checked before torch is imported (train_gpt2.py hands this to common/errors.py's
    check_before_imports): --help prints the keys and exits 0; a mistake is a ReproError held alike by the node's
    ranks, as main's own check is."""
    if answered_without_training(argv):
        sys.exit(0)
    with held_alike_by(NODE_RANKS):  # before the ranks connect: a node's ranks read the same arguments and files
        check_launch(argv)


def answered_without_training(argv: list[str]) -> bool:
    """--help (anywhere: `--config configs/demo.yaml --help` too) prints the keys and the estimate's flags;
    --estimate prints what the run would cost (launch/estimate.py), from its checked configuration. Whether argv
    asked for one of them (then nothing is to be trained)."""
    if wants_help(argv):
        print(usage() + estimate_usage())
        return True
    if wants_estimate(argv):
        flags, config_argv = estimate_flags(argv)
        print(estimate_text(parse_args(config_argv), flags, " ".join(["train_gpt2.py", *config_argv])), end="")
        return True
    return False


def check_launch(argv: list[str]) -> TrainConfig:
    """argv's configuration, checked as far as it can be without torch: its keys and values (parse_args), the
    packages it asks for, and, where every rank runs on this node, the files it reads. A ReproError otherwise."""
    cfg = parse_args(argv)
    check_packages(cfg)
    if all_ranks_here():
        check_inputs(cfg)
    return cfg


def check_packages(cfg: TrainConfig) -> None:
    """The optional packages the configuration asks for are installed (a ConfigError naming what to install)."""
    logging, checkpoint_dir = cfg.logging, cfg.checkpoint.checkpoint_dir
    if logging.wandb and logging.resolved_wandb_mode() != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb: the wandb package is not installed (pip install wandb), or set --wandb false")
    if logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(TENSORBOARD_MISSING)
    if is_url(checkpoint_dir):
        filesystem(checkpoint_dir)  # a ConfigError naming the package a URL's scheme needs (s3fs, gcsfs)


def all_ranks_here() -> bool:
    """Whether every rank of this launch runs on this node: one process, or torchrun's workers of one node (its
    WORLD_SIZE is its LOCAL_WORLD_SIZE). Then what this node's files hold is what every rank reads."""
    world_size = os.environ.get("WORLD_SIZE", "1")
    return os.environ.get("LOCAL_WORLD_SIZE", world_size) == world_size


def check_inputs(cfg: TrainConfig) -> None:
    """The files and folders the run reads are there, in the order the trainer opens them and with its errors
    (launch/build.py): the checkpoint --resume names (a local one: a URL is looked up when it is read), data_dir's
    train shards, the val sets' shards, then init_from. What they hold is read once torch is imported."""
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never") and not is_url(resume):
        require(Path(resume).exists(), "resume", no_checkpoint_at(resume))
    data_dir, val_sets = cfg.data.data_dir, cfg.evaluation.val_sets
    for source in parse_sources(data_dir):
        find_shards(source.path, "train")
    for path in parse_val_sets(val_sets, data_dir).values():
        val_shards(path, "val_sets" if val_sets else "data_dir")
    init_from = cfg.model.init_from
    if init_from != "scratch" and init_from not in PRESET_NAMES and not is_url(init_from):
        require(Path(init_from).exists(), "init_from", unknown_init_from(init_from))
