"""The error convention of every entry point: one `error:` line and the error's exit code.

Each failure a user can act on is a `ReproError` subclass whose class carries the exit code
the process ends with:

    2  bad input: configuration or command-line arguments, data files, checkpoints to read
    1  a write failed (checkpoint, log, run folder), or anything else that stops a run
    3  the training diverged: the loss went NaN/inf (the update was not applied), or the
       loss spikes went on past max_rollbacks rollbacks

`run_cli(main, argv)` is the wrapper every script's `__main__` goes through: it runs main,
turns a ReproError into one `error: message` line on stderr and its exit code, and lets
anything else (a bug) show its traceback. `ArgumentParser` reports usage mistakes the same
way instead of argparse's two-line message.
"""

from __future__ import annotations

import argparse
import os
import sys


class ReproError(Exception):
    """A failure explained by its one-line message; the process exits with `exit_code`."""

    exit_code = 1


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


def report(error: ReproError) -> int:
    """Print `error: message` as one write (ranks sharing a terminal never interleave); the exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    message = " ".join(str(error).split()) or type(error).__name__  # always one line
    os.write(sys.stderr.fileno(), f"error: {message}\n".encode())
    return error.exit_code


def run_cli(main, argv: list[str] | None = None) -> int:
    """main(argv) -> exit status, with every ReproError reported as one line and its exit code."""
    try:
        return main(sys.argv[1:] if argv is None else argv) or 0
    except ReproError as e:
        return report(e)
    except KeyboardInterrupt as e:  # Ctrl-C where no handler keeps it (the trainer's second one says why)
        os.write(sys.stderr.fileno(), f"interrupted{f': {e}' if str(e) else ''}\n".encode())
        return 130


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage mistake raised as a ConfigError (one line, exit 2) by run_cli."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)  # keep the docstring's layout
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} (see --help)")
