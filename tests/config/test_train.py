import pytest

from paratrain.config import TrainConfig
from paratrain.errors import UserError


def test_yaml_round_trip(tmp_path):
    cfg = TrainConfig(model="resnet34", batch_size=16, lr=0.02, data="/x")
    cfg.save(tmp_path / "c.yaml")
    assert TrainConfig.from_yaml(tmp_path / "c.yaml") == cfg


def test_unknown_key_and_wrong_type():
    with pytest.raises(UserError, match="unknown key"):
        TrainConfig.from_dict({"batchsize": 3})
    with pytest.raises(UserError, match="wrong type"):
        TrainConfig.from_dict({"batch_size": "16"})
    assert TrainConfig.from_dict({"lr": 1}).lr == 1.0


@pytest.mark.parametrize(
    "values, flag",
    [
        ({"nproc": 0}, "--nproc"),
        ({"batch_size": 0}, "--batch-size"),
        ({"epochs": 0}, "--epochs"),
        ({"val_fraction": 1.0}, "--val-fraction"),
        ({"lr": -1.0}, "--lr"),
    ],
)
def test_validation_names_the_flag(values, flag):
    with pytest.raises(UserError, match=flag):
        TrainConfig(**values).validate()
