"""A short real run on every GPU, stopped by SIGTERM to torchrun mid-run, then launched again: it must go on
from the checkpoint the signal saved and end where an uninterrupted run ends, its log continuous.

    python benchmarks/preemption_check.py --out /tmp/preemption --data_dir data/edu_fineweb10B   # GPT-2 124M, all GPUs
    python benchmarks/preemption_check.py --out /tmp/preemption --nproc 2 --max_steps 24 --signal_after 4 \\
        --model custom --n_layer 2 --n_head 2 --n_embd 64 --block_size 32 --seq_len 32 --micro_batch_size 2 \\
        --total_batch_size 128 --device cpu --dtype float32 --compile false --val_tokens 64   # a CPU rehearsal

What a scheduler does to a job before it takes the machine away: SIGTERM to the launcher, which forwards
it to every worker; the trainer saves at the next step boundary and exits (docs/OPERATIONS.md,
"Preemption"). Here `torchrun --standalone --nproc_per_node=N train_gpt2.py` runs with the trainer
arguments given after this script's own (the trainer's defaults are GPT-2 124M's configuration), into
OUT/run, for --max_steps steps with --resume auto; once its log holds step --signal_after, torchrun gets
SIGTERM; then the same command runs again. Evaluations, samples and periodic checkpoints are off unless
the arguments turn them on (the val loss after the last step stays). Checked:
  - the first launch said "SIGTERM received: saved step S", signal_after < S < max_steps, and its newest
    checkpoint is step S;
  - the second exited 0, said it resumed at step S, and saved the last step's checkpoint;
  - the log's training records are steps 0 to max_steps - 1, one each, every loss finite.
Writes --json (the steps, each launch's seconds, the losses either side of the stop, what failed) and
each launch's console, OUT/launch1.log and OUT/launch2.log. A failed check is an error line, exit 1.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: launch, training

from common.errors import ArgumentParser, ConfigError, ReproError, run_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# What only the steps need: no evaluations, samples or periodic checkpoints (the caller's arguments come after, and win)
QUIET = ["--eval_interval", "0", "--hellaswag_interval", "0", "--sample_interval", "0", "--checkpoint_interval", "0",
         "--wandb", "false"]
SAVED = re.compile(r"SIGTERM received: saved step (\d+)")
RESUMED = re.compile(r"resumed from \S+ at step (\d+)")


def train_steps(log: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training record of a run's log.jsonl, in file order; none before it exists."""
    from runtime.logger import read_log

    return [(r["step"], r["loss"]) for r in read_log(log) if r.get("kind") == "train"] if log.exists() else []


def last_error(console: Path) -> str:
    """The console's first `error:` line (the trainer's one-line reason), else its last line."""
    lines = console.read_text(errors="replace").splitlines() if console.exists() else []
    return next((line for line in lines if line.startswith("error:")), lines[-1] if lines else "no output")


def finish(proc: subprocess.Popen, timeout: float) -> int:
    """proc's exit status, waiting at most `timeout` s; past that it is stopped (SIGTERM, then SIGKILL)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun forwards it: the workers save and leave
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()  # its workers take their launcher's death as a stop (runtime/process_group.py)
            proc.wait()
        return -1


def check(first: dict, second: dict, steps: list[tuple[int, float]], max_steps: int, signal_after: int) -> list[str]:
    """What went wrong, one sentence each (none: the run was preempted and resumed as it should be).

    first and second: each launch's exit status ("exit"), console text ("console") and newest checkpoint step
    after it ended ("newest"); steps: (step, loss) of the log's training records after the second."""
    problems = []
    saved = SAVED.search(first["console"])
    if not saved:
        return [f"the first launch never said it saved after SIGTERM (exit {first['exit']}): {first['error']}"]
    saved_step = int(saved.group(1))
    if not signal_after < saved_step < max_steps:
        problems.append(f"SIGTERM after step {signal_after} saved step {saved_step}, not one between it and "
                        f"{max_steps}: the signal did not land mid-run")
    if first["newest"] != saved_step:
        problems.append(f"the newest checkpoint after the first launch is step {first['newest']}, "
                        f"not the {saved_step} it said it saved")
    if second["exit"] != 0:
        problems.append(f"the second launch exited {second['exit']}: {second['error']}")
    resumed = RESUMED.search(second["console"])
    if not resumed or int(resumed.group(1)) != saved_step:
        problems.append(f"the second launch did not resume at step {saved_step}: "
                        + (f"it resumed at step {resumed.group(1)}" if resumed else "it never said it resumed"))
    if second["newest"] != max_steps:
        problems.append(f"the newest checkpoint after the second launch is step {second['newest']}, not {max_steps}")
    logged = [step for step, _ in steps]
    if logged != list(range(max_steps)):
        missing = sorted(set(range(max_steps)) - set(logged))
        repeated = sorted({s for s in logged if logged.count(s) > 1})
        problems.append(f"the log's training steps are not 0 to {max_steps - 1} once each: "
                        f"missing {missing[:10]}, repeated {repeated[:10]}")
    bad = [step for step, loss in steps if not math.isfinite(loss)]
    if bad:
        problems.append(f"losses that are not finite at steps {bad[:10]}")
    return problems


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="benchmarks/preemption_check.py", description=__doc__)
    parser.add_argument("--out", required=True, help="an empty or new folder: the run (OUT/run) and the consoles")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU visible)")
    parser.add_argument("--max_steps", type=int, default=30, help="the run's length in steps")
    parser.add_argument("--signal_after", type=int, default=10,
                        help="SIGTERM once the log holds this step (0-based; after compilation's first steps)")
    parser.add_argument("--launch_timeout", type=float, default=600, help="seconds each launch may take")
    parser.add_argument("--json", default="", help="where the figures and the checks' findings go")
    args, trainer_args = parser.parse_known_args(argv)
    if args.nproc is None:
        import torch

        args.nproc = torch.cuda.device_count()
    if args.nproc < 1:
        raise ConfigError("--nproc: no GPU visible; give the number of ranks (--nproc 2 with --device cpu)")
    if not 0 <= args.signal_after < args.max_steps - 1:
        raise ConfigError(f"--signal_after {args.signal_after} must leave a step to stop at before --max_steps "
                          f"{args.max_steps}")
    out = Path(args.out).resolve()
    run = out / "run"
    if run.exists() and any(run.iterdir()):
        raise ConfigError(f"--out: {run} already holds a run, which --resume auto would continue; give a new folder")
    trainer_args = [*QUIET, *trainer_args, "--out_dir", str(run), "--max_steps", str(args.max_steps),
                    "--resume", "auto"]
    from launch.config import parse_args
    from training.checkpoint.folder import checkpoints_folder, list_checkpoints

    cfg = parse_args(trainer_args)  # a wrong key or value is one line now, not in each launch's console
    cfg.data.grad_accum_steps(args.nproc)  # and a batch that does not split over the ranks
    checkpoints = checkpoints_folder(cfg.run.out_dir, cfg.checkpoint.checkpoint_dir)

    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               str(REPO / "train_gpt2.py"), *trainer_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def launch(n: int, stop_after: int | None) -> dict:
        """Launch n of the command; with stop_after, SIGTERM to torchrun once the log holds that step."""
        console = out / f"launch{n}.log"
        start = time.monotonic()
        with open(console, "w") as f:
            # the caller's folder, as if typed there: relative --data_dir and --config read from it
            proc = subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT)
        if stop_after is not None:
            while proc.poll() is None and time.monotonic() - start < args.launch_timeout:
                if any(step >= stop_after for step, _ in train_steps(run / "log.jsonl")):
                    print(f"step {stop_after} logged {time.monotonic() - start:.1f} s after the launch: SIGTERM to "
                          "torchrun", flush=True)
                    proc.send_signal(signal.SIGTERM)  # what a scheduler sends the launcher
                    break
                time.sleep(0.05)
        code = finish(proc, max(args.launch_timeout - (time.monotonic() - start), 60))
        found = list_checkpoints(checkpoints)  # none while the folder does not exist
        result = {"exit": code, "seconds": round(time.monotonic() - start, 1), "console": console.read_text(),
                  "error": last_error(console), "newest": found[-1][0] if found else None}
        print(f"launch {n}: exit {code} after {result['seconds']} s, newest checkpoint {result['newest']}", flush=True)
        return result

    print(f"torchrun --nproc_per_node={args.nproc}: {args.max_steps} steps, SIGTERM after step {args.signal_after}, "
          "then the same command again", flush=True)
    first = launch(1, args.signal_after)
    second = launch(2, None) if SAVED.search(first["console"]) else {
        "exit": None, "seconds": 0.0, "console": "", "error": "not launched", "newest": first["newest"]}
    steps = train_steps(run / "log.jsonl")
    problems = check(first, second, steps, args.max_steps, args.signal_after)
    saved = SAVED.search(first["console"])
    saved_step = int(saved.group(1)) if saved else None
    losses = dict(steps)
    row = {"label": f"preemption-{args.nproc}gpu", "world_size": args.nproc, "model": cfg.model.model,
           "tokens_per_step": cfg.data.total_batch_size, "max_steps": args.max_steps,
           "signal_after": args.signal_after, "saved_step": saved_step,
           "resumed_at": int(m.group(1)) if (m := RESUMED.search(second["console"])) else None,
           "final_checkpoint": second["newest"], "logged_steps": len(steps),
           "loss_before_stop": losses.get(saved_step - 1) if saved_step else None,
           "loss_after_stop": losses.get(saved_step) if saved_step else None,
           "first_launch_s": first["seconds"], "second_launch_s": second["seconds"],
           "ok": not problems, "problems": problems}
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2) + "\n")
    if problems:
        raise ReproError(f"preemption check: {problems[0]}" + (f" (and {len(problems) - 1} more: --json lists them)"
                                                               if len(problems) > 1 else ""))
    print(f"preempted at step {saved_step} of {args.max_steps} on {args.nproc} ranks, resumed there and finished: "
          f"{len(steps)} steps logged once each", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
