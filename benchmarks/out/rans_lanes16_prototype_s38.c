/* session 38, measured and not kept: the AVX-512 rANS encoder in 8 lanes (one vector) and in 16 (two vectors, two
 * chains of states), against the plain loops in 4, 8 and 16 lanes, on the streams rans_streams_s38.py dumps
 * (DUMP=/tmp/s38/calls.bin). Build: gcc -O2 -march=x86-64 -o p rans_lanes16_prototype_s38.c. Checks each vector
 * encoder's words against the plain loops' for the same lanes, then times each. 16 lanes (a format extension)
 * was no faster than 8: the loop is bound by its instructions, not by the states' chains. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>
#define PRECISION 24
#define STATE_LOW ((uint64_t)1 << 32)
#define INLINE static inline __attribute__((always_inline))
typedef struct { uint64_t rcp, flush_from; uint32_t freq, left; } esym_t;
static void esym_init(esym_t *e, const uint32_t *c, int64_t k) {
    for (int64_t s = 0; s < k; s++) {
        const uint32_t freq = c[s + 1] - c[s];
        e[s].freq = freq; e[s].left = c[s];
        e[s].flush_from = (uint64_t)freq << (64 - PRECISION);
        e[s].rcp = freq == 1 ? UINT64_MAX : UINT64_MAX / freq + (UINT64_MAX % freq == freq - 1);
    }
}
INLINE void encode_symbol(uint64_t *st, uint32_t **at, const esym_t *restrict e) {
    uint64_t x = *st;
    if (x >= e->flush_from) { *(*at)++ = (uint32_t)x; x >>= 32; }
    uint64_t q = (uint64_t)(((unsigned __int128)x * e->rcp) >> 64);
    uint64_t r = x - q * e->freq;
    if (r >= e->freq) { q++; r -= e->freq; }
    *st = (q << PRECISION) | (e->left + r);
}
INLINE int64_t encode(const int L, const uint8_t *restrict sym, const uint32_t *cdf, const int64_t *cdf_off,
                         const int64_t *cdf_k, const int64_t *start, const int64_t *stop, int64_t n_groups, uint32_t **at) {
    uint64_t st[16]; esym_t e[256];
    for (int s = 0; s < 256; s++) e[s] = (esym_t){UINT64_MAX, (uint64_t)1 << (64 - PRECISION), 1, 0};
    for (int j = 0; j < L; j++) st[j] = 0;
    for (int64_t g = n_groups - 1; g >= 0; g--) {
        const int64_t a = start[g], b = stop[g], k = cdf_k[g];
        esym_init(e, cdf + cdf_off[g], k);
        unsigned past = 0;
        int64_t row = (b - 1) & ~(int64_t)(L - 1);
        for (; row > a - L && (row + L > b || row < a); row -= L)
            for (int j = L - 1; j >= 0; j--)
                if (row + j >= a && row + j < b) { past |= sym[row + j] >= k; encode_symbol(&st[j], &at[j], &e[sym[row + j]]); }
        for (; row >= a; row -= L)
#pragma GCC unroll 16
            for (int j = L - 1; j >= 0; j--) { past |= sym[row + j] >= k; encode_symbol(&st[j], &at[j], &e[sym[row + j]]); }
        for (; row > a - L; row -= L)
            for (int j = L - 1; j >= 0; j--)
                if (row + j >= a) { past |= sym[row + j] >= k; encode_symbol(&st[j], &at[j], &e[sym[row + j]]); }
        if (past) return g;
    }
    for (int j = 0; j < L; j++) {
        if (st[j] >= STATE_LOW) { *at[j]++ = (uint32_t)st[j]; *at[j]++ = (uint32_t)(st[j] >> 32); }
        else if (st[j] > 0) *at[j]++ = (uint32_t)st[j];
    }
    return -1;
}
static int64_t encode_4(const uint8_t *s, const uint32_t *c, const int64_t *o, const int64_t *k, const int64_t *a, const int64_t *b, int64_t n, uint32_t **at) { return encode(4, s, c, o, k, a, b, n, at); }
static int64_t encode_16(const uint8_t *s, const uint32_t *c, const int64_t *o, const int64_t *k, const int64_t *a, const int64_t *b, int64_t n, uint32_t **at) { return encode(16, s, c, o, k, a, b, n, at); }
static int64_t encode_8(const uint8_t *s, const uint32_t *c, const int64_t *o, const int64_t *k, const int64_t *a, const int64_t *b, int64_t n, uint32_t **at) { return encode(8, s, c, o, k, a, b, n, at); }

#define AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))
typedef struct { __m512i fl0, fl1; __m512d inv0, inv1; const uint64_t *fl; const double *inv; int small; } tab_t;
AVX512 INLINE void step(__m512i *xp, __m512i *ptr, __m512i idx, __mmask8 act, const tab_t *t) {
    __m512i x = *xp, e; __m512d r_inv;
    if (t->small) { e = _mm512_permutex2var_epi64(t->fl0, idx, t->fl1); r_inv = _mm512_permutex2var_pd(t->inv0, idx, t->inv1); }
    else { e = _mm512_i64gather_epi64(idx, t->fl, 8); r_inv = _mm512_i64gather_pd(idx, t->inv, 8); }
    const __m512i freq = _mm512_and_si512(e, _mm512_set1_epi64(0xffffffff)), left = _mm512_srli_epi64(e, 32);
    const __mmask8 fm = _mm512_mask_cmpge_epu64_mask(act, x, _mm512_slli_epi64(freq, 40));
    if (fm) {
        _mm512_mask_i64scatter_epi32(NULL, fm, *ptr, _mm512_cvtepi64_epi32(x), 1);
        *ptr = _mm512_mask_add_epi64(*ptr, fm, *ptr, _mm512_set1_epi64(4));
        x = _mm512_mask_srli_epi64(x, fm, x, 32);
    }
    __m512i q = _mm512_cvttpd_epu64(_mm512_mul_pd(_mm512_cvtepu64_pd(x), r_inv));
    const __m512i r = _mm512_sub_epi64(x, _mm512_mullo_epi64(q, freq));
    const __mmask8 wrong = _mm512_mask_cmpge_epu64_mask(act, r, freq);
    if (__builtin_expect(wrong != 0, 0)) {
        const __mmask8 neg = _mm512_cmplt_epi64_mask(r, _mm512_setzero_si512());
        q = _mm512_mask_sub_epi64(q, neg, q, _mm512_set1_epi64(1));
        q = _mm512_mask_add_epi64(q, wrong & ~neg, q, _mm512_set1_epi64(1));
    }
    const __m512i gap = _mm512_sub_epi64(_mm512_set1_epi64(1 << PRECISION), freq);
    *xp = _mm512_mask_add_epi64(x, act, _mm512_add_epi64(x, left), _mm512_mullo_epi64(q, gap));
}
AVX512 INLINE int64_t encode_simd(const int NV, const uint8_t *restrict sym, const uint32_t *cdf, const int64_t *cdf_off,
                         const int64_t *cdf_k, const int64_t *start, const int64_t *stop, int64_t n_groups, uint32_t **at) {
    const int L = 8 * NV;
    uint64_t fl[256] __attribute__((aligned(64)));
    double inv[256] __attribute__((aligned(64)));
    for (int s = 0; s < 256; s++) { fl[s] = 1; inv[s] = 1.0; }
    __m512i x[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, ptr[2];
    for (int v = 0; v < NV; v++) ptr[v] = _mm512_loadu_si512((const void *)(at + 8 * v));
    const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    __mmask8 past = 0;
    tab_t t; t.fl = fl; t.inv = inv;
    for (int64_t g = n_groups - 1; g >= 0; g--) {
        const int64_t a = start[g], b = stop[g], k = cdf_k[g];
        const uint32_t *c = cdf + cdf_off[g];
        for (int64_t s = 0; s < k; s++) { const uint32_t f = c[s + 1] - c[s]; fl[s] = f | (uint64_t)c[s] << 32; inv[s] = 1.0 / (double)f; }
        const __m512i kv = _mm512_set1_epi64(k);
        t.small = k <= 16;
        t.fl0 = _mm512_load_si512(fl); t.fl1 = _mm512_load_si512(fl + 8); t.inv0 = _mm512_load_pd(inv); t.inv1 = _mm512_load_pd(inv + 8);
        int64_t row = (b - 1) & ~(int64_t)(L - 1);
        for (; row > a - L; row -= L) {
            const int whole = row >= a && row + L <= b;
            for (int v = NV - 1; v >= 0; v--) {
                const int64_t p = row + 8 * v;
                __mmask8 act; __m512i idx;
                if (whole) { act = 0xff; idx = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(sym + p))); }
                else {
                    const __m512i pos = _mm512_add_epi64(_mm512_set1_epi64(p), lane);
                    act = _mm512_cmpge_epi64_mask(pos, _mm512_set1_epi64(a)) & _mm512_cmplt_epi64_mask(pos, _mm512_set1_epi64(b));
                    idx = act ? _mm512_maskz_cvtepu8_epi64(act, _mm_maskz_loadu_epi8((__mmask16)act, sym + (act ? p : 0))) : _mm512_setzero_si512();
                    if (!act) continue;
                }
                past |= _mm512_mask_cmpge_epu64_mask(act, idx, kv);
                step(&x[v], &ptr[v], idx, act, &t);
            }
        }
        if (past) return g;
    }
    uint64_t st[16];
    for (int v = 0; v < NV; v++) { _mm512_storeu_si512((void *)(at + 8 * v), ptr[v]); _mm512_storeu_si512(st + 8 * v, x[v]); }
    for (int j = 0; j < L; j++) {
        if (st[j] >= STATE_LOW) { *at[j]++ = (uint32_t)st[j]; *at[j]++ = (uint32_t)(st[j] >> 32); }
        else if (st[j] > 0) *at[j]++ = (uint32_t)st[j];
    }
    return -1;
}
AVX512 static int64_t encode_8_simd(const uint8_t *s, const uint32_t *c, const int64_t *o, const int64_t *k, const int64_t *a, const int64_t *b, int64_t n, uint32_t **at) { return encode_simd(1, s, c, o, k, a, b, n, at); }
AVX512 static int64_t encode_16_simd(const uint8_t *s, const uint32_t *c, const int64_t *o, const int64_t *k, const int64_t *a, const int64_t *b, int64_t n, uint32_t **at) { return encode_simd(2, s, c, o, k, a, b, n, at); }

typedef struct { int64_t len[6]; void *p[6]; } call_t;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
typedef int64_t (*fn_t)(const uint8_t *, const uint32_t *, const int64_t *, const int64_t *, const int64_t *, const int64_t *, int64_t, uint32_t **);
static int64_t run(fn_t fn, int L, call_t *c, uint32_t **buf, int64_t *cnt) {
    uint32_t *at[16]; int64_t ns = c->len[0];
    for (int j = 0; j < L; j++) buf[j] = at[j] = malloc(((ns - j + L - 1) / L + 2) * 4);
    int64_t r = fn(c->p[0], c->p[1], c->p[2], c->p[3], c->p[4], c->p[5], c->len[4] / 8, at);
    for (int j = 0; j < L; j++) cnt[j] = at[j] - buf[j];
    return r;
}
int main(void) {
    FILE *f = fopen("/tmp/s38/calls.bin", "rb"); int64_t n; fread(&n, 8, 1, f);
    call_t *cs = calloc(n, sizeof(call_t)); int64_t total = 0;
    for (int64_t i = 0; i < n; i++) for (int j = 0; j < 6; j++) { fread(&cs[i].len[j], 8, 1, f); cs[i].p[j] = malloc(cs[i].len[j] + 64); fread(cs[i].p[j], 1, cs[i].len[j], f); }
    for (int64_t i = 0; i < n; i++) total += cs[i].len[0];
    fn_t ref[2] = {encode_8, encode_16}, sim[2] = {encode_8_simd, encode_16_simd};
    for (int w = 0; w < 2; w++) { int L = 8 << w; int64_t bad = 0, words = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t *b1[16], *b2[16]; int64_t c1[16], c2[16];
        bad += run(ref[w], L, &cs[i], b1, c1) >= 0; bad += run(sim[w], L, &cs[i], b2, c2) >= 0;
        for (int j = 0; j < L; j++) { words += c1[j]; if (c1[j] != c2[j] || memcmp(b1[j], b2[j], c1[j] * 4)) bad += 1000; free(b1[j]); free(b2[j]); }
    }
    printf("L=%d mismatches %ld, bytes %ld\n", L, bad, words * 4); }
    const char *names[] = {"scalar4", "scalar8", "scalar16", "simd8", "simd16"}; fn_t fns[] = {encode_4, encode_8, encode_16, encode_8_simd, encode_16_simd}; int lanes[] = {4, 8, 16, 8, 16};
    for (int rep = 0; rep < 2; rep++)
    for (int v = 0; v < 5; v++) {
        double t0 = now();
        for (int64_t i = 0; i < n; i++) { uint32_t *b[16]; int64_t c[16]; run(fns[v], lanes[v], &cs[i], b, c); for (int j = 0; j < lanes[v]; j++) free(b[j]); }
        double dt = now() - t0;
        printf("%s: %.3f s, %.2f ns/sym\n", names[v], dt, dt / total * 1e9);
    }
}
