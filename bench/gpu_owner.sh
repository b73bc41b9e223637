#!/usr/bin/env bash
# The one command a GPU owner runs, from the repository root, after installing a CUDA build of
# torch >= 2.11 and then `pip install -e '.[gpu,test]'`:
#
#   bash bench/gpu_owner.sh
#
# 1. Checks the machine: every test marked `cuda` (pinned memory and non-blocking copies, one
#    device sync per optimizer step, GPU data generation against CPU, the recipe matrix on CUDA,
#    NCCL at world size 2 when there are two GPUs). A failing check stops the script.
# 2. Produces the GPU figures still owed: the 2D flows' solvers on the GPU against the CPU
#    (`bench.solver_time`, configs/reduced/{dr2d,swe2d,ns2d}.yaml), `bench.epoch_time` on configs/bench_burgers.yaml, then
#    `bench.accuracy` on the full Burgers config (PDEBench size: hours on one H100; set
#    SKIP_ACCURACY=1 to stop after the epoch time).
# 3. With RUN_TRANSFER=1, issue 50's transfer at the issue's sizes (`bench.transfer`, N = 8 to 512,
#    3 seeds, the five-PDE mixture of configs/universal/pretrain.yaml): the Kolmogorov flow, then
#    diffusion-reaction, held out; each about 28 pretraining runs' worth of training (days of the
#    2-core CPU, whose reduced cases are in docs/benchmarks.md).
#
# Everything lands in bench/results/ under <device>-<date>-*: nvidia-smi's report, the check log,
# and the JSON / Markdown / plots the benchmarks write there.
set -euo pipefail
cd "$(dirname "$0")/.."

python - <<'EOF'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"bench/gpu_owner.sh needs a CUDA GPU, and torch {torch.__version__} sees none "
             "(install a CUDA build of torch >= 2.11, then pip install -e '.[gpu,test]')")
EOF

device=$(python -c 'import torch; from bench.provenance import device_slug; print(device_slug(torch.device("cuda", 0)))')
prefix="bench/results/${device}-$(date +%F)"
mkdir -p bench/results
nvidia-smi > "${prefix}-nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed or is missing" > "${prefix}-nvidia-smi.txt"

echo "== checks: python -m pytest -m cuda (log: ${prefix}-gpu_check.log)"
python -m pytest -m cuda -ra -q 2>&1 | tee "${prefix}-gpu_check.log"

echo "== the 2D flows' solvers, GPU and CPU (log: ${prefix}-solver_time.txt)"
for flow in dr2d swe2d ns2d; do
    for dev in cuda cpu; do
        python -m bench.solver_time --config "configs/reduced/${flow}.yaml" --device "$dev"
    done
done 2>&1 | tee "${prefix}-solver_time.txt"

echo "== epoch time: configs/bench_burgers.yaml"
python -m bench.epoch_time --config configs/bench_burgers.yaml --out bench/results

if [[ "${SKIP_ACCURACY:-0}" != 1 ]]; then
    echo "== accuracy against PDEBench's FNO: configs/burgers.yaml"
    python -m bench.accuracy --config configs/burgers.yaml --out bench/results
fi
if [[ "${RUN_TRANSFER:-0}" == 1 ]]; then
    echo "== transfer (issue 50): the Kolmogorov flow, then diffusion-reaction, held out"
    python -m bench.transfer --held-out ns2d_kolmogorov --held-out-config configs/reduced/ns2d_kolmogorov.yaml
    python -m bench.transfer --held-out dr2d
fi
echo "done: results in ${prefix}-* (and the benchmarks' files beside them)"
