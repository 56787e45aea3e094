/* A bounded lock-free single-producer/single-consumer ring of (op, key) records.
 *
 * One thread pushes, one other thread pops. head and tail are free-running
 * counters (they wrap modulo 2^64, never reset); tail - head is the number of
 * records in the ring. The producer publishes a slot with a release store of
 * tail, the consumer frees it with a release store of head; each side reads
 * the other's counter with an acquire load, so whatever the producer wrote
 * before a push (the record, and any payload it set up elsewhere) is visible
 * to the consumer once it sees that push.
 */
#ifndef OURO_FAST_RING_H
#define OURO_FAST_RING_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define OURO_RING_LINE 64

typedef struct {
    int32_t op;
    int64_t key;
} ouro_ring_record;

typedef struct {
    /* Consumer's line: next index to read, and its last view of tail. */
    _Alignas(OURO_RING_LINE) _Atomic size_t head;
    size_t tail_seen;
    /* Producer's line: next index to write, and its last view of head. */
    _Alignas(OURO_RING_LINE) _Atomic size_t tail;
    size_t head_seen;
    /* Read-only after creation. */
    _Alignas(OURO_RING_LINE) size_t mask;
    ouro_ring_record *slots;
} ouro_ring;

/* capacity must be a power of two > 0; NULL when out of memory. */
static inline ouro_ring *ouro_ring_create(size_t capacity) {
    ouro_ring *r = aligned_alloc(OURO_RING_LINE, sizeof(ouro_ring));
    if (r == NULL) return NULL;
    r->slots = malloc(capacity * sizeof(ouro_ring_record));
    if (r->slots == NULL) {
        free(r);
        return NULL;
    }
    atomic_init(&r->head, 0);
    atomic_init(&r->tail, 0);
    r->tail_seen = 0;
    r->head_seen = 0;
    r->mask = capacity - 1;
    return r;
}

static inline void ouro_ring_destroy(ouro_ring *r) {
    if (r == NULL) return;
    free(r->slots);
    free(r);
}

static inline size_t ouro_ring_capacity(const ouro_ring *r) { return r->mask + 1; }

/* Producer only. 1 when pushed, 0 when full; never blocks, never allocates. */
static inline int ouro_ring_push(ouro_ring *r, int32_t op, int64_t key) {
    size_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
    if (tail - r->head_seen > r->mask) {
        /* Looks full from the cached head: look again at the real one. */
        r->head_seen = atomic_load_explicit(&r->head, memory_order_acquire);
        if (tail - r->head_seen > r->mask) return 0;
    }
    ouro_ring_record *slot = &r->slots[tail & r->mask];
    slot->op = op;
    slot->key = key;
    atomic_store_explicit(&r->tail, tail + 1, memory_order_release);
    return 1;
}

/* Consumer only. How many records can be read now; the cached view of tail
 * is refreshed when it shows fewer than want, so every record pushed before
 * this call is counted, up to want. */
static inline size_t ouro_ring_readable(ouro_ring *r, size_t want) {
    size_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    if (r->tail_seen - head < want) {
        r->tail_seen = atomic_load_explicit(&r->tail, memory_order_acquire);
    }
    return r->tail_seen - head;
}

/* Consumer only, i < ouro_ring_readable(): the i-th unread record. */
static inline ouro_ring_record ouro_ring_peek(const ouro_ring *r, size_t i) {
    size_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    return r->slots[(head + i) & r->mask];
}

/* Consumer only, n <= ouro_ring_readable(): hands n read slots back to the producer. */
static inline void ouro_ring_consume(ouro_ring *r, size_t n) {
    size_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    atomic_store_explicit(&r->head, head + n, memory_order_release);
}

/* Either thread: a snapshot of the number of records, exact when the ring is idle. */
static inline size_t ouro_ring_size(const ouro_ring *r) {
    size_t head = atomic_load_explicit(&r->head, memory_order_acquire);
    size_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
    size_t n = tail - head;
    /* head read first and tail only grows, so n >= 0; clamp a stale pair. */
    return n > r->mask + 1 ? r->mask + 1 : n;
}

#endif
