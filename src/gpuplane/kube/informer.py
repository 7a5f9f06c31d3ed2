"""An informer: a local cache of one resource kept current by list + watch, with change handlers.

The loop is client-go's reflector in small: list (the cache is replaced, handlers see the difference as
adds, updates and deletes), then watch from the list's resourceVersion. A watch that ends (the server's
timeout) is reopened at once from the last resourceVersion seen; a broken one is reopened after a back-off;
a 410 Gone (the history was compacted) means relist. Handlers get `(type, old, new)`: ADDED with old None,
MODIFIED, DELETED with new None; they run on the informer's thread (or the thread that calls `assume`), one
change at a time, in the order the cache changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from gpuplane.kube.api import ApiError, JsonObject, KubeApi
from gpuplane.kube.objects import object_key, resource_version, resource_version_number

log = logging.getLogger(__name__)

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
ChangeHandler = Callable[[str, JsonObject | None, JsonObject | None], None]


class Informer:
    """The cache of one collection path (`/api/v1/pods`, `/api/v1/nodes`, …), keyed `namespace/name` or `name`.

    `sleep` waits between retries (back-off from `backoff_s`, doubling to `max_backoff_s`); the default waits on
    the stop signal, so `stop()` cuts it short. Tests inject their own.
    """

    def __init__(self, api: KubeApi, path: str, *, label_selector: str | None = None,
                 field_selector: str | None = None, watch_timeout_s: int = 300, backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, sleep: Callable[[float], None] | None = None, name: str = "") -> None:
        self.api = api
        self.path = path
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.watch_timeout_s = watch_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.name = name or path
        self._stopping = threading.Event()
        self._sleep = sleep if sleep is not None else self._stopping.wait
        self._synced = threading.Event()
        self._lock = threading.RLock()
        """Held while the cache changes and handlers run, so handlers see changes one at a time, in order."""
        self._cache: dict[str, JsonObject] = {}
        self._held: dict[str, int] = {}
        """Assumed writes: key → the resourceVersion the assumed object is newer than."""
        self._handlers: list[ChangeHandler] = []
        self._rv = ""
        self._stream: Any = None
        self._thread: threading.Thread | None = None
        self.relists = 0
        """Lists after the first (each a 410 Gone, or a list that failed and was retried)."""
        self.rewatches = 0
        """Watches reopened after a broken connection or an error answer."""
        self.last_error: str = ""

    # ------------------------------------------------------------------ control
    def add_handler(self, handler: ChangeHandler) -> None:
        with self._lock:
            self._handlers.append(handler)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"informer {self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        stream = self._stream
        if stream is not None and hasattr(stream, "close"):
            stream.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def has_synced(self) -> bool:
        """Whether the first list has filled the cache."""
        return self._synced.is_set()

    def wait_synced(self, timeout_s: float | None = None) -> bool:
        return self._synced.wait(timeout_s)

    @property
    def resource_version(self) -> str:
        """The last resourceVersion seen (list, event or bookmark): where a watch resumes."""
        return self._rv

    # ------------------------------------------------------------------ reads
    def get(self, key: str) -> JsonObject | None:
        """The cached object (shared: do not modify it)."""
        with self._lock:
            return self._cache.get(key)

    def objects(self) -> list[JsonObject]:
        with self._lock:
            return list(self._cache.values())

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._cache)

    # ------------------------------------------------------------------ writes
    def assume(self, obj: JsonObject, newer_than: int) -> None:
        """Put a locally known result of a write in the cache now (a bind that returned no object, say).

        Watch events for the object at or below `newer_than` are skipped (they predate the write); the first
        later one replaces the assumed object (if one came already, the assumption is dropped). Handlers see the
        assumed change like any other.
        """
        key = object_key(obj)
        with self._lock:
            old = self._cache.get(key)
            seen = resource_version_number(self._rv)
            if (resource_version(old) if old is not None else seen) > newer_than:
                return  # the watch already brought the server's later state (or the object's deletion)
            self._cache[key] = obj
            self._held[key] = newer_than
            self._notify(MODIFIED if old is not None else ADDED, old, obj)

    def offer(self, obj: JsonObject) -> None:
        """A caller's fresh copy of an object (the answer to its own write): into the cache now, unless the
        watch has already gone past it (the object may have changed or gone since)."""
        with self._lock:
            seen = resource_version_number(self._rv)
            if resource_version(obj) > seen:
                self.apply(MODIFIED, obj)

    def forget(self, obj: JsonObject) -> None:
        """The answer to our own DELETE that removed the object (its last state): out of the cache now, unless
        the watch has gone past it already. Watch events for it at or below that version are skipped (they
        predate the deletion); a later one (the object created again) is applied."""
        key = object_key(obj)
        version = resource_version(obj)
        with self._lock:
            if version <= resource_version_number(self._rv):
                return
            self._held[key] = version
            old = self._cache.pop(key, None)
            if old is not None:
                self._notify(DELETED, old, None)

    def apply(self, event_type: str, obj: JsonObject) -> None:
        """Apply one watch event to the cache."""
        key = object_key(obj)
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                if resource_version(obj) <= held:
                    return
                del self._held[key]
            old = self._cache.get(key)
            if event_type == DELETED:
                if old is not None:
                    del self._cache[key]
                    self._notify(DELETED, old, None)
                return
            if old is not None and resource_version(old) > resource_version(obj) >= 0:
                return  # older than what we hold (an assumed write the server has since overtaken)
            self._cache[key] = obj
            self._notify(MODIFIED if old is not None else ADDED, old, obj)

    # ------------------------------------------------------------------ the loop
    def _notify(self, event_type: str, old: JsonObject | None, new: JsonObject | None) -> None:
        for handler in list(self._handlers):
            try:
                handler(event_type, old, new)
            except Exception:  # a broken handler must not stop the cache
                log.exception("informer %s: handler failed on %s", self.name, event_type)

    def _list(self) -> None:
        items, rv = self.api.list(self.path, label_selector=self.label_selector,
                                  field_selector=self.field_selector)
        fresh = {object_key(item): item for item in items}
        with self._lock:
            for key in list(self._cache):
                if key not in fresh:
                    gone = self._cache.pop(key)
                    self._held.pop(key, None)
                    self._notify(DELETED, gone, None)
            for key, item in fresh.items():
                held = self._held.get(key)
                if held is not None:
                    if resource_version(item) <= held:
                        continue
                    del self._held[key]
                old = self._cache.get(key)
                if old is not None and resource_version(old) == resource_version(item):
                    continue
                self._cache[key] = item
                self._notify(MODIFIED if old is not None else ADDED, old, item)
            self._rv = rv
        self._synced.set()

    def _run(self) -> None:
        need_list = True
        failures = 0
        while not self._stopping.is_set():
            try:
                if need_list:
                    self._list()
                    need_list = False
                stream: Any = self.api.watch(self.path, self._rv, timeout_s=self.watch_timeout_s,
                                        label_selector=self.label_selector, field_selector=self.field_selector)
                self._stream = stream
                if self._stopping.is_set():
                    break
                for event_type, obj in stream:
                    failures = 0
                    rv = (obj.get("metadata") or {}).get("resourceVersion")
                    with self._lock:  # with the resume point, so `offer` sees both or neither
                        if event_type != "BOOKMARK":
                            self.apply(event_type, obj)
                        if rv:
                            self._rv = str(rv)
            except ApiError as exc:
                if self._stopping.is_set():
                    break
                self.last_error = str(exc)
                if exc.status == 410:
                    log.info("informer %s: %s; relisting", self.name, exc)
                    self.relists += 1
                    need_list = True
                    continue
                failures += 1
                if need_list:
                    self.relists += 1
                else:
                    self.rewatches += 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))
                log.warning("informer %s: %s; retrying in %.1fs", self.name, exc, delay)
                self._sleep(delay)
            finally:
                self._stream = None
