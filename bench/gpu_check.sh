#!/usr/bin/env bash
# One prepared GPU check, one command: `bash bench/gpu_check.sh` from anywhere in a checkout.
# It needs a CUDA GPU and PyTorch, nothing else: the tower benchmarks import no torchrec,
# fbgemm or data stack, so they run on a machine with stock torch and no package registry
# (the one this project can reach: H200, Python 3.12, torch 2.11, CUDA 13; about 5 minutes).
# Where the training stack imports too (after `make setup DEVICE=cuda`), `rankmix doctor` checks
# it first, and when the doctor passes it also trains end to end on CUDA: NCCL, fbgemm-gpu's
# fused Adagrad, bf16 autocast, TrainPipelineSparseDist.
# PYTHON=... picks the interpreter (default: .venv/bin/python if there is one, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
TOWER="$PY bench/tower.py --device cuda --bf16"
nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
STACK=no  # the training stack: "ok" once it imports and the doctor passes
if $PY -c "import trainer.train" 2>/dev/null; then  # torchrec, fbgemm-gpu, pyarrow, tomli-w, ...
    echo "== rankmix doctor: versions, one FBGEMM lookup per GPU, NCCL and gloo"
    if $PY -m launch.cli doctor; then STACK=ok; fi
else
    echo "== rankmix doctor: skipped, the training stack does not import here (stock torch only)"
fi

echo "== every tower, one bf16 training step (forward + backward), and the MoE's sparse inference"
$TOWER --repeats 10 --shapes 16,768,2,4,4096 --moe-inference
echo "== the RankMixer paper's 1B shape, T32 D1536 L2 k4 B4096 (target: MFU vs peak >= 50%)"
$TOWER --repeats 10 --towers rankmixer,rankmixer_moe --shapes 32,1536,2,4,4096
echo "== the same step under torch.compile"
$TOWER --repeats 10 --towers rankmixer --shapes 32,1536,2,4,4096 --compile
echo "== small steps, where launches dominate: eager, then replayed from CUDA graphs"
$TOWER --repeats 20 --towers rankmixer,rankmixer_moe,unimixer --shapes 8,64,2,4,4096
$TOWER --repeats 20 --towers rankmixer,rankmixer_moe,unimixer --shapes 8,64,2,4,4096 --cuda-graphs

if [ "$STACK" != ok ]; then
    echo "== training end to end: skipped, no training stack that passes rankmix doctor (make setup DEVICE=cuda)"
    exit 0
fi
RANKMIX="$PY -m launch.cli"
echo "== training on CUDA: 1 process, bf16 tower"
rm -rf runs/gpu-check runs/gpu-check-multi  # a rerun must train, not resume finished runs
$RANKMIX train --config configs/debug.toml --train.device=cuda --train.mixed_precision=bf16 \
    --train.steps=30 --train.run_dir=runs/gpu-check --metrics.progress=false | tail -n 1
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
    echo "== training on CUDA: $NGPU processes, NCCL"
    # 200k synthetic rows: enough row groups for every rank of an 8-GPU node
    $RANKMIX launch --nproc-per-node "$NGPU" --config configs/debug.toml --train.device=cuda \
        --data.synth_rows=200000 --train.steps=30 --train.run_dir=runs/gpu-check-multi \
        --metrics.progress=false | tail -n 1
fi
echo "== fp16 tables, row-wise Adagrad, table-row-wise and column-wise layouts, an async save, then a resume"
LAYOUT="--config configs/debug.toml --train.device=cuda --embeddings.data_type=fp16
    --embeddings.optimizer=rowwise_adagrad --embeddings.table_sharding.user_id=table_row_wise
    --embeddings.table_sharding.item=column_wise --checkpoint.async_save=true --checkpoint.interval=10
    --train.run_dir=runs/gpu-check-layouts --metrics.progress=false"
rm -rf runs/gpu-check-layouts
$RANKMIX launch --nproc-per-node "$NGPU" $LAYOUT --train.steps=20 | tail -n 1
$RANKMIX launch --nproc-per-node "$NGPU" $LAYOUT --train.steps=40 | tail -n 1  # resumes from step 20
grep -E "^(user_id|item) \|" runs/gpu-check-layouts/plan.txt
# Managed tables (TorchRec MCH, row-wise on every GPU): evictions every 10 steps reset the
# freed rows' optimizer state on the device; the export reads the CUDA checkpoint's id maps.
MANAGED="--config configs/synth.toml --train.device=cuda --data.synth_rows=200000 --train.steps=30
    --checkpoint.interval=10 --features.user_id.hashing=managed --features.user_id.num_embeddings=2000
    --features.user_id.eviction_interval=10 --train.run_dir=runs/gpu-check-managed --metrics.progress=false"
rm -rf runs/gpu-check-managed runs/gpu-check-managed-export
echo "== training on CUDA with managed tables: $NGPU process(es), then its serving artifact"
if [ "$NGPU" -ge 2 ]; then
    $RANKMIX launch --nproc-per-node "$NGPU" $MANAGED | tail -n 1
else
    $RANKMIX train $MANAGED | tail -n 1
fi
$RANKMIX export --checkpoint runs/gpu-check-managed --out runs/gpu-check-managed-export | tail -n 1
