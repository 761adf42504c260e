"""Property tests of the scheduler and block manager over random arrivals, lengths, aborts
and cache sizes, with a stand-in for the model that 'samples' deterministic tokens."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from qrun.block_manager import BlockManager
from qrun.sampling_params import SamplingParams
from qrun.scheduler import Scheduler
from qrun.sequence import Sequence, Status

PREFIXES = [[7] * 40, list(range(100, 137))]  # shared prompt heads, to exercise prefix caching


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(4, 60),
                budget=st.integers(4, 96), max_seqs=st.integers(1, 8), caching=st.booleans())
    def setup(self, block_size, num_blocks, budget, max_seqs, caching):
        self.blocks = BlockManager(num_blocks, block_size, caching)
        self.scheduler = Scheduler(self.blocks, max(budget, max_seqs), max_seqs)
        self.budget = max(budget, max_seqs)
        self.seqs: list[Sequence] = []
        self.arrival: dict[int, int] = {}
        self.steps = 0

    @rule(prefix=st.sampled_from([None, 0, 1]), extra=st.integers(1, 50), max_tokens=st.integers(1, 30),
          n=st.sampled_from([1, 1, 1, 2]))
    def add_request(self, prefix, extra, max_tokens, n):
        prompt = (PREFIXES[prefix] if prefix is not None else []) + [len(self.seqs) % 50 + j for j in range(extra)]
        if self.blocks.blocks_needed(len(prompt) + max_tokens) * n > self.blocks.num_blocks:
            return  # the engine rejects these at add_request
        for index in range(n):  # n completions as independent sequences (the engine forks instead)
            seq = Sequence(len(self.seqs), f"r{len(self.seqs)}", index, list(prompt),
                           SamplingParams(max_tokens=max_tokens), detokenizer=None, arrival_time=0.0)
            self.arrival[seq.seq_id] = len(self.arrival)
            self.seqs.append(seq)
            self.scheduler.add(seq)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(decode_steps=st.integers(1, 6))
    def step(self, decode_steps=1):
        self.steps += 1
        batch = self.scheduler.schedule()
        # capped as the engine caps it: no sequence decodes past max_tokens
        self.scheduler.decode_steps(batch, min([decode_steps] + [s.params.max_tokens - len(s.output_token_ids)
                                                                 for s in batch.seqs]))
        assert batch.steps == 1 or (not self.scheduler.waiting and set(batch.num_tokens) == {1})
        assert batch.total_tokens <= self.budget * batch.steps
        assert len(batch.seqs) <= self.scheduler.max_num_seqs
        assert len(set(map(id, batch.seqs))) == len(batch.seqs)
        assert all(n > 0 for n in batch.num_tokens)
        if self.scheduler.running:
            assert batch, "sequences are running but nothing was scheduled"
        for seq, n in zip(batch.seqs, batch.num_tokens):
            assert seq.status is Status.RUNNING
            assert len(seq.block_table) * self.blocks.block_size >= seq.num_computed_tokens + n * batch.steps
        for seq, n in zip(batch.seqs, batch.num_tokens):
            for _ in range(batch.steps):
                seq.num_computed_tokens += n
                self.blocks.commit_computed(seq)
                if seq.num_computed_tokens == len(seq):
                    seq.output_token_ids.append((seq.seq_id * 31 + len(seq)) % 97)
                    if len(seq.output_token_ids) >= seq.params.max_tokens:
                        seq.status = Status.FINISHED
                        self.scheduler.finish(seq)
                        break

    @precondition(lambda self: any(not s.finished for s in self.seqs))
    @rule(pick=st.integers(0, 10_000))
    def abort(self, pick):
        live = [s for s in self.seqs if not s.finished]
        seq = live[pick % len(live)]
        seq.status = Status.FINISHED
        self.scheduler.finish(seq)

    @invariant()
    def reference_counts_match_block_tables(self):
        if not hasattr(self, "blocks"):
            return
        held = Counter(b for s in self.scheduler.running for b in s.block_table)
        for block in self.blocks.blocks:
            assert block.ref_count == held[block.block_id], f"block {block.block_id} leaked or freed twice"
        assert self.blocks.num_references == sum(held.values())
        unreferenced = {b.block_id for b in self.blocks.blocks if b.ref_count == 0}
        assert set(self.blocks.free_ids) | set(self.blocks.evictable) == unreferenced
        assert not set(self.blocks.free_ids) & set(self.blocks.evictable)
        assert len(self.blocks.free_ids) == len(set(self.blocks.free_ids))
        for digest, block_id in self.blocks.cached.items():
            assert self.blocks.blocks[block_id].hash == digest
        assert all(not s.block_table for s in self.scheduler.waiting)

    @invariant()
    def caps_hold_and_queue_is_fcfs(self):
        if not hasattr(self, "blocks"):
            return
        assert len(self.scheduler.running) <= self.scheduler.max_num_seqs
        for waiting in self.scheduler.waiting:
            if waiting.num_preemptions == 0:
                for running in self.scheduler.running:
                    assert self.arrival[running.seq_id] < self.arrival[waiting.seq_id], \
                        "a later request runs while an earlier one waits"

    def teardown(self):
        if not hasattr(self, "blocks"):
            return
        for _ in range(5000):
            if not self.scheduler.has_unfinished():
                break
            self.step()
        assert not self.scheduler.has_unfinished(), "an admitted request never finished"
        assert all(b.ref_count == 0 for b in self.blocks.blocks)
        assert self.blocks.num_free_blocks == self.blocks.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_scheduler_and_block_manager_invariants = SchedulerMachine.TestCase
