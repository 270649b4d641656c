"""When an instance may still act, and when its peers may give it up (docs/contract.md §9,
§14, "A replica fences itself").

An instance's heartbeat is a lease of `SILENT_INTERVALS` sweep intervals, judged by the
store's clock: peers recover its `pending` receipts only after that, and the store refuses to
renew a heartbeat that old. The instance itself stops forwarding sooner, after
`LAPSE_INTERVALS` by its own monotonic clock, counted from when its last successful heartbeat
was *sent* (so never later than the store wrote it). The interval between the two is the
margin that keeps a paused replica's calls from overlapping its peers' recovery, as long as
the two clocks run at about the same rate.
"""

from __future__ import annotations

LAPSE_INTERVALS = 2
SILENT_INTERVALS = 3


def lapsed(last_heartbeat_sent: float | None, now: float, interval_s: float) -> bool:
    """Whether an instance must forward nothing: its last successful heartbeat (sent at
    `last_heartbeat_sent`, monotonic) is older than `LAPSE_INTERVALS` intervals, or it never
    had one."""
    if last_heartbeat_sent is None:
        return True
    return now - last_heartbeat_sent >= LAPSE_INTERVALS * interval_s


def silent(heartbeat_at: float | None, now: float, silent_after_s: float) -> bool:
    """Whether peers may give an instance up at `now` (the database's clock): its heartbeat
    (`heartbeat_at`, None when it has no row) is older than `silent_after_s`."""
    return heartbeat_at is None or heartbeat_at < now - silent_after_s


def next_instance_id(first: str, generation: int) -> str:
    """The id an instance goes on under after its `generation`-th lapse: never one used
    before, and always starting with the first id (`GATEWAY_INSTANCE_ID` is a prefix)."""
    return first if generation == 0 else f"{first}.{generation}"
