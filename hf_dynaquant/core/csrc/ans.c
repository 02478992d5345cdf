#include "kernels.h"

/* rANS coding of uint8 symbols, bit for bit the streams of constriction 0.5's
 * stack::AnsCoder<u32 words, u64 state> with 24-bit probabilities (ans.py, FORMAT.md "rANS
 * streams"), with the GIL released. A stream holds consecutive groups of symbols, each with its
 * own model, given as a cumulative table cdf[0..k] (cdf[0] = 0, cdf[k] = 2^24, strictly
 * increasing; ans.py computes it exactly as constriction quantizes the group's probabilities).
 * The words form a stack: the encoder pushes, the decoder pops from the end, so the encoder
 * codes the last group's last symbol first. */

#define PRECISION 24
#define QMASK ((1u << PRECISION) - 1)
#define LOOKUP_BITS 12 /* a first guess of the symbol from the quantile's top 12 bits */
#define STATE_LOW ((uint64_t)1 << 32)

typedef struct {
    const uint32_t *cdf;          /* k + 1 entries */
    int k;                        /* symbols of the alphabet */
    uint8_t first[1 << LOOKUP_BITS]; /* the symbol of the quantile (q >> shift) << shift */
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
}

static inline int model_symbol(const model_t *m, uint32_t q) {
    int s = m->first[q >> (PRECISION - LOOKUP_BITS)];
    while (s + 1 < m->k && m->cdf[s + 1] <= q) s++;
    return s;
}

/* decode: words[0..n_words), groups g = 0..n_groups-1 filling out[start[g]..stop[g]) with the
 * model cdf + cdf_off[g] of k[g] symbols. Returns the words left unread; *state_out is the
 * final state (0 after a whole, undamaged stream). */
static Py_ssize_t decode(const uint32_t *words, Py_ssize_t n_words, const uint32_t *cdf, const int64_t *cdf_off,
                         const int64_t *k, const int64_t *start, const int64_t *stop, Py_ssize_t n_groups,
                         uint8_t *out, uint64_t *state_out, model_t *model) {
    Py_ssize_t top = n_words; /* words[0..top) are still on the stack */
    uint64_t state = 0;
    if (top > 0) {
        state = words[--top];
        while (top > 0) {
            state = (state << 32) | words[--top];
            if (state >= STATE_LOW) break;
        }
    }
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        model_init(model, cdf + cdf_off[g], (int)k[g]);
        const uint32_t *c = model->cdf;
        for (int64_t i = start[g]; i < stop[g]; i++) {
            const uint32_t q = (uint32_t)(state & QMASK);
            const int s = model_symbol(model, q);
            state = (state >> PRECISION) * (uint64_t)(c[s + 1] - c[s]) + (q - c[s]);
            if (state < STATE_LOW && top > 0) state = (state << 32) | words[--top];
            out[i] = (uint8_t)s;
        }
    }
    *state_out = state;
    return top;
}

PyObject *py_ans_decode(PyObject *self, PyObject *args) {
    Py_buffer words, cdf, cdf_off, k, start, stop, out;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*w*", &words, &cdf, &cdf_off, &k, &start, &stop, &out)) return NULL;
    const Py_ssize_t n_groups = k.len / 8;
    Py_ssize_t left = -1;
    uint64_t state = 0;
    model_t *model = PyMem_RawMalloc(sizeof(model_t));
    if (model == NULL)
        PyErr_NoMemory();
    else {
        Py_BEGIN_ALLOW_THREADS
        left = decode(words.buf, words.len / 4, cdf.buf, cdf_off.buf, k.buf, start.buf, stop.buf, n_groups, out.buf,
                      &state, model);
        Py_END_ALLOW_THREADS
        PyMem_RawFree(model);
    }
    PyBuffer_Release(&words); PyBuffer_Release(&cdf); PyBuffer_Release(&cdf_off); PyBuffer_Release(&k);
    PyBuffer_Release(&start); PyBuffer_Release(&stop); PyBuffer_Release(&out);
    return left < 0 ? NULL : Py_BuildValue("nK", left, (unsigned long long)state);
}

/* encode: the groups in reverse, each group's symbols in reverse, pushing words onto a buffer
 * that grows as needed; then the final state's words, least significant first (none for a state
 * of 0, one below 2^32). Returns the word count or -1 when memory ran out (*buf then freed).
 * The state's division by a symbol's frequency is a multiplication by its reciprocal (a 64-bit
 * division took a sixth of the time): the same quotient and remainder, so the same stream. */
static Py_ssize_t encode(const uint8_t *sym, const uint32_t *cdf, const int64_t *cdf_off, const int64_t *start,
                         const int64_t *stop, Py_ssize_t n_groups, uint32_t **buf, Py_ssize_t cap) {
    Py_ssize_t n = 0;
    uint64_t state = 0, rcp[256];
    for (Py_ssize_t g = n_groups - 1; g >= 0; g--) {
        const uint32_t *c = cdf + cdf_off[g];
        memset(rcp, 0, sizeof(rcp)); /* the group's reciprocals, made as its symbols first occur */
        for (int64_t i = stop[g] - 1; i >= start[g]; i--) {
            const uint32_t left = c[sym[i]], freq = c[sym[i] + 1] - left;
            if ((state >> (64 - PRECISION)) >= freq) {
                if (n + 2 > cap) { /* (room for the final state's two words too) */
                    cap *= 2;
                    uint32_t *grown = realloc(*buf, (size_t)cap * 4);
                    if (grown == NULL) { free(*buf); *buf = NULL; return -1; }
                    *buf = grown;
                }
                (*buf)[n++] = (uint32_t)state;
                state >>= 32;
            }
            /* state / freq by a reciprocal: floor(2^64 / freq) underestimates the quotient by at
             * most one, which the remainder corrects (freq 1 has no 64-bit reciprocal) */
            uint64_t q, r;
#ifdef __SIZEOF_INT128__
            if (freq == 1) { q = state; r = 0; }
            else {
                uint64_t m = rcp[sym[i]];
                if (m == 0) m = rcp[sym[i]] = UINT64_MAX / freq + (UINT64_MAX % freq == freq - 1);
                q = (uint64_t)(((unsigned __int128)state * m) >> 64);
                r = state - q * freq;
                if (r >= freq) { q++; r -= freq; }
            }
#else
            q = state / freq; r = state % freq;
#endif
            state = (q << PRECISION) | (left + r);
        }
    }
    if (n + 2 > cap) {
        uint32_t *grown = realloc(*buf, (size_t)(n + 2) * 4);
        if (grown == NULL) { free(*buf); *buf = NULL; return -1; }
        *buf = grown;
    }
    if (state >= STATE_LOW) {
        (*buf)[n++] = (uint32_t)state;
        (*buf)[n++] = (uint32_t)(state >> 32);
    } else if (state > 0) {
        (*buf)[n++] = (uint32_t)state;
    }
    return n;
}

PyObject *py_ans_encode(PyObject *self, PyObject *args) {
    Py_buffer sym, cdf, cdf_off, start, stop;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*", &sym, &cdf, &cdf_off, &start, &stop)) return NULL;
    Py_ssize_t cap = sym.len / 16 + 16, n = -1;
    uint32_t *buf = malloc((size_t)cap * 4);
    if (buf != NULL) {
        Py_BEGIN_ALLOW_THREADS
        n = encode(sym.buf, cdf.buf, cdf_off.buf, start.buf, stop.buf, start.len / 8, &buf, cap);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&sym); PyBuffer_Release(&cdf); PyBuffer_Release(&cdf_off);
    PyBuffer_Release(&start); PyBuffer_Release(&stop);
    if (n < 0) return PyErr_NoMemory();
    PyObject *result = PyBytes_FromStringAndSize((const char *)buf, n * 4);
    free(buf);
    return result;
}
