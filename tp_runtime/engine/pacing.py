"""How long a streaming engine may hold back its next step for requests still to come.

With async scheduling the driver sends step N+1 as soon as it has read step N-1's output, while the device
runs step N. A request that arrives after that send can only join step N+2: it waits for the rest of step
N and then the whole of step N+1 (~5 ms for an 8B model's decode step) before its prefill starts. The
device needs step N+1 only when step N ends, so a driver with nothing waiting may hold N+1 back until
shortly before then, taking requests as they come; one that comes in that time joins step N+1.

The hold ends a margin before the running step's estimated end: `margin_s` or `margin_share` of the step,
whichever is longer, plus whatever late sends have added. The estimate is the shorter of the last
decode-only step's duration and the median of the recent ones (robust to one slow step, quick to follow a
batch that shrank). A step's duration is the time between its output's arrival and its predecessor's:
the device starts a step when the one before it ends, as it is queued before that one's output is asked
for. That holds only while the device is kept busy. An output that was ready before it was asked for
(`ModelRunnerOutput.ready_before_asked`: rank 0 asks once the next step is queued) means the device may
have sat idle in between (a host slower than the device, a thread that woke late, a batch that shrank):
its interval is no step's duration and the estimates are dropped; if the step before it was held, the
margin grows too (up to half a step; it shrinks back while held steps are sent in time). So a host-bound
engine never holds.
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
    ) -> None:
        """`window` durations are kept, `min_samples` needed before any hold."""
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples} and {window}")
        self.min_samples = min_samples
        self.margin_s = margin_s
        self.margin_share = margin_share
        self._durations: deque[float] = deque(maxlen=window)
        self._last_arrival: float | None = None
        self._late_margin = 0.0  # added after holds that ended too late
        self._held = False  # hold_s offered a hold before the step now being sent

    def output_arrived(self, arrived: float, ready_before_asked: bool, decode_only: bool) -> None:
        """A step's output came in at `arrived` (its successor already sent); `decode_only`: that step
        computed one token per request."""
        held, self._held = self._held, False
        if ready_before_asked:
            if held and self._durations:  # the hold ended too late: leave the device more time
                step = statistics.median(self._durations)
                self._late_margin = min(2 * self._late_margin + self.margin_s, step / 2)
            self._durations.clear()
        else:
            if held:
                self._late_margin *= 0.9
            if decode_only and self._last_arrival is not None:
                self._durations.append(arrived - self._last_arrival)
        self._last_arrival = arrived

    def reset(self) -> None:
        """The pipeline emptied (nothing in flight): the next output starts a new chain of intervals."""
        self._last_arrival = None

    def step_estimate(self) -> float | None:
        if len(self._durations) < self.min_samples:
            return None
        return min(self._durations[-1], statistics.median(self._durations))

    def margin(self, step: float) -> float:
        return max(self.margin_s, self.margin_share * step) + self._late_margin

    def hold_s(self, now: float) -> float:
        """How long from `now` the next step may wait, if the step running now is a decode-only one."""
        step = self.step_estimate()
        if step is None or self._last_arrival is None:
            return 0.0
        hold = max(0.0, self._last_arrival + step - self.margin(step) - now)
        self._held = hold > 0
        return hold
