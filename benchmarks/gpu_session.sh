#!/usr/bin/env bash
# The GPU checks of issue #13, in one command for a machine lent by the `device` tool (one GPU, 16 cores,
# torch preinstalled, no network): lockstep runs from src/ (no install). Everything lands in $OUT (or
# ./gpu_session_out): the CUDA tests' log, the world-size-1 NCCL step times (GPT-124M, ResNet-50, bf16),
# the 2 ranks x 4 threads gloo step times on the machine's CPU cores, and the steady-state peak of
# torch.cuda.max_memory_allocated of torch's DDP and lockstep in every gradient_as_bucket_view mode (issue #30).
# About 4-6 minutes; each step has its own timeout, 590 s in all (a device command may run 600).
#
#   bash benchmarks/gpu_session.sh [quick]     # quick: fewer blocks (a first look, ~3 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_session_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=python3
blocks=8 cpu_blocks=10
[ "${1:-}" = quick ] && blocks=3 cpu_blocks=4
{ nvidia-smi -L; $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"; nproc; } 2>&1 | tee "$out/machine.txt"
status=0
echo "== tests/test_cuda.py =="
timeout 170 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log" || status=1
echo "== lockstep launch (one rank per GPU) examples/wine.py: init picks NCCL and the device, the Trainer on CUDA, exit 0 =="
timeout 80 $py -m lockstep launch --nproc-per-node auto examples/wine.py --epochs 10 --out "$(mktemp -d)" 2>&1 | tee "$out/wine.log" || status=1
echo "== benchmarks/gpu_step.py: world size 1, NCCL, bf16 =="
timeout 150 $py benchmarks/gpu_step.py --blocks "$blocks" --out "$out" || status=1
echo "== benchmarks/ddp_step.py: 2 ranks x 4 threads, gloo on the CPU =="
timeout 100 $py benchmarks/ddp_step.py --threads 4 --blocks "$cpu_blocks" --block-steps 6 --out "$out" || status=1
echo "== benchmarks/memory.py --device cuda: peak GPU memory per rank, torch's DDP vs lockstep, every mode =="
timeout 90 $py benchmarks/memory.py --device cuda --out "$out" || status=1
exit $status
