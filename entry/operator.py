"""`torchrun --nproc_per_node=N -m entry.operator --config CFG [--set k=v]`: train the latent operator.

Also runs as plain `python -m entry.operator` (world size 1). Needs the latent cache
(`python -m entry.cache`). With `operator.task_weighting: step_size` it first measures each task's mean
square latent step over the training pairs and weighs the task's loss by its inverse. With
`evaluation.val_every > 0` it rolls out the dynamic tasks' validation trajectories every
`val_every` steps (through the frozen autoencoder) and logs their nRMSE.
"""

from __future__ import annotations

import sys

from entry.training.stage_command import stage_command

main = stage_command("operator", __doc__)
"""Parse, build what the stage needs first, run its record (entry.stages.record; its build:
entry/stages/operator.py), close."""


if __name__ == "__main__":
    sys.exit(main())
