"""Use a trained run: load it from its folder as a `Surrogate` (`load_run`), roll it out from given
frames, read those frames from a file and write the rollout, export its networks with torch.export.
The commands are `entry/predict.py` and `entry/export.py`."""

from entry.config.errors import InputError
from entry.inference.surrogate import Surrogate, TaskInfo, load_run

__all__ = ["InputError", "Surrogate", "TaskInfo", "load_run"]
