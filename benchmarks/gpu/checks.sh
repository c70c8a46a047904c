#!/bin/bash
# The one-GPU checks of docs/gpu.md in one call (about 6 min on an H100): the GPU tests, what
# calibrate measures, and micscompile against eager PyTorch, DDP and FSDP2 (bench_gpu.py) on the
# small GPT and the 303M one, the latter at s=4 once more with each system alone in the process.
# Run from the repository root on a machine with one CUDA GPU:
#     bash benchmarks/gpu/checks.sh 2>&1 | tee gpu_checks.log
#     bash benchmarks/gpu/checks.sh cuda-graph 2>&1 | tee cuda-graph.log    # the CUDA-graph checks alone (about 10 min)
# Each step has its own time limit, so one that hangs leaves the others their time.
export PYTHONPATH="$PWD/benchmarks/gpu:$PWD/benchmarks:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
step() { echo "=== $(date +%T) $*"; }
step machine
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
if [ "${1:-}" = cuda-graph ]; then
    # the capture's replay parity, then bench_gpu's rows against torch.compile, DDP and FSDP2 with MFU and the host's
    # share, on the 303M GPT (TF32) and the 1.24B Llama-style model (bf16). A micscompile step captures at its third
    # call: bench_gpu's first (peak-memory) call and --warmup 2 leave every timed step a replay.
    step "capture and replay against eager (pytest -m gpu)"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_paths.py tests/test_host_sync.py \
        2>&1 | tail -8
    step "a kernel replayed in a CUDA graph against its dispatch (calibrate's graph_op_overhead_s, item 2)"
    timeout 60 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_cuda_paths.py -k replayed_kernel \
        2>&1 | grep -E "bare add|passed|failed"
    step "bench_gpu.py, the 303M GPT (TF32), s = 1 and 4, with the step uncaptured beside it"
    timeout 260 torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu.py --models gpt-350m --steps 8 \
        --warmup 2 --tf32 --no-graph 2>&1 | grep -v Warning | tail -16
    step "bench_gpu.py, the 1.24B Llama-style model (bf16), s = 1, each system alone"
    timeout 280 torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu.py --models llama-1b --micro-batches 1 \
        --steps 6 --warmup 2 --alone --no-graph 2>&1 | grep -v Warning | tail -12
    step done
    exit 0
fi
step "GPU tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_paths.py tests/test_target_device.py \
    tests/test_host_sync.py 2>&1 | tail -6
step "calibrate (one rank)"
timeout 90 python3 - <<'PY' 2>&1 | grep -v Warning
import datetime, os
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="29555")
from micscompile.core.launch import init_distributed
from micscompile.cost_model.calibrate import calibrate
init_distributed(timeout=datetime.timedelta(seconds=60))
calibrate(repeats=3, log=print)
PY
step "bench_gpu.py, the small GPT (host-bound)"
timeout 170 torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu.py --models small --steps 15 --inductor \
    2>&1 | grep -v Warning | tail -16
step "bench_gpu.py, the 303M GPT (TF32)"
timeout 230 torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu.py --models gpt-350m --steps 8 --warmup 2 \
    --tf32 --inductor 2>&1 | grep -v Warning | tail -14
step "bench_gpu.py, the 303M GPT at s=4, each system alone (is the spread between launches the others'?)"
timeout 200 torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu.py --models gpt-350m --micro-batches 4 \
    --steps 8 --warmup 2 --tf32 --inductor --alone 2>&1 | grep -v Warning | tail -9
step done
