"""Decides, each step, which sequences compute which tokens.

Policy: running sequences first, oldest first (a decode token each, or the next chunk of their
prompt), then waiting sequences in arrival order while the token budget (max_num_batched_tokens)
and max_num_seqs allow; a prompt longer than the remaining budget is prefilled in chunks. When the
pool runs out of blocks, the newest running sequence is preempted: its blocks are freed and it
waits at the front of the queue to be recomputed from its tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.contract.config import MAX_DECODE_STEPS, SchedulerConfig
from scheduler_service.core.block_manager import NO_PREFIX_HIT, BlockManager
from scheduler_service.core.sequence import FinishReason, ScheduledSequence, Sequence, SequenceStatus

# Steps of decodes alone whose periods give the time per iteration: the last 8, once there are 4.
DECODE_PERIOD_WINDOW = 8
MIN_DECODE_PERIODS = 4


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    released_seq_ids: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Decode iterations the worker runs in this step (> 1 only for a step of decodes alone).
    num_decode_steps: int = 1
    # Whether any sequence of the scheduler is constrained: only then do its rows need token masks
    # (or, with grammars_on_worker, its new sequences their grammar).
    has_constraints: bool = False
    # Whether the worker advances the grammars itself (NewSequence.grammar) rather than taking a mask per step.
    grammars_on_worker: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.released_seq_ids


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 grammars_on_worker: bool = False) -> None:
        """grammars_on_worker: the worker advances constrained sequences' grammars itself (their masks need
        not wait for the scheduler to know their last token)."""
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.grammars_on_worker = grammars_on_worker
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences the worker holds but must forget at the next step.
        self._to_release: list[int] = []
        self.num_preemptions = 0  # counter, for tests and metrics
        self.num_constrained = 0  # unfinished sequences with a constraint (structured output)
        # (iterations, seconds) of the last steps of decodes alone, for the time per iteration.
        self._decode_periods: deque[tuple[int, float]] = deque(maxlen=DECODE_PERIOD_WINDOW)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def has_released_seq_ids(self) -> bool:
        return bool(self._to_release)

    def take_released_seq_ids(self) -> list[int]:
        """Ids the worker must forget; each is handed out once."""
        ids, self._to_release = self._to_release, []
        return ids

    def take_unfinished(self) -> list[Sequence]:
        """Removes every unfinished sequence, running ones first (their blocks are the caller's to free)."""
        sequences = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        self.num_constrained = 0
        return sequences

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if seq.constraint_state is not None:
            self.num_constrained += 1

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(num_decode_steps=self._num_decode_steps(), has_constraints=self.num_constrained > 0,
                                 grammars_on_worker=self.grammars_on_worker)
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(output, budget)
        if not output.preempted and output.num_decode_steps == 1:
            self._schedule_waiting(output, budget)
        output.released_seq_ids = self.take_released_seq_ids()
        return output

    def observe_decode_period(self, num_decode_steps: int, period_s: float) -> None:
        """The wall time of a step of num_decode_steps decode iterations alone, from the previous step's
        result to its own (steps following without a gap): what sizes the next steps of decodes."""
        self._decode_periods.append((num_decode_steps, period_s))

    def _iteration_s(self) -> float:
        """Seconds per decode iteration over the last few steps (0: too few measured). A sum, not the
        last step alone: a reply held up (a CPU worker's model thread holding the GIL) makes one
        period short and the one before it long by the same time, and only their sum is right."""
        if len(self._decode_periods) < MIN_DECODE_PERIODS:
            return 0.0
        iterations = sum(n for n, _ in self._decode_periods)
        return sum(period for _, period in self._decode_periods) / iterations

    def _num_decode_steps(self) -> int:
        """Several decode iterations per step amortise the per-step host work over more tokens. Only
        when nothing waits for admission, every running sequence is decoding, and none needs its
        tokens on the host between iterations (penalties; a constraint, unless the worker advances
        the grammars: it reads each iteration's tokens of those rows back); never past max_model_len."""
        rows = len(self.running)
        if not rows or (self.waiting and rows < self.config.max_num_seqs):
            return 1
        if self.num_constrained and not self.grammars_on_worker:
            return 1  # a constrained sequence's next mask needs its last token, which only the worker has
        if rows * self.config.num_decode_steps > self.config.max_num_batched_tokens:
            return 1
        steps = min(self._decode_steps_in_time(), self.config.max_num_batched_tokens // rows)
        for seq in self.running:
            if seq.num_uncomputed_tokens != 1 or seq.sampling_params.needs_token_history:
                return 1
            steps = min(steps, self.max_model_len - seq.num_computed_tokens)
        return max(steps, 1)

    def _decode_steps_in_time(self) -> int:
        """num_decode_steps; for a lone sequence, more while they fit in decode_step_ms at the measured
        time per iteration (too few measured yet: num_decode_steps). Never for more sequences:
        they mean requests are arriving, and a longer step delays their admission (measured on an
        H200 at 8 requests/s: first token +10 ms at p50)."""
        steps = self.config.num_decode_steps
        iteration_s = self._iteration_s() if len(self.running) == 1 and self.config.decode_step_ms else 0.0
        if iteration_s:
            in_time = int(self.config.decode_step_ms / 1e3 / iteration_s)
            steps = max(steps, min(in_time, MAX_DECODE_STEPS))
        return steps

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(self._num_tokens_to_compute(seq), budget)
            if num_tokens == 1:
                num_tokens = output.num_decode_steps
            if num_tokens == 0:
                index += 1
                continue
            end = seq.num_computed_tokens + num_tokens
            while not self.block_manager.allocate_slots(seq, end):
                victim = self.running[-1]
                self._preempt(victim, output)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq itself was preempted: nothing newer is left to run
            output.scheduled.append(seq.schedule(num_tokens))
            budget -= num_tokens
            index += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        skipped: list[Sequence] = []  # samples waiting for their leader's prompt, in queue order
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.leader is not None and self._awaits_leader(seq):
                skipped.append(self.waiting.popleft())  # those behind it need not wait
                continue
            hit = NO_PREFIX_HIT if seq.needs_prompt_logprobs else self.block_manager.find_prefix_hit(seq)
            num_cached = len(hit.blocks) * self.block_manager.block_size
            num_tokens = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.admit(seq, hit, num_tokens):
                break
            self.waiting.popleft()
            seq.admit(num_cached)
            self.running.append(seq)
            output.scheduled.append(seq.schedule(num_tokens))
            budget -= num_tokens
        if skipped:  # back at the front, in order: admitted first once their leader's prompt is cached
            self.waiting.extendleft(reversed(skipped))

    def _awaits_leader(self, seq: Sequence) -> bool:
        """Whether seq, a sample of a request of n > 1, must wait: its leader (sample 0) is unfinished
        and the full blocks of its prompt are not in the prefix cache yet (registered after the reply of
        the step that computed them). Once they are, seq computes only the prompt's last partial block.
        Without prefix caching there is nothing to share. A leader preempted or recomputed after a lost
        worker holds no blocks: the samples wait for its prompt again."""
        leader = seq.leader
        if leader is None or leader.is_finished or not self.block_manager.enable_prefix_caching:
            return False
        num_shared_blocks = (leader.num_prompt_tokens - 1) // self.block_manager.block_size
        return len(leader.block_hashes) < num_shared_blocks

    def _num_tokens_to_compute(self, seq: Sequence) -> int:
        """Tokens seq can compute now; 0 when a step in flight will finish it anyway."""
        num_tokens = seq.num_scheduled_tokens_total
        if seq.num_pending_tokens and (
            # Its next mask depends on the pending token, unless the worker computes it (knowing the token).
            (seq.constraint_state is not None and not self.grammars_on_worker)
            or num_tokens >= self.max_model_len
            or num_tokens - seq.num_prompt_tokens >= seq.sampling_params.max_tokens  # outputs, pending included
        ):
            return 0
        return num_tokens - seq.num_computed_tokens

    def _preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.preempt()
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        output.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        """Frees seq's blocks and tells the worker to forget it at the next step."""
        if seq.is_on_worker:
            self._to_release.append(seq.seq_id)
        self.block_manager.free(seq)

    def finish(self, seq: Sequence, reason: FinishReason, matched_stop: str | int | None = None) -> None:
        """Marks seq finished, frees its blocks and tells the worker at the next step."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.constraint_state is not None:
            self.num_constrained -= 1
        self._release(seq)
        seq.finish(reason, matched_stop)
