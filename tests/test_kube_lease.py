"""Leader election on a Lease against the local API server, two candidates on one virtual clock: one leader at a
time, failover after the lease duration, takeover at once on release, 409s handled, transitions counted, and a
partitioned leader that steps down before anyone else may lead."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from gpuplane.kube.api import JsonObject, KubeApi, RestKubeApi
from gpuplane.kube.lease import LeaseConfig, LeaseConfigError, LeaseElector
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.objects import parse_time

NS, NAME = "gpuplane-system", "gpuplane-operator"
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{NAME}"
T0 = 1_764_400_000.0  # virtual epoch seconds


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as fake:
        yield fake


@pytest.fixture
def clock() -> Clock:
    return Clock()


def candidate(server: FakeApiServer, clock: Clock, identity: str, events: list[tuple[float, str, str]],
              api: KubeApi | None = None) -> LeaseElector:
    config = LeaseConfig(NS, NAME, identity, lease_duration_s=15, renew_deadline_s=10, retry_period_s=2)
    return LeaseElector(api or RestKubeApi.from_url(server.url, request_timeout_s=5), config, clock,
                        on_started_leading=lambda: events.append((clock.t - T0, identity, "start")),
                        on_stopped_leading=lambda: events.append((clock.t - T0, identity, "stop")))


def run(electors: Sequence[LeaseElector], clock: Clock, seconds: float, step: float = 0.5) -> list[str]:
    """Tick every elector each `step` for `seconds`; asserts at most one leader at every instant. Returns the
    leader (or "") at each step."""
    leaders = []
    end = clock.t + seconds
    while clock.t < end:
        for elector in electors:
            elector.tick()
        leading = [e.config.identity for e in electors if e.is_leader]
        assert len(leading) <= 1, f"two leaders at t={clock.t - T0}: {leading}"
        leaders.append(leading[0] if leading else "")
        clock.t += step
    return leaders


def lease(server: FakeApiServer) -> JsonObject:
    obj = server.get("leases", f"{NS}/{NAME}")
    assert obj is not None
    return obj


def dead_api() -> RestKubeApi:
    """A client of a port nothing listens on: every request fails as in a network partition."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return RestKubeApi.from_url(f"http://127.0.0.1:{port}", request_timeout_s=2)


# ------------------------------------------------------------------ settings
@pytest.mark.parametrize(("durations", "message"), [
    ((15, 10, 2), None),
    ((10, 10, 2), "lease_duration_s 10 must be above renew_deadline_s 10"),
    ((15, 2.4, 2), r"renew_deadline_s 2.4 must be above 1.2 × retry_period_s \(2.4\)"),   # 1.2 × 2 = 2.4
    ((15, 10, 0), "retry_period_s: must be above 0"),
])
def test_durations_must_nest(durations: tuple[float, float, float], message: str | None) -> None:
    if message is None:
        LeaseConfig(NS, NAME, "a", *durations)
        return
    with pytest.raises(LeaseConfigError, match=message):
        LeaseConfig(NS, NAME, "a", *durations)


# ------------------------------------------------------------------ election
def test_one_leader_at_a_time_and_it_keeps_renewing(server: FakeApiServer, clock: Clock) -> None:
    events: list[tuple[float, str, str]] = []
    a, b = candidate(server, clock, "a", events), candidate(server, clock, "b", events)
    leaders = run([a, b], clock, 60)
    assert set(leaders) == {"a"} and events == [(0.0, "a", "start")]
    spec = lease(server)["spec"]
    # a created the lease at t=0 and renewed it every retry period (2 s): last at 58 s.
    assert spec["holderIdentity"] == "a" and spec["leaseTransitions"] == 0 and spec["leaseDurationSeconds"] == 15
    assert parse_time(spec["acquireTime"]) == T0
    assert parse_time(spec["renewTime"]) == T0 + 58
    assert spec["renewTime"].endswith(".000000Z")  # MicroTime
    assert b.observed_holder == "a"
    assert len(server.requests_to(LEASE, "PUT")) == 29  # renewals at 2, 4, …, 58 s; b never wrote


def test_failover_after_the_lease_duration_when_the_leader_stops(server: FakeApiServer, clock: Clock) -> None:
    events: list[tuple[float, str, str]] = []
    a, b = candidate(server, clock, "a", events), candidate(server, clock, "b", events)
    run([a, b], clock, 10)           # a leads; its last renewal is at 8 s
    # a crashes (no release). b last saw the record change when it read it at 8 s (its tries are at 0, 2, …):
    # it may take over once 15 s have passed on its own clock since then: at 23 s, or its next try after that.
    leaders = run([b], clock, 30)
    takeover = 10 + leaders.index("b") * 0.5
    assert 23 <= takeover <= 23 + 2
    spec = lease(server)["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert parse_time(spec["acquireTime"]) == T0 + takeover
    assert events == [(0.0, "a", "start"), (takeover, "b", "start")]


def test_the_other_candidates_timestamps_are_not_trusted(server: FakeApiServer, clock: Clock) -> None:
    # A lease renewed "an hour ago" by a candidate whose clock is behind: b has never seen it change, so it waits
    # a full lease duration from its first sighting instead of taking over at once.
    server.add_object(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases", {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": NAME, "namespace": NS},
        "spec": {"holderIdentity": "old", "leaseDurationSeconds": 15, "acquireTime": "2025-01-01T00:00:00.000000Z",
                 "renewTime": "2025-01-01T00:00:00.000000Z", "leaseTransitions": 4}})
    b = candidate(server, clock, "b", [])
    leaders = run([b], clock, 20)
    assert leaders.index("b") * 0.5 == 16  # first seen at 0 s, expired after 15 s: taken at the try at 16 s
    assert lease(server)["spec"]["leaseTransitions"] == 5


def test_release_hands_over_at_once(server: FakeApiServer, clock: Clock) -> None:
    events: list[tuple[float, str, str]] = []
    a, b = candidate(server, clock, "a", events), candidate(server, clock, "b", events)
    run([a, b], clock, 5)
    assert a.release() and not a.is_leader
    assert lease(server)["spec"]["holderIdentity"] == ""
    leaders = run([b], clock, 5)
    assert leaders.index("b") * 0.5 <= 2  # b's next try (every 2 s), not a lease duration later
    assert lease(server)["spec"]["leaseTransitions"] == 1
    assert not candidate(server, clock, "c", []).release()  # not leading: nothing to release


def test_transitions_are_counted_across_handovers(server: FakeApiServer, clock: Clock) -> None:
    events: list[tuple[float, str, str]] = []
    a, b = candidate(server, clock, "a", events), candidate(server, clock, "b", events)
    run([a, b], clock, 4)
    a.release()                    # a shuts down
    run([b], clock, 4)             # b takes over at its next try (1)
    a = candidate(server, clock, "a", events)  # a starts again, as a follower
    b.release()
    run([a, b], clock, 4)          # a again (2)
    assert lease(server)["spec"]["holderIdentity"] == "a" and lease(server)["spec"]["leaseTransitions"] == 2
    assert not b.tick()            # a released elector campaigns no more
    assert [e[1:] for e in events] == [("a", "start"), ("a", "stop"), ("b", "start"), ("b", "stop"), ("a", "start")]


def test_a_conflict_on_renewal_is_retried_within_the_deadline(server: FakeApiServer, clock: Clock) -> None:
    events: list[tuple[float, str, str]] = []
    a = candidate(server, clock, "a", events)
    run([a], clock, 1)
    server.fail_next("PUT", LEASE + "$", 409, "Conflict", times=3)  # renewals at 2, 4 and 6 s fail
    leaders = run([a], clock, 12)
    assert set(leaders) == {"a"}  # the last good renewal (0 s) is younger than the 10 s deadline throughout
    assert parse_time(lease(server)["spec"]["renewTime"]) == T0 + 12
    assert events == [(0.0, "a", "start")]


class StaleReads:
    """The API, except that the next `get` of the lease answers a copy taken earlier: the candidate then writes
    with an outdated resourceVersion, as when another candidate wrote between its read and its write."""

    def __init__(self, api: KubeApi) -> None:
        self.api = api
        self.stale: JsonObject | None = None

    def get(self, path: str) -> JsonObject:
        if self.stale is not None and path == LEASE:
            stale, self.stale = self.stale, None
            return stale
        return self.api.get(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)


def test_a_stale_resource_version_gets_409_and_the_loser_rereads(server: FakeApiServer, clock: Clock) -> None:
    events: list[tuple[float, str, str]] = []
    a = candidate(server, clock, "a", events)
    run([a], clock, 1)
    a.release()
    released = lease(server)                           # holder "", resourceVersion r
    a = candidate(server, clock, "a", events)
    run([a], clock, 2)                                 # a, restarted, takes it back: resourceVersion r + 1
    assert a.is_leader
    stale = StaleReads(RestKubeApi.from_url(server.url))
    stale.stale = released
    b = candidate(server, clock, "b", events, api=stale)  # type: ignore[arg-type]
    puts = len(server.requests_to(LEASE, "PUT"))
    assert not b.tick()                                # b saw a free lease, wrote with r: 409
    assert len(server.requests_to(LEASE, "PUT")) == puts + 1
    assert lease(server)["spec"]["holderIdentity"] == "a"
    leaders = run([a, b], clock, 30)                   # b re-reads, sees a renewing, never takes over
    assert set(leaders) == {"a"}


def test_a_partitioned_leader_steps_down_before_another_takes_over(server: FakeApiServer, clock: Clock) -> None:
    events: list[tuple[float, str, str]] = []
    a, b = candidate(server, clock, "a", events), candidate(server, clock, "b", events)
    run([a, b], clock, 10)           # a's last renewal at 8 s
    a.api = dead_api()               # a can no longer reach the API server; b still can
    run([a, b], clock, 30)           # the run asserts that no two lead at once
    # a gives up 10 s (renew deadline) after its last renewal at 8 s: at 18 s. b takes over at 23 s or later.
    assert events[:2] == [(0.0, "a", "start"), (18.0, "a", "stop")]
    assert events[2][1:] == ("b", "start") and events[2][0] >= 23
    assert lease(server)["spec"]["holderIdentity"] == "b"


def test_a_stalled_loop_stops_counting_as_leader(server: FakeApiServer, clock: Clock) -> None:
    a = candidate(server, clock, "a", [])
    run([a], clock, 1)
    clock.t += 10                    # no tick for the renew deadline: is_leader turns false before any tick
    assert not a.is_leader
