/* For benchmarks/page_reads.py: n pages of a file, by page number, into one buffer — read by T threads with
 * pread(2), each its contiguous share of the (ascending) page list; with an O_DIRECT descriptor the pages bypass
 * the page cache (page_reads.py passes a page-aligned buffer). And how many of a file's pages the page cache
 * holds (mincore(2) over a mapping of it). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_READERS 256

typedef struct {
    int fd;
    const int64_t *pages;
    int64_t n, page_bytes;
    char *out;
    int failed;  /* errno of the first read that failed (EIO: a short read), else 0 */
} reader_t;

static void *read_share(void *arg)
{
    reader_t *r = (reader_t *)arg;
    for (int64_t i = 0; i < r->n && !r->failed; i++) {
        const ssize_t got = pread(r->fd, r->out + i * r->page_bytes, (size_t)r->page_bytes,
                                  (off_t)(r->pages[i] * r->page_bytes));
        if (got != (ssize_t)r->page_bytes) r->failed = got < 0 ? errno : EIO;
    }
    return NULL;
}

/* Returns 0, or the errno of a read that failed. */
int read_pages(int fd, const int64_t *pages, int64_t n, int64_t page_bytes, char *out, int64_t threads)
{
    threads = threads < 1 ? 1 : threads > MAX_READERS ? MAX_READERS : threads;
    pthread_t tid[MAX_READERS];
    int started[MAX_READERS];
    reader_t r[MAX_READERS];
    const int64_t per = (n + threads - 1) / threads;
    int failed = 0;
    for (int64_t t = 0; t < threads; t++) {
        const int64_t a = t * per < n ? t * per : n, b = a + per < n ? a + per : n;
        r[t] = (reader_t){fd, pages + a, b - a, page_bytes, out + a * page_bytes, 0};
        started[t] = t > 0 && pthread_create(&tid[t], NULL, read_share, &r[t]) == 0;
    }
    for (int64_t t = 0; t < threads; t++)  /* share 0, and any whose thread did not start, in this thread */
        if (!started[t]) read_share(&r[t]);
    for (int64_t t = 0; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        if (!failed) failed = r[t].failed;
    }
    return failed;
}

int64_t resident_pages(int fd, int64_t bytes)
{
    void *map = mmap(NULL, (size_t)bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) return -1;
    const long page = sysconf(_SC_PAGESIZE);
    const int64_t n = (bytes + page - 1) / page;
    unsigned char vec[4096];
    int64_t resident = 0;
    for (int64_t a = 0; a < n; a += 4096) {
        const int64_t k = n - a < 4096 ? n - a : 4096;
        if (mincore((char *)map + a * page, (size_t)(k * page), vec) != 0) { resident = -1; break; }
        for (int64_t i = 0; i < k; i++) resident += vec[i] & 1;
    }
    munmap(map, (size_t)bytes);
    return resident;
}
