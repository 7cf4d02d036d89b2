"""paratrain: train image classifiers in parallel with PyTorch."""

__version__ = "0.1.0"

from paratrain.api import evaluate, train  # noqa: E402
from paratrain.config import TrainConfig, resolve_train  # noqa: E402
from paratrain.errors import UserError  # noqa: E402

__all__ = ["TrainConfig", "UserError", "__version__", "evaluate", "resolve_train", "train"]
