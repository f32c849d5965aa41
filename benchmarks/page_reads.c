/* For benchmarks/page_reads.py: how many of a file's pages the page cache holds (mincore(2) over a mapping of it).
 * (The reads themselves are the row cache's: read_pages in modules/embedding/ssd_tier/cache_loops.c.) */
#define _DEFAULT_SOURCE
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

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
