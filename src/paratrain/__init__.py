"""paratrain: train image classifiers in parallel with PyTorch."""

from paratrain.api import evaluate_checkpoint, train
from paratrain.config import TrainConfig
from paratrain.errors import UserError

__all__ = ["TrainConfig", "UserError", "evaluate_checkpoint", "train"]
__version__ = "0.1.0"
