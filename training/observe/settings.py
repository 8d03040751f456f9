"""The observe floor's section: diagnostics (diagnostics.py: the profiler window, memory snapshots, rank stats).

Torch-free, as every settings section is (launch/config.py): the trainer checks a configuration before it imports
torch.
"""

from __future__ import annotations

from common.settings import Settings, option, require, section


@section
class DiagnosticsSettings(Settings):
    """The diagnostics section: what diagnostics.py's ProfileWindow, MemorySnapshot and RankStats do."""

    SECTION = "diagnostics"
    SUMMARY = "rank stats, stragglers, the profiler and memory snapshots"

    rank_stats_interval: int = option(100, "every N steps the ranks share their step and data-wait times, and a "
                                           "ranks record gives the median and the slowest rank (0: off)",
                                      on_resume="none")
    straggler_factor: float = option(1.5, "warn, naming rank and host, when a rank's step time stays above this "
                                          "multiple of the median for 3 rank_stats intervals in a row (0: never)",
                                     on_resume="none")
    profile_from: int = option(0, "profile profile_steps steps from this step with torch.profiler: one trace per "
                                  "rank in out_dir/profile/ (0: off)", on_resume="none")
    profile_steps: int = option(3, "steps in the profile window", on_resume="none")
    memory_snapshot: int = option(0, "CUDA only: record every allocation for the first N steps, then write one "
                                     "snapshot per rank to out_dir/memory/ (also on out-of-memory; 0: off)",
                                  on_resume="none")

    def validate(self) -> None:
        for key in ("rank_stats_interval", "profile_from", "memory_snapshot"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.profile_steps > 0, "profile_steps", f"must be positive, got {self.profile_steps}")
        require(self.straggler_factor == 0 or self.straggler_factor > 1, "straggler_factor",
                f"must be 0 (never) or above 1, got {self.straggler_factor}")
