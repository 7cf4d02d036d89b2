"""Where and how it runs: precision and speed, processes and the strategy, devices, failures and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from paratrain.config.schema import setting
from paratrain.config.words import DEVICE, DEVICE_TEXT, MAX_SECONDS, STRATEGIES


@dataclass(frozen=True)
class RuntimeSettings:
    precision: str = setting(
        "auto",
        "auto: bf16 autocast where the device computes bf16 "
        "natively (CUDA with bf16, CPUs with AVX512-BF16/AMX), else fp32; "
        "16-mixed: fp16 with a GradScaler, CUDA only",
        group="speed",
        choices=("auto", "32", "bf16-mixed", "16-mixed"),
    )
    grad_accum: int = setting(
        1,
        "micro-batches per optimizer step; the global batch and the lr scaling count them",
        group="speed",
        low=1,
    )
    clip_grad: float | None = setting(
        None, "clip the total gradient norm to this value", group="speed", low=0.0, low_open=True
    )
    grad_compression: str = setting(
        "none",
        "compress gradients for communication with a DDP hook (powersgd needs nccl)",
        group="speed",
        choices=("none", "fp16", "bf16", "powersgd"),
        resume="quiet",
    )
    bucket_cap_mb: float = setting(
        25.0,
        "DDP gradient bucket size in MB",
        group="speed",
        low=0.0,
        low_open=True,
        resume="quiet",
    )
    memory_format: str = setting(
        "auto",
        "auto: channels_last for convolutional models",
        group="speed",
        choices=("auto", "channels_last", "contiguous"),
        resume="quiet",
    )
    compile: bool = setting(
        False,
        "torch.compile the model; the first steps compile (see --compile-scope)",
        group="speed",
        resume="quiet",
    )
    compile_scope: str = setting(
        "model",
        "what --compile compiles: the whole model around DDP (its graphs split at the "
        "gradient buckets), or each repeated block in place (ResNet's residual blocks, "
        "ViT's encoder blocks), as torchtitan does; measured on a CPU, blocks compile "
        "no sooner and step slower (docs/gpu.md); not with --strategy dp",
        group="speed",
        choices=("model", "blocks"),
        resume="quiet",
    )
    activation_checkpointing: bool = setting(
        False,
        "keep only each repeated block's input for backward and recompute the rest there: "
        "less activation memory (a larger batch fits; see `paratrain plan`) for about a "
        "third more compute",
        group="speed",
        resume="quiet",
    )
    nproc: int | Literal["auto"] = setting(
        1,
        "processes to start on this machine; auto: one per GPU, or on a CPU the layout "
        "measured faster here",
        group="parallelism",
        low=1,
        auto=True,
        resume="quiet",
    )
    strategy: str = setting(
        "ddp",
        "how the model is spread over processes and devices; auto: the fastest that fits "
        "the device memory (see `paratrain plan`)",
        group="parallelism",
        choices_from=STRATEGIES,
        auto=True,
        resume="quiet",
    )
    devices: str | None = setting(
        None,
        "split: comma-separated devices, one stage each (cuda:0,cuda:1 or cpu,cpu)",
        group="parallelism",
        resume="quiet",
    )
    stages: int = setting(
        2, "pipeline: stages per model", group="parallelism", low=2, high=1024, resume="quiet"
    )
    microbatches: int = setting(
        4,
        "pipeline: micro-batches per batch (must divide --batch-size)",
        group="parallelism",
        low=1,
        resume="quiet",
    )
    schedule: str = setting(
        "1f1b",
        "pipeline schedule",
        group="parallelism",
        choices=("gpipe", "1f1b"),
        resume="quiet",
    )
    split_points: str | None = setting(
        None,
        "split, pipeline: comma-separated units where stages 2.. begin (e.g. layer3,layer4)",
        group="parallelism",
        default_text="balanced from measured time",
        resume="quiet",
    )
    sync_bn: bool = setting(
        False, "synchronise BatchNorm statistics across processes", group="parallelism"
    )
    backend: str | None = setting(
        None,
        "process-group backend",
        group="parallelism",
        choices=("gloo", "nccl"),
        default_text="nccl on CUDA, gloo on CPU",
        resume="quiet",
    )
    device: str | None = setting(
        None,
        "cpu, cuda or cuda:N",
        group="parallelism",
        pattern=DEVICE,
        pattern_text=DEVICE_TEXT,
        default_text="cuda:LOCAL_RANK where there is CUDA",
        resume="quiet",
    )
    timeout: float = setting(
        600.0,
        "seconds a collective may wait",
        group="parallelism",
        low=0.0,
        low_open=True,
        high=MAX_SECONDS,
        resume="quiet",
    )
    max_restarts: int = setting(
        0,
        "with --nproc: restart all workers this often after a "
        "failure; they resume from the last checkpoint",
        group="parallelism",
        low=0,
        high=1000,
        resume="quiet",
    )
    master_port: int | None = setting(
        None,
        "with --nproc: the rendezvous port",
        group="parallelism",
        low=1,
        high=65535,
        default_text="a free one",
        resume="quiet",
    )
    keep: int = setting(
        0, "also keep the newest K epoch checkpoints", group="checkpoints", low=0, resume="quiet"
    )
    save_every_steps: int = setting(
        0,
        "also save last.pt every N steps (0: at the end of epochs only)",
        group="checkpoints",
        low=0,
        resume="quiet",
    )
    async_save: bool = setting(
        False,
        "write --save-every-steps checkpoints in a background thread: training waits only "
        "for a copy of the state in host memory (pinned on CUDA), not for the disk; epoch "
        "ends and stop signals still save before going on (sharded checkpoints: through "
        "torch.distributed.checkpoint's async save)",
        group="checkpoints",
        resume="quiet",
    )
    deterministic: bool = setting(
        False,
        "deterministic algorithms: a resumed run ends bit for bit like an uninterrupted one on CPU",
        group="checkpoints",
    )
    on_nonfinite: str = setting(
        "abort",
        "a NaN/inf loss on any rank: stop every rank, or skip the step on every rank",
        group="checkpoints",
        choices=("abort", "skip"),
    )
    requeue: bool = setting(
        False,
        "under SLURM: after saving on SIGUSR1/SIGTERM, requeue the job (scontrol requeue)",
        group="checkpoints",
        resume="quiet",
    )
    preempt_grace: float = setting(
        20.0,
        "seconds a rank may take to reach a step boundary "
        "after SIGTERM/SIGUSR1 before it exits anyway",
        group="checkpoints",
        low=0.0,
        low_open=True,
        high=3600,
        resume="quiet",
    )
