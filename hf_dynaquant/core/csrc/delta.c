#include "kernels.h"

/* The regrouping of the delta encoder (delta.py): uint8 values ordered by their uint8 key (the
 * previous checkpoint's code), stably, and back. A counting sort in two passes (a histogram of
 * the keys, then each value to the next free place of its key's group), what the numpy
 * reference does with a stable argsort and a gather or scatter, without the index array. */
static void group_starts(const uint8_t *keys, Py_ssize_t n, Py_ssize_t start[256]) {
    Py_ssize_t count[256] = {0}, pos = 0;
    for (Py_ssize_t i = 0; i < n; i++) count[keys[i]]++;
    for (int k = 0; k < 256; k++) { start[k] = pos; pos += count[k]; }
}

PyObject *py_regroup_u8(PyObject *self, PyObject *args) {
    Py_buffer values, keys, out;
    int inverse;
    if (!PyArg_ParseTuple(args, "y*y*w*p", &values, &keys, &out, &inverse)) return NULL;
    int ok = values.len == keys.len && out.len == keys.len;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "regroup: values, keys and out differ in length");
    else {
        const uint8_t *v = values.buf, *k = keys.buf;
        uint8_t *o = out.buf;
        Py_ssize_t n = keys.len, start[256];
        Py_BEGIN_ALLOW_THREADS
        group_starts(k, n, start);
        if (inverse)
            for (Py_ssize_t i = 0; i < n; i++) o[i] = v[start[k[i]]++];
        else
            for (Py_ssize_t i = 0; i < n; i++) o[start[k[i]]++] = v[i];
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&values); PyBuffer_Release(&keys); PyBuffer_Release(&out);
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
        const uint8_t *s = symbols.buf;
        int64_t *c = counts.buf, part[4][256];
        Py_ssize_t n = symbols.len, i = 0;
        Py_BEGIN_ALLOW_THREADS
        memset(part, 0, sizeof(part));
        for (; i + 4 <= n; i += 4) { part[0][s[i]]++; part[1][s[i + 1]]++; part[2][s[i + 2]]++; part[3][s[i + 3]]++; }
        for (; i < n; i++) part[0][s[i]]++;
        for (int k = 0; k < 256; k++) c[k] = part[0][k] + part[1][k] + part[2][k] + part[3][k];
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

/* (a - b) mod levels of two uint8 arrays (delta.py's cyclic_delta, and apply_delta, which is
 * the same operation on the previous codes and the delta), with a non-negative remainder. The
 * difference of two bytes lies in -255..255: its remainder is looked up in a table made once
 * per call (a division per value cost more than the rest of a delta's coding). */
PyObject *py_cyclic_u8(PyObject *self, PyObject *args) {
    Py_buffer a, b, out;
    int levels;
    if (!PyArg_ParseTuple(args, "y*y*iw*", &a, &b, &levels, &out)) return NULL;
    int ok = a.len == b.len && out.len == a.len && levels >= 1 && levels <= 256;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "cyclic: arrays differ in length or levels outside 1..256");
    else {
        const uint8_t *x = a.buf, *y = b.buf;
        uint8_t *o = out.buf, table[511];
        Py_ssize_t n = a.len;
        Py_BEGIN_ALLOW_THREADS
        for (int d = -255; d <= 255; d++) {
            const int r = d % levels;
            table[d + 255] = (uint8_t)(r < 0 ? r + levels : r);
        }
        for (Py_ssize_t i = 0; i < n; i++) o[i] = table[(int)x[i] - (int)y[i] + 255];
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&a); PyBuffer_Release(&b); PyBuffer_Release(&out);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}
