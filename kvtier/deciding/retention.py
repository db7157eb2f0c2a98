"""Retention hints: what a request says about its blocks' future, and how eviction uses it (issue 32).

A request may carry a hint (`TierManager.apply_hint`): its conversation (`session`), that the
conversation has ended (`closed`), or that its blocks are worth keeping for a while (`retain_s`).
Two rules follow, both applied by the manager's eviction and nothing else:

* Doomed first. A block whose every session has closed, and that no request without a session
  used, is *doomed*: when a tier holding it must evict, it goes before whatever the tier's policy
  would choose. A prefix that another open session (a shared system prompt) or unhinted traffic
  used is not doomed. Each tier keeps a queue of doomed keys, checked lazily: an entry whose block
  has left the tier, is busy, or has since been used again by an open session is skipped. A doomed
  block evicted from an upper tier is demoted as usual and queued again in the tiers below.
* Retained kept. A block under `retain_s` is kept, until its deadline, in the last tier in
  service only: upper tiers demote it as usual, so it settles low rather than holding HBM or DRAM.
  When the last tier's policy meets a retained block as a candidate, it is protected, then set
  aside (READY, out of the policy through `remove`, as a pinned block stays); when its deadline
  lapses it goes back into the policy as a newcomer. (Protecting it where it stands would leave
  it at the policy's old end, stepped over by every later eviction: a replay with a 300 s ttl ran
  ~30 times slower that way.) Deadlines only grow (a later hint extends, never shortens), but a
  block that becomes doomed loses its retention: every session that used it said it ended. Each
  tenant's retained blocks are at most `HintLimits.retain_fraction_per_tenant` of the last tier's
  slots, all tenants' at most `retain_fraction`: past that, hints are ignored and counted
  (`over_budget`), and the last tier always has victims. Only blocks in the index are retained.

Bookkeeping is per key (`HintBook`), not per block id: a session must remember blocks that have left
the index and may come back. It is bounded: `max_sessions` open sessions (past that, the least recently
used session is forgotten and counted, its blocks treated as unhinted: clients that never close
cannot shut hints off for new sessions) and `max_session_blocks` per session (excess blocks are counted and treated as
unhinted, so that no close can doom them while that request may still need them).

Clock: the manager's `now` is whatever the caller passes (seconds; trace time in the simulator);
deadlines lapse when a later `now` is passed.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from kvtier.errors import ConfigError, KVTierError

MAX_SESSION_CHARS = 128


class HintError(KVTierError, ValueError):
    """A hint the manager refuses; `reason` is the counted label (e.g. `bad_retain_s`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"hint refused ({reason}): {message}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class HintLimits:
    """Bounds on what hints may hold (config: `hints.*`).

    Attributes:
        max_sessions: open sessions tracked at once; past that the least recently used is forgotten.
        max_session_blocks: blocks one session may list; more are treated as unhinted.
        retain_fraction_per_tenant: a tenant's retained blocks, as a share of the last tier's slots.
        retain_fraction: all tenants' retained blocks together, as a share of the last tier's slots.
        max_retain_s: the longest `retain_s` accepted.
    """

    max_sessions: int = 65_536
    max_session_blocks: int = 16_384
    retain_fraction_per_tenant: float = 0.25
    retain_fraction: float = 0.5
    max_retain_s: float = 3600.0

    def __post_init__(self) -> None:
        """Raises ConfigError naming the field out of range."""
        for name in ("max_sessions", "max_session_blocks"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"hints.{name}: must be an integer >= 1, got {value!r}")
        for name in ("retain_fraction_per_tenant", "retain_fraction"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value < 1:
                raise ConfigError(f"hints.{name}: must be a number in [0, 1), got {value!r}")
        if not _is_number(self.max_retain_s) or not 0 < self.max_retain_s < math.inf:
            raise ConfigError(f"hints.max_retain_s: must be a positive number of seconds, got {self.max_retain_s!r}")


def check_hint(session: object, retain_s: object, closed: object, limits: HintLimits) -> None:
    """Raises HintError (with its reason) where a hint's fields are not what `apply_hint` takes."""
    if session is not None and (not isinstance(session, str) or not 1 <= len(session) <= MAX_SESSION_CHARS
                                or not session.isascii() or not session.isprintable()):
        raise HintError("bad_session", f"session must be 1-{MAX_SESSION_CHARS} printable ASCII characters, "
                                       f"got {session!r:.60}")  # a client's string: bounded in logs
    if retain_s is not None and (not _is_number(retain_s) or not 0 < retain_s <= limits.max_retain_s):
        raise HintError("bad_retain_s", f"retain_s must be a number in (0, {limits.max_retain_s:g}], got {retain_s!r:.60}")
    if not isinstance(closed, bool):
        raise HintError("bad_closed", f"closed must be true or false, got {closed!r:.60}")
    if closed and session is None:
        raise HintError("closed_without_session", "closed needs the session it closes")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class HintBook:
    """Sessions, doomed keys and retention deadlines, per key; knows nothing of tiers.

    Args:
        limits: the bounds.
        retain_slots: the last tier's slots, which the retention budgets are shares of.
        counts: the counter to bump (the manager's `Stats.hints`).
    """

    def __init__(self, limits: HintLimits, retain_slots: int, counts: dict) -> None:
        self.limits = limits
        self.now = -math.inf
        self._counts = counts
        self._sessions: dict[str, set[Hashable]] = {}  # open session -> its keys
        self._refs: dict[Hashable, int] = {}  # key -> open sessions that list it
        self._unhinted: set[Hashable] = set()  # keys a request without a session used
        self._closed: set[Hashable] = set()  # keys some session closed on; doomed while refs are 0
        self._until: dict[Hashable, float] = {}  # key -> retention deadline
        self._retainer: dict[Hashable, str] = {}  # key -> the tenant charged for it
        self._deadlines: list[tuple[float, int, Hashable]] = []  # heap; stale where until differs
        self._num_pushed = 0
        self._retained: dict[str, int] = {}  # tenant -> keys retained now
        self._tenant_cap = math.floor(limits.retain_fraction_per_tenant * retain_slots)
        self._total_cap = math.floor(limits.retain_fraction * retain_slots)

    def advance(self, now: float) -> list[Hashable]:
        """Moves the clock to `now` (never back); returns the keys whose deadlines lapsed by then."""
        if now > self.now:
            self.now = now
        heap, until, lapsed = self._deadlines, self._until, []
        while heap and heap[0][0] <= self.now:
            deadline, _, key = heapq.heappop(heap)
            if until.get(key) == deadline:
                del until[key]
                self._retained[self._retainer.pop(key)] -= 1
                lapsed.append(key)
        return lapsed

    def use(self, keys: Iterable[Hashable], session: str | None) -> None:
        """Records that a request used `keys`, in `session` (None: a request without one)."""
        if session is None:
            self._unhinted.update(keys)
            return
        listed = self._sessions.pop(session, None)  # back in last: sessions in order of last use
        if listed is None:
            listed = set()
            if len(self._sessions) >= self.limits.max_sessions:
                self._forget_oldest_session()
        self._sessions[session] = listed
        refs, cap = self._refs, self.limits.max_session_blocks
        for key in keys:
            if key in listed:
                continue
            if len(listed) >= cap:
                self._counts["session_blocks_over"] += 1
                self._unhinted.add(key)
                continue
            listed.add(key)
            refs[key] = refs.get(key, 0) + 1

    def _forget_oldest_session(self) -> None:
        """Makes room for a new session: the least recently used one is forgotten (a client that
        never said it closed), its keys counted as used without a session, so that no later close
        can doom what it may still come back for. A table full of abandoned sessions thus never
        shuts hints off for new ones."""
        listed = self._sessions.pop(next(iter(self._sessions)))
        refs = self._refs
        for key in listed:
            left = refs[key] - 1
            if left:
                refs[key] = left
            else:
                del refs[key]
        self._unhinted.update(listed)
        self._counts["sessions_forgotten"] += 1

    def close(self, session: str) -> list[Hashable]:
        """Ends `session`; returns its keys that are doomed now (no open session, no unhinted use)."""
        listed = self._sessions.pop(session, None)
        if listed is None:
            return []
        self._counts["closed"] += 1
        refs, unhinted, doomed = self._refs, self._unhinted, []
        for key in listed:
            left = refs[key] - 1
            if left:
                refs[key] = left
                continue
            del refs[key]
            if key not in unhinted:
                self._closed.add(key)
                doomed.append(key)
        return doomed

    def doomed(self, key: Hashable) -> bool:
        """Whether `key` is doomed: every session that listed it closed, and no unhinted use."""
        return key in self._closed and key not in self._refs and key not in self._unhinted

    def retain(self, keys: Iterable[Hashable], retain_s: float, tenant: str) -> int:
        """Extends `keys`' deadlines to now + `retain_s`, within the budgets; returns how many are retained."""
        deadline = self.now + retain_s
        until, retained = self._until, self._retained
        num = 0
        for key in keys:
            old = until.get(key)
            if old is None:
                held = retained.get(tenant, 0)
                if held >= self._tenant_cap or len(until) >= self._total_cap:
                    self._counts["over_budget"] += 1
                    continue
                retained[tenant] = held + 1
                self._retainer[key] = tenant
            elif old >= deadline:
                num += 1
                continue
            until[key] = deadline
            self._num_pushed += 1
            heapq.heappush(self._deadlines, (deadline, self._num_pushed, key))
            num += 1
        return num

    def release(self, key: Hashable) -> None:
        """Ends `key`'s retention now, if any (a doomed key: the sessions that wanted it ended)."""
        if self._until.pop(key, None) is not None:
            self._retained[self._retainer.pop(key)] -= 1

    def retained(self, key: Hashable) -> bool:
        """Whether `key` is under a retention hint now."""
        until = self._until.get(key)
        return until is not None and until > self.now

    def num_retained(self, tenant: str | None = None) -> int:
        """Keys retained now, of `tenant` or of all."""
        return len(self._until) if tenant is None else self._retained.get(tenant, 0)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def prune(self, indexed: Callable[[Hashable], bool], keep: int) -> None:
        """Forgets unhinted and closed marks of keys no longer indexed, once there are over `keep`
        of them: they only matter for blocks that may still be evicted."""
        if len(self._unhinted) > keep:
            self._unhinted = {k for k in self._unhinted if indexed(k)}
        if len(self._closed) > keep:
            self._closed = {k for k in self._closed if indexed(k)}


class DoomedQueues:
    """Per tier, the doomed keys in the order they were doomed; see the module's docstring.

    Args:
        book: whose `doomed` decides whether an entry still counts.
        tiers: the tier kinds.
    """

    def __init__(self, book: HintBook, tiers: Iterable) -> None:
        self.book = book
        self.queues = {tier: deque() for tier in tiers}

    def push(self, tier, key: Hashable) -> None:
        self.queues[tier].append(key)

    def pop(self, tier, usable: Callable[[Hashable], int | None], pending: Callable[[Hashable], bool]) -> int | None:
        """The slot of the first queued doomed key of `tier` that `usable` gives a slot for, or
        None. Entries passed over leave the queue (stale, or busy), but for those still `pending`
        (a copy being written there: a doomed block on its way down), which go to its back."""
        queue, doomed = self.queues[tier], self.book.doomed
        for _ in range(len(queue)):  # one pass at most
            key = queue.popleft()
            if doomed(key):
                slot = usable(key)
                if slot is not None:
                    return slot
                if pending(key):
                    queue.append(key)
        return None
