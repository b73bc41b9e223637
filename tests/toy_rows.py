"""20 rows of a linear-regression set for toy stages that test the training loop itself."""

from __future__ import annotations

import torch
from tensordict import TensorDict


class Rows:
    """20 rows (x: 3 numbers, y: 1) drawn with seed 0; `gather` returns a batch of them with the
    rows' ids (`id`), so a test can see which rows a step read."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(20, 3, generator=g), torch.randn(20, 1, generator=g)

    def __len__(self):
        return 20

    def gather(self, indices):
        ix = torch.as_tensor(indices)
        return TensorDict({"x": self.x[ix], "y": self.y[ix], "id": ix}, batch_size=[len(indices)])
