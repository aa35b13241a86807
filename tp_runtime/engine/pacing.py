"""How long a streaming engine may hold back its next step for requests still to come.

With async scheduling the driver sends step N+1 as soon as it has read step N-1's output, while the device
runs step N. A request that arrives after that send can only join step N+2: it waits for the rest of step
N and then the whole of step N+1 (~5 ms for an 8B model's decode step) before its prefill starts. The
device needs step N+1 only when step N ends, so a driver with nothing waiting may hold N+1 back until
shortly before then, taking requests as they come; one that comes in that time joins step N+1.

The hold ends a margin (`margin_s`, or `margin_share` of the step, whichever is longer) before the
running step's end, estimated as the median of the last decode-only steps' durations. A step's duration
is the time between its output's arrival and its predecessor's: the device starts a step when the one
before ends, as it is queued before the driver asks for that one's output. That holds only when the driver
had to wait for the output (the device was still busy); an output that was ready when asked for means the
device may have sat idle (a host slower than the device, or a hold that was too long), so the estimates
are dropped and no step is held until new ones come in. A host-bound engine therefore never holds.
"""

from __future__ import annotations

import statistics
from collections import deque


class StepPacer:
    """Durations of recent decode-only steps, from when their outputs arrived; `hold_s` from them."""

    def __init__(
        self,
        window: int = 8,
        min_samples: int = 3,
        margin_s: float = 1.5e-3,
        margin_share: float = 0.25,
        blocked_s: float = 2e-4,
    ) -> None:
        """`window` durations are kept, `min_samples` needed before any hold; an output the driver waited
        less than `blocked_s` for counts as ready when asked for."""
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples} and {window}")
        self.min_samples = min_samples
        self.margin_s = margin_s
        self.margin_share = margin_share
        self.blocked_s = blocked_s
        self._durations: deque[float] = deque(maxlen=window)
        self._last_arrival: float | None = None

    def output_arrived(self, arrived: float, waited: float, decode_only: bool) -> None:
        """A step's output came in at `arrived` after the driver waited `waited` seconds for it (the next
        step already sent); `decode_only`: that step computed one token per request."""
        if waited < self.blocked_s:
            self._durations.clear()
        elif decode_only and self._last_arrival is not None:
            self._durations.append(arrived - self._last_arrival)
        self._last_arrival = arrived

    def reset(self) -> None:
        """The pipeline emptied (nothing in flight): the next output starts a new chain of intervals."""
        self._last_arrival = None

    def step_estimate(self) -> float | None:
        if len(self._durations) < self.min_samples:
            return None
        return statistics.median(self._durations)

    def hold_s(self, now: float) -> float:
        """How long from `now` the next step may wait, if the step running now is a decode-only one."""
        step = self.step_estimate()
        if step is None or self._last_arrival is None:
            return 0.0
        send_by = self._last_arrival + step - max(self.margin_s, self.margin_share * step)
        return max(0.0, send_by - now)
