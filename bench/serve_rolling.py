"""The chat-hints workload of bench_serve.py: a rolling population of conversations whose client
tells kvtier which conversation a request belongs to and when a conversation ends (issue 32, part 4).

Why this shape. Session hints (`kv_transfer_params.kvtier.session`, and `closed: true` on a
conversation's last turn) let kvtier evict first the blocks that only closed conversations used.
That can only matter where (a) conversations END while others are still live and new ones start,
so that the cache holds finished contexts beside live ones, and (b) kvtier's DRAM cannot hold
every context it has seen, so that something must go. Then recency alone (LRU) may evict a live
conversation's prefix that was touched a little longer ago than a finished one's, and that
conversation's next turn recomputes it; with the hints the finished ones go first.

The population: `num_live` slots, each always holding one live conversation. A conversation lasts
`num_turns` turns; slot i's first one lasts `num_turns - i % num_turns` (so conversations end at
every step, not all at once), and when one ends its slot starts a new one at the next step. Every
step sends one turn of every live conversation, in an order shuffled per step (users do not
answer in a fixed order), `concurrency` at a time; a step waits for all its answers (a turn's
prompt is the conversation's history: its random context, then (user tokens, answer) per turn).
Prompts go as token ids, greedy, so every configuration gets exactly the same requests and must
give the same answers. The schedule and the prompts depend on the seed only, never on timing.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from serve_workloads import ChatResult, Completion, complete, random_tokens


@dataclass(frozen=True, slots=True)
class RollingSpec:
    num_live: int  # conversations live at every step
    num_turns: int  # turns of a whole conversation
    num_steps: int  # steps of the workload: each sends one turn of every live conversation
    context_tokens: int  # a conversation's random context before its first user tokens
    user_tokens: int
    output_tokens: int
    concurrency: int

    def __post_init__(self) -> None:
        for name in ("num_live", "num_turns", "num_steps", "context_tokens", "user_tokens", "output_tokens",
                     "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"RollingSpec.{name} must be at least 1, not {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of the workload: turn `turn` (0: its first) of conversation `session`."""

    slot: int
    generation: int  # how many conversations the slot held before this one
    turn: int
    last: bool  # the conversation's closing turn

    @property
    def session(self) -> str:
        return f"s{self.slot}g{self.generation}"

    @property
    def key(self) -> str:
        return f"{self.session}t{self.turn}"


def turn_at(spec: RollingSpec, slot: int, step: int) -> Turn:
    """What slot `slot` sends at step `step`."""
    offset = slot % spec.num_turns  # the slot's first conversation starts this many turns short
    phase = step + offset
    generation = phase // spec.num_turns
    turn = phase % spec.num_turns - (offset if generation == 0 else 0)
    return Turn(slot, generation, turn, last=phase % spec.num_turns == spec.num_turns - 1)


def schedule(spec: RollingSpec, seed: int) -> list[list[Turn]]:
    """Every step's turns, in the order they are sent (shuffled per step, by `seed`)."""
    rng = random.Random(f"rolling-order-{seed}")
    steps = []
    for step in range(spec.num_steps):
        turns = [turn_at(spec, slot, step) for slot in range(spec.num_live)]
        rng.shuffle(turns)
        steps.append(turns)
    return steps


def session_hint(turn: Turn) -> dict:
    """kvtier's `kv_transfer_params` for `turn`: its session, and `closed` on its last turn."""
    hint: dict = {"session": turn.session}
    if turn.last:
        hint["closed"] = True
    return {"kvtier": hint}


def prompt_tokens(spec: RollingSpec, turn: int) -> int:
    """The prompt length of a conversation's turn `turn`: context, `turn + 1` user parts, `turn` answers."""
    return spec.context_tokens + (turn + 1) * spec.user_tokens + turn * spec.output_tokens


def footprint_blocks(spec: RollingSpec, block_tokens: int) -> dict[str, int]:
    """What the workload asks of a cache, in full blocks of `block_tokens`: `live_peak_blocks`, the
    most that the live conversations' prompts hold at one step (what a cache must keep for every
    later turn to hit); `seen_blocks`, the distinct prompt blocks of the whole run (live and
    finished); `num_conversations` and `num_closed` (those whose last turn ran)."""
    steps = [[turn_at(spec, slot, step) for slot in range(spec.num_live)] for step in range(spec.num_steps)]
    held = [sum(prompt_tokens(spec, t.turn) // block_tokens for t in turns) for turns in steps]
    finals = [t for i, turns in enumerate(steps) for t in turns if t.last or i == spec.num_steps - 1]
    return {"live_peak_blocks": max(held), "seen_blocks": sum(prompt_tokens(spec, t.turn) // block_tokens
                                                              for t in finals),
            "num_conversations": len(finals), "num_closed": sum(1 for t in finals if t.last)}


def run_rolling_chat(host: str, port: int, model: str, spec: RollingSpec, seed: int, vocab_size: int,
                     hints: bool) -> ChatResult:
    """Runs `schedule(spec, seed)` step by step; with `hints`, every request carries `session_hint`.

    Returns the completions keyed by `Turn.key` (`ChatResult.ttfts_ms(first_turn=False)`: the
    turns that can hit). Raises OSError/RuntimeError as `complete` does.
    """
    rng = random.Random(f"rolling-{seed}")
    histories: dict[str, list[int]] = {}
    done: dict[str, Completion] = {}

    def send(turn: Turn, prompt: list[int]) -> Completion:
        return complete(host, port, model, prompt, spec.output_tokens,
                        kv_transfer_params=session_hint(turn) if hints else None)

    start = time.perf_counter()
    with ThreadPoolExecutor(spec.concurrency) as pool:
        for turns in schedule(spec, seed):
            for t in turns:  # drawn in send order, the same for every configuration
                if t.session not in histories:
                    histories[t.session] = random_tokens(rng, spec.context_tokens, vocab_size)
                histories[t.session].extend(random_tokens(rng, spec.user_tokens, vocab_size))
            prompts = [list(histories[t.session]) for t in turns]
            for t, result in zip(turns, pool.map(send, turns, prompts)):
                done[t.key] = result
                histories[t.session].extend(result.token_ids)
                if t.last:
                    del histories[t.session]
    return ChatResult(done, time.perf_counter() - start)
