/* Trellis-coded quantization on a uniform grid (trellis.py): the Viterbi search that rounds a
 * column's values, and the decoder's state machine that puts the stored symbols' parity back. */
#include "kernels.h"

/* from state s, subset SUB[s][b] (the grid levels i with i % 4 == SUB[s][b]) leads to NEXT[s][b] */
static const uint8_t NEXT[8][2] = {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {0, 1}, {2, 3}, {4, 5}, {6, 7}};
static const uint8_t SUB[8][2] = {{0, 2}, {1, 3}, {2, 0}, {3, 1}, {2, 0}, {3, 1}, {0, 2}, {1, 3}};

/* Rounds the n values x whose codes are >= 2 (the others are skipped) to the path of grid levels
 * of least squared error from state 0, writing 2 + i into their codes: round_sequences in
 * trellis.py, bit for bit. table: each code's float32 value (two specials, then levels grid
 * levels, a multiple of 4); c0, step: the grid's first level and spacing. scratch: 16 * n bytes.
 * Of two equal ways into a state the one from the lower state wins, as in the reference. */
SIMD_CLONES void trellis_round_f32(const float *x, Py_ssize_t n, double c0, double step, const float *table,
                                   Py_ssize_t levels,
                       uint8_t *codes, uint8_t *scratch) {
    uint8_t *back = scratch, *pick = scratch + 8 * n;
    double cost[8], next[8], top[4], e2[4];
    int level[4];
    for (int d = 0; d < 4; d++) top[d] = (double)(d + 4 * ((levels - 1 - d) / 4));
    for (int s = 0; s < 8; s++) cost[s] = s ? INFINITY : 0.0;
    Py_ssize_t m = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (codes[r] < 2) continue;
        const double v = (double)x[r], y = (v - c0) / step;
        for (int d = 0; d < 4; d++) { /* each subset's nearest level: the same from every state */
            double i = (double)d + 4.0 * rint((y - (double)d) / 4.0);
            i = i < (double)d ? (double)d : i; /* (maxsd, minsd: no branches) */
            i = i > top[d] ? top[d] : i;
            level[d] = (int)i;
            const double e = v - (double)table[2 + level[d]];
            e2[d] = e * e;
        }
        /* state t is reached from t / 2 and t / 2 + 4 by branch t % 2: the second only when
         * strictly cheaper (a loop over the states in order, keeping the first of equals) */
        uint8_t *bk = back + 8 * m, *pk = pick + 8 * m;
        for (int t = 0; t < 8; t++) { /* without branches: which way wins is data, unpredictable */
            const int b = t & 1, s1 = t >> 1, d1 = SUB[s1][b], d2 = SUB[s1 + 4][b];
            const double c1 = cost[s1] + e2[d1], c2 = cost[s1 + 4] + e2[d2];
            const int two = c2 < c1;
            next[t] = c2 < c1 ? c2 : c1; /* (minsd) */
            bk[t] = (uint8_t)(s1 + 4 * two);
            pk[t] = (uint8_t)(level[d1] + two * (level[d2] - level[d1]));
        }
        memcpy(cost, next, sizeof cost);
        m++;
    }
    int s = 0;
    for (int t = 1; t < 8; t++)
        if (cost[t] < cost[s]) s = t;
    for (Py_ssize_t r = n - 1; r >= 0; r--) {
        if (codes[r] < 2) continue;
        m--;
        codes[r] = (uint8_t)(2 + pick[8 * m + s]);
        s = back[8 * m + s];
    }
}

PyObject *py_trellis_round_f32(PyObject *self, PyObject *args) {
    Py_buffer x, codes, table;
    Py_ssize_t length;
    double c0, step;
    if (!PyArg_ParseTuple(args, "y*w*nddy*", &x, &codes, &length, &c0, &step, &table)) return NULL;
    const Py_ssize_t n = codes.len, levels = table.len / 4 - 2;
    int ok = length > 0 && n % length == 0 && x.len == 4 * n && levels >= 4 && levels % 4 == 0 && levels <= 252 &&
             step > 0;
    uint8_t *scratch = NULL;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "trellis_round: buffers disagree in length, or a grid of no use");
    else if (!(scratch = malloc((size_t)(16 * length)))) {
        PyErr_NoMemory();
        ok = 0;
    } else {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t at = 0; at < n; at += length)
            trellis_round_f32((const float *)x.buf + at, length, c0, step, table.buf, levels, (uint8_t *)codes.buf + at,
                              scratch);
        Py_END_ALLOW_THREADS
    }
    free(scratch);
    PyBuffer_Release(&x); PyBuffer_Release(&codes); PyBuffer_Release(&table);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* Stored symbols back to codes in place, a rows x cols tensor whose trellis runs down each
 * column, one per column and kind of row (kinds: a byte per row, 0 or 1; the kind-1 rows' grid of
 * levels1 levels follows the kind-0 rows' of levels0): unpack in trellis.py. Returns -1 where a
 * symbol names a level past its grid. state: 2 * cols bytes. */
static int trellis_unpack_u8(uint8_t *codes, const uint8_t *kinds, Py_ssize_t rows, Py_ssize_t cols,
                             const Py_ssize_t *levels, uint8_t *state) {
    uint8_t after[8][4];
    for (int s = 0; s < 8; s++)
        for (int b = 0; b < 2; b++) after[s][SUB[s][b]] = NEXT[s][b];
    memset(state, 0, (size_t)(2 * cols));
    for (Py_ssize_t r = 0; r < rows; r++) {
        const int k = kinds[r];
        const Py_ssize_t size = levels[k], offset = k ? levels[0] : 0;
        uint8_t *row = codes + r * cols, *st = state + k * cols;
        for (Py_ssize_t c = 0; c < cols; c++) {
            if (row[c] < 2) continue;
            const Py_ssize_t i = 2 * (Py_ssize_t)(row[c] - 2) + (st[c] & 1);
            if (i >= size) return -1;
            row[c] = (uint8_t)(2 + offset + i);
            st[c] = after[st[c]][i & 3];
        }
    }
    return 0;
}

PyObject *py_trellis_unpack_u8(PyObject *self, PyObject *args) {
    Py_buffer codes, kinds;
    Py_ssize_t levels[2];
    if (!PyArg_ParseTuple(args, "w*y*nn", &codes, &kinds, &levels[0], &levels[1])) return NULL;
    const Py_ssize_t rows = kinds.len;
    int rc = -2, ok = rows > 0 && codes.len % rows == 0 && levels[0] >= 4 && levels[1] >= 4 &&
                      levels[0] + levels[1] <= 2 * 252;
    for (Py_ssize_t r = 0; ok && r < rows; r++) ok = ((const uint8_t *)kinds.buf)[r] <= 1;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "trellis_unpack: codes do not make the rows, or a row map or grid of no use");
    else {
        uint8_t *state = malloc((size_t)(2 * (codes.len / rows)) + 1);
        if (!state)
            PyErr_NoMemory();
        else {
            Py_BEGIN_ALLOW_THREADS
            rc = trellis_unpack_u8(codes.buf, kinds.buf, rows, codes.len / rows, levels, state);
            Py_END_ALLOW_THREADS
            free(state);
        }
    }
    PyBuffer_Release(&codes); PyBuffer_Release(&kinds);
    return rc == -2 ? NULL : PyLong_FromLong(rc);
}
