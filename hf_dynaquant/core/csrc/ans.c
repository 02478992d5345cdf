#include "kernels.h"

/* rANS coding of uint8 symbols, bit for bit the streams of constriction 0.5's
 * stack::AnsCoder<u32 words, u64 state> with 24-bit probabilities (ans.py, FORMAT.md "rANS
 * streams"), with the GIL released. A stream holds consecutive groups of symbols, each with its
 * own model, given as a cumulative table cdf[0..k] (cdf[0] = 0, cdf[k] = 2^24, strictly
 * increasing; ans.py computes it exactly as constriction quantizes the group's probabilities).
 * The words form a stack: the encoder pushes, the decoder pops from the end, so the encoder
 * codes the last group's last symbol first.
 *
 * A stream is cut into L interleaved lanes (L = 1, 2, 4 or 8): the symbol at position i belongs
 * to lane i mod L, and each lane is a coder of its own (its own state and words). One state
 * codes one symbol after the other, each waiting on the last one's multiply; L states in one
 * loop overlap in the CPU. The lanes are walked in rows of L positions with a constant lane
 * index (the functions are instantiated for each L), so the compiler keeps the states in
 * registers. */

#define PRECISION 24
#define QMASK ((1u << PRECISION) - 1)
#define LOOKUP_BITS 12 /* a first guess of the symbol from the quantile's top 12 bits */
#define STATE_LOW ((uint64_t)1 << 32)
#define MAX_LANES 8

#define SLOT_BITS 11 /* the quantile's top 11 bits, where one symbol holds them all, give it outright */

/* A slot of quantiles (q >> (PRECISION - SLOT_BITS) equal) that one symbol covers whole: its
 * symbol with its frequency (freq_sym: frequency | symbol << 24) and its cumulative start, so
 * that decoding a symbol there takes one load, not the guess and then the table; freq_sym 0
 * marks a slot two symbols share, decoded the long way. */
typedef struct {
    uint32_t freq_sym, start;
} slot_t;

typedef struct {
    const uint32_t *cdf;          /* k + 1 entries */
    int k;                        /* symbols of the alphabet */
    uint8_t first[1 << LOOKUP_BITS]; /* the symbol of the quantile (q >> shift) << shift */
    slot_t slot[1 << SLOT_BITS];
    int64_t counts[MAX_LANES][256]; /* the decoder's histogram of the group, lane by lane */
} model_t;

static void model_init(model_t *m, const uint32_t *cdf, int k) {
    m->cdf = cdf;
    m->k = k;
    int s = 0;
    for (uint32_t i = 0; i < (1u << LOOKUP_BITS); i++) {
        const uint32_t q = i << (PRECISION - LOOKUP_BITS);
        while (s + 1 < k && cdf[s + 1] <= q) s++;
        m->first[i] = (uint8_t)s;
    }
    s = 0;
    for (uint32_t i = 0; i < (1u << SLOT_BITS); i++) {
        const uint32_t lo = i << (PRECISION - SLOT_BITS), hi = lo + (1u << (PRECISION - SLOT_BITS)) - 1;
        while (s + 1 < k && cdf[s + 1] <= lo) s++;
        /* (the last symbol's end is 2^24; a lone symbol's frequency, 2^24, takes the long way) */
        const uint32_t freq = cdf[s + 1] - cdf[s];
        const int whole = (s + 1 >= k || cdf[s + 1] > hi) && freq < (1u << PRECISION);
        m->slot[i].freq_sym = whole ? freq | (uint32_t)s << 24 : 0;
        m->slot[i].start = cdf[s];
    }
}

INLINE int model_symbol(const uint8_t *first, const uint32_t *cdf, int k, uint32_t q) {
    int s = first[q >> (PRECISION - LOOKUP_BITS)];
    while (s + 1 < k && cdf[s + 1] <= q) s++;
    return s;
}

static int valid_lanes(Py_ssize_t lanes) {
    if (lanes == 1 || lanes == 2 || lanes == 4 || lanes == 8) return 1;
    PyErr_Format(PyExc_ValueError, "rANS lanes must be 1, 2, 4 or 8, not %zd", lanes);
    return 0;
}

/* Whether the lanes' bounds into the words (lanes + 1 of them) are in order, inside n_words. */
static int lanes_fit(const int64_t *bound, Py_ssize_t lanes, Py_ssize_t n_words) {
    if (bound[0] < 0 || bound[lanes] > (int64_t)n_words) return 0;
    for (Py_ssize_t j = 0; j < lanes; j++)
        if (bound[j + 1] < bound[j]) return 0;
    return 1;
}

/* Whether n_groups groups and their tables fit what the kernels assume (ans.py always passes
 * such; a direct call may not): each group's alphabet of min_k to 256 symbols, its cumulative
 * table inside the cdf_n entries of cdf, from 0 to 2^24 and strictly increasing (every
 * frequency at least 1: the encoder divides by each), and the groups in order, apart, inside the
 * n symbols (a lane's buffers hold a word for each of its symbols, coded once). */
static int tables_fit(const uint32_t *cdf, Py_ssize_t cdf_n, const int64_t *off, const int64_t *k, const int64_t *start,
                      const int64_t *stop, Py_ssize_t n_groups, Py_ssize_t n, int64_t min_k) {
    int64_t end = 0;
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        const int64_t o = off[g], kg = k[g], a = start[g], b = stop[g];
        if (kg < min_k || kg > 256 || o < 0 || o > (int64_t)cdf_n - 1 - kg) return 0;
        if (a < end || b < a || b > (int64_t)n) return 0;
        end = b;
        const uint32_t *c = cdf + o;
        if (c[0] != 0 || c[kg] != (1u << PRECISION)) return 0;
        for (int64_t s = 0; s < kg; s++)
            if (c[s + 1] <= c[s]) return 0;
    }
    return 1;
}

/* One symbol of a lane: its state st, whose words are words[low..*top), with the model of
 * slot (the whole slots), first (the guesses), cdf and k (model_t's fields, passed as values so
 * that nothing is reloaded after each byte written). */
INLINE uint8_t decode_symbol(uint64_t *st, int64_t *top, int64_t low, const uint32_t *restrict words,
                             const slot_t *restrict slot, const uint8_t *restrict first,
                             const uint32_t *restrict cdf, int k) {
    const uint32_t q = (uint32_t)(*st & QMASK);
    const slot_t e = slot[q >> (PRECISION - SLOT_BITS)];
    int s;
    uint32_t freq, start;
    if (e.freq_sym) {
        s = (int)(e.freq_sym >> 24), freq = e.freq_sym & QMASK, start = e.start;
    } else {
        s = model_symbol(first, cdf, k, q), freq = cdf[s + 1] - cdf[s], start = cdf[s];
    }
    *st = (*st >> PRECISION) * (uint64_t)freq + (q - start);
    if (*st < STATE_LOW && *top > low) *st = (*st << 32) | words[--*top];
    return (uint8_t)s;
}

/* The decoder of a stream in L lanes: lane j's words are words[bound[j]..bound[j+1]). Groups
 * g = 0..n_groups-1 fill out[start[g]..stop[g]) with the model cdf + cdf_off[g] of k[g]
 * symbols, and hist[cdf_off[g] + s] with how many symbols s they decoded to (counted as they
 * are decoded, each lane apart: the check that a group decodes to its table's histogram then
 * costs no second pass over the symbols). Returns 1 when every lane ends empty (no words left,
 * state 0: a whole, undamaged stream), else 0. */
INLINE int decode(const int L, const uint32_t *restrict words, const int64_t *bound, const uint32_t *cdf,
                  const int64_t *cdf_off, const int64_t *k, const int64_t *start, const int64_t *stop,
                  Py_ssize_t n_groups, uint8_t *restrict out, int64_t *restrict hist, model_t *restrict model) {
    uint64_t st[MAX_LANES];
    int64_t (*cnt)[256] = model->counts;
    int64_t top[MAX_LANES];
    for (int j = 0; j < L; j++) {
        top[j] = bound[j + 1];
        st[j] = 0;
        if (top[j] > bound[j]) {
            st[j] = words[--top[j]];
            while (top[j] > bound[j]) {
                st[j] = (st[j] << 32) | words[--top[j]];
                if (st[j] >= STATE_LOW) break;
            }
        }
    }
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        model_init(model, cdf + cdf_off[g], (int)k[g]);
        const uint8_t *first = model->first;
        const slot_t *sl = model->slot;
        const uint32_t *c = model->cdf;
        const int kg = model->k;
        const int64_t a = start[g], b = stop[g];
        for (int j = 0; j < L; j++) memset(cnt[j], 0, (size_t)kg * sizeof(int64_t));
        int64_t row = a & ~(int64_t)(L - 1);
        for (; row < b && (row < a || row + L > b); row += L) /* rows the group begins or ends in */
            for (int j = 0; j < L; j++)
                if (row + j >= a && row + j < b)
                    cnt[j][out[row + j] = decode_symbol(&st[j], &top[j], bound[j], words, sl, first, c, kg)]++;
        for (; row + L <= b; row += L) /* whole rows: the lanes unrolled, their states in registers */
#pragma GCC unroll 8
            for (int j = 0; j < L; j++)
                cnt[j][out[row + j] = decode_symbol(&st[j], &top[j], bound[j], words, sl, first, c, kg)]++;
        for (; row < b; row += L) /* the last row */
            for (int j = 0; j < L; j++)
                if (row + j < b)
                    cnt[j][out[row + j] = decode_symbol(&st[j], &top[j], bound[j], words, sl, first, c, kg)]++;
        for (int s = 0; s < kg; s++) {
            int64_t total = 0;
            for (int j = 0; j < L; j++) total += cnt[j][s];
            hist[cdf_off[g] + s] = total;
        }
    }
    int empty = 1;
    for (int j = 0; j < L; j++) empty &= st[j] == 0 && top[j] == bound[j];
    return empty;
}

#define DECODE_ARGS const uint32_t *w, const int64_t *b, const uint32_t *cdf, const int64_t *off, const int64_t *k, \
                    const int64_t *start, const int64_t *stop, Py_ssize_t n, uint8_t *out, int64_t *h, model_t *m
static int decode_1(DECODE_ARGS) { return decode(1, w, b, cdf, off, k, start, stop, n, out, h, m); }
static int decode_2(DECODE_ARGS) { return decode(2, w, b, cdf, off, k, start, stop, n, out, h, m); }
static int decode_4(DECODE_ARGS) { return decode(4, w, b, cdf, off, k, start, stop, n, out, h, m); }
static int decode_8(DECODE_ARGS) { return decode(8, w, b, cdf, off, k, start, stop, n, out, h, m); }

/* ans_decode(words, lane_bounds, cdf, cdf_offsets, sizes, starts, stops, out, hist) -> every
 * lane ended empty; hist (int64, an entry per entry of cdf) gets each group's histogram */
PyObject *py_ans_decode(PyObject *self, PyObject *args) {
    Py_buffer words, bound, cdf, cdf_off, k, start, stop, out, hist;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*w*w*", &words, &bound, &cdf, &cdf_off, &k, &start, &stop, &out, &hist))
        return NULL;
    const Py_ssize_t n_groups = k.len / 8, lanes = bound.len / 8 - 1;
    int empty = -1;
    model_t *model = NULL;
    const int64_t *sizes = k.buf;
    int sizes_ok = 1;
    for (Py_ssize_t g = 0; g < n_groups; g++) sizes_ok &= sizes[g] >= 1 && sizes[g] <= 256;
    if (!sizes_ok)
        PyErr_SetString(PyExc_ValueError, "ans_decode: a group's alphabet is not of 1 to 256 symbols");
    else if (hist.len / 8 < cdf.len / 4)
        PyErr_SetString(PyExc_ValueError, "ans_decode: the histogram has fewer entries than the tables");
    else if (cdf_off.len != k.len || start.len != k.len || stop.len != k.len || lanes < 1 ||
             !lanes_fit(bound.buf, lanes, words.len / 4) ||
             !tables_fit(cdf.buf, cdf.len / 4, cdf_off.buf, k.buf, start.buf, stop.buf, n_groups, out.len, 1))
        PyErr_SetString(PyExc_ValueError, "ans_decode: tables, groups or lanes that do not fit the words and symbols");
    else if (valid_lanes(lanes) && (model = PyMem_RawMalloc(sizeof(model_t))) == NULL)
        PyErr_NoMemory();
    if (model != NULL) {
        int (*fn)(DECODE_ARGS) = lanes == 1 ? decode_1 : lanes == 2 ? decode_2 : lanes == 4 ? decode_4 : decode_8;
        Py_BEGIN_ALLOW_THREADS
        empty = fn(words.buf, bound.buf, cdf.buf, cdf_off.buf, k.buf, start.buf, stop.buf, n_groups, out.buf, hist.buf,
                   model);
        Py_END_ALLOW_THREADS
        PyMem_RawFree(model);
    }
    PyBuffer_Release(&words); PyBuffer_Release(&bound); PyBuffer_Release(&cdf); PyBuffer_Release(&cdf_off);
    PyBuffer_Release(&k); PyBuffer_Release(&start); PyBuffer_Release(&stop); PyBuffer_Release(&out);
    PyBuffer_Release(&hist);
    return empty < 0 ? NULL : PyBool_FromLong(empty);
}

/* A symbol of a group as the encoder uses it: its frequency and cumulative start, the state
 * from which pushing it first writes a word (freq << (64 - PRECISION)), and the reciprocal
 * floor(2^64 / freq) by which state / freq is made with a multiply: it underestimates the
 * quotient by at most one, which the remainder corrects (a 64-bit division took a sixth of the
 * time; the same quotient, so the same stream). Frequency 1's reciprocal, 2^64, does not fit:
 * 2^64 - 1 underestimates by one as well. Made for the group's symbols before its first one is
 * coded (made lazily, as each symbol first occurred, it cost a test on every symbol). */
typedef struct {
    uint64_t rcp, flush_from;
    uint32_t freq, left;
} esym_t;

static void esym_init(esym_t *e, const uint32_t *c, int64_t k) {
    for (int64_t s = 0; s < k; s++) {
        const uint32_t freq = c[s + 1] - c[s];
        e[s].freq = freq;
        e[s].left = c[s];
        e[s].flush_from = (uint64_t)freq << (64 - PRECISION);
        e[s].rcp = freq == 1 ? UINT64_MAX : UINT64_MAX / freq + (UINT64_MAX % freq == freq - 1);
    }
}

/* One symbol pushed onto a lane's state st and its words, which end at *at (the buffer has room
 * for a word a symbol, so no step checks it). */
INLINE void encode_symbol(uint64_t *st, uint32_t **at, const esym_t *restrict e) {
    uint64_t x = *st;
    if (x >= e->flush_from) {
        *(*at)++ = (uint32_t)x;
        x >>= 32;
    }
#ifdef __SIZEOF_INT128__
    uint64_t q = (uint64_t)(((unsigned __int128)x * e->rcp) >> 64);
    uint64_t r = x - q * e->freq;
    if (r >= e->freq) {
        q++;
        r -= e->freq;
    }
#else
    const uint64_t q = x / e->freq, r = x % e->freq;
#endif
    *st = (q << PRECISION) | (e->left + r);
}

/* Each lane's final state pushed as its last words, least significant first (none for a state of
 * 0, one below 2^32). */
INLINE void flush_states(const uint64_t *st, const int L, uint32_t **at) {
    for (int j = 0; j < L; j++) {
        if (st[j] >= STATE_LOW) {
            *at[j]++ = (uint32_t)st[j];
            *at[j]++ = (uint32_t)(st[j] >> 32);
        } else if (st[j] > 0) {
            *at[j]++ = (uint32_t)st[j];
        }
    }
}

/* The encoder of a stream in L lanes: the groups in reverse, each group's symbols in reverse,
 * each pushing words onto its lane's buffer (at[j], its end, advanced); then each lane's final
 * state's words, least significant first (none for a state of 0, one below 2^32). The states
 * and the lanes' ends are locals the unrolled loop keeps in registers. Returns a group holding
 * a symbol at or past its table's k (the last such: the stream is then not to be used), or -1. */
INLINE Py_ssize_t encode(const int L, const uint8_t *restrict sym, const uint32_t *cdf, const int64_t *cdf_off,
                         const int64_t *cdf_k, const int64_t *start, const int64_t *stop, Py_ssize_t n_groups,
                         uint32_t **at) {
    uint64_t st[MAX_LANES];
    esym_t e[256];
    for (int s = 0; s < 256; s++) /* symbols past a group's k: harmless values, refused below */
        e[s] = (esym_t){UINT64_MAX, (uint64_t)1 << (64 - PRECISION), 1, 0};
    for (int j = 0; j < L; j++) st[j] = 0;
    for (Py_ssize_t g = n_groups - 1; g >= 0; g--) {
        const int64_t a = start[g], b = stop[g], k = cdf_k[g];
        esym_init(e, cdf + cdf_off[g], k);
        unsigned past = 0; /* whether a symbol is at or past k: one compare a symbol, no branch */
        int64_t row = (b - 1) & ~(int64_t)(L - 1);
        for (; row > a - L && (row + L > b || row < a); row -= L) /* rows the group ends or begins in */
            for (int j = L - 1; j >= 0; j--)
                if (row + j >= a && row + j < b) {
                    past |= sym[row + j] >= k;
                    encode_symbol(&st[j], &at[j], &e[sym[row + j]]);
                }
        for (; row >= a; row -= L) /* whole rows: the lanes unrolled */
#pragma GCC unroll 8
            for (int j = L - 1; j >= 0; j--) {
                past |= sym[row + j] >= k;
                encode_symbol(&st[j], &at[j], &e[sym[row + j]]);
            }
        for (; row > a - L; row -= L) /* the first row */
            for (int j = L - 1; j >= 0; j--)
                if (row + j >= a) {
                    past |= sym[row + j] >= k;
                    encode_symbol(&st[j], &at[j], &e[sym[row + j]]);
                }
        if (past) return g;
    }
    flush_states(st, L, at);
    return -1;
}

/* The encoder of 8 lanes with AVX-512 (F, DQ, BW, VL) where the CPU has it: the 8 states in one
 * vector, a row of 8 symbols a step. The streams are encode(8, ...)'s, word for word (tested
 * both ways). A group's symbols are looked up in two tables of 256: freq | left << 32, and
 * 1 / freq as a double; from registers (permutes) at up to 64 symbols, else gathered.
 *
 * The quotient q = x / freq is made in double precision: after the flush x < freq * 2^40, so
 * q < 2^40, and the three roundings (x, 1 / freq, the product; 2^-53 each) leave the truncated
 * product within 1 of q. Its remainder r = x - q * freq is outside [0, freq) only then (one row
 * in about 25,000 of a 124M delta's, fixed on a branch the CPU predicts), and the new state
 * (q << 24) | (left + r) is made as x + left + q * (2^24 - freq), one multiply after q. Every
 * row stores each lane's low word at that lane's end and advances the end only where the lane
 * flushed (the word is then kept; elsewhere the next word written replaces it). A branch on
 * whether a row flushed, which depends on the data (a lane flushes once for each 32 bits it
 * codes), cost 1.70-1.73 ns a symbol on a 124M delta's streams where this takes 1.35-1.45; the
 * plain loops keep their branch (without it they took 2.59 ns against 2.32). The stored word is
 * inside the lane's buffer, which has room for a word a symbol and two more. */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 7) || (!defined(__clang__) && __GNUC__ >= 8))
#include <immintrin.h>
#define ANS_SIMD 1
#define AVX512DQ __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))

typedef struct {
    __m512i fl[8], inv[8]; /* (1 / freq's bits) */
} lookup_t; /* a group's tables in registers: up to 64 symbols */

/* Entries idx (each below 64) of a table of 64 in registers t[0..7], at k symbols: bits 4 and 5
 * of the index pick the pair of registers (only the pairs the table reaches are read). */
AVX512DQ INLINE __m512i in_registers(__m512i idx, int64_t k, const __m512i *t) {
    const __m512i low = _mm512_permutex2var_epi64(t[0], idx, t[1]);
    if (k <= 16) return low;
    const __mmask8 b4 = _mm512_test_epi64_mask(idx, _mm512_set1_epi64(16));
    const __m512i below = _mm512_mask_blend_epi64(b4, low, _mm512_permutex2var_epi64(t[2], idx, t[3]));
    if (k <= 32) return below;
    const __m512i above = _mm512_mask_blend_epi64(b4, _mm512_permutex2var_epi64(t[4], idx, t[5]),
                                                  _mm512_permutex2var_epi64(t[6], idx, t[7]));
    return _mm512_mask_blend_epi64(_mm512_test_epi64_mask(idx, _mm512_set1_epi64(32)), below, above);
}

/* The tables' entries of 8 symbols idx (each below 256): from registers at k <= 64, else gathered. */
AVX512DQ INLINE void lookup(__m512i idx, int64_t k, const lookup_t *t, const uint64_t *fl, const double *inv,
                            __m512i *e, __m512d *r) {
    if (k <= 64) {
        *e = in_registers(idx, k, t->fl);
        *r = _mm512_castsi512_pd(in_registers(idx, k, t->inv));
    } else {
        *e = _mm512_i64gather_epi64(idx, fl, 8);
        *r = _mm512_i64gather_pd(idx, inv, 8);
    }
}

/* One row: the symbols idx pushed onto the states x of the lanes in act, flushed words stored
 * at at[j]. */
AVX512DQ INLINE __m512i encode_row(__m512i x, __m512i idx, __mmask8 act, int64_t k, const lookup_t *t,
                                   const uint64_t *fl, const double *inv, uint32_t **at) {
    __m512i e;
    __m512d rcp;
    lookup(idx, k, t, fl, inv, &e, &rcp);
    const __m512i freq = _mm512_and_si512(e, _mm512_set1_epi64(0xffffffff)), left = _mm512_srli_epi64(e, 32);
    const __mmask8 flush = _mm512_mask_cmpge_epu64_mask(act, x, _mm512_slli_epi64(freq, 64 - PRECISION));
    { /* each lane's low word stored at its lane's end, the end advanced where it flushed: no branch */
        uint64_t word[8] __attribute__((aligned(64)));
        _mm512_store_si512(word, x);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            *at[j] = (uint32_t)word[j];
            at[j] += (flush >> j) & 1;
        }
        x = _mm512_mask_srli_epi64(x, flush, x, 32);
    }
    __m512i q = _mm512_cvttpd_epu64(_mm512_mul_pd(_mm512_cvtepu64_pd(x), rcp));
    const __m512i r = _mm512_sub_epi64(x, _mm512_mullo_epi64(q, freq));
    const __mmask8 off = _mm512_mask_cmpge_epu64_mask(act, r, freq); /* (a negative r reads as huge) */
    if (__builtin_expect(off != 0, 0)) {
        const __mmask8 over = _mm512_mask_cmplt_epi64_mask(off, r, _mm512_setzero_si512());
        q = _mm512_mask_sub_epi64(q, over, q, _mm512_set1_epi64(1));
        q = _mm512_mask_add_epi64(q, off & ~over, q, _mm512_set1_epi64(1));
    }
    const __m512i gap = _mm512_sub_epi64(_mm512_set1_epi64(1 << PRECISION), freq);
    return _mm512_mask_add_epi64(x, act, _mm512_add_epi64(x, left), _mm512_mullo_epi64(q, gap));
}

AVX512DQ static Py_ssize_t encode_8_avx512(const uint8_t *restrict sym, const uint32_t *cdf, const int64_t *cdf_off,
                                           const int64_t *cdf_k, const int64_t *start, const int64_t *stop,
                                           Py_ssize_t n_groups, uint32_t **at) {
    uint64_t fl[256] __attribute__((aligned(64)));
    double inv[256] __attribute__((aligned(64)));
    for (int s = 0; s < 256; s++) { /* symbols past a group's k: harmless values (these, or an earlier
                                        * group's), refused below */
        fl[s] = 1;
        inv[s] = 1.0;
    }
    lookup_t t;
    const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    __m512i x = _mm512_setzero_si512();
    for (Py_ssize_t g = n_groups - 1; g >= 0; g--) {
        const int64_t a = start[g], b = stop[g], k = cdf_k[g];
        const uint32_t *c = cdf + cdf_off[g];
        for (int64_t s = 0; s < k; s++) {
            const uint32_t freq = c[s + 1] - c[s];
            fl[s] = freq | (uint64_t)c[s] << 32;
            inv[s] = 1.0 / (double)freq;
        }
        for (int i = 0; i < 8; i++) {
            t.fl[i] = _mm512_load_si512(fl + 8 * i);
            t.inv[i] = _mm512_castpd_si512(_mm512_load_pd(inv + 8 * i));
        }
        const __m512i kv = _mm512_set1_epi64(k), av = _mm512_set1_epi64(a), bv = _mm512_set1_epi64(b);
        __mmask8 past = 0; /* lanes that met a symbol at or past k */
        for (int64_t row = (b - 1) & ~(int64_t)7; row > a - 8; row -= 8) {
            __mmask8 act = 0xff;
            __m512i idx;
            if (row >= a && row + 8 <= b) {
                idx = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(sym + row)));
            } else { /* a row the group ends or begins in: its lanes in the group (no other byte read) */
                const __m512i pos = _mm512_add_epi64(_mm512_set1_epi64(row), lane);
                act = _mm512_cmpge_epi64_mask(pos, av) & _mm512_cmplt_epi64_mask(pos, bv);
                idx = _mm512_maskz_cvtepu8_epi64(act, _mm_maskz_loadu_epi8(act, sym + row));
            }
            past |= _mm512_mask_cmpge_epu64_mask(act, idx, kv);
            x = encode_row(x, idx, act, k, &t, fl, inv, at);
        }
        if (past) return g;
    }
    uint64_t st[8] __attribute__((aligned(64)));
    _mm512_store_si512(st, x);
    flush_states(st, 8, at);
    return -1;
}
#endif

#define ENCODE_ARGS const uint8_t *sym, const uint32_t *cdf, const int64_t *off, const int64_t *k, \
                    const int64_t *start, const int64_t *stop, Py_ssize_t n, uint32_t **at
static Py_ssize_t encode_1(ENCODE_ARGS) { return encode(1, sym, cdf, off, k, start, stop, n, at); }
static Py_ssize_t encode_2(ENCODE_ARGS) { return encode(2, sym, cdf, off, k, start, stop, n, at); }
static Py_ssize_t encode_4(ENCODE_ARGS) { return encode(4, sym, cdf, off, k, start, stop, n, at); }
static Py_ssize_t encode_8(ENCODE_ARGS) { return encode(8, sym, cdf, off, k, start, stop, n, at); }

/* ans_encode(symbols, cdf, cdf_offsets, cdf_symbols, starts, stops, lanes) -> (the words of
 * lane 0, then of lane 1, ..., as little-endian bytes; the word count of each lane), or an int:
 * a group holding a symbol its table does not have (the tables are checked to fit
 * cdf and the groups to lie in the symbols). Each lane's buffer has room for a word for each of
 * its symbols and the final state's two: pages past the words written are never touched, so
 * never made resident. */
PyObject *py_ans_encode(PyObject *self, PyObject *args) {
    Py_buffer sym, cdf, cdf_off, cdf_k, start, stop;
    Py_ssize_t lanes;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*n", &sym, &cdf, &cdf_off, &cdf_k, &start, &stop, &lanes)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n_groups = start.len / 8;
    int fits = valid_lanes(lanes); /* (sets the error when not) */
    if (fits) { /* (a coded group has two symbols at least: one alone would write a word for each) */
        fits = cdf_off.len == start.len && cdf_k.len == start.len && stop.len == start.len &&
               tables_fit(cdf.buf, cdf.len / 4, cdf_off.buf, cdf_k.buf, start.buf, stop.buf, n_groups, sym.len, 2);
        if (!fits) PyErr_SetString(PyExc_ValueError, "ans_encode: tables or groups that do not fit the symbols");
    }
    if (fits) {
        uint32_t *buf[MAX_LANES] = {NULL}, *at[MAX_LANES];
        int failed = 0;
        for (Py_ssize_t j = 0; j < lanes; j++) {
            buf[j] = at[j] = malloc((size_t)((sym.len - j + lanes - 1) / lanes + 2) * 4);
            failed |= buf[j] == NULL;
        }
        Py_ssize_t (*fn)(ENCODE_ARGS) = lanes == 1 ? encode_1 : lanes == 2 ? encode_2 : lanes == 4 ? encode_4 : encode_8;
#ifdef ANS_SIMD
        if (lanes == 8 && (dq_simd_paths() & DQ_AVX512DQ)) fn = encode_8_avx512;
#endif
        Py_ssize_t past = -1;
        if (failed) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
            past = fn(sym.buf, cdf.buf, cdf_off.buf, cdf_k.buf, start.buf, stop.buf, n_groups, at);
            Py_END_ALLOW_THREADS
        }
        if (!failed && past >= 0) {
            result = PyLong_FromSsize_t(past);
        } else if (!failed) {
            Py_ssize_t total = 0;
            for (Py_ssize_t j = 0; j < lanes; j++) total += at[j] - buf[j];
            PyObject *data = PyBytes_FromStringAndSize(NULL, total * 4);
            PyObject *counts = data == NULL ? NULL : PyTuple_New(lanes);
            if (counts != NULL) {
                char *out = PyBytes_AS_STRING(data);
                Py_BEGIN_ALLOW_THREADS /* (the words of a long stream: megabytes) */
                for (Py_ssize_t j = 0; j < lanes; j++) {
                    memcpy(out, buf[j], (size_t)(at[j] - buf[j]) * 4);
                    out += (at[j] - buf[j]) * 4;
                }
                Py_END_ALLOW_THREADS
                for (Py_ssize_t j = 0; j < lanes; j++) PyTuple_SET_ITEM(counts, j, PyLong_FromSsize_t(at[j] - buf[j]));
                result = Py_BuildValue("NN", data, counts);
            } else {
                Py_XDECREF(data);
            }
        }
        for (Py_ssize_t j = 0; j < lanes; j++) free(buf[j]);
    }
    PyBuffer_Release(&cdf_k);
    PyBuffer_Release(&sym); PyBuffer_Release(&cdf); PyBuffer_Release(&cdf_off);
    PyBuffer_Release(&start); PyBuffer_Release(&stop);
    return result;
}
