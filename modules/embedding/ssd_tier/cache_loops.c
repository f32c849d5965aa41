/* The row cache's per-row loops in C, called through ctypes (modules/embedding/ssd_tier/native_loops.py, which
 * also says how this file is built). Each loop has a torch / numpy twin that computes the same thing, is the
 * reference the tests compare it with (tests/test_native_loops.py) and runs where no C compiler is found.
 *
 * 1. assign_slots_i32 / _i64 — each unique id of a batch to its slot (twin: set_victims.place):
 *
 *   table   t = the last table with first[t] <= id            (ids ascending: one forward walk)
 *   set     s = set_offset[t] + (id − first[t]) mod nsets[t]
 *   hit     keys[s·W + w] = id         → used = clock, uses += 1 (saturating at 2^23 − 1, so that the lfu
 *                                        score below stays within int64), dirty |= mark_dirty
 *   miss    (after every hit of the batch is pinned, misses in ascending id order) the way of s with the
 *           least score among the ways not pinned (used < hold: rows used since call `hold` stay — this
 *           call's, and with hold < clock those of a batch still under way), ties the lower way:
 *             −1 empty (key < 0);  lru: used;  lfu: uses·2^40 + used
 *           (the first empty way is found from the set's keys alone, read already: while a cache fills, most
 *           misses take one without reading the ways' uses and last uses — the C lookup −14–22 % there)
 *           → its old key and dirty flag are returned (the caller writes the row back), then
 *             key = id, used = clock (pinned), uses = 1, dirty = mark_dirty
 *
 *   Returns −1, or the set in which a miss found every way pinned: the cache is then left as the hits made
 *   it (the misses admitted before are rolled back), or −2 − i where ids[i] is below the first table's first
 *   id (nothing touched: its set would be outside the arrays). Keys are int32 or int64 (two entry points).
 *
 * 2. bloom_add / bloom_may_hold — a sorted run's Bloom filter (twin and formulas: bloom.py).
 * 3. paged_find — keys in a sorted run's records file, one page read per key (twin and layout:
 *    paged_records.py): each key's page from the fences, the pages asked of the kernel at once
 *    (madvise WILLNEED, runs of adjacent pages as one call), a binary search of the page's inline keys.
 */
#define _DEFAULT_SOURCE
#include <string.h>
#include <sys/mman.h>
#include <stdint.h>

#define USE_BITS 40
#define USE_CAP ((1 << (63 - USE_BITS)) - 1)  /* uses · 2^USE_BITS + used < 2^63 */
#define MAX_WAYS 64  /* the row cache's W (32) at most */
#define PREFETCH 16  /* ids (misses) ahead whose set's lines are prefetched */
#define LINE 64       /* bytes of a cache line */

#define DEFINE_ASSIGN(NAME, KEY)                                                                               \
int64_t NAME(const int64_t *ids, int64_t n, const int64_t *first, const int64_t *nsets,                        \
             const int64_t *set_offset, int64_t tables, KEY *keys, int32_t *used, int32_t *uses,               \
             uint8_t *dirty, int64_t ways, int32_t clock, int32_t hold, int32_t mark_dirty, int32_t lfu,       \
             int64_t *slot_out, int64_t *table_out, int64_t *miss_out, int64_t *old_key_out,                   \
             uint8_t *old_dirty_out, int32_t *old_used, int32_t *old_uses, int64_t *n_miss_out)                \
{                                                                                                              \
    int64_t t = 0, misses = 0;                                                                                 \
    for (int64_t i = 0; i < n; i++) {  /* slot_out first holds each id's set's first slot */                 \
        const int64_t id = ids[i];                                                                             \
        if (id < first[0]) { *n_miss_out = 0; return -2 - i; }  /* its set: before the arrays */              \
        while (t + 1 < tables && first[t + 1] <= id) t++;                                                      \
        slot_out[i] = (set_offset[t] + (id - first[t]) % nsets[t]) * ways;                                     \
        table_out[i] = t;                                                                                      \
    }                                                                                                          \
    for (int64_t i = 0; i < n; i++) {                                                                          \
        if (i + PREFETCH < n) {  /* the sets are scattered: ask for their lines a few ids ahead */             \
            const int64_t ahead = slot_out[i + PREFETCH];                                                      \
            for (int64_t w = 0; w < ways; w += LINE / (int64_t)sizeof(KEY))                                    \
                __builtin_prefetch(keys + ahead + w);                                                          \
        }                                                                                                      \
        const int64_t id = ids[i], base = slot_out[i];                                                         \
        const KEY key = (KEY)id;                                                                               \
        int64_t way = -1;  /* a branch-free scan, no early exit: a key sits in one way at most */              \
        for (int64_t w = 0; w < ways; w++)                                                                     \
            way = keys[base + w] == key ? w : way;                                                             \
        if (way >= 0) {                                                                                        \
            const int64_t s = base + way;                                                                      \
            slot_out[i] = s;                                                                                   \
            used[s] = clock;                                                                                   \
            uses[s] += uses[s] < USE_CAP;                                                                      \
            if (mark_dirty) dirty[s] = 1;                                                                      \
        } else {                                                                                               \
            miss_out[misses++] = i;                                                                            \
        }                                                                                                      \
    }                                                                                                          \
    for (int64_t m = 0; m < misses; m++) {                                                                     \
        if (m + PREFETCH < misses) {                                                                           \
            const int64_t ahead = slot_out[miss_out[m + PREFETCH]];                                            \
            for (int64_t w = 0; w < ways; w += LINE / (int64_t)sizeof(KEY))                                    \
                __builtin_prefetch(keys + ahead + w);                                                          \
            for (int64_t w = 0; w < ways; w += LINE / 4) {                                                     \
                __builtin_prefetch(used + ahead + w, 1);                                                       \
                __builtin_prefetch(uses + ahead + w, 1);                                                       \
            }                                                                                                  \
            __builtin_prefetch(dirty + ahead, 1);                                                              \
        }                                                                                                      \
        const int64_t i = miss_out[m], base = slot_out[i];                                                     \
        int64_t best = -1;  /* an empty way wins outright, found from the keys alone (read by the lookup) */   \
        for (int64_t w = 0; w < ways && best < 0; w++)                                                         \
            if (keys[base + w] < 0) best = w;                                                                  \
        if (best < 0) {  /* else branch-free scores of the unpinned ways, then the first least */              \
            int64_t score[MAX_WAYS], low = INT64_MAX;                                                          \
            for (int64_t w = 0; w < ways; w++) {                                                               \
                const int64_t s = base + w;                                                                    \
                const int64_t v = lfu ? ((int64_t)uses[s] << USE_BITS) | used[s] : (int64_t)used[s];           \
                score[w] = used[s] >= hold ? INT64_MAX : v;                                                    \
                low = score[w] < low ? score[w] : low;                                                         \
            }                                                                                                  \
            for (int64_t w = ways - 1; w >= 0 && low != INT64_MAX; w--)                                        \
                best = score[w] == low ? w : best;                                                             \
        }                                                                                                      \
        if (best < 0) {  /* every way pinned: undo the misses admitted so far */                               \
            for (int64_t k = m - 1; k >= 0; k--) {                                                             \
                const int64_t s = slot_out[miss_out[k]];                                                       \
                keys[s] = (KEY)old_key_out[k]; used[s] = old_used[k]; uses[s] = old_uses[k];                   \
                dirty[s] = old_dirty_out[k];                                                                   \
            }                                                                                                  \
            *n_miss_out = misses;                                                                              \
            return base / ways;                                                                                \
        }                                                                                                      \
        const int64_t s = base + best;                                                                         \
        slot_out[i] = s;                                                                                       \
        old_key_out[m] = (int64_t)keys[s]; old_dirty_out[m] = dirty[s];                                        \
        old_used[m] = used[s]; old_uses[m] = uses[s];                                                          \
        keys[s] = (KEY)ids[i];                                                                                  \
        used[s] = clock; uses[s] = 1; dirty[s] = (uint8_t)(mark_dirty != 0);                                   \
    }                                                                                                          \
    *n_miss_out = misses;                                                                                      \
    return -1;                                                                                                 \
}

DEFINE_ASSIGN(assign_slots_i32, int32_t)
DEFINE_ASSIGN(assign_slots_i64, int64_t)

/* -- 2. Bloom filters (bloom.py) ------------------------------------------------------------------------ */
static inline void bloom_halves(int64_t key, uint64_t *h1, uint64_t *h2)
{
    uint64_t z = (uint64_t)key + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    *h1 = z >> 32;
    *h2 = (z & 0xFFFFFFFFULL) | 1;
}

void bloom_add(uint8_t *words, uint64_t bits, int64_t hashes, const int64_t *keys, int64_t n)
{
    for (int64_t j = 0; j < n; j++) {
        uint64_t h1, h2;
        bloom_halves(keys[j], &h1, &h2);
        for (int64_t i = 0; i < hashes; i++) {
            const uint64_t at = (h1 + (uint64_t)i * h2) % bits;
            words[at >> 3] |= (uint8_t)(1u << (at & 7));
        }
    }
}

void bloom_may_hold(const uint8_t *words, uint64_t bits, int64_t hashes, const int64_t *keys, int64_t n, uint8_t *out)
{
    for (int64_t j = 0; j < n; j++) {
        uint64_t h1, h2;
        uint8_t all = 1;
        bloom_halves(keys[j], &h1, &h2);
        for (int64_t i = 0; i < hashes; i++) {
            const uint64_t at = (h1 + (uint64_t)i * h2) % bits;
            all &= (uint8_t)((words[at >> 3] >> (at & 7)) & 1);
        }
        out[j] = all;
    }
}

/* -- 3. a sorted run's records (paged_records.py) -------------------------------------------------------- */
static inline int64_t record_key(const float *flat, int64_t word)
{
    int64_t key;
    memcpy(&key, flat + word, sizeof key);
    return key;
}

/* found[j] = whether keys[j] (ascending) is among the run's n_records records; the found keys' records
 * (width floats each) are written to out one after the other. Returns how many were found. */
int64_t paged_find(const float *flat, int64_t n_records, int64_t width, int64_t per_page, int64_t page_words,
                   const int64_t *fences, int64_t n_fences, const int64_t *keys, int64_t n, int64_t *page_of,
                   uint8_t *found, float *out)
{
    const int64_t stride = 2 + width;
    const long page_bytes = (long)page_words * 4;
    for (int64_t j = 0; j < n; j++) {  /* the page: the last fence <= key (−1: before the first page) */
        int64_t lo = 0, hi = n_fences;
        while (lo < hi) {
            const int64_t mid = (lo + hi) >> 1;
            if (fences[mid] <= keys[j]) lo = mid + 1; else hi = mid;
        }
        page_of[j] = lo - 1;
    }
    for (int64_t j = 0; j < n;) {  /* keys ascending: pages nondecreasing; adjacent pages in one call */
        if (page_of[j] < 0) { j++; continue; }
        const int64_t first = page_of[j];
        int64_t last = first;
        while (j < n && page_of[j] <= last + 1) { if (page_of[j] > last) last = page_of[j]; j++; }
        madvise((void *)(flat + first * page_words), (size_t)((last - first + 1) * page_bytes), MADV_WILLNEED);
    }
    int64_t hits = 0;
    for (int64_t j = 0; j < n; j++) {
        found[j] = 0;
        const int64_t page = page_of[j];
        if (page < 0) continue;
        const int64_t base = page * page_words, count = n_records - page * per_page < per_page
                                                         ? n_records - page * per_page : per_page;
        int64_t lo = 0, hi = count;  /* the first record whose key >= keys[j] */
        while (lo < hi) {
            const int64_t mid = (lo + hi) >> 1;
            if (record_key(flat, base + mid * stride) < keys[j]) lo = mid + 1; else hi = mid;
        }
        if (lo < count && record_key(flat, base + lo * stride) == keys[j]) {
            found[j] = 1;
            memcpy(out + hits * width, flat + base + lo * stride + 2, (size_t)width * sizeof(float));
            hits++;
        }
    }
    return hits;
}
