"""The textbook DDP training script that paratrain is compared with (no paratrain code).

torchvision ImageFolder with PIL decoding, DistributedSampler (set_epoch every epoch),
DistributedDataParallel, SGD, fp32 (``--bf16``: autocast, as PyTorch's AMP examples do),
a DataLoader with workers (pinned memory on a GPU). Run it under torchrun:

    torchrun --standalone --nproc-per-node 2 benchmarks/plain_ddp.py DATA --epochs 2
    python benchmarks/plain_ddp.py DATA --device cuda --bf16 --image-size 224 \
        --batch-size 256 --workers 12 --model resnet50

DATA holds train/<class>/* and val/<class>/*. Rank 0 prints one JSON line: training
images per second (training time only, every rank's images), validation top-1, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms as T


def accuracy(model, loader, distributed: bool, device: torch.device, bf16: bool) -> float:
    """Validation top-1 (a DistributedSampler pads the last shard, as the textbook does)."""
    model.eval()
    correct = torch.zeros(2, device=device)
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device)
            hits = (model(images).argmax(1) == labels).sum()
            correct += torch.stack(
                [hits.float(), torch.tensor(float(labels.numel()), device=device)]
            )
    if distributed:
        dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1]).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="initial weights and shuffling")
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda (each rank its LOCAL_RANK's GPU)"
    )
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument(
        "--eval-every-epoch",
        action="store_true",
        help="evaluate after every epoch and print a JSON line with its time.time()",
    )
    parser.add_argument(
        "--first-step",
        action="store_true",
        help='print {"first_step": time.time()} after the first optimizer step',
    )
    args = parser.parse_args()

    distributed = "RANK" in os.environ
    cuda = args.device.startswith("cuda")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    normalize = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_set = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose(
            [
                T.RandomResizedCrop(args.image_size),
                T.RandomHorizontalFlip(),
                T.ToTensor(),
                normalize,
            ]
        ),
    )
    val_set = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose(
            [
                T.Resize(args.image_size * 256 // 224),
                T.CenterCrop(args.image_size),
                T.ToTensor(),
                normalize,
            ]
        ),
    )
    sampler = DistributedSampler(train_set, seed=args.seed) if distributed else None
    train_loader = DataLoader(
        train_set,
        args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=cuda,
    )
    val_sampler = DistributedSampler(val_set, shuffle=False) if distributed else None
    val_loader = DataLoader(
        val_set, args.batch_size, sampler=val_sampler, num_workers=args.workers, pin_memory=cuda
    )

    torch.manual_seed(args.seed)
    model = torchvision.models.get_model(args.model, num_classes=len(train_set.classes))
    model = model.to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if cuda else None)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr * world, momentum=0.9, weight_decay=0.005
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    criterion = nn.CrossEntropyLoss()

    train_seconds, seen = 0.0, 0
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        start = time.perf_counter()
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device.type, torch.bfloat16, enabled=args.bf16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.first_step and seen == 0 and rank == 0:
                print(json.dumps({"first_step": time.time()}), flush=True)
            seen += labels.numel()
        if cuda:
            torch.cuda.synchronize(device)
        train_seconds += time.perf_counter() - start
        scheduler.step()
        if args.eval_every_epoch:
            top1 = accuracy(model, val_loader, distributed, device, args.bf16)
            if rank == 0:
                print(json.dumps({"epoch": epoch + 1, "val_top1": top1, "time": time.time()}))
                sys.stdout.flush()

    top1 = accuracy(model, val_loader, distributed, device, args.bf16)
    if distributed:
        totals = torch.tensor([float(seen), train_seconds], device=device)
        dist.all_reduce(totals)  # images summed; seconds summed, averaged below
        seen, train_seconds = totals[0].item(), totals[1].item() / world
    if rank == 0:
        print(
            json.dumps(
                {
                    "images_per_s": seen / train_seconds,
                    "val_top1": top1,
                    "train_seconds": train_seconds,
                }
            )
        )
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
