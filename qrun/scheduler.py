"""Which tokens of which sequences go into the next forward pass.

One step is one flat batch under a token budget and a sequence cap. Running sequences come
first (a decode costs one token, an unfinished prefill continues in chunks); the remaining
budget admits waiting sequences in arrival order, each prefilling as much as fits. Blocks are
allocated as tokens arrive; when the pool runs dry the newest running sequence is preempted:
its blocks go back (named prefixes stay cached) and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qrun.block_manager import BlockManager
from qrun.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the step
    preempted: list[Sequence] = field(default_factory=list)
    # decode steps run back to back (Scheduler.decode_steps): each sequence computes one token a
    # step, the token the step before picked (greedy or drawn: ModelRunner.decode)
    steps: int = 1

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens) * self.steps

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        blocks = self.block_manager

        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted by an earlier sequence of this loop
                continue
            if budget == 0:
                break
            wanted = min(seq.num_uncomputed_tokens, budget)
            while not blocks.can_append(seq, wanted):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            blocks.append_slots(seq, wanted)
            batch.seqs.append(seq)
            batch.num_tokens.append(wanted)
            budget -= wanted

        # A preemption this step means memory is short: admitting now would only thrash. The
        # watermark keeps a few blocks for running sequences to grow into.
        watermark = max(1, blocks.num_blocks // 100)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            wanted = blocks.admit(seq, budget, watermark if self.running else 0)
            if not wanted:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(wanted)
            budget -= wanted

        batch.block_copies, blocks.pending_copies = blocks.pending_copies, []
        return batch

    def decode_steps(self, batch: ScheduledBatch, steps: int) -> None:
        """Let `batch` run `steps` decode steps back to back where every sequence decodes one token
        of its output, nobody waits (a sequence that finishes within the run would hold back no
        one's admission) and the pool holds the slots of all `steps` tokens; else it stays one step."""
        blocks = self.block_manager
        if (steps < 2 or self.waiting or batch.preempted
                or any(n != 1 or not seq.output_token_ids for seq, n in zip(batch.seqs, batch.num_tokens))):
            return
        needed = sum(blocks.blocks_needed(seq.num_computed_tokens + steps) - len(seq.block_table) for seq in batch.seqs)
        if needed > blocks.num_free_blocks:
            return
        for seq in batch.seqs:
            blocks.append_slots(seq, steps)
        batch.steps = steps

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Run `children` right after `parent`, sharing its blocks (its other samples, n > 1):
        they sample their first token with it, and are preempted before it."""
        position = self.running.index(parent) + 1
        for child in children:
            self.block_manager.fork(parent, child)
            child.status = Status.RUNNING
            child.num_cached_tokens = parent.num_cached_tokens
        self.running[position:position] = children

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
