"""TrainConfig's settings in sections, a dataclass each (data, model, optimization, schedule,
runtime, output); ``config/train.TrainConfig`` is all of them at once, so the flags, the
YAML keys and ``cfg.<setting>`` stay flat. A new setting goes in its section's module."""
