"""How many proxied calls a process takes on at once: the decision behind
`GATEWAY_MAX_INFLIGHT=auto` (docs/contract.md §11).

A gradient limit, after Netflix concurrency-limits' Gradient2: the latency of calls over a
short window is compared with its long-term average. While the short one stays within
`tolerance` of the long one the process is not queueing, and the limit grows by a small queue
allowance (its square root) each window; when the short one rises above, the limit shrinks in
proportion, never below half in one window. Samples are averaged over a window (at least
`window_s` and `min_samples` calls), so one slow call moves nothing, and a window in which the
process was never more than half busy leaves the limit alone: it says nothing about how much
more the process could take.

The long average moves slowly (`long_windows` windows), so a burst of overload is held near
`tolerance` times the latency the process had before it. In Gradient2 the reference then
follows the higher latency, so under lasting overload the limit creeps up with it, doubling
every few horizons. Here, while the limit binds (calls are being shed), the reference rises
`binding_slowdown` times slower: slowly enough that a flood is held near the latency from
before it, fast enough that a tool that really became slower is followed within minutes
instead of starving at `min_limit`. `max_limit` bounds the limit in any case.

Pure: the caller measures time and counts calls in progress, and asks for the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class GradientLimit:
    # A fresh process starts at its ceiling and sheds nothing it can take: a burst of calls is
    # not a flood. A flood brings the limit down to its floor in about two seconds (22
    # windows), since a window takes at most a tenth off it.
    limit: float = 1000.0
    # The floor. Clients that resend at once when shed (wrk, a retry loop without backoff)
    # load the process with their 503s, which raises the latency of the calls it took, which
    # shrinks the limit, which sheds more: below some floor that spiral would leave a process
    # shedding under an ordinary load long after the flood. Shed calls now cost little (the
    # server answers them from their head and leaves their connection unread for the
    # Retry-After second), yet with a floor of 20 the limit still settled near 20 after a
    # flood of 2,000 connections, and the 32-connection load that followed had calls shed.
    # 100 calls in progress is well within what one process serves.
    min_limit: int = 100
    max_limit: int = 1000
    tolerance: float = 1.5
    smoothing: float = 0.2
    long_windows: int = 100
    binding_slowdown: int = 20
    window_s: float = 0.1
    min_samples: int = 10
    long_rtt: float = 0.0
    _windows: int = 0
    _sum: float = 0.0
    _count: int = 0
    _busiest: int = 0
    _window_start: float | None = None

    @property
    def current(self) -> int:
        return int(self.limit)

    def sample(self, rtt_s: float, in_flight: int, now: float) -> int:
        """One call took `rtt_s`, with `in_flight` calls in progress when it started (itself
        included); `now` is a monotonic clock. Returns the limit for the calls that follow."""
        if self._window_start is None:
            self._window_start = now
        self._sum += rtt_s
        self._count += 1
        self._busiest = max(self._busiest, in_flight)
        if self._count >= self.min_samples and now - self._window_start >= self.window_s:
            self._close_window(self._sum / self._count, self._busiest)
            self._sum, self._count, self._busiest, self._window_start = 0.0, 0, 0, now
        return int(self.limit)

    def _close_window(self, short_rtt: float, busiest: int) -> None:
        if short_rtt <= 0:
            # every call of the window answered within a tick of the loop's clock (uvloop's
            # moves in whole milliseconds), less the tool's time: no latency to compare
            return
        if self._windows == 0:
            self.long_rtt = short_rtt
        else:  # an exponential average over about `long_windows` windows
            horizon = min(self._windows + 1, self.long_windows)
            if short_rtt > self.long_rtt and busiest >= int(self.limit):
                # at the limit, calls are being shed, and the latency is the limit's doing:
                # following it at the usual pace would let the limit creep up with it
                horizon *= self.binding_slowdown
            self.long_rtt += (short_rtt - self.long_rtt) / horizon
        self._windows += 1
        if self.long_rtt / short_rtt > 2:
            # latency fell well below the reference (the load went away): let the reference
            # follow faster, so the next overload is judged against the quiet latency
            self.long_rtt *= 0.9
        self.limit = next_limit(
            self.limit,
            short_rtt,
            self.long_rtt,
            busiest,
            tolerance=self.tolerance,
            smoothing=self.smoothing,
            min_limit=self.min_limit,
            max_limit=self.max_limit,
        )


def next_limit(
    limit: float,
    short_rtt: float,
    long_rtt: float,
    busiest: int,
    *,
    tolerance: float,
    smoothing: float,
    min_limit: int,
    max_limit: int,
) -> float:
    """The limit after one window whose mean latency was `short_rtt`, against the long-term
    `long_rtt`, with at most `busiest` calls in progress during it."""
    if busiest < limit / 2:
        return limit  # the process was never near its limit: no evidence either way
    gradient = max(0.5, min(1.0, tolerance * long_rtt / short_rtt)) if short_rtt > 0 else 1.0
    queue = math.sqrt(limit)
    target = limit * gradient + queue
    smoothed = limit * (1 - smoothing) + target * smoothing
    return float(min(max_limit, max(min_limit, smoothed)))
