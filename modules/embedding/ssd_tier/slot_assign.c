/* The row cache's per-row loop: each unique id of a batch to its slot (set-associative lookup, then a victim
 * way for each miss), in one pass in C. Python's side, the contract and the reference it is tested against:
 * modules/embedding/ssd_tier/native_slots.py, set_victims.py, row_cache.py.
 *
 *   table   t = the last table with first[t] <= id            (ids ascending: one forward walk)
 *   set     s = set_offset[t] + (id − first[t]) mod nsets[t]
 *   hit     keys[s·W + w] = id         → used = clock, uses += 1, dirty |= mark_dirty
 *   miss    (after every hit of the batch is pinned, misses in ascending id order) the way of s with the
 *           least score among the ways not pinned (used ≠ clock), ties the lower way:
 *             −1 empty (key < 0);  lru: used;  lfu: uses·2^40 + used
 *           → its old key and dirty flag are returned (the caller writes the row back), then
 *             key = id, used = clock (pinned), uses = 1, dirty = mark_dirty
 *
 * Returns −1, or the set in which a miss found every way pinned: the cache is then left as the hits made it
 * (the misses admitted before are rolled back). Keys are int32 or int64 (KEY below: two entry points).
 */
#include <stdint.h>

#define USE_BITS 40
#define MAX_WAYS 64  /* the row cache's W (32) at most */
#define PREFETCH 16  /* ids (misses) ahead whose set's lines are prefetched */
#define LINE 64       /* bytes of a cache line */

#define DEFINE_ASSIGN(NAME, KEY)                                                                               \
int64_t NAME(const int64_t *ids, int64_t n, const int64_t *first, const int64_t *nsets,                        \
             const int64_t *set_offset, int64_t tables, KEY *keys, int32_t *used, int32_t *uses,               \
             uint8_t *dirty, int64_t ways, int32_t clock, int32_t mark_dirty, int32_t lfu,                     \
             int64_t *slot_out, int64_t *table_out, int64_t *miss_out, int64_t *old_key_out,                   \
             uint8_t *old_dirty_out, int32_t *old_used, int32_t *old_uses, int64_t *n_miss_out)                \
{                                                                                                              \
    int64_t t = 0, misses = 0;                                                                                 \
    for (int64_t i = 0; i < n; i++) {  /* slot_out first holds each id's set's first slot */                 \
        const int64_t id = ids[i];                                                                             \
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
        int64_t way = -1;  /* no early exit: the compiler vectorises the scan (a key sits in one way at most) */\
        for (int64_t w = 0; w < ways; w++)                                                                     \
            way = keys[base + w] == key ? w : way;                                                             \
        if (way >= 0) {                                                                                        \
            const int64_t s = base + way;                                                                      \
            slot_out[i] = s;                                                                                   \
            used[s] = clock;                                                                                   \
            uses[s] += 1;                                                                                      \
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
        int64_t score[MAX_WAYS], low = INT64_MAX, best = -1;  /* branch-free scores, then the first least */ \
        for (int64_t w = 0; w < ways; w++) {                                                                   \
            const int64_t s = base + w;                                                                        \
            const int64_t v = lfu ? ((int64_t)uses[s] << USE_BITS) | used[s] : (int64_t)used[s];               \
            score[w] = used[s] == clock ? INT64_MAX : keys[s] < 0 ? -1 : v;                                    \
            low = score[w] < low ? score[w] : low;                                                             \
        }                                                                                                      \
        for (int64_t w = ways - 1; w >= 0; w--)                                                                \
            best = score[w] == low ? w : best;                                                                 \
        if (low == INT64_MAX) best = -1;                                                                       \
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
