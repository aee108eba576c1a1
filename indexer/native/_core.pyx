# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""kvindex's compiled hot loops: block-key chaining and the memory store's tables.

Built by ``pip install`` (setup.py); ``kvindex.indexer.native`` says whether it loaded, and
the pure-Python code it replaces stays the reference (tests prove both agree).

The memory store keeps every map in open-addressing tables of 16-byte entries (64-bit key,
64-bit value; linear probing, Fibonacci hashing, deletion by backward shift, so no
tombstones), allocated with ``PyMem_Malloc`` so ``tracemalloc`` sees them. A Python dict of
ints costs about 100 bytes per entry; these cost 16 bytes per slot at a load factor of at
most 0.8.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

cdef extern from *:
    """
    #define XXH_INLINE_ALL
    #include "vendor/xxhash.h"
    """
    uint64_t XXH3_64bits(const void* data, size_t length) nogil

cdef extern from "Python.h":
    ctypedef struct PyObject
    bint PyLong_Check(object)
    object PySequence_Fast(object, const char*)
    Py_ssize_t PySequence_Fast_GET_SIZE(object)
    PyObject** PySequence_Fast_ITEMS(object)
    char* PyBytes_AS_STRING(object) nogil
    Py_ssize_t PyBytes_GET_SIZE(object) nogil


# --- block keys ---------------------------------------------------------------------------


def chain(uint64_t parent, bytes token_bytes, Py_ssize_t block_size):
    """Keys of the full blocks of ``token_bytes`` chained from ``parent``: for each block,
    XXH3-64 of ``parent (u64, little-endian) | the block's token bytes`` (what
    ``kvindex.indexer.keys.chain_keys`` hashes when there are no extra keys)."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    cdef Py_ssize_t stride = block_size * 4
    cdef Py_ssize_t num_blocks = PyBytes_GET_SIZE(token_bytes) // stride
    cdef const unsigned char* src = <const unsigned char*> PyBytes_AS_STRING(token_bytes)
    cdef unsigned char* buf = <unsigned char*> PyMem_Malloc(8 + stride)
    if buf == NULL:
        raise MemoryError()
    cdef list keys = []
    cdef Py_ssize_t i
    cdef int j
    try:
        for i in range(num_blocks):
            for j in range(8):
                buf[j] = (parent >> (8 * j)) & 0xFF
            memcpy(buf + 8, src + i * stride, stride)
            parent = XXH3_64bits(buf, 8 + stride)
            keys.append(parent)
    finally:
        PyMem_Free(buf)
    return keys


def chain_tokens(uint64_t parent, token_ids, Py_ssize_t block_size):
    """:func:`chain` over token ids (a list or tuple of ints) rather than their bytes: the
    ids of the full blocks only are read, each must be an int in [0, 2**32) (else
    OverflowError or TypeError)."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    cdef object seq = PySequence_Fast(token_ids, "token ids must be a sequence")
    cdef Py_ssize_t num_blocks = PySequence_Fast_GET_SIZE(seq) // block_size
    cdef PyObject** items = PySequence_Fast_ITEMS(seq)
    cdef Py_ssize_t stride = block_size * 4
    cdef unsigned char* buf = <unsigned char*> PyMem_Malloc(8 + stride)
    if buf == NULL:
        raise MemoryError()
    cdef list keys = []
    cdef Py_ssize_t i, t
    cdef uint32_t token
    cdef object item
    cdef int j
    try:
        for i in range(num_blocks):
            for j in range(8):
                buf[j] = (parent >> (8 * j)) & 0xFF
            for t in range(block_size):
                item = <object> items[i * block_size + t]
                if not PyLong_Check(item):
                    raise TypeError(f"token id {item!r} is not an int")
                token = item
                for j in range(4):
                    buf[8 + 4 * t + j] = (token >> (8 * j)) & 0xFF
            parent = XXH3_64bits(buf, 8 + stride)
            keys.append(parent)
    finally:
        PyMem_Free(buf)
    return keys


# --- tables: u64 -> u64 -------------------------------------------------------------------


cdef struct Entry:
    uint64_t key
    uint64_t value

cdef struct Table:
    Entry* slots
    Py_ssize_t capacity  # 0 (nothing allocated) or a power of two
    int shift  # 64 - log2(capacity)
    Py_ssize_t size  # entries in ``slots`` (key 0 is held apart)
    bint has_zero
    uint64_t zero_value

cdef enum:
    MIN_CAPACITY = 8

cdef inline Py_ssize_t _home(const Table* t, uint64_t key) nogil:
    return <Py_ssize_t> ((key * <uint64_t> 0x9E3779B97F4A7C15ULL) >> t.shift)

cdef Py_ssize_t _find(const Table* t, uint64_t key) nogil:
    """The slot holding ``key`` (not 0), or -1."""
    if t.capacity == 0:
        return -1
    cdef Py_ssize_t mask = t.capacity - 1
    cdef Py_ssize_t i = _home(t, key)
    cdef uint64_t found
    while True:
        found = t.slots[i].key
        if found == key:
            return i
        if found == 0:
            return -1
        i = (i + 1) & mask

cdef bint _get(const Table* t, uint64_t key, uint64_t* value) nogil:
    cdef Py_ssize_t i
    if key == 0:
        value[0] = t.zero_value
        return t.has_zero
    i = _find(t, key)
    if i < 0:
        return False
    value[0] = t.slots[i].value
    return True

cdef int _resize(Table* t, Py_ssize_t capacity) except -1:
    cdef Entry* old = t.slots
    cdef Py_ssize_t old_capacity = t.capacity, i, j, mask = capacity - 1
    cdef Entry* slots = <Entry*> PyMem_Malloc(capacity * sizeof(Entry))
    if slots == NULL:
        raise MemoryError()
    memset(slots, 0, capacity * sizeof(Entry))
    t.slots = slots
    t.capacity = capacity
    t.shift = 64
    while capacity > 1:
        t.shift -= 1
        capacity >>= 1
    for i in range(old_capacity):
        if old[i].key != 0:
            j = _home(t, old[i].key)
            while slots[j].key != 0:
                j = (j + 1) & mask
            slots[j] = old[i]
    PyMem_Free(old)
    return 0

cdef int _put(Table* t, uint64_t key, uint64_t value) except -1:
    """Insert or overwrite."""
    cdef Py_ssize_t i, mask
    if key == 0:
        t.has_zero = True
        t.zero_value = value
        return 0
    if (t.size + 1) * 5 > t.capacity * 4:  # load factor at most 0.8
        _resize(t, t.capacity * 2 if t.capacity else MIN_CAPACITY)
    mask = t.capacity - 1
    i = _home(t, key)
    while t.slots[i].key != 0 and t.slots[i].key != key:
        i = (i + 1) & mask
    if t.slots[i].key == 0:
        t.size += 1
        t.slots[i].key = key
    t.slots[i].value = value
    return 0

cdef bint _delete(Table* t, uint64_t key) nogil:
    """Remove ``key``; False if it was not there. Later entries of the run shift back."""
    cdef Py_ssize_t i, j, home, mask
    if key == 0:
        if not t.has_zero:
            return False
        t.has_zero = False
        return True
    i = _find(t, key)
    if i < 0:
        return False
    mask = t.capacity - 1
    j = i
    while True:
        j = (j + 1) & mask
        if t.slots[j].key == 0:
            break
        home = _home(t, t.slots[j].key)
        # Move j back to the hole at i unless its home lies cyclically in (i, j].
        if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
            t.slots[i] = t.slots[j]
            i = j
    t.slots[i].key = 0
    t.size -= 1
    return True

cdef void _free(Table* t) noexcept:
    PyMem_Free(t.slots)
    memset(t, 0, sizeof(Table))

cdef Py_ssize_t _nbytes(const Table* t) nogil:
    return t.capacity * sizeof(Entry)


# --- the memory store ---------------------------------------------------------------------


cdef enum:
    NUM_TIERS = 3
    LANE_BITS = 21
    OP_STORE = 0
    OP_STORE_BY_HASH = 1
    OP_REMOVE = 2

cdef uint64_t LANE_MAX = (1ULL << LANE_BITS) - 1
cdef object _ONE = 1  # bitmaps are Python ints: shifts of it never overflow

cdef struct Stream:
    Table hash_to_key
    Table key_to_counts  # counts: one 21-bit lane per tier
    int64_t blocks_by_tier[NUM_TIERS]
    bint live


cdef inline uint64_t _lane(uint64_t counts, long tier) nogil:
    return (counts >> (LANE_BITS * tier)) & LANE_MAX


cdef class Tables:
    """Every stream's block maps and the block → holders map of one memory index.

    Streams are named by small numbers (the caller keeps the stream ↔ number map). A
    block's holders are stored as ``2 * number + 1`` for one holder, else ``2 * i`` where
    ``shared[i]`` is the bitmap of the holders' numbers (a Python int: fleets of any size).
    A tier's count saturates at 2**21 - 1 stores without a removal (no engine stores one
    block that often; the count never wraps). Not thread-safe: the caller locks.
    """

    cdef Stream* _streams
    cdef Py_ssize_t _num_streams
    cdef Table _holders
    cdef list _shared
    cdef list _free_shared

    def __cinit__(self):
        self._streams = NULL
        self._num_streams = 0
        memset(&self._holders, 0, sizeof(Table))
        self._shared = []
        self._free_shared = []

    def __dealloc__(self):
        cdef Py_ssize_t n
        for n in range(self._num_streams):
            _free(&self._streams[n].hash_to_key)
            _free(&self._streams[n].key_to_counts)
        PyMem_Free(self._streams)
        _free(&self._holders)

    cdef Stream* _stream(self, Py_ssize_t number) except NULL:
        cdef Py_ssize_t grown
        cdef Stream* streams
        if number < 0:
            raise ValueError(f"stream number must be >= 0, got {number}")
        if number >= self._num_streams:
            grown = max(number + 1, 2 * self._num_streams)
            streams = <Stream*> PyMem_Realloc(self._streams, grown * sizeof(Stream))
            if streams == NULL:
                raise MemoryError()
            memset(streams + self._num_streams, 0, (grown - self._num_streams) * sizeof(Stream))
            self._streams = streams
            self._num_streams = grown
        return &self._streams[number]

    # holders

    cdef int _join(self, uint64_t key, Py_ssize_t number) except -1:
        cdef uint64_t held
        cdef object bitmap
        cdef Py_ssize_t i
        if not _get(&self._holders, key, &held):
            _put(&self._holders, key, 2 * <uint64_t> number + 1)
            return 0
        if held & 1:
            bitmap = (_ONE << <Py_ssize_t> (held >> 1)) | (_ONE << number)
            if self._free_shared:
                i = self._free_shared.pop()
                self._shared[i] = bitmap
            else:
                i = len(self._shared)
                self._shared.append(bitmap)
            _put(&self._holders, key, 2 * <uint64_t> i)
        else:
            i = <Py_ssize_t> (held >> 1)
            self._shared[i] = self._shared[i] | (_ONE << number)
        return 0

    cdef int _release(self, uint64_t key, Py_ssize_t number) except -1:
        cdef uint64_t held
        cdef object bitmap
        cdef Py_ssize_t i
        if not _get(&self._holders, key, &held):
            return 0
        if held & 1:
            _delete(&self._holders, key)
            return 0
        i = <Py_ssize_t> (held >> 1)
        bitmap = self._shared[i] & ~(_ONE << number)
        if bitmap & (bitmap - 1):
            self._shared[i] = bitmap
        else:  # one holder left: its compact form
            self._shared[i] = 0
            self._free_shared.append(i)
            _put(&self._holders, key, 2 * <uint64_t> (bitmap.bit_length() - 1) + 1)
        return 0

    cdef object _bitmap(self, uint64_t held):
        if held & 1:
            return _ONE << <Py_ssize_t> (held >> 1)
        return self._shared[<Py_ssize_t> (held >> 1)]

    # streams

    def reset(self, Py_ssize_t number):
        """Forget every block of stream ``number`` (and its place among their holders)."""
        cdef Stream* s = self._stream(number)
        cdef Py_ssize_t i
        cdef Table* counts = &s.key_to_counts
        for i in range(counts.capacity):
            if counts.slots[i].key != 0:
                self._release(counts.slots[i].key, number)
        if counts.has_zero:
            self._release(0, number)
        _free(&s.hash_to_key)
        _free(&s.key_to_counts)
        memset(s.blocks_by_tier, 0, sizeof(s.blocks_by_tier))

    def apply(self, Py_ssize_t number, ops):
        """Apply ``(kind, tier, engine_hash, key)`` ops to stream ``number`` in order, as
        ``MemoryIndex`` does; returns (unknown removals, unresolved stores)."""
        cdef Stream* s = self._stream(number)
        cdef long kind, tier
        cdef uint64_t engine_hash, key, counts, unit
        cdef Py_ssize_t unknown = 0, unresolved = 0
        cdef tuple op
        for op in ops:
            kind = op[0]
            tier = op[1]
            engine_hash = op[2]
            if tier < 0 or tier >= NUM_TIERS:
                raise ValueError(f"tier out of range: {tier}")
            if kind == OP_REMOVE:
                if not self._remove(s, number, engine_hash, tier):
                    unknown += 1
                continue
            if kind == OP_STORE:
                key = op[3]
                _put(&s.hash_to_key, engine_hash, key)
            elif kind == OP_STORE_BY_HASH:
                if not _get(&s.hash_to_key, engine_hash, &key):
                    unresolved += 1
                    continue
            else:
                self.reset(number)
                continue
            if not _get(&s.key_to_counts, key, &counts):
                counts = 0
            if counts == 0:
                self._join(key, number)
            if _lane(counts, tier) == 0:
                s.blocks_by_tier[tier] += 1
            if _lane(counts, tier) < LANE_MAX:
                counts += (<uint64_t> 1) << (LANE_BITS * tier)
            _put(&s.key_to_counts, key, counts)
        return unknown, unresolved

    cdef bint _remove(self, Stream* s, Py_ssize_t number, uint64_t engine_hash, long tier) except -1:
        cdef uint64_t key, counts, held
        if not _get(&s.hash_to_key, engine_hash, &key):
            return False
        if not _get(&s.key_to_counts, key, &counts):
            return False
        held = _lane(counts, tier)
        if held == 0:
            return False
        counts -= (<uint64_t> 1) << (LANE_BITS * tier)
        if held == 1:
            s.blocks_by_tier[tier] -= 1
            if counts == 0:
                _delete(&s.key_to_counts, key)
                _delete(&s.hash_to_key, engine_hash)
                self._release(key, number)
                return True
        _put(&s.key_to_counts, key, counts)
        return True

    def resolve(self, Py_ssize_t number, engine_hashes):
        """The key each engine hash maps to in stream ``number`` (None: unknown)."""
        cdef Stream* s = self._stream(number)
        cdef uint64_t key, engine_hash
        cdef list keys = []
        for engine_hash in engine_hashes:
            keys.append(key if _get(&s.hash_to_key, engine_hash, &key) else None)
        return keys

    def blocks_by_tier(self, Py_ssize_t number):
        """Distinct blocks stream ``number`` holds on each tier."""
        cdef Stream* s = self._stream(number)
        return [s.blocks_by_tier[0], s.blocks_by_tier[1], s.blocks_by_tier[2]]

    # lookup

    def matched(self, list keys):
        """``(bitmap of stream numbers, blocks they matched)`` for every stream holding
        ``keys[0]``: the prompt walked once, the set still matching narrowed block by block;
        once one stream is left, the walk goes on in that stream's own table."""
        cdef Py_ssize_t n = len(keys), num_blocks = 1, lone
        cdef uint64_t held = 0
        cdef list out = []
        cdef object matching, still
        if n == 0 or not _get(&self._holders, keys[0], &held):
            return out
        if held & 1:  # one holder: no bitmaps at all
            lone = <Py_ssize_t> (held >> 1)
            matching = _ONE << lone
        else:
            matching = self._shared[<Py_ssize_t> (held >> 1)]
            while num_blocks < n and matching & (matching - 1):
                if _get(&self._holders, keys[num_blocks], &held):
                    still = matching & self._bitmap(held)
                else:
                    still = 0
                if still != matching:
                    out.append((matching ^ still, num_blocks))
                    if not still:
                        return out
                    matching = still
                num_blocks += 1
            lone = matching.bit_length() - 1
        if num_blocks < n and not matching & (matching - 1):
            num_blocks = self._held_from(lone, keys, num_blocks)
        out.append((matching, num_blocks))
        return out

    cdef Py_ssize_t _held_from(self, Py_ssize_t number, list keys, Py_ssize_t start) except -1:
        cdef Stream* s = self._stream(number)
        cdef Py_ssize_t i
        cdef uint64_t counts
        for i in range(start, len(keys)):
            if not _get(&s.key_to_counts, keys[i], &counts):
                return i
        return len(keys)

    def best_tiers(self, Py_ssize_t number, list keys, Py_ssize_t num_blocks):
        """The best tier (lowest held) of each of the first ``num_blocks`` keys, which
        stream ``number`` holds."""
        cdef Stream* s = self._stream(number)
        cdef Py_ssize_t i
        cdef long tier
        cdef uint64_t counts
        cdef list tiers = []
        for i in range(num_blocks):
            if not _get(&s.key_to_counts, keys[i], &counts) or counts == 0:
                raise AssertionError("a held block has a non-zero count on some tier")
            tier = 0
            while _lane(counts, tier) == 0:
                tier += 1
            tiers.append(tier)
        return tiers

    def nbytes(self):
        """Bytes the tables hold (slots allocated, not only those in use)."""
        cdef Py_ssize_t total = _nbytes(&self._holders) + self._num_streams * sizeof(Stream)
        cdef Py_ssize_t n
        for n in range(self._num_streams):
            total += _nbytes(&self._streams[n].hash_to_key)
            total += _nbytes(&self._streams[n].key_to_counts)
        return total
