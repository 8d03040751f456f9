"""The error convention of every entry point: one `error:` line and the error's exit code.

Each failure a user can act on is a `ReproError` subclass whose class carries the exit code
the process ends with:

    2  bad input: configuration or command-line arguments, data files, checkpoints to read
    1  a write failed (checkpoint, log, run folder), a package the script imports is not installed
       in the Python that runs it, or anything else that stops a run
    3  the training diverged: the loss went NaN/inf (the update was not applied), or the
       loss spikes went on past max_rollbacks rollbacks

`run_cli(main, argv)` is the wrapper every script's `__main__` goes through: it runs main,
turns a ReproError into one `error: message` line on stderr and its exit code, and lets
anything else (a bug) show its traceback. `ArgumentParser` reports usage mistakes the same
way instead of argparse's two-line message. A Ctrl-C is one `interrupted` line, exit 130:
inside main through run_cli, and while the script still imports its modules through
`one_line_interrupts` (common/startup.py, the first import of every entry script).

Under torchrun every worker runs the script, and an error that several of them hold alike is
printed by one of them (`held_alike_by`): by rank 0 for an error every rank holds (the
trainer shares a failure with all ranks once they have connected), by each node's local rank
0 for one found before the ranks connect, when each node reads its own arguments, files and
devices. Every worker that ends with an error also leaves it in torchrun's error file
(TORCHELASTIC_ERROR_FILE), whose content torchrun's failure report shows for that worker in
place of a link to its documentation: an error only one rank had is never lost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable

# Which ranks of a torchrun launch hold an error alike, so that one of them prints it for all: the variable
# torchrun gives each worker whose value 0 names the rank that prints.
EVERY_RANK = "RANK"  # every rank of the job: rank 0 prints it, one line per job
NODE_RANKS = "LOCAL_RANK"  # every rank of this node: its local rank 0 prints it, one line per node


class ReproError(Exception):
    """A failure explained by its one-line message; the process exits with `exit_code`."""

    exit_code = 1
    held_by: str | None = None  # EVERY_RANK or NODE_RANKS: other ranks hold it alike (None: this process alone)


class ConfigError(ReproError):
    """A bad configuration value, combination or command-line argument; the message names the key."""

    exit_code = 2


class DataError(ReproError):
    """Bad or missing input data; the message names the file or folder."""

    exit_code = 2


class CheckpointError(ReproError):
    """A checkpoint that cannot be read or used; the message names the file."""

    exit_code = 2


class WriteError(ReproError):
    """A file could not be written (disk full, permissions); what was saved before is intact."""

    exit_code = 1


class CheckpointWriteError(WriteError):
    """A checkpoint could not be written; earlier checkpoints are intact."""


class NonFiniteLossError(ReproError):
    """The loss or gradient norm went NaN/inf; the update was not applied."""

    exit_code = 3


class DivergedError(NonFiniteLossError):
    """Spikes (or NaNs) that rollbacks did not get past: max_rollbacks used up, or no checkpoint."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (its class name when it has none), at most `limit` characters.

    Library errors often carry a multi-line message (a traceback of their own, a hint
    paragraph); the one-line convention keeps what says what went wrong.
    """
    lines = str(e).strip().splitlines()
    return (lines[0].strip() if lines else type(e).__name__)[:limit]


def print_warning(text: str) -> None:
    """One `warning: ...` line on stderr, whitespace folded, written at once."""
    sys.stdout.flush()
    print(f"warning: {' '.join(text.split())}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def held_alike_by(ranks: str):
    """A ReproError raised inside is held alike by `ranks` (EVERY_RANK, NODE_RANKS): one of them prints it.

    For code that each of those ranks runs on the same inputs, or that shares a failure any of
    them saw with all.
    """
    try:
        yield
    except ReproError as e:
        e.held_by = ranks
        raise


def prints_here(held_by: str | None) -> bool:
    """Whether this process prints what `held_by` ranks hold alike: the one whose variable is 0 (or unset:
    no torchrun), or any process for what it alone holds (None)."""
    return held_by is None or os.environ.get(held_by, "0") == "0"


def report(error: ReproError) -> int:
    """Print `error: message` as one write (ranks sharing a terminal never interleave) unless another rank
    prints it, and leave it in torchrun's error file; the exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    line = "error: " + (" ".join(str(error).split()) or type(error).__name__)  # always one line
    if prints_here(error.held_by):
        os.write(sys.stderr.fileno(), f"{line}\n".encode())
    write_torchrun_error_file(line)
    return error.exit_code


def write_torchrun_error_file(line: str) -> None:
    """Under torchrun, `line` into this worker's error file: torchrun's failure report shows it for this worker.

    torchrun names the file in TORCHELASTIC_ERROR_FILE and reads it as its own error handler
    writes it (torch.distributed.elastic.multiprocessing.errors): a message and a timestamp, the
    earliest of which torchrun reports as the root cause. No traceback: the line says it all.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass  # the line on stderr is the report; the file only adds it to torchrun's


def report_interrupt(e: KeyboardInterrupt) -> None:
    """`interrupted` (with why, if the interrupt says) on stderr. Under torchrun, which forwards a signal to each
    of its workers alike, each node's local rank 0 prints it."""
    if prints_here(NODE_RANKS):
        os.write(sys.stderr.fileno(), f"interrupted{f': {e}' if str(e) else ''}\n".encode())


def one_line_interrupts() -> None:
    """From now on a KeyboardInterrupt that nothing catches ends the process with one `interrupted` line, not a
    traceback: a Ctrl-C while an entry script imports its modules (seconds for torch), before run_cli runs. And a
    package that is not installed in the Python running the script (the project's environment not entered) is one
    `error:` line saying so (missing_package), not an import's traceback.

    Python then ends the process by SIGINT as usual: the shell sees status 130 (1 for a missing package). Other
    uncaught exceptions go to the hook that was there before.
    """
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if issubclass(kind, KeyboardInterrupt):
            report_interrupt(value)
        elif issubclass(kind, ModuleNotFoundError) and (line := missing_package(value)):
            if prints_here(NODE_RANKS):
                os.write(sys.stderr.fileno(), f"error: {line}\n".encode())
            write_torchrun_error_file(f"error: {line}")
        else:
            previous(kind, value, traceback)

    sys.excepthook = hook


# the project's own top-level modules and packages: a missing one of these is a bug, whose traceback shows where
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def missing_package(error: ModuleNotFoundError) -> str | None:
    """What to do about a package that is not installed (error: the import's), or None where the missing module is
    the project's own (a bug, left to its traceback)."""
    top = (error.name or "").partition(".")[0]
    if not top or os.path.exists(os.path.join(_PROJECT_ROOT, top)) or \
            os.path.exists(os.path.join(_PROJECT_ROOT, top + ".py")):
        return None
    return (f"the package {top!r} is not installed for {sys.executable}: enter the project's environment "
            f"(source .venv/bin/activate, which `make install` creates), or pip install -r requirements.txt")


def run_cli(main, argv: list[str] | None = None) -> int:
    """main(argv) -> exit status, with every ReproError reported as one line and its exit code."""
    try:
        return main(sys.argv[1:] if argv is None else argv) or 0
    except ReproError as e:
        return report(e)
    except KeyboardInterrupt as e:  # Ctrl-C where no handler keeps it (the trainer's second one says why)
        report_interrupt(e)
        return 130


def check_before_imports(module_name: str, check: Callable[[list[str]], object]) -> None:
    """An entry script's check of its command line, made before the script imports what takes seconds (torch): run
    as a script (module_name, the caller's __name__, is "__main__"), check(sys.argv[1:]), whose ReproError ends the
    process with its one line and exit code, reported as run_cli reports it (torchrun's error file too); otherwise
    return, and the script goes on to import the rest and run main, which checks its arguments again (tests and
    tools call main directly, without the script's first lines)."""
    if module_name != "__main__":
        return
    try:
        check(sys.argv[1:])
    except ReproError as e:
        sys.exit(report(e))


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage mistake raised as a ConfigError (one line, exit 2) by run_cli."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)  # keep the docstring's layout
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} (see --help)")
