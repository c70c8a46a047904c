#!/bin/bash
# Issue 57's GPU checks in one call (about 10 min on an H100/H200): the capture's replay parity (pytest -m gpu), then
# bench_gpu.py's rows against torch.compile, DDP and FSDP2 with MFU and the host's share, on the 303M GPT (TF32) and
# the 1.24B Llama-style model (bf16). Run from the repository root on a machine with one CUDA GPU:
#     bash benchmarks/gpu/issue57.sh 2>&1 | tee issue57.log
# A micscompile step captures at its third call: bench_gpu's first (peak-memory) call and --warmup 2 leave every
# timed step a replay. Each step has its own time limit, so one that hangs leaves the others their time.
export PYTHONPATH="$PWD/benchmarks/gpu:$PWD/benchmarks:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
step() { echo "=== $(date +%T) $*"; }
step machine
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
step "capture and replay against eager (pytest -m gpu)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_paths.py tests/test_host_sync.py \
    2>&1 | tail -8
step "bench_gpu.py, the 303M GPT (TF32), s = 1 and 4, with the step uncaptured beside it"
timeout 260 torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu.py --models gpt-350m --steps 8 --warmup 2 \
    --tf32 --no-graph 2>&1 | grep -v Warning | tail -16
step "bench_gpu.py, the 1.24B Llama-style model (bf16), s = 1, each system alone"
timeout 280 torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu.py --models llama-1b --micro-batches 1 \
    --steps 6 --warmup 2 --alone --no-graph 2>&1 | grep -v Warning | tail -12
step done
