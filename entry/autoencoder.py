"""`torchrun --nproc_per_node=N -m entry.autoencoder --config CFG`: fit and train the codec (`latent.codec`).

First the codec's linear path is fitted in closed form to training fields of every task
(`entry.models.codec_fit.fit_codec`: the grid codec's is exact when the latent is as large as
the field and the PCA of the cells otherwise, the conv codec's the PCA of the patches); then
`autoencoder.steps` optimizer steps train the learned correction on field snapshots of every
task's training split (Darcy: coefficient and solution), one task per step on every rank,
reconstruction loss. `autoencoder.steps: 0` keeps the fitted linear path. With
`evaluation.val_every > 0` the reconstruction nRMSE of the val split's frames is validated (before
the first step too) and `evaluation.select: best` keeps the best weights.
"""

from __future__ import annotations

import sys

from entry.training.stage_command import stage_command

main = stage_command("autoencoder", __doc__)
"""Parse, build what the stage needs first, run its record (entry.stages.record; its build:
entry/stages/autoencoder.py), close."""


if __name__ == "__main__":
    sys.exit(main())
