# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled hot loops: block-key chaining, the memory store's tables, and the compiled ingest
path (live msgpack frames read into flat records, translated and applied in one call).

The tables are open-addressing arrays of 16-byte slots (Robin Hood linear probing, deletion
by backward shift, at most 90 % full), allocated with ``PyMem_Malloc`` so ``tracemalloc`` sees them.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport (
    PyMem_Free, PyMem_Malloc, PyMem_RawFree, PyMem_RawMalloc, PyMem_RawRealloc, PyMem_Realloc,
)
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset, strlen

cdef extern from *:
    "#define XXH_INLINE_ALL"

cdef extern from "vendor/xxhash.h":
    uint64_t XXH3_64bits(const void* data, size_t length) nogil

cdef extern from "kv_inline.h":
    Py_ssize_t kv_home(uint64_t key, uint64_t capacity) nogil
    void kv_prefetch(const void* slots, Py_ssize_t entry_size, uint64_t key, uint64_t capacity) nogil
    void kv_store_le32(unsigned char* out, uint32_t value) nogil

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
    """Reference: kvindex.indexer.domain.keys.chain_keys; tests/unit/indexer/native/test_core.py::test_compiled_chain_agrees_with_python

    Keys of the full blocks of ``token_bytes``: each XXH3-64 of its parent (u64 LE) and bytes."""
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
    """Reference: kvindex.indexer.domain.keys.chain_keys; tests/unit/indexer/native/test_core.py::test_compiled_chain_agrees_with_python

    :func:`chain` over token ids, ints in [0, 2**32) (else OverflowError or TypeError)."""
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
    """Reference: tests.oracles.translation.pack_tokens; tests/unit/indexer/native/test_core.py::test_pack_tokens_equal_the_python_packing

    Token ids (a list or tuple of ints in [0, 2**32)) as little-endian u32 bytes."""
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
    """A decoded store's token ids as little-endian u32 bytes (``packed``): a read-only
    sequence equal to the list it stands for, and only to lists."""

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
    """Reference: kvindex.indexer.ingest.wire._decode_general; tests/unit/indexer/native/test_core.py::test_packed_decoding_agrees_with_the_general_one

    One msgpack array of ints in [0, 2**32) as :class:`PackedTokens`, else None."""
    cdef Py_buffer view
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    try:
        return _packed(<const unsigned char*> view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef inline int _int_width(unsigned char head) noexcept nogil:
    # Bytes after a msgpack uint or int head; -1 for any other head (fixints: the caller).
    if head == 0xCC or head == 0xD0:
        return 1
    if head == 0xCD or head == 0xD1:
        return 2
    if head == 0xCE or head == 0xD2:
        return 4
    if head == 0xCF or head == 0xD3:
        return 8
    return -1


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
            width = _int_width(head)
            if width < 0:
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
    """Reference: kvindex.indexer.ingest.wire._general_hashes; tests/unit/indexer/native/test_core.py::test_compiled_hash_fast_path_agrees_with_python

    ``tuple(values)`` for a list of ints in [0, 2**64), else None (the caller normalises)."""
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


def store_chain(list ops, KeyCache cache, object kind, object tier, engine_hashes,
                uint64_t parent, bytes token_bytes, Py_ssize_t block_size):
    """Reference: tests.oracles.translation.store_chain; tests/unit/indexer/native/test_core.py::test_compiled_translation_agrees_with_python

    A store's ``(kind, tier, engine_hash, key)`` ops to ``ops``, each mapping cached; one engine
    hash per full block (ValueError). Returns the number of blocks."""
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
            _put(&cache._young, PyLong_AsUnsignedLongLong(engine_hash), parent)
    finally:
        PyMem_Free(buf)
    return num_blocks


def remove_ops(list ops, object kind, object tier, engine_hashes):
    """Reference: tests.oracles.translation.remove_ops; tests/unit/indexer/native/test_core.py::test_compiled_translation_agrees_with_python

    ``(kind, tier, engine_hash, 0)`` to ``ops`` for each engine hash."""
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
    PREFETCH_AHEAD = 8  # keys a lookup's walk asks for ahead of its probe
    PREFETCH_ABOVE = 65536  # slots (1 MiB) from which a lookup's walk prefetches
    DOUBLING_BELOW = 4096  # small tables double; large ones grow by a quarter

cdef inline Py_ssize_t _home(const Table* t, uint64_t key) noexcept nogil:
    return kv_home(key, <uint64_t> t.capacity)

cdef inline Py_ssize_t _next(const Table* t, Py_ssize_t i) noexcept nogil:
    i += 1
    return 0 if i == t.capacity else i

cdef inline Py_ssize_t _distance(const Table* t, uint64_t key, Py_ssize_t i) noexcept nogil:
    cdef Py_ssize_t home = _home(t, key)
    return i - home if i >= home else i + t.capacity - home

cdef inline void _shift_up(Table* t, Py_ssize_t i) noexcept nogil:
    # Move the entries from slot i to the next empty one up a slot, freeing slot i.
    cdef Py_ssize_t j = i, k
    while t.slots[j].key != 0:
        j = _next(t, j)
    while j != i:
        k = j - 1 if j > 0 else t.capacity - 1
        t.slots[j] = t.slots[k]
        j = k

cdef Py_ssize_t _find(const Table* t, uint64_t key) noexcept nogil:
    """The slot holding ``key`` (not 0), or -1. Robin Hood order: a slot whose entry is nearer
    its home than ``key`` would be means ``key`` is absent (no scan of the whole cluster)."""
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

cdef bint _get(const Table* t, uint64_t key, uint64_t* value) noexcept nogil:
    cdef Py_ssize_t i
    if key == 0:
        value[0] = t.zero_value
        return t.has_zero
    i = _find(t, key)
    if i < 0:
        return False
    value[0] = t.slots[i].value
    return True

cdef struct KeyWalk:
    uint64_t* keys  # keys[:read] converted from the caller's list
    Py_ssize_t n
    Py_ssize_t read

cdef inline uint64_t _key(KeyWalk* w, list keys, Py_ssize_t i, const Table* t) except? 0:
    # keys[i]; in a table past the caches, each key's home slot is asked for PREFETCH_AHEAD
    # keys before its probe (a lookup's keys are known in advance; its probes miss).
    if t.capacity < PREFETCH_ABOVE:
        return keys[i]
    cdef Py_ssize_t last = min(i + PREFETCH_AHEAD, w.n - 1)
    cdef uint64_t key
    while w.read <= last:
        key = keys[w.read]
        w.keys[w.read] = key
        kv_prefetch(t.slots, sizeof(Entry), key, <uint64_t> t.capacity)
        w.read += 1
    return w.keys[i]

cdef void _place(Table* t, Entry entry) noexcept nogil:
    """Insert an absent ``key`` (not 0) before the first entry of its run whose home lies past
    its own (homes are monotonic in the mixed key); the rest of the run moves up one slot."""
    cdef Py_ssize_t i = _home(t, entry.key), d = 0
    while t.slots[i].key != 0 and _distance(t, t.slots[i].key, i) >= d:
        i = _next(t, i)
        d += 1
    _shift_up(t, i)
    t.slots[i] = entry

cdef int _resize(Table* t, Py_ssize_t capacity) except -1 nogil:
    """Move every entry to ``capacity`` slots, read from an empty slot on so they come in home
    order and each lands at its home or just after the one before; one out of order is placed."""
    cdef Entry* old = t.slots
    cdef Py_ssize_t old_capacity = t.capacity, start = 0, n, i, home, pos
    cdef Py_ssize_t last = -1, last_home = 0  # where the last entry in order went, its home
    cdef Entry* slots = <Entry*> PyMem_RawMalloc(capacity * sizeof(Entry))
    if slots == NULL:
        with gil:
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
        if old[i].key == 0:
            continue
        home = _home(t, old[i].key)
        pos = home if home > last else last + 1
        if home >= last_home and pos < capacity and slots[pos].key == 0:
            slots[pos] = old[i]  # [home, pos) is full: its entries' homes are <= home
            last, last_home = pos, home
            continue
        _place(t, old[i])
        while last + 1 < capacity and slots[last + 1].key != 0:  # the run may have grown
            last += 1
    PyMem_RawFree(old)
    return 0

cdef uint64_t* _value_of(Table* t, uint64_t key) noexcept nogil:
    """Where ``key``'s value is kept, or NULL if it is absent (valid until an insertion)."""
    cdef Py_ssize_t i
    if key == 0:
        return &t.zero_value if t.has_zero else NULL
    i = _find(t, key)
    return NULL if i < 0 else &t.slots[i].value

cdef inline bint _full(const Table* t) noexcept nogil:
    return (t.size + 1) * 10 > t.capacity * 9

cdef int _grow(Table* t) except -1 nogil:
    if t.capacity < DOUBLING_BELOW:
        return _resize(t, max(2 * t.capacity, MIN_CAPACITY))
    return _resize(t, t.capacity + t.capacity // 4)

cdef int _insert(Table* t, uint64_t key, uint64_t value) except -1 nogil:
    """Insert ``key``, known to be absent."""
    cdef Entry entry
    if key == 0:
        t.has_zero = True
        t.zero_value = value
        return 0
    if _full(t):
        _grow(t)
    entry.key = key
    entry.value = value
    _place(t, entry)
    t.size += 1
    return 0

cdef uint64_t* _slot_for(Table* t, uint64_t key, bint* added) except NULL nogil:
    """Where ``key``'s value is kept, inserted as 0 (``added`` set) if absent: one walk."""
    cdef Py_ssize_t i = 0, d = 0
    cdef uint64_t found
    if key == 0:
        added[0] = not t.has_zero
        if added[0]:
            t.has_zero = True
            t.zero_value = 0
        return &t.zero_value
    if t.capacity:
        i = _home(t, key)
        while True:
            found = t.slots[i].key
            if found == key:
                added[0] = False
                return &t.slots[i].value
            if found == 0 or _distance(t, found, i) < d:
                break
            i = _next(t, i)
            d += 1
    added[0] = True
    if _full(t):  # the slot found moves: insert anew (rare)
        _grow(t)
        _insert(t, key, 0)
        return &t.slots[_find(t, key)].value
    _shift_up(t, i)
    t.slots[i].key = key
    t.slots[i].value = 0
    t.size += 1
    return &t.slots[i].value

cdef int _put(Table* t, uint64_t key, uint64_t value) except -1 nogil:
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

cdef bint _delete(Table* t, uint64_t key) noexcept nogil:
    """Remove ``key`` (False if absent); the entries after it shift back (no tombstone)."""
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

cdef void _free(Table* t) noexcept nogil:
    PyMem_RawFree(t.slots)
    memset(t, 0, sizeof(Table))

cdef void _clear(Table* t) noexcept nogil:
    """Empty the table, keeping its slots."""
    if t.capacity:
        memset(t.slots, 0, t.capacity * sizeof(Entry))
    t.size = 0
    t.has_zero = False

cdef inline Py_ssize_t _len(const Table* t) noexcept nogil:
    return t.size + (1 if t.has_zero else 0)

cdef Py_ssize_t _nbytes(const Table* t) noexcept nogil:
    return t.capacity * sizeof(Entry)


# --- the engine hash -> key cache -----------------------------------------------------------


cdef class KeyCache:
    """Reference: tests.oracles.key_cache.KeyCache; tests/unit/indexer/native/test_native_ingest.py::test_the_compiled_key_cache_answers_as_the_python_one

    Recent engine hash → key mappings of one stream in two generations: new ones go to the young;
    :meth:`age` makes a young one of ``capacity // 2`` the old, dropping the old whole; a hit in the
    old is copied back. Hashes are u64 (else OverflowError). Not thread-safe."""

    cdef Table _young
    cdef Table _old
    cdef readonly Py_ssize_t capacity

    def __cinit__(self, Py_ssize_t capacity):
        memset(&self._young, 0, sizeof(Table))
        memset(&self._old, 0, sizeof(Table))
        self.capacity = capacity

    def __dealloc__(self):
        _free(&self._young)
        _free(&self._old)

    def __len__(self):
        """Mappings in the young generation."""
        return _len(&self._young)

    def get(self, uint64_t engine_hash):
        cdef uint64_t key
        if _get(&self._young, engine_hash, &key):
            return key
        if _get(&self._old, engine_hash, &key):
            _put(&self._young, engine_hash, key)
            return key
        return None

    def put(self, uint64_t engine_hash, uint64_t key):
        _put(&self._young, engine_hash, key)

    def age(self):
        _age(&self._young, &self._old, self.capacity // 2)

    def translate(self, list batches, uint64_t root):
        """The first phase of ``Tables.ingest``, without the GIL or the index: each batch's ops
        made in order, a parent looked up in this cache alone, up to a store whose parent it
        lacks. Returns the batches translated whole. They must next go to ``Tables.ingest`` in
        order with this cache and ``root``; a batch translated and not ingested: ValueError."""
        cdef tuple held = tuple(batches)
        cdef Py_ssize_t n = len(held), i, done = 0
        cdef NativeBatch batch
        cdef void** views = <void**> PyMem_RawMalloc(max(2 * n, 1) * sizeof(void*))
        if views == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                batch = <NativeBatch?> held[i]
                if batch._t.resume >= 0:
                    raise ValueError("a batch translated ahead and not yet ingested")
                views[i] = &batch._r
                views[n + i] = &batch._t
            for i in range(n):
                batch = <NativeBatch> held[i]
                batch._cache = self
                batch._root = root
            with nogil:
                done = _translate_run(
                    <const Records**> views, <Translation**> (views + n), n, &self._young,
                    &self._old, self.capacity // 2, root,
                )
        finally:
            PyMem_RawFree(views)
        return done


cdef inline void _age(Table* young, Table* old, Py_ssize_t half) noexcept nogil:
    cdef Table dropped
    if _len(young) < half:
        return
    dropped = old[0]
    old[0] = young[0]
    young[0] = dropped
    _clear(young)


cdef int _cached_parent(Table* young, Table* old, Table* hash_to_key, uint64_t parent_hash,
                        uint64_t* key) except -2 nogil:
    """A parent's key from the cache (young, then old: copied back), else from the stream's
    table (then cached): 1; 0: unknown; -1: in neither generation and ``hash_to_key`` NULL."""
    if _get(young, parent_hash, key):
        return 1
    if _get(old, parent_hash, key):
        _put(young, parent_hash, key[0])
        return 1
    if hash_to_key == NULL:
        return -1
    if _get(hash_to_key, parent_hash, key):
        _put(young, parent_hash, key[0])
        return 1
    return 0


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


cdef inline uint64_t _lane(uint64_t counts, long tier) noexcept nogil:
    return (counts >> (LANE_BITS * tier)) & LANE_MAX

cdef inline bint _foldable(uint64_t counts) noexcept nogil:
    cdef long tier
    for tier in range(NUM_TIERS):
        if _lane(counts, tier) > SHORT_LANE_MAX:
            return False
    return True

cdef inline uint64_t _folded(Py_ssize_t number, uint64_t counts) noexcept nogil:
    cdef uint64_t entry = LONE | (<uint64_t> number << NUMBER_SHIFT)
    cdef long tier
    for tier in range(NUM_TIERS):
        entry |= _lane(counts, tier) << (COUNTS_SHIFT + SHORT_LANE_BITS * tier)
    return entry

cdef inline uint64_t _unfolded(uint64_t entry) noexcept nogil:
    cdef uint64_t counts = 0
    cdef long tier
    for tier in range(NUM_TIERS):
        counts |= ((entry >> (COUNTS_SHIFT + SHORT_LANE_BITS * tier)) & SHORT_LANE_MAX) << (
            LANE_BITS * tier
        )
    return counts

cdef inline Py_ssize_t _holder(uint64_t entry) noexcept nogil:
    return <Py_ssize_t> ((entry >> NUMBER_SHIFT) & NUMBER_MAX)


# --- the compiled ingest path's records ------------------------------------------------

cdef struct Buffer:  # a growable byte array (PyMem_RawRealloc: grown without the GIL)
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

cdef struct Records:  # one NativeBatch's events, as Tables.ingest reads them without the GIL
    Buffer words  # the records
    Buffer tokens  # every store's token ids, packed
    Buffer hashes  # every event's engine hashes, u64
    uint64_t seq

cdef struct Op:
    uint64_t engine_hash
    uint64_t key
    long kind
    long tier

cdef struct Translation:  # a batch's ops made ahead of Tables.ingest (KeyCache.translate)
    Buffer ops
    Ingest counts  # what making them counted (the translation's counts only)
    Py_ssize_t resume  # the word its translation stopped at (-1: not translated)


cdef int _reserve(Buffer* b, Py_ssize_t more) except -1 nogil:
    cdef Py_ssize_t capacity
    cdef char* data
    if b.size + more <= b.capacity:
        return 0
    capacity = max(2 * b.capacity, b.size + more, 256)
    data = <char*> PyMem_RawRealloc(b.data, capacity)
    if data == NULL:
        with gil:
            raise MemoryError()
    b.data = data
    b.capacity = capacity
    return 0

cdef inline int _push_op(Buffer* b, long kind, long tier, uint64_t engine_hash,
                         uint64_t key) except -1 nogil:
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

cdef inline int _push_word(Buffer* b, uint64_t word) except -1 nogil:
    if b.size + 8 > b.capacity:
        _reserve(b, 8)
    (<uint64_t*> (b.data + b.size))[0] = word
    b.size += 8
    return 0

cdef uint64_t _orphan_root(uint64_t parent_hash) noexcept nogil:
    """Reference: kvindex.indexer.ingest.ingestor.orphan_root; tests/unit/indexer/native/test_native_ingest.py::test_random_chains_give_the_same_index_and_reports"""
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

cdef class NativeBatch:
    """Reference: kvindex.indexer.ingest.wire.decode_payload; tests/unit/indexer/native/test_native_ingest.py::test_captured_frames_are_read_as_the_python_path_reads_them

    One live batch for the compiled ingest path: seq, timestamp, rank and its events as flat
    records of 64-bit words. Made by :func:`native_live` only when every event takes that path."""

    cdef readonly object seq
    cdef readonly double ts
    cdef readonly object rank
    cdef readonly Py_ssize_t num_events
    cdef Records _r
    cdef Translation _t
    cdef object _cache  # the KeyCache that translated it ahead (None: not translated)
    cdef uint64_t _root  # and the root it chained from

    def __cinit__(self):
        memset(&self._r, 0, sizeof(Records))
        memset(&self._t, 0, sizeof(Translation))
        self._t.resume = -1

    def __dealloc__(self):
        PyMem_RawFree(self._r.words.data)
        PyMem_RawFree(self._r.tokens.data)
        PyMem_RawFree(self._r.hashes.data)
        PyMem_RawFree(self._t.ops.data)

    @property
    def translated(self):
        """Whether :meth:`KeyCache.translate` made ops ``Tables.ingest`` has not consumed yet."""
        return self._t.resume >= 0

    cdef void _consume(self) noexcept:
        PyMem_RawFree(self._t.ops.data)
        memset(&self._t, 0, sizeof(Translation))
        self._t.resume = -1
        self._cache = None

    @property
    def num_bad_events(self):
        """Always 0: a batch with an undecodable event is never made one."""
        return 0

    @property
    def num_blocks(self):
        """Engine hashes its events name: what ``MemoryIndex`` bounds its lock holds by."""
        return self._r.hashes.size // 8

    def records(self):
        """The events as read, as tuples (for tests)."""
        cdef const uint64_t* w = <const uint64_t*> self._r.words.data
        cdef const uint64_t* end = w + self._r.words.size // 8
        cdef const unsigned char* t
        cdef const uint64_t* h
        cdef uint64_t kind, n, i
        cdef list out = []
        while w < end:
            kind = w[0] & 0xFF
            if kind == EV_STORE:
                n = w[4]
                t = <const unsigned char*> self._r.tokens.data + w[3]
                h = (<const uint64_t*> self._r.hashes.data) + w[5]
                out.append((
                    "store", <long> ((w[0] >> 8) & 0xFF), w[1] if w[0] & HAS_PARENT else None,
                    <Py_ssize_t> w[2], [_le32(t + 4 * i) for i in range(n * w[2])],
                    tuple([h[i] for i in range(n)]),
                ))
                w += 6
            elif kind == EV_REMOVE:
                n = w[1]
                h = (<const uint64_t*> self._r.hashes.data) + w[2]
                out.append(("remove", <long> ((w[0] >> 8) & 0xFF), tuple([h[i] for i in range(n)])))
                w += 3
            else:
                out.append(("clear",) if kind == EV_CLEAR else (
                    ("other_group",) if kind == EV_OTHER_GROUP else ("misaligned",)))
                w += 1
        return out


cdef extern from *:
    int _lowest_bit "__builtin_ctz" (unsigned int x) nogil


cdef inline uint32_t _le32(const unsigned char* b) noexcept nogil:
    return b[0] | (<uint32_t> b[1] << 8) | (<uint32_t> b[2] << 16) | (<uint32_t> b[3] << 24)


cdef class Tables:
    """Reference: tests.oracles.tables.PyTables; tests/unit/indexer/native/test_core.py::test_compiled_tables_agree_with_python

    Every stream's block maps (streams numbered below 2**24) and the block → holders map: a key
    maps to its one holder with its counts folded in, or to a bitmap of holders (a Python int).
    A tier's count saturates at 2**21 - 1. Not thread-safe: the caller locks."""

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
        PyMem_RawFree(self._ops.data)
        PyMem_RawFree(self._scratch.data)

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

    cdef uint64_t _counts(self, Stream* s, Py_ssize_t number, uint64_t key) noexcept nogil:
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
                  uint64_t new) except -1 nogil:
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

    cdef int _join(self, Stream* s, Py_ssize_t number, uint64_t key,
                   uint64_t counts) except -1 nogil:
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
            with gil:  # bitmaps are Python ints
                i = self._new_shared(other, number)
            _put(&self._holders, key, 2 * <uint64_t> i)
        else:
            with gil:
                self._add_shared(<Py_ssize_t> (entry >> 1), number)
        return 0

    # the bitmaps of blocks with several holders (Python ints: the GIL is held)

    cdef Py_ssize_t _new_shared(self, Py_ssize_t first, Py_ssize_t second) except -1:
        cdef Py_ssize_t i
        bitmap = (_ONE << first) | (_ONE << second)
        if self._free_shared:
            i = self._free_shared.pop()
            self._shared[i] = bitmap
        else:
            i = len(self._shared)
            self._shared.append(bitmap)
        return i

    cdef int _add_shared(self, Py_ssize_t i, Py_ssize_t number) except -1:
        self._shared[i] = self._shared[i] | (_ONE << number)
        return 0

    cdef Py_ssize_t _drop_shared(self, Py_ssize_t i, Py_ssize_t number) except -2:
        """Stream ``number`` leaves bitmap ``i``: -1 if several are left, else the one left."""
        bitmap = self._shared[i] & ~(_ONE << number)
        if bitmap & (bitmap - 1):
            self._shared[i] = bitmap
            return -1
        self._shared[i] = 0
        self._free_shared.append(i)
        return bitmap.bit_length() - 1

    cdef int _release(self, Py_ssize_t number, uint64_t key) except -1 nogil:
        _delete(&self._streams[number].key_to_counts, key)
        return self._leave(number, key)

    cdef int _leave(self, Py_ssize_t number, uint64_t key) except -1 nogil:
        """Take stream ``number`` out of ``key``'s holders. A single holder left keeps its counts
        in its own table, where a clear must still find them."""
        cdef uint64_t entry
        cdef Py_ssize_t i, other
        if not _get(&self._holders, key, &entry):
            return 0
        if entry & LONE:
            _delete(&self._holders, key)
            return 0
        with gil:
            other = self._drop_shared(<Py_ssize_t> (entry >> 1), number)
        if other < 0:
            return 0
        _put(&self._holders, key, LONE | COUNTS_APART | (<uint64_t> other << NUMBER_SHIFT))
        return 0

    cdef int _unlink(self, Stream* s, Py_ssize_t number, uint64_t key) except -1 nogil:
        """The engine hash that mapped to ``key`` maps elsewhere now: folded counts of a block
        the stream holds alone move to its own table, where a clear finds them."""
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

    cdef int _forget_folded(self, Py_ssize_t number, uint64_t key) except -1 nogil:
        cdef uint64_t entry
        if (
            _get(&self._holders, key, &entry) and entry & LONE and not entry & COUNTS_APART
            and _holder(entry) == number
        ):
            _delete(&self._holders, key)
        return 0

    def apply(self, Py_ssize_t number, ops):
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
                       uint64_t engine_hash, uint64_t key) except -1 nogil:
        """One op; :data:`UNKNOWN_REMOVAL`, :data:`UNRESOLVED_STORE` or 0."""
        cdef uint64_t previous, counts
        cdef uint64_t* mapped
        cdef bint added
        if kind == OP_REMOVE:
            return 0 if self._remove(s, number, engine_hash, tier) else UNKNOWN_REMOVAL
        if kind == OP_STORE:
            mapped = _slot_for(&s.hash_to_key, engine_hash, &added)
            if added:
                mapped[0] = key
            elif mapped[0] != key:
                previous = mapped[0]
                mapped[0] = key
                self._unlink(s, number, previous)  # it does not touch ``hash_to_key``
            mapped = _slot_for(&self._holders, key, &added)
            if added:
                # Held by no stream (the common new block): this one holds it alone,
                # its one count folded into the entry, as _join would do in 3 probes.
                s.blocks_by_tier[tier] += 1
                mapped[0] = _folded(number, (<uint64_t> 1) << (LANE_BITS * tier))
                return 0
        elif kind == OP_STORE_BY_HASH:
            if not _get(&s.hash_to_key, engine_hash, &key):
                return UNRESOLVED_STORE
        else:
            with gil:
                self.reset(number)
            return 0
        counts = self._counts(s, number, key)
        if _lane(counts, tier) == 0:
            s.blocks_by_tier[tier] += 1
        if _lane(counts, tier) < LANE_MAX:
            self._set(s, number, key, counts, counts + ((<uint64_t> 1) << (LANE_BITS * tier)))
        return 0

    cdef bint _remove(self, Stream* s, Py_ssize_t number, uint64_t engine_hash,
                      long tier) except -1 nogil:
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
        cdef Stream* s = self._stream(number)
        cdef uint64_t key, engine_hash
        cdef list keys = []
        for engine_hash in engine_hashes:
            keys.append(key if _get(&s.hash_to_key, engine_hash, &key) else None)
        return keys

    def blocks_by_tier(self, Py_ssize_t number):
        cdef Stream* s = self._stream(number)
        return [s.blocks_by_tier[0], s.blocks_by_tier[1], s.blocks_by_tier[2]]

    # lookup

    def matched(self, list keys):
        cdef KeyWalk w
        w.n, w.read = len(keys), 0
        w.keys = <uint64_t*> PyMem_Malloc(max(w.n, 1) * sizeof(uint64_t))
        if w.keys == NULL:
            raise MemoryError()
        try:
            return self._matched(&w, keys)
        finally:
            PyMem_Free(w.keys)

    cdef list _matched(self, KeyWalk* w, list keys):
        cdef Py_ssize_t n = w.n, num_blocks = 1, lone
        cdef uint64_t entry = 0
        cdef list out = []
        cdef object matching, still, shared
        cdef bint several = False
        if n == 0 or not _get(&self._holders, _key(w, keys, 0, &self._holders), &entry):
            return out
        if entry & LONE:  # one holder: no bitmaps at all
            lone = _holder(entry)
            matching = _ONE << lone
        else:
            matching = self._shared[<Py_ssize_t> (entry >> 1)]
            several = (matching & (matching - 1)) != 0
            while num_blocks < n and several:
                if not _get(&self._holders, _key(w, keys, num_blocks, &self._holders), &entry):
                    still = 0
                elif entry & LONE:
                    still = matching & (_ONE << _holder(entry))
                else:
                    # A shared prefix's blocks have equal holders: a compare, no new int.
                    shared = self._shared[<Py_ssize_t> (entry >> 1)]
                    still = matching if shared == matching else matching & shared
                if still is not matching and still != matching:
                    out.append((matching ^ still, num_blocks))
                    if not still:
                        return out
                    matching = still
                    several = (matching & (matching - 1)) != 0
                num_blocks += 1
            lone = matching.bit_length() - 1
        if num_blocks < n and not several:
            num_blocks = self._held_from(lone, w, keys, num_blocks)
        out.append((matching, num_blocks))
        return out

    cdef Py_ssize_t _held_from(self, Py_ssize_t number, KeyWalk* w, list keys,
                               Py_ssize_t start) except -1:
        cdef Stream* s = self._stream(number)
        cdef Py_ssize_t i
        for i in range(start, w.n):
            if self._counts(s, number, _key(w, keys, i, &self._holders)) == 0:
                return i
        return w.n

    def best_tiers(self, Py_ssize_t number, list keys, Py_ssize_t num_blocks):
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

    def split_holders(self, object bitmap, list index_of):
        """``(indices, mixed)``: ``index_of[number]`` of the streams of ``bitmap`` holding blocks
        on GPU only, the others' numbers; ascending, in one pass, no object per stream."""
        cdef list indices = [], mixed = []
        if not bitmap:
            return indices, mixed
        cdef bytes raw = bitmap.to_bytes((bitmap.bit_length() + 7) // 8, "little")
        cdef const unsigned char* data = <const unsigned char*> PyBytes_AS_STRING(raw)
        cdef Py_ssize_t i, number, num_known = len(index_of)
        cdef unsigned int byte
        cdef Stream* s
        for i in range(PyBytes_GET_SIZE(raw)):
            byte = data[i]
            while byte:
                number = i * 8 + _lowest_bit(byte)
                byte &= byte - 1
                if number >= num_known or number >= self._num_streams:
                    raise IndexError(f"stream number {number} has no index")
                s = &self._streams[number]
                if s.blocks_by_tier[1] or s.blocks_by_tier[2]:
                    mixed.append(number)
                else:
                    indices.append(index_of[number])
        return indices, mixed

    def held(self, list keys, object wanted, list index_of, dict gpu_matches, object on_gpu,
             object mixed_match):
        """Reference: kvindex.indexer.index.memory.MemoryIndex._held_reference; tests/unit/indexer/index/test_memory.py::test_compiled_runs_equal_the_reference

        :meth:`matched`'s runs of the ``wanted`` streams, in its order, as ``(match, indices)``:
        the run's streams all on GPU together (``gpu_matches[num_blocks]``, else
        ``on_gpu(num_blocks)``), then each other one alone (``mixed_match(best_tiers)``)."""
        cdef list runs = [], all_gpu, mixed
        cdef object asked, match
        cdef Py_ssize_t num_blocks, number
        for run in self.matched(keys):
            asked = run[0] & wanted
            if not asked:
                continue
            num_blocks = run[1]
            all_gpu, mixed = self._split(asked, index_of)
            if all_gpu:
                match = gpu_matches.get(num_blocks)
                runs.append((on_gpu(num_blocks) if match is None else match, all_gpu))
            for number in mixed:
                match = mixed_match(self.best_tiers(number, keys, num_blocks))
                runs.append((match, [index_of[number]]))
        return runs

    cdef tuple _split(self, object bitmap, list index_of):
        # split_holders, a lone stream (most runs past a shared prefix) without its bytes.
        if bitmap & (bitmap - 1):
            return self.split_holders(bitmap, index_of)
        cdef Py_ssize_t number = bitmap.bit_length() - 1
        if number >= len(index_of) or number >= self._num_streams:
            raise IndexError(f"stream number {number} has no index")
        cdef Stream* s = &self._streams[number]
        if s.blocks_by_tier[1] or s.blocks_by_tier[2]:
            return [], [number]
        return [index_of[number]], []

    def nbytes(self):
        """Bytes the tables hold (slots allocated, not only those in use)."""
        cdef Py_ssize_t total = _nbytes(&self._holders) + self._num_streams * sizeof(Stream)
        cdef Py_ssize_t n
        for n in range(self._num_streams):
            total += _nbytes(&self._streams[n].hash_to_key)
            total += _nbytes(&self._streams[n].key_to_counts)
        return total

    # the compiled ingest path

    def ingest(self, Py_ssize_t number, list batches, KeyCache cache, uint64_t root,
               object watermark):
        """Reference: kvindex.indexer.ingest.ingestor.Ingestor; tests/unit/indexer/native/test_native_ingest.py::test_captured_frames_give_the_same_index_and_reports

        Translate and apply :class:`NativeBatch` es of stream ``number`` above ``watermark``, in
        order; returns the watermark, last ts and ``NativeCounts``. Runs without the GIL: the
        caller's lock keeps other calls out, and ``cache`` is this thread's alone."""
        cdef Stream* s = self._stream(number)
        cdef Ingest counts
        cdef tuple held = tuple(batches)
        cdef Py_ssize_t n = len(held), i, last = -1
        cdef bint marked = watermark >= 0
        cdef uint64_t mark = <uint64_t> watermark if marked else 0
        cdef void** views = <void**> PyMem_RawMalloc(max(2 * n, 1) * sizeof(void*))
        if views == NULL:
            raise MemoryError()
        memset(&counts, 0, sizeof(Ingest))
        counts.block_size = -1
        try:
            self._check_translated(held, cache, root)
            for i in range(n):
                views[i] = &(<NativeBatch> held[i])._r
                views[n + i] = &(<NativeBatch> held[i])._t
            with nogil:
                last = self._ingest_run(
                    s, number, <const Records**> views, <Translation**> (views + n), n,
                    &cache._young, &cache._old, cache.capacity // 2, root, &marked, &mark,
                    &counts,
                )
        finally:
            PyMem_RawFree(views)
            for i in range(n):
                if type(held[i]) is NativeBatch and (<NativeBatch> held[i])._cache is not None:
                    (<NativeBatch> held[i])._consume()
        return (
            mark if last >= 0 else watermark, (<NativeBatch> held[last]).ts if last >= 0 else None,
            counts.applied, counts.unknown, counts.unresolved, counts.stored, counts.removed,
            counts.clears, counts.other_group, counts.misaligned, counts.orphans,
            counts.block_size,
        )

    cdef int _check_translated(self, tuple held, KeyCache cache, uint64_t root) except -1:
        cdef NativeBatch batch
        cdef bint whole = True  # every batch before was translated whole
        for item in held:
            batch = <NativeBatch?> item
            if batch._t.resume < 0:
                whole = False
                continue
            if not whole or batch._cache is not cache or batch._root != root:
                raise ValueError("batches translated ahead must come first, by this cache")
            whole = batch._t.resume == batch._r.words.size // 8
        return 0

    cdef Py_ssize_t _ingest_run(self, Stream* s, Py_ssize_t number, const Records** views,
                                Translation** made, Py_ssize_t n, Table* young, Table* old,
                                Py_ssize_t half, uint64_t root, bint* marked, uint64_t* mark,
                                Ingest* counts) except -2 nogil:
        """``ingest``'s loop: the index of the last batch applied (-1: none)."""
        cdef Py_ssize_t b, last = -1
        cdef const Records* r
        cdef Translation* t
        cdef Buffer* ops
        for b in range(n):
            r = views[b]
            t = made[b]
            if t.resume < 0:
                ops = &self._ops
                ops.size = 0
                _translate(r, 0, ops, &self._scratch, young, old, &s.hash_to_key, root, counts)
                _age(young, old, half)
            else:
                ops = &t.ops
                _add_translated(counts, &t.counts)
                if t.resume < r.words.size // 8:  # stopped at a parent the cache lacked
                    _translate(r, t.resume, ops, &self._scratch, young, old, &s.hash_to_key,
                               root, counts)
                    _age(young, old, half)
            if marked[0] and r.seq <= mark[0]:
                continue
            self._apply_ops(s, number, <const Op*> ops.data, ops.size // sizeof(Op), counts)
            marked[0] = True
            mark[0] = r.seq
            last = b
            counts.applied += 1
        return last

    cdef int _apply_ops(self, Stream* s, Py_ssize_t number, const Op* ops, Py_ssize_t num_ops,
                        Ingest* counts) except -1 nogil:
        cdef Py_ssize_t i = 0
        while i < num_ops:
            if not self._needs_gil(s, number, ops + i):
                self._apply_counted(s, number, ops + i, counts)
                i += 1
                continue
            with gil:  # once for a run of such ops: taking it back costs a handover
                i = self._apply_with_gil(s, number, ops, i, num_ops, counts)
        return 0

    cdef int _apply_counted(self, Stream* s, Py_ssize_t number, const Op* op,
                            Ingest* counts) except -1 nogil:
        cdef int done = self._apply_op(s, number, op.kind, op.tier, op.engine_hash, op.key)
        if done == UNKNOWN_REMOVAL:
            counts.unknown += 1
        elif done == UNRESOLVED_STORE:
            counts.unresolved += 1
        return 0

    cdef Py_ssize_t _apply_with_gil(self, Stream* s, Py_ssize_t number, const Op* ops,
                                    Py_ssize_t i, Py_ssize_t num_ops,
                                    Ingest* counts) except -1:
        """Apply ``ops`` from ``i`` on while they need the GIL; the index of the first op left."""
        while True:
            self._apply_counted(s, number, ops + i, counts)
            i += 1
            if i == num_ops or not self._needs_gil(s, number, ops + i):
                return i

    cdef bint _needs_gil(self, Stream* s, Py_ssize_t number, const Op* op) noexcept nogil:
        """A clear, or a block another stream holds (its holders are a Python int)."""
        cdef uint64_t key = op.key, entry
        if op.kind == OP_CLEAR:
            return True
        if op.kind != OP_STORE and not _get(&s.hash_to_key, op.engine_hash, &key):
            return False  # an unknown removal or an unresolved store changes nothing
        if not _get(&self._holders, key, &entry):
            return False
        if op.kind == OP_REMOVE:
            return not entry & LONE
        return not entry & LONE or _holder(entry) != number


cdef void _add_translated(Ingest* counts, const Ingest* made) noexcept nogil:
    counts.stored += made.stored
    counts.removed += made.removed
    counts.clears += made.clears
    counts.other_group += made.other_group
    counts.misaligned += made.misaligned
    counts.orphans += made.orphans
    if made.block_size >= 0:
        counts.block_size = made.block_size


cdef Py_ssize_t _translate_run(const Records** views, Translation** made, Py_ssize_t n,
                               Table* young, Table* old, Py_ssize_t half,
                               uint64_t root) except -1 nogil:
    """``KeyCache.translate``'s loop: the number of batches translated whole."""
    cdef Buffer scratch
    cdef Py_ssize_t b, done = 0
    cdef Translation* t
    memset(&scratch, 0, sizeof(Buffer))
    try:
        for b in range(n):
            t = made[b]
            memset(&t.counts, 0, sizeof(Ingest))
            t.counts.block_size = -1
            t.ops.size = 0
            _reserve(&t.ops, (views[b].hashes.size // 8) * sizeof(Op))
            t.resume = _translate(views[b], 0, &t.ops, &scratch, young, old, NULL, root,
                                  &t.counts)
            if t.resume < views[b].words.size // 8:
                break
            _age(young, old, half)
            done += 1
    finally:
        PyMem_RawFree(scratch.data)
    return done


cdef Py_ssize_t _translate(const Records* r, Py_ssize_t start, Buffer* ops, Buffer* scratch,
                           Table* young, Table* old, Table* hash_to_key, uint64_t root,
                           Ingest* counts) except -1 nogil:
    """One batch's events from word ``start`` on → ops; the word it stopped at: the end, or
    (``hash_to_key`` NULL) the first store whose parent neither generation holds."""
    cdef const uint64_t* words = <const uint64_t*> r.words.data
    cdef const uint64_t* w = words + start
    cdef const uint64_t* end = words + r.words.size // 8
    cdef const uint64_t* hashes = <const uint64_t*> r.hashes.data
    cdef uint64_t tag, kind, n, parent, i
    cdef long tier
    cdef int found
    while w < end:
        tag = w[0]
        tier = (tag >> 8) & 0xFF
        kind = tag & 0xFF
        if kind == EV_STORE:  # tag, parent, block size, token offset, n, hash offset
            n = w[4]
            parent = root
            if tag & HAS_PARENT:
                found = _cached_parent(young, old, hash_to_key, w[1], &parent)
                if found < 0:
                    return w - words
                if found == 0:
                    counts.orphans += 1
                    parent = _orphan_root(w[1])
            counts.block_size = <Py_ssize_t> w[2]
            _store_ops(
                ops, scratch, young, tier, hashes + w[5], n, parent,
                <const unsigned char*> r.tokens.data + w[3], <Py_ssize_t> w[2],
            )
            counts.stored += n
            w += 6
        elif kind == EV_REMOVE:  # tag, n, hash offset
            n = w[1]
            for i in range(n):
                _push_op(ops, OP_REMOVE, tier, hashes[w[2] + i], 0)
            counts.removed += n
            w += 3
        elif kind == EV_CLEAR:
            _push_op(ops, OP_CLEAR, 0, 0, 0)
            counts.clears += 1
            w += 1
        elif kind == EV_OTHER_GROUP:
            counts.other_group += 1
            w += 1
        else:
            counts.misaligned += 1
            w += 1
    return w - words


cdef int _store_ops(Buffer* ops, Buffer* scratch, Table* young, long tier,
                    const uint64_t* hashes, uint64_t n, uint64_t parent,
                    const unsigned char* tokens, Py_ssize_t block_size) except -1 nogil:
    """A store's ops, keys chained from ``parent``; each engine hash → key goes to ``young``."""
    cdef Py_ssize_t stride = block_size * 4
    cdef uint64_t i
    cdef int j
    cdef unsigned char* buf
    if n == 0:  # nothing to hash (and a block size of 2**31 must not allocate 8 GB)
        return 0
    _reserve(scratch, 8 + stride)
    buf = <unsigned char*> scratch.data
    for i in range(n):
        for j in range(8):
            buf[j] = (parent >> (8 * j)) & 0xFF
        memcpy(buf + 8, tokens + i * stride, stride)
        parent = XXH3_64bits(buf, 8 + stride)
        _push_op(ops, OP_STORE, tier, hashes[i], parent)
        _put(young, hashes[i], parent)
    return 0


# --- live messages read straight into NativeBatch es --------------------------------------
# A reader of msgpack that accepts only what the wire module's fast decoders (msgspec)
# surely decode, and decode to the events read here: anything else makes it decline
# (REJECT), and the caller decodes the message the general way. Declining is always safe.

cdef enum:
    REJECT = -1
    MAX_SKIP_DEPTH = 32
    NUM_FIELDS = 11
    F_TYPE = 0
    F_HASHES = 1
    F_PARENT = 2
    F_TOKENS = 3
    F_BLOCK_SIZE = 4
    F_LORA_ID = 5
    F_MEDIUM = 6
    F_LORA_NAME = 7
    F_EXTRA_KEYS = 8
    F_GROUP = 9
    F_CACHE_SALT = 10
    K_STORED = 1
    K_REMOVED = 2
    K_CLEARED = 3

cdef struct Reader:
    const unsigned char* p
    Py_ssize_t pos
    Py_ssize_t size

cdef const char* _FIELD_NAMES[NUM_FIELDS]
_FIELD_NAMES[:] = [
    b"type", b"block_hashes", b"parent_block_hash", b"token_ids", b"block_size", b"lora_id",
    b"medium", b"lora_name", b"extra_keys", b"group_idx", b"cache_salt",
]
cdef Py_ssize_t _FIELD_LENGTHS[NUM_FIELDS]
for _f in range(NUM_FIELDS):
    _FIELD_LENGTHS[_f] = strlen(_FIELD_NAMES[_f])


cdef inline bint _has(const Reader* r, Py_ssize_t n) noexcept nogil:
    return n >= 0 and r.pos + n <= r.size

cdef int _container(Reader* r, unsigned char fix_low, unsigned char w16, unsigned char w32,
                    Py_ssize_t* count) noexcept nogil:
    """An array or map head (``fix_low``, ``w16``, ``w32``): its count in ``count``."""
    cdef unsigned char head
    if not _has(r, 1):
        return REJECT
    head = r.p[r.pos]
    if fix_low <= head <= fix_low + 0x0F:
        count[0] = head & 0x0F
        r.pos += 1
        return 0
    if head == w16 and _has(r, 3):
        count[0] = <Py_ssize_t> _be(r.p + r.pos + 1, 2)
        r.pos += 3
        return 0
    if head == w32 and _has(r, 5):
        count[0] = <Py_ssize_t> _be(r.p + r.pos + 1, 4)
        r.pos += 5
        return 0
    return REJECT

cdef inline int _array(Reader* r, Py_ssize_t* count) noexcept nogil:
    return _container(r, 0x90, 0xDC, 0xDD, count)

cdef inline int _map(Reader* r, Py_ssize_t* count) noexcept nogil:
    return _container(r, 0x80, 0xDE, 0xDF, count)

cdef int _str(Reader* r, const unsigned char** text, Py_ssize_t* length) noexcept nogil:
    cdef unsigned char head
    cdef int width
    if not _has(r, 1):
        return REJECT
    head = r.p[r.pos]
    if 0xA0 <= head <= 0xBF:
        length[0] = head & 0x1F
        width = 0
    elif head == 0xD9 or head == 0xDA or head == 0xDB:
        width = 1 if head == 0xD9 else (2 if head == 0xDA else 4)
        if not _has(r, 1 + width):
            return REJECT
        length[0] = <Py_ssize_t> _be(r.p + r.pos + 1, width)
    else:
        return REJECT
    if not _has(r, 1 + width + length[0]):
        return REJECT
    text[0] = r.p + r.pos + 1 + width
    r.pos += 1 + width + length[0]
    return 0

cdef inline bint _is_nil(Reader* r) noexcept nogil:
    if _has(r, 1) and r.p[r.pos] == 0xC0:
        r.pos += 1
        return True
    return False

cdef int _int(Reader* r, uint64_t* bits, bint* negative) noexcept nogil:
    """A msgpack int of any width: its low 64 bits (two's complement) and its sign."""
    cdef unsigned char head
    cdef int width
    if not _has(r, 1):
        return REJECT
    head = r.p[r.pos]
    if head < 0x80:
        bits[0] = head
        negative[0] = False
        r.pos += 1
        return 0
    if head >= 0xE0:
        bits[0] = <uint64_t> (<int64_t> (<signed char> head))
        negative[0] = True
        r.pos += 1
        return 0
    if 0xCC <= head <= 0xCF:
        width = 1 << (head - 0xCC)
    elif 0xD0 <= head <= 0xD3:
        width = 1 << (head - 0xD0)
    else:
        return REJECT
    if not _has(r, 1 + width):
        return REJECT
    bits[0] = _be(r.p + r.pos + 1, width)
    negative[0] = False
    if head >= 0xD0 and bits[0] >> (8 * width - 1):  # a negative signed int: sign-extend
        negative[0] = True
        if width < 8:
            bits[0] |= ~((<uint64_t> 1 << (8 * width)) - 1)
    r.pos += 1 + width
    return 0

cdef int _wire_hash_at(Reader* r, uint64_t* out) noexcept nogil:
    """An engine hash as ``normalize_hash`` makes it (int: low 64 bits; bin: last 8, BE)."""
    cdef unsigned char head
    cdef Py_ssize_t n
    cdef int width
    cdef bint negative
    if not _has(r, 1):
        return REJECT
    head = r.p[r.pos]
    if head == 0xC4 or head == 0xC5 or head == 0xC6:
        width = 1 if head == 0xC4 else (2 if head == 0xC5 else 4)
        if not _has(r, 1 + width):
            return REJECT
        n = <Py_ssize_t> _be(r.p + r.pos + 1, width)
        if not _has(r, 1 + width + n):
            return REJECT
        out[0] = _be(r.p + r.pos + 1 + width + max(n - 8, 0), <int> min(n, 8))
        r.pos += 1 + width + n
        return 0
    return _int(r, out, &negative)

cdef int _skip(Reader* r, int depth) noexcept nogil:
    """Skip one item msgspec surely reads as some value; REJECT anything else."""
    cdef unsigned char head
    cdef Py_ssize_t n, i, width
    cdef uint64_t bits
    cdef bint negative
    cdef const unsigned char* text
    if depth > MAX_SKIP_DEPTH or not _has(r, 1):
        return REJECT
    head = r.p[r.pos]
    if head < 0x80 or head >= 0xE0:
        r.pos += 1
        return 0
    if 0xCC <= head <= 0xD3:
        return _int(r, &bits, &negative)
    if head == 0xC0 or head == 0xC2 or head == 0xC3:
        r.pos += 1
        return 0
    if head == 0xCA or head == 0xCB:
        width = 5 if head == 0xCA else 9
        if not _has(r, width):
            return REJECT
        r.pos += width
        return 0
    if 0xA0 <= head <= 0xBF or 0xD9 <= head <= 0xDB:
        if _str(r, &text, &n) < 0 or not _utf8(text, n):
            return REJECT
        return 0
    if head == 0xC4 or head == 0xC5 or head == 0xC6:
        return _wire_hash_at(r, &bits)
    if 0x90 <= head <= 0x9F or head == 0xDC or head == 0xDD:
        if _array(r, &n) < 0 or n > r.size - r.pos:
            return REJECT
        for i in range(n):
            if _skip(r, depth + 1) < 0:
                return REJECT
        return 0
    if 0x80 <= head <= 0x8F or head == 0xDE or head == 0xDF:
        if _map(r, &n) < 0 or n > r.size - r.pos:
            return REJECT
        for i in range(2 * n):
            if _skip(r, depth + 1) < 0:
                return REJECT
        return 0
    return REJECT  # ext types and the unused head 0xC1

cdef bint _utf8(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """Valid UTF-8: no surrogates, no overlong forms."""
    cdef Py_ssize_t i = 0, extra, j
    cdef uint32_t c
    cdef unsigned char b
    while i < n:
        b = s[i]
        if b < 0x80:
            i += 1
            continue
        if 0xC2 <= b <= 0xDF:
            extra, c = 1, b & 0x1F
        elif 0xE0 <= b <= 0xEF:
            extra, c = 2, b & 0x0F
        elif 0xF0 <= b <= 0xF4:
            extra, c = 3, b & 0x07
        else:
            return False
        if i + extra >= n:
            return False
        for j in range(1, extra + 1):
            if s[i + j] & 0xC0 != 0x80:
                return False
            c = (c << 6) | (s[i + j] & 0x3F)
        if (extra == 2 and (c < 0x800 or 0xD800 <= c <= 0xDFFF)) or (
            extra == 3 and (c < 0x10000 or c > 0x10FFFF)
        ):
            return False
        i += extra + 1
    return True

cdef int _field_of(const unsigned char* name, Py_ssize_t n) noexcept nogil:
    cdef int f
    for f in range(NUM_FIELDS):
        if _FIELD_LENGTHS[f] == n and memcmp(_FIELD_NAMES[f], name, n) == 0:
            return f
    return -1

cdef int _kind_of(Reader* r) noexcept nogil:
    cdef const unsigned char* text
    cdef Py_ssize_t n
    if _str(r, &text, &n) < 0:
        return REJECT
    if n == 11 and memcmp(text, b"BlockStored", 11) == 0:
        return K_STORED
    if n == 12 and memcmp(text, b"BlockRemoved", 12) == 0:
        return K_REMOVED
    if n == 16 and memcmp(text, b"AllBlocksCleared", 16) == 0:
        return K_CLEARED
    return REJECT


cdef enum:
    MAP_FORM = 1
    ARRAY_FORM = 2

cdef int[9] _STORED_AT = [F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM,
                          F_LORA_NAME, F_EXTRA_KEYS, F_GROUP]
cdef int[3] _REMOVED_AT = [F_HASHES, F_MEDIUM, F_GROUP]


cdef struct Fields:
    Py_ssize_t at[NUM_FIELDS]  # where each field's value starts (-1: absent)
    Py_ssize_t hash_at  # block_hashes: where in the batch's hashes (in hashes)
    Py_ssize_t num_hashes  # -1: not an array of ints and bins
    Py_ssize_t token_at  # token_ids: where in the batch's tokens (in bytes)
    Py_ssize_t num_tokens  # -1: not an array of ints in [0, 2**32)


cdef int _field_value(NativeBatch batch, Reader* r, int f, Fields* out) except -2:
    """One field's value: hashes and token ids into the batch's buffers, others checked, skipped."""
    cdef Py_ssize_t start = r.pos, n
    if f < 0:
        return _skip(r, 0)
    if out.at[f] >= 0:  # a repeated key: left to msgspec
        return REJECT
    out.at[f] = start
    if f == F_HASHES:
        n = _hashes_into(&batch._r.hashes, r)
        if n >= 0:
            out.num_hashes = n
            out.hash_at = batch._r.hashes.size // 8 - n
            return 0
        r.pos = start
    elif f == F_TOKENS:
        n = _tokens_into(&batch._r.tokens, r)
        if n >= 0:
            out.num_tokens = n
            out.token_at = batch._r.tokens.size - 4 * n
            return 0
        r.pos = start
    return _skip(r, 0)


cdef int _fields(NativeBatch batch, Reader* r, int form, Fields* out) except -2:
    """Read one event's fields; its kind (K_STORED, K_REMOVED, K_CLEARED) or REJECT."""
    cdef Py_ssize_t n, i, length
    cdef const unsigned char* name
    cdef int f, kind
    cdef Reader tag
    for f in range(NUM_FIELDS):
        out.at[f] = -1
    out.num_hashes = out.num_tokens = -1
    if form == MAP_FORM:
        if _map(r, &n) < 0 or n > r.size - r.pos:
            return REJECT
        for i in range(n):
            if _str(r, &name, &length) < 0:
                return REJECT
            if _field_value(batch, r, _field_of(name, length), out) < 0:
                return REJECT
        if out.at[F_TYPE] < 0:
            return REJECT
        tag = r[0]
        tag.pos = out.at[F_TYPE]
        return _kind_of(&tag)
    if _array(r, &n) < 0 or n < 1 or n > r.size - r.pos:
        return REJECT
    kind = _kind_of(r)
    if kind == REJECT or (kind == K_STORED and n < 6) or (kind == K_REMOVED and n < 2):
        return REJECT
    for i in range(1, n):
        f = -1
        if kind == K_STORED and i <= 9:
            f = _STORED_AT[i - 1]
        elif kind == K_REMOVED and i <= 3:
            f = _REMOVED_AT[i - 1]
        if _field_value(batch, r, f, out) < 0:
            return REJECT
    return kind


cdef Py_ssize_t _hashes_into(Buffer* out, Reader* r) except -2:
    """Engine hashes (ints, bins) appended to ``out``: their number, or REJECT (none appended)."""
    cdef Py_ssize_t n, i, start = out.size
    cdef uint64_t value
    if _array(r, &n) < 0 or n > r.size - r.pos:
        return REJECT
    _reserve(out, 8 * n)
    for i in range(n):
        if _wire_hash_at(r, &value) < 0:
            out.size = start
            return REJECT
        (<uint64_t*> (out.data + out.size))[0] = value
        out.size += 8
    return n


cdef Py_ssize_t _tokens_into(Buffer* out, Reader* r) except -2:
    """Ints in [0, 2**32) appended to ``out`` as u32 LE: their number, or REJECT (none appended)."""
    cdef Py_ssize_t n, i, start = out.size
    cdef uint64_t value
    cdef unsigned char head
    cdef unsigned char* buf
    cdef int width
    if _array(r, &n) < 0 or n > r.size - r.pos:
        return REJECT
    _reserve(out, 4 * n)
    buf = <unsigned char*> out.data + start
    for i in range(n):
        head = r.p[r.pos] if r.pos < r.size else 0xC1
        if head < 0x80:
            value = head
            r.pos += 1
        elif head == 0xCD and r.pos + 3 <= r.size:  # most token ids: a u16, read at once
            value = (<uint64_t> r.p[r.pos + 1] << 8) | r.p[r.pos + 2]
            r.pos += 3
        else:
            width = _int_width(head)
            if width < 0:
                return REJECT  # a negative fixint, not an int, or the end
            if not _has(r, 1 + width):
                return REJECT
            value = _be(r.p + r.pos + 1, width)
            r.pos += 1 + width
            if (head >= 0xD0 and value >> (8 * width - 1)) or value >> 32:
                return REJECT  # negative, or past u32
        kv_store_le32(buf + 4 * i, <uint32_t> value)
    out.size = start + 4 * n
    return n


cdef inline Reader _at(const Reader* r, Py_ssize_t pos) noexcept nogil:
    cdef Reader sub = r[0]
    sub.pos = pos
    return sub


cdef int _optional_int(const Reader* r, Py_ssize_t pos, bint* is_zero) noexcept nogil:
    """An ``int | None`` field (absent: None): ``is_zero`` unless a non-zero int."""
    cdef Reader sub
    cdef uint64_t bits
    cdef bint negative
    is_zero[0] = True
    if pos < 0:
        return 0
    sub = _at(r, pos)
    if _is_nil(&sub):
        return 0
    if _int(&sub, &bits, &negative) < 0:
        return REJECT
    is_zero[0] = bits == 0
    return 0


cdef int _medium(const Reader* r, Py_ssize_t pos, long* tier) noexcept nogil:
    """``medium``: absent, nil or ``"GPU"`` (tier 0), ``"CPU"`` or SGLang's ``"CPU_PINNED"``
    (1); REJECT otherwise."""
    cdef Reader sub
    cdef const unsigned char* text
    cdef Py_ssize_t n
    tier[0] = 0
    if pos < 0:
        return 0
    sub = _at(r, pos)
    if _is_nil(&sub):
        return 0
    if _str(&sub, &text, &n) < 0:
        return REJECT
    if n == 10 and memcmp(text, b"CPU_PINNED", 10) == 0:
        tier[0] = 1
        return 0
    if n != 3:
        return REJECT
    if memcmp(text, b"GPU", 3) == 0:
        return 0
    if memcmp(text, b"CPU", 3) == 0:
        tier[0] = 1
        return 0
    return REJECT


cdef int _no_extras_at(const Reader* r, Py_ssize_t lora_name, Py_ssize_t extra_keys,
                       Py_ssize_t cache_salt) noexcept nogil:
    """No LoRA name nor SGLang's cache salt (absent or nil); extra keys absent, nil, or nil
    for every block."""
    cdef Reader sub
    cdef Py_ssize_t n, i
    if lora_name >= 0:
        sub = _at(r, lora_name)
        if not _is_nil(&sub):
            return REJECT
    if cache_salt >= 0:
        sub = _at(r, cache_salt)
        if not _is_nil(&sub):
            return REJECT
    if extra_keys >= 0:
        sub = _at(r, extra_keys)
        if _is_nil(&sub):
            return 0
        if _array(&sub, &n) < 0:
            return REJECT
        for i in range(n):
            if not _is_nil(&sub):
                return REJECT
    return 0


cdef int _read_removed(NativeBatch batch, const Reader* r, const Fields* f) except -2:
    cdef long tier
    cdef bint main
    if f.at[F_HASHES] < 0 or f.num_hashes < 0 or _medium(r, f.at[F_MEDIUM], &tier) < 0:
        return REJECT
    if _optional_int(r, f.at[F_GROUP], &main) < 0:
        return REJECT
    if not main:
        _push_word(&batch._r.words, EV_OTHER_GROUP)
        return 0
    _push_word(&batch._r.words, EV_REMOVE | (<uint64_t> tier << 8))
    _push_word(&batch._r.words, <uint64_t> f.num_hashes)
    _push_word(&batch._r.words, <uint64_t> f.hash_at)
    return 0


cdef int _block_size(const Reader* r, Py_ssize_t pos, long long* size) noexcept nogil:
    """``block_size`` (absent: 0), an int in [-2**31, 2**31) here."""
    cdef Reader sub
    cdef uint64_t bits
    cdef bint negative
    size[0] = 0
    if pos < 0:
        return 0
    sub = _at(r, pos)
    if _int(&sub, &bits, &negative) < 0:
        return REJECT
    if (not negative and bits >= (1ULL << 31)) or (negative and <int64_t> bits < -(1LL << 31)):
        return REJECT
    size[0] = <long long> (<int64_t> bits)
    return 0


cdef int _read_stored(NativeBatch batch, const Reader* r, const Fields* f) except -2:
    """A store's record; REJECT for what the Python path must take (a LoRA name, extra keys,
    a cache salt, an uncommon medium, token ids not all u32) or msgspec might decode otherwise."""
    cdef long tier
    cdef bint main, lora_zero
    cdef long long block_size
    cdef Py_ssize_t num_tokens = 0, num_hashes = f.num_hashes
    cdef uint64_t parent = 0, tag
    cdef Reader sub
    if f.at[F_HASHES] < 0 or num_hashes < 0 or _medium(r, f.at[F_MEDIUM], &tier) < 0:
        return REJECT
    if _optional_int(r, f.at[F_GROUP], &main) < 0:
        return REJECT
    if _optional_int(r, f.at[F_LORA_ID], &lora_zero) < 0:
        return REJECT
    if _no_extras_at(r, f.at[F_LORA_NAME], f.at[F_EXTRA_KEYS], f.at[F_CACHE_SALT]) < 0:
        return REJECT
    if _block_size(r, f.at[F_BLOCK_SIZE], &block_size) < 0:
        return REJECT
    tag = EV_STORE | (<uint64_t> tier << 8)
    if f.at[F_PARENT] >= 0:
        sub = _at(r, f.at[F_PARENT])
        if not _is_nil(&sub):
            if _wire_hash_at(&sub, &parent) < 0:
                return REJECT
            tag |= HAS_PARENT
    if f.at[F_TOKENS] >= 0:
        num_tokens = f.num_tokens
        if num_tokens < 0:
            return REJECT
    if main and block_size == 0 and num_tokens == 0:
        return REJECT  # a placeholder: the Python path
    if not main or block_size <= 0 or num_tokens % block_size or (
        num_tokens // block_size != num_hashes
    ):
        _push_word(&batch._r.words, EV_MISALIGNED if main else EV_OTHER_GROUP)
        return 0
    _push_word(&batch._r.words, tag)
    _push_word(&batch._r.words, parent)
    _push_word(&batch._r.words, <uint64_t> block_size)
    _push_word(&batch._r.words, <uint64_t> f.token_at if f.at[F_TOKENS] >= 0 else 0)
    _push_word(&batch._r.words, <uint64_t> num_hashes)
    _push_word(&batch._r.words, <uint64_t> f.hash_at)
    return 0


cdef int _read_event(NativeBatch batch, Reader* r, int form) except -2:
    cdef Fields f
    cdef int kind = _fields(batch, r, form, &f)
    if kind == K_STORED:
        return _read_stored(batch, r, &f)
    if kind == K_REMOVED:
        return _read_removed(batch, r, &f)
    if kind == K_CLEARED:
        _push_word(&batch._r.words, EV_CLEAR)
        return 0
    return REJECT


cdef int _form(const Reader* r) noexcept nogil:
    """Whether the next event is a map (vLLM >= 0.24) or an array (<= 0.23)."""
    cdef unsigned char head
    if not _has(r, 1):
        return REJECT
    head = r.p[r.pos]
    if 0x80 <= head <= 0x8F or head == 0xDE or head == 0xDF:
        return MAP_FORM
    if 0x90 <= head <= 0x9F or head == 0xDC or head == 0xDD:
        return ARRAY_FORM
    return REJECT


cdef object _read_batch(uint64_t seq, const unsigned char* p, Py_ssize_t size):
    """``[ts, events, data_parallel_rank]`` as a NativeBatch, or None."""
    cdef Reader r
    cdef Py_ssize_t n, num_events, i
    cdef uint64_t bits
    cdef bint negative
    cdef int form = 0
    cdef NativeBatch batch
    r.p, r.pos, r.size = p, 0, size
    if _array(&r, &n) < 0 or not (n == 2 or n == 3) or not _has(&r, 9) or p[r.pos] != 0xCB:
        return None
    bits = _be(p + r.pos + 1, 8)
    r.pos += 9
    if _array(&r, &num_events) < 0 or num_events > size - r.pos:
        return None
    batch = NativeBatch.__new__(NativeBatch)
    batch.seq = seq
    batch._r.seq = seq
    memcpy(&batch.ts, &bits, 8)
    batch.num_events = num_events
    for i in range(num_events):
        if i == 0:
            form = _form(&r)
        elif _form(&r) != form:
            return None  # maps and arrays mixed: the Python path reads them one by one
        if form < 0 or _read_event(batch, &r, form) < 0:
            return None
    batch.rank = 0
    if n == 3 and not _is_nil(&r):
        if _int(&r, &bits, &negative) < 0:
            return None
        batch.rank = <int64_t> bits if negative else bits
    if r.pos != size:
        return None
    return batch


def native_live(list frames):
    """Reference: kvindex.indexer.ingest.wire.decode_payload; tests/unit/indexer/native/test_native_ingest.py::test_fuzzed_frames_are_read_as_the_python_path_reads_them

    A live message ``[topic, seq, payload]`` read into a :class:`NativeBatch`, or None for
    anything the general decode must read (it then counts and reports it as ever)."""
    cdef Py_buffer view
    cdef const unsigned char* s
    cdef uint64_t seq
    if len(frames) != 3:
        return None
    topic, seq_frame, payload = frames
    if type(topic) is not bytes or type(seq_frame) is not bytes or type(payload) is not bytes:
        return None
    if PyBytes_GET_SIZE(seq_frame) != 8:
        return None
    seq = _be(<const unsigned char*> PyBytes_AS_STRING(seq_frame), 8)
    if seq == 0xFFFFFFFFFFFFFFFFULL:
        return None
    try:
        (<bytes> topic).decode("utf-8")
    except UnicodeDecodeError:
        return None
    return _read_batch(
        seq, <const unsigned char*> PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload)
    )
