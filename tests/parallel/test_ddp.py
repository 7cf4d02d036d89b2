"""Issue: identical initial weights, per-epoch reshuffling, exact evaluation (gloo, CPU)."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from torch.utils.data import DataLoader

from imagefolders import make_image_folder
from paratrain.config import TrainConfig
from paratrain.data.folder import ImageSamples, build_split
from paratrain.data.samplers import ShardedEvalSampler
from paratrain.data.transforms import eval_transform
from paratrain.distributed.env import detect
from paratrain.distributed.runtime import Runtime
from paratrain.engine.inference.evaluate import evaluate
from paratrain.models.registry import create_model
from spawn import in_single_process, run_distributed

pytestmark = pytest.mark.slow


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _runtime() -> Runtime:
    return Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")


def _initial_weights(rank, world, weights):
    from paratrain.models.registry import build_model
    from paratrain.parallel.parallelize import parallelize

    torch.manual_seed(1234 + rank)  # ranks arrive with different RNG states
    cfg = TrainConfig(model="resnet18", weights=weights, image_size=32)
    model = build_model(cfg, num_classes=3)
    built = _digest(model)
    parts = parallelize(model, cfg, _runtime())
    return built, _digest(parts.unwrapped()[0])


@pytest.mark.parametrize("with_weights", [False, True])
def test_every_rank_starts_from_identical_weights(tmp_path, with_weights):
    weights = None
    if with_weights:
        torch.manual_seed(99)
        weights = str(tmp_path / "w.pt")
        torch.save(create_model("resnet18", 1000).state_dict(), weights)
    results = run_distributed(_initial_weights, 2, weights)
    assert results[0] == results[1]
    if with_weights:
        # the loaded file, not the seed, decides the backbone
        assert results[0][0] != in_single_process(_initial_weights, None)[0]


def _record_training_order(rank, world, data_dir, out_dir):
    from paratrain.data.transforms import DecodedSamples
    from paratrain.engine.trainer import fit

    seen: list[int] = []
    original = DecodedSamples.load

    def recording(self, index):
        seen.append(index)  # training images only: validation is not DecodedSamples
        return original(self, index)

    DecodedSamples.load = recording
    cfg = TrainConfig(
        data=data_dir,
        model="resnet18",
        image_size=16,
        epochs=2,
        batch_size=4,
        workers=0,
        output_dir=out_dir,
        name="order",
        cache="off",  # the decode path loads each training sample once, which is recorded
    )
    fit(cfg, _runtime())
    half = len(seen) // 2
    return seen[:half], seen[half:]


def test_sampler_reshuffles_every_epoch_and_shards_disjointly(tmp_path):
    data = make_image_folder(tmp_path / "d", classes=2, per_class=10)  # 16 train images
    results = run_distributed(_record_training_order, 2, str(data), str(tmp_path / "runs"))
    for epoch in (0, 1):
        shards = [set(r[epoch]) for r in results]
        assert shards[0].isdisjoint(shards[1])
        assert shards[0] | shards[1] == set(range(16))
    for first, second in results:
        assert first != second  # set_epoch() was called: a new order
    assert (tmp_path / "runs" / "order" / "checkpoints" / "last.pt").is_file()


def _evaluate(rank, world, data_dir, weights_path, size=16, tta=False):
    split = build_split(data_dir, val_fraction=0.5)
    model = create_model("resnet18", len(split.classes))
    model.load_state_dict(torch.load(weights_path))
    dataset = ImageSamples(split.val, eval_transform(size))
    loader = DataLoader(
        dataset, batch_size=16, sampler=ShardedEvalSampler(len(dataset), rank, world, 16)
    )
    return evaluate(model, loader, torch.device("cpu"), len(split.classes), tta=tta).as_dict()


@pytest.fixture(scope="module")
def odd_validation_set(tmp_path_factory):
    """7 classes x 286 images at val_fraction 0.5: exactly 1,001 validation images."""
    root = tmp_path_factory.mktemp("odd")
    data = make_image_folder(root / "d", classes=7, per_class=286, size=(16, 16))
    torch.manual_seed(5)
    weights = root / "w.pt"
    torch.save(create_model("resnet18", 7).state_dict(), weights)
    return str(data), str(weights)


@pytest.fixture(scope="module")
def one_process(odd_validation_set) -> dict:
    """The 1-process evaluation every world size is compared with: at 16 px; at 24 px
    with flip averaging, and without it."""
    data, weights = odd_validation_set
    return {
        "plain16": in_single_process(_evaluate, data, weights),
        "flip24": in_single_process(_evaluate, data, weights, 24, True),
        "plain24": in_single_process(_evaluate, data, weights, 24, False),
    }


@pytest.mark.parametrize("world", [2, 3, 4])
def test_evaluation_counts_every_image_once_and_matches_one_process(
    odd_validation_set, one_process, world
):
    data, weights = odd_validation_set
    reference = one_process["plain16"]
    assert reference["count"] == 1001
    results = run_distributed(_evaluate, world, data, weights)
    for result in results:
        assert result == reference


@pytest.mark.parametrize("world", [1, 2, 3])
def test_flip_averaging_at_a_higher_resolution_counts_every_image_once(
    odd_validation_set, one_process, world
):
    """--tta flip and a validation size above training's (--val-size): still every
    image once, and the same totals at every world size."""
    data, weights = odd_validation_set
    reference, plain = one_process["flip24"], one_process["plain24"]
    assert reference["count"] == plain["count"] == 1001
    assert reference["loss"] != plain["loss"]  # the mirrors' logits were averaged in
    results = (
        [reference] if world == 1 else run_distributed(_evaluate, world, data, weights, 24, True)
    )
    for result in results:
        assert result == reference
