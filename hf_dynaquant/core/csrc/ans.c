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

/* One lane's words while encoding: a buffer that grows as needed. */
typedef struct {
    uint32_t *buf;
    Py_ssize_t n, cap;
} words_t;

/* Room for two more words (a final state's two words too); 0 when memory ran out. */
INLINE int room(words_t *w) {
    if (w->n + 2 <= w->cap) return 1;
    const Py_ssize_t cap = 2 * w->cap + 2;
    uint32_t *grown = realloc(w->buf, (size_t)cap * 4);
    if (grown == NULL) return 0;
    w->buf = grown;
    w->cap = cap;
    return 1;
}

/* state / freq and state % freq by the reciprocal floor(2^64 / freq), made in *rcp as the
 * symbol first occurs: it underestimates the quotient by at most one, which the remainder
 * corrects (a 64-bit division took a sixth of the time; the same quotient, so the same
 * stream). freq 1 has no 64-bit reciprocal. */
INLINE uint64_t divide(uint64_t state, uint32_t freq, uint64_t *rcp, uint64_t *r) {
#ifdef __SIZEOF_INT128__
    if (freq == 1) {
        *r = 0;
        return state;
    }
    if (*rcp == 0) *rcp = UINT64_MAX / freq + (UINT64_MAX % freq == freq - 1);
    uint64_t q = (uint64_t)(((unsigned __int128)state * *rcp) >> 64);
    *r = state - q * freq;
    if (*r >= freq) {
        q++;
        *r -= freq;
    }
    return q;
#else
    *r = state % freq;
    return state / freq;
#endif
}

/* One symbol of a lane, pushed onto state st and the lane's words; 0 when memory ran out. */
INLINE int encode_symbol(uint64_t *st, words_t *lane, uint8_t sym, const uint32_t *restrict c, uint64_t *restrict rcp) {
    const uint32_t left = c[sym], freq = c[sym + 1] - left;
    if ((*st >> (64 - PRECISION)) >= freq) {
        if (!room(lane)) return 0;
        lane->buf[lane->n++] = (uint32_t)*st;
        *st >>= 32;
    }
    uint64_t r;
    const uint64_t q = divide(*st, freq, &rcp[sym], &r);
    *st = (q << PRECISION) | (left + r);
    return 1;
}

/* The encoder of a stream in L lanes: the groups in reverse, each group's symbols in reverse,
 * each pushing words onto its lane's buffer; then each lane's final state's words, least
 * significant first (none for a state of 0, one below 2^32). Returns 0, or -1 when memory ran
 * out. */
INLINE int encode(const int L, const uint8_t *restrict sym, const uint32_t *cdf, const int64_t *cdf_off,
                  const int64_t *start, const int64_t *stop, Py_ssize_t n_groups, words_t *restrict lane) {
    uint64_t st[MAX_LANES], rcp[256];
    for (int j = 0; j < L; j++) st[j] = 0;
    for (Py_ssize_t g = n_groups - 1; g >= 0; g--) {
        const uint32_t *c = cdf + cdf_off[g];
        const int64_t a = start[g], b = stop[g];
        memset(rcp, 0, sizeof(rcp)); /* the group's reciprocals */
        int64_t row = (b - 1) & ~(int64_t)(L - 1);
        for (; row > a - L && (row + L > b || row < a); row -= L) /* rows the group ends or begins in */
            for (int j = L - 1; j >= 0; j--)
                if (row + j >= a && row + j < b && !encode_symbol(&st[j], &lane[j], sym[row + j], c, rcp)) return -1;
        for (; row >= a; row -= L) /* whole rows: the lanes unrolled, their states in registers */
#pragma GCC unroll 8
            for (int j = L - 1; j >= 0; j--)
                if (!encode_symbol(&st[j], &lane[j], sym[row + j], c, rcp)) return -1;
        for (; row > a - L; row -= L) /* the first row */
            for (int j = L - 1; j >= 0; j--)
                if (row + j >= a && !encode_symbol(&st[j], &lane[j], sym[row + j], c, rcp)) return -1;
    }
    for (int j = 0; j < L; j++) {
        if (!room(&lane[j])) return -1;
        if (st[j] >= STATE_LOW) {
            lane[j].buf[lane[j].n++] = (uint32_t)st[j];
            lane[j].buf[lane[j].n++] = (uint32_t)(st[j] >> 32);
        } else if (st[j] > 0) {
            lane[j].buf[lane[j].n++] = (uint32_t)st[j];
        }
    }
    return 0;
}

#define ENCODE_ARGS const uint8_t *sym, const uint32_t *cdf, const int64_t *off, const int64_t *start, \
                    const int64_t *stop, Py_ssize_t n, words_t *lane
static int encode_1(ENCODE_ARGS) { return encode(1, sym, cdf, off, start, stop, n, lane); }
static int encode_2(ENCODE_ARGS) { return encode(2, sym, cdf, off, start, stop, n, lane); }
static int encode_4(ENCODE_ARGS) { return encode(4, sym, cdf, off, start, stop, n, lane); }
static int encode_8(ENCODE_ARGS) { return encode(8, sym, cdf, off, start, stop, n, lane); }

/* ans_encode(symbols, cdf, cdf_offsets, starts, stops, lanes) -> (the words of lane 0, then of
 * lane 1, ..., as little-endian bytes; the word count of each lane) */
PyObject *py_ans_encode(PyObject *self, PyObject *args) {
    Py_buffer sym, cdf, cdf_off, start, stop;
    Py_ssize_t lanes;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*n", &sym, &cdf, &cdf_off, &start, &stop, &lanes)) return NULL;
    PyObject *result = NULL;
    if (valid_lanes(lanes)) {
        words_t lane[MAX_LANES];
        for (Py_ssize_t j = 0; j < lanes; j++) {
            lane[j].n = lane[j].cap = 0;
            lane[j].buf = NULL; /* room() allocates */
        }
        int (*fn)(ENCODE_ARGS) = lanes == 1 ? encode_1 : lanes == 2 ? encode_2 : lanes == 4 ? encode_4 : encode_8;
        int failed;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < lanes; j++) { /* a first guess: a quarter of a word a symbol */
            lane[j].cap = sym.len / 16 / lanes + 16;
            lane[j].buf = malloc((size_t)lane[j].cap * 4);
            if (lane[j].buf == NULL) lane[j].cap = 0;
        }
        failed = fn(sym.buf, cdf.buf, cdf_off.buf, start.buf, stop.buf, start.len / 8, lane);
        Py_END_ALLOW_THREADS
        Py_ssize_t total = 0;
        for (Py_ssize_t j = 0; j < lanes; j++) total += lane[j].n;
        PyObject *data = failed ? NULL : PyBytes_FromStringAndSize(NULL, total * 4);
        PyObject *counts = failed ? NULL : PyTuple_New(lanes);
        if (failed) PyErr_NoMemory();
        if (data != NULL && counts != NULL) {
            char *at = PyBytes_AS_STRING(data);
            Py_BEGIN_ALLOW_THREADS /* (the words of a long stream: megabytes) */
            for (Py_ssize_t j = 0; j < lanes; j++) {
                memcpy(at, lane[j].buf, (size_t)lane[j].n * 4);
                at += lane[j].n * 4;
            }
            Py_END_ALLOW_THREADS
            for (Py_ssize_t j = 0; j < lanes; j++) PyTuple_SET_ITEM(counts, j, PyLong_FromSsize_t(lane[j].n));
            result = Py_BuildValue("NN", data, counts);
        } else {
            Py_XDECREF(data);
            Py_XDECREF(counts);
        }
        for (Py_ssize_t j = 0; j < lanes; j++) free(lane[j].buf);
    }
    PyBuffer_Release(&sym); PyBuffer_Release(&cdf); PyBuffer_Release(&cdf_off);
    PyBuffer_Release(&start); PyBuffer_Release(&stop);
    return result;
}
