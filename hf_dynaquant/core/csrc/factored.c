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
