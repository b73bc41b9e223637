#!/usr/bin/env bash
# Bootstrap a fresh rented GPU machine (a cloud VM or a GPU rental with the NVIDIA driver): install
# torch's CUDA build and this project into a virtual environment, check the machine, prepare the
# data, plan the memory, run the pipeline on every GPU, and keep the results (the run folder without
# its checkpoints, wandb's offline files included) in one archive under results/ to copy off
# before the machine is given back.
#
#   git clone <this repository> universal-simulator && cd universal-simulator
#   bash configs/launch/bootstrap.sh --config configs/burgers.yaml
#   bash configs/launch/bootstrap.sh --config configs/quickstart.yaml --skip-cuda-install -- --set operator.steps=50
#
# Options: --config CFG (default configs/burgers.yaml); --nproc N (default: every GPU, else 1);
# --cuda TAG (PyTorch wheel index, default cu128); --torch VERSION (default 2.13.0); --venv DIR
# (default .venv); --max-restarts N (torchrun restarts from the last checkpoint, default 3);
# --wandb MODE (default offline: no credentials needed, `wandb sync <run folder>/wandb/...` later;
# "config" keeps the config's); --results DIR (where the archive goes, default results);
# --skip-cuda-install (install nothing: use $PYTHON, default python3, as it is, for a CPU run or
# a machine set up already). Arguments after -- go to every entry command (--set k=v ...).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"

CONFIG=configs/burgers.yaml
NPROC=""
CUDA_TAG=cu128
TORCH_VERSION=2.13.0
VENV=.venv
MAX_RESTARTS=3
RESULTS=results
WANDB=offline
SKIP_INSTALL=0
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --config) CONFIG=$2; shift 2 ;;
        --nproc) NPROC=$2; shift 2 ;;
        --cuda) CUDA_TAG=$2; shift 2 ;;
        --torch) TORCH_VERSION=$2; shift 2 ;;
        --venv) VENV=$2; shift 2 ;;
        --max-restarts) MAX_RESTARTS=$2; shift 2 ;;
        --wandb) WANDB=$2; shift 2 ;;
        --results) RESULTS=$2; shift 2 ;;
        --skip-cuda-install) SKIP_INSTALL=1; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "bootstrap: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
say() { echo "bootstrap: $*"; }

GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then
    GPUS=$(nvidia-smi -L | grep -c '^GPU' || true)
    nvidia-smi -L || true
fi
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 1 ))}

say "1/5 install"
if [[ $SKIP_INSTALL == 1 ]]; then
    PY=${PYTHON:-python3}
    say "--skip-cuda-install: using $("$PY" -c 'import sys; print(sys.executable)') as it is"
else
    [[ -d $VENV ]] || python3 -m venv "$VENV"
    PY=$VENV/bin/python
    "$PY" -m pip install --upgrade pip
    "$PY" -m pip install "torch==$TORCH_VERSION" --index-url "https://download.pytorch.org/whl/$CUDA_TAG"
    "$PY" -m pip install -c constraints.txt -e ".[test]"
fi
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC")
ARGS=(--config "$CONFIG" "${EXTRA[@]}")
if [[ $WANDB != config ]]; then
    ARGS+=(--set "logging.wandb.mode=$WANDB")
fi
# One interpreter start for both: the torch build, and the run folder the config names.
RUN_DIR=$("$PY" -c 'import sys, torch
from entry.config.cli import parse_config
from entry.storage.run_folder import run_dir_for
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}", file=sys.stderr)
print(run_dir_for(parse_config(sys.argv[1:], "")[0]))' "${ARGS[@]}")
say "run folder $RUN_DIR"
mkdir -p "$RESULTS"
ARCHIVE=$RESULTS/$(basename "$RUN_DIR")-$(hostname -s)-$(date +%Y%m%d-%H%M%S).tar.gz

keep_results() {
    # Checkpoints stay behind: they only serve to resume on this machine.
    if [[ -d $RUN_DIR ]]; then
        tar czf "$ARCHIVE" --exclude=checkpoints -C "$(dirname "$RUN_DIR")" "$(basename "$RUN_DIR")" \
            && say "results kept in $ARCHIVE"
    fi
}
trap keep_results EXIT  # also when a step fails: its logs are in the run folder

say "2/5 check the machine (entry.doctor on $NPROC process(es))"
"${TORCHRUN[@]}" -m entry.doctor "${ARGS[@]}"

say "3/5 prepare the data"
"$PY" -m entry.prepare_data "${ARGS[@]}" --workers "$(( GPUS > 0 ? 1 : $(nproc) ))"

if [[ $GPUS -gt 0 ]]; then
    say "4/5 plan the memory of $NPROC GPU(s)"
    MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
    "$PY" -m entry.plan "${ARGS[@]}" --world-size "$NPROC" --gpu-memory "${MEM_MIB}MiB"
else
    say "4/5 no GPU: no memory plan"
fi

say "5/5 run entry.pipeline on $NPROC process(es)"
"${TORCHRUN[@]}" --max-restarts="$MAX_RESTARTS" -m entry.pipeline "${ARGS[@]}"
trap - EXIT
keep_results
say "results in $RUN_DIR; pipeline completed"
