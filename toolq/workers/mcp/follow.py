"""The worker's advertisement follows its MCP servers after start (no Celery here: `fleet.py` wires it).

On every heartbeat the worker's main process reads the host's listing; when it changed (a
server's `list_changed`, a restart, a server going down) it installs the listing in the main
process's catalog, starts consuming the queue of each new declaration, and re-advertises.

Two graces keep turns already running from being told "no live worker serves" it:
- a declaration the server no longer lists stays routable (advertised as `retiring`, which new
  turns do not offer the model) for `GRACE` seconds, so a call still carrying it reaches this
  worker and is refused with what changed ("declared differently by its MCP server now");
- a server that is down (restarting) keeps its declarations advertised as they were for `GRACE`
  seconds, so a call waits in the host for the restart; if it stays down, they are withdrawn.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from toolq.core.advert import ToolAdvert, ToolRef
from toolq.core.catalog import Catalog, ToolSpec
from toolq.workers.mcp.wire import Listing

log = logging.getLogger("toolq.worker")

#: How long a withdrawn declaration stays routable, and a down server's tools stay advertised.
GRACE = 10.0

#: Starts consuming one queue in this worker; False if the worker did not confirm it.
Consume = Callable[[str], bool]


class Follower:
    """Called by the heartbeat thread with the worker's `Advertiser` (`presence.on_beat`)."""

    def __init__(self, catalog: Catalog, servers: set[str], *, read: Callable[[], Listing | None],
                 install: Callable[[Catalog, Listing], None], consume: Consume, stop_consuming: Callable[[str], None],
                 grace: float = GRACE, clock: Callable[[], float] = time.monotonic) -> None:
        self.catalog, self.servers = catalog, servers
        self.read, self.install = read, install
        self.consume, self.stop_consuming = consume, stop_consuming
        self.grace, self.clock = grace, clock
        self.current: dict[str, ToolSpec] = {}
        """What each server last advertised, by digest (kept while the server is down, within the grace)."""
        self.retiring: dict[str, tuple[ToolSpec, float]] = {}
        """Declarations no longer listed: their spec and when they stopped being listed."""
        self.down_since: dict[str, float] = {}
        self.consumed: set[str] | None = None
        self.generation: int | None = None

    def __call__(self, advertiser) -> None:
        if self.consumed is None:  # first beat: what the worker advertised and consumes since its start
            self.consumed = {t.route for t in advertiser.record.tools if t.namespace in self.servers}
            self.current = {s.digest(): s for s in self._listed()}
        listing = self.read()
        if listing is not None and listing.generation != self.generation:
            self.install(self.catalog, listing)
            self.generation = listing.generation
        refs, adverts = self.offer(listing)
        others = [t for t in advertiser.record.tools if t.namespace not in self.servers]
        before = [t for t in advertiser.record.tools if t.namespace in self.servers]
        if sorted(before, key=_order) != refs:
            kept = {t.digest for t in others}
            advertiser.serve([*others, *refs], [a for a in advertiser.tools if a.digest in kept] + adverts)
            log.info("mcp tools re-advertised: %d listed, %d retiring", len(self.current), len(self.retiring))

    def _listed(self, up: set[str] | None = None) -> list[ToolSpec]:
        return [s for s in self.catalog if s.namespace in (self.servers if up is None else up)]

    def offer(self, listing: Listing | None) -> tuple[list[ToolRef], list[ToolAdvert]]:
        """What to advertise now: each server's listed declarations (a down one's as they were,
        within the grace), and the retiring ones; only those whose queue this worker consumes."""
        now = self.clock()
        states = {s.name: s.state for s in listing.servers} if listing is not None else {}
        up = {name for name in self.servers if states.get(name) == "ready"}
        for name in self.servers - up:
            self.down_since.setdefault(name, now)
        for name in up:
            self.down_since.pop(name, None)
        kept = {n for n, since in self.down_since.items() if now - since < self.grace}
        current = {s.digest(): s for s in self._listed(up)}
        current |= {d: s for d, s in self.current.items() if s.namespace in kept}
        for digest, spec in self.current.items():
            if digest not in current and spec.namespace in up:  # listed anew; a server down too long just goes
                self.retiring.setdefault(digest, (spec, now))
        self.retiring = {d: (s, t) for d, (s, t) in self.retiring.items() if d not in current and now - t < self.grace}
        self.current = current
        offered = [(s, False) for s in current.values()] + [(s, True) for s, _ in self.retiring.values()]
        routes = {ToolRef.of(s).route for s, _ in offered}
        assert self.consumed is not None
        for route in sorted(routes - self.consumed):
            if self.consume(route):
                self.consumed.add(route)
        for route in sorted(self.consumed - routes):
            self.stop_consuming(route)
            self.consumed.discard(route)
        served = [(s, retiring) for s, retiring in offered if ToolRef.of(s).route in self.consumed]
        refs = sorted((ToolRef.of(s).model_copy(update={"retiring": retiring}) for s, retiring in served), key=_order)
        return refs, [ToolAdvert.of(s) for s, _ in served]


def _order(ref: ToolRef) -> tuple[str, bool, str]:
    return str(ref.tool_name), ref.retiring, ref.digest
