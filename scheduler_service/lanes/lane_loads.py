"""Outstanding work per worker lane, in tokens: data parallelism sends each new request to the lane
with the least.

A request counts on its lane its prompt until its first token arrives (the prompt is then computed)
and the tokens it may still generate: max_tokens (capped by the context) minus those delivered. It
stops counting when it ends, however it ends. Every change is O(1) (a request's admission, each of
its deltas, its end), so picking a lane costs O(lanes), never O(requests). Counting requests instead
would send the next request to a lane that holds as many requests but far more work.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

Lane = TypeVar("Lane", bound=Hashable)


class Charge:
    """What one request still counts on its lane."""

    __slots__ = ("lane", "num_prompt_tokens", "num_output_tokens")

    def __init__(self, lane: Hashable, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.lane = lane
        self.num_prompt_tokens = num_prompt_tokens  # until the first token
        self.num_output_tokens = num_output_tokens  # the most it may still generate

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


class LaneLoads:
    """The one owner of the per-lane counts; every charge it hands out goes back through it."""

    def __init__(self) -> None:
        self._lane_to_num_tokens: dict[Hashable, int] = {}

    def num_tokens(self, lane: Hashable) -> int:
        return self._lane_to_num_tokens.get(lane, 0)

    def least_loaded(self, lanes: Sequence[Lane]) -> Lane:
        """The lane with the least outstanding work (the first of equals)."""
        return min(lanes, key=self.num_tokens)

    def admit(self, lane: Hashable, num_prompt_tokens: int, max_output_tokens: int) -> Charge:
        charge = Charge(lane, num_prompt_tokens, max_output_tokens)
        self._lane_to_num_tokens[lane] = self.num_tokens(lane) + charge.num_tokens
        return charge

    def progress(self, charge: Charge, num_new_tokens: int) -> None:
        """num_new_tokens were delivered: the prompt is computed, and so many fewer may follow."""
        num_outputs = min(num_new_tokens, charge.num_output_tokens)
        self._lane_to_num_tokens[charge.lane] -= charge.num_prompt_tokens + num_outputs
        charge.num_prompt_tokens = 0
        charge.num_output_tokens -= num_outputs

    def finish(self, charge: Charge) -> None:
        """The request ended: whatever it still counted goes (called once per charge)."""
        self._lane_to_num_tokens[charge.lane] -= charge.num_tokens
        charge.num_prompt_tokens = charge.num_output_tokens = 0
