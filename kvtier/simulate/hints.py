"""`kvtier simulate --hints`: derive retention hints for a trace, and measure what they are worth.

A trace may carry hints itself (`session`, `closed`, `retain_s` per line: kvtier/simulate/trace.py);
`--hints` derives them instead, from the hash ids and timestamps:

    session-end   conversations inferred from the past as `--servers` infers them
                  (kvtier/simulate/servers.py: a request joins the conversation that first listed
                  its deepest reused block, unless that block is common to many conversations);
                  every request carries its conversation's session, and the last request of each
                  conversation says `closed` (hindsight: a client that knows its chat ended).
    ttl=T         every request says `retain_s = T` (T in seconds: `300`, `300s`, `5m`).
    wrong=F       with session-end: a share F of the conversations of two requests or more say
                  `closed` one request early and then come back (a client that was wrong): their
                  last request reopens the session. Chosen by a seeded draw, the same every run.

Items combine with commas: `session-end,ttl=300s`, `session-end,wrong=0.2`.

`compare_hints` replays each configuration with and without hints, beside LRU and Belady at the same
tiers without hints, and reports the share of the LRU -> Belady gap each closes:
`gap_closed = (hits - hits_LRU) / (hits_Belady - hits_LRU)`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.simulate.replay import SimConfig, SimPolicy, simulate
from kvtier.simulate.servers import assign_conversations, common_blocks
from kvtier.simulate.trace import Trace

WRONG_SEED = 32  # the draw of the conversations whose hints are wrong (`wrong=F`)
_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class HintSpec:
    """What `--hints` asks for: session-end hints, a ttl, and the share of wrong session ends."""

    session_end: bool = False
    ttl_s: float | None = None
    wrong_share: float = 0.0

    @property
    def label(self) -> str:
        items = (["session-end"] if self.session_end else []) + ([f"ttl={self.ttl_s:g}s"] if self.ttl_s else [])
        return ",".join(items + ([f"wrong={self.wrong_share:g}"] if self.wrong_share else []))


def parse_hints(text: str) -> HintSpec:
    """`--hints`' value as a `HintSpec`.

    Raises:
        ConfigError: an unknown item, a bad ttl or share, an item twice, or wrong= without session-end.
    """
    fields: dict = {}
    seen: set[str] = set()
    for item in (part.strip() for part in text.split(",")):
        name, _, value = item.partition("=")
        if name in seen:
            raise ConfigError(f"hints: {name!r} given twice in {text!r}")
        seen.add(name)
        if item == "session-end":
            fields["session_end"] = True
        elif name == "ttl" and value:
            fields["ttl_s"] = _seconds(value, text)
        elif name == "wrong" and value:
            fields["wrong_share"] = _share(value, text)
        else:
            raise ConfigError(f"hints: unknown item {item!r} in {text!r}; expected session-end, ttl=300s, "
                              "wrong=0.1, comma-separated")
    spec = HintSpec(**fields)
    if spec.wrong_share and not spec.session_end:
        raise ConfigError(f"hints: wrong= needs session-end (it moves session ends), got {text!r}")
    return spec


def _seconds(value: str, text: str) -> float:
    unit = _UNITS_S.get(value[-1:].lower())
    try:
        seconds = float(value[:-1] if unit else value) * (unit or 1.0)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"hints: ttl must be a positive duration (300, 300s, 5m), got {value!r} in {text!r}")
    return seconds


def _share(value: str, text: str) -> float:
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 <= share <= 1:
        raise ConfigError(f"hints: wrong must be a share in [0, 1], got {value!r} in {text!r}")
    return share


def derive_hints(trace: Trace, spec: HintSpec) -> Trace:
    """`trace` with each request's hints derived as `spec` says (see the module docstring);
    hints the trace carried are replaced."""
    requests = trace.requests
    sessions: list[str | None] = [None] * len(requests)
    closes = [False] * len(requests)
    if spec.session_end:
        conversations = assign_conversations(trace, common_blocks(trace)[0])
        sessions = [f"c{c}" for c in conversations]
        last: dict[int, list[int]] = {}
        for i, c in enumerate(conversations):
            last.setdefault(c, []).append(i)
        draw = random.Random(WRONG_SEED)
        for members in last.values():
            closes[members[-1]] = True
            if len(members) >= 2 and spec.wrong_share and draw.random() < spec.wrong_share:
                closes[members[-2]] = True  # closed too early: the last request comes back
    hinted = tuple(dataclasses.replace(r, session=s, closed=c, retain_s=spec.ttl_s)
                   for r, s, c in zip(requests, sessions, closes))
    return dataclasses.replace(trace, requests=hinted)


def compare_hints(trace: Trace, hinted: Trace, configs: Sequence[SimConfig],
                  on_progress: Callable[[SimConfig, bool], Callable[[int], None] | None] = lambda c, h: None
                  ) -> list[dict]:
    """Per configuration: its hit rate without and with hints, and the share of the LRU -> Belady gap
    each closes, LRU and Belady replayed at the same tiers without hints.

    Args:
        trace: the trace without hints.
        hinted: the same requests with hints (`derive_hints`, or a trace that carried them).
        configs: the configurations to replay.
        on_progress: given a configuration and whether hinted, a progress callback or None.
    Returns:
        One row per configuration: label, tiers, hit rates, gap shares and the hint counters.
    """
    baselines: dict[tuple, dict] = {}

    def plain(config: SimConfig) -> dict:
        if config not in baselines:
            baselines[config] = simulate(trace, config, on_progress=on_progress(config, False))
        return baselines[config]

    rows = []
    for config in configs:
        lru = plain(dataclasses.replace(config, policy=SimPolicy.LRU))["block_hit_rate"]
        belady = plain(dataclasses.replace(config, policy=SimPolicy.BELADY))["block_hit_rate"]
        without = plain(config)["block_hit_rate"]
        run = simulate(hinted, config, on_progress=on_progress(config, True))
        gap = belady - lru

        def closed(rate: float) -> float | None:
            return (rate - lru) / gap if gap > 0 else None

        rows.append({"label": config.label, "tiers": {t.kind.name.lower(): t.num_slots for t in config.tiers},
                     "block_hit_rate": without, "block_hit_rate_hinted": run["block_hit_rate"],
                     "lru": lru, "belady": belady, "gap_closed": closed(without),
                     "gap_closed_hinted": closed(run["block_hit_rate"]), "engine_hinted": run["engine"],
                     "hints": run.get("hints", {})})
    return rows
