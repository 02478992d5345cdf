#include "kernels.h"

/* DynaQuant partition and code assignment (quantizer.py), one pass over float32 weights, or
 * bfloat16 ones read as they are (WB: their bits widened in registers, exactly, so the codes are
 * those of the float32 copy the partition otherwise needs, 2 bytes a value of new memory less):
 * code 1 if protected (|w| > tau_mag, or sens > tau_sens), else 0 if pruned (metric <
 * tau_prune, or metric exactly 0, the metric being |w| or sens; tau_prune < 0 disables pruning),
 * else 2 + the nearest of the sorted centres (2 when there are none yet): the number of the
 * centres' midpoints below w. Returns the number of protected values.
 *
 * The thresholds are doubles and the values float32: (double) x > t exactly when x > the
 * largest float32 not above t, and (double) x < t exactly when x < the smallest float32 not
 * below it (quantizer.py says why), so the loops compare in float32, with no branches: a
 * value's code is picked from the three outcomes, and up to SMALL_MIDS midpoints are counted
 * against padding of +inf (never below a value, NaN included). The compiler then vectorises
 * the loop; a value's code is the one the search by halves gives (NaN: 2). More midpoints
 * (centres past 32; Adam's scale of a bfloat16 v takes 35-55) start from a look-up by the
 * value's top 16 bits (below), 4-6x faster than a search by halves value by value. Where the CPU
 * has AVX-512, up to SIMD_MIDS midpoints are searched by halves in vector registers instead
 * (partition_avx512): 0.25-0.4 ns a value against 1.0-2.7 for 7-31 midpoints, 0.6-0.8 against
 * 5.5 for 40; where it has AVX2 and not AVX-512, in two levels (partition_avx2). */
#define SMALL_MIDS 31
#define SIMD_MIDS 63 /* midpoints the AVX-512 path searches (64 entries with the padding) */

static float f32_at_most(double t) {
    float f = (float)t;
    return (double)f > t ? nextafterf(f, -INFINITY) : f;
}

static float f32_at_least(double t) {
    float f = (float)t;
    return (double)f < t ? nextafterf(f, INFINITY) : f;
}

/* The loop for HAS_SENS (a sensitivity given), BY_SENS (pruning by it) and WB (bfloat16
 * weights), M midpoints counted (mids padded with +inf to M), instantiated for each
 * combination below. */
INLINE Py_ssize_t partition_loop(const int HAS_SENS, const int BY_SENS, const int WB, const int M,
                                 const void *restrict w, const float *restrict sens, Py_ssize_t n, float tm,
                                 float ts, float tp, int prune, const float *restrict mids,
                                 uint8_t *restrict codes) {
    Py_ssize_t nprot = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const float x = weight_at(WB, w, i), a = fabsf(x), s = HAS_SENS ? sens[i] : 0.0f;
        const int protect = HAS_SENS ? (a > tm) | (s > ts) : a > tm;
        const float m = BY_SENS ? s : a;
        const int pruned = prune & ((m < tp) | (m == 0.0f));
        int c = 2;
#pragma GCC unroll 32
        for (int k = 0; k < M; k++) c += mids[k] < x;
        codes[i] = (uint8_t)(protect + (1 - protect) * (1 - pruned) * c); /* 1, else 0, else c */
        nprot += protect;
    }
    return nprot;
}

#define PARTITION_LOOPS_OF(M, WB, NAME)                                                                       \
    SIMD_CLONES static Py_ssize_t NAME(int has_sens, int by_sens, const void *w, const float *sens, Py_ssize_t n, \
                                       float tm, float ts, float tp, int prune, const float *mids, uint8_t *codes) { \
        if (!has_sens) return partition_loop(0, 0, WB, M, w, sens, n, tm, ts, tp, prune, mids, codes);           \
        if (!by_sens) return partition_loop(1, 0, WB, M, w, sens, n, tm, ts, tp, prune, mids, codes);            \
        return partition_loop(1, 1, WB, M, w, sens, n, tm, ts, tp, prune, mids, codes);                          \
    }
#define PARTITION_LOOPS(M) PARTITION_LOOPS_OF(M, 0, partition_##M) PARTITION_LOOPS_OF(M, 1, partition_bf16_##M)
PARTITION_LOOPS(3)
PARTITION_LOOPS(7)
PARTITION_LOOPS(15)
PARTITION_LOOPS(31)

/* The partition with AVX-512 where the CPU has it, 16 values at a time: the midpoints below a
 * value are counted by a search by halves in registers (the midpoints, padded with +inf to 64,
 * permuted to each value's next probe), log2(M + 1) steps instead of M comparisons. The codes
 * are those of partition_loop (tested against the same rules both ways). Returns the protected
 * count of the values done, *done (a multiple of 16) the values done. */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 7) || (!defined(__clang__) && __GNUC__ >= 8))
#include <immintrin.h>
#define PARTITION_SIMD 1
#define AVX512F __attribute__((target("avx512f,popcnt")))

INLINE AVX512F Py_ssize_t partition_avx512(const int HAS_SENS, const int BY_SENS, const int WB, const int STEPS,
                                         const void *restrict w, const float *restrict sens, Py_ssize_t n, float tm,
                                         float ts, float tp, int prune, const float *restrict padded,
                                         uint8_t *restrict codes, Py_ssize_t *done) {
    const __m512 t0 = _mm512_loadu_ps(padded), t1 = _mm512_loadu_ps(padded + 16);
    const __m512 t2 = _mm512_loadu_ps(padded + 32), t3 = _mm512_loadu_ps(padded + 48);
    const __m512 vtm = _mm512_set1_ps(tm), vts = _mm512_set1_ps(ts), vtp = _mm512_set1_ps(tp), zero = _mm512_setzero_ps();
    const __m512i two = _mm512_set1_epi32(2), one = _mm512_set1_epi32(1);
    Py_ssize_t nprot = 0, i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 x = WB ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i))), 16))
                            : _mm512_loadu_ps((const float *)w + i);
        const __m512 a = _mm512_abs_ps(x);
        __mmask16 protect = _mm512_cmp_ps_mask(a, vtm, _CMP_GT_OQ);
        __m512 m = a;
        if (HAS_SENS) {
            const __m512 s = _mm512_loadu_ps(sens + i);
            protect |= _mm512_cmp_ps_mask(s, vts, _CMP_GT_OQ);
            if (BY_SENS) m = s;
        }
        const __mmask16 pruned =
            prune ? _mm512_cmp_ps_mask(m, vtp, _CMP_LT_OQ) | _mm512_cmp_ps_mask(m, zero, _CMP_EQ_OQ) : 0;
        __m512i lo = _mm512_setzero_si512(); /* midpoints below x: padded[lo + step - 1] < x adds step */
#pragma GCC unroll 6
        for (int k = STEPS - 1; k >= 0; k--) {
            const __m512i at = _mm512_add_epi32(lo, _mm512_set1_epi32((1 << k) - 1));
            __m512 probe;
            if (STEPS <= 4)
                probe = _mm512_permutexvar_ps(at, t0);
            else if (STEPS == 5)
                probe = _mm512_permutex2var_ps(t0, at, t1);
            else /* (the first of 64 entries, or the second 32: bit 5 of the index) */
                probe = _mm512_mask_blend_ps(_mm512_test_epi32_mask(at, _mm512_set1_epi32(32)),
                                             _mm512_permutex2var_ps(t0, at, t1), _mm512_permutex2var_ps(t2, at, t3));
            lo = _mm512_mask_add_epi32(lo, _mm512_cmp_ps_mask(probe, x, _CMP_LT_OQ), lo, _mm512_set1_epi32(1 << k));
        }
        __m512i c = _mm512_maskz_add_epi32((__mmask16)~pruned, lo, two); /* 0 where pruned */
        c = _mm512_mask_mov_epi32(c, protect, one);
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(c));
        nprot += _mm_popcnt_u32(protect);
    }
    *done = i;
    return nprot;
}

#define PARTITION_AVX512(STEPS)                                                                                 \
    AVX512F static Py_ssize_t partition_avx512_##STEPS(int has_sens, int by_sens, int wb, const void *w,            \
                                                       const float *sens, Py_ssize_t n, float tm, float ts, float tp, \
                                                       int prune, const float *padded, uint8_t *codes,              \
                                                       Py_ssize_t *done) {                                         \
        if (wb) {                                                                                                    \
            if (!has_sens) return partition_avx512(0, 0, 1, STEPS, w, sens, n, tm, ts, tp, prune, padded, codes, done); \
            if (!by_sens) return partition_avx512(1, 0, 1, STEPS, w, sens, n, tm, ts, tp, prune, padded, codes, done);  \
            return partition_avx512(1, 1, 1, STEPS, w, sens, n, tm, ts, tp, prune, padded, codes, done);                \
        }                                                                                                            \
        if (!has_sens) return partition_avx512(0, 0, 0, STEPS, w, sens, n, tm, ts, tp, prune, padded, codes, done);     \
        if (!by_sens) return partition_avx512(1, 0, 0, STEPS, w, sens, n, tm, ts, tp, prune, padded, codes, done);      \
        return partition_avx512(1, 1, 0, STEPS, w, sens, n, tm, ts, tp, prune, padded, codes, done);                    \
    }
PARTITION_AVX512(2)
PARTITION_AVX512(3)
PARTITION_AVX512(4)
PARTITION_AVX512(5)
PARTITION_AVX512(6)

/* The partition with AVX2 where the CPU has it (and not AVX-512), 32 values at a time in four
 * vectors of 8: the midpoints (padded with +inf) are taken as G groups of S, the last of each
 * group a coarse midpoint. A value's group g is the count of coarse midpoints below it (G - 1
 * compares, the midpoints being sorted), and its count 4g plus that of its group's other S - 1
 * midpoints below it, each a permute of a table (a midpoint of each group, 8 entries) by g and
 * a compare: for 31 midpoints 7 + 3 compares where counting them all takes 31 (G = 1 counts
 * them all, the tables then one midpoint each). NaN is below none, so its count is 0, as in the
 * loops above. On a Zen 1 EPYC (no AVX-512): 0.46, 0.66, 1.0, 1.3 and 2.1 ns a value for 3, 7,
 * 15, 31 and 63 midpoints, against 1.3, 2.0, 3.4, 6.4 for the loops the compiler vectorises and
 * 5.0 for the look-up by top bits. */
#define AVX2_ATTR __attribute__((target("avx2,popcnt")))

INLINE AVX2_ATTR Py_ssize_t partition_avx2(const int HAS_SENS, const int BY_SENS, const int WB, const int S,
                                           const int G, const void *restrict w, const float *restrict sens,
                                           Py_ssize_t n, float tm, float ts, float tp, int prune,
                                           const float *restrict padded, uint8_t *restrict codes, Py_ssize_t *done) {
    __m256 coarse[8], table[7];
    for (int j = 0; j + 1 < G; j++) coarse[j] = _mm256_set1_ps(padded[S * j + S - 1]);
    for (int f = 0; f + 1 < S; f++) {
        float t[8];
        for (int g = 0; g < 8; g++) t[g] = g < G ? padded[S * g + f] : INFINITY;
        table[f] = G == 1 ? _mm256_set1_ps(t[0]) : _mm256_loadu_ps(t);
    }
    const __m256 vtm = _mm256_set1_ps(tm), vts = _mm256_set1_ps(ts), vtp = _mm256_set1_ps(tp), zero = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i one = _mm256_set1_epi32(1), two = _mm256_set1_epi32(2), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    Py_ssize_t nprot = 0, i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i c4[4];
        for (int q = 0; q < 4; q++) {
            const Py_ssize_t at = i + 8 * q;
            const __m256 x = WB ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + at))), 16))
                                : _mm256_loadu_ps((const float *)w + at);
            const __m256 a = _mm256_and_ps(x, magnitude);
            __m256 protect = _mm256_cmp_ps(a, vtm, _CMP_GT_OQ), m = a;
            if (HAS_SENS) {
                const __m256 s = _mm256_loadu_ps(sens + at);
                protect = _mm256_or_ps(protect, _mm256_cmp_ps(s, vts, _CMP_GT_OQ));
                if (BY_SENS) m = s;
            }
            __m256i g = _mm256_setzero_si256(); /* (compares give -1 where true) */
            for (int j = 0; j + 1 < G; j++) g = _mm256_sub_epi32(g, _mm256_castps_si256(_mm256_cmp_ps(coarse[j], x, _CMP_LT_OQ)));
            __m256i c = _mm256_add_epi32(_mm256_mullo_epi32(g, _mm256_set1_epi32(S)), two);
            for (int f = 0; f + 1 < S; f++) {
                const __m256 probe = G == 1 ? table[f] : _mm256_permutevar8x32_ps(table[f], g);
                c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(probe, x, _CMP_LT_OQ)));
            }
            if (prune) {
                const __m256 pruned = _mm256_or_ps(_mm256_cmp_ps(m, vtp, _CMP_LT_OQ), _mm256_cmp_ps(m, zero, _CMP_EQ_OQ));
                c = _mm256_andnot_si256(_mm256_castps_si256(pruned), c); /* 0 where pruned */
            }
            c4[q] = _mm256_blendv_epi8(c, one, _mm256_castps_si256(protect));
            nprot += _mm_popcnt_u32((unsigned)_mm256_movemask_ps(protect));
        }
        const __m256i lo = _mm256_packs_epi32(c4[0], c4[1]), hi = _mm256_packs_epi32(c4[2], c4[3]);
        _mm256_storeu_si256((__m256i *)(codes + i), _mm256_permutevar8x32_epi32(_mm256_packus_epi16(lo, hi), order));
    }
    *done = i;
    return nprot;
}

#define PARTITION_AVX2(S, G)                                                                                     \
    AVX2_ATTR static Py_ssize_t partition_avx2_##S##_##G(int has_sens, int by_sens, int wb, const void *w,        \
                                                         const float *sens, Py_ssize_t n, float tm, float ts,     \
                                                         float tp, int prune, const float *padded, uint8_t *codes, \
                                                         Py_ssize_t *done) {                                      \
        if (wb) {                                                                                                 \
            if (!has_sens) return partition_avx2(0, 0, 1, S, G, w, sens, n, tm, ts, tp, prune, padded, codes, done); \
            if (!by_sens) return partition_avx2(1, 0, 1, S, G, w, sens, n, tm, ts, tp, prune, padded, codes, done);  \
            return partition_avx2(1, 1, 1, S, G, w, sens, n, tm, ts, tp, prune, padded, codes, done);                \
        }                                                                                                         \
        if (!has_sens) return partition_avx2(0, 0, 0, S, G, w, sens, n, tm, ts, tp, prune, padded, codes, done);     \
        if (!by_sens) return partition_avx2(1, 0, 0, S, G, w, sens, n, tm, ts, tp, prune, padded, codes, done);      \
        return partition_avx2(1, 1, 0, S, G, w, sens, n, tm, ts, tp, prune, padded, codes, done);                    \
    }
PARTITION_AVX2(4, 1) /* 3 midpoints, all counted */
PARTITION_AVX2(8, 1) /* 7 */
PARTITION_AVX2(4, 4) /* 15 */
PARTITION_AVX2(4, 8) /* 31 */
PARTITION_AVX2(8, 8) /* 63 */
#endif

/* The partition of n weights w (float32, or bfloat16 bits with wb), with their sensitivities
 * sens (float32, or NULL). */
static Py_ssize_t partition(const void *w, int wb, const float *sens, Py_ssize_t n, double tau_mag, double tau_sens,
                            double tau_prune, int prune_by_sens, const float *mids, Py_ssize_t nmids, uint8_t *codes) {
    const float tm = f32_at_most(tau_mag), ts = f32_at_most(tau_sens), tp = f32_at_least(tau_prune);
    const int prune = tau_prune >= 0, has_sens = sens != NULL, by_sens = prune_by_sens && has_sens;
    const size_t size = wb ? 2 : 4;
    float padded[SIMD_MIDS + 1];
    for (Py_ssize_t k = 0; k <= SIMD_MIDS; k++) padded[k] = k < nmids ? mids[k] : INFINITY;
    Py_ssize_t done = 0, nprot = 0;
#ifdef PARTITION_SIMD
    Py_ssize_t (*simd)(int, int, int, const void *, const float *, Py_ssize_t, float, float, float, int, const float *,
                       uint8_t *, Py_ssize_t *) = NULL;
    const int paths = nmids <= SIMD_MIDS ? dq_simd_paths() : 0;
    if (paths & DQ_AVX512F)
        simd = nmids <= 3    ? partition_avx512_2
               : nmids <= 7  ? partition_avx512_3
               : nmids <= 15 ? partition_avx512_4
               : nmids <= 31 ? partition_avx512_5
                             : partition_avx512_6;
    else if (paths & DQ_AVX2)
        simd = nmids <= 3    ? partition_avx2_4_1
               : nmids <= 7  ? partition_avx2_8_1
               : nmids <= 15 ? partition_avx2_4_4
               : nmids <= 31 ? partition_avx2_4_8
                             : partition_avx2_8_8;
    if (simd != NULL) {
        nprot = simd(has_sens, by_sens, wb, w, sens, n, tm, ts, tp, prune, padded, codes, &done);
        if (done == n) return nprot;
        w = (const char *)w + done * size, sens = has_sens ? sens + done : NULL, n -= done, codes += done;
    }
#endif
    if (nmids <= SMALL_MIDS) {
        Py_ssize_t (*loop)(int, int, const void *, const float *, Py_ssize_t, float, float, float, int,
                           const float *, uint8_t *) =
            wb ? (nmids <= 3 ? partition_bf16_3 : nmids <= 7 ? partition_bf16_7 : nmids <= 15 ? partition_bf16_15
                                                                                              : partition_bf16_31)
               : (nmids <= 3 ? partition_3 : nmids <= 7 ? partition_7 : nmids <= 15 ? partition_15 : partition_31);
        return nprot + loop(has_sens, by_sens, w, sens, n, tm, ts, tp, prune, padded, codes);
    }
    /* below[b]: how many midpoints lie below the least value whose order key (the float's bits,
     * flipped so that the keys sort as the values do) has top 16 bits b. Every value of that bucket
     * is at least that one and below the next bucket's least, so it has from below[b] to
     * below[b + 1] midpoints below it: `steps`, the most any bucket spans, compares against the
     * midpoints from below[b] on (padded with +inf) count the rest without a branch (a bucket
     * spans under 1% of a value's magnitude: a step or two). NaN counts none, as in the loops
     * above. (nmids <= 253: a count fits a byte.) */
    uint8_t *below = malloc((1 << 16) + (size_t)(nmids + 1) * sizeof(float)); /* (lo never passes nmids) */
    if (below == NULL) return -2;
    float *ordered = (float *)(below + (1 << 16));
    Py_ssize_t c = 0, steps = 0, last = 0;
    for (uint32_t b = 0; b < (1u << 16); b++) {
        const uint32_t key = b << 16, bits = key & 0x80000000u ? key ^ 0x80000000u : ~key;
        float least;
        memcpy(&least, &bits, 4);
        if (least == least)  /* (NaN patterns hold no value that is counted: 0, set below) */
            while (c < nmids && mids[c] < least) c++;
        below[b] = (uint8_t)c;
        steps = c - last > steps ? c - last : steps;
        last = c;
    }
    steps = nmids - last > steps ? nmids - last : steps;
    for (Py_ssize_t k = 0; k <= nmids; k++) ordered[k] = k < nmids ? mids[k] : INFINITY;
    for (Py_ssize_t i = 0; i < n; i++) {
        const float x = weight_at(wb, w, i), a = fabsf(x), s = has_sens ? sens[i] : 0.0f;
        if (a > tm || (has_sens && s > ts)) { codes[i] = 1; nprot++; continue; }
        const float m = by_sens ? s : a;
        if (prune && (m < tp || m == 0.0f)) { codes[i] = 0; continue; }
        uint32_t bits;
        memcpy(&bits, &x, 4);
        const uint32_t key = bits & 0x80000000u ? ~bits : bits ^ 0x80000000u;
        Py_ssize_t lo = x == x ? below[key >> 16] : 0; /* (NaN: in +inf's bucket, or a NaN one) */
        for (Py_ssize_t k = 0; k < steps; k++) lo += ordered[lo] < x;
        codes[i] = (uint8_t)(2 + lo);
    }
    free(below);
    return nprot;
}

PyObject *py_partition(PyObject *self, PyObject *args) {
    Py_buffer w, sens, mids, codes;
    double tau_mag, tau_sens, tau_prune;
    int prune_by_sens, has_sens, wb;
    if (!PyArg_ParseTuple(args, "y*py*pdddpy*w*", &w, &wb, &sens, &has_sens, &tau_mag, &tau_sens, &tau_prune,
                          &prune_by_sens, &mids, &codes))
        return NULL;
    Py_ssize_t n = w.len / (wb ? 2 : 4), nprot = -1;
    if (w.len % (wb ? 2 : 4) || codes.len != n || (has_sens && sens.len != n * 4) || mids.len / 4 > 253)
        PyErr_SetString(PyExc_ValueError, "partition: buffers disagree in length or too many centres");
    else {
        Py_BEGIN_ALLOW_THREADS
        nprot = partition(w.buf, wb, has_sens ? sens.buf : NULL, n, tau_mag, tau_sens, tau_prune, prune_by_sens,
                          mids.buf, mids.len / 4, codes.buf);
        Py_END_ALLOW_THREADS
        if (nprot < 0) PyErr_NoMemory();
    }
    PyBuffer_Release(&w); PyBuffer_Release(&sens); PyBuffer_Release(&mids); PyBuffer_Release(&codes);
    return nprot < 0 ? NULL : PyLong_FromSsize_t(nprot);
}

/* The values (of `size` bytes: float32, or bfloat16 bits) whose code is `code`, in order, into
 * out (quantizer.py's quantize: the protected values a partition found): returns how many there
 * are, or -1 when out cannot hold them all (then out holds the first ones). memchr finds the
 * rare codes, as in dequantize_u8. */
static Py_ssize_t select_u8(const uint8_t *codes, Py_ssize_t n, uint8_t code, const char *values, size_t size,
                            char *out, Py_ssize_t cap) {
    Py_ssize_t j = 0;
    const uint8_t *c = codes, *end = codes + n;
    while ((c = memchr(c, code, (size_t)(end - c))) != NULL) {
        if (j == cap) return -1;
        memcpy(out + (size_t)j++ * size, values + (size_t)(c - codes) * size, size);
        c++;
    }
    return j;
}
PyObject *py_select_u8(PyObject *self, PyObject *args) {
    Py_buffer codes, values, out;
    int code;
    if (!PyArg_ParseTuple(args, "y*iy*w*", &codes, &code, &values, &out)) return NULL;
    Py_ssize_t found = -2;
    const Py_ssize_t size = codes.len ? values.len / codes.len : 4;
    if (codes.len == 0 && values.len == 0 && code >= 0 && code <= 255)
        found = 0; /* (no values: nothing to select, whatever their size) */
    else if ((size != 2 && size != 4) || values.len != codes.len * size || code < 0 || code > 255 || out.len % size)
        PyErr_SetString(PyExc_ValueError, "select: values must be of 2 or 4 bytes, one per code, and code 0..255");
    else {
        Py_BEGIN_ALLOW_THREADS
        found = select_u8(codes.buf, codes.len, (uint8_t)code, values.buf, (size_t)size, out.buf, out.len / size);
        Py_END_ALLOW_THREADS
        if (found < 0) PyErr_SetString(PyExc_ValueError, "select: more values hold the code than out holds");
    }
    PyBuffer_Release(&codes); PyBuffer_Release(&values); PyBuffer_Release(&out);
    return found < 0 ? NULL : PyLong_FromSsize_t(found);
}

/* Float32 values of codes (quantizer.py, dequantize and decoded_values): 0 for a pruned code,
 * the next stored bfloat16 value (in order) for a protected one, table[code] otherwise (the
 * table being 0, 0, then the centres), plus ref[i] when a reference is given. Returns the
 * number of protected codes (values past the stored ones read as 0; the caller refuses a
 * count that differs), or -1 when a code lies beyond the table (out is then not written).
 * Three plain loops (the largest code, the table look-up, the protected values in order) run
 * several times faster than one loop carrying the protected values' running index. */
static Py_ssize_t dequantize_u8(const uint8_t *codes, Py_ssize_t n, const float *table, Py_ssize_t ntable,
                                const uint16_t *prot, Py_ssize_t nprot, const float *ref, float *out) {
    uint8_t top = 0;
    for (Py_ssize_t i = 0; i < n; i++) top = codes[i] > top ? codes[i] : top;
    if (n && top >= ntable) return -1;
    if (ref)
        for (Py_ssize_t i = 0; i < n; i++) out[i] = table[codes[i]] + ref[i];
    else
        for (Py_ssize_t i = 0; i < n; i++) out[i] = table[codes[i]];
    Py_ssize_t j = 0;
    const uint8_t *c = codes, *end = codes + n;
    while ((c = memchr(c, 1, (size_t)(end - c))) != NULL) { /* the protected codes, in order */
        const Py_ssize_t i = c - codes;
        uint32_t bits = j < nprot ? (uint32_t)prot[j] << 16 : 0;
        float v;
        memcpy(&v, &bits, 4);
        out[i] = ref ? v + ref[i] : v;
        j++;
        c++;
    }
    return j;
}

PyObject *py_dequantize_u8(PyObject *self, PyObject *args) {
    Py_buffer codes, table, prot, ref, out;
    int has_ref;
    if (!PyArg_ParseTuple(args, "y*y*y*y*pw*", &codes, &table, &prot, &ref, &has_ref, &out)) return NULL;
    Py_ssize_t n = codes.len, used = -2;
    if (out.len != 4 * n || (has_ref && ref.len != 4 * n) || table.len / 4 > 256)
        PyErr_SetString(PyExc_ValueError, "dequantize: buffers disagree in length or too large a table");
    else {
        Py_BEGIN_ALLOW_THREADS
        used = dequantize_u8(codes.buf, n, table.buf, table.len / 4, prot.buf, prot.len / 2,
                             has_ref ? ref.buf : NULL, out.buf);
        Py_END_ALLOW_THREADS
        if (used < 0) PyErr_SetString(PyExc_ValueError, "a code lies beyond the stored centres");
    }
    PyBuffer_Release(&codes); PyBuffer_Release(&table); PyBuffer_Release(&prot); PyBuffer_Release(&ref);
    PyBuffer_Release(&out);
    return used < 0 ? NULL : PyLong_FromSsize_t(used);
}

/* Float32 rounded to bfloat16 and back, to nearest even (as torch converts finite values). */
static float bf16_round(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits += 0x7FFF + ((bits >> 16) & 1);
    bits &= 0xFFFF0000u;
    memcpy(&x, &bits, 4);
    return x;
}

/* One block of error feedback (feedback.py, GPTQ's lazy batch), columns stored one after the
 * other (block[k * rows + r] is row r of the block's column k, and so are sens, codes and
 * errors). Column j is partitioned and rounded as partition does (protected values to their
 * bfloat16, the rest to table[code]: 0, 0, then the centres); its error e = (w - q) / u[j][j]
 * goes to errors, and every later column k of the block takes w -= e * u[j][k]; the column is
 * left holding q. u is the block's b x b corner of the factor, row-major. With a trellis scratch
 * (16 * rows bytes; trellis.c), the values the partition gives a centre are rounded instead by the
 * trellis down the column, on the grid that table holds (first level c0, spacing step). */
static void feedback_block_f32(float *block, const float *sens, Py_ssize_t rows, Py_ssize_t b, const float *u,
                               double tau_mag, double tau_sens, double tau_prune, int prune_by_sens,
                               const float *mids, Py_ssize_t nmids, const float *table, uint8_t *codes,
                               float *errors, uint8_t *trellis, double c0, double step) {
    for (Py_ssize_t j = 0; j < b; j++) {
        float *col = block + j * rows, *err = errors + j * rows;
        uint8_t *code = codes + j * rows;
        partition(col, 0, sens ? sens + j * rows : NULL, rows, tau_mag, tau_sens, tau_prune, prune_by_sens, mids,
                  nmids, code);
        if (trellis) trellis_round_f32(col, rows, c0, step, table, nmids + 1, code, trellis);
        const float pivot = u[j * b + j];
        for (Py_ssize_t r = 0; r < rows; r++) {
            const float q = code[r] == 1 ? bf16_round(col[r]) : table[code[r]];
            err[r] = (col[r] - q) / pivot;
            col[r] = q;
        }
        for (Py_ssize_t k = j + 1; k < b; k++) {
            const float f = u[j * b + k];
            float *later = block + k * rows;
#pragma omp simd
            for (Py_ssize_t r = 0; r < rows; r++) later[r] -= err[r] * f;
        }
    }
}

PyObject *py_feedback_block_f32(PyObject *self, PyObject *args) {
    Py_buffer block, sens, u, mids, table, codes, errors;
    double tau_mag, tau_sens, tau_prune, c0 = 0.0, step = 0.0;
    int prune_by_sens, has_sens, trellis = 0;
    Py_ssize_t rows;
    if (!PyArg_ParseTuple(args, "w*y*pny*dddpy*y*w*w*|pdd", &block, &sens, &has_sens, &rows, &u, &tau_mag, &tau_sens,
                          &tau_prune, &prune_by_sens, &mids, &table, &codes, &errors, &trellis, &c0, &step))
        return NULL;
    const Py_ssize_t n = block.len / 4, b = rows > 0 ? n / rows : 0;
    int ok = rows > 0 && b * rows == n && codes.len == n && errors.len == block.len && u.len == 4 * b * b &&
             (!has_sens || sens.len == block.len) && mids.len / 4 <= 253 && table.len == mids.len + 12 &&
             (!trellis || (mids.len / 4 + 1 >= 4 && (mids.len / 4 + 1) % 4 == 0 && step > 0));
    uint8_t *scratch = NULL;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "feedback_block: buffers disagree in length or too many centres");
    else if (trellis && !(scratch = malloc((size_t)(16 * rows)))) {
        PyErr_NoMemory();
        ok = 0;
    } else {
        Py_BEGIN_ALLOW_THREADS
        feedback_block_f32(block.buf, has_sens ? sens.buf : NULL, rows, b, u.buf, tau_mag, tau_sens, tau_prune,
                           prune_by_sens, mids.buf, mids.len / 4, table.buf, codes.buf, errors.buf, scratch, c0, step);
        Py_END_ALLOW_THREADS
    }
    free(scratch);
    PyBuffer_Release(&block); PyBuffer_Release(&sens); PyBuffer_Release(&u); PyBuffer_Release(&mids);
    PyBuffer_Release(&table); PyBuffer_Release(&codes); PyBuffer_Release(&errors);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}
