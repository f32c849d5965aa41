/* The row cache's per-row loops in C, called through ctypes (modules/embedding/ssd_tier/native_loops.py, which
 * also says how this file is built). Each loop has a torch / numpy twin that computes the same thing, is the
 * reference the tests compare it with (tests/test_native_loops.py) and runs where no C compiler is found.
 *
 * 1. assign_slots_i32 / _i64 — each unique id of a batch to its slot (twin: set_victims.place):
 *
 *   table   t = the last table with first[t] <= id            (ids ascending: one forward walk)
 *   set     s = set_offset[t] + (id − first[t]) mod nsets[t]
 *   hit     keys[s·W + w] = id         → used = clock, uses += 1, dirty |= mark_dirty
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
 *   it (the misses admitted before are rolled back). Keys are int32 or int64 (two entry points).
 *
 * 2. bloom_add / bloom_may_hold — a sorted run's Bloom filter (twin and formulas: bloom.py).
 * 3. paged_find — keys in a sorted run's records file, one page read per key (twin and layout:
 *    paged_records.py): each key's page from the fences, the pages asked of the kernel at once
 *    (madvise WILLNEED, runs of adjacent pages as one call), a binary search of the page's inline keys.
 *    paged_find_direct — the same from a descriptor opened with O_DIRECT: the distinct pages, CHUNK_PAGES at
 *    a time, read by up to READERS threads with pread(2) into an aligned buffer, then the same search. The
 *    pages bypass the page cache (a row is not cached twice: once in the row cache, once as its 4 KiB page
 *    in the page cache, which a memory cgroup counts), and the reads take less CPU than page faults:
 *    benchmarks/page_reads.py, docs/scale.md.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <stdint.h>
#include <unistd.h>

#define USE_BITS 40
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

static void pages_of(const int64_t *fences, int64_t n_fences, const int64_t *keys, int64_t n, int64_t *page_of)
{
    for (int64_t j = 0; j < n; j++) {  /* the page: the last fence <= key (−1: before the first page) */
        int64_t lo = 0, hi = n_fences;
        while (lo < hi) {
            const int64_t mid = (lo + hi) >> 1;
            if (fences[mid] <= keys[j]) lo = mid + 1; else hi = mid;
        }
        page_of[j] = lo - 1;
    }
}

/* The record of `key` in a page (`page`: its first word; `count` records of stride 2 + width) copied to out:
 * 1 if the page holds it, else 0. */
static int find_in_page(const float *page, int64_t count, int64_t width, int64_t key, float *out)
{
    const int64_t stride = 2 + width;
    int64_t lo = 0, hi = count;  /* the first record whose key >= key */
    while (lo < hi) {
        const int64_t mid = (lo + hi) >> 1;
        if (record_key(page, mid * stride) < key) lo = mid + 1; else hi = mid;
    }
    if (lo < count && record_key(page, lo * stride) == key) {
        memcpy(out, page + lo * stride + 2, (size_t)width * sizeof(float));
        return 1;
    }
    return 0;
}

/* found[j] = whether keys[j] (ascending) is among the run's n_records records; the found keys' records
 * (width floats each) are written to out one after the other. Returns how many were found. */
int64_t paged_find(const float *flat, int64_t n_records, int64_t width, int64_t per_page, int64_t page_words,
                   const int64_t *fences, int64_t n_fences, const int64_t *keys, int64_t n, int64_t *page_of,
                   uint8_t *found, float *out)
{
    const long page_bytes = (long)page_words * 4;
    pages_of(fences, n_fences, keys, n, page_of);
    for (int64_t j = 0; j < n;) {  /* keys ascending: pages nondecreasing; adjacent pages in one call */
        if (page_of[j] < 0) { j++; continue; }
        const int64_t first = page_of[j];
        int64_t last = first;
        while (j < n && page_of[j] <= last + 1) { if (page_of[j] > last) last = page_of[j]; j++; }
        madvise((void *)(flat + first * page_words), (size_t)((last - first + 1) * page_bytes), MADV_WILLNEED);
    }
    int64_t hits = 0;
    for (int64_t j = 0; j < n; j++) {
        const int64_t page = page_of[j];
        const int64_t count = n_records - page * per_page < per_page ? n_records - page * per_page : per_page;
        found[j] = page >= 0 && find_in_page(flat + page * page_words, count, width, keys[j], out + hits * width);
        hits += found[j];
    }
    return hits;
}

#define CHUNK_PAGES 4096   /* pages read at once by paged_find_direct (16 MiB of buffer) */
#define READERS 32         /* threads reading them: the disk serves that many requests in parallel */
#define MAX_READERS 256
#define PAGES_A_READER 8   /* fewer pages than READERS × this: fewer threads */

typedef struct {
    int fd;
    const int64_t *pages;
    int64_t n, page_bytes;
    char *out;
    int failed;  /* errno of the first read that failed (EIO: a short read), else 0 */
} reader_t;

static void *read_pages_of(void *arg)
{
    reader_t *r = (reader_t *)arg;
    for (int64_t i = 0; i < r->n && !r->failed; i++) {
        const ssize_t got = pread(r->fd, r->out + i * r->page_bytes, (size_t)r->page_bytes,
                                  (off_t)(r->pages[i] * r->page_bytes));
        if (got != (ssize_t)r->page_bytes) r->failed = got < 0 ? errno : EIO;
    }
    return NULL;
}

/* Pages `pages[0..n)` of fd into out (n × page_bytes), each of up to `readers` threads (at most MAX_READERS, at
 * least PAGES_A_READER pages each) its contiguous share. Returns 0, or the errno of a read that failed.
 * (Also called by benchmarks/page_reads.py.) */
int read_pages(int fd, const int64_t *pages, int64_t n, int64_t page_bytes, char *out, int64_t readers)
{
    int64_t threads = (n + PAGES_A_READER - 1) / PAGES_A_READER;
    readers = readers > MAX_READERS ? MAX_READERS : readers;
    threads = threads < 1 ? 1 : threads > readers ? readers : threads;
    pthread_t tid[MAX_READERS];
    int started[MAX_READERS];
    reader_t r[MAX_READERS];
    const int64_t per = (n + threads - 1) / threads;
    int failed = 0;
    for (int64_t t = 0; t < threads; t++) {
        const int64_t a = t * per < n ? t * per : n, b = a + per < n ? a + per : n;
        r[t] = (reader_t){fd, pages + a, b - a, page_bytes, out + a * page_bytes, 0};
        started[t] = t > 0 && pthread_create(&tid[t], NULL, read_pages_of, &r[t]) == 0;
    }
    for (int64_t t = 0; t < threads; t++) {  /* share 0, and any share whose thread did not start, here */
        if (!started[t]) read_pages_of(&r[t]);
    }
    for (int64_t t = 0; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        if (!failed) failed = r[t].failed;
    }
    return failed;
}

/* paged_find from a descriptor (O_DIRECT: page-aligned reads into an aligned buffer). Returns how many were
 * found, or −errno if a page could not be read, INT64_MIN if no buffer could be allocated. */
int64_t paged_find_direct(int fd, int64_t n_records, int64_t width, int64_t per_page, int64_t page_words,
                          const int64_t *fences, int64_t n_fences, const int64_t *keys, int64_t n, int64_t *page_of,
                          uint8_t *found, float *out)
{
    const int64_t page_bytes = page_words * 4;
    pages_of(fences, n_fences, keys, n, page_of);
    char *buf = NULL;
    int64_t *pages = malloc(sizeof(int64_t) * CHUNK_PAGES);
    if (!pages || posix_memalign((void **)&buf, 4096, (size_t)(CHUNK_PAGES * page_bytes)) != 0) {
        free(pages);
        return INT64_MIN;
    }
    int64_t hits = 0;
    for (int64_t j = 0; j < n;) {  /* keys ascending: pages nondecreasing; a chunk's distinct pages, then its keys */
        const int64_t from = j;
        int64_t m = 0;
        for (; j < n; j++) {
            if (page_of[j] < 0 || (m && pages[m - 1] == page_of[j])) continue;
            if (m == CHUNK_PAGES) break;
            pages[m++] = page_of[j];
        }
        const int failed = m ? read_pages(fd, pages, m, page_bytes, buf, READERS) : 0;
        if (failed) {
            free(pages); free(buf);
            return -(int64_t)failed;
        }
        for (int64_t k = from, at = 0; k < j; k++) {
            found[k] = 0;
            if (page_of[k] < 0) continue;
            while (pages[at] != page_of[k]) at++;
            const int64_t page = page_of[k];
            const int64_t count = n_records - page * per_page < per_page ? n_records - page * per_page : per_page;
            found[k] = (uint8_t)find_in_page((const float *)(buf + at * page_bytes), count, width, keys[k],
                                             out + hits * width);
            hits += found[k];
        }
    }
    free(pages); free(buf);
    return hits;
}
