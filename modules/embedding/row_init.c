/* Initial rows drawn from (seed, table, row) in C, called through ctypes (modules/embedding/row_init.py, whose
 * docstring gives the formulas and whose numpy twin, normal_rows_numpy, computes the same float32 operations in
 * the same order: the tests compare the two bit for bit). Built by modules/embedding/native_build.py.
 *
 *   dst[dst_row[i]·stride + c] = value(rows[i]·table_dim + col0 + c + 1),  c < cols
 *   value(i) = std · sqrt(−2 ln u1) · cos(2π u2),   x = mix(base + i·γ),  u1, u2 from x's two 24-bit parts
 *
 * ln and cos are polynomials in float32 +, −, ×, ÷ and sqrt only — operations IEEE 754 rounds exactly, in a
 * fixed order (no contraction: -ffp-contract=off) — so the values are the same in numpy, in C, on any machine.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define GAMMA 0x9E3779B97F4A7C15ULL

static inline uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* ln u for a normal float u > 0: u = m·2^e with m in [√½, √2); ln m = 2s(1 + z/3 + z²/5 + z³/7 + z⁴/9),
 * s = (m − 1)/(m + 1), z = s² ≤ 0.0295 (the next term, z⁵/11, is below 2·10⁻⁹ of the sum). */
static inline float ln_f32(float u)
{
    uint32_t bits, mbits;
    memcpy(&bits, &u, sizeof bits);
    float e = (float)((int32_t)((bits >> 23) & 0xFF) - 127);
    mbits = (bits & 0x7FFFFF) | 0x3F800000;
    float m;
    memcpy(&m, &mbits, sizeof m);
    const int big = m > 1.41421354f;
    m = big ? m * 0.5f : m;
    e = big ? e + 1.0f : e;
    const float s = (m - 1.0f) / (m + 1.0f), z = s * s;
    float p = (1.0f / 9.0f) * z + 1.0f / 7.0f;
    p = p * z + 1.0f / 5.0f;
    p = p * z + 1.0f / 3.0f;
    p = p * z + 1.0f;
    return e * 0.693147182f + (s * p) * 2.0f;
}

/* cos 2πu for u in (0, 1), a multiple of 2^-25 (so every subtraction below is exact): d = |u − ½|,
 * cos 2πu = −cos 2πd; q = min(d, ½ − d) (the sign flips with it) in [0, ¼]; cos 2πq as cos x on [0, π/4]
 * (q ≤ ⅛) or as sin x of ¼ − q, x = 2π·(q or ¼ − q), Taylor to x⁸ and x⁹. */
static inline float cos_2pi_f32(float u)
{
    float d = u - 0.5f;
    d = d < 0.0f ? -d : d;
    const int far = d > 0.25f;
    const float q = far ? 0.5f - d : d, sign = far ? 1.0f : -1.0f;
    const int use_sin = q > 0.125f;
    const float x = 6.28318548f * (use_sin ? 0.25f - q : q), y = x * x;
    float c = (1.0f / 40320.0f) * y - 1.0f / 720.0f;
    c = c * y + 1.0f / 24.0f;
    c = c * y - 0.5f;
    c = c * y + 1.0f;
    float s = (1.0f / 362880.0f) * y - 1.0f / 5040.0f;
    s = s * y + 1.0f / 120.0f;
    s = s * y - 1.0f / 6.0f;
    s = s * y + 1.0f;
    s = s * x;
    return sign * (use_sin ? s : c);
}

#define BLOCK 64  /* values of a row computed at once: the float part is one vectorisable loop */
#define AHEAD 8   /* rows ahead whose destination lines are prefetched */

/* One row's values (module comment); dst_row may be NULL (row i goes to dst row i). */
void draw_rows(float *dst, int64_t stride, const int64_t *dst_row, const int64_t *rows, int64_t n, uint64_t base,
               int64_t table_dim, int64_t col0, int64_t cols, float std)
{
    float u1[BLOCK], u2[BLOCK];
    for (int64_t i = 0; i < n; i++) {
        if (dst_row && i + AHEAD < n) {  /* scattered rows (a cache's slots): their lines asked for ahead */
            const char *row = (const char *)(dst + dst_row[i + AHEAD] * stride);
            for (int64_t b = 0; b < cols * (int64_t)sizeof(float); b += 64) __builtin_prefetch(row + b, 1);
            __builtin_prefetch(row + cols * (int64_t)sizeof(float) - 1, 1);
        }
        float *out = dst + (dst_row ? dst_row[i] : i) * stride;
        const uint64_t first = (uint64_t)rows[i] * (uint64_t)table_dim + (uint64_t)col0 + 1;
        for (int64_t c0 = 0; c0 < cols; c0 += BLOCK) {
            const int64_t k = cols - c0 < BLOCK ? cols - c0 : BLOCK;
            for (int64_t c = 0; c < k; c++) {
                const uint64_t x = mix(base + (first + (uint64_t)(c0 + c)) * GAMMA);
                u1[c] = (float)(int32_t)(x >> 40);
                u2[c] = (float)(int32_t)(x & 0xFFFFFF);
            }
            for (int64_t c = 0; c < k; c++) {
                const float a = (u1[c] + 0.5f) * 0x1p-24f, b = (u2[c] + 0.5f) * 0x1p-24f;
                out[c0 + c] = (sqrtf(-2.0f * ln_f32(a)) * cos_2pi_f32(b)) * std;
            }
        }
    }
}
