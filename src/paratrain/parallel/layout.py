"""Layout: which rank is which, the one value every strategy's arithmetic returns.

Apart from parallel/base.py so that ModelParts (parallel/parts.py), which carries it, and
the Strategy interface, which returns ModelParts, do not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Which rank is which (torchtitan's ParallelDims): ``world`` ranks as ``replicate``
    groups of whole copies x ``shard`` ranks sharing one copy's parameters x ``stages``
    pipeline stages of one copy, the stages innermost (one copy's stages are neighbours,
    on one machine) and the shards next (one node's ranks share a copy under hsdp)."""

    world: int = 1
    rank: int = 0
    replicate: int = 1
    shard: int = 1
    stages: int = 1

    def __post_init__(self) -> None:
        if self.replicate * self.shard * self.stages != self.world:
            raise ValueError(
                f"{self.replicate} replicas x {self.shard} shards x {self.stages} stages "
                f"is not {self.world} ranks"
            )
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside {self.world} ranks")

    @property
    def dp_size(self) -> int:
        """Ranks that read different batches: the global batch is the batch times this."""
        return self.replicate * self.shard

    @property
    def dp_rank(self) -> int:
        """Which of them this rank is: it reads the dp_rank-th shard of every epoch."""
        return self.rank // self.stages

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 without a pipeline)."""
        return self.rank % self.stages

    def stage_ranks(self, dp_rank: int) -> list[int]:
        """The ranks of one copy's stages, in stage order."""
        return [dp_rank * self.stages + s for s in range(self.stages)]

    def dp_ranks(self, stage: int) -> list[int]:
        """The ranks holding one stage, one per data-parallel rank."""
        return [r * self.stages + stage for r in range(self.dp_size)]
