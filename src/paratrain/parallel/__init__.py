"""STRATEGIES: a strategy's name -> its summary. Nothing else lives here.

The strategy itself is ``paratrain.parallel.<name>.STRATEGY`` (see parallel/base.py),
loaded by :func:`get`; adding one is its module and one line here. Nothing here imports
torch, so the command line reads these names for ``--strategy`` at no cost.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paratrain.parallel.base import Strategy

STRATEGIES: dict[str, str] = {
    "ddp": "DistributedDataParallel, one process per device",
    "dp": "legacy DataParallel, one process over every visible GPU",
    "fsdp": "parameters, gradients and optimizer state sharded across processes (FSDP2)",
    "hsdp": "FSDP2 sharded within each node and replicated across nodes",
    "split": "the model's stages on --devices in one process",
    "pipeline": "--stages processes per model, micro-batches pipelined",
}


def get(name: str) -> Strategy:
    """The strategy called ``name`` (a name the settings were checked against)."""
    if name not in STRATEGIES:
        from paratrain.errors import UserError

        raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")
    strategy: Strategy = importlib.import_module(f"{__name__}.{name}").STRATEGY
    return strategy
