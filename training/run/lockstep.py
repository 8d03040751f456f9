"""The ranks' agreement around each step: what keeps every rank in lockstep, in one place.

Every rank must take every step's collectives, and decide the same things at the same step.
So a step is: the math (training/run/step.py) on batches that never raise (a batch this rank
cannot read becomes zeros, and the failure is kept), then one all-gather of each rank's loss,
stop vote, failure vote and the metrics the step recorded, then the step's one host
synchronisation, which reads the result (and the gradient norm) and decides, on every rank
alike, before the update is applied:

- a failure on any rank (an unreadable batch, a log record rank 0 could not write): every
  rank raises the same error, and the update is not applied;
- a NaN/inf loss or gradient norm: NonFiniteLossError, the update is not applied (with
  rollback_on_nonfinite: RollbackRequested, and the loop reloads the newest checkpoint);
- float16 gradients that overflowed: the scaler skips this update (and lowers its scale);
- with spike_skip, a loss spike (training/optim/spikes.py): the update is not applied, and after
  rollback_after of them in a row, RollbackRequested;
- a stop signal on any rank: every rank stops after this step;
- a background checkpoint save that failed on any rank: every rank saves this step's state.
(FSDP adds its own reduce-scatters and the global gradient-norm all-reduce; no host sync.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from common.errors import NonFiniteLossError, ReproError
from common.log_fields import Metric
from runtime.process_group import DistEnv, all_gather, as_repro_error, raise_first_error
from runtime.context import Context
from runtime.recorder import forget_recorded, take_recorded
from training.run.run import Run
from data.settings import DataSettings
from training.optim.schedule import ScheduleSettings
from training.optim.settings import LongRunSettings
from training.optim.spikes import RollbackRequested, spike_reason
from training.run.step import apply_update, train_step


@dataclass
class Verdict:
    """What every rank read at the step's one host synchronisation (the same values on every rank)."""

    loss: float  # the mean over the whole global batch, all ranks
    grad_norm: float  # global, before clipping
    stop: bool  # some rank was asked to stop (SIGTERM/SIGUSR1)
    failures: bool  # some rank failed (an unreadable batch, a log write)
    save_failed: bool  # some rank saw a background checkpoint save fail: the loop saves again now
    skipped: bool  # float16 only: the gradients overflowed, the scaler skips the update
    metrics: dict[str, float]  # the metrics the step recorded, by name, each combined over the ranks as declared
    judged: list[float]  # the spike window's verdict (SpikeWindow.judge), [] until the window is full
    global_loss: torch.Tensor  # the same loss and norm, still on the device (for the spike window)
    grad_norm_tensor: torch.Tensor

    def judge_spike(self, threshold: float) -> str | None:
        """Why this step is a spike, or None. An overflow is float16's scaler at work, not a spike."""
        if not self.judged or not self.judged[0] or self.skipped:
            return None
        return spike_reason(self.judged, self.loss, self.grad_norm, threshold)


@dataclass
class StepResult(Verdict):
    """A step's verdict, and what else the loop logs of it."""

    lr: float
    seconds: float
    spike: str | None  # why the update was not applied: a loss spike (spike_skip)
    data_wait: float  # seconds this rank waited for its micro-batches (host clock)


class GuardedBatches:
    """A step's micro-batches that never raise: one this rank cannot read is zeros, its error kept.

    The rank goes on with the others through the step's collectives, and the kept error rides
    on the step's failure vote, so every rank stops together before the update.
    """

    def __init__(self, batches, step: int, count: int, shape: tuple[int, int], env: DistEnv):
        self.batches, self.step, self.count, self.shape, self.env = batches, step, count, shape, env
        self.failure: ReproError | None = None
        self.wait = 0.0  # seconds spent in batches.get

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for micro_step in range(self.count):
            try:
                started = time.perf_counter()
                batch = self.batches.get(self.step, micro_step)  # (B, T) inputs and targets, on the device
                self.wait += time.perf_counter() - started
                yield batch
            except Exception as e:  # noqa: BLE001 - keep stepping in lockstep, fail together after the step
                self.failure = self.failure or as_repro_error(e, self.env)
                zeros = torch.zeros(self.shape, dtype=torch.long, device=self.env.device)
                yield zeros, zeros


class Lockstep:
    """Takes one step on every rank: the math, wrapped in the ranks' agreement (see above)."""

    def __init__(self, ctx: Context, schedule: ScheduleSettings, long_run: LongRunSettings, batch: DataSettings, *,
                 grad_clip: float, dropout_base_seed: int | None, save_failed: Callable[[], bool] = lambda: False):
        """The sections of what a step applies: the schedule (its lr), long_run (spikes and rollbacks) and the
        data section's batch geometry (seq_len: a batch that fails is zeros of (run.micro_batch_size, seq_len);
        total_batch_size: the tokens a step adds). Of other sections, as values: grad_clip (optimizer),
        dropout_base_seed (the runtime section's seed where the model has dropout, whose masks are reseeded
        every step; None without dropout).

        save_failed: this rank saw a background checkpoint save fail (its vote for a save now). A failure
        this rank saw since the last step (rank 0's log writes: ctx.logger.failure) rides on the step's vote."""
        self.env, self.runtime, self.logger = ctx.env, ctx.runtime, ctx.logger
        self.schedule, self.long_run, self.batch = schedule, long_run, batch
        self.max_norm = grad_clip or math.inf  # 0: no clipping (the norm is still measured)
        self.dropout_base_seed = dropout_base_seed
        self.save_failed = save_failed
        forget_recorded()  # a metric recorded before the run's first step (a micro-batch probe's) is no step's

    def step(self, run: Run, model: torch.nn.Module, batches, stop_requested: bool) -> StepResult:
        """Apply update run.step to run.model through `model` (its compiled / DDP wrapper).

        batches.get(step, micro_step) gives (B, T) inputs and targets on the device. A failure,
        or a NaN/inf, raises on every rank with the weights and optimizer state of step run.step.
        """
        t0 = time.perf_counter()
        step, lr = run.step, self.schedule.lr(run.step)
        if self.dropout_base_seed is not None:
            torch.manual_seed(dropout_seed(self.dropout_base_seed, step, self.env.rank))
        micro_batches = GuardedBatches(batches, step + run.data_offset, run.grad_accum_steps,
                                       (run.micro_batch_size, self.batch.seq_len), self.env)
        loss, grad_norm = train_step(run, model, micro_batches, lr, self.runtime, self.max_norm)
        metrics = take_recorded()  # this rank's, recorded since the last step's all-gather (runtime/recorder.py)
        failure = self.logger.failure or micro_batches.failure
        verdict = self.agree(run, loss, grad_norm, stop_requested, failure, metrics)
        if verdict.failures:
            raise_first_error(failure, self.env)  # every rank raises the same error
        self.check_finite(step, verdict)
        spike = verdict.judge_spike(self.long_run.spike_threshold)
        apply_update(run, skip=verdict.skipped or spike is not None)
        self.track_spikes(run, step, verdict, spike)
        run.step += 1
        run.tokens_seen += self.batch.total_batch_size
        return StepResult(**vars(verdict), lr=lr, seconds=time.perf_counter() - t0, spike=spike,
                          data_wait=micro_batches.wait)

    def agree(self, run: Run, loss: torch.Tensor, grad_norm: torch.Tensor, stop_requested: bool,
              failure: ReproError | None, metrics: dict[Metric, torch.Tensor | float]) -> Verdict:
        """The step's one collective and its one host synchronisation: every rank gets the same verdict."""
        # one all-gather of each rank's loss, votes (stop, failure, failed save) and metrics (0-d tensors or numbers)
        values = (stop_requested, failure is not None, self.save_failed(), *metrics.values())
        mine = torch.stack([loss, *(v.to(loss.dtype) if torch.is_tensor(v) else loss.new_full((), float(v))
                                    for v in values)])
        everyone = all_gather(mine, self.env)  # (world_size, 4 + len(metrics))
        # every rank combines them alike: the loss's mean over all ranks, env.world_size (every rank votes; were a
        # replica several ranks that each hold its loss (tensor parallel), still the mean over the replicas), the
        # votes' sums, each metric as declared
        how = ("mean", "sum", "sum", "sum", *(m.over_ranks for m in metrics))
        summed = everyone.sum(0)
        combined = [everyone[:, i].amax() if h == "max" else summed[i] / self.env.world_size if h == "mean"
                    else summed[i] for i, h in enumerate(how)]
        decided = torch.stack([*combined, grad_norm])
        if run.spikes is not None and run.spikes.full:  # the spike verdict rides on the same sync
            decided = torch.cat([decided, run.spikes.judge(combined[0], grad_norm)])
        loss_value, stop_votes, failures, save_failures, *rest = decided.tolist()  # the host sync
        recorded, (norm_value, *judged) = rest[:len(metrics)], rest[len(metrics):]
        return Verdict(loss_value, norm_value, bool(stop_votes), bool(failures), bool(save_failures),
                       skipped=run.scaler.is_enabled() and not math.isfinite(norm_value),
                       metrics={metric.name: value for metric, value in zip(metrics, recorded)}, judged=judged,
                       global_loss=combined[0], grad_norm_tensor=grad_norm)

    def check_finite(self, step: int, verdict: Verdict) -> None:
        """A NaN/inf loss or gradient norm (but float16's overflow, which the scaler handles) stops the
        update: a rollback with rollback_on_nonfinite, else NonFiniteLossError."""
        if math.isfinite(verdict.loss) and (math.isfinite(verdict.grad_norm) or verdict.skipped):
            return
        reason = f"loss {verdict.loss} / grad norm {verdict.grad_norm} is not finite"
        if self.long_run.rollback_on_nonfinite:
            raise RollbackRequested(step, reason)
        raise NonFiniteLossError(f"step {step}: {reason}; the update was not applied and the run's newest checkpoint "
                                 f"is the last good state")

    def track_spikes(self, run: Run, step: int, verdict: Verdict, spike: str | None) -> None:
        """Count a skipped spike (rolling back after rollback_after in a row), or add an applied step to the window."""
        if spike is not None:
            run.skips_in_a_row += 1
            if self.long_run.rollback_after and run.skips_in_a_row >= self.long_run.rollback_after:
                raise RollbackRequested(step, f"{run.skips_in_a_row} spikes in a row, the last: {spike}")
        elif run.spikes is not None and not verdict.skipped:
            run.skips_in_a_row = 0
            run.spikes.add(verdict.global_loss, verdict.grad_norm_tensor)


def dropout_seed(seed: int, step: int, rank: int) -> int:
    """Dropout masks depend on (seed, step, rank) only, so a resumed run draws the same ones (the process's
    rank: under ddp and fsdp each rank is a replica with activations of its own)."""
    return ((seed * 1_000_003 + step) * 4099 + rank) % 2**64
