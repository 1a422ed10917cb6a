"""A simulator of PyTorch 2.11's CUDA caching allocator (native backend, one stream): the reserved peak
of a training step from the sequence of its allocations and frees, without a GPU.

Input: events ``("alloc", key, nbytes)``, ``("free", key)``, optionally ``("empty_cache",)`` and
``("reset_peak",)``. Output: what ``torch.cuda.memory_stats()`` would report: allocated / reserved bytes
(current and peak), segments, cudaMalloc / cudaFree counts, and the index of the event at each peak.

What is modelled, with the source of each rule (PyTorch 2.11.0, git 70d99e998b; constants read from the
wheel's own header ``torch/include/c10/core/AllocatorConfig.h``; the algorithm from
``c10/cuda/CUDACachingAllocator.cpp``, ``DeviceCachingAllocator``):

* ``round_size``: requests are rounded up to a multiple of kMinBlockSize = 512 bytes (at least 512);
  with ``roundup_power2_divisions`` configured, to the next power-of-2 division instead.
  A request of 0 bytes never reaches the allocator (``allocate(0)`` returns a null DataPtr).
* ``get_pool``: rounded size <= kSmallSize (1 MiB) -> the small pool, else the large pool.
* ``get_allocation_size``: a new segment (cudaMalloc) is kSmallBuffer = 2 MiB for small requests,
  ``large_segment_size`` (default kLargeBuffer = 20 MiB) for requests < kMinLargeAlloc = 10 MiB, and the
  request rounded up to kRoundLarge = 2 MiB otherwise.
* ``get_free_block``: best fit: ``pool.blocks.lower_bound(search_key)`` on a set ordered by
  (size, stream, address): the smallest cached free block >= the request, lowest address among equals.
  With ``max_split_size`` set: a request < max_split_size never takes a block >= max_split_size, and a
  request >= max_split_size takes a block only if it is < request + ``max_non_split_rounding_size``
  (default 20 MiB).
* ``should_split``: a small-pool block is split when the remainder is >= 512 bytes; a large-pool block
  when the request is < max_split_size and the remainder is > kSmallSize (1 MiB). An unsplit remainder
  stays inside the handed-out block and counts as *allocated* (``allocated_bytes`` adds ``block->size``,
  not the request): ``max_memory_allocated`` can exceed the sum of the tensors by up to 1 MiB per block.
* ``free_block``: a freed block merges with its free neighbours of the same segment (``try_merge_blocks``)
  and returns to its pool's cache. Cached segments are never given back to the driver unless
  ``empty_cache()`` runs or a cudaMalloc fails (``release_cached_blocks``), so reserved memory only grows
  during a step.
* ``alloc_block`` failure path (only with ``capacity`` set): first ``release_available_cached_blocks``
  (frees oversize cached blocks; only when max_split_size is set), then ``release_cached_blocks`` (frees
  every cached block that is a whole, unsplit segment), then one retry; then out of memory.

Validated on an NVIDIA H200 (torch 2.11.0+cu130, 2026-11-26): fed the segment addresses the driver
returned, the simulator put every allocation of four recorded programs (an MLP, ResNet-50, an STFT/conv
and a GRU training step) at the address the real allocator chose, made the same cudaMalloc calls and
ended with the same reserved peak (tests/data/h200-2026-11-26, packages/core/tests/test_allocator.py).

Not modelled: several streams (record_stream, cross-stream events), CUDA-graph private pools,
expandable segments (off by default in 2.11: ``use_expandable_segments_{false}`` in AllocatorConfig.h),
the garbage-collection threshold (acts only with a memory fraction set), the cudaMallocAsync backend.
Segment addresses are invented (each new segment above the last); the driver's real addresses only
decide ties between cached blocks of equal size (measured effect: +-1 segment of reserved memory on
fragmenting programs).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable

KiB = 1024
MiB = 1024 * 1024

# c10/core/AllocatorConfig.h (torch 2.11 wheel)
K_MIN_BLOCK_SIZE = 512  # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MiB  # largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MiB  # "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MiB  # allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2 * MiB  # round up large allocations to 2 MiB
K_LARGE_BUFFER = 20 * MiB  # AcceleratorAllocatorConfig::large_segment_size_ default (20 MiB)
UNLIMITED = 1 << 63  # std::numeric_limits<size_t>::max(): max_split_size's default


class UnsupportedConfig(ValueError):
    """A PYTORCH_CUDA_ALLOC_CONF setting the simulator does not model."""


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF knobs that change the native allocator's decisions (defaults = 2.11's)."""

    max_split_size: int = UNLIMITED  # max_split_size_mb (bytes here)
    max_non_split_rounding_size: int = 20 * MiB  # max_non_split_rounding_mb
    large_segment_size: int = K_LARGE_BUFFER  # large_segment_size_mb
    # roundup_power2_divisions: one int for every size, or 16 ints for the power-of-2 intervals from
    # 1 MiB (index 0: sizes below 2 MiB) up to 64 GiB, as AcceleratorAllocatorConfig stores them.
    roundup_power2_divisions: int | tuple[int, ...] = 0
    capacity: int | None = None  # bytes cudaMalloc may hand out in all; None: never fails

    @staticmethod
    def from_env(text: str | None, capacity: int | None = None) -> AllocatorConfig:
        """Parse a PYTORCH_CUDA_ALLOC_CONF string (the keys that change the decisions modelled here).
        Raises UnsupportedConfig for expandable segments and the cudaMallocAsync backend."""
        kw: dict = {}
        for part in _split_conf(text or ""):
            if ":" not in part:
                continue
            key, val = (s.strip() for s in part.split(":", 1))
            if key == "max_split_size_mb":
                kw["max_split_size"] = int(float(val) * MiB)
            elif key == "max_non_split_rounding_mb":
                kw["max_non_split_rounding_size"] = int(float(val) * MiB)
            elif key == "large_segment_size_mb":
                kw["large_segment_size"] = int(float(val) * MiB)
            elif key == "roundup_power2_divisions":
                kw["roundup_power2_divisions"] = _parse_divisions(val)
            elif key == "expandable_segments" and val.lower() in ("true", "1"):
                raise UnsupportedConfig("expandable_segments:True is not modelled")
            elif key == "backend" and val != "native":
                raise UnsupportedConfig(f"the {val} backend is not modelled")
        return AllocatorConfig(capacity=capacity, **kw)

    def divisions(self, size: int) -> int:
        d = self.roundup_power2_divisions
        if isinstance(d, int):
            return d
        log_size = size.bit_length() - 1
        start = 20  # log2(1 MiB)
        index = log_size - start if log_size > start else 0
        return d[min(index, len(d) - 1)]


def _split_conf(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


def _parse_divisions(val: str) -> int | tuple[int, ...]:
    """AcceleratorAllocatorConfig::parseRoundUpPower2Divisions (c10/core/AllocatorConfig.cpp): a single
    value applies to every interval; in a list, "MB:div" sets the interval of log2(MB) (the first entry
    also fills every interval below it) and ">:div" fills every interval after the last one set."""
    val = val.strip()
    if not val.startswith("["):
        return int(val)
    table = [0] * 16
    last_index = 0
    first = True
    for item in val.strip("[]").split(","):
        k, v = (s.strip() for s in item.split(":"))
        if k == ">":
            for i in range(last_index + 1, 16):
                table[i] = int(v)
            continue
        index = min(max(int(k).bit_length() - 1, 0), 15)
        if first:
            for i in range(index):
                table[i] = int(v)
            first = False
        table[index] = int(v)
        last_index = index
    return tuple(table)


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """CUDACachingAllocator.cpp roundup_power2_next_division."""
    if size <= 4 or divisions <= 1:
        return size
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    floor = size & ~(power2_division - 1)
    return size if floor == size else floor + power2_division


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """CUDACachingAllocator.cpp round_size."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if config is not None:
        divisions = config.divisions(size)
        if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
            return roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int, large_segment_size: int = K_LARGE_BUFFER) -> int:
    """CUDACachingAllocator.cpp get_allocation_size: the cudaMalloc size for a rounded request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment_size
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class Block:
    __slots__ = ("addr", "size", "small", "prev", "next", "allocated", "requested")

    def __init__(self, addr: int, size: int, small: bool) -> None:
        self.addr = addr
        self.size = size
        self.small = small
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.requested = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        state = "alloc" if self.allocated else "free"
        return f"Block({self.addr:#x}, {self.size}, {'small' if self.small else 'large'}, {state})"


class _Pool:
    """The cached free blocks of one pool, ordered as BlockComparatorSize orders them: (size, address)."""

    __slots__ = ("keys", "blocks")

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, Block] = {}

    def insert(self, b: Block) -> None:
        bisect.insort(self.keys, (b.size, b.addr))
        self.blocks[b.addr] = b

    def remove(self, b: Block) -> None:
        i = bisect.bisect_left(self.keys, (b.size, b.addr))
        del self.keys[i]
        del self.blocks[b.addr]

    def lower_bound(self, size: int) -> Block | None:
        i = bisect.bisect_left(self.keys, (size, -1))
        if i == len(self.keys):
            return None
        return self.blocks[self.keys[i][1]]


class OutOfMemory(Exception):
    pass


@dataclasses.dataclass
class Stats:
    allocated: int = 0
    reserved: int = 0
    requested: int = 0
    segments: int = 0
    active_blocks: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_requested: int = 0
    peak_segments: int = 0
    num_device_alloc: int = 0
    num_device_free: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0


class CachingAllocatorSim:
    """DeviceCachingAllocator for one device and one stream."""

    def __init__(self, config: AllocatorConfig | None = None, segment_addresses=None) -> None:
        self.config = config or AllocatorConfig()
        # Optional iterator of the addresses cudaMalloc returned in a recorded run (validation: with
        # the real addresses, ties between equal-sized cached blocks break as they did on the GPU).
        self._seg_addrs = iter(segment_addresses) if segment_addresses is not None else None
        self.small = _Pool()
        self.large = _Pool()
        self.stats = Stats()
        self.segment_log: list[int] = []  # sizes passed to cudaMalloc, in order
        self._next_addr = 1 << 32

    # -- malloc ------------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        cfg = self.config
        size = round_size(nbytes, cfg)
        small = size <= K_SMALL_SIZE
        pool = self.small if small else self.large
        block = self._get_free_block(pool, size)
        if block is None:
            alloc_size = allocation_size(size, cfg.large_segment_size)
            block = self._alloc_block(alloc_size, small)
            if block is None:
                self._release_available_cached_blocks(pool, size)
                block = self._alloc_block(alloc_size, small)
            if block is None:
                self._release_cached_blocks()
                self.stats.num_alloc_retries += 1
                block = self._alloc_block(alloc_size, small)
            if block is None:
                self.stats.num_ooms += 1
                raise OutOfMemory(
                    f"tried to allocate {alloc_size} bytes with {self.stats.reserved} reserved "
                    f"of capacity {cfg.capacity}"
                )
        return self._alloc_found_block(block, size, nbytes, pool)

    def _get_free_block(self, pool: _Pool, size: int) -> Block | None:
        b = pool.lower_bound(size)
        if b is None:
            return None
        cfg = self.config
        if size < cfg.max_split_size and b.size >= cfg.max_split_size:
            return None
        if size >= cfg.max_split_size and b.size >= size + cfg.max_non_split_rounding_size:
            return None
        pool.remove(b)
        return b

    def _alloc_block(self, alloc_size: int, small: bool) -> Block | None:
        st = self.stats
        cap = self.config.capacity
        if cap is not None and st.reserved + alloc_size > cap:
            return None
        addr = next(self._seg_addrs, None) if self._seg_addrs is not None else None
        if addr is None:
            addr = self._next_addr
            self._next_addr += alloc_size + K_ROUND_LARGE  # a gap: segments never touch
        b = Block(addr, alloc_size, small)
        st.reserved += alloc_size
        st.segments += 1
        st.num_device_alloc += 1
        if st.reserved > st.peak_reserved:
            st.peak_reserved = st.reserved
        st.peak_segments = max(st.peak_segments, st.segments)
        self.segment_log.append(alloc_size)
        return b

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.config.max_split_size and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block: Block, size: int, requested: int, pool: _Pool) -> Block:
        if self._should_split(block, size):
            rest = block
            block = Block(rest.addr, size, rest.small)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size -= size
            pool.insert(rest)
        block.allocated = True
        block.requested = requested
        st = self.stats
        st.allocated += block.size
        st.requested += requested
        st.active_blocks += 1
        if st.allocated > st.peak_allocated:
            st.peak_allocated = st.allocated
        if st.requested > st.peak_requested:
            st.peak_requested = st.requested
        return block

    # -- free --------------------------------------------------------------------------------------
    def free(self, block: Block) -> None:
        if not block.allocated:
            raise ValueError("double free")
        st = self.stats
        block.allocated = False
        st.allocated -= block.size
        st.requested -= block.requested
        st.active_blocks -= 1
        pool = self.small if block.small else self.large
        for cand in (block.prev, block.next):
            if cand is not None and not cand.allocated:
                self._merge(block, cand, pool)
        pool.insert(block)

    def _merge(self, dst: Block, src: Block, pool: _Pool) -> None:
        pool.remove(src)
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # -- releasing cached segments -----------------------------------------------------------------
    def _release_block(self, b: Block, pool: _Pool) -> None:
        pool.remove(b)
        st = self.stats
        st.reserved -= b.size
        st.segments -= 1
        st.num_device_free += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """Free oversize cached blocks (only with max_split_size set): the smallest one that is large
        enough, else the largest ones until enough is freed."""
        cfg = self.config
        if cfg.max_split_size == UNLIMITED:
            return False
        key = max(size, cfg.max_split_size)
        i = bisect.bisect_left(pool.keys, (key, -1))
        if i < len(pool.keys):
            self._release_block(pool.blocks[pool.keys[i][1]], pool)
            return True
        released = 0
        i -= 1
        while i >= 0 and released < key and pool.keys[i][0] >= cfg.max_split_size:
            sz, addr = pool.keys[i]
            released += sz
            self._release_block(pool.blocks[addr], pool)
            i -= 1
        return released >= key

    def _release_cached_blocks(self) -> None:
        for pool in (self.large, self.small):
            for _, addr in list(pool.keys):
                b = pool.blocks[addr]
                if not b.is_split():
                    self._release_block(b, pool)

    def empty_cache(self) -> None:
        self._release_cached_blocks()

    def reset_peak(self) -> None:
        st = self.stats
        st.peak_allocated = st.allocated
        st.peak_reserved = st.reserved
        st.peak_requested = st.requested
        st.peak_segments = st.segments


@dataclasses.dataclass
class SimResult:
    peak_allocated: int  # torch.cuda.max_memory_allocated
    peak_reserved: int  # torch.cuda.max_memory_reserved
    peak_requested: int
    peak_segments: int
    allocated: int  # at the end
    reserved: int
    segments: int
    num_device_alloc: int
    num_device_free: int
    peak_allocated_at: int  # index of the event that set the allocated peak (-1: none)
    peak_reserved_at: int
    oom_at: int | None  # index of the event that ran out of memory (capacity set), else None
    segment_log: list[int]
    block_bytes: dict  # key -> bytes of the block each live allocation holds at the allocated peak


def simulate(events: Iterable[tuple], config: AllocatorConfig | None = None) -> SimResult:
    """Run the allocator over ``("alloc", key, nbytes)`` / ``("free", key)`` / ``("empty_cache",)`` /
    ``("reset_peak",)`` events. Frees of unknown keys (and 0-byte allocations) are ignored."""
    sim = CachingAllocatorSim(config)
    st = sim.stats
    live: dict = {}
    sizes: dict[int, int] = {}  # event index -> the size of the block that allocation got
    oom_at = None
    peak_alloc_at = peak_res_at = -1
    best_alloc = best_res = 0
    malloc, free = sim.malloc, sim.free
    events = events if isinstance(events, list) else list(events)
    for i, ev in enumerate(events):
        kind = ev[0]
        if kind == "alloc":
            if ev[2] <= 0:
                continue
            try:
                b = live[ev[1]] = malloc(ev[2])
            except OutOfMemory:
                oom_at = i
                break
            sizes[i] = b.size
            if st.peak_allocated > best_alloc:
                best_alloc, peak_alloc_at = st.peak_allocated, i
            if st.peak_reserved > best_res:
                best_res, peak_res_at = st.peak_reserved, i
        elif kind == "free":
            b = live.pop(ev[1], None)
            if b is not None:
                free(b)
        elif kind == "empty_cache":
            sim.empty_cache()
        elif kind == "reset_peak":
            sim.reset_peak()
            best_alloc, best_res = st.peak_allocated, st.peak_reserved
            peak_alloc_at = peak_res_at = i
        else:
            raise ValueError(f"unknown event {ev!r}")
    # the blocks live at the allocated peak (a block keeps its size while it is handed out)
    at_peak: dict = {}
    for i, ev in enumerate(events[: peak_alloc_at + 1]):
        if ev[0] == "alloc" and i in sizes:
            at_peak[ev[1]] = sizes[i]
        elif ev[0] == "free":
            at_peak.pop(ev[1], None)
    return SimResult(
        st.peak_allocated,
        st.peak_reserved,
        st.peak_requested,
        st.peak_segments,
        st.allocated,
        st.reserved,
        st.segments,
        st.num_device_alloc,
        st.num_device_free,
        peak_alloc_at,
        peak_res_at,
        oom_at,
        sim.segment_log,
        at_peak,
    )


# ----------------------------------------------------------------------------------------------------
# Recorded GPU runs (torch.cuda.memory._record_memory_history) as simulator events
# ----------------------------------------------------------------------------------------------------


def events_from_device_trace(trace: Iterable) -> list[tuple]:
    """``torch.cuda.memory._snapshot()["device_traces"][i]`` -> simulator events. Each entry is a dict
    with "action", "addr", "size" (or a compact [action, addr, size] list); "alloc" carries the requested
    size; a block is freed at "free_completed" (one stream: the same moment as "free_requested");
    segment events are what the simulator predicts, so they are left out."""
    events: list[tuple] = []
    live: dict[int, int] = {}
    next_id = 0
    for e in trace:
        action, addr, size = (e["action"], e["addr"], e["size"]) if isinstance(e, dict) else e
        if action in ("alloc", "a"):
            live[addr] = next_id
            events.append(("alloc", next_id, size))
            next_id += 1
        elif action in ("free_completed", "f"):
            bid = live.pop(addr, None)
            if bid is not None:
                events.append(("free", bid))
    return events
