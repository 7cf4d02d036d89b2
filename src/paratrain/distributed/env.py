"""Pure environment detection: a mapping of environment variables in, a DistEnv out.

Order of precedence: torchrun (RANK/WORLD_SIZE/LOCAL_RANK, set by torch's elastic agent)
over SLURM (SLURM_PROCID/SLURM_NTASKS/...) over a single process. Under ``srun torchrun``
both are present and torchrun's variables win, as they describe the actual workers.
No process, file or network is touched here, so every case is testable with a dict.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from paratrain.errors import UserError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    source: str = "single"  # "torchrun", "slurm" or "single"

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0."""
        return self.rank == 0


def detect(environ: Mapping[str, str]) -> DistEnv:
    """Return the process's place in the job from its environment variables."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return _from_slurm(environ)
    return DistEnv()


def _int(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = environ.get(key)
    if raw is None or raw == "":
        if default is None:
            raise UserError(f"environment variable {key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"environment variable {key} must be an integer, got {raw!r}") from None


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv:
    rank = _int(environ, "RANK")
    world = _int(environ, "WORLD_SIZE")
    local_rank = _int(environ, "LOCAL_RANK", 0)
    local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
    node_rank = _int(environ, "GROUP_RANK", rank // max(local_world, 1))
    _check_rank(rank, world, "RANK", "WORLD_SIZE")
    return DistEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT", DEFAULT_PORT),
        source="torchrun",
    )


def _from_slurm(environ: Mapping[str, str]) -> DistEnv:
    rank = _int(environ, "SLURM_PROCID")
    world = _int(environ, "SLURM_NTASKS")
    local_rank = _int(environ, "SLURM_LOCALID", 0)
    nodes = expand_hostlist(environ.get("SLURM_JOB_NODELIST", environ.get("SLURM_NODELIST", "")))
    n_nodes = _int(environ, "SLURM_NNODES", len(nodes) or 1)
    local_world = _tasks_on_this_node(environ, world, n_nodes)
    _check_rank(rank, world, "SLURM_PROCID", "SLURM_NTASKS")
    job_id = _int(environ, "SLURM_JOB_ID", 0)
    port = _int(environ, "MASTER_PORT", 0) or slurm_port(job_id)
    return DistEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=_int(environ, "SLURM_NODEID", 0),
        master_addr=environ.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1"),
        master_port=port,
        source="slurm",
    )


def slurm_port(job_id: int) -> int:
    """A port derived from the job id, so that jobs sharing a node do not collide."""
    return 15000 + job_id % 20000


def _tasks_on_this_node(environ: Mapping[str, str], world: int, n_nodes: int) -> int:
    # SLURM_NTASKS_PER_NODE looks like "4" or "4(x2),3"; the simple form is the common one.
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "")
    match = re.match(r"^(\d+)", per_node)
    if match:
        return int(match.group(1))
    return max(1, world // max(n_nodes, 1))


def _check_rank(rank: int, world: int, rank_key: str, world_key: str) -> None:
    if world < 1 or not 0 <= rank < world:
        raise UserError(f"inconsistent environment: {rank_key}={rank} with {world_key}={world}")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist such as ``node[01-04,07],gpu-a[1-2]`` into host names.

    Zero padding is kept (``node[01-02]`` gives node01, node02) and several bracket
    groups in one name multiply out (``r[1-2]n[1-2]`` gives four hosts).
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        if item:
            hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise UserError(f"malformed SLURM hostlist: {text!r}")
    parts.append("".join(current))
    return parts


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    prefix, rest = item[: match.start()], item[match.end() :]
    expanded = []
    for part in match.group(1).split(","):
        if "-" in part:
            low, high = part.split("-", 1)
            width = len(low)
            if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
                raise UserError(f"malformed SLURM hostlist range: {part!r} in {item!r}")
            expanded += [str(i).zfill(width) for i in range(int(low), int(high) + 1)]
        else:
            expanded.append(part)
    return [prefix + e + tail for e in expanded for tail in _expand_one(rest)]
