"""Sharded checkpoints: fsdp and pipeline runs save through torch.distributed.checkpoint.

Each rank writes the shards it holds (fsdp: 1/N of every tensor; pipeline: its stage),
so nothing gathers the whole model or optimizer onto one rank. A checkpoint is a folder:
DCP's files, plus ``state.pt`` (rank 0: where training stands, the config, classes, RNG
states, the optimizer's hyperparameters by parameter name). Loading reshards: an fsdp
checkpoint loads at another world size, into a pipeline, or, consolidated in memory,
into a single process (`eval`, `predict`, `export`, a ddp run).

Read as data: DCP keeps its index in a pickle, which is read here by an unpickler that
knows only the index's own types, and the shards are tensors read with
``weights_only``; a folder that holds anything else is refused before anything of it
runs.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from paratrain.distributed import comm
from paratrain.errors import UserError
from paratrain.files import replaced, swap_in
from paratrain.parallel import optim_state

if TYPE_CHECKING:
    from paratrain.parallel.parts import ModelParts

STATE = "state.pt"  # everything but the model's and optimizer's tensors

_INDEX_TYPES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _IndexUnpickler(pickle.Unpickler):
    """DCP's index (``.metadata``), allowing only the types an index is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _INDEX_TYPES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


class SafeReader(FileSystemReader):
    """torch's file-system reader, its index read as data."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _IndexUnpickler(io.BytesIO(path.read_bytes())).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise UserError(
                f"{self.path} is not a checkpoint paratrain reads as data ({exc}); it was "
                "not loaded (nothing in it ran)"
            ) from None
        if not isinstance(metadata, Metadata) or not all(
            isinstance(v, TensorStorageMetadata) for v in metadata.state_dict_metadata.values()
        ):
            raise UserError(f"{self.path} holds more than tensors; it was not loaded")
        from torch.distributed.checkpoint.metadata import StorageMeta

        storage = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata


def is_sharded(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / STATE).is_file()


def save(directory: Path, parts: ModelParts, optimizer: torch.optim.Optimizer, rest: dict) -> None:
    """A collective: every rank writes its shards into a temporary folder, rank 0 adds
    ``state.pt`` (``rest``: the checkpoint's other parts, engine/checkpointing/checkpoint.Checkpoint),
    then renames the folder into place (the old one is removed after)."""
    tmp = _fresh_tmp(directory)
    flat, groups = parts.sharded_state(optimizer)
    dcp.save(flat, checkpoint_id=tmp)
    _finish(tmp, directory, {**rest, "optimizer_groups": parts.gather_groups(groups)})


class Pending:
    """A sharded save whose shards are still being written (``save_async``)."""

    def __init__(self, future: Any, stager: Any, tmp: Path, directory: Path, state: dict) -> None:
        self.future, self.stager = future, stager
        self.tmp, self.directory, self.state = tmp, directory, state

    def finish(self) -> None:
        """A collective: every rank's shards written, then ``state.pt`` and the rename as
        ``save`` does; a rank whose write failed makes every rank raise the same error."""
        problem = None
        try:
            self.future.result()
        except Exception as exc:  # an OSError, or DCP's CheckpointException around one
            problem = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else repr(exc)
        finally:
            self.stager.close()
        told = [p for p in comm.all_gather_object(problem) if p]
        if told:
            if comm.is_main():
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise OSError(f"a background sharded save failed: {told[0]}")
        _finish(self.tmp, self.directory, self.state)


_SAVE_GROUP: list[Any] = []  # (the default group, the gloo group background saves meet in)


def save_async(
    directory: Path, parts: ModelParts, optimizer: torch.optim.Optimizer, rest: dict
) -> Pending:
    """``save`` with the shards copied to host memory (pinned from CUDA) before it returns
    and written by DCP's background thread (torchtitan's async checkpointing). That thread
    meets the other ranks in a gloo group of its own, so its collectives never interleave
    with training's. ``Pending.finish`` completes it."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    tmp = _fresh_tmp(directory)
    flat, groups = parts.sharded_state(optimizer)
    state = {**rest, "optimizer_groups": parts.gather_groups(groups)}
    cuda = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(cuda, False, False, cuda))
    future = dcp.async_save(  # a Future: staging is synchronous, done when it returns
        flat,
        checkpoint_id=tmp,
        process_group=_save_group(),
        async_stager=stager,
        no_dist=not comm.is_dist(),
    )
    return Pending(future, stager, tmp, directory, state)


def _save_group() -> Any:
    """The gloo group of this process group's background saves (None in one process),
    made once per group: a later group (a new run in the same process) gets its own."""
    if not comm.is_dist():
        return None
    import torch.distributed as dist

    world = dist.group.WORLD
    if not _SAVE_GROUP or _SAVE_GROUP[0] is not world:
        _SAVE_GROUP[:] = [world, dist.new_group(backend="gloo")]
    return _SAVE_GROUP[1]


def _fresh_tmp(directory: Path) -> Path:
    """The empty temporary folder a save writes into (every rank waits for it)."""
    tmp = directory.with_name(f".{directory.name}.tmp")
    if comm.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    return tmp


def _finish(tmp: Path, directory: Path, state: dict) -> None:
    """Rank 0: ``state.pt`` into the written folder, then the folder into place."""
    if comm.is_main():
        with replaced(tmp / STATE) as handle:
            torch.save({**state, "sharded": True}, handle)
        swap_in(tmp, directory)
    comm.barrier()


def find(directory: Path) -> Path | None:
    """A sharded checkpoint folder, or the one parked while it was replaced."""
    for candidate in (directory, directory.with_name(f".{directory.name}.old")):
        if is_sharded(candidate):
            return candidate
    return None


def link_copy(source: Path, target: Path) -> None:
    """``target`` gets ``source``'s files as hard links (copies where links fail)."""
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, tmp, copy_function=link)
    swap_in(tmp, target)


def read_state(directory: Path) -> dict[str, Any]:
    """``state.pt`` of a sharded checkpoint, as data."""
    try:
        state = torch.load(directory / STATE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(
            f"{directory / STATE} holds objects other than tensors and plain values; it "
            "was not loaded (nothing in it ran)"
        ) from None
    if not isinstance(state, dict) or not state.get("sharded"):
        raise UserError(f"{directory} is not a paratrain sharded checkpoint")
    return state


def load_into(
    directory: Path, parts: ModelParts, optimizer: torch.optim.Optimizer, groups: list
) -> None:
    """A collective: this rank's shards of the model and optimizer, resharded from
    whatever world size and strategy saved them; ``groups``: the optimizer's param
    groups by parameter name, as saved."""
    template, _ = parts.sharded_state(optimizer)
    saved = SafeReader(directory).read_metadata().state_dict_metadata
    stepped = {key.rsplit("::", 1)[0] for key in saved if key.startswith(optim_state.OPTIM)}
    for key in [k for k in template if k not in saved and k.startswith(optim_state.OPTIM)]:
        if key.rsplit("::", 1)[0] not in stepped:  # a parameter the optimizer had not
            del template[key]  # stepped when saved (a frozen backbone): none to load
    _check_keys(directory, template)
    dcp.load(template, storage_reader=SafeReader(directory))
    parts.load_sharded_state(optimizer, template, groups)


def consolidate(directory: Path, with_optimizer: bool = True) -> dict[str, Any]:
    """The whole checkpoint in memory, in the single-file layout (for one process: eval,
    predict, export, a ddp run): model tensors whole, the optimizer indexed over the
    model's parameters in order."""
    state = read_state(directory)
    reader = SafeReader(directory)
    metadata = reader.read_metadata()
    wanted = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)  # SafeReader admits no other kind
        and (with_optimizer or key.startswith(optim_state.MODEL))
    }
    dcp.load(wanted, storage_reader=reader, no_dist=True)
    model, named = optim_state.unflatten(wanted, state["optimizer_groups"])
    state["model"] = model
    if with_optimizer:
        names = [name for group in named["param_groups"] for name in group["params"]]
        state["optimizer"] = optim_state.by_index(named, names)
    return state


def _check_keys(directory: Path, template: dict[str, torch.Tensor]) -> None:
    """Every tensor this rank needs is in the checkpoint (another model's is not)."""
    saved = SafeReader(directory).read_metadata().state_dict_metadata
    missing = [key for key in template if key not in saved]
    if missing:
        names = ", ".join(k.split("::", 1)[1] for k in missing[:3])
        raise UserError(
            f"{directory} does not hold this model's tensors ({len(missing)} missing: {names})"
        )
