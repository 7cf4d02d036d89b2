"""The words and limits settings are checked against, and where the registries they read
from live (named as strings: config imports none of the packages above it)."""

from __future__ import annotations

OPTIMIZERS = ("sgd", "adamw", "lars", "lamb")
STRATEGIES = "paratrain.parallel:STRATEGIES"  # the registry of --strategy's names

DEVICE = r"cpu|cuda(:\d{1,3})?"
DEVICE_TEXT = "cpu, cuda or cuda:N"
RUN_NAME = r"[^/\\\0]+"  # one folder name: no separators
NAME_MAX = 255  # bytes in a file name (Linux's NAME_MAX)
MAX_IMAGE_SIZE = 4096
INTERPOLATIONS = ("bilinear", "bicubic")  # how images are resized
TIMM_PREFIX = "timm/"  # --model timm/<name>: a timm model
DURATION = r"(\d+(\.\d+)?[smh])+"  # 90s, 15m, 2h, 1h30m
TRACKERS = "paratrain.report.trackers:TRACKERS"  # the registry of --logger's names
SCORES = "paratrain.report.scores:SUMMARIES"  # the registry of --monitor's names
CACHE_MODES = "paratrain.data.cache:MODES"  # --cache's words: the cache kinds and more
NUMBERS3 = r"\s*[0-9.eE+-]+\s*,\s*[0-9.eE+-]+\s*,\s*[0-9.eE+-]+\s*"  # R,G,B
# what a named --weights brings (mean, std, sizes, interpolation): its registry's
# metadata, read by the models package (config never imports it)
WEIGHTS_PREPROCESSING = "paratrain.models.pretrained:preprocessing"
SMALL_IMAGES = "paratrain.data.sizes:suggested_settings"  # the size and crop small images suggest
SMALL_IMAGES_WHY = "paratrain.data.sizes:why"
LARGE_IMAGES = "paratrain.data.sizes:larger_cache"  # the cache side large originals suggest
LARGE_IMAGES_WHY = "paratrain.data.sizes:why_larger"
MAX_SECONDS = 30 * 24 * 3600  # a time limit longer than this is a mistake (and overflows)
