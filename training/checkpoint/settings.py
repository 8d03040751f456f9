"""The checkpoint folder's sections: the run folder (run: out_dir, which run_folder.py claims) and the checkpoints
(checkpoint: when checkpointer.py writes them, where, in which format, how many it keeps, which one a launch resumes);
and the weights the checkpoints' readers may take (WEIGHTS: sample.py, export_hf.py, eval_lm.py's --weights).

Torch-free, as every settings section is (launch/config.py): the trainer checks a configuration before it imports
torch.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from common.settings import Settings, option, require, section
from runtime.storage import absolute, is_url
from training.optim.settings import rollbacks_on

WEIGHTS = ("live", "ema")  # the readers' --weights: the trained weights, or their EMA (training/optim/ema.py)


@section
class RunSettings(Settings):
    """The run section: the run folder, which every part of a run writes into, and run_folder.py claims."""

    SECTION = "run"
    SUMMARY = "the run folder"

    out_dir: str = option("out/gpt2_124m", "run folder: config.yaml, run.json, log.jsonl, checkpoints/",
                          on_resume="none")

    def validate(self) -> None:
        require(not is_url(self.out_dir), "out_dir",
                f"{self.out_dir!r} is a URL, but the run folder (logs, config) is a local or shared path; put "
                f"checkpoints on remote storage with --checkpoint_dir URL")


CHECKPOINT_FORMATS = ("auto", "file", "sharded")


@section
class CheckpointSettings(Settings):
    """The checkpoint section: when the Checkpointer (checkpointer.py) writes, where, in which format, how many it
    keeps, and which checkpoint a launch resumes (launch/resume.py)."""

    SECTION = "checkpoint"
    SUMMARY = "when checkpoints are written and kept, where they go, which one a run resumes"

    checkpoint_interval: int = option(5000, "checkpoint every N steps (0: only at the end and on preemption)",
                                      on_resume=rollbacks_on)  # which batches a rollback passes over
    final_checkpoint: bool = option(True, "checkpoint after the last step (benchmarks turn it off)", on_resume="none")
    keep_last: int = option(3, "keep the newest N checkpoints", on_resume="none")
    resume: str = option("auto", "auto (newest checkpoint in out_dir, else fresh), never, or a checkpoint path",
                         on_resume="none")
    # stored absolute, so config.yaml, the checkpoints' config and run.json name the place itself: a tool run from
    # another folder (sample.py --ckpt RUN_FOLDER reads config.yaml's checkpoint_dir) finds it too
    checkpoint_dir: Annotated[str, AfterValidator(absolute)] = option(
        "", "where checkpoints go ('': out_dir/checkpoints): a local or shared path (a relative one is stored "
            "absolute), or an fsspec URL (s3://bucket/run, gs://..., needing s3fs, gcsfs, ...)", on_resume="none")
    checkpoint_format: str = option("auto", "file (one step_X.pt written by rank 0), sharded (a step_X/ folder "
                                            "every rank writes its part of, torch.distributed.checkpoint), or auto "
                                            "(sharded under fsdp and for URLs, else file); both resume anywhere",
                                    on_resume="none")
    checkpoint_async: bool = option(True, "sharded checkpoints are written in the background: training waits only "
                                          "for the copy to host memory", on_resume="none")

    def resolved_format(self, strategy_format: str) -> str:
        """file or sharded: checkpoint_format, its auto resolved to sharded where only those can go (URLs), else
        to the strategy's default_checkpoint_format (sharded for fsdp, where one writer gathering everything
        does not scale)."""
        if self.checkpoint_format != "auto":
            return self.checkpoint_format
        return "sharded" if is_url(self.checkpoint_dir) else strategy_format

    def validate(self) -> None:
        require(self.checkpoint_interval >= 0, "checkpoint_interval", f"must be >= 0, got {self.checkpoint_interval}")
        require(self.keep_last > 0, "keep_last", f"must be positive, got {self.keep_last}")
        require(self.checkpoint_format in CHECKPOINT_FORMATS, "checkpoint_format",
                f"unknown format {self.checkpoint_format!r}; choose auto, file or sharded")
        require(not (is_url(self.checkpoint_dir) and self.checkpoint_format == "file"), "checkpoint_format",
                f"file checkpoints are written locally; checkpoint_dir {self.checkpoint_dir!r} is a URL: use sharded")
        # resume's path is checked where the checkpoint is opened


def no_checkpoint_at(resume: str) -> str:
    """What a `resume` path that names nothing is told (launch/resume.py; launch/early_checks.py, before torch)."""
    return (f"no checkpoint file or folder at {resume!r} (use auto, never, or the path of a step_XXXXXXXX.pt file or "
            f"step_XXXXXXXX folder)")
