#!/usr/bin/env bash
# The whole race of issue 51 on this machine, task after task, from the repository root of a clean
# checkout with the extra `peers` installed (pip install -e '.[peers]': neuraloperator's FNO races):
#
#   bash bench/race_ladder.sh                      # advection, darcy, burgers, ns2d
#   bash bench/race_ladder.sh burgers ns2d         # some of them
#
# Each task is one `bench.race` (every model's recipe chosen on validation at B and 4B among its
# authors' recipe, our loop's help per loss at batch 16, and its choice from below; 3 seeds of
# every model on every rung; the machine's speed before each run). A race records each trial
# when it finishes and trains nothing twice, so the script resumes where it was stopped: run it
# again, on this machine or another (each model's budget is in seconds of the machine that started
# the store: bench/machine_budget.py). Nothing else should run meanwhile: the race is on the wall
# clock (its report says how far the machine's speed moved). On 2 CPU cores the budgets alone add up to about 5 h each for
# advection and Darcy, 9 h for Burgers (B = 60 s to 16B) and 19 h for ns2d (B = 120 s to 16B);
# scoring and start-up add to that: two to three days in all.
#
# A store holding records of the race's former rule (one recipe chosen at B) is refused with one
# line: remove it first (`git rm bench/results/race-<task>.*`; git keeps it). RACE_LADDER_PRINT=1
# prints the commands instead of running them.
# To read a task's race while it runs or after it stopped, run its printed command with
# --report-only: the report and plot of what is recorded, nothing trained.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A base=([advection]=60 [darcy]=60 [burgers]=60 [ns2d]=120)
declare -A rungs=([advection]=1,4 [darcy]=1,4 [burgers]=1,4,16 [ns2d]=1,4,16)
tasks=("$@")
[[ ${#tasks[@]} -gt 0 ]] || tasks=(advection darcy burgers ns2d)
for task in "${tasks[@]}"; do
    [[ -n "${base[$task]:-}" ]] || { echo "bench/race_ladder.sh: no race for '$task' (one of: ${!base[*]})" >&2; exit 2; }
done

for task in "${tasks[@]}"; do
    race=(python -m bench.race --config "configs/reduced/${task}.yaml" --base-s "${base[$task]}" --rungs "${rungs[$task]}"
          --models ours,fno,unet,plain_transformer,neuralop_fno --seeds 0,1,2 --batches 16)
    if [[ "${RACE_LADDER_PRINT:-0}" == 1 ]]; then  # the commands only (tests/test_race.py checks them)
        echo "${race[*]}"
        continue
    fi
    echo "== the race on ${task}: B = ${base[$task]} s, rungs ${rungs[$task]}"
    "${race[@]}"
done
