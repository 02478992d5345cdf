#include "kernels.h"

/* Log-sketch bucket counts of float32 values (sketch.py). The key of |x| is
 * ceil(log(|x|) / log(gamma)); lut maps the top 20 bits of |x| (exponent and 12 mantissa bits)
 * to that key when the whole fine bucket shares it, else to `exact` (then log is computed).
 * Magnitudes below `tiny` count as zero; +-inf take the largest key. With `codes` (uint8, one
 * per value) only the values whose code is `only` are counted: the K-means sketch of the values
 * a plan neither prunes nor protects, without gathering them first. Returns the NaN count. */
static Py_ssize_t sketch_f32(const uint32_t *x, Py_ssize_t n, const int32_t *lut, int32_t exact,
                             double inv_log_gamma, uint32_t tiny, int32_t kmin, Py_ssize_t nkeys,
                             int64_t *pos, int64_t *neg, int64_t *zeros, const uint8_t *codes, int only) {
    Py_ssize_t nans = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (codes && codes[i] != only) continue;
        const uint32_t u = x[i] & 0x7FFFFFFFu;
        if (u < tiny) { (*zeros)++; continue; }
        int32_t key;
        if (u >= 0x7F800000u) {
            if (u > 0x7F800000u) { nans++; continue; }
            key = kmin + (int32_t)nkeys - 1;
        } else {
            key = lut[u >> 11];
            if (key == exact) {
                float f;
                memcpy(&f, &u, 4);
                key = (int32_t)ceil(log((double)f) * inv_log_gamma);
            }
        }
        Py_ssize_t slot = (Py_ssize_t)key - kmin;
        if (slot < 0) slot = 0;
        if (slot >= nkeys) slot = nkeys - 1;
        (x[i] >> 31 ? neg : pos)[slot]++;
    }
    return nans;
}

PyObject *py_sketch_f32(PyObject *self, PyObject *args) {
    Py_buffer x, lut, pos, neg, codes;
    int exact, kmin, only;
    double inv_log_gamma;
    unsigned int tiny;
    if (!PyArg_ParseTuple(args, "y*y*idIiw*w*y*i", &x, &lut, &exact, &inv_log_gamma, &tiny, &kmin, &pos, &neg,
                          &codes, &only))
        return NULL;
    Py_ssize_t nans = -1;
    int64_t zeros = 0;
    if (lut.len != (1 << 20) * 4 || pos.len != neg.len || pos.len % 8 || (codes.len && codes.len != x.len / 4))
        PyErr_SetString(PyExc_ValueError, "sketch: bad table, count or code buffers");
    else {
        Py_BEGIN_ALLOW_THREADS
        nans = sketch_f32(x.buf, x.len / 4, lut.buf, exact, inv_log_gamma, tiny, kmin, pos.len / 8,
                          pos.buf, neg.buf, &zeros, codes.len ? codes.buf : NULL, only);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x); PyBuffer_Release(&lut); PyBuffer_Release(&pos); PyBuffer_Release(&neg);
    PyBuffer_Release(&codes);
    if (nans < 0) return NULL;
    return Py_BuildValue("(nL)", nans, (long long)zeros);
}
