/* Trellis-coded quantization on a uniform grid (trellis.py): the Viterbi search that rounds a
 * column's values, and the decoder's state machine that puts the stored symbols' parity back. */
#include "kernels.h"

/* from state s, subset SUB[s][b] (the grid levels i with i % 4 == SUB[s][b]) leads to NEXT[s][b] */
static const uint8_t NEXT[8][2] = {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {0, 1}, {2, 3}, {4, 5}, {6, 7}};
static const uint8_t SUB[8][2] = {{0, 2}, {1, 3}, {2, 0}, {3, 1}, {2, 0}, {3, 1}, {0, 2}, {1, 3}};

enum { LANES = 32 }; /* columns in lockstep, at most: 16 * LANES bytes of scratch a row */

/* The Viterbi search of round_sequences in trellis.py, bit for bit, over `lanes` sequences of n
 * values at once: value r of sequence l is x[r * stride + l] (one lane, stride 1: a contiguous
 * sequence; many lanes, stride the row length: columns of a row-major matrix, in lockstep so that
 * the lane loop vectorises). Rounds the values whose codes are >= 2 (the others leave the state
 * alone) to the path of grid levels of least squared error from state 0, writing 2 + i into
 * their codes (same layout as x). table: each code's float32 value (two specials, then levels
 * grid levels, a multiple of 4); c0, step: the grid's first level and spacing. cost: 8 * lanes
 * doubles; scratch: 16 * n * lanes bytes. Of two equal ways into a state the one from the lower
 * state wins, as in the reference. Always inlined: each caller's copy is compiled for its own
 * instruction set and count of lanes. */
static inline __attribute__((always_inline)) void round_lanes(const float *restrict x, Py_ssize_t n,
                                                              Py_ssize_t stride, Py_ssize_t lanes, double c0,
                                                              double step, const float *restrict table,
                                                              Py_ssize_t levels, uint8_t *restrict codes,
                                                              double *restrict cost, uint8_t *restrict scratch) {
    uint8_t *back = scratch, *pick = scratch + 8 * n * lanes;
    double top[4], e2[4][LANES], next[8][LANES];
    int level[4][LANES];
    double live[LANES];
    for (int d = 0; d < 4; d++) top[d] = (double)(d + 4 * ((levels - 1 - d) / 4));
    for (int t = 0; t < 8; t++)
        for (Py_ssize_t l = 0; l < lanes; l++) cost[t * lanes + l] = t ? INFINITY : 0.0;
    for (Py_ssize_t r = 0; r < n; r++) {
        const float *xr = x + r * stride;
        uint8_t *bk = back + 8 * lanes * r, *pk = pick + 8 * lanes * r;
        for (Py_ssize_t l = 0; l < lanes; l++) live[l] = codes[r * stride + l] >= 2; /* (a double: a blend) */
        if (lanes == 1 && !live[0]) continue; /* (one lane: nothing to do; many: the state stays below) */
        for (int d = 0; d < 4; d++) /* each subset's nearest level: the same from every state */
#pragma omp simd simdlen(8)
            for (Py_ssize_t l = 0; l < lanes; l++) {
                const double v = (double)xr[l];
                double i = (double)d + 4.0 * rint(((v - c0) / step - (double)d) / 4.0);
                i = !(i >= (double)d) ? (double)d : i; /* (no branches; NaN, off the trellis, to a level) */
                i = i > top[d] ? top[d] : i;
                level[d][l] = (int)i;
                const double e = v - (double)table[2 + (int)i];
                e2[d][l] = e * e;
            }
        /* state t is reached from t / 2 and t / 2 + 4 by branch t % 2: the second only when
         * strictly cheaper (a loop over the states in order, keeping the first of equals) */
        for (int t = 0; t < 8; t++) { /* without branches: which way wins is data, unpredictable */
            const int b = t & 1, s1 = t >> 1, d1 = SUB[s1][b], d2 = SUB[s1 + 4][b];
            const double *from1 = cost + s1 * lanes, *from2 = cost + (s1 + 4) * lanes;
#pragma omp simd simdlen(8)
            for (Py_ssize_t l = 0; l < lanes; l++) {
                const double c1 = from1[l] + e2[d1][l], c2 = from2[l] + e2[d2][l];
                const int two = c2 < c1;
                next[t][l] = c2 < c1 ? c2 : c1; /* (minsd) */
                bk[t * lanes + l] = (uint8_t)(s1 + 4 * two); /* (read back only where live) */
                pk[t * lanes + l] = (uint8_t)(level[d1][l] + two * (level[d2][l] - level[d1][l]));
            }
        }
        for (int t = 0; t < 8; t++)
#pragma omp simd simdlen(8)
            for (Py_ssize_t l = 0; l < lanes; l++) {
                const double keep = cost[t * lanes + l], moved = next[t][l];
                cost[t * lanes + l] = live[l] ? moved : keep;
            }
    }
    uint8_t state[LANES];
    for (Py_ssize_t l = 0; l < lanes; l++) {
        state[l] = 0;
        for (int t = 1; t < 8; t++)
            if (cost[t * lanes + l] < cost[state[l] * lanes + l]) state[l] = (uint8_t)t;
    }
    for (Py_ssize_t r = n - 1; r >= 0; r--) {
        uint8_t *code = codes + r * stride;
        const uint8_t *bk = back + 8 * lanes * r, *pk = pick + 8 * lanes * r;
        for (Py_ssize_t l = 0; l < lanes; l++) {
            const Py_ssize_t at = state[l] * lanes + l;
            if (code[l] >= 2) { /* (a value off the trellis leaves the state alone) */
                code[l] = (uint8_t)(2 + pk[at]);
                state[l] = bk[at];
            }
        }
    }
}

/* One contiguous sequence of n values (the column error feedback rounds, partition.c); scratch:
 * 16 * n bytes. */
SIMD_CLONES void trellis_round_f32(const float *x, Py_ssize_t n, double c0, double step, const float *table,
                                   Py_ssize_t levels, uint8_t *codes, uint8_t *scratch) {
    double cost[8];
    round_lanes(x, n, 1, 1, c0, step, table, levels, codes, cost, scratch);
}

/* The columns of a rows x cols row-major matrix, LANES at a time; scratch: 16 * rows * LANES bytes. */
SIMD_CLONES static void trellis_round_columns_f32(const float *x, Py_ssize_t rows, Py_ssize_t cols, double c0,
                                                  double step, const float *table, Py_ssize_t levels, uint8_t *codes,
                                                  uint8_t *scratch) {
    double cost[8 * LANES];
    for (Py_ssize_t at = 0; at < cols; at += LANES) {
        if (cols - at >= LANES) /* (a constant count of lanes, which vectorises) */
            round_lanes(x + at, rows, cols, LANES, c0, step, table, levels, codes + at, cost, scratch);
        else
            round_lanes(x + at, rows, cols, cols - at, c0, step, table, levels, codes + at, cost, scratch);
    }
}

PyObject *py_trellis_round_f32(PyObject *self, PyObject *args) {
    Py_buffer x, codes, table;
    Py_ssize_t length;
    int across;
    double c0, step;
    if (!PyArg_ParseTuple(args, "y*w*npddy*", &x, &codes, &length, &across, &c0, &step, &table)) return NULL;
    const Py_ssize_t n = codes.len, levels = table.len / 4 - 2;
    int ok = length > 0 && n % length == 0 && x.len == 4 * n && levels >= 4 && levels % 4 == 0 && levels <= 252 &&
             step > 0;
    uint8_t *scratch = NULL;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "trellis_round: buffers disagree in length, or a grid of no use");
    else if (!(scratch = malloc((size_t)(16 * length * (across ? LANES : 1))))) {
        PyErr_NoMemory();
        ok = 0;
    } else {
        Py_BEGIN_ALLOW_THREADS
        if (across)
            trellis_round_columns_f32(x.buf, length, n / length, c0, step, table.buf, levels, codes.buf, scratch);
        else
            for (Py_ssize_t at = 0; at < n; at += length)
                trellis_round_f32((const float *)x.buf + at, length, c0, step, table.buf, levels,
                                  (uint8_t *)codes.buf + at, scratch);
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
