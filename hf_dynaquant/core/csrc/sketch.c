#include "kernels.h"

/* Log-sketch bucket counts of float32 values (sketch.py). The key of |x| is
 * ceil(log(|x|) / log(gamma)), counted in slot key - kmin (clamped to 0..nkeys-1) of counts:
 * positive values in counts[0..nkeys), negative ones in counts[nkeys..2 nkeys), magnitudes
 * below `tiny` in counts[2 nkeys] (zeros), and +-inf in the largest slot. lut maps the top 20
 * bits of |x| (exponent and 12 mantissa bits) to the slot, or to 2 nkeys where the whole fine
 * bucket lies below tiny, or to -1 where the fine bucket straddles a key boundary, holds tiny,
 * or holds inf and NaN: those values take the exact path (log, comparisons). With `codes`
 * (uint8, one per value) only the values whose code is `only` are counted (the others go to
 * counts[2 nkeys + 1], a discard slot): the K-means sketch of the values a plan neither prunes
 * nor protects, without gathering them first. Branch-free but for the rare exact path; the
 * table look-up and the increment are all a value costs. Returns the NaN count. */

/* The slot of a magnitude u (float32 bits, sign cleared) by the exact rule; -1 for NaN. */
static Py_ssize_t exact_slot(uint32_t u, double inv_log_gamma, uint32_t tiny, int32_t kmin, Py_ssize_t nkeys) {
    if (u < tiny) return 2 * nkeys;
    if (u > 0x7F800000u) return -1;
    if (u == 0x7F800000u) return nkeys - 1;
    float f;
    memcpy(&f, &u, 4);
    Py_ssize_t slot = (Py_ssize_t)ceil(log((double)f) * inv_log_gamma) - kmin;
    return slot < 0 ? 0 : slot >= nkeys ? nkeys - 1 : slot;
}

INLINE Py_ssize_t sketch(const uint32_t *x, Py_ssize_t n, const int32_t *lut, double inv_log_gamma, uint32_t tiny,
                         int32_t kmin, Py_ssize_t nkeys, int64_t *counts, const uint8_t *codes, int only) {
    Py_ssize_t nans = 0;
    const Py_ssize_t discard = 2 * nkeys + 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint32_t bits = x[i], u = bits & 0x7FFFFFFFu;
        Py_ssize_t slot = lut[u >> 11];
        if ((size_t)slot > (size_t)(2 * nkeys)) { /* -1, or (a table not made for nkeys) out of bounds */
            slot = codes && codes[i] != only ? discard : exact_slot(u, inv_log_gamma, tiny, kmin, nkeys);
            if (slot < 0) {
                nans++;
                slot = discard;
            }
        }
        slot += (Py_ssize_t)((slot < nkeys) & (bits >> 31)) * nkeys; /* negative values' half */
        if (codes) slot = codes[i] == only ? slot : discard;
        counts[slot]++;
    }
    return nans;
}

static Py_ssize_t sketch_all(const uint32_t *x, Py_ssize_t n, const int32_t *lut, double inv_log_gamma,
                             uint32_t tiny, int32_t kmin, Py_ssize_t nkeys, int64_t *counts) {
    return sketch(x, n, lut, inv_log_gamma, tiny, kmin, nkeys, counts, NULL, 0);
}

static Py_ssize_t sketch_only(const uint32_t *x, Py_ssize_t n, const int32_t *lut, double inv_log_gamma,
                              uint32_t tiny, int32_t kmin, Py_ssize_t nkeys, int64_t *counts, const uint8_t *codes,
                              int only) {
    return sketch(x, n, lut, inv_log_gamma, tiny, kmin, nkeys, counts, codes, only);
}

PyObject *py_sketch_f32(PyObject *self, PyObject *args) {
    Py_buffer x, lut, counts, codes;
    int kmin, only;
    double inv_log_gamma;
    unsigned int tiny;
    if (!PyArg_ParseTuple(args, "y*y*dIiw*y*i", &x, &lut, &inv_log_gamma, &tiny, &kmin, &counts, &codes, &only))
        return NULL;
    Py_ssize_t nans = -1;
    const Py_ssize_t nkeys = (counts.len / 8 - 2) / 2;
    if (lut.len != (1 << 20) * 4 || counts.len % 8 || nkeys < 1 || counts.len / 8 != 2 * nkeys + 2 ||
        (codes.len && codes.len != x.len / 4))
        PyErr_SetString(PyExc_ValueError, "sketch: bad table, count or code buffers");
    else {
        Py_BEGIN_ALLOW_THREADS
        nans = codes.len ? sketch_only(x.buf, x.len / 4, lut.buf, inv_log_gamma, tiny, kmin, nkeys, counts.buf,
                                       codes.buf, only)
                         : sketch_all(x.buf, x.len / 4, lut.buf, inv_log_gamma, tiny, kmin, nkeys, counts.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x); PyBuffer_Release(&lut); PyBuffer_Release(&counts); PyBuffer_Release(&codes);
    if (nans < 0) return NULL;
    return PyLong_FromSsize_t(nans);
}
