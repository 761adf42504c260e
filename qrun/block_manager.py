"""Paged KV-cache bookkeeping: block allocation, reference counts and prefix caching.

A full block is named by a SHA-256 chained from its predecessor's name and its own token ids;
a hit also compares the token ids, so no collision can hand a sequence foreign K/V. Blocks that
no sequence references but that still hold a named prefix stay cached until the pool needs
them, least recently freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from qrun.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # unreferenced and holding no prefix
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, still cached
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write, for the runner
        self.prefix_queries = 0  # prompt tokens looked up, for the hit rate
        self.prefix_hits = 0
        # Sequences' references to blocks, summed: 0 whenever no sequence holds a block. Kept as
        # ref counts change rather than summed, since /metrics' snapshot reads it every step.
        self.num_references = 0

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        self.num_references += 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1
        self.num_references += 1

    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Cached block ids (and their hashes) holding the longest prefix of `seq`'s tokens.

        At least one token is always left to compute, since sampling needs its logits.
        """
        if not self.enable_prefix_caching:
            return [], []
        tokens = seq.token_ids
        hits, hashes, parent = [], [], b""
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tokens[i * self.block_size:(i + 1) * self.block_size]
            parent = block_hash(parent, chunk)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                break
            hits.append(block_id)
            hashes.append(parent)
        return hits, hashes

    def admit(self, seq: Sequence, token_budget: int, watermark: int = 0) -> int:
        """Give a waiting sequence its cached prefix blocks and blocks for its next tokens.

        Returns how many tokens it computes this step (at most `token_budget`), or 0, with
        nothing allocated, when that would leave fewer than `watermark` free blocks.
        """
        hits, hashes = self.match_prefix(seq)
        num_new = min(len(seq) - len(hits) * self.block_size, token_budget)
        unreferenced_hits = sum(self.blocks[b].ref_count == 0 for b in hits)
        needed = self.blocks_needed(len(hits) * self.block_size + num_new) - len(hits)
        if needed + unreferenced_hits + watermark > self.num_free_blocks:
            return 0
        for block_id in hits:
            self._ref(block_id)
        seq.block_table, seq.block_hashes = hits, hashes
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_queries += len(seq.prompt_token_ids)
            self.prefix_hits += seq.num_computed_tokens
        self.append_slots(seq, num_new)
        return num_new

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if self._needs_copy(seq):
            needed += 1
        return needed <= self.num_free_blocks

    def _needs_copy(self, seq: Sequence) -> bool:
        """The block the next token lands in is shared (after a fork): write a private copy."""
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self.blocks[seq.block_table[index]].ref_count > 1

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make `seq`'s block table cover its next `num_new_tokens` tokens (call can_append first)."""
        if self._needs_copy(seq):
            index = seq.num_computed_tokens // self.block_size
            src = seq.block_table[index]
            self.blocks[src].ref_count -= 1  # still referenced by the other sequence
            self.num_references -= 1
            dst = self._take_free_block()
            seq.block_table[index] = dst
            self.pending_copies.append((src, dst))
        while len(seq.block_table) < self.blocks_needed(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self._take_free_block())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent`; a shared partial block is copied on write."""
        for block_id in parent.block_table:
            self._ref(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def commit_computed(self, seq: Sequence) -> None:
        """Name the blocks `seq` has just filled so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            chunk = seq.tokens_between(i * self.block_size, (i + 1) * self.block_size)
            digest = block_hash(seq.block_hashes[-1] if seq.block_hashes else b"", chunk)
            seq.block_hashes.append(digest)
            block = self.blocks[seq.block_table[i]]
            # Another sequence may have cached the same prefix meanwhile: keep its block.
            if digest not in self.cached and block.hash is None:
                block.hash, block.token_ids = digest, tuple(chunk)
                self.cached[digest] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`; cached ones stay reusable until evicted.

        Freed in reverse so a sequence's tail blocks are evicted before the shared head.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            self.num_references -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_ids.append(block_id)
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix no sequence holds (benchmarks start each run cold)."""
        for block_id in self.evictable:
            block = self.blocks[block_id]
            del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
            self.free_ids.append(block_id)
        self.evictable.clear()

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
