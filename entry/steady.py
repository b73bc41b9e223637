"""`torchrun --nproc_per_node=N -m entry.steady --config CFG`: the steady prior (Darcy).

A denoiser maps the coefficient latent to the solution latent; trained on steady tasks only,
from the steady cache (coefficient, solution) pairs. With `steady.subtract_mean` (the default)
each task's mean solution latent is measured over the training pairs first and the prior learns
the deviation from it (core/steps/steady.py). With `evaluation.val_every > 0` it samples the
steady tasks' validation solutions every `val_every` steps and logs their nRMSE.
"""

from __future__ import annotations

import sys

from entry.training.stage_command import stage_command

main = stage_command("steady", __doc__)
"""Parse, build what the stage needs first, run its record (entry.stages.record; its build:
entry/stages/steady.py), close."""


if __name__ == "__main__":
    sys.exit(main())
