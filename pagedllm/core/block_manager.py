"""The KV block pool: free queue, ref counts, per-request block tables, automatic prefix
caching, and the CPU pool that swapped-out requests live in. Pure Python, no torch.

Prefix caching: a full block is named by a chained hash,

    h0 = H(ROOT, tokens[0:bs])   h1 = H(h0, tokens[bs:2bs])   ...

so equal hashes mean equal prefixes. A block's hash is registered as soon as the step that
fills it is scheduled (its K/V are written in that step's forward, before any attention of
the same layer reads them, so a request in the same step may already share it). Freed blocks
keep their hash and sit in the free queue in LRU order until their memory is needed:

    free queue:  front [ never-hashed ... | least recently used cached ... most recent ] back
    allocation pops the front; a cached block popped there is evicted from the hash map.

Invariants (`check_invariants`): a block is in the free queue iff its ref count is 0; every
hash in the map names a block that carries that hash; no request holds a freed block.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from pagedllm.core.request import Request

_ROOT_HASH = 0x9E3779B97F4A7C15


def hash_block(parent: int, token_ids: list[int] | tuple[int, ...]) -> int:
    h = xxhash.xxh3_64()
    h.update(parent.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept to double-check a hash hit


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_cpu_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.req_blocks: dict[str, list[int]] = {}
        self.req_num_hashed: dict[str, int] = {}  # how many leading blocks are registered
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.req_cpu_blocks: dict[str, list[int]] = {}
        # counters, in tokens (vLLM's meaning of prefix-cache queries and hits)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- state -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------
    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks that prefixes the request. At least one token is
        always left to compute, so that the request's last position yields logits."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hits: list[int] = []
        tokens = request.all_token_ids
        for i, h in enumerate(self._block_hashes(request, max_blocks)):
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(tokens[i * bs : (i + 1) * bs]):
                break
            hits.append(bid)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self.req_blocks[rid]
        # only blocks of known tokens: a token sampled by a step in flight is not known yet
        num_full = min(min(num_tokens, request.num_tokens) // self.block_size, len(table))
        start = self.req_num_hashed.get(rid, 0)
        if num_full <= start:
            return
        bs = self.block_size
        hashes = self._block_hashes(request, num_full)
        tokens = request.all_token_ids
        for i in range(start, num_full):
            blk = self.blocks[table[i]]
            if blk.block_hash is None and hashes[i] not in self.hash_to_block:
                blk.block_hash = hashes[i]
                blk.token_ids = tuple(tokens[i * bs : (i + 1) * bs])
                self.hash_to_block[hashes[i]] = blk.block_id
        self.req_num_hashed[rid] = num_full

    # ---- allocation ------------------------------------------------------------------
    def _pop_free_block(self) -> int:
        if not self.free_queue:
            raise NoFreeBlocksError("no free KV blocks")
        bid, _ = self.free_queue.popitem(last=False)
        blk = self.blocks[bid]
        if blk.block_hash is not None:  # evict from the prefix cache
            if self.hash_to_block.get(blk.block_hash) == bid:
                del self.hash_to_block[blk.block_hash]
            blk.block_hash = None
            blk.token_ids = None
        blk.ref_cnt = 1
        return bid

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        table = self.req_blocks.get(request.request_id, ())
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.num_blocks_needed(num_computed + num_new_tokens) - len(table) - len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        return max(need, 0) + reclaimed <= len(self.free_queue)

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (counting the
        prefix-cache hits in `computed_blocks`, which the request takes a reference on).
        Returns False and changes nothing when there are not enough free blocks."""
        rid = request.request_id
        table = self.req_blocks.get(rid)
        if table is not None and not computed_blocks:  # fast path: a running request
            total = request.num_computed_tokens + num_new_tokens
            if -(-total // self.block_size) <= len(table):
                if self.enable_prefix_caching and min(
                    total, request.num_tokens
                ) // self.block_size > self.req_num_hashed.get(rid, 0):
                    self._register_full_blocks(request, total)
                return True
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            return False
        table = self.req_blocks.setdefault(rid, [])
        for bid in computed_blocks:
            blk = self.blocks[bid]
            if blk.ref_cnt == 0:
                del self.free_queue[bid]
            blk.ref_cnt += 1
            table.append(bid)
        if computed_blocks:
            self.req_num_hashed[rid] = len(table)
        num_total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        for _ in range(self.num_blocks_needed(num_total) - len(table)):
            table.append(self._pop_free_block())
        self._register_full_blocks(request, num_total)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks. Cached ones stay reusable until evicted; the tail of
        the sequence is queued for eviction before its head."""
        rid = request.request_id
        self.req_num_hashed.pop(rid, None)
        table = self.req_blocks.pop(rid, None)
        if not table:
            return
        for bid in reversed(table):
            blk = self.blocks[bid]
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self.free_queue[bid] = None
                if blk.block_hash is None:
                    self.free_queue.move_to_end(bid, last=False)

    def reset_prefix_cache(self) -> bool:
        if len(self.free_queue) != self.num_blocks:
            return False
        for blk in self.blocks:
            blk.block_hash, blk.token_ids = None, None
        self.hash_to_block.clear()
        return True

    # ---- swap ------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return len(self.req_blocks.get(request.request_id, ())) <= len(self.cpu_free)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the CPU pool: returns (gpu_block, cpu_block) copies,
        which the worker must run before this step's forward writes anything."""
        table = self.req_blocks.get(request.request_id, [])
        cpu_blocks = [self.cpu_free.pop() for _ in table]
        self.req_cpu_blocks[request.request_id] = cpu_blocks
        mapping = list(zip(table, cpu_blocks))
        self.free(request)
        return mapping

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        n = len(self.req_cpu_blocks.get(request.request_id, ()))
        need = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
        return max(n, need) <= len(self.free_queue)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring the request's blocks back: returns (cpu_block, gpu_block) copies."""
        cpu_blocks = self.req_cpu_blocks.pop(request.request_id)
        table = self.req_blocks.setdefault(request.request_id, [])
        assert not table, "a swapped-out request holds no GPU blocks"
        for _ in cpu_blocks:
            table.append(self._pop_free_block())
        self.cpu_free.extend(reversed(cpu_blocks))
        self._register_full_blocks(request, request.num_computed_tokens)
        return list(zip(cpu_blocks, table))

    def free_swapped(self, request: Request) -> None:
        cpu_blocks = self.req_cpu_blocks.pop(request.request_id, None)
        if cpu_blocks:
            self.cpu_free.extend(reversed(cpu_blocks))

    # ---- checks ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        refs = [0] * self.num_blocks
        for table in self.req_blocks.values():
            for bid in table:
                refs[bid] += 1
        for blk in self.blocks:
            assert blk.ref_cnt == refs[blk.block_id], f"block {blk.block_id}: ref {blk.ref_cnt} != {refs[blk.block_id]}"
            assert (blk.ref_cnt == 0) == (blk.block_id in self.free_queue), f"block {blk.block_id} free-queue mismatch"
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].block_hash == h
        held_cpu = sum(len(v) for v in self.req_cpu_blocks.values())
        assert held_cpu + len(self.cpu_free) == self.num_cpu_blocks
        assert len(set(self.cpu_free)) == len(self.cpu_free)
