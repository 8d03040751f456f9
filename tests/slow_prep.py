"""Run prep/fineweb.py with a pause after each shard's progress record (interruption tests only).

    python tests/slow_prep.py PREP_ARGS...      # PREP_PAUSE=seconds (default 0.05)

Unchanged, the prep writes the ~47 shards left after the tests' interruption point in about
0.4 s, less when its workers have tokenized ahead: a test process descheduled that long on a
loaded machine would signal a prep that has already finished. The pause makes that window
seconds long; the shards, progress records and bytes are those of prep/fineweb.py.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import run_cli  # noqa: E402
from prep import fineweb  # noqa: E402

PAUSE_S = float(os.environ.get("PREP_PAUSE", "0.05"))


def pausing(write):
    """`write`, then PAUSE_S of sleep."""
    def write_then_pause(path, record) -> None:
        write(path, record)
        time.sleep(PAUSE_S)

    return write_then_pause


if __name__ == "__main__":  # spawned workers import this file too: they must not patch or run anything
    fineweb.write_json_atomic = pausing(fineweb.write_json_atomic)
    sys.exit(run_cli(fineweb.main))
