"""paratrain: train image classifiers in parallel with PyTorch."""

from paratrain.api import evaluate, train
from paratrain.config import TrainConfig, resolve_train
from paratrain.errors import UserError
from paratrain.version import __version__

__all__ = ["TrainConfig", "UserError", "__version__", "evaluate", "resolve_train", "train"]
