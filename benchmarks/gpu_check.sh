#!/usr/bin/env bash
# The GPU checks in one run on one GPU, sized for 8 minutes on an H200; prints one table.
#
#   bash benchmarks/gpu_check.sh            (after the README's install command)
#
# 1. the GPU tests (tests/gpu); 2. short CUDA training runs from a generated folder:
# bf16 channels_last, the same with --compile, 16-mixed, then a resume; 3. `paratrain
# bench` ResNet-50 at 224 px, batch 256: images/s and peak memory; 4. training ResNet-50
# from the decoded cache, end to end, as a ratio of that bench (augmented by the loader,
# then by the GPU); 5. two processes sharing
# the GPU through gloo; 6. what one GPU cannot show; 7. the comparison users make: on a
# generated set of 20,000 images, benchmarks/plain_ddp.py (torchvision's DataLoader and
# PIL, bf16 autocast, 224 px) against paratrain's defaults, end-to-end images/s and the
# seconds each takes to the plain loop's final accuracy, then each data path's images/s
# (benchmarks/augment_where.py), DALI's where installed. `gpu_check.sh levers` runs,
# instead, the step's levers (compile scopes, CUDA graphs, activation checkpointing).
# Logs and the table go to $OUT (or a temporary folder).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${OUT:-$(mktemp -d)}
work=$(mktemp -d)
export PARATRAIN_CACHE="$work/cache" PARATRAIN_NO_BAR=1 PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
table="$out/gpu_check.txt"
: > "$table"
row() { printf '%-44s %-5s %s\n' "$1" "$2" "$3" | tee -a "$table"; }
verdict() { [ "$1" = 0 ] && echo ok || echo FAIL; }
metric() { # metric RUN KEY: the last epoch's KEY from the run's metrics.jsonl
  "$python" -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][-1]; print(r[sys.argv[2]])" \
    "$work/runs/$1/metrics.jsonl" "$2" 2>/dev/null || echo "?"
}

# not installed: run from the checkout (an offline machine cannot fetch the build backend)
"$python" -c "import paratrain" 2>/dev/null || export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
gpu=$("$python" -c "import torch; p=torch.cuda.get_device_properties(0); print(f'{p.name}, {p.total_memory/2**30:.0f} GiB, torch {torch.__version__}')")
row "device" "" "$gpu"

if [ "${1:-}" = levers ]; then
  # 8. (a second run, to stay within 10 minutes a run) the step's levers on this GPU:
  # compile scope (eager / whole model / blocks / CUDA graphs), start-up included, and
  # activation checkpointing's peak memory; ResNet-50 and ViT-B/16 at 224 px, bf16
  timeout 400 "$python" benchmarks/step_levers.py compile --device cuda --bf16 \
    --models resnet50 vit_b_16 --image-size 224 --batch 128 --steps 10 > "$out/levers.log" 2>&1
  row "compile scopes (benchmarks/step_levers.py)" "$(verdict $?)" "see levers.log"
  timeout 160 "$python" benchmarks/step_levers.py memory --device cuda --bf16 \
    --models resnet50 vit_b_16 --image-size 224 --batch 128 --steps 5 >> "$out/levers.log" 2>&1
  row "activation checkpointing memory" "$(verdict $?)" "see levers.log"
  cat "$out/levers.log"
  exit 0
fi

# 1. the GPU tests
timeout 240 "$python" -m pytest -q tests/gpu -p no:cacheprovider > "$out/tests.log" 2>&1
code=$?
row "tests/gpu" "$(verdict $code)" "$(tail -n 1 "$out/tests.log")"

# a generated folder: 5 classes of 400x300 JPEGs (80/20 train/val)
"$python" - "$work/data" 6000 <<'EOF'
import sys
from pathlib import Path
from concurrent.futures import ProcessPoolExecutor
sys.path.insert(0, "benchmarks")
from vs_plain_loop import make_folder
root, count = Path(sys.argv[1]), int(sys.argv[2])
with ProcessPoolExecutor() as pool:  # each worker writes its own slice of the images
    list(pool.map(make_folder, [root] * 8, [count] * 8, range(8), [8] * 8))
EOF

train() { # train NAME FLAGS...: one run, its exit code, its log
  local name=$1; shift
  (cd "$work" && timeout 300 "$python" -m paratrain train --data "$work/data" --name "$name" "$@") \
    > "$out/train-$name.log" 2>&1
}

# 2. short CUDA training runs, then a resume
small=(--model resnet18 --image-size 64 --batch-size 128 --workers 4)
train bf16 "${small[@]}" --epochs 1 --precision bf16-mixed --memory-format channels_last
row "train bf16, channels_last" "$(verdict $?)" "top1 $(metric bf16 val_top1), $(metric bf16 train_images_per_s) img/s"
train compiled "${small[@]}" --epochs 1 --precision bf16-mixed --compile
row "train bf16 + --compile" "$(verdict $?)" "top1 $(metric compiled val_top1), $(metric compiled train_images_per_s) img/s (compiling included)"
train fp16 "${small[@]}" --epochs 1 --precision 16-mixed
row "train 16-mixed (GradScaler)" "$(verdict $?)" "top1 $(metric fp16 val_top1), $(metric fp16 train_images_per_s) img/s"
train fp16 "${small[@]}" --epochs 2 --precision 16-mixed --resume auto
code=$?
grep -q "resumed from" "$out/train-fp16.log" || code=1
row "resume 16-mixed to epoch 2" "$(verdict $code)" "epoch $(metric fp16 epoch), top1 $(metric fp16 val_top1)"

# 3. bench: ResNet-50 at 224 px, batch 256, bf16 channels_last
(cd "$work" && timeout 300 "$python" -m paratrain bench --model resnet50 --image-size 224 \
  --batch-size 256 --precision bf16-mixed --memory-format channels_last --steps 30 --warmup 10 \
  --json) > "$out/bench.json" 2> "$out/bench.log"
code=$?
bench=$("$python" -c "import json,sys; print(round(json.loads(open(sys.argv[1]).read().splitlines()[-1])['images_per_s']))" "$out/bench.json" 2>/dev/null || echo 0)
peak=$("$python" -c "import json,sys; print(round(json.loads(open(sys.argv[1]).read().splitlines()[-1])['peak_memory_mb']))" "$out/bench.json" 2>/dev/null || echo "?")
row "bench resnet50 224px b256 bf16 (target 3000)" "$(verdict $code)" "$bench img/s, peak $peak MiB"

# 4. end to end from the decoded cache (the last of 3 epochs), against the bench: the
# loader augmenting (auto's choice from the cache), then the GPU (--augment-on device)
for where in auto device; do
  train "e2e-$where" --model resnet50 --image-size 224 --batch-size 256 --epochs 3 --workers 12 \
    --precision bf16-mixed --memory-format channels_last --cache on --augment-on "$where"
  code=$?
  e2e=$(metric "e2e-$where" train_images_per_s)
  ratio=$("$python" -c "import sys; print(f'{float(sys.argv[1]) / max(float(sys.argv[2]), 1):.2f}')" "$e2e" "$bench" 2>/dev/null || echo "?")
  row "train resnet50 from the cache, augment $where" "$(verdict $code)" "${e2e%.*} img/s = ${ratio}x bench (target 0.9x)"
done

# 5. two processes sharing the one GPU (gloo; NCCL refuses two ranks on one GPU)
train shared "${small[@]}" --epochs 1 --nproc 2 --device cuda:0 --backend gloo
row "2 processes on 1 GPU through gloo" "$(verdict $?)" "top1 $(metric shared val_top1), world $(metric shared world_size)"

# 6. what one GPU cannot show
count=$("$python" -c "import torch; print(torch.cuda.device_count())")
if [ "$count" -lt 2 ]; then
  row "NCCL with 2 ranks (ddp, SyncBN, fsdp, pipeline)" "n/a" "needs 2 GPUs; in tests/gpu, skipped here"
  row "split over cuda:0,cuda:1; dp over 2 GPUs" "n/a" "needs 2 GPUs (split over cuda:0,cuda:0 is tested)"
fi
# 7. paratrain against the plain loop, on 20,000 images (16,000 to train), ResNet-50 at
# 224 px, batch 256, 3 epochs, bf16, 12 loader processes each; both evaluate every epoch
"$python" - "$work/big" 20000 <<'EOF'
import sys
from pathlib import Path
from concurrent.futures import ProcessPoolExecutor
sys.path.insert(0, "benchmarks")
from vs_plain_loop import make_folder
root, count = Path(sys.argv[1]), int(sys.argv[2])
with ProcessPoolExecutor() as pool:
    list(pool.map(make_folder, [root] * 16, [count] * 16, range(16), [16] * 16))
EOF
start=$("$python" -c "import time; print(time.time())")
timeout 420 "$python" benchmarks/plain_ddp.py "$work/big" --device cuda --bf16 --model resnet50 \
  --image-size 224 --batch-size 256 --workers 12 --epochs 3 --eval-every-epoch > "$out/plain.log" 2>&1
code=$?
"$python" benchmarks/versus_plain.py plain "$out/plain.log" "$start" > "$out/plain.txt" 2>&1 || code=1
read -r plain target reached < "$out/plain.txt"
row "plain loop: resnet50 224px bf16, 20k images" "$(verdict $code)" "$plain img/s; final top1 $target at ${reached}s"
train big --model resnet50 --image-size 224 --batch-size 256 --epochs 3 --workers 12 \
  --precision bf16-mixed --data "$work/big"
code=$?
read -r ours ratio sooner < <("$python" benchmarks/versus_plain.py ours \
  "$work/runs/big/metrics.jsonl" "$plain" "$target" 2>/dev/null || echo "? ? ?")
row "paratrain defaults, same run (target 2x)" "$(verdict $code)" "$ours img/s = ${ratio}x the plain loop; its top1 at ${sooner}s"
timeout 120 "$python" benchmarks/augment_where.py --device cuda --image-size 224 --batch 256 \
  --images 2000 > "$out/augment_where.log" 2>&1
row "data paths at batch 256 (loader/batched/per-image)" "$(verdict $?)" "$(tail -n 2 "$out/augment_where.log" | head -n 1 | tr -s ' ')"
row "DALI at batch 256 (--loader dali)" "" "$(tail -n 1 "$out/augment_where.log" | tr -s ' ')"

echo
echo "table: $table; logs in $out"
