"""Leader election on a `coordination.k8s.io/v1` Lease, with client-go's semantics, in injected time.

- Acquire when the Lease is absent (create it; 409 AlreadyExists: someone else won), held by us, released
  (empty holder), or when no renewal has been *observed* for its `leaseDurationSeconds` on our own clock:
  like client-go's `observedTime`, we note when we last saw the record change and never compare the other
  holder's timestamps with our clock.
- Renew every retry period by PUT with the read `resourceVersion` (409 Conflict: lost the race; re-read next
  time). Leadership is given up once renewal has failed for `renew_deadline`, which is shorter than the
  lease, so a partitioned leader stops before anyone else may start; seeing another holder ends it at once.
- Acquiring from another holder increments `leaseTransitions` and sets `acquireTime`; `release` clears
  the holder so that a successor takes over at its next try instead of after a lease duration (on shutdown:
  a released elector campaigns no more).

Why not the official client's `leaderelection`: it calls `sys.exit` on bad settings and sleeps on the real
clock in its own loop, so it cannot be driven in virtual time; kopf's peering is a priority scheme on its own
CRD, not a Lease lock. `LeaseElector.tick()` is called by the operator's loop; nothing here sleeps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuplane.kube.api import ApiError, JsonObject, KubeApi
from gpuplane.kube.objects import format_time
from gpuplane.model import GpuplaneError

log = logging.getLogger(__name__)


class LeaseConfigError(GpuplaneError):
    pass


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    """Which Lease, who we are, and client-go's three durations (seconds; defaults are client-go's)."""

    namespace: str
    name: str
    identity: str
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.namespace or not self.name:
            raise LeaseConfigError("lease: namespace and name must not be empty")
        if not self.identity:
            raise LeaseConfigError("identity: must not be empty")
        if self.retry_period_s <= 0:
            raise LeaseConfigError(f"retry_period_s: must be above 0, got {self.retry_period_s}")
        if not self.renew_deadline_s > self.retry_period_s * 1.2:
            raise LeaseConfigError(f"renew_deadline_s {self.renew_deadline_s} must be above 1.2 × retry_period_s "
                                   f"({self.retry_period_s * 1.2:g})")
        if not self.lease_duration_s > self.renew_deadline_s:
            raise LeaseConfigError(f"lease_duration_s {self.lease_duration_s} must be above renew_deadline_s "
                                   f"{self.renew_deadline_s}")

    @property
    def path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{self.name}"

    @property
    def collection(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"


@dataclass(frozen=True, slots=True)
class _Record:
    holder: str
    duration_s: float
    acquire_time: str
    renew_time: str
    transitions: int

    @staticmethod
    def of(lease: Mapping[str, Any]) -> _Record:
        spec = lease.get("spec") or {}
        return _Record(str(spec.get("holderIdentity") or ""), float(spec.get("leaseDurationSeconds") or 0),
                       str(spec.get("acquireTime") or ""), str(spec.get("renewTime") or ""),
                       int(spec.get("leaseTransitions") or 0))

    def spec(self) -> dict[str, Any]:
        return {"holderIdentity": self.holder, "leaseDurationSeconds": round(self.duration_s),
                "acquireTime": self.acquire_time, "renewTime": self.renew_time, "leaseTransitions": self.transitions}


Callback = Callable[[], None]


class LeaseElector:
    """One candidate. Call `tick()` often (at least every retry period); it tries at most once per retry period."""

    def __init__(self, api: KubeApi, config: LeaseConfig, now: Callable[[], float], *,
                 on_started_leading: Callback | None = None, on_stopped_leading: Callback | None = None) -> None:
        self.api = api
        self.config = config
        self.now = now
        self.on_started_leading = on_started_leading
        self.on_stopped_leading = on_stopped_leading
        self._leading = False
        self._last_renew = float("-inf")
        self._next_try = float("-inf")
        self._observed: _Record | None = None
        self._observed_at = float("-inf")
        self._released = False

    @property
    def is_leader(self) -> bool:
        """Leader, and the last renewal is younger than the renew deadline (a stalled loop stops leading)."""
        return self._leading and self.now() - self._last_renew < self.config.renew_deadline_s

    @property
    def observed_holder(self) -> str:
        return self._observed.holder if self._observed is not None else ""

    def tick(self) -> bool:
        """Try to acquire or renew when a retry period has passed; returns whether we lead now."""
        now = self.now()
        if self._released:
            return False
        if self._leading and now - self._last_renew >= self.config.renew_deadline_s:
            self._stop_leading("renewal failed for the renew deadline")
        if now < self._next_try:
            return self.is_leader
        self._next_try = now + self.config.retry_period_s
        if self._try_acquire_or_renew(now):
            self._last_renew = now
            if not self._leading:
                self._leading = True
                log.info("%s: leading %s/%s", self.config.identity, self.config.namespace, self.config.name)
                if self.on_started_leading is not None:
                    self.on_started_leading()
        elif self._leading and self.observed_holder not in ("", self.config.identity):
            self._stop_leading(f"the lease is held by {self.observed_holder}")
        return self.is_leader

    def release(self) -> bool:
        """Stop campaigning and give the lease up (clear the holder) if we hold it, as client-go does on
        shutdown; returns whether a release was written. Later ticks do nothing."""
        self._released = True
        if not self._leading:
            return False
        self._stop_leading("released")
        try:
            lease = self.api.get(self.config.path)
            record = _Record.of(lease)
            if record.holder != self.config.identity:
                return False
            now = format_time(self.now(), micro=True)
            released = _Record("", 1, now, now, record.transitions)
            self._write(lease, released)
        except ApiError as exc:
            log.warning("%s: could not release the lease: %s", self.config.identity, exc)
            return False
        return True

    # ------------------------------------------------------------------ one try
    def _try_acquire_or_renew(self, now: float) -> bool:
        stamp = format_time(now, micro=True)
        mine = _Record(self.config.identity, self.config.lease_duration_s, stamp, stamp, 0)
        try:
            lease = self.api.get(self.config.path)
        except ApiError as exc:
            if exc.status != 404:
                log.info("%s: reading the lease failed: %s", self.config.identity, exc)
                return False
            return self._create(mine, now)
        record = _Record.of(lease)
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = record.duration_s or self.config.lease_duration_s
        held_by_other = record.holder not in ("", self.config.identity)
        if held_by_other and now < self._observed_at + duration:
            return False
        if record.holder == self.config.identity:  # a renewal (or our own record, from before a restart)
            new = _Record(mine.holder, mine.duration_s, record.acquire_time or stamp, stamp, record.transitions)
        else:  # from another holder whose lease expired, or a released lease: a transition
            new = _Record(mine.holder, mine.duration_s, stamp, stamp, record.transitions + 1)
        try:
            self._write(lease, new)
        except ApiError as exc:
            log.info("%s: %s the lease failed: %s", self.config.identity,
                     "renewing" if self._leading else "acquiring", exc)
            return False
        self._observed, self._observed_at = new, now
        return True

    def _create(self, mine: _Record, now: float) -> bool:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.config.name, "namespace": self.config.namespace}, "spec": mine.spec()}
        try:
            self.api.create(self.config.collection, body)
        except ApiError as exc:  # 409 AlreadyExists: another candidate created it first
            log.info("%s: creating the lease failed: %s", self.config.identity, exc)
            return False
        self._observed, self._observed_at = mine, now
        return True

    def _write(self, lease: Mapping[str, Any], record: _Record) -> JsonObject:
        """PUT with the resourceVersion we read: a 409 means someone wrote in between."""
        meta = lease.get("metadata") or {}
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.config.name, "namespace": self.config.namespace,
                             "resourceVersion": meta.get("resourceVersion")},
                "spec": record.spec()}
        return self.api.replace(self.config.path, body)

    def _stop_leading(self, why: str) -> None:
        if not self._leading:
            return
        self._leading = False
        log.info("%s: stopped leading (%s)", self.config.identity, why)
        if self.on_stopped_leading is not None:
            self.on_stopped_leading()
