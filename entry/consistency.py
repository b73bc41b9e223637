"""`torchrun --nproc_per_node=N -m entry.consistency --config CFG`: distil the denoiser to 1-2 steps.

The student starts from the trained diffusion denoiser (the teacher, frozen) and matches an
EMA target, a second module sharded like the student and updated after every optimizer step.
All three carry the teacher's sigma_data (a buffer in its weights); the loss is scaled by it.
"""

from __future__ import annotations

import sys

from entry.training.stage_command import stage_command

main = stage_command("consistency", __doc__)
"""Parse, build what the stage needs first, run its record (entry.stages.record; its build:
entry/stages/consistency.py), close."""


if __name__ == "__main__":
    sys.exit(main())
