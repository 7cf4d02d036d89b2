import pytest

from paratrain.distributed.env import DistEnv, detect, expand_hostlist, slurm_port
from paratrain.errors import UserError


def test_single_process_when_nothing_is_set():
    env = detect({})
    assert env == DistEnv()
    assert env.world_size == 1 and env.rank == 0 and not env.distributed and env.source == "single"


def test_torchrun_variables():
    env = detect(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "node7",
            "MASTER_PORT": "1234",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.node_rank == 1 and env.master_addr == "node7" and env.master_port == 1234
    assert env.source == "torchrun" and env.distributed and not env.is_main


def test_slurm_variables_with_hostlist_and_job_port():
    env = detect(
        {
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS_PER_NODE": "2(x2)",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.node_rank) == (3, 4, 1, 1)
    assert env.local_world_size == 2
    assert env.master_addr == "gpu07"
    assert env.master_port == slurm_port(4242) != slurm_port(4243)
    assert env.source == "slurm"


def test_torchrun_wins_over_slurm():
    # srun torchrun ...: one SLURM task per node, torchrun's workers inside it.
    env = detect(
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "3",
        }
    )
    assert env.source == "torchrun" and env.rank == 3 and env.world_size == 8


def test_slurm_master_port_from_environment_wins():
    env = detect(
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
            "MASTER_PORT": "29999",
            "SLURM_JOB_NODELIST": "a",
        }
    )
    assert env.master_port == 29999


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node1", ["node1"]),
        (
            "node[01-04,07],gpu-a[1-2]",
            ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"],
        ),
        ("a,b,c", ["a", "b", "c"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("", []),
    ],
)
def test_hostlist_expansion(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "environ",
    [
        {"RANK": "x", "WORLD_SIZE": "2"},
        {"RANK": "2", "WORLD_SIZE": "2"},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "0"},
    ],
)
def test_bad_variables_are_user_errors(environ):
    with pytest.raises(UserError):
        detect(environ)


def test_malformed_hostlist():
    with pytest.raises(UserError, match="hostlist"):
        expand_hostlist("node[1-")
