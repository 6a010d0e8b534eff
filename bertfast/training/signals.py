"""Stopping a run cleanly: SIGTERM or SIGINT (a scheduler's pre-emption, Ctrl-C) asks the run to
save a checkpoint at the end of the current step and stop; a second signal interrupts at once."""
from __future__ import annotations

import signal
import threading


class StopRequest:
    def __init__(self) -> None:
        self.requested = False

    def install(self) -> "StopRequest":
        """Handle SIGTERM and SIGINT (only the main thread can install handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return self

        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError):
                pass
        return self
