/* Small C helpers shared by the compiled modules (_core.pyx, _json.pyx). */
#ifndef KVINDEX_KV_INLINE_H
#define KVINDEX_KV_INLINE_H

#include <stdint.h>
#include <string.h>
#include <Python.h>

/* A u32 stored little-endian (one store on a little-endian host). */
static inline void kv_store_le32(unsigned char* out, uint32_t value) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(out, &value, 4);
#else
    out[0] = value & 0xFF; out[1] = (value >> 8) & 0xFF;
    out[2] = (value >> 16) & 0xFF; out[3] = (value >> 24) & 0xFF;
/* Ask for a key's home slot ahead of its probe (a lookup walks keys known in advance). */
static inline void kv_prefetch(const void* slots, Py_ssize_t entry_size, uint64_t key,
                               uint64_t capacity) {
    if (capacity) __builtin_prefetch((const char*)slots + kv_home(key, capacity) * entry_size);
}

#endif
}

/* A key's home slot in a table of any capacity: the high bits of a 128-bit product
   (keys are mixed first: engine hashes in tests are small ints). */
static inline Py_ssize_t kv_home(uint64_t key, uint64_t capacity) {
    uint64_t mixed = key * 0x9E3779B97F4A7C15ULL;
    return (Py_ssize_t)(((unsigned __int128)(mixed ^ (mixed >> 29)) * capacity) >> 64);
}

/* Ask for a key's home slot ahead of its probe (a lookup walks keys known in advance). */
static inline void kv_prefetch(const void* slots, Py_ssize_t entry_size, uint64_t key,
                               uint64_t capacity) {
    if (capacity) __builtin_prefetch((const char*)slots + kv_home(key, capacity) * entry_size);
}

#endif
