"""HellaSwag validation accuracy, scored by completion likelihood (the usual way for small LMs).

Each example is a context and four candidate endings, one of them right. The model reads
context + ending, and an ending's score is the cross-entropy of its own tokens given everything
before them. `acc_norm` picks the ending with the lowest *mean* loss per token; `acc` the lowest
*summed* loss, which favours short endings. (lm-evaluation-harness normalises by characters
rather than tokens and cleans the text first, so its figures differ slightly.)

Data: the official val split (10,042 examples), downloaded once into a cache folder
(`$GPT2_REPRO_CACHE/hellaswag/`, default `~/.cache/gpt2-repro/hellaswag/`) or read from a local
file. In a multi-process run, local rank 0 of each node downloads while the node's other ranks
wait; all ranks then agree on the outcome, so a failed download skips the eval on every rank
with one warning instead of crashing or hanging one of them.

Shapes in comments: E = examples in a batch, R = 4 * E rows, L = padded row length,
N = ending tokens in the batch, M = longest ending in the batch, C = n_embd, V = vocab_size.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.atomic_file import atomic_write
from data.tokenizer import EOT_TOKEN
from common.errors import DataError, print_warning
from evals.base import Evaluator, Progress, Series, in_lockstep
from runtime.process_group import DistEnv, all_reduce_sum, barrier, first_error, run_on_all_ranks

if TYPE_CHECKING:
    from training.distributed.strategies import Strategy
    from evals.settings import EvalSettings
    from runtime.context import Context

VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
VAL_FILENAME = "hellaswag_val.jsonl"
VAL_EXAMPLES = 10_042  # in the official val split
CACHE_ENV_VAR = "GPT2_REPRO_CACHE"  # replaces ~/.cache/gpt2-repro as the project's cache root
DOWNLOAD_TIMEOUT_S = 60.0  # per blocking socket operation, so a dead connection cannot stall a run
NUM_ENDINGS = 4
# Positions whose logits are made at once (a (LOGIT_CHUNK, V) block): the same bound as
# lm-evaluation-harness scoring (evals/lm_eval_harness.py), so both score a batch the same way.
LOGIT_CHUNK = 4096
# Rows are padded to a multiple of this many tokens so the same few shapes recur across batches
# and evals (the CUDA caching allocator and cuDNN/cuBLAS heuristics reuse them).
PAD_MULTIPLE = 32


class HellaSwagDataError(DataError):
    """A HellaSwag file that cannot be used; the message names the file (and the line)."""


@dataclass(frozen=True)
class Example:
    ctx: str
    endings: tuple[str, ...]  # NUM_ENDINGS strings
    label: int  # index of the right ending


@dataclass(frozen=True)
class EncodedExample:
    index: int  # position in the file (among its non-blank lines)
    label: int
    ctx_ids: list[int]
    endings_ids: tuple[list[int], ...]


# --- files: cache location, download, validation -------------------------------------------------

def default_cache_dir() -> Path:
    """`$GPT2_REPRO_CACHE/hellaswag`, or `~/.cache/gpt2-repro/hellaswag` when the variable is unset."""
    root = os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "gpt2-repro"
    return Path(root) / "hellaswag"


def parse_example(line: str, where: str) -> Example:
    """One jsonl record; only `ctx`, `endings` and `label` are used (and checked)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise HellaSwagDataError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise HellaSwagDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    ctx, endings, label = record.get("ctx"), record.get("endings"), record.get("label")
    if not isinstance(ctx, str):
        raise HellaSwagDataError(f"{where}: 'ctx' must be a string, got {ctx!r:.60}")
    if not (isinstance(endings, list) and len(endings) == NUM_ENDINGS and all(isinstance(e, str) for e in endings)):
        raise HellaSwagDataError(f"{where}: 'endings' must be a list of {NUM_ENDINGS} strings, got {endings!r:.80}")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < NUM_ENDINGS:
        raise HellaSwagDataError(f"{where}: 'label' must be an integer in 0..{NUM_ENDINGS - 1}, got {label!r:.40}")
    return Example(ctx=ctx, endings=tuple(endings), label=label)


def parse_lines(lines: Iterable[str], name: str, limit: int = 0) -> list[Example]:
    """Examples of a jsonl stream (blank lines skipped); the first `limit` only when limit > 0."""
    examples = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        examples.append(parse_example(line, f"{name}: line {lineno}"))
        if limit and len(examples) == limit:
            break
    if not examples:
        raise HellaSwagDataError(f"{name}: no examples")
    return examples


def read_examples(path: str | Path, limit: int = 0, name: str | None = None) -> list[Example]:
    """Validated examples of a HellaSwag jsonl file; errors name the file (or `name`) and line."""
    name = name or str(path)
    try:
        with open(path, encoding="utf-8") as f:
            return parse_lines(f, name, limit)
    except UnicodeDecodeError:
        raise HellaSwagDataError(f"{name}: not UTF-8 text") from None


def download_val(dest: str | Path, url: str = VAL_URL, timeout: float = DOWNLOAD_TIMEOUT_S) -> int:
    """Download the val jsonl to `dest` and return its number of examples.

    The bytes go to a temp file beside `dest`, are validated, and only then renamed onto it: an
    interrupted or garbled download (a proxy's HTML page, say) never leaves a file that a later
    run would trust, and two nodes filling a shared cache at once each rename a whole file.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # a temp name of this writer's own (another node may fill a shared cache at once), readable by
    # all when renamed into place (a cache may be shared)
    with (atomic_write(dest, "wb", unique=True, permissions=0o644) as out,
          urllib.request.urlopen(url, timeout=timeout) as response):
        shutil.copyfileobj(response, out, length=1 << 20)
        out.flush()
        return len(read_examples(out.name, name=f"{url} (downloaded)"))


def fetch_val(cache_dir: str | Path | None = None, url: str = VAL_URL,
              timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Path of the cached val jsonl, downloaded first if it is not there yet (no network otherwise)."""
    path = Path(cache_dir or default_cache_dir()) / VAL_FILENAME
    if not path.is_file():
        download_val(path, url, timeout)
    return path


# --- rendering and batching ----------------------------------------------------------------------

def encode_example(index: int, example: Example, tokenizer) -> EncodedExample:
    """Context tokens, and each ending's tokens with the space that joins it to the context.

    Ordinary-text encoding: a literal "<|endoftext|>" in the text is not a control token.
    """
    return EncodedExample(
        index=index, label=example.label, ctx_ids=tokenizer.encode_ordinary(example.ctx),
        endings_ids=tuple(tokenizer.encode_ordinary(" " + ending) for ending in example.endings),
    )


def render_rows(ctx_ids: Sequence[int], endings_ids: Sequence[Sequence[int]],
                block_size: int) -> list[tuple[list[int], int]]:
    """Token rows context + ending for one example, each with its ending's length.

    The model reads row[:-1] and predicts row[1:], so a row may hold block_size + 1 tokens.
    Longer rows lose tokens from the left of the context: the ending is what gets scored, so it
    stays whole, and the context's latest tokens matter most for predicting it. An empty context
    becomes <|endoftext|>, so the first ending token has something to follow. (An ending longer
    than block_size on its own, which HellaSwag never has at GPT-2 sizes, keeps its first
    block_size tokens after the context's last token.)
    """
    context = list(ctx_ids) or [EOT_TOKEN]
    rows = []
    for ending in endings_ids:
        ending = list(ending[:block_size])
        keep = block_size + 1 - len(ending)  # >= 1
        rows.append((context[-keep:] + ending, len(ending)))
    return rows


@dataclass
class Batch:
    """Several examples' rows, right-padded, with where their ending tokens sit."""

    inputs: torch.Tensor  # (R, L) token ids the model reads
    positions: torch.Tensor  # (N,) indices into the flattened (R*L) grid: positions predicting an ending token
    targets: torch.Tensor  # (N,) the ending token predicted at each such position
    slots: torch.Tensor  # (N,) where each token's loss goes in an (R*M) grid, row-major
    ending_lengths: torch.Tensor  # (R,)
    max_ending: int  # M
    labels: torch.Tensor  # (E,)
    indices: list[int]  # (E,) example indices

    def to(self, device: torch.device) -> Batch:
        move = dict(inputs=self.inputs, positions=self.positions, targets=self.targets, slots=self.slots,
                    ending_lengths=self.ending_lengths, labels=self.labels)
        return Batch(**{k: v.to(device) for k, v in move.items()}, max_ending=self.max_ending, indices=self.indices)


def collate(examples: Sequence[EncodedExample], block_size: int, pad_multiple: int = PAD_MULTIPLE) -> Batch:
    """One batch of NUM_ENDINGS rows per example, padded to a multiple of pad_multiple tokens.

    Right padding is harmless: attention is causal, so real tokens never see the padding after
    them, and padded positions are never scored.
    """
    rendered = [row for ex in examples for row in render_rows(ex.ctx_ids, ex.endings_ids, block_size)]
    longest = max(len(tokens) - 1 for tokens, _ in rendered)
    L = min(-(-longest // pad_multiple) * pad_multiple, block_size)
    M = max(n_end for _, n_end in rendered)
    padded, positions, targets, slots = [], [], [], []
    for r, (tokens, n_end) in enumerate(rendered):
        n_in = len(tokens) - 1
        padded.append(tokens[:-1] + [EOT_TOKEN] * (L - n_in))
        first = n_in - n_end  # input position whose next token is the ending's first
        positions += range(r * L + first, r * L + n_in)
        targets += tokens[-n_end:]
        slots += range(r * M, r * M + n_end)
    return Batch(
        inputs=torch.tensor(padded), positions=torch.tensor(positions), targets=torch.tensor(targets),
        slots=torch.tensor(slots), ending_lengths=torch.tensor([n for _, n in rendered]), max_ending=M,
        labels=torch.tensor([ex.label for ex in examples]), indices=[ex.index for ex in examples],
    )


def make_batches(share: Sequence[EncodedExample], block_size: int, batch_examples: int) -> list[Batch]:
    """Batches of `batch_examples` examples, longest first.

    Sorting by length keeps padding low; longest first means a batch too big for the device
    fails at the start of the first eval, not minutes into training.
    """
    def longest_row(ex: EncodedExample) -> int:  # what render_rows would give, without building rows
        return min(max(len(ex.ctx_ids), 1) + max(map(len, ex.endings_ids)), block_size + 1)

    ordered = sorted(share, key=longest_row, reverse=True)
    return [collate(ordered[i:i + batch_examples], block_size) for i in range(0, len(ordered), batch_examples)]


@torch.no_grad()
def ending_losses(model: torch.nn.Module, batch: Batch, device: torch.device,
                  autocast: contextlib.AbstractContextManager) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean cross-entropy of every ending in the batch, both (E, NUM_ENDINGS).

    Only the N positions that predict an ending token go through lm_head, instead of all R*L:
    full logits would be R*L*V floats (about 1.6 GB for 64 rows of 128 tokens).
    """
    R, L = batch.inputs.shape
    inputs = batch.inputs.to(device, non_blocking=True)
    with autocast:
        hidden = model.hidden_states(inputs)  # (R, L, C)
        hidden = hidden.flatten(0, 1)[batch.positions.to(device)]  # (N, C)
        # lm_head and a float32 softmax over the 50K classes, LOGIT_CHUNK positions at a time
        token_losses = torch.cat([losses for _, losses in model.logits_and_losses(
            hidden, batch.targets.to(device), LOGIT_CHUNK)])  # (N,)
    # scatter into a zero-padded (R, M) grid and sum its rows: deterministic, unlike index_add_ on CUDA
    grid = token_losses.new_zeros(R * batch.max_ending)
    grid[batch.slots.to(device)] = token_losses
    sums = grid.view(R, batch.max_ending).sum(dim=1)  # (R,)
    means = sums / batch.ending_lengths.to(device)
    return sums.view(-1, NUM_ENDINGS), means.view(-1, NUM_ENDINGS)


# --- the evaluator -------------------------------------------------------------------------------

class HellaSwag(Evaluator):
    """HellaSwag accuracy of a model, computed by all ranks together.

    Construct on every rank (the download, the agreement on it and the tokenization happen
    here, once), then call `accuracy` on every rank at the same steps. Each data-parallel rank
    scores the examples whose index % dp_size == dp_rank, and one all-reduce of integer counts
    gives every rank the same figure for any world size.
    """

    kind = "hellaswag"
    series = Series("hellaswag", "acc_norm", "HellaSwag", "acc_norm (%)", percent=True)
    metric = ("hellaswag_acc_norm", "acc_norm")
    averaged = True
    unweighted_fields = ("n",)

    def __init__(self, path: str, limit: int, env: DistEnv, tokenizer, batch_examples: int = 16,
                 cache_dir: str | Path | None = None, *, url: str = VAL_URL,
                 timeout: float = DOWNLOAD_TIMEOUT_S, warn=print_warning, interval: int = 0,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 dp_rank: int | None = None, dp_size: int | None = None,
                 console: Callable[[str], None] = lambda text: None):
        """path: a local jsonl ('' = the cached official val split, downloaded if missing);
        limit: score only the first `limit` examples (0 = all). A malformed file raises
        HellaSwagDataError on every rank; a failed download makes the evaluator unavailable,
        with one warning through `warn`. interval and autocast: as a periodic evaluation.
        dp_rank, dp_size: the strategy's data-parallel view, which picks this rank's examples
        (None: env.rank and env.world_size, every process a replica). console: where the progress lines
        of a long evaluation go (rank 0's logger)."""
        super().__init__(interval)
        if batch_examples < 1:
            raise ValueError(f"batch_examples must be >= 1, got {batch_examples}")
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.env, self.warn, self.autocast, self.console = env, warn, autocast, console
        self.dp_rank = env.rank if dp_rank is None else dp_rank
        self.dp_size = env.world_size if dp_size is None else dp_size
        self.batch_examples = batch_examples
        self.num_examples = 0  # over all ranks; 0 while unavailable
        self.source: Path | None = Path(path) if path else self._fetch_once_per_node(cache_dir, url, timeout)
        self._share: list[EncodedExample] = []
        self._batches: dict[int, list[Batch]] = {}  # by block_size
        if self.source is None:
            return
        examples = self._read_on_every_rank(self.source, limit)
        self.num_examples = len(examples)
        self._share = [encode_example(i, examples[i], tokenizer)
                       for i in range(self.dp_rank, len(examples), self.dp_size)]

    # --- as a periodic evaluation ----------------------------------------------------------------

    @classmethod
    def from_settings(cls, settings: EvalSettings, ctx: Context, strategy: Strategy, tokenizer,
                      seed: int) -> HellaSwag | None:
        if not settings.hellaswag_interval:
            return None
        return cls(settings.hellaswag_path, settings.hellaswag_limit, ctx.env, tokenizer, warn=ctx.logger.warn,
                   interval=settings.hellaswag_interval, autocast=ctx.runtime.autocast,
                   dp_rank=strategy.dp_rank, dp_size=strategy.dp_size, console=ctx.logger.console)

    def evaluate(self, run) -> list[dict]:
        result = self.accuracy(run.model, self.autocast(), idle_forward=lambda: run.strategy.idle_forward(run.model),
                               progress=Progress(f"step {run.step:6d} | hellaswag", self.batches_per_rank,
                                                 self.console))
        return [] if result is None else [result]

    def describe(self, record: dict) -> str:
        return f"hellaswag acc_norm {record['acc_norm']:.4f} ({record['n']} examples)"

    # --- data ------------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Same value on every rank: False when the data could not be fetched."""
        return self.source is not None

    def _fetch_once_per_node(self, cache_dir: str | Path | None, url: str, timeout: float) -> Path | None:
        """The cached val file, or None on every rank (with one warning) when any rank lacks it."""
        env = self.env
        path = Path(cache_dir or default_cache_dir()) / VAL_FILENAME
        failure = None
        if env.local_rank == 0:
            try:
                fetch_val(path.parent, url, timeout)
            except Exception as e:  # any failure must reach the agreement below, never escape past it
                failure = f"{type(e).__name__}: {e}"
        barrier(env)  # the node's other ranks wait here for the download
        if failure is None and not path.is_file():
            failure = f"rank {env.rank} sees no file at {path}"
        failure = first_error(failure, env)  # every rank gets the same verdict
        if failure is None:
            return path
        self.skip_reason = f"could not fetch {url} into {path} ({failure})"
        if env.master_process:
            self.warn(f"hellaswag eval skipped: {self.skip_reason}; "
                      f"run `python prep/hellaswag.py` where there is internet, or set hellaswag_path")
        return None

    def _read_on_every_rank(self, path: Path, limit: int) -> list[Example]:
        """The file's first `limit` examples; if any rank cannot read them, all raise the same error."""
        def read() -> list[Example]:
            try:
                return read_examples(path, limit)
            except OSError as e:
                raise HellaSwagDataError(f"hellaswag_path: {path}: {e.strerror or e}") from None

        return run_on_all_ranks(self.env, read)

    def batches(self, block_size: int) -> list[Batch]:
        """This rank's batches, built at the first eval and kept on the device.

        Kept there because a copy from pageable host memory makes the host wait for the GPU, once
        per batch; they take about 55 MB for all 10,042 examples on one rank (int64).
        """
        if block_size not in self._batches:
            batches = make_batches(self._share, block_size, self.batch_examples)
            self._batches[block_size] = [batch.to(self.env.device) for batch in batches]
        return self._batches[block_size]

    @property
    def batches_per_rank(self) -> int:
        """The most batches any rank scores: rank 0's, whose share of the examples is the largest."""
        largest_share = -(-self.num_examples // self.dp_size)
        return -(-largest_share // self.batch_examples)

    # --- scoring ---------------------------------------------------------------------------------

    def losses(self, model: torch.nn.Module, autocast: contextlib.AbstractContextManager | None = None):
        """(batch, summed losses (E, 4), mean losses (E, 4)) for each of this rank's batches, in eval mode.

        No collective of its own (but under FSDP each forward is one).
        """
        autocast = autocast or contextlib.nullcontext()
        was_training = model.training
        model.eval()
        try:
            for batch in self.batches(model.config.block_size):
                yield (batch, *ending_losses(model, batch, self.env.device, autocast))
        finally:
            model.train(was_training)

    @torch.no_grad()
    def accuracy(self, model: torch.nn.Module, autocast: contextlib.AbstractContextManager | None = None,
                 idle_forward: Callable[[], None] | None = None,
                 progress: Callable[[int], None] | None = None) -> dict | None:
        """{"acc_norm", "acc", "n"} over all ranks' examples, or None (on every rank) when unavailable.

        A collective when available: every rank calls it, including ranks with no examples.
        The model is left in the train/eval mode it came in. A rank with fewer batches than
        rank 0 calls idle_forward() once for each one it lacks (forwards are collectives under FSDP).
        progress(n) hears of each of this rank's batches scored (evals/base.py's Progress).
        """
        if not self.available:
            return None
        device = self.env.device
        counts = torch.zeros(3, dtype=torch.long, device=device)  # correct_norm, correct, n
        scored = in_lockstep(self.losses(model, autocast), self.batches_per_rank, idle_forward)
        for done, (batch, sums, means) in enumerate(scored, start=1):
            labels = batch.labels.to(device)  # (E,)
            counts[0] += (means.argmin(dim=1) == labels).sum()
            counts[1] += (sums.argmin(dim=1) == labels).sum()
            counts[2] += labels.numel()
            if progress is not None:
                progress(done)
        all_reduce_sum(counts, self.env)  # integers: the same figure for any world size
        correct_norm, correct, n = counts.tolist()
        return {"acc_norm": correct_norm / n, "acc": correct / n, "n": n}
