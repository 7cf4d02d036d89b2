import pytest
import torch
import torchvision

from paratrain.errors import UserError
from paratrain.models.registry import create_model, list_models, load_weights, read_state_dict


def test_models_list_holds_the_classics():
    names = list_models()
    for name in (
        "resnet18",
        "resnet34",
        "resnet50",
        "mobilenet_v3_small",
        "efficientnet_b0",
        "convnext_tiny",
        "vit_b_16",
    ):
        assert name in names


def test_create_model_sets_classes_and_rejects_unknown():
    model = create_model("resnet18", num_classes=5)
    assert model.fc.out_features == 5
    with pytest.raises(UserError, match="unknown model 'resnet17'"):
        create_model("resnet17", 5)


def test_vit_takes_the_image_size():
    model = create_model("vit_b_16", num_classes=3, image_size=32)
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 3)


def test_partial_load_skips_the_1000_class_head(tmp_path):
    torch.manual_seed(1)
    source = torchvision.models.resnet18(num_classes=1000)
    path = tmp_path / "resnet18-imagenet.pth"
    torch.save(source.state_dict(), path)
    model = create_model("resnet18", num_classes=5)
    report = load_weights(model, read_state_dict(path))
    assert {key for key, _ in report.skipped} == {"fc.weight", "fc.bias"}
    assert set(report.missing) == {"fc.weight", "fc.bias"}
    assert len(report.loaded) == len(source.state_dict()) - 2
    assert torch.equal(model.conv1.weight, source.conv1.weight)
    assert "skipped fc.weight: shape (1000, 512) in file, (5, 512) in model" in report.summary(
        str(path)
    )
    with pytest.raises(UserError, match="--weights-strict"):
        load_weights(create_model("resnet18", 5), read_state_dict(path), strict=True)


def test_wrapper_prefixes_and_checkpoints_are_understood(tmp_path):
    source = create_model("resnet18", num_classes=4)
    wrapped = {f"module._orig_mod.{k}": v for k, v in source.state_dict().items()}
    torch.save({"model": wrapped, "epoch": 3}, tmp_path / "ckpt.pt")
    model = create_model("resnet18", num_classes=4)
    report = load_weights(model, read_state_dict(tmp_path / "ckpt.pt"), strict=True)
    assert report.exact and not report.skipped
    assert torch.equal(model.fc.weight, source.fc.weight)


@pytest.mark.parametrize("content", [b"not a pickle at all", b""])
def test_garbage_file_is_a_user_error(tmp_path, content):
    path = tmp_path / "bad.pth"
    path.write_bytes(content)
    with pytest.raises(UserError, match="could not be read as a state dict"):
        read_state_dict(path)


def test_pickle_that_is_not_a_state_dict(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(UserError, match="does not hold a state dict"):
        read_state_dict(tmp_path / "list.pt")
    with pytest.raises(UserError, match="not found"):
        read_state_dict(tmp_path / "absent.pt")


@pytest.mark.parametrize(
    ("name", "last", "blocks"), [("resnet18", "bn2", 8), ("resnet50", "bn3", 16)]
)
def test_zero_init_residual_starts_every_block_as_its_shortcut(name, last, blocks):
    from paratrain.config import TrainConfig
    from paratrain.models.registry import build_model

    model = build_model(TrainConfig(model=name, zero_init_residual=True), 3)
    zeroed = [n for n, p in model.named_parameters() if n.endswith(f"{last}.weight")]
    assert len(zeroed) == blocks
    assert all(not model.get_parameter(n).any() for n in zeroed)
    plain = build_model(TrainConfig(model=name), 3)
    assert all(plain.get_parameter(n).all() for n in zeroed)  # ones as built
    # the rest as without it: the same seed, the same weights
    others = {n for n, _ in model.named_parameters()} - set(zeroed)
    assert all(torch.equal(model.get_parameter(n), plain.get_parameter(n)) for n in others)


def test_zero_init_residual_on_a_model_without_known_blocks_is_a_user_error():
    from paratrain.config import TrainConfig
    from paratrain.models.registry import build_model

    with pytest.raises(UserError, match="--zero-init-residual: mobilenet_v3_small has no"):
        build_model(TrainConfig(model="mobilenet_v3_small", zero_init_residual=True), 3)


def test_zero_init_residual_reaches_timms_blocks():
    """timm's blocks zero themselves through their zero_init_last (timm's own ResNets
    already start so: the weights are set to ones first)."""
    from paratrain.models.registry import create_model, zero_init_residual

    model = create_model("timm/resnet10t", 3)
    last = [m.bn2.weight for m in model.modules() if hasattr(m, "zero_init_last")]
    with torch.no_grad():
        for weight in last:
            weight.fill_(1.0)
    assert zero_init_residual(model, "timm/resnet10t") == 4
    assert len(last) == 4 and all(not w.any() for w in last)


def test_a_size_is_tried_once_a_process_and_a_refusal_still_says_why(monkeypatch):
    """The launcher's checks and a worker's setup ask whether the model takes a size
    alike: the model is built and run once a size, and the answer (a refusal too) is
    the same each time."""
    from paratrain.models import registry

    built = []
    real = registry.create_model
    monkeypatch.setattr(
        registry, "create_model", lambda name, *a: built.append(name) or real(name, *a)
    )
    registry.runs_at.cache_clear()
    for _ in range(2):
        registry.check_input_size("resnet18", 24, norm_batch=4)
        with pytest.raises(UserError, match="cannot run on 4px images"):
            registry.check_input_size("alexnet", 4)
    tries = [name for name in built if name == "resnet18"]
    assert tries == ["resnet18"], built
    assert built.count("alexnet") > 1  # the refusal's answer, then the smallest size's search
    before = len(built)
    with pytest.raises(UserError, match="cannot run on 4px images"):
        registry.check_input_size("alexnet", 4)
    assert len(built) == before  # every size it tried: kept
