"""Command line: parse, build the config, dispatch. No training logic lives here."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from paratrain.config import STRATEGIES
from paratrain.errors import UserError

S = argparse.SUPPRESS  # flags the user did not give stay absent, so presets can fill them


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _positive_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("data")
    data.add_argument(
        "--data",
        default=S,
        help="image folder: DIR/<class>/* or DIR/{train,val}/<class>/*; default: the embedded digits set",
    )
    data.add_argument(
        "--val-fraction",
        type=float,
        default=S,
        help="share of each class held out for validation (default 0.2)",
    )
    data.add_argument(
        "--split-seed", type=int, default=S, help="seed of the train/val split (default 0)"
    )
    data.add_argument(
        "--image-size",
        type=_positive_int,
        default=S,
        help="training crop size in pixels (default 224)",
    )
    data.add_argument(
        "--crop-scale-min",
        type=float,
        default=S,
        help="smallest area share of RandomResizedCrop (default 0.08)",
    )
    data.add_argument(
        "--hflip", type=float, default=S, help="horizontal flip probability (default 0.5)"
    )
    data.add_argument(
        "--workers",
        type=_positive_int,
        default=S,
        help="loader processes per rank (default: from the cores)",
    )
    data.add_argument(
        "--cache-dir",
        default=S,
        help="where the embedded data set is written (default ~/.cache/paratrain)",
    )
    data.add_argument(
        "--bad-images",
        choices=["error", "skip"],
        default=S,
        help="unreadable images: list them all and stop, or leave them out (default error)",
    )
    data.add_argument(
        "--cache",
        choices=["auto", "on", "off"],
        default=S,
        help="decode every image once into a memory-mapped uint8 cache (default auto: on "
        "when it fits --cache-max-gb)",
    )
    data.add_argument(
        "--cache-max-gb",
        type=float,
        default=S,
        help="memory budget of the decoded-image cache in auto mode (default 4)",
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        default=S,
        help="torchvision model name (default resnet18; see `paratrain models`)",
    )
    model.add_argument(
        "--weights", default=S, help="local state dict or paratrain checkpoint to start from"
    )
    model.add_argument(
        "--weights-strict",
        action="store_true",
        default=S,
        help="any key or shape mismatch in --weights is an error",
    )
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--epochs", type=_positive_int, default=S, help="(default 10)")
    opt.add_argument(
        "--batch-size",
        type=_positive_int,
        default=S,
        help="per process (default 16); global batch = this x world size",
    )
    opt.add_argument(
        "--lr", type=float, default=S, help="learning rate for one process (default 0.01)"
    )
    opt.add_argument(
        "--lr-scaling",
        choices=["linear", "none"],
        default=S,
        help="scale lr with world size (default linear)",
    )
    opt.add_argument(
        "--lrf", type=float, default=S, help="final lr as a fraction of lr (default 0.1)"
    )
    opt.add_argument("--momentum", type=float, default=S, help="SGD momentum (default 0.9)")
    opt.add_argument("--weight-decay", type=float, default=S, help="(default 0.005)")
    opt.add_argument(
        "--warmup-epochs", type=_positive_int, default=S, help="linear warm-up epochs (default 0)"
    )
    opt.add_argument("--seed", type=int, default=S, help="seed of weights and sampling (default 0)")
    recipe = p.add_argument_group("recipe")
    recipe.add_argument(
        "--opt",
        choices=["sgd", "adamw"],
        default=S,
        help="optimizer (default sgd); adamw defaults to lr 0.001, weight decay 0.05",
    )
    recipe.add_argument(
        "--label-smoothing", type=float, default=S, help="cross-entropy label smoothing (default 0)"
    )
    recipe.add_argument(
        "--ema-decay",
        type=float,
        default=S,
        help="keep an exponential moving average of the weights with this decay (e.g. 0.999); "
        "it is evaluated every epoch and saved beside the raw weights",
    )
    recipe.add_argument(
        "--mixup", type=float, default=S, help="MixUp Beta alpha, e.g. 0.2 (default 0: off)"
    )
    recipe.add_argument(
        "--cutmix", type=float, default=S, help="CutMix Beta alpha, e.g. 1.0 (default 0: off)"
    )
    recipe.add_argument(
        "--freeze-backbone",
        action="store_true",
        default=S,
        help="train only the classifier head (fc / classifier / head); use with --weights",
    )
    _add_speed_flags(p.add_argument_group("speed"))
    par = p.add_argument_group("parallelism")
    par.add_argument(
        "--nproc",
        type=_positive_int,
        default=S,
        help="processes to start on this machine (default 1)",
    )
    par.add_argument(
        "--strategy",
        choices=list(STRATEGIES),
        default=S,
        help="ddp: DistributedDataParallel, one process per device (default); dp: legacy "
        "DataParallel, one process over every visible GPU; fsdp: parameters, gradients and "
        "optimizer state sharded across processes (FSDP2); split: the model's stages on "
        "--devices in one process; pipeline: --stages processes per model, micro-batches "
        "pipelined (world size = stages x replicas)",
    )
    par.add_argument(
        "--devices",
        default=S,
        help="split: comma-separated devices, one stage each (cuda:0,cuda:1 or cpu,cpu)",
    )
    par.add_argument(
        "--stages", type=_positive_int, default=S, help="pipeline: stages per model (default 2)"
    )
    par.add_argument(
        "--microbatches",
        type=_positive_int,
        default=S,
        help="pipeline: micro-batches per batch (default 4; must divide --batch-size)",
    )
    par.add_argument(
        "--schedule", choices=["gpipe", "1f1b"], default=S, help="pipeline schedule (default 1f1b)"
    )
    par.add_argument(
        "--split-points",
        default=S,
        help="split, pipeline: comma-separated units where stages 2.. begin (e.g. "
        "layer3,layer4); default: balanced from measured time (see `paratrain plan`)",
    )
    par.add_argument(
        "--sync-bn",
        action="store_true",
        default=S,
        help="synchronise BatchNorm statistics across processes",
    )
    par.add_argument(
        "--backend", choices=["gloo", "nccl"], default=S, help="default: nccl on CUDA, gloo on CPU"
    )
    par.add_argument(
        "--device", default=S, help="cpu, cuda or cuda:N (default: cuda:LOCAL_RANK if present)"
    )
    par.add_argument(
        "--timeout", type=float, default=S, help="seconds a collective may wait (default 600)"
    )
    par.add_argument(
        "--max-restarts",
        type=_positive_int,
        default=S,
        help="with --nproc: restart all workers this often after a failure; they resume "
        "from the last checkpoint (default 0)",
    )
    par.add_argument(
        "--master-port",
        type=_positive_int,
        default=S,
        help="with --nproc: the rendezvous port (default: a free one)",
    )
    fail = p.add_argument_group("failures and checkpoints")
    fail.add_argument(
        "--keep",
        type=_positive_int,
        default=S,
        help="also keep the newest K epoch checkpoints (default 0)",
    )
    fail.add_argument(
        "--save-every-steps",
        type=_positive_int,
        default=S,
        help="also save last.pt every N steps (default 0: at the end of epochs only)",
    )
    fail.add_argument(
        "--deterministic",
        action="store_true",
        default=S,
        help="deterministic algorithms: a resumed run ends bit for bit like an uninterrupted one on CPU",
    )
    fail.add_argument(
        "--on-nonfinite",
        choices=["abort", "skip"],
        default=S,
        help="a NaN/inf loss on any rank: stop every rank, or skip the step on every rank "
        "(default abort)",
    )
    fail.add_argument(
        "--requeue",
        action="store_true",
        default=S,
        help="under SLURM: after saving on SIGUSR1/SIGTERM, requeue the job (scontrol requeue)",
    )
    fail.add_argument(
        "--preempt-grace",
        type=float,
        default=S,
        help="seconds a rank may take to reach a step boundary after SIGTERM/SIGUSR1 "
        "before it exits anyway (default 20)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--output-dir", default=S, help="parent of run directories (default runs)")
    out.add_argument("--name", default=S, help="run directory name (default: a timestamp)")
    out.add_argument(
        "--resume", default=S, help="checkpoint path, or 'auto' for the newest in the run directory"
    )
    out.add_argument(
        "--tensorboard",
        action="store_true",
        default=S,
        help="also write TensorBoard scalars to <run>/tensorboard (needs the tensorboard package)",
    )
    p.add_argument("--config", default=None, help="YAML file of config keys; flags given here win")


def _add_speed_flags(speed, training: bool = True) -> None:
    """Speed flags of `train`; `bench` takes the ones that change what a step costs."""
    speed.add_argument(
        "--precision",
        choices=["auto", "32", "bf16-mixed", "16-mixed"],
        default=S,
        help="auto (default): bf16 autocast where the device computes bf16 natively (CUDA "
        "with bf16, CPUs with AVX512-BF16/AMX), else fp32; 16-mixed: fp16 with a GradScaler, "
        "CUDA only",
    )
    if training:
        speed.add_argument(
            "--grad-accum",
            type=_positive_int,
            default=S,
            help="micro-batches per optimizer step (default 1); global batch and lr scaling "
            "count them",
        )
        speed.add_argument(
            "--clip-grad", type=float, default=S, help="clip the gradient norm to this value"
        )
    speed.add_argument(
        "--grad-compression",
        choices=["none", "fp16", "bf16", "powersgd"],
        default=S,
        help="compress gradients for communication with a DDP hook (default none)",
    )
    speed.add_argument(
        "--bucket-cap-mb", type=float, default=S, help="DDP gradient bucket size (default 25)"
    )
    speed.add_argument(
        "--memory-format",
        choices=["auto", "channels_last", "contiguous"],
        default=S,
        help="auto (default): channels_last for convolutional models",
    )
    speed.add_argument(
        "--compile",
        action="store_true",
        default=S,
        help="torch.compile the model (around DDP, so its graphs split at the gradient "
        "buckets); the first steps compile",
    )


def _add_step_flags(parser: argparse.ArgumentParser) -> None:
    """What a training step is made of: `bench` and `scale` time it."""
    parser.add_argument("--model", default=S, help="(default resnet18)")
    parser.add_argument("--image-size", type=_positive_int, default=S, help="(default 224)")
    parser.add_argument(
        "--batch-size", type=_positive_int, default=S, help="per process (default 16)"
    )
    parser.add_argument("--device", default=S)
    _add_speed_flags(parser, training=False)


def _add_scale_flags(sc: argparse.ArgumentParser) -> None:
    from paratrain.bench.costmodel import PRESETS

    _add_step_flags(sc)
    sc.add_argument(
        "--nproc-max", type=_positive_int, default=None,
        help="measure 1..N processes (default: the number of cores or CUDA devices)",
    )  # fmt: skip
    link = sc.add_mutually_exclusive_group()
    link.add_argument(
        "--link", choices=list(PRESETS), default=None,
        help="predict on this link (default: the one fitted here); between nodes when "
        "--gpus-per-node is given: " + "; ".join(v.describe() for v in PRESETS.values()),
    )  # fmt: skip
    link.add_argument("--bandwidth", type=float, default=None, help="GB/s, with --latency")
    sc.add_argument("--latency", type=float, default=None, help="microseconds, with --bandwidth")
    sc.add_argument(
        "--gpus-per-node", type=_positive_int, default=None,
        help="hierarchical all-reduce: this many devices per node on --intra-link",
    )  # fmt: skip
    sc.add_argument(
        "--intra-link",
        choices=list(PRESETS),
        default="nvlink4",
        help="the link inside a node (default nvlink4)",
    )
    sc.add_argument(
        "--epoch-images",
        type=_positive_int,
        default=10_000,
        help="images per epoch for the epoch times (default 10000)",
    )
    sc.add_argument("--max-n", type=_positive_int, default=1024, help="predict up to this N")
    sc.add_argument("--steps", type=_positive_int, default=10, help="timed steps (median)")
    sc.add_argument("--warmup", type=_positive_int, default=3)
    sc.add_argument(
        "--max-message-mb",
        type=float,
        default=256.0,
        help="largest all-reduce message timed (default 256)",
    )
    sc.add_argument(
        "--calibrate",
        default=None,
        metavar="CSV",
        help="fit your own epoch times (lines n,seconds) instead of measuring",
    )
    sc.add_argument("--out", default="scaling", help="report folder (default ./scaling)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="paratrain", description="Train image classifiers in parallel with PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train a classifier on an image folder")
    _add_train_flags(train)
    ev = sub.add_parser("eval", help="evaluate a checkpoint on the validation images")
    ev.add_argument("--checkpoint", required=True, help="a paratrain checkpoint (.pt)")
    ev.add_argument("--data", default=None, help="image folder (default: the checkpoint's)")
    ev.add_argument("--batch-size", type=_positive_int, default=64)
    ev.add_argument("--workers", type=_positive_int, default=None)
    ev.add_argument("--nproc", type=_positive_int, default=1)
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.add_argument("--ema", action="store_true", help="evaluate the EMA weights (--ema-decay)")
    pred = sub.add_parser("predict", help="class probabilities for images or folders of images")
    pred.add_argument("--checkpoint", required=True, help="a paratrain checkpoint (.pt)")
    pred.add_argument("inputs", nargs="+", help="image files and/or folders")
    pred.add_argument("--top-k", type=_positive_int, default=5)
    pred.add_argument("--batch-size", type=_positive_int, default=64)
    pred.add_argument("--csv", default=None, help="also write the predictions to this CSV file")
    pred.add_argument("--device", default="cpu")
    pred.add_argument("--ema", action="store_true", help="use the EMA weights (--ema-decay)")
    exp = sub.add_parser(
        "export", help="write a checkpoint as a torch.export program or as safetensors"
    )
    exp.add_argument("--checkpoint", required=True, help="a paratrain checkpoint (.pt)")
    exp.add_argument("--format", choices=["pt2", "safetensors"], default="pt2")
    exp.add_argument(
        "--out", default=None, help="output file (default <run>/export/model.<format>)"
    )
    exp.add_argument("--ema", action="store_true", help="export the EMA weights (--ema-decay)")
    runs = sub.add_parser("runs", help="a table of the runs in a folder")
    runs.add_argument("dir", nargs="?", default="runs", help="run folder (default runs)")
    runs.add_argument("--json", action="store_true", help="print the rows as JSON")
    sub.add_parser("models", help="list the model names --model accepts")
    b = sub.add_parser(
        "bench", help="training-step speed on synthetic data: images/s, time per phase"
    )
    _add_step_flags(b)
    b.add_argument("--nproc", type=_positive_int, default=S, help="(default 1)")
    b.add_argument("--steps", type=_positive_int, default=20, help="timed steps (median)")
    b.add_argument("--warmup", type=_positive_int, default=5)
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    # used by `paratrain scale` for the runs it launches
    b.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    b.add_argument("--sweep-bytes", type=_positive_int, default=0, help=argparse.SUPPRESS)
    _add_scale_flags(
        sub.add_parser(
            "scale",
            help="scaling report: measure 1..N processes, fit the link, predict larger clusters",
            description="Weak scaling measured at 1..N processes (images/s, speedup, "
            "efficiency), all-reduce latency and bandwidth fitted, and a ring all-reduce cost "
            "model that predicts N = 1 to 1024 on a link preset or given values. With "
            "--calibrate, your own epoch times are fitted instead and nothing is measured.",
        )
    )
    plan = sub.add_parser(
        "plan",
        help="memory per device for ddp, fsdp, pipeline and split; which fit, which to use",
        description="Estimates, per device, the memory of parameters, gradients, optimizer "
        "state and activations (fp32) for every strategy, from one profiled step at batch 2 "
        "scaled to --batch-size; says which fit --device-memory and recommends the fastest "
        "that fits.",
    )
    plan.add_argument("--model", default="resnet18")
    plan.add_argument("--image-size", type=_positive_int, default=224)
    plan.add_argument("--batch-size", type=_positive_int, default=16, help="per device")
    plan.add_argument("--device-memory", required=True, help="per device, e.g. 16GB or 80GiB")
    plan.add_argument("--devices", type=_positive_int, default=2, help="(default 2)")
    plan.add_argument("--opt", choices=["sgd", "adamw"], default="sgd")
    plan.add_argument("--microbatches", type=_positive_int, default=4, help="pipeline")
    plan.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b", help="pipeline")
    plan.add_argument("--classes", type=_positive_int, default=1000, help="(default 1000)")
    plan.add_argument("--json", action="store_true", help="print the estimate as JSON")
    _add_slurm_flags(
        sub.add_parser(
            "slurm",
            help="print an sbatch script that runs `paratrain train` on SLURM nodes",
            description="Print an sbatch script: srun starts one torchrun agent per node, "
            "c10d rendezvous on the first node, USR1 before the time limit saves and requeues. "
            "Every flag not listed here is passed to `paratrain train`.",
        )
    )
    check = sub.add_parser(
        "check", help="self-test: backends, collectives, SyncBatchNorm, bandwidth"
    )
    check.add_argument("--nproc", type=_positive_int, default=2)
    check.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    check.add_argument("--device", default=None)
    check.add_argument("--timeout", type=float, default=120.0)
    return parser


def _add_slurm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=_positive_int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=0, help="(default 0: CPU)")
    p.add_argument(
        "--procs-per-node",
        type=_positive_int,
        default=None,
        help="workers per node (default: one per GPU, 1 without GPUs)",
    )
    p.add_argument("--cpus-per-task", type=_positive_int, default=None)
    p.add_argument("--time", default=None, help="time limit, e.g. 24:00:00")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--job-name", default="paratrain")
    p.add_argument(
        "--port", type=_positive_int, default=29500, help="rendezvous port on the first node"
    )
    p.add_argument(
        "--max-restarts",
        type=_positive_int,
        default=3,
        help="torchrun restarts after a failure; workers resume from the last checkpoint",
    )
    p.add_argument("--python", default="python", help="the interpreter on the nodes")


def run() -> None:
    """The `paratrain` command and `python -m paratrain`: main(), then a prompt exit.

    By then every file is written and closed, so the process ends without Python's
    teardown, which takes 1.7 s once torch and torchvision are loaded (paid by every
    worker and by the launcher). A failed launched worker must end this way in any case:
    it leaves its process group open on purpose (its peers must not report a lost
    connection before it reports the cause), and tearing that down during shutdown can
    abort with "terminate called without an active exception"."""
    import logging

    try:
        code = main()
    except SystemExit as exc:  # argparse, or a launcher passing on its workers' code
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["slurm"]:
        return _slurm(argv[1:])
    args = build_parser().parse_args(argv)
    from paratrain.engine.preempt import Preempted

    try:
        return _dispatch(args, argv)
    except UserError as exc:
        if getattr(exc, "agreed", False) is False or os.environ.get("RANK", "0") == "0":
            _report(str(exc))  # an error every rank agreed on is told once, by rank 0
        return exc.exit_code
    except Preempted as exc:
        print(f"paratrain: {_where()}{exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("paratrain: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        from paratrain.distributed.launch import PEER_LOST, is_peer_loss

        if is_peer_loss(exc):  # a consequence of another rank's failure, not a cause
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(
                f"paratrain: error: {_where()}lost contact with another rank: {first}",
                file=sys.stderr,
            )
            return PEER_LOST
        # not the user's doing: keep the traceback, and say which rank it came from
        import traceback

        traceback.print_exc()
        print(f"paratrain: error: {_where()}{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _where() -> str:
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    return f"[rank {rank}] " if rank is not None and world not in (None, "1") else ""


def _report(message: str) -> None:
    print(f"paratrain: error: {_where()}{one_line(message)}", file=sys.stderr)


def one_line(message: str) -> str:
    """A UserError re-raised by a DataLoader worker carries the worker's traceback in its
    message; the user needs only the original message, its last line."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if len(lines) > 1 and "Original Traceback" in message:
        last = lines[-1]
        return last.split(": ", 1)[1] if last.startswith(("paratrain.", "UserError")) else last
    return lines[0] if lines else message


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "models":
        from paratrain.models.registry import list_models

        print("\n".join(list_models()))
        return 0
    if args.command == "eval":
        return _eval(args, argv)
    if args.command == "predict":
        return _predict(args)
    if args.command == "export":
        from paratrain.engine.export import export

        written = export(args.checkpoint, args.format, args.out, args.ema)
        print(f"wrote {written['export']} (classes in {written['class_indices']})")
        return 0
    if args.command == "runs":
        return _runs(args)
    if args.command == "bench":
        return _bench(args, argv)
    if args.command == "scale":
        return _scale(args)
    if args.command == "plan":
        from paratrain.api import plan

        result = plan(args.model, args.image_size, args.batch_size, args.device_memory,
                      args.devices, args.opt, args.microbatches, args.schedule, args.classes,
                      say=(lambda _text: None) if args.json else print)  # fmt: skip
        if args.json:
            print(json.dumps(result))
        return 0
    if args.command == "check":
        from paratrain.api import check

        return check(args.nproc, args.backend, args.device, args.timeout, argv)
    return _train(args, argv)


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    from paratrain.api import resolve, train
    from paratrain.config import TrainConfig

    values = vars(args).copy()
    values.pop("command")
    config_file = values.pop("config")
    if config_file:
        values = {**TrainConfig.from_yaml(config_file).to_dict(), **values}
    cfg, builtin = resolve(values)
    if builtin and not os.environ.get("RANK"):
        from paratrain.api import DIGITS_PRESET

        chosen = ", ".join(f"{k}={getattr(cfg, k)}" for k in DIGITS_PRESET)
        print(f"no --data: using the embedded digits set ({cfg.data}); chose {chosen}")
    train(cfg, argv)
    return 0


def _eval(args: argparse.Namespace, argv: list[str]) -> int:
    from paratrain.api import evaluate_checkpoint

    result = evaluate_checkpoint(
        args.checkpoint, args.data, args.batch_size, args.workers, args.nproc, argv, args.ema
    )
    if result is None or os.environ.get("RANK", "0") != "0":
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        top5 = f"  top5 {result['top5']:.2%}" if result["top5"] is not None else ""
        print(
            f"{result['count']} images on {result['world_size']} process(es): "
            f"loss {result['loss']:.4f}  top1 {result['top1']:.2%}{top5}"
        )
        width = max(len(name) for name in result["per_class"])
        for name, accuracy in result["per_class"].items():
            print(f"  {name.ljust(width)}  {accuracy:.2%}")
        print(
            f"per-class accuracy, confusion matrix and misclassified files in {result['report_dir']}"
        )
    return 0


def _predict(args: argparse.Namespace) -> int:
    from paratrain.engine.predict import predict, write_csv

    rows = predict(args.checkpoint, args.inputs, args.top_k, args.batch_size, args.device, args.ema)
    for row in rows:
        print(f"{row['path']}: " + ", ".join(f"{name} {p:.3f}" for name, p in row["top"]))
    if args.csv:
        write_csv(rows, args.csv)
    return 0


def _runs(args: argparse.Namespace) -> int:
    from paratrain.report.runs import collect, format_table

    rows = collect(args.dir)
    if args.json:
        print(json.dumps(rows))
    elif rows:
        print(format_table(rows))
    else:
        print(f"no runs in {args.dir}")
    return 0


def _slurm(argv: list[str]) -> int:
    """Flags of the script are ours; every other one goes to `paratrain train`, which
    checks them here already, so a typo fails now and not after hours in the queue."""
    from paratrain.distributed.slurm import SlurmJob, sbatch_script

    parser = _Parser(prog="paratrain slurm")
    _add_slurm_flags(parser)
    known, train_args = parser.parse_known_args(argv)
    train_parser = _Parser(prog="paratrain slurm")
    _add_train_flags(train_parser)
    train_parser.parse_args(train_args)
    try:
        print(sbatch_script(SlurmJob(**vars(known)), train_args), end="")
    except UserError as exc:
        _report(str(exc))
        return exc.exit_code
    return 0


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from dataclasses import asdict

    from paratrain.api import bench
    from paratrain.bench.step import format_result
    from paratrain.config import TrainConfig

    values = {
        k: v
        for k, v in vars(args).items()
        if k not in ("command", "steps", "warmup", "json", "result_file", "sweep_bytes")
    }
    config = TrainConfig.from_dict(values, source="arguments")
    result = bench(config, args.steps, args.warmup, argv, args.sweep_bytes, args.result_file)
    if result is not None and not args.result_file:
        print(json.dumps(asdict(result)) if args.json else format_result(result))
    return 0


def _scale(args: argparse.Namespace) -> int:
    from paratrain.api import scale
    from paratrain.bench.costmodel import PRESETS, Link
    from paratrain.bench.scale import ScaleOptions
    from paratrain.config import TrainConfig

    if (args.bandwidth is None) != (args.latency is None):
        raise UserError("--bandwidth and --latency go together (GB/s and microseconds)")
    if args.bandwidth is not None and not (args.bandwidth > 0 and args.latency >= 0):
        raise UserError(
            f"--bandwidth must be positive and --latency 0 or more, got "
            f"{args.bandwidth} and {args.latency}"
        )
    link = PRESETS[args.link] if args.link else None
    if args.bandwidth is not None:
        link = Link("given", args.bandwidth, args.latency)
    nproc_max = args.nproc_max
    if nproc_max is None:
        import torch

        from paratrain.bench.scale import available_cores

        nproc_max = torch.cuda.device_count() or available_cores()
    options = ScaleOptions(
        nproc_max=nproc_max, steps=args.steps, warmup=args.warmup,
        largest_message=max(4096, int(args.max_message_mb * 2**20)), link=link,
        gpus_per_node=args.gpus_per_node, intra_link=PRESETS[args.intra_link],
        epoch_images=args.epoch_images, max_n=args.max_n,
    )  # fmt: skip
    skip = (
        "command",
        "nproc_max",
        "link",
        "bandwidth",
        "latency",
        "gpus_per_node",
        "intra_link",
        "epoch_images",
        "max_n",
        "steps",
        "warmup",
        "max_message_mb",
        "calibrate",
        "out",
    )
    config = TrainConfig.from_dict(
        {k: v for k, v in vars(args).items() if k not in skip}, source="arguments"
    )
    scale(config, options, args.out, args.calibrate)
    return 0
