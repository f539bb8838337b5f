"""Radix prefix cache of one replica, keyed by the traces' prefix-block hashes, with a HiCache tier.

SGLang's RadixAttention (Zheng et al., "SGLang: Efficient Execution of Structured Language Model
Programs", NeurIPS 2024; ``python/sglang/srt/mem_cache/radix_cache.py``) keeps the KV of finished
and running prompts in a radix tree over token ids and reuses the longest cached prefix of a new
prompt. Traces carry no token ids, only prefix-block hashes (Mooncake: 512 tokens per block,
Qwen-Bailian: 16), so the twin's tree has one node per block: a node is identified by its whole
path from the root (:class:`PathIndex`), so equal hashes after different prefixes never match.

Semantics reproduced:

- ``match``: the longest run of leading blocks resident on the device, then (HiCache) the run that
  continues in host memory. Host blocks are loaded back to the device before the prefill
  (``hiradix_cache.py: init_load_back``), at a cost the engine charges per token.
- Nodes used by a running request are locked (reference counted along the whole path); only
  unlocked leaves are evictable, least recently used first (``--radix-eviction-policy lru``, the
  0.5.23 default). A parent becomes a leaf once its last device child is evicted.
- HiCache (``--enable-hierarchical-cache``, ``write_through`` default): every block inserted on the
  device is also backed up in a host pool of ``hicache_ratio`` x the device pool. Host copies of
  device-resident blocks are pinned; only blocks already evicted from the device are evicted from
  the host, LRU first (``hiradix_cache.py: evict_host``). A block evicted from the device keeps its
  host copy and stays matchable.

Units: tokens. Time stamps are the engine's virtual seconds.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence


class PathIndex:
    """Interns block-hash paths: node ``(parent, hash)`` gets one integer id; the root is 0.

    Shared by every replica of a run and by the router, so a path is hashed once.
    """

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}
        self.depth: list[int] = [0]

    def path(self, hashes: Sequence[int]) -> list[int]:
        """Node ids of the prefix blocks ``hashes`` (one id per block, in order)."""
        nid, out = 0, []
        ids, depth = self._ids, self.depth
        for h in hashes:
            key = (nid, h)
            child = ids.get(key)
            if child is None:
                child = len(depth)
                ids[key] = child
                depth.append(depth[nid] + 1)
            out.append(child)
            nid = child
        return out


class _Node:
    __slots__ = ("children", "last", "parent", "ref", "tokens")

    def __init__(self, parent: int, tokens: int, last: float) -> None:
        self.parent, self.tokens, self.last = parent, tokens, last
        self.ref = 0
        self.children = 0  # device-resident children


class PrefixCache:
    """Device radix cache over block-path nodes plus an optional host (HiCache) tier.

    The engine owns the KV pool; this object only tracks which cached tokens occupy it
    (``device_tokens``) and how many of them could be freed now (``evictable_tokens``).

    Args:
        index: the run's path index (for node depths).
        host_capacity_tokens: HiCache host pool in tokens (0 = HiCache off).
    """

    def __init__(self, index: PathIndex, host_capacity_tokens: int = 0) -> None:
        self.index = index
        self.dev: dict[int, _Node] = {}
        self.device_tokens = 0
        self.evictable_tokens = 0
        self.host_cap = host_capacity_tokens
        self.host_only: OrderedDict[int, int] = OrderedDict()  # evicted from device, LRU order
        self.host_pinned: dict[int, int] = {}                   # backed up and device-resident
        self.host_tokens = 0
        self._heap: list[tuple[float, int, int]] = []           # (last access, -depth, node)
        self.evicted_tokens = 0
        self.loaded_back_tokens = 0

    # ---- queries ----
    def match(self, path: Sequence[int]) -> tuple[int, int]:
        """(device blocks, host blocks) of the longest cached prefix of ``path``."""
        nd = 0
        dev = self.dev
        for nid in path:
            if nid not in dev:
                break
            nd += 1
        nh = 0
        if self.host_cap:
            host = self.host_only
            for nid in path[nd:]:
                if nid not in host:
                    break
                nh += 1
        return nd, nh

    # ---- reference counting ----
    def lock(self, nodes: Sequence[int], now: float) -> None:
        """Reference device-resident ``nodes`` (a path prefix) for a running request."""
        for nid in nodes:
            n = self.dev[nid]
            if n.ref == 0:
                self.evictable_tokens -= n.tokens
            n.ref += 1
            n.last = now

    def unlock(self, nodes: Sequence[int], now: float) -> None:
        """Drop one reference from each of ``nodes``; unreferenced leaves become evictable."""
        for nid in nodes:
            n = self.dev[nid]
            n.ref -= 1
            n.last = now
            if n.ref == 0:
                self.evictable_tokens += n.tokens
                if n.children == 0:
                    heapq.heappush(self._heap, (now, -self.index.depth[nid], nid))

    # ---- residency changes ----
    def _make_resident(self, nid: int, parent: int, tokens: int, now: float) -> None:
        n = _Node(parent, tokens, now)
        self.dev[nid] = n
        self.device_tokens += tokens
        self.evictable_tokens += tokens  # ref 0 until the caller locks it
        if parent in self.dev:
            self.dev[parent].children += 1

    def insert(self, path: Sequence[int], start: int, block_tokens: int, now: float) -> None:
        """Make blocks ``path[start:]`` device-resident (those not already there).

        The caller then locks ``path``; the prefix ``path[:start]`` must be resident already.
        With HiCache each new block is written through to the host pool if it has room.
        """
        for i in range(start, len(path)):
            nid = path[i]
            if nid in self.dev:
                continue
            parent = path[i - 1] if i else 0
            if nid in self.host_only:  # same block came back by recomputation
                del self.host_only[nid]
                self.host_pinned[nid] = block_tokens
            self._make_resident(nid, parent, block_tokens, now)
            if self.host_cap and nid not in self.host_pinned and self._host_room(block_tokens):
                self.host_pinned[nid] = block_tokens
                self.host_tokens += block_tokens

    def load_back(self, path: Sequence[int], start: int, count: int, now: float) -> int:
        """Move host blocks ``path[start:start+count]`` back to the device; returns tokens moved."""
        moved = 0
        for i in range(start, start + count):
            nid = path[i]
            tokens = self.host_only.pop(nid)
            self.host_pinned[nid] = tokens
            self._make_resident(nid, path[i - 1] if i else 0, tokens, now)
            moved += tokens
        self.loaded_back_tokens += moved
        return moved

    def _host_room(self, tokens: int) -> bool:
        while self.host_tokens + tokens > self.host_cap and self.host_only:
            _, t = self.host_only.popitem(last=False)
            self.host_tokens -= t
        return self.host_tokens + tokens <= self.host_cap

    def evict(self, tokens: int) -> int:
        """Free at least ``tokens`` device tokens from unreferenced LRU leaves if possible.

        Returns:
            Tokens freed (may be less than asked when too few are evictable).
        """
        freed = 0
        heap, dev = self._heap, self.dev
        while freed < tokens and heap:
            last, _, nid = heapq.heappop(heap)
            n = dev.get(nid)
            if n is None or n.ref or n.children or n.last != last:
                continue  # stale entry
            del dev[nid]
            self.device_tokens -= n.tokens
            self.evictable_tokens -= n.tokens
            self.evicted_tokens += n.tokens
            freed += n.tokens
            if nid in self.host_pinned:
                self.host_only[nid] = self.host_pinned.pop(nid)  # most recent end
            p = dev.get(n.parent)
            if p is not None:
                p.children -= 1
                if p.children == 0 and p.ref == 0:
                    heapq.heappush(heap, (p.last, -self.index.depth[n.parent], n.parent))
        return freed
