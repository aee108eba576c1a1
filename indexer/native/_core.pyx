# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""kvindex's compiled hot loops: block-key chaining and the memory store's tables.

Built by ``pip install`` (setup.py); ``kvindex.indexer.native`` says whether it loaded, and
the pure-Python code it replaces stays the reference (tests prove both agree).

The memory store keeps its maps in open-addressing tables of 16-byte slots (64-bit key,
64-bit value; linear probing in Robin Hood order, multiplicative hashing, deletion by
backward shift, so no tombstones), filled up to 90 % and grown by a quarter, allocated with ``PyMem_Malloc`` so
``tracemalloc`` sees them. A (stream, block) entry costs two slots (its engine hash in the
stream's table, its key in the index-wide one), where Python dicts of ints cost 100+ bytes.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

cdef extern from *:
    """
    #define XXH_INLINE_ALL
    #include "vendor/xxhash.h"

    /* A key's home slot in a table of any capacity: the high bits of a 128-bit product
       (keys are mixed first: engine hashes in tests are small ints). */
    static inline Py_ssize_t kv_home(uint64_t key, uint64_t capacity) {
        uint64_t mixed = key * 0x9E3779B97F4A7C15ULL;
        return (Py_ssize_t)(((unsigned __int128)(mixed ^ (mixed >> 29)) * capacity) >> 64);
    }
    """
    uint64_t XXH3_64bits(const void* data, size_t length) nogil
    Py_ssize_t kv_home(uint64_t key, uint64_t capacity) nogil

cdef extern from "Python.h":
    ctypedef struct PyObject
    bint PyLong_Check(object)
    bint PyLong_CheckExact(object)
    unsigned long long PyLong_AsUnsignedLongLong(object) except? -1
    bytes PyBytes_FromStringAndSize(const char*, Py_ssize_t)
    object PySequence_Fast(object, const char*)
    Py_ssize_t PySequence_Fast_GET_SIZE(object)
    PyObject** PySequence_Fast_ITEMS(object)
    PyObject* PyDict_GetItem(object, object)
    bint PyBytes_CheckExact(object)
    long long PyLong_AsLongLong(object) except? -1
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


def pack_tokens(token_ids):
    """Token ids (a list or tuple of ints in [0, 2**32), else OverflowError or TypeError)
    as little-endian u32 bytes."""
    cdef object seq = PySequence_Fast(token_ids, "token ids must be a sequence")
    cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i
    cdef PyObject** items = PySequence_Fast_ITEMS(seq)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 4 * n)
    cdef unsigned char* buf = <unsigned char*> PyBytes_AS_STRING(out)
    cdef uint32_t token
    cdef object item
    for i in range(n):
        item = <object> items[i]
        if not PyLong_Check(item):
            raise TypeError(f"token id {item!r} is not an int")
        token = item
        buf[4 * i] = token & 0xFF
        buf[4 * i + 1] = (token >> 8) & 0xFF
        buf[4 * i + 2] = (token >> 16) & 0xFF
        buf[4 * i + 3] = token >> 24
    return out


# --- token ids as decoded ---------------------------------------------------------------


cdef class PackedTokens:
    """A decoded event's token ids kept as little-endian u32 bytes (``packed``, what the
    block keys hash) instead of a list of Python ints: a read-only sequence of ints that
    equals the list it stands for (and only lists, as a list does), made by
    :func:`packed_tokens` from the msgpack array as sent."""

    cdef readonly bytes packed
    cdef Py_ssize_t _n

    def __len__(self):
        return self._n

    cdef uint32_t _at(self, Py_ssize_t i):
        cdef const unsigned char* b = <const unsigned char*> PyBytes_AS_STRING(self.packed) + 4 * i
        return b[0] | (<uint32_t> b[1] << 8) | (<uint32_t> b[2] << 16) | (<uint32_t> b[3] << 24)

    def __getitem__(self, index):
        cdef Py_ssize_t i
        if isinstance(index, slice):
            return [self._at(i) for i in range(*index.indices(self._n))]
        i = index
        if i < 0:
            i += self._n
        if i < 0 or i >= self._n:
            raise IndexError("token index out of range")
        return self._at(i)

    def tolist(self):
        cdef Py_ssize_t i
        return [self._at(i) for i in range(self._n)]

    def __iter__(self):
        return iter(self.tolist())

    def __contains__(self, value):
        return value in self.tolist()

    def __eq__(self, other):
        if isinstance(other, PackedTokens):
            return self.packed == (<PackedTokens> other).packed
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    def __ne__(self, other):
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __hash__ = None

    def __repr__(self):
        return f"PackedTokens({self.tolist()!r})"


cdef inline uint64_t _be(const unsigned char* p, int width) noexcept nogil:
    cdef uint64_t value = 0
    cdef int j
    for j in range(width):
        value = (value << 8) | p[j]
    return value


def packed_tokens(raw):
    """The token ids of a msgpack array (any buffer holding exactly one msgpack item) as
    :class:`PackedTokens`; None unless it is an array of ints each in [0, 2**32) (the
    caller then decodes it the general way, which says what is wrong with it)."""
    cdef Py_buffer view
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    try:
        return _packed(<const unsigned char*> view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef object _packed(const unsigned char* p, Py_ssize_t size):
    cdef Py_ssize_t pos = 1, n, i
    cdef unsigned char head
    cdef uint64_t value
    cdef int width
    if size == 0:
        return None
    head = p[0]
    if 0x90 <= head <= 0x9F:
        n = head & 0x0F
    elif (head == 0xDC and size >= 3) or (head == 0xDD and size >= 5):
        width = 2 if head == 0xDC else 4
        n = <Py_ssize_t> _be(p + 1, width)
        pos = 1 + width
    else:
        return None
    if n > size - pos:  # each item takes a byte at least
        return None
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 4 * n)
    cdef unsigned char* buf = <unsigned char*> PyBytes_AS_STRING(out)
    for i in range(n):
        if pos >= size:
            return None
        head = p[pos]
        pos += 1
        if head < 0x80:
            value = head
        else:
            if head == 0xCC or head == 0xD0:
                width = 1
            elif head == 0xCD or head == 0xD1:
                width = 2
            elif head == 0xCE or head == 0xD2:
                width = 4
            elif head == 0xCF or head == 0xD3:
                width = 8
            else:
                return None  # a negative fixint or not an int
            if pos + width > size:
                return None
            value = _be(p + pos, width)
            pos += width
            if head >= 0xD0 and value >> (8 * width - 1):  # a negative signed int
                return None
            if value >> 32:  # past u32 (a typed test: a literal here would be a Python int)
                return None
        buf[4 * i] = value & 0xFF
        buf[4 * i + 1] = (value >> 8) & 0xFF
        buf[4 * i + 2] = (value >> 16) & 0xFF
        buf[4 * i + 3] = (value >> 24) & 0xFF
    if pos != size:
        return None
    cdef PackedTokens tokens = PackedTokens.__new__(PackedTokens)
    tokens.packed = out
    tokens._n = n
    return tokens


def unsigned_hashes(values):
    """``tuple(values)`` when ``values`` is a list of ints in [0, 2**64) (engine hashes that
    need no normalising: vLLM's int form), else None (the caller normalises them)."""
    cdef Py_ssize_t i
    cdef object item
    if type(values) is not list:
        return None
    for item in <list> values:
        if not PyLong_CheckExact(item):
            return None
        try:
            PyLong_AsUnsignedLongLong(item)
        except OverflowError:  # negative (an old vLLM's Python hash())
            return None
    return tuple(<list> values)


def store_chain(list ops, dict key_of_hash, object kind, object tier, engine_hashes,
                uint64_t parent, bytes token_bytes, Py_ssize_t block_size):
    """The store ops of one event, with the keys :func:`chain` gives: for each full block
    and its engine hash, ``(kind, tier, engine_hash, key)`` goes to ``ops`` and
    ``key_of_hash[engine_hash] = key``. There must be one engine hash per full block
    (ValueError). Returns the number of blocks."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    cdef object seq = PySequence_Fast(engine_hashes, "engine hashes must be a sequence")
    cdef PyObject** hashes = PySequence_Fast_ITEMS(seq)
    cdef Py_ssize_t stride = block_size * 4
    cdef Py_ssize_t num_blocks = PyBytes_GET_SIZE(token_bytes) // stride
    if PySequence_Fast_GET_SIZE(seq) != num_blocks:
        raise ValueError(f"{PySequence_Fast_GET_SIZE(seq)} engine hashes for {num_blocks} blocks")
    cdef const unsigned char* src = <const unsigned char*> PyBytes_AS_STRING(token_bytes)
    cdef unsigned char* buf = <unsigned char*> PyMem_Malloc(8 + stride)
    if buf == NULL:
        raise MemoryError()
    cdef Py_ssize_t i
    cdef int j
    cdef object key, engine_hash
    try:
        for i in range(num_blocks):
            for j in range(8):
                buf[j] = (parent >> (8 * j)) & 0xFF
            memcpy(buf + 8, src + i * stride, stride)
            parent = XXH3_64bits(buf, 8 + stride)
            key = parent
            engine_hash = <object> hashes[i]
            ops.append((kind, tier, engine_hash, key))
            key_of_hash[engine_hash] = key
    finally:
        PyMem_Free(buf)
    return num_blocks


def remove_ops(list ops, object kind, object tier, engine_hashes):
    """``(kind, tier, engine_hash, 0)`` to ``ops`` for each engine hash."""
    cdef object engine_hash
    for engine_hash in engine_hashes:
        ops.append((kind, tier, engine_hash, 0))


# --- tables: u64 -> u64 -------------------------------------------------------------------


cdef struct Entry:
    uint64_t key
    uint64_t value

cdef struct Table:
    Entry* slots
    Py_ssize_t capacity  # 0: nothing allocated
    Py_ssize_t size  # entries in ``slots`` (key 0 is held apart)
    bint has_zero
    uint64_t zero_value

cdef enum:
    MIN_CAPACITY = 16
    DOUBLING_BELOW = 4096  # small tables double; large ones grow by a quarter

cdef inline Py_ssize_t _home(const Table* t, uint64_t key) nogil:
    return kv_home(key, <uint64_t> t.capacity)

cdef inline Py_ssize_t _next(const Table* t, Py_ssize_t i) nogil:
    i += 1
    return 0 if i == t.capacity else i

cdef inline Py_ssize_t _distance(const Table* t, uint64_t key, Py_ssize_t i) nogil:
    """How far slot ``i`` is past ``key``'s home slot (cyclically)."""
    cdef Py_ssize_t home = _home(t, key)
    return i - home if i >= home else i + t.capacity - home

cdef Py_ssize_t _find(const Table* t, uint64_t key) nogil:
    """The slot holding ``key`` (not 0), or -1. Robin Hood order: a slot whose entry is
    nearer its home than ``key`` would be here means ``key`` is absent (no full scan of
    the cluster, which at 90 % load is long)."""
    if t.capacity == 0:
        return -1
    cdef Py_ssize_t i = _home(t, key), d = 0
    cdef uint64_t found
    while True:
        found = t.slots[i].key
        if found == key:
            return i
        if found == 0 or _distance(t, found, i) < d:
            return -1
        i = _next(t, i)
        d += 1

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

cdef void _place(Table* t, Entry entry) noexcept nogil:
    """Insert an entry whose key (not 0) is absent, keeping the Robin Hood order. With
    homes monotonic in the mixed key (``kv_home``), that order sorts each run by home:
    the entry goes before the first entry of its run whose home lies past its own, and
    the rest of the run moves up one slot (no per-slot home computed for the move)."""
    cdef Py_ssize_t i = _home(t, entry.key), d = 0, j, k
    while t.slots[i].key != 0 and _distance(t, t.slots[i].key, i) >= d:
        i = _next(t, i)
        d += 1
    j = i
    while t.slots[j].key != 0:
        j = _next(t, j)
    while j != i:  # the run [i, j) moves up one slot, from its end
        k = j - 1 if j > 0 else t.capacity - 1
        t.slots[j] = t.slots[k]
        j = k
    t.slots[i] = entry

cdef int _resize(Table* t, Py_ssize_t capacity) except -1:
    """Move every entry to a new array of ``capacity`` slots. The old one is read from an
    empty slot on, so entries come in the order of their homes (Robin Hood runs are sorted
    by home, and homes keep their order at any capacity): each lands just after the one
    before it, in memory already in cache, rather than at a random place."""
    cdef Entry* old = t.slots
    cdef Py_ssize_t old_capacity = t.capacity, start = 0, n, i
    cdef Entry* slots = <Entry*> PyMem_Malloc(capacity * sizeof(Entry))
    if slots == NULL:
        raise MemoryError()
    memset(slots, 0, capacity * sizeof(Entry))
    t.slots = slots
    t.capacity = capacity
    while start < old_capacity and old[start].key != 0:
        start += 1
    for n in range(old_capacity):
        i = start + n
        if i >= old_capacity:
            i -= old_capacity
        if old[i].key != 0:
            _place(t, old[i])
    PyMem_Free(old)
    return 0

cdef uint64_t* _value_of(Table* t, uint64_t key) noexcept nogil:
    """Where ``key``'s value is kept, or NULL if it is absent (valid until an insertion)."""
    cdef Py_ssize_t i
    if key == 0:
        return &t.zero_value if t.has_zero else NULL
    i = _find(t, key)
    return NULL if i < 0 else &t.slots[i].value

cdef int _insert(Table* t, uint64_t key, uint64_t value) except -1:
    """Insert ``key``, known to be absent (one probe less than :func:`_put`)."""
    cdef Entry entry
    if key == 0:
        t.has_zero = True
        t.zero_value = value
        return 0
    if (t.size + 1) * 10 > t.capacity * 9:  # load factor at most 0.9
        if t.capacity < DOUBLING_BELOW:
            _resize(t, max(2 * t.capacity, MIN_CAPACITY))
        else:
            _resize(t, t.capacity + t.capacity // 4)
    entry.key = key
    entry.value = value
    _place(t, entry)
    t.size += 1
    return 0

cdef int _put(Table* t, uint64_t key, uint64_t value) except -1:
    """Insert or overwrite."""
    cdef Py_ssize_t i
    if key == 0:
        t.has_zero = True
        t.zero_value = value
        return 0
    i = _find(t, key)
    if i >= 0:
        t.slots[i].value = value
        return 0
    return _insert(t, key, value)

cdef bint _delete(Table* t, uint64_t key) nogil:
    """Remove ``key``; False if it was not there. The entries after it shift back one
    slot, up to the first that is at its home (or an empty slot)."""
    cdef Py_ssize_t i, j
    cdef uint64_t found
    if key == 0:
        if not t.has_zero:
            return False
        t.has_zero = False
        return True
    i = _find(t, key)
    if i < 0:
        return False
    j = _next(t, i)
    while True:
        found = t.slots[j].key
        if found == 0 or _distance(t, found, j) == 0:
            break
        t.slots[i] = t.slots[j]
        i = j
        j = _next(t, j)
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
    LANE_BITS = 21  # a tier's count in a stream's table of counts
    SHORT_LANE_BITS = 12  # the same, folded into a lone holder's entry
    NUMBER_BITS = 24
    OP_STORE = 0
    OP_STORE_BY_HASH = 1
    OP_REMOVE = 2
    OP_CLEAR = 3
    UNKNOWN_REMOVAL = 1
    UNRESOLVED_STORE = 2

cdef uint64_t LANE_MAX = (1ULL << LANE_BITS) - 1
cdef uint64_t SHORT_LANE_MAX = (1ULL << SHORT_LANE_BITS) - 1
cdef uint64_t NUMBER_MAX = (1ULL << NUMBER_BITS) - 1
cdef object _ONE = 1  # bitmaps are Python ints: shifts of it never overflow

# A block's entry in the holders table, by its lowest bits:
#   ...1: one holder; bit 1 set: its counts are in the stream's own table, else in bits
#         26.. (three 12-bit lanes); bits 2..25: the holder's number;
#   ...0: several holders; the entry >> 1 indexes ``Tables._shared`` (their bitmap); each
#         holder's counts are in its own table.
cdef enum:
    LONE = 1
    COUNTS_APART = 2
    NUMBER_SHIFT = 2
    COUNTS_SHIFT = 26

cdef struct Stream:
    Table hash_to_key
    Table key_to_counts  # only blocks with several holders, or counts too big to fold
    int64_t blocks_by_tier[NUM_TIERS]


cdef inline uint64_t _lane(uint64_t counts, long tier) nogil:
    return (counts >> (LANE_BITS * tier)) & LANE_MAX

cdef inline bint _foldable(uint64_t counts) nogil:
    cdef long tier
    for tier in range(NUM_TIERS):
        if _lane(counts, tier) > SHORT_LANE_MAX:
            return False
    return True

cdef inline uint64_t _folded(Py_ssize_t number, uint64_t counts) nogil:
    cdef uint64_t entry = LONE | (<uint64_t> number << NUMBER_SHIFT)
    cdef long tier
    for tier in range(NUM_TIERS):
        entry |= _lane(counts, tier) << (COUNTS_SHIFT + SHORT_LANE_BITS * tier)
    return entry

cdef inline uint64_t _unfolded(uint64_t entry) nogil:
    cdef uint64_t counts = 0
    cdef long tier
    for tier in range(NUM_TIERS):
        counts |= ((entry >> (COUNTS_SHIFT + SHORT_LANE_BITS * tier)) & SHORT_LANE_MAX) << (
            LANE_BITS * tier
        )
    return counts

cdef inline Py_ssize_t _holder(uint64_t entry) nogil:
    return <Py_ssize_t> ((entry >> NUMBER_SHIFT) & NUMBER_MAX)


# --- the compiled ingest path's records ------------------------------------------------

cdef struct Buffer:  # a growable byte array (PyMem_Realloc)
    char* data
    Py_ssize_t size
    Py_ssize_t capacity

cdef struct Ingest:
    Py_ssize_t applied
    Py_ssize_t unknown
    Py_ssize_t unresolved
    Py_ssize_t stored
    Py_ssize_t removed
    Py_ssize_t clears
    Py_ssize_t other_group
    Py_ssize_t misaligned
    Py_ssize_t orphans
    Py_ssize_t block_size

cdef struct Op:
    uint64_t engine_hash
    uint64_t key
    long kind
    long tier


cdef int _reserve(Buffer* b, Py_ssize_t more) except -1:
    """Room for ``more`` bytes past ``b.size``."""
    cdef Py_ssize_t capacity
    cdef char* data
    if b.size + more <= b.capacity:
        return 0
    capacity = max(2 * b.capacity, b.size + more, 256)
    data = <char*> PyMem_Realloc(b.data, capacity)
    if data == NULL:
        raise MemoryError()
    b.data = data
    b.capacity = capacity
    return 0

cdef inline int _push_op(Buffer* b, long kind, long tier, uint64_t engine_hash,
                         uint64_t key) except -1:
    cdef Op* op
    if b.size + <Py_ssize_t> sizeof(Op) > b.capacity:
        _reserve(b, sizeof(Op))
    op = <Op*> (b.data + b.size)
    op.kind = kind
    op.tier = tier
    op.engine_hash = engine_hash
    op.key = key
    b.size += sizeof(Op)
    return 0

cdef inline int _push_word(Buffer* b, uint64_t word) except -1:
    if b.size + 8 > b.capacity:
        _reserve(b, 8)
    (<uint64_t*> (b.data + b.size))[0] = word
    b.size += 8
    return 0

cdef uint64_t _orphan_root(uint64_t parent_hash) noexcept:
    """``kvindex.indexer.ingest.orphan_root``: XXH3-64 of ``b"kvindex/orphan\\x00"`` and the
    parent's engine hash (8 bytes, big-endian)."""
    cdef unsigned char buf[23]
    cdef int j
    memcpy(buf, b"kvindex/orphan\x00", 15)
    for j in range(8):
        buf[15 + j] = (parent_hash >> (8 * (7 - j))) & 0xFF
    return XXH3_64bits(buf, 23)


# --- decoded batches for the compiled ingest path ------------------------------------------

cdef enum:
    EV_STORE = 1
    EV_REMOVE = 2
    EV_CLEAR = 3
    EV_OTHER_GROUP = 4
    EV_MISALIGNED = 5
    HAS_PARENT = 1 << 16

cdef object _U64_END = int("18446744073709551616")
cdef object _I64_MIN = -int("9223372036854775808")
cdef object _I32 = int("2147483648")
cdef tuple _STORED_KINDS = ()
cdef tuple _REMOVED_KINDS = ()
cdef tuple _CLEARED_KINDS = ()


def wire_kinds(tuple stored, tuple removed, tuple cleared):
    """Name the decoded wire structs (``kvindex.indexer.wire``) of each event type that
    :func:`native_batch` reads."""
    global _STORED_KINDS, _REMOVED_KINDS, _CLEARED_KINDS
    _STORED_KINDS, _REMOVED_KINDS, _CLEARED_KINDS = stored, removed, cleared


cdef class NativeBatch:
    """One live batch decoded for the compiled ingest path (``Tables.ingest``): its seq,
    engine timestamp and rank, and its events as flat records of 64-bit words (engine
    hashes normalised, tiers folded, a store's token ids packed). Made by
    :func:`native_batch` only for batches whose events all take that path."""

    cdef readonly object seq
    cdef readonly double ts
    cdef readonly object rank
    cdef readonly Py_ssize_t num_events
    cdef Buffer _words
    cdef Buffer _tokens

    def __cinit__(self):
        memset(&self._words, 0, sizeof(Buffer))
        memset(&self._tokens, 0, sizeof(Buffer))

    def __dealloc__(self):
        PyMem_Free(self._words.data)
        PyMem_Free(self._tokens.data)

    @property
    def num_bad_events(self):
        """Always 0: a batch with an undecodable event is never made one."""
        return 0


cdef bint _wire_hash(object value, uint64_t* out) except -1:
    """``kvindex.indexer.wire.normalize_hash`` of an int (of any msgpack width) or bytes
    (the last 8, big-endian); False for anything else."""
    cdef const unsigned char* p
    cdef Py_ssize_t n, j
    if PyLong_CheckExact(value):
        if 0 <= value < _U64_END:
            out[0] = PyLong_AsUnsignedLongLong(value)
        elif _I64_MIN <= value < 0:
            out[0] = <uint64_t> PyLong_AsLongLong(value)
        else:
            return False
        return True
    if PyBytes_CheckExact(value):
        p = <const unsigned char*> PyBytes_AS_STRING(value)
        n = PyBytes_GET_SIZE(value)
        out[0] = _be(p + max(n - 8, 0), <int> min(n, 8))
        return True
    return False


cdef bint _tier_of(object medium, long* tier):
    """The tiers of the common media: None and ``"GPU"`` (0), ``"CPU"`` (1)."""
    if medium is None or medium == "GPU":
        tier[0] = 0
        return True
    if medium == "CPU":
        tier[0] = 1
        return True
    return False


cdef bint _in_group(object group_idx):
    return group_idx is None or group_idx == 0


cdef bint _no_extras(object event):
    """No LoRA name, and extra keys absent or None for every block."""
    cdef object extra = event.extra_keys
    if event.lora_name is not None:
        return False
    if extra is None:
        return True
    if type(extra) is not list:
        return False
    for item in <list> extra:
        if item is not None:
            return False
    return True


cdef int _hashes_to(Buffer* words, object hashes) except -1:
    """Append each engine hash, normalised; -2 if one is not an int or bytes."""
    cdef uint64_t value
    if type(hashes) is not list:
        return -2
    _reserve(words, 8 * len(<list> hashes))
    for item in <list> hashes:
        if not _wire_hash(item, &value):
            return -2
        _push_word(words, value)
    return 0


cdef int _add_store(NativeBatch batch, object event) except -1:
    """Append a store's record; -2 if the event must take the Python path (LoRA or extra
    keys, an uncommon medium, a placeholder, a block size past 2**31, token ids not all
    in [0, 2**32))."""
    cdef long tier
    cdef long long block_size
    cdef Py_ssize_t num_tokens, num_hashes
    cdef Py_buffer view
    cdef uint64_t parent = 0, tag
    cdef object parent_hash
    if not _in_group(event.group_idx):
        _push_word(&batch._words, EV_OTHER_GROUP)
        return 0
    if not _no_extras(event) or not _tier_of(event.medium, &tier):
        return -2
    size = event.block_size
    if not -_I32 <= size < _I32:
        return -2
    block_size = size
    PyObject_GetBuffer(event.token_ids, &view, PyBUF_SIMPLE)
    try:
        num_tokens = _pack_into(&batch._tokens, <const unsigned char*> view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
    if num_tokens < 0 or (block_size == 0 and num_tokens == 0):
        return -2
    hashes = event.block_hashes
    num_hashes = len(hashes)
    if block_size <= 0 or num_tokens % block_size or num_tokens // block_size != num_hashes:
        batch._tokens.size -= 4 * num_tokens
        _push_word(&batch._words, EV_MISALIGNED)
        return 0
    parent_hash = event.parent_block_hash
    tag = EV_STORE | (<uint64_t> tier << 8)
    if parent_hash is not None:
        if not _wire_hash(parent_hash, &parent):
            return -2
        tag |= HAS_PARENT
    _push_word(&batch._words, tag)
    _push_word(&batch._words, num_hashes)
    _push_word(&batch._words, parent)
    _push_word(&batch._words, <uint64_t> block_size)
    _push_word(&batch._words, <uint64_t> (batch._tokens.size - 4 * num_tokens))
    if _hashes_to(&batch._words, hashes) < 0:
        return -2
    return 0


cdef int _add_remove(NativeBatch batch, object event) except -1:
    cdef long tier
    if not _in_group(event.group_idx):
        _push_word(&batch._words, EV_OTHER_GROUP)
        return 0
    if not _tier_of(event.medium, &tier):
        return -2
    hashes = event.block_hashes
    _push_word(&batch._words, EV_REMOVE | (<uint64_t> tier << 8))
    _push_word(&batch._words, len(hashes))
    return _hashes_to(&batch._words, hashes)


def native_batch(object seq, double ts, object rank, list events):
    """A :class:`NativeBatch` of decoded wire events (the fast decoders' structs, token
    ids raw), or None when any event must take the Python path (see ``_add_store``)."""
    cdef NativeBatch batch = NativeBatch.__new__(NativeBatch)
    cdef object kind
    batch.seq = seq
    batch.ts = ts
    batch.rank = rank
    batch.num_events = len(events)
    for event in events:
        kind = type(event)
        if kind in _STORED_KINDS:
            if _add_store(batch, event) < 0:
                return None
        elif kind in _REMOVED_KINDS:
            if _add_remove(batch, event) < 0:
                return None
        elif kind in _CLEARED_KINDS:
            _push_word(&batch._words, EV_CLEAR)
        else:
            return None
    return batch


cdef Py_ssize_t _pack_into(Buffer* out, const unsigned char* p, Py_ssize_t size) except -2:
    """:func:`_packed` into ``out`` (appended): the number of token ids, or -1 (nothing
    appended) unless ``p`` is one msgpack array of ints in [0, 2**32)."""
    cdef Py_ssize_t pos = 1, n, i, start = out.size
    cdef unsigned char head
    cdef uint64_t value
    cdef int width
    cdef unsigned char* buf
    if size == 0:
        return -1
    head = p[0]
    if 0x90 <= head <= 0x9F:
        n = head & 0x0F
    elif (head == 0xDC and size >= 3) or (head == 0xDD and size >= 5):
        width = 2 if head == 0xDC else 4
        n = <Py_ssize_t> _be(p + 1, width)
        pos = 1 + width
    else:
        return -1
    if n > size - pos:  # each item takes a byte at least
        return -1
    _reserve(out, 4 * n)
    buf = <unsigned char*> out.data + start
    for i in range(n):
        if pos >= size:
            return -1
        head = p[pos]
        pos += 1
        if head < 0x80:
            value = head
        else:
            if head == 0xCC or head == 0xD0:
                width = 1
            elif head == 0xCD or head == 0xD1:
                width = 2
            elif head == 0xCE or head == 0xD2:
                width = 4
            elif head == 0xCF or head == 0xD3:
                width = 8
            else:
                return -1
            if pos + width > size:
                return -1
            value = _be(p + pos, width)
            pos += width
            if head >= 0xD0 and value >> (8 * width - 1):
                return -1
            if value >> 32:
                return -1
        buf[4 * i] = value & 0xFF
        buf[4 * i + 1] = (value >> 8) & 0xFF
        buf[4 * i + 2] = (value >> 16) & 0xFF
        buf[4 * i + 3] = (value >> 24) & 0xFF
    if pos != size:
        return -1
    out.size = start + 4 * n
    return n


cdef class Tables:
    """Every stream's block maps and the block → holders map of one memory index.

    Streams are named by small numbers (below 2**24; the caller keeps the stream ↔ number
    map). Each stream has engine hash → key; the index-wide table maps a block key to its
    one holder with that holder's counts folded in (the common private block: no other
    slot), or to the bitmap of its holders (a Python int: fleets of any size), whose counts
    are then in their own tables. A stream's table of counts also takes a block it holds
    alone that no engine hash of it maps to any more (so a clear still finds it) and one
    with a count past 4,095. A tier's count saturates at 2**21 - 1 stores without a
    removal (no engine stores one block that often; it never wraps). Not thread-safe: the
    caller locks.
    """

    cdef Stream* _streams
    cdef Py_ssize_t _num_streams
    cdef Table _holders
    cdef list _shared
    cdef list _free_shared
    cdef Buffer _ops  # one batch's ops (the compiled ingest path)
    cdef Buffer _scratch  # a block's hashed bytes (the same)

    def __cinit__(self):
        self._streams = NULL
        self._num_streams = 0
        memset(&self._holders, 0, sizeof(Table))
        memset(&self._ops, 0, sizeof(Buffer))
        memset(&self._scratch, 0, sizeof(Buffer))
        self._shared = []
        self._free_shared = []

    def __dealloc__(self):
        cdef Py_ssize_t n
        for n in range(self._num_streams):
            _free(&self._streams[n].hash_to_key)
            _free(&self._streams[n].key_to_counts)
        PyMem_Free(self._streams)
        _free(&self._holders)
        PyMem_Free(self._ops.data)
        PyMem_Free(self._scratch.data)

    cdef Stream* _stream(self, Py_ssize_t number) except NULL:
        cdef Py_ssize_t grown
        cdef Stream* streams
        if number < 0 or <uint64_t> number > NUMBER_MAX:
            raise ValueError(f"stream number must be in [0, 2**24), got {number}")
        if number >= self._num_streams:
            grown = max(number + 1, 2 * self._num_streams)
            streams = <Stream*> PyMem_Realloc(self._streams, grown * sizeof(Stream))
            if streams == NULL:
                raise MemoryError()
            memset(streams + self._num_streams, 0, (grown - self._num_streams) * sizeof(Stream))
            self._streams = streams
            self._num_streams = grown
        return &self._streams[number]

    # a stream's counts of a block, wherever they are kept

    cdef uint64_t _counts(self, Stream* s, Py_ssize_t number, uint64_t key):
        """Stream ``number``'s counts of ``key`` (0: it does not hold it)."""
        cdef uint64_t entry, counts
        if not _get(&self._holders, key, &entry):
            return 0
        if entry & LONE:
            if _holder(entry) != number:
                return 0
            if not entry & COUNTS_APART:
                return _unfolded(entry)
        if _get(&s.key_to_counts, key, &counts):
            return counts
        return 0

    cdef int _set(self, Stream* s, Py_ssize_t number, uint64_t key, uint64_t old,
                  uint64_t new) except -1:
        """Stream ``number``'s counts of ``key`` go from ``old`` to ``new``."""
        cdef uint64_t entry
        if old == 0:
            return self._join(s, number, key, new)
        if new == 0:
            return self._release(number, key)
        _get(&self._holders, key, &entry)
        if entry & LONE and not entry & COUNTS_APART and _foldable(new):
            _put(&self._holders, key, _folded(number, new))
        else:
            _put(&s.key_to_counts, key, new)
            if entry & LONE:
                _put(&self._holders, key, LONE | COUNTS_APART | (<uint64_t> number << NUMBER_SHIFT))
        return 0

    cdef int _join(self, Stream* s, Py_ssize_t number, uint64_t key, uint64_t counts) except -1:
        cdef uint64_t entry
        cdef Py_ssize_t other, i
        cdef Stream* o
        if not _get(&self._holders, key, &entry):
            if _foldable(counts):
                _put(&self._holders, key, _folded(number, counts))
            else:
                _put(&s.key_to_counts, key, counts)
                _put(&self._holders, key, LONE | COUNTS_APART | (<uint64_t> number << NUMBER_SHIFT))
            return 0
        _put(&s.key_to_counts, key, counts)
        if entry & LONE:  # a second holder: the first one's counts move to its own table
            other = _holder(entry)
            if not entry & COUNTS_APART:
                o = &self._streams[other]
                _put(&o.key_to_counts, key, _unfolded(entry))
            bitmap = (_ONE << other) | (_ONE << number)
            if self._free_shared:
                i = self._free_shared.pop()
                self._shared[i] = bitmap
            else:
                i = len(self._shared)
                self._shared.append(bitmap)
            _put(&self._holders, key, 2 * <uint64_t> i)
        else:
            i = <Py_ssize_t> (entry >> 1)
            self._shared[i] = self._shared[i] | (_ONE << number)
        return 0

    cdef int _release(self, Py_ssize_t number, uint64_t key) except -1:
        """Stream ``number`` no longer holds ``key``."""
        _delete(&self._streams[number].key_to_counts, key)
        return self._leave(number, key)

    cdef int _leave(self, Py_ssize_t number, uint64_t key) except -1:
        """Take stream ``number`` out of ``key``'s holders (its own table is not touched).
        A single holder left keeps its counts in its own table: none of its engine hashes
        may map to the block any more, and a clear must still find it there."""
        cdef uint64_t entry
        cdef Py_ssize_t i, other
        if not _get(&self._holders, key, &entry):
            return 0
        if entry & LONE:
            _delete(&self._holders, key)
            return 0
        i = <Py_ssize_t> (entry >> 1)
        bitmap = self._shared[i] & ~(_ONE << number)
        if bitmap & (bitmap - 1):
            self._shared[i] = bitmap
            return 0
        self._shared[i] = 0
        self._free_shared.append(i)
        other = bitmap.bit_length() - 1
        _put(&self._holders, key, LONE | COUNTS_APART | (<uint64_t> other << NUMBER_SHIFT))
        return 0

    cdef int _unlink(self, Stream* s, Py_ssize_t number, uint64_t key) except -1:
        """The engine hash that mapped to ``key`` now maps elsewhere: if the stream holds
        it alone with folded counts, they move to its own table, where a clear finds them."""
        cdef uint64_t entry
        if (
            _get(&self._holders, key, &entry) and entry & LONE and not entry & COUNTS_APART
            and _holder(entry) == number
        ):
            _put(&s.key_to_counts, key, _unfolded(entry))
            _put(&self._holders, key, LONE | COUNTS_APART | (<uint64_t> number << NUMBER_SHIFT))
        return 0

    # streams

    def reset(self, Py_ssize_t number):
        """Forget every block of stream ``number`` (and its place among their holders):
        the blocks its engine hashes name, then those of its table of counts."""
        cdef Stream* s = self._stream(number)
        cdef Py_ssize_t i
        cdef uint64_t entry
        cdef Table* hashes = &s.hash_to_key
        cdef Table* counts = &s.key_to_counts
        for i in range(hashes.capacity):
            if hashes.slots[i].key != 0:
                self._forget_folded(number, hashes.slots[i].value)
        if hashes.has_zero:
            self._forget_folded(number, hashes.zero_value)
        for i in range(counts.capacity):
            if counts.slots[i].key != 0:
                self._leave(number, counts.slots[i].key)
        if counts.has_zero:
            self._leave(number, 0)
        _free(&s.hash_to_key)
        _free(&s.key_to_counts)
        memset(s.blocks_by_tier, 0, sizeof(s.blocks_by_tier))

    cdef int _forget_folded(self, Py_ssize_t number, uint64_t key) except -1:
        cdef uint64_t entry
        if (
            _get(&self._holders, key, &entry) and entry & LONE and not entry & COUNTS_APART
            and _holder(entry) == number
        ):
            _delete(&self._holders, key)
        return 0

    def apply(self, Py_ssize_t number, ops):
        """Apply ``(kind, tier, engine_hash, key)`` ops to stream ``number`` in order, as
        ``MemoryIndex`` does; returns (unknown removals, unresolved stores)."""
        cdef Stream* s = self._stream(number)
        cdef long kind, tier
        cdef Py_ssize_t unknown = 0, unresolved = 0
        cdef int done
        cdef tuple op
        for op in ops:
            kind = op[0]
            tier = op[1]
            if tier < 0 or tier >= NUM_TIERS:
                raise ValueError(f"tier out of range: {tier}")
            done = self._apply_op(s, number, kind, tier, op[2], op[3] if kind == OP_STORE else 0)
            if done == UNKNOWN_REMOVAL:
                unknown += 1
            elif done == UNRESOLVED_STORE:
                unresolved += 1
        return unknown, unresolved

    cdef int _apply_op(self, Stream* s, Py_ssize_t number, long kind, long tier,
                       uint64_t engine_hash, uint64_t key) except -1:
        """One op (``tier`` in range); returns :data:`UNKNOWN_REMOVAL` for a removal of a
        block not held, :data:`UNRESOLVED_STORE` for a store by an unknown hash, else 0."""
        cdef uint64_t previous, counts
        cdef uint64_t* mapped
        if kind == OP_REMOVE:
            return 0 if self._remove(s, number, engine_hash, tier) else UNKNOWN_REMOVAL
        if kind == OP_STORE:
            mapped = _value_of(&s.hash_to_key, engine_hash)
            if mapped == NULL:
                _insert(&s.hash_to_key, engine_hash, key)
            elif mapped[0] != key:
                previous = mapped[0]
                mapped[0] = key
                self._unlink(s, number, previous)  # it does not touch ``hash_to_key``
            if _value_of(&self._holders, key) == NULL:
                # Held by no stream (the common new block): this one holds it alone,
                # its one count folded into the entry, as _join would do in 3 probes.
                s.blocks_by_tier[tier] += 1
                counts = (<uint64_t> 1) << (LANE_BITS * tier)
                _insert(&self._holders, key, _folded(number, counts))
                return 0
        elif kind == OP_STORE_BY_HASH:
            if not _get(&s.hash_to_key, engine_hash, &key):
                return UNRESOLVED_STORE
        else:
            self.reset(number)
            return 0
        counts = self._counts(s, number, key)
        if _lane(counts, tier) == 0:
            s.blocks_by_tier[tier] += 1
        if _lane(counts, tier) < LANE_MAX:
            self._set(s, number, key, counts, counts + ((<uint64_t> 1) << (LANE_BITS * tier)))
        return 0

    cdef bint _remove(self, Stream* s, Py_ssize_t number, uint64_t engine_hash, long tier) except -1:
        cdef uint64_t key, counts, held
        if not _get(&s.hash_to_key, engine_hash, &key):
            return False
        counts = self._counts(s, number, key)
        held = _lane(counts, tier)
        if held == 0:
            return False
        if held == 1:
            s.blocks_by_tier[tier] -= 1
        self._set(s, number, key, counts, counts - ((<uint64_t> 1) << (LANE_BITS * tier)))
        if counts == (<uint64_t> 1) << (LANE_BITS * tier):  # its last count: the hash goes too
            _delete(&s.hash_to_key, engine_hash)
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
        once one stream is left, its own holding of each next block is checked."""
        cdef Py_ssize_t n = len(keys), num_blocks = 1, lone
        cdef uint64_t entry = 0
        cdef list out = []
        cdef object matching, still
        if n == 0 or not _get(&self._holders, keys[0], &entry):
            return out
        if entry & LONE:  # one holder: no bitmaps at all
            lone = _holder(entry)
            matching = _ONE << lone
        else:
            matching = self._shared[<Py_ssize_t> (entry >> 1)]
            while num_blocks < n and matching & (matching - 1):
                if _get(&self._holders, keys[num_blocks], &entry):
                    still = matching & (
                        (_ONE << _holder(entry)) if entry & LONE
                        else self._shared[<Py_ssize_t> (entry >> 1)]
                    )
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
        for i in range(start, len(keys)):
            if self._counts(s, number, keys[i]) == 0:
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
            counts = self._counts(s, number, keys[i])
            if counts == 0:
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

    # the compiled ingest path

    def ingest(self, Py_ssize_t number, list batches, object cache, uint64_t root,
               object watermark):
        """Translate and apply :class:`NativeBatch` es of stream ``number`` in order, as
        ``kvindex.indexer.ingest.Ingestor`` and ``MemoryIndex.apply_many`` do for the same
        events (the reference the tests hold this to): each batch's ops are made first
        (a parent is looked up in ``cache``, the ``Ingestor``'s two-generation engine hash
        → key cache, then in the stream's table as the previous batch left it), then
        applied unless its seq is at or below ``watermark``. Returns ``(watermark, last
        applied ts or None, batches applied, unknown removals, unresolved stores, blocks
        stored, blocks removed, clears, events of another group, misaligned events, orphan
        stores, the last store's block size or -1)``."""
        cdef Stream* s = self._stream(number)
        cdef Ingest counts
        cdef NativeBatch batch
        cdef dict young = cache.young, old = cache.old
        cdef Py_ssize_t half = cache.capacity // 2, i, num_ops
        cdef object last_ts = None
        cdef int done
        cdef Op* op
        memset(&counts, 0, sizeof(Ingest))
        counts.block_size = -1
        try:
            for batch in batches:
                self._ops.size = 0
                self._translate(s, batch, young, old, root, &counts)
                if len(young) >= half:
                    old = young
                    young = {}
                if batch.seq <= watermark:
                    continue
                num_ops = self._ops.size // sizeof(Op)
                for i in range(num_ops):
                    op = (<Op*> self._ops.data) + i
                    done = self._apply_op(s, number, op.kind, op.tier, op.engine_hash, op.key)
                    if done == UNKNOWN_REMOVAL:
                        counts.unknown += 1
                    elif done == UNRESOLVED_STORE:
                        counts.unresolved += 1
                watermark = batch.seq
                last_ts = batch.ts
                counts.applied += 1
        finally:
            cache.young = young
            cache.old = old
        return (
            watermark, last_ts, counts.applied, counts.unknown, counts.unresolved,
            counts.stored, counts.removed, counts.clears, counts.other_group,
            counts.misaligned, counts.orphans, counts.block_size,
        )

    cdef int _translate(self, Stream* s, NativeBatch batch, dict young, dict old,
                        uint64_t root, Ingest* counts) except -1:
        """One batch's events → ops in ``self._ops`` (counted into ``counts``)."""
        cdef const uint64_t* w = <const uint64_t*> batch._words.data
        cdef const uint64_t* end = w + batch._words.size // 8
        cdef uint64_t tag, kind, n, parent, i
        cdef long tier
        while w < end:
            tag = w[0]
            tier = (tag >> 8) & 0xFF
            kind = tag & 0xFF
            if kind == EV_STORE:
                n = w[1]
                if tag & HAS_PARENT:
                    parent = self._parent_key(s, w[2], young, old, counts)
                else:
                    parent = root
                counts.block_size = <Py_ssize_t> w[3]
                self._store_ops(
                    young, tier, w + 5, n, parent,
                    <const unsigned char*> batch._tokens.data + w[4], <Py_ssize_t> w[3],
                )
                counts.stored += n
                w += 5 + n
            elif kind == EV_REMOVE:
                n = w[1]
                for i in range(n):
                    _push_op(&self._ops, OP_REMOVE, tier, w[2 + i], 0)
                counts.removed += n
                w += 2 + n
            elif kind == EV_CLEAR:
                _push_op(&self._ops, OP_CLEAR, 0, 0, 0)
                counts.clears += 1
                w += 1
            elif kind == EV_OTHER_GROUP:
                counts.other_group += 1
                w += 1
            else:
                counts.misaligned += 1
                w += 1
        return 0

    cdef uint64_t _parent_key(self, Stream* s, uint64_t parent_hash, dict young, dict old,
                              Ingest* counts) except? 0:
        """The key of a store's parent: the cache (young, then old: moved back to young),
        the stream's table, else an orphan root (counted)."""
        cdef object h = parent_hash
        cdef PyObject* found = PyDict_GetItem(young, h)
        cdef uint64_t key
        if found != NULL:
            return <uint64_t> <object> found
        found = PyDict_GetItem(old, h)
        if found != NULL:
            young[h] = <object> found
            return <uint64_t> <object> found
        if _get(&s.hash_to_key, parent_hash, &key):
            young[h] = key
            return key
        counts.orphans += 1
        return _orphan_root(parent_hash)

    cdef int _store_ops(self, dict young, long tier, const uint64_t* hashes, uint64_t n,
                        uint64_t parent, const unsigned char* tokens,
                        Py_ssize_t block_size) except -1:
        """The store ops of one event's blocks, keys chained from ``parent``; each engine
        hash → key goes to ``young``."""
        cdef Py_ssize_t stride = block_size * 4
        cdef uint64_t i
        cdef int j
        cdef unsigned char* buf
        _reserve(&self._scratch, 8 + stride)
        buf = <unsigned char*> self._scratch.data
        for i in range(n):
            for j in range(8):
                buf[j] = (parent >> (8 * j)) & 0xFF
            memcpy(buf + 8, tokens + i * stride, stride)
            parent = XXH3_64bits(buf, 8 + stride)
            _push_op(&self._ops, OP_STORE, tier, hashes[i], parent)
            young[hashes[i]] = parent
        return 0


