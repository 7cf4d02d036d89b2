"""What every rank must decide alike at step boundaries: a non-finite loss (stop every
rank, or skip the step on every rank), a preemption signal (save, then stop), a save.

On a CPU reading a value back costs nothing, so every step's flags are exchanged and
acted on at once. On CUDA a read-back stalls the queue of kernels, so nothing in a step
reads the device:

* ``--on-nonfinite abort``: each rank counts its non-finite steps on the device; every
  ``CUDA_CHECK_EVERY`` steps, before every save and at the end of every epoch the ranks
  exchange (count, first bad step, signal) in one collective and act alike. A NaN is
  acted on at most ``CUDA_CHECK_EVERY - 1`` steps after it appeared, and never after a
  save of the weights it spoiled.
* ``--on-nonfinite skip``: each step's flag is all-reduced on the device and handed to
  torch's fused optimizer kernel as ``found_inf``, which leaves weights and optimizer
  state as they were (the way GradScaler skips a step); BatchNorm buffers are put back
  with a ``where``. Where that is not possible (a GradScaler, EMA weights, an optimizer
  that is not fused) the step reads its flag back, as on a CPU.
* a SIGTERM/SIGUSR1 is acted on at the next exchange: at most ``CUDA_CHECK_EVERY - 1``
  steps later, well inside ``--preempt-grace``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable

import torch
import torch.distributed as dist

from paratrain.config import TrainConfig
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime
from paratrain.engine.run import faults
from paratrain.engine.run.preempt import Preempted, PreemptionGuard, requeue
from paratrain.engine.run.state import Progress
from paratrain.errors import AgreedUserError

CUDA_CHECK_EVERY = 16


class NonFiniteLoss(AgreedUserError):
    """Every rank raises it on the same step; rank 0 tells it."""

    exit_code = 3


class StepControl:
    """Per-step agreement on non-finite losses and stop requests, and periodic saves."""

    def __init__(
        self,
        cfg: TrainConfig,
        runtime: Runtime,
        save,
        guard: PreemptionGuard,
        sync_free: bool = False,
    ):
        """``save(progress)`` writes a checkpoint (a collective); ``sync_free``: the
        CUDA behaviour described above."""
        self.cfg, self.runtime, self.save, self.guard = cfg, runtime, save, guard
        self.skip_mode = cfg.on_nonfinite == "skip"
        self.sync_free = sync_free
        self.check_every = CUDA_CHECK_EVERY if sync_free else 1
        self.fault = faults.planned(runtime.rank)
        self.stop_requested = False
        zero = lambda: torch.zeros((), dtype=torch.int64, device=runtime.device)  # noqa: E731
        self._bad, self._first_bad, self._skipped = zero(), zero(), zero()
        self._since_check = 0
        self._buffers: list[torch.Tensor] = []
        self._saved: list[torch.Tensor] = []

    def begin_step(self, buffers: Iterable[torch.Tensor]) -> None:
        """Under skip, keep the buffers (BatchNorm statistics) a skipped step restores."""
        if self.skip_mode:
            self._buffers = list(buffers)
            self._saved = [b.detach().clone() for b in self._buffers]

    def judge(self, loss_sum: torch.Tensor, progress: Progress) -> bool | torch.Tensor:
        """Whether this step's update is to be skipped: True/False, or (sync-free skip) a
        device flag for the optimizer. Raises NonFiniteLoss on every rank under abort."""
        step = progress.global_step + 1
        bad = ~torch.isfinite(loss_sum.detach())
        if faults.fire(self.fault, step):
            bad = torch.ones_like(bad)
        self._since_check += 1
        if not self.sync_free:
            ranks, first, stop = self._exchange(
                bad.long(), torch.full_like(bad, step, dtype=torch.long)
            )
            self.stop_requested = stop
            if ranks and not self.skip_mode:
                raise self._error(first, ranks, progress)
            if ranks:
                progress.skipped_steps += 1
            return bool(ranks)
        if self.skip_mode:
            flag = comm.all_reduce_sum(bad.float())  # stays on the device
            self._skipped += (flag > 0).long()
            verdict: bool | torch.Tensor = flag
        else:
            self._first_bad = torch.where((self._bad == 0) & bad, step, self._first_bad)
            self._bad += bad.long()
            verdict = False
        if self._since_check >= self.check_every:
            self.check(progress)
        return verdict

    def end_step(self, skipped: bool | torch.Tensor) -> None:
        """A skipped step leaves the buffers as they were before it."""
        if skipped is False or not self._saved:
            return
        with torch.no_grad():
            for buffer, saved in zip(self._buffers, self._saved, strict=True):
                if skipped is True:
                    buffer.copy_(saved)
                else:
                    buffer.copy_(torch.where(skipped > 0, saved, buffer))

    def check(self, progress: Progress) -> None:
        """Sync-free runs: exchange what was counted since the last check and act alike.
        Called every ``check_every`` steps, before saves and at the end of an epoch."""
        if not self.sync_free:
            return
        self._since_check = 0
        first = torch.where(self._bad > 0, self._first_bad, 0)
        ranks, first_step, stop = self._exchange(self._bad, first)
        skipped = int(self._skipped)  # one read, here rather than every step
        progress.skipped_steps += skipped
        self._bad.zero_(), self._first_bad.zero_(), self._skipped.zero_()
        self.stop_requested = self.stop_requested or stop
        if ranks and not self.skip_mode:
            raise self._error(first_step, ranks, progress)

    def after_step(self, progress: Progress) -> None:
        """Periodic saves, and a stop request: save at this step boundary on every rank, then stop."""
        every = self.cfg.save_every_steps
        if every and progress.global_step % every == 0:
            self.check(progress)  # nothing spoiled is saved; a signal is seen
            if not self.stop_requested:  # --async-save: written while training goes on
                self.save(progress, background=self.cfg.async_save)
        if self.stop_requested:
            self.guard.reached_boundary()
            self.save(progress)
            signum = self.guard.signum or signal.SIGTERM  # a rank that saw none follows the others
            if self.cfg.requeue and self.runtime.is_main:
                requeue(os.environ)
            raise Preempted(signum)

    def _exchange(self, bad: torch.Tensor, first: torch.Tensor) -> tuple[int, int, bool]:
        """One collective: how many ranks saw a non-finite loss, the first step one was
        seen at, whether any rank was asked to stop."""
        mine = torch.stack(
            [bad.clamp(max=1), first, torch.tensor(int(self.guard.signum > 0)).to(bad.device)]
        ).to(comm.comm_device())
        if comm.is_dist():
            every = [torch.empty_like(mine) for _ in range(comm.world_size())]
            dist.all_gather(every, mine)
            table = torch.stack(every).cpu()
        else:
            table = mine.cpu()[None]
        ranks = int(table[:, 0].sum())
        firsts = [int(f) for b, f in zip(table[:, 0], table[:, 1], strict=True) if b]
        return ranks, min(firsts, default=0), bool(table[:, 2].any())

    def _error(self, step: int, ranks: int, progress: Progress) -> NonFiniteLoss:
        return NonFiniteLoss(
            f"non-finite loss at step {step} (epoch {progress.epoch + 1}) on {ranks} rank(s); "
            "--on-nonfinite skip would skip such steps"
        )
