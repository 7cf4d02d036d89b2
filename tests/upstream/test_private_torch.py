"""torch internals paratrain reaches into, each pinned by a test that fails naming the
piece on a torch where it changes (torch's private names change without notice)."""

from __future__ import annotations

import importlib
import inspect

import torch
from torch import nn


def test_sgd_init_group_collects_params_grads_and_buffers():
    """engine/run/recipe.StorageOrderSGD calls SGD._init_group(group, params, grads, buffers)
    and reads its answer as has_sparse_grad."""
    init = getattr(torch.optim.SGD, "_init_group", None)
    assert callable(init), "torch.optim.SGD._init_group is gone"
    assert list(inspect.signature(init).parameters) == [
        "self", "group", "params", "grads", "momentum_buffer_list",
    ], "SGD._init_group's parameters changed"  # fmt: skip
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    a.grad = torch.ones(2)  # b has none: left out
    params, grads, buffers = [], [], []
    sparse = optimizer._init_group(optimizer.param_groups[0], params, grads, buffers)
    assert sparse is False and params == [a] and grads == [a.grad] and buffers == [None]


def test_functional_sgd_takes_what_storage_order_sgd_passes():
    from torch.optim import sgd as sgd_module

    from paratrain.engine.run.recipe import SGD_KEYWORDS, private_sgd_fits

    sgd = getattr(sgd_module, "sgd", None)
    assert callable(sgd), "torch.optim.sgd.sgd is gone"
    missing = set(SGD_KEYWORDS) - set(inspect.signature(sgd).parameters)
    assert not missing, f"torch.optim.sgd.sgd no longer takes {sorted(missing)}"
    assert private_sgd_fits()
    p = torch.ones(3)
    buffers = [None]
    sgd([p], [torch.ones(3)], buffers, weight_decay=0.0, momentum=0.9, lr=0.5,
        dampening=0.0, nesterov=False, maximize=False, has_sparse_grad=False,
        foreach=False, fused=False, grad_scale=None, found_inf=None)  # fmt: skip
    assert torch.equal(p, torch.full((3,), 0.5)) and torch.equal(buffers[0], torch.ones(3))


def test_storage_order_sgd_steps_as_sgd_when_the_private_pieces_change(monkeypatch):
    """The fallback: where torch's functional sgd() no longer declares the keywords (here
    a stand-in taking **kwargs that SGD itself still calls), training goes on with
    torch's own SGD step, with the same result."""
    from torch.optim import sgd as sgd_module

    from paratrain.engine.run import recipe

    real = sgd_module.sgd
    calls = []

    def changed(params, grads, buffers, **kwargs):
        calls.append(len(params))
        return real(params, grads, buffers, **kwargs)

    monkeypatch.setattr(sgd_module, "sgd", changed)
    recipe.private_sgd_fits.cache_clear()
    try:
        assert not recipe.private_sgd_fits()
        results = []
        for kind in (recipe.StorageOrderSGD, torch.optim.SGD):
            w = nn.Parameter(torch.ones(2, 3, 2, 2).to(memory_format=torch.channels_last))
            optimizer = kind([w], lr=0.1, momentum=0.9, weight_decay=0.01)
            for _ in range(2):
                w.grad = torch.full_like(w, 0.5)
                optimizer.step()
            results.append(w.detach().clone())
        torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
        assert calls == [1, 1, 1, 1]  # both stepped through torch's SGD.step
    finally:
        monkeypatch.undo()
        recipe.private_sgd_fits.cache_clear()


def test_the_checkpoint_index_types_are_where_the_safe_reader_allows_them():
    """parallel/sharded._IndexUnpickler reads DCP's .metadata allowing only these types by
    their module and name; a type torch moves or renames would make every sharded
    checkpoint unreadable."""
    from paratrain.parallel.sharded import _INDEX_TYPES

    for module, name in sorted(_INDEX_TYPES):
        found = getattr(importlib.import_module(module), name, None)
        assert found is not None, f"{module}.{name} is gone: the safe index reader needs it"
    from torch.distributed.checkpoint.metadata import Metadata

    assert "state_dict_metadata" in inspect.signature(Metadata).parameters


def test_dcp_public_pieces_the_checkpoints_use():
    from torch.distributed.checkpoint.api import (
        CheckpointException,  # engine/checkpointing/checkpoint
    )
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    assert issubclass(CheckpointException, BaseException)
    fields = set(inspect.signature(StateDictOptions).parameters)
    assert {"full_state_dict", "cpu_offload", "broadcast_from_rank0"} <= fields


def test_torch_compile_keeps_the_module_as_orig_mod():
    """parallel/parts peels torch.compile's wrapper through its _orig_mod attribute."""
    model = nn.Linear(2, 2)
    compiled = torch.compile(model)  # wrapping compiles nothing until it is called
    assert getattr(compiled, "_orig_mod", None) is model
    assert list(compiled.state_dict()) == ["_orig_mod.weight", "_orig_mod.bias"]
