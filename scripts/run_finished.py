"""Whether the run that some trainer arguments describe has finished: exit 0 if so, 1 if not.

    python scripts/run_finished.py --config configs/gpt2_124m.yaml --out_dir out/gpt2_124m [--key value ...]

Finished: the run folder's log.jsonl records the checkpoint of its last step (max_steps), which the trainer saves
after the final evaluations and logs once it is complete; with final_checkpoint off, the final val record. What
scripts/speedrun.sh asks before it launches the trainer, so that a finished run is not launched again (the
trainer would load its checkpoint only to find nothing to do). Any other state is for the trainer to continue.
A configuration the trainer would refuse is its one `error:` line, exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common.startup  # noqa: E402,F401 - first: a Ctrl-C while the modules below load is one line

from common.errors import ArgumentParser, run_cli  # noqa: E402
from launch.config import parse_args  # noqa: E402
from runtime.logger import LOG_NAME, read_log  # noqa: E402


def finished(argv: list[str]) -> bool:
    cfg = parse_args(argv)
    log = Path(cfg.run.out_dir) / LOG_NAME
    if not log.is_file():
        return False
    last, kind = cfg.schedule.max_steps, "checkpoint" if cfg.checkpoint.final_checkpoint else "val"
    return any(r.get("kind") == kind and r.get("step") == last for r in read_log(log))


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="scripts/run_finished.py", description=__doc__, allow_abbrev=False)
    _, trainer_argv = parser.parse_known_args(argv)  # all of them the trainer's: --help is this script's own
    return 0 if finished(trainer_argv) else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
