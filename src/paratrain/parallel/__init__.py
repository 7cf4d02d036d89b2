"""STRATEGIES: a strategy's name -> its summary. Nothing else lives here.

The strategy itself is ``paratrain.parallel.<name>.STRATEGY`` (see parallel/base.py),
loaded by ``parallel.base.get``; adding one is its module and one line here. Nothing here imports
torch, so the command line reads these names for ``--strategy`` at no cost.
"""

from __future__ import annotations

STRATEGIES: dict[str, str] = {
    "ddp": "DistributedDataParallel, one process per device",
    "dp": "legacy DataParallel, one process over every visible GPU",
    "fsdp": "parameters, gradients and optimizer state sharded across processes (FSDP2)",
    "hsdp": "FSDP2 sharded within each node and replicated across nodes",
    "split": "the model's stages on --devices in one process",
    "pipeline": "--stages processes per model, micro-batches pipelined",
}
