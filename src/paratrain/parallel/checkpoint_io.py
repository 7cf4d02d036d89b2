"""How a strategy's checkpoint reaches the disk: its parts decide (``io_for``: whether
their state is spread over ranks), so nothing above asks which strategy ran.

* ``WHOLE``: rank 0 holds the whole state (the unwrapped model, the optimizer in the
  single-device layout every strategy shares) and writes one file, atomically
  (``files.replaced``); best and epoch copies are hard links of it. In the background
  (``background=True``: --async-save's step checkpoints) the state is first copied to
  host memory (pinned, from CUDA) and written by one writer thread while training goes
  on; the next save, and the run's end, wait for it (and raise what it raised).
* ``SHARDED``: each rank writes the shards it holds through torch.distributed.checkpoint
  (parallel/sharded.py), rank 0 adding ``state.pt``; copies are folders of hard links.
  In the background, DCP's async save stages the shards in host memory and writes them
  from its own thread; the next save, and the run's end, finish it on every rank.

Either is given the checkpoint's other parts as a plain dict (``rest``) and writes them
with the tensors; ``load_into`` puts a checkpoint's model and optimizer back.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from paratrain.distributed import comm
from paratrain.errors import UserError
from paratrain.files import fsync, replaced
from paratrain.parallel import sharded

if TYPE_CHECKING:
    from paratrain.parallel.parts import ModelParts


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """A reader sees the old file or the new one, never a torn one. A write that fails
    (a full disk, a file size limit) is one line; the old file stays as it was."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced(path) as handle:
            torch.save(state, handle)
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports write errors so
        cause = exc.__context__ if isinstance(exc.__context__, OSError) else exc
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
        kept = "the previous one is unchanged" if path.exists() else "none was saved before"
        raise UserError(
            f"cannot write checkpoint {path}: {reason.strip().splitlines()[0][:200]} ({kept})"
        ) from None


def copy_atomic(state: dict[str, Any], written: Path, path: Path) -> None:
    """``path`` gets the checkpoint just written to ``written`` (the same ``state``): a hard
    link, renamed into place, instead of a second 90 MB write; a write where the file
    system has no hard links. A later replacement of ``written`` leaves ``path`` alone."""
    import os

    tmp = path.with_name(f".{path.name}.{os.getpid()}.link")
    try:
        tmp.unlink(missing_ok=True)
        os.link(written, tmp)  # the same inode: its bytes were fsynced when written
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        save_atomic(state, path)
        return
    fsync(path.parent)


class CheckpointIO:
    """Where and how a checkpoint named ``name`` (last, best, epoch-NNNN) is written."""

    suffix = ""

    def path(self, folder: Path, name: str) -> Path:
        return folder / f"{name}{self.suffix}"

    def save(
        self,
        path: Path,
        parts: ModelParts,
        optimizer: torch.optim.Optimizer,
        rest: dict[str, Any],
        before_write: Callable[[Path], None] | None = None,
        background: bool = False,
    ) -> None:
        """A collective: every rank calls it. ``background``: the write may finish after
        this returns (where the I/O can)."""
        raise NotImplementedError

    def wait(self) -> None:
        """The write still in the background, if any, finished (its error raised)."""

    def copy(self, source: Path, target: Path) -> None:
        """Rank 0: ``target`` becomes a copy of the checkpoint just saved at ``source``."""
        raise NotImplementedError

    def reads_shards(self, path: Path) -> bool:
        """Whether resuming from ``path`` reads each rank's shards (else the whole)."""
        return False

    def load_into(
        self, path: Path, parts: ModelParts, optimizer: torch.optim.Optimizer, state: Any
    ) -> None:
        """The model's and optimizer's state of checkpoint ``state`` (read from ``path``:
        whole, or with ``reads_shards`` its ``state.pt`` alone)."""
        try:
            parts.load_state_dict(state.model)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0]
            raise UserError(f"{path}: its weights do not fit this model ({first[:160]})") from None
        assert state.optimizer is not None
        parts.load_optimizer_state_dict(optimizer, state.optimizer)


class WholeIO(CheckpointIO):
    suffix = ".pt"

    def __init__(self) -> None:
        self.written: dict[str, Any] | None = None  # the last state written, for copies
        self._writer: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def save(self, path, parts, optimizer, rest, before_write=None, background=False) -> None:
        model = parts.state_dict() if comm.is_main() else {}
        optim = parts.optimizer_state_dict(optimizer) if comm.is_main() else {}
        if not comm.is_main():
            return
        self.wait()  # one write at a time, in order
        state = {**rest, "model": model, "optimizer": optim}
        if not background:
            self.written = state
            _write(state, path, before_write)
            return
        self.written = host_copy(state)  # training may now change the weights
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="paratrain-save")
        self._pending = self._writer.submit(_write, self.written, path, before_write)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def copy(self, source: Path, target: Path) -> None:
        assert self.written is not None  # copies follow a save
        self.wait()
        copy_atomic(self.written, source, target)


def _write(state: dict[str, Any], path: Path, before_write: Callable[[Path], None] | None) -> None:
    if before_write is not None:
        before_write(path)
    save_atomic(state, path)


def host_copy(value: Any) -> Any:
    """``value`` (dicts, lists and tuples of tensors and plain values) with every tensor
    copied to host memory: pinned, from a device (copied asynchronously, then waited for
    once), or a plain clone of a CPU tensor; the rest as it is."""
    moved: list[bool] = []

    def copy(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            if item.device.type == "cpu":
                return item.detach().clone()
            moved.append(True)
            out = torch.empty(item.shape, dtype=item.dtype, pin_memory=True)
            return out.copy_(item.detach(), non_blocking=True)
        if isinstance(item, dict):
            return {key: copy(sub) for key, sub in item.items()}
        if isinstance(item, list | tuple):
            return type(item)(copy(sub) for sub in item)
        return item

    out = copy(value)
    if moved and torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies landed before the writer reads them
    return out


class ShardedIO(CheckpointIO):
    def __init__(self) -> None:
        self._pending: sharded.Pending | None = None

    def save(self, path, parts, optimizer, rest, before_write=None, background=False) -> None:
        self.wait()  # one save at a time, in order
        if background:
            self._pending = sharded.save_async(path, parts, optimizer, rest)
        else:
            sharded.save(path, parts, optimizer, rest)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()

    def copy(self, source: Path, target: Path) -> None:
        sharded.link_copy(source, target)

    def reads_shards(self, path: Path) -> bool:
        return path.is_dir() and sharded.find(path) is not None

    def load_into(self, path, parts, optimizer, state) -> None:
        if not self.reads_shards(path):  # a whole file: every rank reads it, and keeps its share
            super().load_into(path, parts, optimizer, state)
            return
        folder = sharded.find(path)
        assert folder is not None and state.optimizer_groups is not None
        sharded.load_into(folder, parts, optimizer, state.optimizer_groups)


def io_for(parts: ModelParts) -> CheckpointIO:
    """How ``parts``' checkpoint reaches the disk: each rank's shards where the state is
    spread over ranks (``collective_state``), else one whole file."""
    return ShardedIO() if parts.collective_state else WholeIO()
