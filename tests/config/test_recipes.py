"""Training recipes on par with torchvision's references and timm: augmentation policies,
repeated augmentation, LARS and LAMB, weight decay by kind, timm models, named recipes,
validation crop and resize. Each is tested for what it changes."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from torch import nn

from imagefolders import make_image_folder
from paratrain import TrainConfig, train
from paratrain.cli import build_parser, main, resolve_train_args
from paratrain.config.train import RECIPES, read_recipe, shipped_recipes
from paratrain.data.cache.build import prepare
from paratrain.data.cache.read import CachedImages
from paratrain.data.device_batches import DeviceAugmented
from paratrain.data.folder import build_split
from paratrain.data.samplers import TrainSampler
from paratrain.data.transforms import Augment, DecodedSamples, TrainAugment, eval_transform
from paratrain.engine.run.recipe import build_optimizer, param_groups
from paratrain.errors import UserError
from paratrain.models.registry import create_model
from paratrain.parallel import optim_state
from paratrain.parallel.parts import ModelParts

POLICIES = ["trivialaugment", "randaugment", "autoaugment", "augmix"]


@pytest.fixture
def split(tmp_path):
    return build_split(make_image_folder(tmp_path / "data", classes=2, per_class=8, size=(53, 37)))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_policy_changes_pixels_keeps_labels_and_repeats_from_its_seed(split, tmp_path, policy):
    cache = prepare(split.train, 24, "on", 1.0, str(tmp_path / "c"), workers=0)
    keys = [(i, 77 + i) for i in range(len(split.train))]
    plain = CachedImages(split.train, cache, TrainAugment(Augment(24, 0.3)))
    rich = Augment(24, 0.3, policy=policy, random_erase=0.5)
    with_policy = CachedImages(split.train, cache, TrainAugment(rich))
    a, labels = plain.__getitems__(keys)
    b, same = with_policy.__getitems__(keys)
    assert torch.equal(labels, same) and not torch.equal(a, b)
    assert torch.equal(with_policy.__getitems__(keys)[0], b)  # the seed decides every draw
    device, _ = DeviceAugmented(split.train, TrainAugment(rich), cache).__getitems__(keys)
    on_device = device.on(torch.device("cpu"), torch.contiguous_format)
    grey = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
    gaps = ((on_device - b) * grey).abs()  # the batched resize's filter, then the same policy
    # measured 0.7-2.3 grey levels; exact zeros are erased pixels: the same rectangles
    assert gaps.mean() < 3 and torch.equal(on_device == 0, b == 0)
    decoded, labels_decoded = DecodedSamples(split.train, TrainAugment(rich)).__getitems__(keys)
    assert decoded.shape == b.shape and torch.equal(labels_decoded, labels)  # the same one


def test_random_erasing_erases(split):
    image = torch.randint(0, 255, (3, 40, 40), dtype=torch.uint8)
    erased = TrainAugment(Augment(32, 0.5, random_erase=1.0)).sample(image, seed=3)
    kept = TrainAugment(Augment(32, 0.5)).sample(image, seed=3)
    assert (erased == 0).sum() > (kept == 0).sum() + 50


@pytest.mark.parametrize("world, reps", [(4, 4), (2, 3), (3, 2)])
def test_repeated_augmentation_gives_each_image_k_times_on_different_ranks(world, reps):
    n = 24
    per_rank = []
    for rank in range(world):
        sampler = TrainSampler(n, rank, world, seed=1, repeats=reps)
        sampler.set_epoch(2)
        per_rank.append(list(sampler))
    everything = [index for items in per_rank for index, _ in items]
    counts = {i: everything.count(i) for i in set(everything)}
    assert len(everything) == math.ceil(n / world) * world  # the epoch keeps its length
    assert sorted(set(counts.values())) == [reps]  # each image of the epoch K times
    for index in counts:
        ranks = [r for r, items in enumerate(per_rank) if any(i == index for i, _ in items)]
        assert len(ranks) == min(reps, world)  # the copies sit on different ranks
    seeds = [seed for items in per_rank for _, seed in items]
    assert len(set(seeds)) == len(seeds)  # each copy augmented differently
    # resumed after 8 samples at another world size: the rest of the same order
    whole = TrainSampler(n, 0, 1, seed=1, repeats=reps)
    whole.set_epoch(2)
    resumed = []
    for rank in range(2):
        sampler = TrainSampler(n, rank, 2, seed=1, repeats=reps)
        sampler.set_epoch(2, consumed=8)
        resumed += list(sampler)
    assert sorted(resumed) == sorted(list(whole)[8:])


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    )


def test_lars_scales_each_layers_step_by_its_trust_ratio():
    """One LARS step on a small layer against the formula by hand: the gradient plus
    weight decay, times trust = 0.001 ||w|| / (||g|| + wd ||w||), then SGD."""
    layer = nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]]))
        layer.bias.zero_()
    cfg = TrainConfig(
        opt="lars",
        lr=0.1,
        momentum=0.9,
        weight_decay=0.01,
        bias_weight_decay=0.0,
    )
    optimizer = build_optimizer(ModelParts([layer]), cfg, 1)
    grad = torch.tensor([[0.2, 0.1, -0.3], [0.05, -0.4, 0.1]])
    layer.weight.grad, layer.bias.grad = grad.clone(), torch.tensor([0.3, -0.2])
    w = layer.weight.detach().clone()
    trust = 0.001 * w.norm() / (grad.norm() + 0.01 * w.norm() + 1e-8)
    optimizer.step()
    expected = w - 0.1 * (grad + 0.01 * w) * trust
    torch.testing.assert_close(layer.weight.detach(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(layer.bias.detach(), torch.tensor([-0.03, 0.02]))  # no decay: plain
    assert type(optimizer).__module__.startswith("timm.")


def test_lamb_comes_from_timm_with_adamws_defaults(tmp_path):
    cfg = resolve_train_args(
        build_parser().parse_args(["train", "--data", str(tmp_path), "--opt", "lamb"])
    )
    assert (cfg.rate(1), cfg.weight_decay) == (0.001, 0.05)  # at batch 16
    optimizer = build_optimizer(ModelParts([_tiny()]), cfg, 1)
    assert type(optimizer).__name__ == "Lamb" and type(optimizer).__module__.startswith("timm.")


def test_the_no_decay_groups_hold_exactly_the_norm_weights_and_the_biases():
    model = create_model("resnet18", 5)
    cfg = TrainConfig(weight_decay=1e-4, norm_weight_decay=0.0, bias_weight_decay=0.0)
    groups = {g["kind"]: g for g in param_groups(ModelParts([model]), cfg)}
    names = {id(p): n for n, p in model.named_parameters()}
    norm = {names[id(p)] for p in groups["norm"]["params"]}
    bias = {names[id(p)] for p in groups["bias"]["params"]}
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    bn = {
        f"{m}.{p}"
        for m, mod in model.named_modules()
        if isinstance(mod, nn.BatchNorm2d)
        for p in ("weight", "bias")
    }
    assert norm == bn and bias == {"fc.bias"}
    assert decay == set(names.values()) - bn - {"fc.bias"}
    assert (groups["norm"]["weight_decay"], groups["decay"]["weight_decay"]) == (0.0, 1e-4)
    order = optim_state.trainable_names(model, split=True)  # every strategy indexes alike
    assert order == [names[id(p)] for g in groups.values() for p in g["params"]]


def test_a_timm_model_trains_loads_weights_in_part_and_converts_to_syncbn(tmp_path):
    from paratrain.models.registry import list_models, load_weights
    from paratrain.parallel import partition, sync_batchnorm
    from paratrain.parallel.sync_batchnorm import SyncBatchNorm

    assert "timm/resnet18" in list_models(timm=True)
    model = create_model("timm/resnet18", 3)
    donor = create_model("timm/resnet18", 10).state_dict()  # another head
    report = load_weights(model, donor)
    assert {k for k, _ in report.skipped} == {"fc.weight", "fc.bias"} and report.loaded
    runtime = SimpleRuntime()
    synced = sync_batchnorm.apply(model, runtime)
    assert any(isinstance(m, SyncBatchNorm) for m in synced.modules())
    assert len(partition.trace(create_model("timm/resnet18", 3), "timm/resnet18").units) > 5
    weights = tmp_path / "donor.pt"
    torch.save(donor, weights)
    data = make_image_folder(tmp_path / "data", classes=3, per_class=6)
    summary = train(
        TrainConfig(
            data=str(data),
            model="timm/resnet18",
            weights=str(weights),
            image_size=16,
            batch_size=4,
            workers=0,
            epochs=1,
            output_dir=str(tmp_path / "runs"),
            name="t",
        )
    )
    assert summary["final"]["val_count"] == 3  # 20% of 6 images a class, 3 classes
    with pytest.raises(UserError, match="unknown model 'timm/resnet1'"):
        create_model("timm/resnet1", 3)


class SimpleRuntime:
    device = torch.device("cpu")


def test_each_shipped_recipe_holds_the_values_it_cites():
    assert set(shipped_recipes()) == {"torchvision-resnet50-v2", "flower-photos", "fine-tune"}
    tv = read_recipe("torchvision-resnet50-v2")
    # torchvision's published command: 8 GPUs x batch 128, --lr 0.5 (global), ...
    published = {
        "batch": 128,
        "gpus": 8,
        "lr": 0.5,
        "epochs": 600,
        "warmup": 5,
        "warmup_decay": 0.01,
        "wd": 0.00002,
        "norm_wd": 0.0,
        "smoothing": 0.1,
        "mixup": 0.2,
        "cutmix": 1.0,
        "erase": 0.1,
        "crop": 176,
        "resize": 232,
        "val_crop": 224,
        "ra_reps": 4,
        "ema_steps": 32,
        "ema_decay": 0.99998,
    }
    assert tv["model"] == "resnet50" and tv["opt"] == "sgd" and tv["momentum"] == 0.9
    assert tv["batch_size"] == published["batch"] and "lr" not in tv
    cfg = TrainConfig.from_dict(tv)
    assert cfg.rate(published["gpus"]) == pytest.approx(published["lr"])  # torchvision's 8 GPUs
    assert (tv["epochs"], tv["warmup_epochs"], tv["warmup_start"]) == (600, 5, 0.01)
    assert (tv["sched"], tv["lrf"]) == ("cosine", 0.0)
    assert (tv["weight_decay"], tv["norm_weight_decay"]) == (published["wd"], published["norm_wd"])
    assert (tv["label_smoothing"], tv["mixup"], tv["cutmix"]) == (0.1, 0.2, 1.0)
    assert (tv["auto_augment"], tv["random_erase"], tv["ra_reps"]) == ("trivialaugment", 0.1, 4)
    assert (tv["train_crop"], tv["val_resize"], tv["val_crop"]) == (176, 232, 224)
    # torchvision's EMA: every 32 steps, alpha = (1 - decay) x world x batch x steps / epochs
    alpha = min(1.0, (1 - published["ema_decay"]) * 8 * 128 * 32 / 600)
    assert tv["ema_decay"] == pytest.approx((1 - alpha) ** (1 / 32), abs=1e-6)
    flowers = read_recipe("flower-photos")  # the README's flower_photos command
    assert (flowers["model"], flowers["batch_size"], flowers["epochs"]) == ("resnet34", 16, 30)
    for name in shipped_recipes():  # every key is a setting
        assert TrainConfig.from_dict(read_recipe(name)).validate()
        assert (RECIPES / f"{name}.yaml").read_text().startswith("#")  # it says its source


def test_a_recipe_fills_what_flags_and_config_do_not_give(tmp_path):
    data = make_image_folder(tmp_path / "data", classes=2, per_class=4)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"epochs": 3}))
    argv = [
        "train",
        "--data",
        str(data),
        "--recipe",
        "torchvision-resnet50-v2",
        "--config",
        str(config),
        "--batch-size",
        "8",
    ]
    cfg = resolve_train_args(build_parser().parse_args(argv))
    assert (cfg.epochs, cfg.batch_size) == (3, 8)  # the file's and the flag's
    assert (cfg.model, cfg.auto_augment, cfg.ra_reps) == ("resnet50", "trivialaugment", 4)
    own = tmp_path / "mine.yaml"
    own.write_text("opt: adamw\nmixup: 0.3\n")
    cfg = resolve_train_args(
        build_parser().parse_args(["train", "--data", str(data), "--recipe", str(own)])
    )
    assert (cfg.opt, cfg.mixup, cfg.lr_base) == ("adamw", 0.3, 0.016)  # adamw's preset fills
    assert main(["train", "--data", str(data), "--recipe", "nope", "--dry-run"]) == 2


def test_validation_crop_and_resize_are_settable_and_the_cache_keeps_the_larger(tmp_path):
    cfg = TrainConfig(image_size=224, train_crop=176, val_resize=232)
    assert (cfg.train_size, cfg.eval_crop, cfg.eval_resize, cfg.stored_size) == (176, 224, 232, 232)
    assert TrainConfig(image_size=64, train_crop=128).stored_size == round(128 * 256 / 224)
    with pytest.raises(UserError, match="smaller than the validation crop"):
        TrainConfig(val_resize=100, val_crop=128).validate()
    transform = eval_transform(24, resize=40, interpolation="bicubic")
    assert transform.transforms[0].size == 40 and transform.transforms[1].size == (24, 24)
    data = make_image_folder(tmp_path / "data", classes=2, per_class=8)
    summary = train(
        TrainConfig(
            data=str(data),
            image_size=24,
            train_crop=16,
            val_resize=32,
            interpolation="bicubic",
            batch_size=4,
            workers=0,
            epochs=1,
            output_dir=str(tmp_path / "runs"),
            name="v",
        )
    )
    assert summary["final"]["val_count"] == 4


def test_recipes_lists_every_description_whole(capsys):
    """`paratrain recipes` printed each recipe's first line, cut mid-sentence."""
    from paratrain.cli import main

    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 3
    for line in lines:
        name, _, description = line.partition(": ")
        assert description.rstrip().endswith((".", ":", ")")), line  # a whole sentence
    fine = next(line for line in lines if line.startswith("fine-tune: "))
    assert "the backbone frozen for the first epoch" in fine and "Give the model" in fine
