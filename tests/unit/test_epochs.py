"""Store epochs and synchronous replication, the plain decisions (docs/contract.md §19)."""

from __future__ import annotations

import pytest

from gateway.core.epochs import (
    Epoch,
    Known,
    New,
    StoreEpoch,
    is_replication_warning,
    judge,
    replication_problem,
    timeline_of,
)
from gateway.store.pg_hosts import Host, parse_hosts


def recorded(mode: str = "async", timeline: int = 1, system_id: str = "71") -> StoreEpoch:
    return StoreEpoch(3, system_id, timeline, mode, "not_needed", 0.0)  # type: ignore[arg-type]


class TestJudge:
    """Which servers are a new epoch, and which new epochs apply the floor."""

    def test_the_first_epoch_is_recorded_without_a_floor(self) -> None:
        assert judge(None, Epoch("71", 1, 100), None) == New(floor=False, reason="first epoch")

    def test_the_same_server_line_going_forward_is_known(self) -> None:
        assert judge(recorded(), Epoch("71", 1, 500), (3, 400)) == Known(recorded())

    def test_a_promotion_applies_the_floor_after_async_only(self) -> None:
        reason = "a new timeline (a promotion)"
        assert judge(recorded("async"), Epoch("71", 2, 9), None) == New(True, reason)
        assert judge(recorded("sync"), Epoch("71", 2, 9), None) == New(False, reason)

    def test_another_cluster_or_a_wal_position_gone_back_applies_it_in_either_mode(self) -> None:
        for mode in ("async", "sync"):
            assert judge(recorded(mode), Epoch("99", 1, 9), None).floor is True  # type: ignore[union-attr]
            back = judge(recorded(mode), Epoch("71", 1, 399), (3, 400))
            assert back == New(True, "the WAL position went back (restored in place)")

    def test_a_position_read_in_an_older_epoch_says_nothing_of_the_latest(self) -> None:
        assert judge(recorded(), Epoch("71", 1, 10), (2, 400)) == Known(recorded())

    def test_an_epoch_list_gone_back_applies_it(self) -> None:
        """This replica read in epoch 4, and the latest recorded is 3: the store was restored
        to before epoch 4 (a disk snapshot restored in place a second time: its first
        restore recorded epoch 4 with the floor, which the snapshot does not hold)."""
        for mode in ("async", "sync"):
            back = judge(recorded(mode), Epoch("71", 1, 500), (4, 400))
            assert back == New(True, "the store's epochs went back (restored in place)")

    def test_the_live_timeline_is_read_from_the_wal_file_name(self) -> None:
        assert timeline_of("0000000A0000000000000003") == 10
        with pytest.raises(ValueError):
            timeline_of("nope")


class TestReplicationChecks:
    def test_commits_wait_only_with_standbys_named_and_a_waiting_synchronous_commit(self) -> None:
        assert replication_problem('"node1"', "on") is None
        assert replication_problem("ANY 1 (*)", "remote_apply") is None
        assert "synchronous_standby_names is empty" in str(replication_problem(" ", "on"))
        assert "synchronous_commit is 'local'" in str(replication_problem("*", "local"))

    def test_the_warning_of_a_cancelled_wait_is_recognised(self) -> None:
        detail = (
            "The transaction has already committed locally, but might not have been "
            "replicated to the standby."
        )
        assert is_replication_warning(
            "WARNING", "canceling wait for synchronous replication due to user request", detail
        )
        assert not is_replication_warning("NOTICE", "relation exists, skipping", None)


class TestHostList:
    def test_a_libpq_multi_host_url_gives_one_url_per_host(self) -> None:
        hosts = parse_hosts(
            "postgresql://u:pw@h1:5433,h2,[::1]:6000/db?sslmode=disable&target_session_attrs=any"
        )
        assert hosts.hosts == (Host("h1", 5433), Host("h2", 5432), Host("::1", 6000))
        assert hosts.url_of(hosts.hosts[2]) == "postgresql://u:pw@[::1]:6000/db?sslmode=disable"

    @pytest.mark.parametrize(
        "url", ["postgresql:///db", "postgresql://u@h1,:5/db", "postgresql://h:x/db"]
    )
    def test_a_bad_host_list_is_named(self, url: str) -> None:
        with pytest.raises(ValueError):
            parse_hosts(url)
