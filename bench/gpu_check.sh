#!/usr/bin/env bash
# One prepared GPU check (docs/design.md §6; issue: distributed training): the CUDA path end to end
# (NCCL, fbgemm-gpu, fused Adagrad, bf16 autocast, TrainPipelineSparseDist), then the
# tower's bf16 MFU at the RankMixer paper's 100M and 1B shapes. Run from the repo root
# on a machine with a GPU; prints everything it measures.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup DEVICE=cuda
BIN=.venv/bin
nvidia-smi -L
echo "== training on CUDA: 1 process, bf16 tower"
rm -rf runs/gpu-check runs/gpu-check-multi  # a rerun must train, not resume finished runs
$BIN/rankmix train --config configs/debug.toml --train.device=cuda --train.mixed_precision=bf16 \
    --train.steps=30 --train.run_dir=runs/gpu-check --metrics.progress=false | tail -n 1
NGPU=$($BIN/python -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
    echo "== training on CUDA: $NGPU processes, NCCL"
    # 200k synthetic rows: enough row groups for every rank of an 8-GPU node
    $BIN/rankmix launch --nproc-per-node "$NGPU" --config configs/debug.toml --train.device=cuda \
        --data.synth_rows=200000 --train.steps=30 --train.run_dir=runs/gpu-check-multi \
        --metrics.progress=false | tail -n 1
fi
echo "== tower MFU, bf16 autocast, forward+backward"
$BIN/python bench/tower.py --device cuda --bf16 --repeats 20 \
    --shapes 16,768,2,4,4096 32,1536,2,4,4096
