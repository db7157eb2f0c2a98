"""The pool node's authentication throttle without sockets, on a fake clock: free failures, a
backoff that doubles up to a cap, forgetting, a bounded table. (The node's front door under attack,
with real sockets: tests/attacks/test_attack_pool_admission.py.) Cost: well under a second.
"""

from __future__ import annotations

from kvtier.pool.node.admission import AuthThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_few_failures_are_free_then_each_one_doubles_the_wait_up_to_the_cap() -> None:
    clock = Clock()
    throttle = AuthThrottle(clock, free_failures=3, backoff_s=1.0, max_backoff_s=8.0)
    for _ in range(3):
        throttle.failed("10.0.0.1")
        assert throttle.retry_in("10.0.0.1") == 0.0
    waits = []
    for _ in range(6):
        throttle.failed("10.0.0.1")
        waits.append(throttle.retry_in("10.0.0.1"))
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert throttle.retry_in("10.0.0.2") == 0.0, "other peers are not held to it"
    clock.now += 8.0
    assert throttle.retry_in("10.0.0.1") == 0.0, "the wait is over"
    throttle.failed("10.0.0.1")
    assert throttle.retry_in("10.0.0.1") == 8.0, "the count is remembered: one more guess, the full wait"


def test_a_quiet_peer_is_forgotten_and_the_table_stays_bounded() -> None:
    clock = Clock()
    throttle = AuthThrottle(clock, free_failures=1, backoff_s=1.0, max_backoff_s=4.0, max_peers=100)
    throttle.failed("a")
    throttle.failed("a")
    clock.now += 8.1  # twice the cap without a failure
    assert throttle.retry_in("a") == 0.0 and len(throttle) == 0
    throttle.failed("a")
    assert throttle.retry_in("a") == 0.0, "a fresh start: one free failure again"
    for i in range(1000):
        throttle.failed(f"flood-{i}")
    assert len(throttle) == 100
