"""`torchrun --nproc_per_node=N -m entry.diffusion --config CFG`: train the residual denoiser.

PDE-Refiner style: the trained operator, frozen, predicts z_op; the denoiser learns the
residual z_next - z_op from noised copies at a few noise levels. With `diffusion.sigma_data: 0`
the residual's RMS is measured first (the denoiser's EDM sigma_data, stored in its weights).
"""

from __future__ import annotations

import sys

from entry.training.stage_command import stage_command

main = stage_command("diffusion", __doc__)
"""Parse, build what the stage needs first, run its record (entry.stages.record; its build:
entry/stages/diffusion.py), close."""


if __name__ == "__main__":
    sys.exit(main())
