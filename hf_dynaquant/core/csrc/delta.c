#include "kernels.h"

/* Counts of each byte value added to count, in eight interleaved tables of 32-bit counters, the
 * bytes read eight at a time: a run of equal bytes (the counts of codes come in such runs, and a
 * few codes take most places) then adds to eight counters in turn instead of waiting on one.
 * Blocks of 2^28 bytes keep each counter below 2^32. About 0.32 ns a byte on bytes spread over
 * their values, 0.52 where one value takes most (session 39's machine). */
static void count_any(const uint8_t *s, Py_ssize_t n, int64_t count[256]) {
    uint32_t part[8][256];
    for (Py_ssize_t at = 0, end; at < n; at = end) {
        end = n - at > ((Py_ssize_t)1 << 28) ? at + ((Py_ssize_t)1 << 28) : n;
        Py_ssize_t i = at;
        memset(part, 0, sizeof(part));
        for (; i + 8 <= end; i += 8) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            part[0][w & 255]++; part[1][(w >> 8) & 255]++; part[2][(w >> 16) & 255]++; part[3][(w >> 24) & 255]++;
            part[4][(w >> 32) & 255]++; part[5][(w >> 40) & 255]++; part[6][(w >> 48) & 255]++; part[7][w >> 56]++;
        }
        for (; i < end; i++) part[0][s[i]]++;
        for (int k = 0; k < 256; k++)
            for (int j = 0; j < 8; j++) count[k] += part[j][k];
    }
}

/* Codes and their deltas take few values (3-34 levels: an embedding's 32 bins and the pruned
 * and protected levels): where a span's bytes are all below SMALL_SYMBOLS, each value's count
 * is a vector compare and subtract per vector of bytes (a byte counter per lane, summed every
 * 255 vectors), four values a pass over a block that stays in the L1 cache. With 64-byte vectors
 * (AVX-512 BW): 0.13 ns a byte for 10 values, 0.33 for 34, where count_any takes 0.32 on bytes
 * spread over their values and 0.52 on a delta's (98% one value); at 48 values 0.42 either way
 * (session 39's machine). With 32-byte vectors (AVX2, a Zen 1 EPYC): 0.25 ns for 10 values,
 * 0.68 for 34, count_any 0.9; with 16-byte ones 0.28 and 0.80. */
#define SMALL_SYMBOLS 36
#define SMALL_SPAN ((Py_ssize_t)1 << 20) /* bytes whose largest decides how they are counted */
#define SMALL_BLOCKS 255                 /* vectors a byte counter can count */

SIMD_CLONES static int largest_byte(const uint8_t *s, Py_ssize_t n) {
    uint8_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m; /* (vectorised) */
    return m;
}

/* count_small for vectors of W bytes, built once for each width under the target that has it
 * natively: a generic vector wider than its target's registers is taken apart a byte at a time
 * (GCC's "expanded piecewise"; the 64-byte build took 1 ns a byte and value on an AVX2 CPU,
 * thirty times count_any). It adds to count[0..symbols) the counts of s's bytes, every one of
 * which is below symbols (at most SMALL_SYMBOLS; counted four values at a time, so count has
 * room past symbols). */
#define COUNT_SMALL(NAME, TARGET, W)                                                              \
    TARGET static void NAME(const uint8_t *s, Py_ssize_t n, int symbols, int64_t count[256]) {    \
        typedef uint8_t vec __attribute__((vector_size(W)));                                      \
        Py_ssize_t i = 0;                                                                         \
        while (n - i >= W) {                                                                      \
            const Py_ssize_t blocks = (n - i) / W < SMALL_BLOCKS ? (n - i) / W : SMALL_BLOCKS;    \
            for (int v = 0; v < symbols; v += 4) {                                                \
                vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                       \
                for (Py_ssize_t b = 0; b < blocks; b++) {                                         \
                    vec x;                                                                        \
                    memcpy(&x, s + i + W * b, W);                                                 \
                    a0 -= (vec)(x == (uint8_t)v);                                                 \
                    a1 -= (vec)(x == (uint8_t)(v + 1));                                           \
                    a2 -= (vec)(x == (uint8_t)(v + 2));                                           \
                    a3 -= (vec)(x == (uint8_t)(v + 3));                                           \
                }                                                                                 \
                uint32_t t0 = 0, t1 = 0, t2 = 0, t3 = 0;                                          \
                for (int j = 0; j < W; j++) t0 += a0[j], t1 += a1[j], t2 += a2[j], t3 += a3[j];   \
                count[v] += t0, count[v + 1] += t1, count[v + 2] += t2, count[v + 3] += t3;       \
            }                                                                                     \
            i += W * blocks;                                                                      \
        }                                                                                         \
        for (; i < n; i++) count[s[i]]++;                                                         \
    }

COUNT_SMALL(count_small_16, , 16) /* SSE2, the x86-64 baseline; NEON */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 7) || (!defined(__clang__) && __GNUC__ >= 8))
#define COUNT_WIDE 1
COUNT_SMALL(count_small_32, __attribute__((target("avx2"))), 32)
COUNT_SMALL(count_small_64, __attribute__((target("avx512f,avx512bw"))), 64)
#endif

/* count_small at the widest width this CPU has (dq_simd_paths; the 16-byte build elsewhere). */
static void count_small(const uint8_t *s, Py_ssize_t n, int symbols, int64_t count[256]) {
#ifdef COUNT_WIDE
    const int paths = dq_simd_paths();
    if (paths & DQ_AVX512BW) return count_small_64(s, n, symbols, count);
    if (paths & DQ_AVX2) return count_small_32(s, n, symbols, count);
#endif
    count_small_16(s, n, symbols, count);
}

/* Counts of each byte value (count is set, not added to): span by span, by value where a
 * span's bytes are all below SMALL_SYMBOLS, else by count_any. */
static void count_bytes(const uint8_t *s, Py_ssize_t n, int64_t count[256]) {
    for (int k = 0; k < 256; k++) count[k] = 0;
    for (Py_ssize_t at = 0; at < n; at += SMALL_SPAN) {
        const Py_ssize_t len = n - at < SMALL_SPAN ? n - at : SMALL_SPAN;
        const int top = largest_byte(s + at, len);
        if (top < SMALL_SYMBOLS)
            count_small(s + at, len, top + 1, count);
        else
            count_any(s + at, len, count);
    }
}

static int groups_in(const int64_t count[256]);

/* The regrouping of the delta encoder (delta.py): uint8 values ordered by their uint8 key (the
 * previous checkpoint's code), stably, and back. A counting sort in two passes (a histogram of
 * the keys, then each value to the next free place of its key's group), what the numpy
 * reference does with a stable argsort and a gather or scatter, without the index array.
 * group_starts gives the first place of each key's group, and returns the number of groups (the
 * largest key, plus one). */
static int group_starts(const uint8_t *keys, Py_ssize_t n, Py_ssize_t start[256]) {
    int64_t count[256];
    Py_ssize_t pos = 0;
    count_bytes(keys, n, count);
    for (int k = 0; k < 256; k++) { start[k] = pos; pos += count[k]; }
    return groups_in(count);
}

/* table[d + 255] = d mod levels (non-negative) for every difference d of two bytes, -255..255:
 * the cyclic delta's remainders looked up, not divided (a division per value cost more than the
 * rest of a delta's coding). */
static void cyclic_table(int levels, uint8_t table[511]) {
    for (int d = -255; d <= 255; d++) {
        const int r = d % levels;
        table[d + 255] = (uint8_t)(r < 0 ? r + levels : r);
    }
}

/* The next places of the groups of keys k[0..3], taken (start advanced past them): every place
 * is read before any is written, a key met earlier among the four counting one more, so a run
 * of one key, the common case, waits on one update of its group's place per four values, not
 * per value. */
INLINE void next_places(const uint8_t *k, Py_ssize_t start[256], Py_ssize_t c[4]) {
    const uint8_t k0 = k[0], k1 = k[1], k2 = k[2], k3 = k[3];
    c[0] = start[k0];
    c[1] = start[k1] + (k1 == k0);
    c[2] = start[k2] + (k2 == k0) + (k2 == k1);
    c[3] = start[k3] + (k3 == k0) + (k3 == k1) + (k3 == k2);
    start[k0] = c[0] + 1;
    start[k1] = c[1] + 1;
    start[k2] = c[2] + 1;
    start[k3] = c[3] + 1;
}

/* Whether two buffers share a byte. */
static int overlaps(const Py_buffer *p, const Py_buffer *q) {
    const char *a = p->buf, *b = q->buf;
    return a < b + q->len && b < a + p->len;
}

/* The number of groups a counting sort walks: the largest key counted, plus one. */
static int groups_in(const int64_t count[256]) {
    int keys = 256;
    while (keys > 0 && count[keys - 1] == 0) keys--;
    return keys;
}

/* The grouping with AVX-512 (VBMI2) where the CPU has it: 64 values at a time, each group's share
 * packed together (vpcompressb) and stored at its group's next place (forward), or each group's
 * next values spread to its keys' lanes (vpexpandb, inverse). One pass per group and block, so
 * it is used for at most GROUP_SIMD_KEYS groups (a checkpoint's codes have 3-34 levels; at 34
 * and 48 groups it groups in 2.3 and 2.7 ns a value against 2.5 and 3.1, and a restore undoes in
 * 1.2 and 1.3 against 1.7 and 2.2; at 64 it grouped in 2.9 against 2.4); a
 * value at a time, as the scalar loops do, costs a dependent update of its group's place. Past
 * GROUP_TWO_PASS_KEYS groups both take two passes (group_simd_two_pass, ungroup_simd_two_pass),
 * about half the compresses or expands: on a 124M delta's codes, grouping 1.35 ns a value at 34
 * groups (one pass: 2.07), 0.69 at 15 (0.92), 0.53 at 13 (0.56); undoing 0.67 at 34 (0.94),
 * 0.35 at 15 (0.40), 0.29-0.31 at 13-14 (0.34-0.37). The
 * results are those of the scalar loops, byte for byte (tested against the numpy references). */
#define GROUP_SIMD_KEYS 48

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 7) || (!defined(__clang__) && __GNUC__ >= 8))
#include <immintrin.h>
#define GROUP_SIMD 1
#define VBMI2 __attribute__((target("avx512f,avx512bw,avx512vbmi2,bmi2,popcnt")))

static int group_simd_available(void) { return (dq_simd_paths() & DQ_AVX512_VBMI2) != 0; }

/* (a - b) mod levels of 64 bytes: one conditional add where both are below levels (every code
 * of a checkpoint), else looked up byte by byte in the cyclic table, as the scalar loops do. */
VBMI2 static __m512i cyclic_block(__m512i a, __m512i b, int levels, const uint8_t table[511]) {
    if (levels >= 256) return _mm512_sub_epi8(a, b);
    const __m512i top = _mm512_set1_epi8((char)levels);
    if (!(_mm512_cmpge_epu8_mask(a, top) | _mm512_cmpge_epu8_mask(b, top))) {
        const __m512i d = _mm512_sub_epi8(a, b);
        return _mm512_mask_add_epi8(d, _mm512_cmplt_epu8_mask(a, b), d, top);
    }
    uint8_t x[64], y[64], d[64];
    _mm512_storeu_si512(x, a);
    _mm512_storeu_si512(y, b);
    for (int j = 0; j < 64; j++) d[j] = table[(int)x[j] - (int)y[j] + 255];
    return _mm512_loadu_si512(d);
}

/* Forward: o[start[k[i]]++] = v[i], or, with y, (k[i] - y[i]) mod levels; blocks of 64 while
 * they last. Returns the values done. */
VBMI2 static Py_ssize_t group_simd(const uint8_t *k, const uint8_t *v, const uint8_t *y, int levels,
                                   const uint8_t table[511], Py_ssize_t n, int keys, uint8_t *o, Py_ssize_t start[256]) {
    Py_ssize_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const __m512i a = _mm512_loadu_si512(k + i);
        const __m512i d = y == NULL ? _mm512_loadu_si512(v + i) : cyclic_block(a, _mm512_loadu_si512(y + i), levels, table);
        for (int key = 0; key < keys; key++) {
            const __mmask64 m = _mm512_cmpeq_epi8_mask(a, _mm512_set1_epi8((char)key));
            const unsigned cnt = (unsigned)_mm_popcnt_u64(m);
            _mm512_mask_storeu_epi8(o + start[key], _bzhi_u64(~0ULL, cnt), _mm512_maskz_compress_epi8(m, d));
            start[key] += cnt;
        }
    }
    return i;
}

/* The forward grouping of many groups (more than GROUP_TWO_PASS_KEYS) in two passes over chunks
 * of GROUP_CHUNK values: each value and its key to the buffer of its key / 8 (at most 6 of them),
 * then each buffer's values to their groups, at most 8 groups a block, as group_simd does: a
 * stable sort by key / 8, then by key within, which is the stable sort by key, with about half
 * the compresses group_simd takes. Blocks of 64 while they last; returns the values done. */
#define GROUP_TWO_PASS_KEYS 12
#define GROUP_CHUNK 2048

/* Each of 64 keys' key / 8. */
VBMI2 INLINE __m512i eighths(__m512i a) { return _mm512_and_si512(_mm512_srli_epi16(a, 3), _mm512_set1_epi8(0x1F)); }

/* The first pass of the two-pass grouping and undoing: a block's keys a (and, with d, their
 * values) appended to the buffers of their key / 8, in order; len: each buffer's length, advanced. */
VBMI2 INLINE void to_eighths(__m512i a, const __m512i *d, int highs, uint8_t bk[][GROUP_CHUNK],
                             uint8_t bv[][GROUP_CHUNK], Py_ssize_t len[]) {
    const __m512i hi = eighths(a);
    for (int h = 0; h < highs; h++) {
        const __mmask64 m = _mm512_cmpeq_epi8_mask(hi, _mm512_set1_epi8((char)h));
        const unsigned cnt = (unsigned)_mm_popcnt_u64(m);
        const __mmask64 first = _bzhi_u64(~0ULL, cnt);
        _mm512_mask_storeu_epi8(bk[h] + len[h], first, _mm512_maskz_compress_epi8(m, a));
        if (d != NULL) _mm512_mask_storeu_epi8(bv[h] + len[h], first, _mm512_maskz_compress_epi8(m, *d));
        len[h] += cnt;
    }
}

VBMI2 static Py_ssize_t group_simd_two_pass(const uint8_t *k, const uint8_t *v, const uint8_t *y, int levels,
                                            const uint8_t table[511], Py_ssize_t n, int keys, uint8_t *o,
                                            Py_ssize_t start[256]) {
    uint8_t bk[(GROUP_SIMD_KEYS + 7) / 8][GROUP_CHUNK], bv[(GROUP_SIMD_KEYS + 7) / 8][GROUP_CHUNK];
    const int highs = (keys + 7) / 8;
    Py_ssize_t i = 0;
    while (n - i >= 64) {
        const Py_ssize_t chunk = (n - i < GROUP_CHUNK ? n - i : GROUP_CHUNK) / 64 * 64;
        Py_ssize_t len[(GROUP_SIMD_KEYS + 7) / 8] = {0};
        for (Py_ssize_t j = i; j < i + chunk; j += 64) {
            const __m512i a = _mm512_loadu_si512(k + j);
            const __m512i d = y == NULL ? _mm512_loadu_si512(v + j) : cyclic_block(a, _mm512_loadu_si512(y + j), levels, table);
            to_eighths(a, &d, highs, bk, bv, len);
        }
        for (int h = 0; h < highs; h++) {
            const int top = 8 * h + 8 < keys ? 8 * h + 8 : keys;
            for (Py_ssize_t j = 0; j < len[h]; j += 64) {
                const __mmask64 valid = _bzhi_u64(~0ULL, (unsigned)(len[h] - j < 64 ? len[h] - j : 64));
                const __m512i a = _mm512_maskz_loadu_epi8(valid, bk[h] + j);
                const __m512i d = _mm512_maskz_loadu_epi8(valid, bv[h] + j);
                for (int key = 8 * h; key < top; key++) {
                    const __mmask64 m = _mm512_mask_cmpeq_epi8_mask(valid, a, _mm512_set1_epi8((char)key));
                    const unsigned cnt = (unsigned)_mm_popcnt_u64(m);
                    _mm512_mask_storeu_epi8(o + start[key], _bzhi_u64(~0ULL, cnt), _mm512_maskz_compress_epi8(m, d));
                    start[key] += cnt;
                }
            }
        }
        i += chunk;
    }
    return i;
}

/* Inverse: o[i] = v[start[k[i]]++], or, with levels > 0, (k[i] - that) mod levels; blocks of 64
 * while they last. A key at or past keys, or a group read past n (counts that are not the keys'
 * histogram), sets *wrong and stops. o may be k: each block of k is read before it is written.
 * Returns the values done. */
VBMI2 static Py_ssize_t ungroup_simd(const uint8_t *k, const uint8_t *v, int levels, const uint8_t table[511],
                                     Py_ssize_t n, int keys, uint8_t *o, Py_ssize_t start[256], int *wrong) {
    Py_ssize_t i = 0;
    const __m512i past = _mm512_set1_epi8((char)keys);
    for (; i + 64 <= n; i += 64) {
        const __m512i a = _mm512_loadu_si512(k + i);
        if (keys < 256 && _mm512_cmpge_epu8_mask(a, past)) { *wrong = 1; return i; }
        __m512i d = _mm512_setzero_si512();
        for (int key = 0; key < keys; key++) {
            const __mmask64 m = _mm512_cmpeq_epi8_mask(a, _mm512_set1_epi8((char)key));
            const unsigned cnt = (unsigned)_mm_popcnt_u64(m);
            if (start[key] < 0 || start[key] > n - (Py_ssize_t)cnt) { *wrong = 1; return i; }
            const __m512i g = _mm512_maskz_loadu_epi8(_bzhi_u64(~0ULL, cnt), v + start[key]);
            d = _mm512_mask_expand_epi8(d, m, g);
            start[key] += cnt;
        }
        _mm512_storeu_si512(o + i, levels > 0 ? cyclic_block(a, d, levels, table) : d);
    }
    return i;
}

/* The inverse of group_simd_two_pass, as ungroup_simd does it (o[i] = v[start[k[i]]++], or, with
 * levels > 0, (k[i] - that) mod levels), over chunks of GROUP_CHUNK values: the chunk's keys to
 * the buffers of key / 8, each buffer's values read from its groups (at most 8 a block), then
 * each block's values spread from the buffers to their places. A key at or past keys, or a group
 * read past n, sets *wrong and stops before the chunk is written; o may be k (the chunk's keys
 * are read before any of it is written). Returns the values done. */
VBMI2 static Py_ssize_t ungroup_simd_two_pass(const uint8_t *k, const uint8_t *v, int levels, const uint8_t table[511],
                                              Py_ssize_t n, int keys, uint8_t *o, Py_ssize_t start[256], int *wrong) {
    uint8_t bk[(GROUP_SIMD_KEYS + 7) / 8][GROUP_CHUNK], bv[(GROUP_SIMD_KEYS + 7) / 8][GROUP_CHUNK];
    const int highs = (keys + 7) / 8;
    const __m512i past = _mm512_set1_epi8((char)keys);
    Py_ssize_t i = 0;
    while (n - i >= 64) {
        const Py_ssize_t chunk = (n - i < GROUP_CHUNK ? n - i : GROUP_CHUNK) / 64 * 64;
        Py_ssize_t len[(GROUP_SIMD_KEYS + 7) / 8] = {0}, at[(GROUP_SIMD_KEYS + 7) / 8] = {0};
        for (Py_ssize_t j = i; j < i + chunk; j += 64) {
            const __m512i a = _mm512_loadu_si512(k + j);
            if (_mm512_cmpge_epu8_mask(a, past)) { *wrong = 1; return i; }
            to_eighths(a, NULL, highs, bk, NULL, len);
        }
        for (int h = 0; h < highs; h++) {
            const int top = 8 * h + 8 < keys ? 8 * h + 8 : keys;
            for (Py_ssize_t j = 0; j < len[h]; j += 64) {
                const __mmask64 valid = _bzhi_u64(~0ULL, (unsigned)(len[h] - j < 64 ? len[h] - j : 64));
                const __m512i a = _mm512_maskz_loadu_epi8(valid, bk[h] + j);
                __m512i d = _mm512_setzero_si512();
                for (int key = 8 * h; key < top; key++) {
                    const __mmask64 m = _mm512_mask_cmpeq_epi8_mask(valid, a, _mm512_set1_epi8((char)key));
                    const unsigned cnt = (unsigned)_mm_popcnt_u64(m);
                    if (start[key] < 0 || start[key] > n - (Py_ssize_t)cnt) { *wrong = 1; return i; }
                    const __m512i g = _mm512_maskz_loadu_epi8(_bzhi_u64(~0ULL, cnt), v + start[key]);
                    d = _mm512_mask_expand_epi8(d, m, g);
                    start[key] += cnt;
                }
                _mm512_mask_storeu_epi8(bv[h] + j, valid, d);
            }
        }
        for (Py_ssize_t j = i; j < i + chunk; j += 64) {
            const __m512i a = _mm512_loadu_si512(k + j), hi = eighths(a);
            __m512i d = _mm512_setzero_si512();
            for (int h = 0; h < highs; h++) {
                const __mmask64 m = _mm512_cmpeq_epi8_mask(hi, _mm512_set1_epi8((char)h));
                const unsigned cnt = (unsigned)_mm_popcnt_u64(m);
                d = _mm512_mask_expand_epi8(d, m, _mm512_maskz_loadu_epi8(_bzhi_u64(~0ULL, cnt), bv[h] + at[h]));
                at[h] += cnt;
            }
            _mm512_storeu_si512(o + j, levels > 0 ? cyclic_block(a, d, levels, table) : d);
        }
        i += chunk;
    }
    return i;
}
#endif

/* The forward grouping's plain loop: o[start[k[i]]++] = v[i], or, with y, (k[i] - y[i]) mod levels
 * (looked up in table), four at a time, then one. */
INLINE void group_loop(const uint8_t *k, const uint8_t *v, const uint8_t *y, const uint8_t table[511], Py_ssize_t n,
                       uint8_t *o, Py_ssize_t start[256]) {
    Py_ssize_t i = 0, c[4];
    for (; i + 4 <= n; i += 4) { /* loads first */
        uint8_t d[4];
        for (int j = 0; j < 4; j++) d[j] = y == NULL ? v[i + j] : table[k[i + j] - y[i + j] + 255];
        next_places(k + i, start, c);
        for (int j = 0; j < 4; j++) o[c[j]] = d[j];
    }
    for (; i < n; i++) o[start[k[i]]++] = y == NULL ? v[i] : table[k[i] - y[i] + 255];
}

#ifdef GROUP_SIMD
/* The cyclic forward grouping where the CPU has AVX2 and not the VBMI2 path, for at most
 * SPARSE_KEYS groups, into an o group_sparse zeroed: most of a delta's codes did not change,
 * and their difference, 0, is in place already. Of each 32 values only the
 * changed ones are written, each at its group's place plus the count of its key's lanes before
 * it; then each group's place moves past the block's lanes of its key (a compare and a count a
 * group). A block of more than SPARSE_DENSE changes takes the plain loop. On a Zen 1 EPYC, 32 Mi
 * values of 3, 15 and 34 levels with 1 in 10 changed: 1.0, 1.5 and 2.2 ns a value against the
 * loop's 2.4; 1 in 3: 2.2, 2.5 and 2.7. Returns the values done (blocks of 32). */
#define SPARSE_KEYS 16
#define SPARSE_DENSE 8
#define AVX2_GROUP __attribute__((target("avx2,popcnt,bmi,bmi2")))

AVX2_GROUP static Py_ssize_t group_sparse_avx2(const uint8_t *k, const uint8_t *y, const uint8_t table[511],
                                               Py_ssize_t n, int keys, uint8_t *o, Py_ssize_t start[256]) {
    __m256i key[SPARSE_KEYS];
    uint32_t lanes[SPARSE_KEYS];
    for (int g = 0; g < keys; g++) key[g] = _mm256_set1_epi8((char)g);
    Py_ssize_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(k + i));
        const __m256i same = _mm256_cmpeq_epi8(a, _mm256_loadu_si256((const __m256i *)(y + i)));
        uint32_t changed = ~(uint32_t)_mm256_movemask_epi8(same);
        if (_mm_popcnt_u32(changed) > SPARSE_DENSE) {
            group_loop(k + i, NULL, y + i, table, 32, o, start);
            continue;
        }
        for (int g = 0; g < keys; g++) lanes[g] = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(a, key[g]));
        for (; changed != 0; changed &= changed - 1) {
            const unsigned lane = (unsigned)__builtin_ctz(changed);
            const uint8_t g = k[i + lane];
            o[start[g] + _mm_popcnt_u32(_bzhi_u32(lanes[g], lane))] = table[g - y[i + lane] + 255];
        }
        for (int g = 0; g < keys; g++) start[g] += _mm_popcnt_u32(lanes[g]);
    }
    return i;
}
#endif

/* Whether group_forward takes the sparse path for the cyclic difference of these many groups into
 * the n bytes of o, which it then zeroes (the differences of unchanged values are never written). */
static int group_sparse(int keys, uint8_t *o, Py_ssize_t n) {
#ifdef GROUP_SIMD
    if (keys <= SPARSE_KEYS && (dq_simd_paths() & DQ_AVX2) && !(keys <= GROUP_SIMD_KEYS && group_simd_available())) {
        memset(o, 0, n);
        return 1;
    }
#endif
    return 0;
}

/* The forward grouping: o[start[k[i]]++] = v[i], or, with y, (k[i] - y[i]) mod levels (looked up
 * in table); 64 at a time where the vector path applies (the CPU has it, at most
 * GROUP_SIMD_KEYS groups), else, with y and an o group_sparse zeroed, the changed
 * values 32 at a time; the rest four at a time. start: group_starts of k, advanced. */
INLINE void group_forward(const uint8_t *k, const uint8_t *v, const uint8_t *y, int levels, const uint8_t table[511],
                          Py_ssize_t n, int keys, uint8_t *o, Py_ssize_t start[256], int zeroed) {
    Py_ssize_t i = 0;
#ifdef GROUP_SIMD
    if (keys <= GROUP_SIMD_KEYS && group_simd_available())
        i = keys > GROUP_TWO_PASS_KEYS ? group_simd_two_pass(k, v, y, levels, table, n, keys, o, start)
                                       : group_simd(k, v, y, levels, table, n, keys, o, start);
    else if (zeroed && y != NULL)
        i = group_sparse_avx2(k, y, table, n, keys, o, start);
#endif
    group_loop(k + i, v == NULL ? NULL : v + i, y == NULL ? NULL : y + i, table, n - i, o, start);
}

/* The vectorised inverse grouping where it applies (as group_forward's); the values it did (a
 * multiple of 64, or 0), the rest for the caller's loop, which checks places its own way. */
static Py_ssize_t ungroup_fast(const uint8_t *k, const uint8_t *v, int levels, const uint8_t table[511], Py_ssize_t n,
                               int keys, uint8_t *o, Py_ssize_t start[256], int *wrong) {
#ifdef GROUP_SIMD
    if (keys <= GROUP_SIMD_KEYS && group_simd_available())
        return keys > GROUP_TWO_PASS_KEYS ? ungroup_simd_two_pass(k, v, levels, table, n, keys, o, start, wrong)
                                          : ungroup_simd(k, v, levels, table, n, keys, o, start, wrong);
#endif
    return 0;
}

static int simd_allowed = 1; /* py_allow_simd: tests run the plain loops on a CPU that has the vector ones */

int dq_simd_paths(void) {
    static int known = -1; /* (threads that ask at once each store the same answer) */
    int have = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (have < 0) {
        have = 0;
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 7) || (!defined(__clang__) && __GNUC__ >= 8))
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("popcnt")) have |= DQ_AVX512F;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) have |= DQ_AVX512BW;
        if (__builtin_cpu_supports("avx2")) have |= DQ_AVX2;
        if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi2") &&
            __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt"))
            have |= DQ_AVX512_VBMI2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
            have |= DQ_AVX512DQ;
#endif
        __atomic_store_n(&known, have, __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&simd_allowed, __ATOMIC_RELAXED) ? have : 0;
}

PyObject *py_simd_paths(PyObject *self, PyObject *args) { return PyLong_FromLong(dq_simd_paths()); }

PyObject *py_allow_simd(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
    return PyBool_FromLong(__atomic_exchange_n(&simd_allowed, flag, __ATOMIC_RELAXED));
}

PyObject *py_regroup_u8(PyObject *self, PyObject *args) {
    Py_buffer values, keys, out;
    int inverse;
    if (!PyArg_ParseTuple(args, "y*y*w*p", &values, &keys, &out, &inverse)) return NULL;
    int ok = values.len == keys.len && out.len == keys.len;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "regroup: values, keys and out differ in length");
    else if (overlaps(&out, &values) || overlaps(&out, &keys)) {
        ok = 0;
        PyErr_SetString(PyExc_ValueError, "regroup: out must be apart from values and keys");
    }
    else {
        const uint8_t *v = values.buf, *k = keys.buf;
        uint8_t *o = out.buf;
        Py_ssize_t n = keys.len, start[256];
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t i, c[4];
        const int groups = group_starts(k, n, start);
        int wrong; /* (never set: the groups are the keys' own) */
        if (inverse) {
            i = ungroup_fast(k, v, 0, NULL, n, groups, o, start, &wrong);
            for (; i + 4 <= n; i += 4) {
                next_places(k + i, start, c);
                for (int j = 0; j < 4; j++) o[i + j] = v[c[j]];
            }
            for (; i < n; i++) o[i] = v[start[k[i]]++];
        } else
            group_forward(k, v, NULL, 0, NULL, n, groups, o, start, 0);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&values); PyBuffer_Release(&keys); PyBuffer_Release(&out);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* The current codes from a regrouped delta (delta.py's undo_regrouped_delta): the ungrouping of
 * py_regroup_u8 (inverse) and the cyclic difference of py_cyclic_u8 in one pass, out[i] =
 * (keys[i] - grouped[next place of keys[i]'s group]) mod levels. out may be keys itself (a
 * restore's base codes, given up): keys[i] is read before out[i] is written, and never after.
 * counts (optional, 256 int64): the histogram of keys, when the caller has it (a restore counted
 * it for the delta's rANS models), so that it is not counted again. Counts that are not that
 * histogram are refused (ValueError): each place is checked before it is read, and each group
 * must end where its count says. */
PyObject *py_ungroup_cyclic_u8(PyObject *self, PyObject *args) {
    Py_buffer grouped, keys, out, counts = {0};
    int levels;
    if (!PyArg_ParseTuple(args, "y*y*iw*|y*", &grouped, &keys, &levels, &out, &counts)) return NULL;
    int ok = grouped.len == keys.len && out.len == keys.len && levels >= 1 && levels <= 256;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "ungroup_cyclic: arrays differ in length or levels outside 1..256");
    else if (overlaps(&out, &grouped) || (out.buf != keys.buf && overlaps(&out, &keys))) {
        ok = 0;
        PyErr_SetString(PyExc_ValueError, "ungroup_cyclic: out must be apart from grouped, and keys itself or apart");
    }
    else if (counts.obj != NULL) {
        const int64_t *c = counts.buf;
        int64_t sum = 0;
        ok = counts.len == 256 * (Py_ssize_t)sizeof(int64_t);
        for (int j = 0; ok && j < 256; j++) {
            if (c[j] < 0 || c[j] > keys.len) ok = 0; /* (each at most n: the sums cannot overflow) */
            else sum += c[j];
        }
        ok = ok && sum == keys.len;
        if (!ok) PyErr_SetString(PyExc_ValueError, "ungroup_cyclic: counts must be 256 int64 adding up to the keys");
    }
    if (ok) {
        const uint8_t *v = grouped.buf, *k = keys.buf;
        uint8_t *o = out.buf, table[511];
        Py_ssize_t n = keys.len, start[256], end[256];
        const int64_t *given = counts.obj != NULL ? counts.buf : NULL;
        int wrong = 0; /* given counts that are not the keys' histogram (a place outside the groups) */
        Py_BEGIN_ALLOW_THREADS
        cyclic_table(levels, table);
        int groups;
        if (given != NULL) {
            Py_ssize_t pos = 0;
            for (int j = 0; j < 256; j++) { start[j] = pos; pos += given[j]; end[j] = pos; }
            groups = groups_in(given);
        } else
            groups = group_starts(k, n, start);
        Py_ssize_t i = ungroup_fast(k, v, levels, table, n, groups, o, start, &wrong), c[4];
        for (; i + 4 <= n && !wrong; i += 4) {
            const uint8_t k0 = k[i], k1 = k[i + 1], k2 = k[i + 2], k3 = k[i + 3]; /* (before out overwrites them) */
            next_places(k + i, start, c);
            if (given != NULL && ((size_t)c[0] >= (size_t)n || (size_t)c[1] >= (size_t)n
                                  || (size_t)c[2] >= (size_t)n || (size_t)c[3] >= (size_t)n)) { wrong = 1; break; }
            o[i] = table[(int)k0 - (int)v[c[0]] + 255];
            o[i + 1] = table[(int)k1 - (int)v[c[1]] + 255];
            o[i + 2] = table[(int)k2 - (int)v[c[2]] + 255];
            o[i + 3] = table[(int)k3 - (int)v[c[3]] + 255];
        }
        for (; i < n && !wrong; i++) {
            const Py_ssize_t at = start[k[i]]++;
            if ((size_t)at >= (size_t)n) { wrong = 1; break; }
            o[i] = table[(int)k[i] - (int)v[at] + 255];
        }
        for (int j = 0; given != NULL && j < 256 && !wrong; j++) wrong = start[j] != end[j];
        Py_END_ALLOW_THREADS
        if (wrong) {
            ok = 0;
            PyErr_SetString(PyExc_ValueError, "ungroup_cyclic: the counts are not the histogram of the keys");
        }
    }
    PyBuffer_Release(&grouped); PyBuffer_Release(&keys); PyBuffer_Release(&out);
    PyBuffer_Release(&counts); /* (nothing when none was given) */
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* Counts of each uint8 symbol (np.bincount of bytes, without converting them to intp first). */
PyObject *py_byte_counts(PyObject *self, PyObject *args) {
    Py_buffer symbols, counts;
    if (!PyArg_ParseTuple(args, "y*w*", &symbols, &counts)) return NULL;
    int ok = counts.len == 256 * (Py_ssize_t)sizeof(int64_t);
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "byte_counts: counts must hold 256 int64");
    else {
        Py_BEGIN_ALLOW_THREADS
        count_bytes(symbols.buf, symbols.len, counts.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&symbols); PyBuffer_Release(&counts);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* Counts of each (key, value) pair of two uint8 arrays: counts[256 * key + value]. The regrouped
 * delta is coded with one model per key (the previous code), so these give its size before it
 * is coded (entropy.py, conditional_bits). */
PyObject *py_pair_counts(PyObject *self, PyObject *args) {
    Py_buffer keys, values, counts;
    if (!PyArg_ParseTuple(args, "y*y*w*", &keys, &values, &counts)) return NULL;
    int ok = keys.len == values.len && counts.len == 65536 * (Py_ssize_t)sizeof(int64_t);
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "pair_counts: keys and values differ in length, or counts is not 65536");
    else {
        const uint8_t *k = keys.buf, *v = values.buf;
        int64_t *c = counts.buf;
        Py_ssize_t n = keys.len;
        Py_BEGIN_ALLOW_THREADS
        memset(c, 0, 65536 * sizeof(int64_t));
        for (Py_ssize_t i = 0; i < n; i++) c[(k[i] << 8) | v[i]]++;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&keys); PyBuffer_Release(&values); PyBuffer_Release(&counts);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* The cyclic difference (x - y) mod levels regrouped by x (py_regroup_u8's order) into o, which
 * overlaps neither, and its pairs counted (pairs[(a << 8) | d]): the delta an encoder codes, in
 * one pass over the codes, then one over each group's differences to count them. */
static void grouped_pairs(const uint8_t *x, const uint8_t *y, Py_ssize_t n, const uint8_t table[511], int levels,
                          uint8_t *o, int64_t *pairs) {
    Py_ssize_t start[256], begin[256];
    const int keys = group_starts(x, n, start), zeroed = group_sparse(keys, o, n);
    memcpy(begin, start, sizeof(begin));
    group_forward(x, NULL, y, levels, table, n, keys, o, start, zeroed);
    memset(pairs, 0, 65536 * sizeof(int64_t));
    for (int k = 0; k < keys; k++) count_bytes(o + begin[k], start[k] - begin[k], pairs + ((Py_ssize_t)k << 8));
}

/* (a - b) mod levels of two uint8 arrays (delta.py's cyclic_delta, and apply_delta, which is
 * the same operation on the previous codes and the delta), with a non-negative remainder. The
 * difference of two bytes lies in -255..255: its remainder is looked up (cyclic_table). With a
 * fifth argument (65536 int64) out receives the differences regrouped by a and their pairs
 * (a, difference) are counted there, as pair_counts does (grouped_pairs; out must not overlap
 * a or b): the encoder's delta needs both (delta.py's grouped_delta). */
PyObject *py_cyclic_u8(PyObject *self, PyObject *args) {
    Py_buffer a, b, out, pairs = {0};
    int levels;
    PyObject *pairs_obj = Py_None;
    if (!PyArg_ParseTuple(args, "y*y*iw*|O", &a, &b, &levels, &out, &pairs_obj)) return NULL;
    int counted = pairs_obj != Py_None;
    if (counted && PyObject_GetBuffer(pairs_obj, &pairs, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&a); PyBuffer_Release(&b); PyBuffer_Release(&out);
        return NULL;
    }
    int ok = a.len == b.len && out.len == a.len && levels >= 1 && levels <= 256 &&
             (!counted || pairs.len == 65536 * (Py_ssize_t)sizeof(int64_t));
    if (!ok)
        PyErr_SetString(PyExc_ValueError,
                        "cyclic: arrays differ in length, levels outside 1..256, or pairs is not 65536 int64");
    else if (counted && (overlaps(&out, &a) || overlaps(&out, &b))) {
        ok = 0;
        PyErr_SetString(PyExc_ValueError, "cyclic: the grouped difference needs an out apart from a and b");
    } else {
        const uint8_t *x = a.buf, *y = b.buf;
        uint8_t *o = out.buf, table[511];
        int64_t *c = counted ? pairs.buf : NULL;
        Py_ssize_t n = a.len;
        Py_BEGIN_ALLOW_THREADS
        cyclic_table(levels, table);
        if (c == NULL)
            for (Py_ssize_t i = 0; i < n; i++) o[i] = table[(int)x[i] - (int)y[i] + 255];
        else
            grouped_pairs(x, y, n, table, levels, o, c);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&a); PyBuffer_Release(&b); PyBuffer_Release(&out);
    if (counted) PyBuffer_Release(&pairs);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* The codes grouped_pairs_chunked (below) unpacks at a time: packed ones, bits (1-8) a code less
 * base (bitplanes.c's pack, as a kept state holds the previous checkpoint's codes). */
#define PACKED_CHUNK 32768

#ifdef GROUP_SIMD
/* n (a multiple of 64) codes packed four bits a code, each plus base, 64 at a time: each packed
 * byte widened to 16 bits, its high nibble moved to the high byte (the next code, little-endian). */
VBMI2 static void unpack4_simd(const uint8_t *in, Py_ssize_t n, uint8_t base, uint8_t *v) {
    const __m512i low = _mm512_set1_epi16(0x000F), high = _mm512_set1_epi16(0x0F00), add = _mm512_set1_epi8((char)base);
    for (Py_ssize_t i = 0; i < n; i += 64) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(in + i / 2)));
        const __m512i codes = _mm512_or_si512(_mm512_and_si512(w, low), _mm512_and_si512(_mm512_slli_epi16(w, 4), high));
        _mm512_storeu_si512(v + i, _mm512_add_epi8(codes, add));
    }
}

/* The same with AVX2, 32 at a time (n a multiple of 32). */
AVX2_GROUP static void unpack4_avx2(const uint8_t *in, Py_ssize_t n, uint8_t base, uint8_t *v) {
    const __m256i low = _mm256_set1_epi16(0x000F), high = _mm256_set1_epi16(0x0F00), add = _mm256_set1_epi8((char)base);
    for (Py_ssize_t i = 0; i < n; i += 32) {
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(in + i / 2)));
        const __m256i codes = _mm256_or_si256(_mm256_and_si256(w, low), _mm256_and_si256(_mm256_slli_epi16(w, 4), high));
        _mm256_storeu_si256((__m256i *)(v + i), _mm256_add_epi8(codes, add));
    }
}
#endif

/* A chunk of packed codes (from a whole byte) unpacked: four bits a code 64 at a time where the
 * CPU allows (32 with AVX2 alone: 0.06 ns a code on a Zen 1 EPYC against the table's 0.32), else
 * (and the rest) by bitplanes.c's tables. */
static void unpack_chunk(const uint8_t *in, Py_ssize_t n, int bits, uint8_t base, uint8_t *v) {
    Py_ssize_t done = 0;
#ifdef GROUP_SIMD
    if (bits == 4 && group_simd_available()) {
        done = n / 64 * 64;
        unpack4_simd(in, done, base, v);
    } else if (bits == 4 && (dq_simd_paths() & DQ_AVX2)) {
        done = n / 32 * 32;
        unpack4_avx2(in, done, base, v);
    }
#endif
    if (done < n) dq_unpack_bits(in + done / 8 * bits, n - done, bits, base, v + done);
}

/* The packed first codes of grouped_pairs_chunked; fill writes codes at..at+len-1 into x. */
typedef struct {
    const uint8_t *packed;
    int bits;
    uint8_t base;
} first_codes_t;

static void fill_packed(const first_codes_t *f, Py_ssize_t at, Py_ssize_t len, uint8_t *x) {
    unpack_chunk(f->packed + at / 8 * f->bits, len, f->bits, f->base, x); /* (a chunk starts on a whole byte) */
}

/* grouped_pairs with the first codes unpacked PACKED_CHUNK at a time into a buffer that stays in
 * the cache, once to count the keys and once to group, where unpacking them whole first wrote a
 * byte a code to new memory (a 124M delta's previous codes, 373 MB, whose first touches cost more
 * than the unpacking itself) and read it back twice. The chunks are grouped in order into the
 * same groups, so out and pairs are grouped_pairs' of the codes made whole. */
static void grouped_pairs_chunked(const first_codes_t *f, const uint8_t *y, Py_ssize_t n, const uint8_t table[511],
                                  int levels, uint8_t *o, int64_t *pairs) {
    uint8_t x[PACKED_CHUNK];
    int64_t count[256] = {0}, part[256];
    Py_ssize_t start[256], begin[256], pos = 0;
    for (Py_ssize_t at = 0; at < n; at += PACKED_CHUNK) {
        const Py_ssize_t len = n - at < PACKED_CHUNK ? n - at : PACKED_CHUNK;
        fill_packed(f, at, len, x);
        count_bytes(x, len, part);
        for (int k = 0; k < 256; k++) count[k] += part[k];
    }
    for (int k = 0; k < 256; k++) { start[k] = pos; pos += count[k]; }
    const int keys = groups_in(count), zeroed = group_sparse(keys, o, n);
    memcpy(begin, start, sizeof(begin));
    for (Py_ssize_t at = 0; at < n; at += PACKED_CHUNK) {
        const Py_ssize_t len = n - at < PACKED_CHUNK ? n - at : PACKED_CHUNK;
        fill_packed(f, at, len, x);
        group_forward(x, NULL, y + at, levels, table, len, keys, o, start, zeroed);
    }
    memset(pairs, 0, 65536 * sizeof(int64_t));
    for (int k = 0; k < keys; k++) count_bytes(o + begin[k], start[k] - begin[k], pairs + ((Py_ssize_t)k << 8));
}

/* cyclic_packed_u8(packed, bits, base, b, levels, out, pairs): py_cyclic_u8's grouped difference
 * and pairs (a - b, regrouped by a) where a comes packed (grouped_pairs_chunked); b's length is
 * the code count. delta.py's grouped_delta of a kept state's codes. */
PyObject *py_cyclic_packed_u8(PyObject *self, PyObject *args) {
    Py_buffer a, b, out, pairs;
    int bits, base, levels;
    if (!PyArg_ParseTuple(args, "y*iiy*iw*w*", &a, &bits, &base, &b, &levels, &out, &pairs)) return NULL;
    int ok = bits >= 1 && bits <= 8 && base >= 0 && base + (1 << bits) - 1 <= 255 &&
             a.len == (b.len * bits + 7) / 8 && out.len == b.len && levels >= 1 && levels <= 256 &&
             pairs.len == 65536 * (Py_ssize_t)sizeof(int64_t);
    if (!ok)
        PyErr_SetString(PyExc_ValueError,
                        "cyclic_packed: the packed codes do not hold as many codes as b, out's length differs, "
                        "bits outside 1..8 or past 255 with base, levels outside 1..256, or pairs is not 65536 int64");
    else if (overlaps(&out, &a) || overlaps(&out, &b)) {
        ok = 0;
        PyErr_SetString(PyExc_ValueError, "cyclic_packed: the grouped difference needs an out apart from a and b");
    } else {
        uint8_t table[511];
        const first_codes_t f = {.packed = a.buf, .bits = bits, .base = (uint8_t)base};
        Py_BEGIN_ALLOW_THREADS
        cyclic_table(levels, table);
        grouped_pairs_chunked(&f, b.buf, b.len, table, levels, out.buf, pairs.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&a); PyBuffer_Release(&b); PyBuffer_Release(&out); PyBuffer_Release(&pairs);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* The factored grouping (delta.py's grouped_delta of a keyframe's factored contexts), FORWARD:
 * the cyclic difference (context - y) mod levels of each code y of a factored matrix
 * (factored_t, src) regrouped by context into dst, as grouped_pairs regroups by a key; or its
 * inverse: each code (context - d) mod levels into dst from the grouped differences d in src.
 * The groups' sizes come from the terms (factored_counts, into count), and a row's codes go a
 * class at a time: its columns, a run known in advance, gathered from the row and stored one
 * after another at their context's next place (or back), with no context made and no place
 * updated per code (grouped_pairs' counting sort over 53-61 contexts took 1.2-1.4 ns a code on a
 * 124M GPT-2's Adam scales, about half a keyframe's added cost; its inverse, after making the
 * contexts whole, 1.2). Rows where two classes or more clip to an end context go column by
 * column, as the counting sort does. */
INLINE void factored_walk(const int FORWARD, const factored_t *f, const uint8_t *src, const uint8_t table[511],
                          uint8_t *dst, int64_t count[256]) {
    Py_ssize_t pos[256], at = 0;
    factored_counts(f, count);
    for (int k = 0; k < 256; k++) { pos[k] = at; at += count[k]; }
    for (Py_ssize_t i = 0; i < f->rows; i++) {
        const int r = f->r[i];
        const uint8_t *codes_in = src + i * f->cols; /* (the row, when FORWARD) */
        uint8_t *codes_out = dst + i * f->cols;      /* (the row, when not) */
        if (row_by_class(f, r))
            for (Py_ssize_t k = 0; k < f->classes; k++) {
                const int c = class_context(f, r, k);
                const int32_t *cols = f->order + f->start[k];
                const Py_ssize_t len = f->start[k + 1] - f->start[k];
                const uint8_t *t = table + c + 255; /* t[-x] = (c - x) mod levels */
                if (FORWARD) {
                    uint8_t *g = dst + pos[c];
                    for (Py_ssize_t j = 0; j < len; j++) g[j] = t[-(int)codes_in[cols[j]]];
                } else {
                    const uint8_t *g = src + pos[c];
                    for (Py_ssize_t j = 0; j < len; j++) codes_out[cols[j]] = t[-(int)g[j]];
                }
                pos[c] += len;
            }
        else
            for (Py_ssize_t j = 0; j < f->cols; j++) {
                int c = r + f->c[j];
                c = c < 0 ? 0 : c > f->top ? f->top : c;
                if (FORWARD)
                    dst[pos[c]++] = table[c - (int)codes_in[j] + 255];
                else
                    codes_out[j] = table[c - (int)src[pos[c]++] + 255];
            }
    }
}

/* cyclic_factored_u8's work (forward, with pairs: the grouped differences' pairs counted, as
 * grouped_pairs counts them) or ungroup_factored_u8's, the GIL released, its arguments checked
 * first (`in` the codes b, or the grouped differences; `what` names it): 1, or 0 with the
 * error set (a ValueError naming `name`, or out of memory). */
static int factored_regroup(const char *name, const char *what, const int forward, const Py_buffer *r,
                            const Py_buffer *c, int contexts, int levels, const Py_buffer *in, const Py_buffer *out,
                            const Py_buffer *pairs) {
    if (!factored_fits(r, c, contexts) || in->len != (r->len / 2) * (c->len / 2) || out->len != in->len ||
        levels < 1 || levels > 256 || (forward && pairs->len != 65536 * (Py_ssize_t)sizeof(int64_t))) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s is not rows x cols, out's length differs, terms past +-4096, contexts or levels outside "
                     "1..256%s",
                     name, what, forward ? ", or pairs is not 65536 int64" : "");
        return 0;
    }
    if (overlaps(out, in)) {
        PyErr_Format(PyExc_ValueError, "%s: out must be apart from %s", name, what);
        return 0;
    }
    factored_t f;
    if (!factored_init(&f, r->buf, r->len / 2, c->buf, c->len / 2, contexts)) {
        PyErr_NoMemory();
        return 0;
    }
    const uint8_t *src = in->buf;
    uint8_t *dst = out->buf, table[511];
    int64_t count[256];
    Py_BEGIN_ALLOW_THREADS
    cyclic_table(levels, table);
    if (forward) {
        int64_t *counts = pairs->buf;
        factored_walk(1, &f, src, table, dst, count);
        Py_ssize_t at = 0;
        memset(counts, 0, 65536 * sizeof(int64_t));
        for (int k = 0; k < groups_in(count); at += count[k], k++)
            count_bytes(dst + at, count[k], counts + ((Py_ssize_t)k << 8));
    } else {
        factored_walk(0, &f, src, table, dst, count);
    }
    Py_END_ALLOW_THREADS
    factored_free(&f);
    return 1;
}

/* cyclic_factored_u8(row_terms, col_terms, contexts, b, levels, out, pairs): py_cyclic_u8's
 * grouped difference and pairs ((a - b) mod levels, regrouped by a) where a is the factored
 * contexts of a rows x cols matrix (factored.py: clip(r[i] + c[j], 0, contexts - 1), int16 terms
 * within +-2^12), never made (factored_walk); b's length is rows x cols. delta.py's grouped_delta
 * of a keyframe's factored contexts. */
PyObject *py_cyclic_factored_u8(PyObject *self, PyObject *args) {
    Py_buffer r, c, b, out, pairs;
    int contexts, levels;
    if (!PyArg_ParseTuple(args, "y*y*iy*iw*w*", &r, &c, &contexts, &b, &levels, &out, &pairs)) return NULL;
    const int ok = factored_regroup("cyclic_factored", "b", 1, &r, &c, contexts, levels, &b, &out, &pairs);
    PyBuffer_Release(&r); PyBuffer_Release(&c); PyBuffer_Release(&b); PyBuffer_Release(&out); PyBuffer_Release(&pairs);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* ungroup_factored_u8(grouped, row_terms, col_terms, contexts, levels, out): the codes (a - d) mod
 * levels of a rows x cols matrix, a its factored contexts, from the differences d grouped by
 * them (cyclic_factored_u8's grouped); out apart from grouped. delta.py's undo_regrouped_delta of
 * a factored keyframe. Every group's size is the terms' (factored_counts), so any grouped bytes
 * of the right length give codes; whether they are the stored ones is the rANS stream's check. */
PyObject *py_ungroup_factored_u8(PyObject *self, PyObject *args) {
    Py_buffer g, r, c, out;
    int contexts, levels;
    if (!PyArg_ParseTuple(args, "y*y*y*iiw*", &g, &r, &c, &contexts, &levels, &out)) return NULL;
    const int ok = factored_regroup("ungroup_factored", "grouped", 0, &r, &c, contexts, levels, &g, &out, NULL);
    PyBuffer_Release(&g); PyBuffer_Release(&r); PyBuffer_Release(&c); PyBuffer_Release(&out);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* A regrouped delta two values to a byte (delta.py's pair_up): for each group k of sizes[k]
 * values, in order, its values two at a time as x * levels + y (levels <= 16: a pair fits a
 * byte), then one last group: the last value of each group of odd size. counts[(k << 8) | s]
 * receives the histogram of group k's pair symbols, row `groups` that of the last group. rANS
 * then codes half the symbols, each in one step (decoding 1.7x faster), and a pair's model sees
 * what two neighbours share. Returns 0, or -1 when a value is at or past levels. */
static int pair_up(const uint8_t *v, const int64_t *sizes, Py_ssize_t groups, int levels, uint8_t *out,
                   int64_t *counts) {
    Py_ssize_t at = 0, k = 0;
    uint8_t top = 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        const Py_ssize_t half = sizes[g] / 2, begin = k;
        for (Py_ssize_t j = 0; j < half; j++) {
            const uint8_t x = v[at + 2 * j], y = v[at + 2 * j + 1];
            top = x > top ? x : top;
            top = y > top ? y : top;
            out[k++] = (uint8_t)(x * levels + y);
        }
        at += sizes[g];
        count_bytes(out + begin, k - begin, counts + (g << 8));
    }
    const Py_ssize_t begin = k;
    at = 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        at += sizes[g];
        if (sizes[g] % 2) {
            top = v[at - 1] > top ? v[at - 1] : top;
            out[k++] = v[at - 1];
        }
    }
    count_bytes(out + begin, k - begin, counts + (groups << 8));
    return top < levels ? 0 : -1;
}

/* The inverse (delta.py's unpair): returns 0, or -1 when a symbol is no pair of values below
 * levels (a damaged stream). */
static int unpair(const uint8_t *s, const int64_t *sizes, Py_ssize_t groups, int levels, uint8_t *out) {
    uint16_t both[256]; /* a pair's two values, as the two bytes they take in out */
    const int pairs = levels * levels;
    for (int p = 0; p < 256; p++) {
        const uint8_t two[2] = {(uint8_t)(p / levels), (uint8_t)(p % levels)};
        memcpy(&both[p], two, 2);
    }
    Py_ssize_t at = 0, k = 0;
    uint8_t top = 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        const Py_ssize_t half = sizes[g] / 2;
        for (Py_ssize_t j = 0; j < half; j++) {
            const uint8_t p = s[k + j];
            top = p > top ? p : top;
            const uint16_t two = both[p];
            memcpy(out + at + 2 * j, &two, 2);
        }
        k += half;
        at += sizes[g];
    }
    int wrong = pairs <= 256 && top >= pairs;
    at = 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        at += sizes[g];
        if (sizes[g] % 2) {
            wrong |= s[k] >= levels;
            out[at - 1] = s[k++];
        }
    }
    return wrong ? -1 : 0;
}

/* Whether groups of these sizes hold n values: none negative, and they add up to n. */
static int sizes_fit(const int64_t *sizes, Py_ssize_t groups, Py_ssize_t n) {
    Py_ssize_t total = 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        if (sizes[g] < 0 || sizes[g] > n) return 0;
        total += sizes[g];
    }
    return total == n;
}

/* The paired stream's length for groups of these sizes, or -1 for sizes that do not fit n. */
static Py_ssize_t paired_length(const int64_t *sizes, Py_ssize_t groups, Py_ssize_t n) {
    if (!sizes_fit(sizes, groups, n)) return -1;
    Py_ssize_t length = 0;
    for (Py_ssize_t g = 0; g < groups; g++) length += sizes[g] / 2 + sizes[g] % 2;
    return length;
}

PyObject *py_pair_up_u8(PyObject *self, PyObject *args) {
    Py_buffer values, sizes, out, counts;
    int levels;
    if (!PyArg_ParseTuple(args, "y*y*iw*w*", &values, &sizes, &levels, &out, &counts)) return NULL;
    const Py_ssize_t groups = sizes.len / 8;
    int ok = levels >= 1 && levels <= 16 && sizes.len % 8 == 0 && groups <= 256 &&
             counts.len == (groups + 1) * 256 * 8 && paired_length(sizes.buf, groups, values.len) == out.len;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "pair_up: levels outside 1..16, or sizes, out and counts do not fit");
    else {
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = pair_up(values.buf, sizes.buf, groups, levels, out.buf, counts.buf);
        Py_END_ALLOW_THREADS
        if (status) {
            ok = 0;
            PyErr_SetString(PyExc_ValueError, "pair_up: a value is at or past the levels");
        }
    }
    PyBuffer_Release(&values); PyBuffer_Release(&sizes); PyBuffer_Release(&out); PyBuffer_Release(&counts);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

PyObject *py_unpair_u8(PyObject *self, PyObject *args) {
    Py_buffer symbols, sizes, out;
    int levels;
    if (!PyArg_ParseTuple(args, "y*y*iw*", &symbols, &sizes, &levels, &out)) return NULL;
    const Py_ssize_t groups = sizes.len / 8;
    int ok = levels >= 1 && levels <= 16 && sizes.len % 8 == 0 && groups <= 256 &&
             paired_length(sizes.buf, groups, out.len) == symbols.len;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "unpair: levels outside 1..16, or the sizes do not fit the symbols");
    else {
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = unpair(symbols.buf, sizes.buf, groups, levels, out.buf);
        Py_END_ALLOW_THREADS
        if (status) {
            ok = 0;
            PyErr_SetString(PyExc_ValueError, "unpair: a symbol is no pair of values below the levels");
        }
    }
    PyBuffer_Release(&symbols); PyBuffer_Release(&sizes); PyBuffer_Release(&out);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* The gap token that stands for GAP_ESCAPE unchanged values with no changed one after them
 * (delta.py's GAP_ESCAPE; tokens are below it otherwise, so a group's table has at most 32 counts). */
#define GAP_ESCAPE 31

/* Whether each of eight values is not 0, as the bits of a byte: a byte's high bit after adding
 * 0x7f to its low bits is whether it is 0, and one multiply gathers the eight bits. */
INLINE unsigned nonzero_bytes(const uint8_t *v) {
    uint64_t w;
    memcpy(&w, v, 8);
    const uint64_t low = 0x7f7f7f7f7f7f7f7fULL;
    const uint64_t high = ((((w & low) + low) | w) >> 7) & 0x0101010101010101ULL;
    return (unsigned)((high * 0x0102040810204080ULL) >> 56); /* (byte i's bit to bit i) */
}

/* Which of 64 values are not 0, as the bits of a word (bit j: value j): SSE2's byte compares
 * where the CPU is an x86-64 (all have it), else eight words. */
#if defined(__SSE2__)
#include <emmintrin.h>
INLINE uint64_t nonzero_64(const uint8_t *v) {
    const __m128i zero = _mm_setzero_si128();
    uint64_t m = 0;
    for (int j = 0; j < 4; j++)
        m |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)(v + 16 * j)), zero))
             << (16 * j);
    return ~m;
}
#else
INLINE uint64_t nonzero_64(const uint8_t *v) {
    uint64_t m = 0;
    for (int j = 0; j < 8; j++) m |= (uint64_t)nonzero_bytes(v + 8 * j) << (8 * j);
    return m;
}
#endif

/* A regrouped delta as gaps (delta.py's gap_up), where most deltas are 0: for each group g of
 * sizes[g] values, in order, one token for each value that is not 0, the number of 0s before it
 * (since the group's start or the last such value), where that is below GAP_ESCAPE, and for each
 * GAP_ESCAPE 0s a token GAP_ESCAPE ahead of it (the 0s after the group's last such value are not
 * coded); tokens[] receives every group's tokens in turn, token_counts[g] how many group g took,
 * hist[(g << 8) | k] how many of them were k, and values[] the values that are not 0, less 1, in
 * order. rANS then takes a step or two for each changed value where it took one for each value: a
 * weight's delta two steps on changes 1-6% of them. 64 values at a time are tested at once, then
 * their changed ones visited. Returns the tokens written, or -1 when a value is at or past levels,
 * the values do not fill values[] exactly, or capacity is short of a token for each value and each
 * GAP_ESCAPE values of a group (the most a group's gaps take), and 4. */
static Py_ssize_t gap_up(const uint8_t *v, const int64_t *sizes, Py_ssize_t groups, int levels, uint8_t *tokens,
                         Py_ssize_t capacity, int64_t *token_counts, int64_t *hist, uint8_t *values,
                         Py_ssize_t n_values) {
    Py_ssize_t at = 0, t = 0, c = 0, most = n_values;
    for (Py_ssize_t g = 0; g < groups; g++) most += sizes[g] / GAP_ESCAPE;
    if (capacity < most + 4) return -1; /* (4: a gap's escapes are written four at once, below) */
    int top = 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        const Py_ssize_t n = sizes[g], first = t;
        Py_ssize_t last = 0; /* the place after the group's last value that is not 0 */
        for (Py_ssize_t i = 0; i < n; i += 64) {
            uint64_t m = 0;
            if (n - i >= 64)
                m = nonzero_64(v + at + i);
            else
                for (Py_ssize_t j = 0; j < n - i; j++) m |= (uint64_t)(v[at + i + j] != 0) << j;
            if (c + __builtin_popcountll(m) > n_values) return -1; /* (more values than the pairs counted) */
            for (; m; m &= m - 1) {
                const Py_ssize_t place = i + __builtin_ctzll(m);
                const Py_ssize_t gap = place - last, skips = gap / GAP_ESCAPE;
                if (skips <= 4) /* (the common case: four stored, those past the gap's overwritten next) */
                    memset(tokens + t, GAP_ESCAPE, 4);
                else
                    memset(tokens + t, GAP_ESCAPE, (size_t)skips);
                t += skips;
                tokens[t++] = (uint8_t)(gap - skips * GAP_ESCAPE);
                const uint8_t x = v[at + place];
                top = x > top ? x : top;
                values[c++] = (uint8_t)(x - 1);
                last = place + 1;
            }
        }
        token_counts[g] = t - first;
        count_bytes(tokens + first, t - first, hist + (g << 8));
        at += n;
    }
    return top < levels && c == n_values ? t : -1;
}

/* The inverse (delta.py's ungap): the regrouped delta from each group's token_counts[g] tokens and
 * the values; returns 0, or -1 when a token is past GAP_ESCAPE, a group's gaps run past its end, a
 * value is at or past levels, or the values are not one for each token below GAP_ESCAPE. */
static int ungap(const uint8_t *tokens, const int64_t *token_counts, const uint8_t *values, Py_ssize_t n_values,
                 const int64_t *sizes, Py_ssize_t groups, int levels, uint8_t *out) {
    Py_ssize_t at = 0, t = 0, c = 0;
    int top = -1, wrong = 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        const Py_ssize_t n = sizes[g];
        Py_ssize_t pos = 0;
        memset(out + at, 0, (size_t)n);
        for (const Py_ssize_t end = t + token_counts[g]; t < end; t++) {
            const uint8_t k = tokens[t];
            pos += k;
            if (k >= GAP_ESCAPE) {
                wrong |= k > GAP_ESCAPE;
                continue;
            }
            if (pos >= n || c == n_values) return -1;
            const uint8_t x = values[c++];
            top = x > top ? x : top;
            out[at + pos++] = (uint8_t)(x + 1);
        }
        wrong |= pos > n;
        at += n;
    }
    return wrong || top + 1 >= levels || c != n_values ? -1 : 0;
}

PyObject *py_gap_up_u8(PyObject *self, PyObject *args) {
    Py_buffer v, sizes, tokens, token_counts, hist, values;
    int levels;
    if (!PyArg_ParseTuple(args, "y*y*iw*w*w*w*", &v, &sizes, &levels, &tokens, &token_counts, &hist, &values))
        return NULL;
    const Py_ssize_t groups = sizes.len / 8;
    Py_ssize_t written = -1;
    int ok = levels >= 1 && levels <= 256 && sizes.len % 8 == 0 && groups <= 256 && token_counts.len == groups * 8 &&
             hist.len == groups * 256 * 8 && sizes_fit(sizes.buf, groups, v.len);
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "gap_up: levels outside 1..256, or sizes and counts do not fit");
    else {
        Py_BEGIN_ALLOW_THREADS
        written = gap_up(v.buf, sizes.buf, groups, levels, tokens.buf, tokens.len, token_counts.buf, hist.buf,
                         values.buf, values.len);
        Py_END_ALLOW_THREADS
        if (written < 0) {
            ok = 0;
            PyErr_SetString(PyExc_ValueError,
                            "gap_up: a value is at or past the levels, or the changed values or tokens do not fit");
        }
    }
    PyBuffer_Release(&v); PyBuffer_Release(&sizes); PyBuffer_Release(&tokens); PyBuffer_Release(&token_counts);
    PyBuffer_Release(&hist); PyBuffer_Release(&values);
    if (!ok) return NULL;
    return PyLong_FromSsize_t(written);
}

PyObject *py_ungap_u8(PyObject *self, PyObject *args) {
    Py_buffer tokens, token_counts, values, sizes, out;
    int levels;
    if (!PyArg_ParseTuple(args, "y*y*y*y*iw*", &tokens, &token_counts, &values, &sizes, &levels, &out)) return NULL;
    const Py_ssize_t groups = sizes.len / 8;
    int ok = levels >= 1 && levels <= 256 && sizes.len % 8 == 0 && groups <= 256 && token_counts.len == sizes.len &&
             sizes_fit(sizes.buf, groups, out.len);
    if (ok) {
        Py_ssize_t total = 0;
        for (Py_ssize_t g = 0; g < groups; g++) {
            const int64_t k = ((const int64_t *)token_counts.buf)[g];
            ok &= k >= 0 && k <= tokens.len;
            total += ok ? k : 0;
        }
        ok &= total == tokens.len;
    }
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "ungap: levels outside 1..256, or the sizes or counts do not fit the tokens");
    else {
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = ungap(tokens.buf, token_counts.buf, values.buf, values.len, sizes.buf, groups, levels, out.buf);
        Py_END_ALLOW_THREADS
        if (status) {
            ok = 0;
            PyErr_SetString(PyExc_ValueError, "ungap: a gap or value is out of range, or the values do not match the gaps");
        }
    }
    PyBuffer_Release(&tokens); PyBuffer_Release(&token_counts); PyBuffer_Release(&values); PyBuffer_Release(&sizes);
    PyBuffer_Release(&out);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}
