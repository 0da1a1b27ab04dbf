"""How a job stops on SIGTERM / SIGINT: the first asks for a stop at the next step boundary
(the run then writes a checkpoint and status.json ``stopped``); a second one stops at once."""
from __future__ import annotations

import logging
import signal

from cluster.job.errors import signal_exit_code

log = logging.getLogger("tether")


class StopSignals:
    """SIGTERM/SIGINT -> ``on_stop()`` once; the second signal raises KeyboardInterrupt."""

    def __init__(self, on_stop) -> None:
        self.on_stop, self.received = on_stop, None
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        log.warning("%s received: stopping after this step with a checkpoint (send it again to stop now)",
                    signal.Signals(signum).name)
        self.on_stop()

    @property
    def exit_code(self) -> int:
        return signal_exit_code(self.received) if self.received else 0
