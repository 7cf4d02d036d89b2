"""The options of every subcommand besides a run's own settings (TrainConfig).

A subcommand that times or sizes a training step (bench, scale, plan) takes the step's
settings from TrainConfig by name (``*_SETTINGS``), so their defaults, bounds and help
are TrainConfig's; what only it has is declared here.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.schema import Options, setting
from paratrain.config.words import DEVICE, DEVICE_TEXT, MAX_SECONDS
from paratrain.errors import UserError

DRY_RUN = "check every option and print what would run, without running it"
SIZE = r"\s*[0-9]*\.?[0-9]+\s*([kKmMgGtT]?)(i?[bB])?\s*"

# What `paratrain scale --link NAME` means: bandwidth in GB/s per direction, latency per
# message in microseconds as a collective library sees it (software included), not the
# wire's. Real all-reduce reaches perhaps 70-90% of these bandwidths.
LINK_PRESETS: dict[str, tuple[float, float, str]] = {
    "nvlink4": (450.0, 3.0, "NVLink 4, H100 SXM: 900 GB/s both directions"),
    "pcie5": (64.0, 5.0, "PCIe 5.0 x16"),
    "pcie4": (32.0, 5.0, "PCIe 4.0 x16"),
    "ib-ndr": (50.0, 6.0, "InfiniBand NDR, 400 Gb/s"),
    "ib-hdr": (25.0, 6.0, "InfiniBand HDR, 200 Gb/s"),
    "100gbe": (12.5, 25.0, "100 Gb Ethernet, TCP"),
    "25gbe": (3.125, 30.0, "25 Gb Ethernet, TCP"),
    "10gbe": (1.25, 50.0, "10 Gb Ethernet, TCP"),
}

# the settings of a training step that bench and scale time
STEP_SETTINGS = (
    "model",
    "image_size",
    "batch_size",
    "device",
    "precision",
    "grad_compression",
    "bucket_cap_mb",
    "memory_format",
    "compile",
    "compile_scope",
    "activation_checkpointing",
)
BENCH_SETTINGS = (*STEP_SETTINGS, "nproc")
PLAN_SETTINGS = (
    "model",
    "teacher",
    "image_size",
    "batch_size",
    "opt",
    "momentum",
    "microbatches",
    "schedule",
    "precision",
    "activation_checkpointing",
)


def _checkpoint() -> str | None:
    return setting(
        None,
        "a paratrain checkpoint (a .pt file, or a sharded checkpoint's folder)",
        required=True,
        metavar="PATH",
    )


def _dry_run() -> bool:
    return setting(False, DRY_RUN)


@dataclass
class TrainCommand(Options):
    """`paratrain train`: what is not a setting of the run itself."""

    recipe: str | None = setting(
        None,
        "a recipe: a shipped one by name (see `paratrain recipes`) or a YAML file of "
        "settings; it fills what neither the flags nor --config give",
        metavar="NAME|FILE",
    )
    config: str | None = setting(
        None,
        "YAML file of settings (a run's config.yaml, say); flags given here win over it",
        path="file",
        metavar="FILE",
        short="-c",
    )
    dry_run: bool = _dry_run()
    print_config: bool = setting(
        False, "print the resolved settings as YAML (ready for --config) and stop"
    )


@dataclass
class EvalOptions(Options):
    checkpoint: str | None = _checkpoint()
    data: str | None = setting(
        None, "image folder", path="dir", metavar="DIR", default_text="the checkpoint's"
    )
    batch_size: int = setting(64, "images per batch and process", low=1)
    workers: int | None = setting(
        None, "loader processes per rank", low=0, high=64, default_text="from the cores"
    )
    nproc: int = setting(1, "processes to start on this machine", low=1, high=1024)
    device: str | None = setting(
        None,
        DEVICE_TEXT,
        pattern=DEVICE,
        pattern_text=DEVICE_TEXT,
        default_text="cuda:LOCAL_RANK where there is CUDA, else cpu",
    )
    ema: bool = setting(False, "evaluate the EMA weights (a run keeps them unless --ema-decay 0)")
    json: bool = setting(False, "print the result as JSON")
    dry_run: bool = _dry_run()


@dataclass
class PredictOptions(Options):
    checkpoint: str | None = setting(
        None,
        "a paratrain checkpoint (a .pt file, or a sharded checkpoint's folder), or a model "
        "`paratrain export` wrote (.pt2, .onnx)",
        required=True,
        metavar="PATH",
    )
    inputs: list = setting(
        [], "image files and/or folders", positional=True, nargs="+", metavar="INPUT"
    )
    top_k: int = setting(5, "classes listed per image", low=1)
    batch_size: int = setting(64, "images per batch", low=1)
    csv: str | None = setting(None, "also write the predictions to this CSV file", metavar="FILE")
    device: str = setting("cpu", DEVICE_TEXT, pattern=DEVICE, pattern_text=DEVICE_TEXT)
    ema: bool = setting(False, "use the EMA weights (a run keeps them unless --ema-decay 0)")
    dry_run: bool = _dry_run()


@dataclass
class ExportOptions(Options):
    checkpoint: str | None = _checkpoint()
    format: str = setting(
        "pt2",
        "a torch.export program (.pt2), onnx (needs paratrain[onnx]), safetensors, or pt: "
        "one checkpoint file (a sharded checkpoint consolidated: resumable, and usable as "
        "--weights)",
        choices=("pt2", "onnx", "safetensors", "pt"),
    )
    out: str | None = setting(
        None, "output file", metavar="FILE", default_text="<run>/export/model.<format>"
    )
    ema: bool = setting(False, "export the EMA weights (a run keeps them unless --ema-decay 0)")
    dry_run: bool = _dry_run()


@dataclass
class RunsOptions(Options):
    dir: str = setting("runs", "run folder", positional=True, nargs="?", path="dir")
    json: bool = setting(False, "print the rows as JSON")


@dataclass
class ModelsOptions(Options):
    timm: bool = setting(False, "list timm's models (timm/<name>) instead of torchvision's")
    filter: str | None = setting(
        None,
        "only the names that match: a pattern with * and ? (resnet*), else a part of the "
        "name (vit)",
        metavar="PATTERN",
    )


@dataclass
class RecipesOptions(Options):
    """`paratrain recipes` takes no options."""


@dataclass
class BenchOptions(Options):
    steps: int = setting(20, "timed steps (the median is reported)", low=1, high=100_000)
    warmup: int = setting(5, "untimed steps first", low=0, high=100_000)
    json: bool = setting(False, "print the result as JSON")
    dry_run: bool = _dry_run()
    # used by `paratrain scale` for the runs it launches
    result_file: str | None = setting(None, "write the result here as JSON", hidden=True)
    sweep_bytes: int = setting(0, "also time all-reduce up to this size", low=0, hidden=True)


@dataclass
class ScaleOptions(Options):
    nproc_max: int | None = setting(
        None,
        "measure 1..N processes",
        low=1,
        high=1024,
        default_text="the number of cores or CUDA devices",
    )
    link: str | None = setting(
        None,
        "predict on this link; between nodes when --gpus-per-node is given",
        choices=tuple(LINK_PRESETS),
        default_text="the one fitted here",
    )
    bandwidth: float | None = setting(
        None, "link bandwidth in GB/s, with --latency", low=0.0, low_open=True
    )
    latency: float | None = setting(None, "link latency in microseconds, with --bandwidth", low=0.0)
    gpus_per_node: int | None = setting(
        None,
        "hierarchical all-reduce: this many devices per node on --intra-link",
        low=1,
        high=1024,
    )
    intra_link: str = setting("nvlink4", "the link inside a node", choices=tuple(LINK_PRESETS))
    epoch_images: int = setting(10_000, "images per epoch for the epoch times", low=1)
    max_n: int = setting(1024, "predict up to this N", low=1, high=2**20)
    steps: int = setting(10, "timed steps (median)", low=1, high=100_000)
    warmup: int = setting(3, "untimed steps first", low=0, high=100_000)
    max_message_mb: float = setting(
        256.0, "largest all-reduce message timed, in MB", low=0.0, low_open=True, high=16384
    )
    calibrate: str | None = setting(
        None,
        "fit your own epoch times (lines n,seconds) instead of measuring",
        path="file",
        metavar="CSV",
    )
    out: str = setting("scaling", "report folder", metavar="DIR")
    dry_run: bool = _dry_run()

    def combinations(self) -> None:
        """--link names a preset, --bandwidth/--latency give one: not both, and those two together."""
        if (self.bandwidth is None) != (self.latency is None):
            raise UserError("--bandwidth and --latency go together (GB/s and microseconds)")
        if self.link is not None and self.bandwidth is not None:
            raise UserError("--link and --bandwidth/--latency are alternatives; give one")


@dataclass
class PlanOptions(Options):
    device_memory: str | None = setting(
        None,
        "memory of one device, e.g. 16GB or 80GiB",
        pattern=SIZE,
        metavar="SIZE",
        pattern_text="a size such as 16GB, 80GiB or 512MB",
        default_text="this machine's: a GPU's memory, or the available memory over --devices",
    )
    devices: int | None = setting(
        None,
        "devices to spread the model over",
        low=1,
        high=1024,
        default_text="this machine's GPUs, else 2",
    )
    classes: int = setting(1000, "outputs of the classifier head", low=1, high=1_000_000)
    json: bool = setting(False, "print the estimate as JSON")
    dry_run: bool = _dry_run()


@dataclass
class SlurmOptions(Options):
    nodes: int = setting(1, "nodes", low=1, high=100_000)
    gpus_per_node: int = setting(0, "GPUs per node (0: CPU)", low=0, high=1024)
    procs_per_node: int | None = setting(
        None, "workers per node", low=1, high=1024, default_text="one per GPU, 1 without GPUs"
    )
    cpus_per_task: int | None = setting(None, "CPUs of each node's task", low=1, high=100_000)
    time: str | None = setting(
        None,
        "time limit, e.g. 24:00:00 or 2-00:00:00",
        pattern=r"(\d+-)?\d+(:\d\d){0,2}",
        pattern_text="a SLURM time such as 90, 24:00:00 or 2-00:00:00",
    )
    partition: str | None = setting(
        None, "SLURM partition", pattern=r"[\w.,-]+", pattern_text="a partition name"
    )
    account: str | None = setting(
        None, "SLURM account", pattern=r"[\w.-]+", pattern_text="an account name"
    )
    job_name: str = setting(
        "paratrain",
        "job name",
        pattern=r"[\w.-]+",
        pattern_text="a job name of letters, digits, '.', '_' and '-'",
    )
    port: int = setting(29500, "rendezvous port on the first node", low=1, high=65535)
    max_restarts: int = setting(
        3,
        "torchrun restarts after a failure; workers resume from the last checkpoint",
        low=0,
        high=1000,
    )
    python: str = setting(
        "python",
        "the interpreter on the nodes",
        pattern=r"[^\s'\"]+",
        pattern_text="a command without spaces or quotes",
    )

    @property
    def per_node(self) -> int:
        """Workers per node: as asked, else one per GPU, else one."""
        return self.procs_per_node or self.gpus_per_node or 1


@dataclass
class CheckOptions(Options):
    nproc: int = setting(2, "processes to test", low=1, high=1024)
    backend: str | None = setting(
        None,
        "process-group backend",
        choices=("gloo", "nccl"),
        default_text="nccl on CUDA, gloo on CPU",
    )
    device: str | None = setting(
        None,
        DEVICE_TEXT,
        pattern=DEVICE,
        pattern_text=DEVICE_TEXT,
        default_text="cuda:LOCAL_RANK where there is CUDA",
    )
    timeout: float = setting(
        120.0, "seconds a collective may wait", low=0.0, low_open=True, high=MAX_SECONDS
    )
    dry_run: bool = _dry_run()
