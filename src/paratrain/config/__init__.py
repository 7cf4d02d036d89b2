"""The settings schema: every option of every subcommand, declared once.

``train.py``: TrainConfig, a run's settings, and the presets; ``commands.py``: the other
subcommands' options; ``schema.py``: what turns a declaration into flags, checks,
messages and the docs' flag reference.
"""

from paratrain.config.commands import (
    BENCH_SETTINGS,
    LINK_PRESETS,
    PLAN_SETTINGS,
    STEP_SETTINGS,
    BenchOptions,
    CheckOptions,
    EvalOptions,
    ExportOptions,
    ModelsOptions,
    PlanOptions,
    PredictOptions,
    RecipesOptions,
    RunsOptions,
    ScaleOptions,
    SlurmOptions,
    TrainCommand,
)
from paratrain.config.schema import build, read_yaml, setting, settings, to_argv
from paratrain.config.train import (
    PRESETS,
    TrainConfig,
    preset_notes,
    resolve_train,
)

__all__ = [
    "BENCH_SETTINGS",
    "LINK_PRESETS",
    "PLAN_SETTINGS",
    "PRESETS",
    "STEP_SETTINGS",
    "BenchOptions",
    "CheckOptions",
    "EvalOptions",
    "ExportOptions",
    "ModelsOptions",
    "PlanOptions",
    "PredictOptions",
    "RecipesOptions",
    "RunsOptions",
    "ScaleOptions",
    "SlurmOptions",
    "TrainCommand",
    "TrainConfig",
    "build",
    "preset_notes",
    "read_yaml",
    "resolve_train",
    "setting",
    "settings",
    "to_argv",
]
