"""The training loop's stop request: SIGTERM or SIGINT sets a flag that the loop agrees on with the
other ranks at the step's one all_reduce (entry.training.step.agree_on_step)."""

from __future__ import annotations

import signal


class StopFlag:
    """SIGTERM or SIGINT sets it; the loop agrees on it with the other ranks at the step's flag all_reduce.

    SIGINT is handled as SIGTERM: Ctrl-C reaches every process of the terminal's group (each worker
    and torchrun's agent, which then SIGTERMs the workers), so a KeyboardInterrupt would drop the
    steps since the last checkpoint, and a second signal must not abort the checkpoint the first
    one asked for. `restore` puts the previous handlers back.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self.received = ""
        """The name of the first signal this process got ("" when the stop came from another rank)."""
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame):
        self.requested = True
        self.received = self.received or signal.Signals(signum).name

    def why(self) -> str:
        """What asked for the stop, for the log."""
        return f"{self.received} received" if self.received else "a stop signal reached another rank"

    def restore(self):
        for s, previous in self._previous.items():
            signal.signal(s, previous)
