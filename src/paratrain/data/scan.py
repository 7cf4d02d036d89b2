"""Screen a data set for unreadable images before training, in parallel.

Every rank decodes a disjoint shard of the file list (rank r takes r, r+W, ...) with its
loader workers, and the findings are gathered, so every rank ends with the same list of
bad files and, under ``--bad-images skip``, the same list of good ones.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from paratrain.data.folder import DataSplit, Sample, image_problem
from paratrain.distributed import comm
from paratrain.errors import AgreedUserError
from paratrain.log import get_logger


class _Probe(Dataset):
    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[str, str]:
        return self.paths[index], image_problem(self.paths[index]) or ""


def find_bad_images(paths: list[str], rank: int, world: int, workers: int, show: bool) -> list:
    """(path, reason) for every unreadable file, the same list on every rank."""
    shard = paths[rank::world]
    loader = DataLoader(_Probe(shard), batch_size=None, num_workers=workers)
    found = []
    with tqdm(
        total=len(paths),
        desc="checking images",
        unit="img",
        delay=1.0,
        disable=not (show and sys.stderr.isatty()),
        leave=False,
    ) as bar:
        for path, problem in loader:
            if problem:
                found.append((path, problem))
            bar.update(world)
    return sorted(pair for part in comm.all_gather_object(found) for pair in part)


def without_unreadable(samples: list[Sample]) -> tuple[list[Sample], list[tuple[str, str]]]:
    """The samples whose files can be read, and (path, why) of the others: how a run
    under ``--bad-images skip`` left them out, for `paratrain eval` to do the same."""
    bad = find_bad_images([path for path, _ in samples], 0, 1, 0, show=True)
    return _leave_out(samples, {path for path, _ in bad}), bad


def _leave_out(samples: list[Sample], bad: set[str]) -> list[Sample]:
    return [sample for sample in samples if sample[0] not in bad]


def screen(
    split: DataSplit,
    policy: str,
    rank: int,
    world: int,
    workers: int,
    run_dir: Path | None,
    found: list[tuple[str, str]] | None = None,
) -> DataSplit:
    """Apply ``--bad-images error|skip`` to a split; report ignored non-image files.
    ``found``: the unreadable files when already known (the cache build decoded them)."""
    log = get_logger()
    if split.ignored:
        log.info(f"ignored {split.ignored} file(s) without an image extension in {split.root}")
    if found is None:
        paths = [p for p, _ in split.train] + [p for p, _ in split.val]
        found = find_bad_images(paths, rank, world, workers, show=rank == 0)
    bad = found
    if not bad:
        return split
    listing = "; ".join(f"{path} ({why})" for path, why in bad)
    if policy == "error":
        raise AgreedUserError(
            f"{len(bad)} unreadable image(s) (--bad-images skip leaves them out): {listing}"
        )
    bad_paths = {path for path, _ in bad}
    if run_dir is not None and rank == 0:
        (run_dir / "bad_images.txt").write_text("".join(f"{p}\t{w}\n" for p, w in bad))
    listed = f"; listed in {run_dir / 'bad_images.txt'}" if run_dir is not None else ""
    log.info(f"skipping {len(bad)} unreadable image(s){listed}")
    kept = replace(
        split, train=_leave_out(split.train, bad_paths), val=_leave_out(split.val, bad_paths)
    )
    for name, part in (("train", kept.train), ("val", kept.val)):
        present = {label for _, label in part}
        missing = [c for i, c in enumerate(kept.classes) if i not in present]
        if missing:
            raise AgreedUserError(
                f"after skipping unreadable images, {name} has no images of class(es) {missing}"
            )
    return kept
