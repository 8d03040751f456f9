"""The evaluation section: the keys of val loss, HellaSwag and the samples, each evaluator made from it."""

from __future__ import annotations

from common.settings import Settings, mapping_text, option, require, section

ValSetsText = mapping_text("=")  # val_sets: name=path,... (YAML: {name: path, ...})


@section
class EvalSettings(Settings):
    """The evaluation section: what every evaluator is made from (its from_settings), and when each runs."""

    SECTION = "evaluation"
    SUMMARY = "val loss (always after the last step), HellaSwag and text samples"

    eval_interval: int = option(250, "val loss every N steps (0: only after the last)", on_resume="none")
    val_tokens: int = option(10485760, "tokens of the fixed val window (20 x 524,288), of each val set",
                             on_resume="none")
    val_sets: ValSetsText = option("", "named val windows, each its own val/<name> series: name=folder or name=val "
                                       "shard, comma-separated ({name: folder, ...} in YAML); '': data_dir's val split "
                                       "as `val`, or each mixture source's under its name", on_resume="none")
    hellaswag_interval: int = option(250, "HellaSwag every N steps and after the last (0: off)", on_resume="none")
    hellaswag_path: str = option("", "a local HellaSwag val jsonl ('': download it once into the cache)",
                                 on_resume="none")
    hellaswag_limit: int = option(0, "score only the first N examples (0: all 10,042)", on_resume="none")
    sample_interval: int = option(250, "text samples every N steps and after the last (0: off)", on_resume="none")
    sample_prompt: str = option("Hello, I'm a language model,", "prompt of the samples ('': unconditional)",
                                on_resume="none")
    sample_count: int = option(4, "samples each time", on_resume="none")
    sample_tokens: int = option(32, "new tokens per sample", on_resume="none")

    def validate(self) -> None:
        for key in ("val_tokens", "sample_count", "sample_tokens"):
            require(getattr(self, key) > 0, key, f"must be positive, got {getattr(self, key)}")
        for key in ("eval_interval", "hellaswag_interval", "hellaswag_limit", "sample_interval"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        # hellaswag_path is checked where the file is opened
