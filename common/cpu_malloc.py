"""The CPU's malloc settings (common/cpu_malloc.env, which says why), as a mapping a child process's environment
takes: {**CPU_MALLOC, **os.environ} lets a user's own values win."""

from __future__ import annotations

from pathlib import Path

CPU_MALLOC_FILE = Path(__file__).with_name("cpu_malloc.env")
CPU_MALLOC = dict(line.split("=", 1) for line in CPU_MALLOC_FILE.read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
