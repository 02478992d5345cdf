#include "kernels.h"

/* A matrix of codes' row and column sums, and each code's context from row and column terms
 * (factored.py): one pass each, in loops the compiler vectorises, with the GIL released. */

/* Row i's sum into row_sums[i] and column j's into col_sums[j] (both zeroed first) of rows x cols
 * uint8 codes. The columns are summed in uint32 a block of rows at a time (255 * 2^24 < 2^32),
 * then added to the int64 sums. */
#define SUM_BLOCK (1 << 24)
SIMD_CLONES static void matrix_sums(const uint8_t *restrict m, Py_ssize_t rows, Py_ssize_t cols, int64_t *restrict row_sums,
                                    int64_t *restrict col_sums, uint32_t *restrict part) {
    memset(col_sums, 0, (size_t)cols * sizeof(int64_t));
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += SUM_BLOCK) {
        const Py_ssize_t r1 = rows - r0 < SUM_BLOCK ? rows : r0 + SUM_BLOCK;
        memset(part, 0, (size_t)cols * sizeof(uint32_t));
        for (Py_ssize_t i = r0; i < r1; i++) {
            const uint8_t *restrict row = m + i * cols;
            uint32_t s = 0;
            for (Py_ssize_t j = 0; j < cols; j++) {
                part[j] += row[j];
                s += row[j];
            }
            row_sums[i] = s; /* (a row of at most 2^24 codes: its sum fits) */
        }
        for (Py_ssize_t j = 0; j < cols; j++) col_sums[j] += part[j];
    }
}

/* factored_sums(codes, rows, row_sums, col_sums): the sums of codes (uint8, rows rows of equal
 * length, at most 2^24 codes a row) into row_sums (int64, rows) and col_sums (int64, the row
 * length). */
PyObject *py_factored_sums(PyObject *self, PyObject *args) {
    Py_buffer codes, row_sums, col_sums;
    Py_ssize_t rows;
    if (!PyArg_ParseTuple(args, "y*nw*w*", &codes, &rows, &row_sums, &col_sums)) return NULL;
    const Py_ssize_t cols = rows > 0 ? codes.len / rows : 0;
    int ok = rows > 0 && cols > 0 && cols <= (1 << 24) && codes.len == rows * cols &&
             row_sums.len == rows * (Py_ssize_t)sizeof(int64_t) && col_sums.len == cols * (Py_ssize_t)sizeof(int64_t);
    uint32_t *part = ok ? malloc((size_t)cols * sizeof(uint32_t)) : NULL;
    if (!ok)
        PyErr_SetString(PyExc_ValueError,
                        "factored_sums: codes are not rows of equal length (at most 2^24), or the sums' lengths differ");
    else if (part == NULL) {
        ok = 0;
        PyErr_NoMemory();
    } else {
        Py_BEGIN_ALLOW_THREADS
        matrix_sums(codes.buf, rows, cols, row_sums.buf, col_sums.buf, part);
        Py_END_ALLOW_THREADS
        free(part);
    }
    PyBuffer_Release(&codes); PyBuffer_Release(&row_sums); PyBuffer_Release(&col_sums);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* A row of factored contexts: out[j] = clip(r + c[j], 0, top) for terms within +-2^12 (their
 * sum cannot overflow). */
INLINE void factored_row(int16_t r, const int16_t *restrict c, Py_ssize_t n, int16_t top, uint8_t *restrict out) {
    for (Py_ssize_t j = 0; j < n; j++) {
        int16_t v = (int16_t)(r + c[j]);
        v = v < 0 ? 0 : v;
        v = v > top ? top : v;
        out[j] = (uint8_t)v;
    }
}

/* out[i * cols + j] = clip(r[i] + c[j], 0, top), the terms already within +-2^12. */
SIMD_CLONES static void contexts(const int16_t *restrict r, Py_ssize_t rows, const int16_t *restrict c, Py_ssize_t cols,
                                 int16_t top, uint8_t *restrict out) {
    for (Py_ssize_t i = 0; i < rows; i++) factored_row(r[i], c, cols, top, out + i * cols);
}

/* factored_contexts(rows_terms, cols_terms, contexts, out): factored.py's contexts of a rows x cols
 * matrix (int16 terms, each within +-2^12; contexts 1..256) into out (uint8, rows x cols). */
PyObject *py_factored_contexts(PyObject *self, PyObject *args) {
    Py_buffer r, c, out;
    int count;
    if (!PyArg_ParseTuple(args, "y*y*iw*", &r, &c, &count, &out)) return NULL;
    const Py_ssize_t rows = r.len / 2, cols = c.len / 2;
    int ok = r.len % 2 == 0 && c.len % 2 == 0 && count >= 1 && count <= 256 && out.len == rows * cols &&
             terms_bounded(r.buf, rows) && terms_bounded(c.buf, cols);
    if (!ok)
        PyErr_SetString(PyExc_ValueError,
                        "factored_contexts: terms past +-4096, contexts outside 1..256, or out is not rows x cols");
    else {
        Py_BEGIN_ALLOW_THREADS
        contexts(r.buf, rows, c.buf, cols, (int16_t)(count - 1), out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&r); PyBuffer_Release(&c); PyBuffer_Release(&out);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* The classes of a factored matrix's columns (factored_t, kernels.h): the columns ordered stably
 * by their term (a counting sort over the bounded terms' 2^13 + 1 values), and the runs of equal
 * terms in that order. Returns 1, or 0 out of memory (nothing then held). */
#define TERM_BOUND (1 << 12)
int factored_init(factored_t *f, const int16_t *r, Py_ssize_t rows, const int16_t *c, Py_ssize_t cols, int contexts) {
    *f = (factored_t){.r = r, .rows = rows, .c = c, .cols = cols, .top = (int16_t)(contexts - 1)};
    int32_t *place = calloc(2 * TERM_BOUND + 2, sizeof(int32_t));
    f->order = malloc((size_t)cols * sizeof(int32_t));
    f->start = malloc((size_t)(cols + 1) * sizeof(int32_t));
    f->value = malloc((size_t)cols * sizeof(int16_t));
    if (place == NULL || f->order == NULL || f->start == NULL || f->value == NULL) {
        free(place);
        factored_free(f);
        return 0;
    }
    for (Py_ssize_t j = 0; j < cols; j++) place[c[j] + TERM_BOUND + 1]++;
    for (int v = 1; v < 2 * TERM_BOUND + 2; v++) place[v] += place[v - 1];
    for (Py_ssize_t j = 0; j < cols; j++) f->order[place[c[j] + TERM_BOUND]++] = (int32_t)j;
    free(place);
    for (Py_ssize_t t = 0; t < cols; t++)
        if (t == 0 || c[f->order[t]] != c[f->order[t - 1]]) {
            f->start[f->classes] = (int32_t)t;
            f->value[f->classes++] = c[f->order[t]];
        }
    f->start[f->classes] = (int32_t)cols;
    return 1;
}

void factored_free(factored_t *f) {
    free(f->order); free(f->start); free(f->value);
    f->order = f->start = NULL, f->value = NULL;
}

/* How many codes take each context (count: 256, set): each row's classes' sizes added at their
 * contexts, rows x classes steps rather than a pass over the codes. */
void factored_counts(const factored_t *f, int64_t count[256]) {
    memset(count, 0, 256 * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < f->rows; i++)
        for (Py_ssize_t k = 0; k < f->classes; k++)
            count[class_context(f, f->r[i], k)] += f->start[k + 1] - f->start[k];
}

/* Whether the factored terms of a call fit the kernels: int16 row and column terms within
 * +-2^12, at least one column (fewer than 2^31), contexts 1..256. */
int factored_fits(const Py_buffer *r, const Py_buffer *c, int contexts) {
    return r->len % 2 == 0 && c->len % 2 == 0 && c->len > 0 && c->len / 2 < INT32_MAX && contexts >= 1 &&
           contexts <= 256 && terms_bounded(r->buf, r->len / 2) && terms_bounded(c->buf, c->len / 2);
}

/* factored_counts(row_terms, col_terms, contexts, count): how many codes of a rows x cols matrix
 * take each of factored.py's contexts, into count (int64, 256), from the terms alone. */
PyObject *py_factored_counts(PyObject *self, PyObject *args) {
    Py_buffer r, c, count;
    int contexts;
    if (!PyArg_ParseTuple(args, "y*y*iw*", &r, &c, &contexts, &count)) return NULL;
    int ok = factored_fits(&r, &c, contexts) && count.len == 256 * (Py_ssize_t)sizeof(int64_t);
    factored_t f;
    if (!ok)
        PyErr_SetString(PyExc_ValueError,
                        "factored_counts: no columns, terms past +-4096, contexts outside 1..256, or count is "
                        "not 256 int64");
    else if (!factored_init(&f, r.buf, r.len / 2, c.buf, c.len / 2, contexts)) {
        ok = 0;
        PyErr_NoMemory();
    } else {
        Py_BEGIN_ALLOW_THREADS
        factored_counts(&f, count.buf);
        Py_END_ALLOW_THREADS
        factored_free(&f);
    }
    PyBuffer_Release(&r); PyBuffer_Release(&c); PyBuffer_Release(&count);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}
