/* Single-pass kernels for the float bit-plane split of bitplanes.py (see its docstring and
 * FORMAT.md section 8). They compute exactly what the numpy reference does, in one pass over
 * the data and with the GIL released, so chunks encode and decode in parallel threads.
 * Buffers are little-endian and contiguous; the Python wrapper checks sizes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exponent histogram of every `stride`-th element */
#define HIST(W)                                                                              \
    static void hist_##W(const uint##W##_t *x, Py_ssize_t n, Py_ssize_t stride, int e,       \
                         int64_t *counts) {                                                  \
        const unsigned emask = (1u << e) - 1;                                                \
        for (Py_ssize_t i = 0; i < n; i += stride) {                                         \
            unsigned u = (unsigned)(x[i] >> (W - 16));                                       \
            counts[(u >> (15 - e)) & emask]++;                                               \
        }                                                                                    \
    }

/* head = rank << k | top k mantissa bits; side = next mantissa bits + sign; rest = low W-16 */
#define SPLIT(W)                                                                             \
    static Py_ssize_t split_##W(const uint##W##_t *x, Py_ssize_t n, int e, int k,            \
                                const uint8_t *rank, uint8_t *head, uint8_t *side,           \
                                uint8_t *rest, uint16_t *esc) {                              \
        const int sb = 16 - e - k;                                                           \
        const unsigned cap = (1u << (8 - k)) - 1, emask = (1u << e) - 1;                     \
        const unsigned kmask = (1u << k) - 1, smask = (1u << (sb - 1)) - 1;                  \
        Py_ssize_t nesc = 0;                                                                 \
        for (Py_ssize_t i = 0; i < n; i++) {                                                 \
            const uint##W##_t v = x[i];                                                      \
            const unsigned u = (unsigned)(v >> (W - 16));                                    \
            const unsigned ex = (u >> (15 - e)) & emask, r = rank[ex];                       \
            head[i] = (uint8_t)((r << k) | ((u >> (sb - 1)) & kmask));                       \
            side[i] = (uint8_t)((u & smask) | ((u >> 15) << (sb - 1)));                      \
            if (r == cap) esc[nesc++] = (uint16_t)ex;                                        \
            if (W == 32) ((uint16_t *)rest)[i] = (uint16_t)v;                                \
            if (W == 64) {                                                                   \
                ((uint32_t *)rest)[i] = (uint32_t)v;                                         \
                ((uint16_t *)(rest + 4 * n))[i] = (uint16_t)((uint64_t)v >> 32);             \
            }                                                                                \
        }                                                                                    \
        return nesc;                                                                         \
    }

/* inverse of split for elements [i0, i1); side[0] belongs to element i0; *j counts the escapes
 * consumed so far. Returns -1 if there are too few escapes. */
#define JOIN(W)                                                                              \
    static int join_##W(uint##W##_t *x, Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t n, int e,   \
                        int k, const uint16_t *hl, const uint16_t *sl, const uint8_t *head,  \
                        const uint8_t *side, const uint8_t *rest, const uint16_t *esc,       \
                        Py_ssize_t nesc, Py_ssize_t *j) {                                    \
        const unsigned cap = (1u << (8 - k)) - 1;                                            \
        for (Py_ssize_t i = i0; i < i1; i++) {                                               \
            unsigned u = hl[head[i]] | sl[side[i - i0]];                                     \
            if ((unsigned)(head[i] >> k) == cap) {                                           \
                if (*j >= nesc) return -1;                                                   \
                u |= (unsigned)esc[(*j)++] << (15 - e);                                      \
            }                                                                                \
            uint##W##_t v = (uint##W##_t)((uint##W##_t)u << (W - 16));                       \
            if (W == 32) v |= ((const uint16_t *)rest)[i];                                   \
            if (W == 64)                                                                     \
                v |= (uint##W##_t)((uint64_t)((const uint32_t *)rest)[i] |                  \
                                   ((uint64_t)((const uint16_t *)(rest + 4 * n))[i] << 32)); \
            x[i] = v;                                                                        \
        }                                                                                    \
        return 0;                                                                            \
    }

HIST(16) HIST(32) HIST(64)
SPLIT(16) SPLIT(32) SPLIT(64)
JOIN(16) JOIN(32) JOIN(64)

/* b-bit values (b <= 8, one per byte) packed densely, least significant bits first.
 * Eight values fill exactly b bytes, so the bulk runs eight at a time through a 64-bit word;
 * one copy of the loop per b lets the compiler unroll it. */
#define PACK8(B)                                                                             \
    static Py_ssize_t pack8_##B(const uint8_t *v, Py_ssize_t n, uint8_t *out) {              \
        Py_ssize_t i = 0;                                                                    \
        for (; i + 8 <= n; i += 8, out += B) {                                               \
            uint64_t w = 0;                                                                  \
            for (int j = 0; j < 8; j++) w |= (uint64_t)(v[i + j] & ((1u << B) - 1)) << (j * B); \
            for (int j = 0; j < B; j++) out[j] = (uint8_t)(w >> (8 * j));                   \
        }                                                                                    \
        return i;                                                                            \
    }                                                                                        \
    static Py_ssize_t unpack8_##B(const uint8_t *in, Py_ssize_t n, uint8_t *v) {             \
        Py_ssize_t i = 0;                                                                    \
        for (; i + 8 <= n; i += 8, in += B) {                                                \
            uint64_t w = 0;                                                                  \
            for (int j = 0; j < B; j++) w |= (uint64_t)in[j] << (8 * j);                     \
            for (int j = 0; j < 8; j++) v[i + j] = (uint8_t)((w >> (j * B)) & ((1u << B) - 1)); \
        }                                                                                    \
        return i;                                                                            \
    }
PACK8(1) PACK8(2) PACK8(3) PACK8(4) PACK8(5) PACK8(6) PACK8(7) PACK8(8)

typedef Py_ssize_t (*pack_fn)(const uint8_t *, Py_ssize_t, uint8_t *);
static const pack_fn PACKERS[9] = {NULL, pack8_1, pack8_2, pack8_3, pack8_4, pack8_5, pack8_6, pack8_7, pack8_8};
static const pack_fn UNPACKERS[9] = {NULL, unpack8_1, unpack8_2, unpack8_3, unpack8_4,
                                     unpack8_5, unpack8_6, unpack8_7, unpack8_8};

static void pack_bits(const uint8_t *v, Py_ssize_t n, int b, uint8_t *out) {
    Py_ssize_t i = PACKERS[b](v, n, out), o = i / 8 * b;
    uint64_t w = 0;
    int filled = 0;
    for (; i < n; i++, filled += b) w |= (uint64_t)(v[i] & ((1u << b) - 1)) << filled;
    for (; filled > 0; filled -= 8) { out[o++] = (uint8_t)w; w >>= 8; }
}

static void unpack_bits(const uint8_t *in, Py_ssize_t n, int b, uint8_t *v) {
    Py_ssize_t i = UNPACKERS[b](in, n, v), p = i / 8 * b;
    if (i < n) {
        uint64_t w = 0;
        const Py_ssize_t rest = (n * b + 7) / 8 - p;
        for (Py_ssize_t j = 0; j < rest; j++) w |= (uint64_t)in[p + j] << (8 * j);
        for (int j = 0; i < n; i++, j++) v[i] = (uint8_t)((w >> (j * b)) & ((1u << b) - 1));
    }
}

static PyObject *py_pack(PyObject *self, PyObject *args) {
    Py_buffer v, out;
    int b;
    if (!PyArg_ParseTuple(args, "y*iw*", &v, &b, &out)) return NULL;
    int ok = b >= 1 && b <= 8 && out.len >= (v.len * b + 7) / 8;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        pack_bits(v.buf, v.len, b, out.buf);
        Py_END_ALLOW_THREADS
    } else PyErr_SetString(PyExc_ValueError, "pack: bits must be 1..8 and the output large enough");
    PyBuffer_Release(&v); PyBuffer_Release(&out);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_unpack(PyObject *self, PyObject *args) {
    Py_buffer in, v;
    int b;
    if (!PyArg_ParseTuple(args, "y*iw*", &in, &b, &v)) return NULL;
    int ok = b >= 1 && b <= 8 && in.len == (v.len * b + 7) / 8;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        unpack_bits(in.buf, v.len, b, v.buf);
        Py_END_ALLOW_THREADS
    } else PyErr_SetString(PyExc_ValueError, "unpack: packed length does not match the value count");
    PyBuffer_Release(&in); PyBuffer_Release(&v);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* Log-sketch bucket counts of float32 values (sketch.py). The key of |x| is
 * ceil(log(|x|) / log(gamma)); lut maps the top 20 bits of |x| (exponent and 12 mantissa bits)
 * to that key when the whole fine bucket shares it, else to `exact` (then log is computed).
 * Magnitudes below `tiny` count as zero; +-inf take the largest key. Returns the NaN count. */
static Py_ssize_t sketch_f32(const uint32_t *x, Py_ssize_t n, const int32_t *lut, int32_t exact,
                             double inv_log_gamma, uint32_t tiny, int32_t kmin, Py_ssize_t nkeys,
                             int64_t *pos, int64_t *neg, int64_t *zeros) {
    Py_ssize_t nans = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
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

static PyObject *py_sketch_f32(PyObject *self, PyObject *args) {
    Py_buffer x, lut, pos, neg;
    int exact, kmin;
    double inv_log_gamma;
    unsigned int tiny;
    if (!PyArg_ParseTuple(args, "y*y*idIiw*w*", &x, &lut, &exact, &inv_log_gamma, &tiny, &kmin, &pos, &neg))
        return NULL;
    Py_ssize_t nans = -1;
    int64_t zeros = 0;
    if (lut.len != (1 << 20) * 4 || pos.len != neg.len || pos.len % 8)
        PyErr_SetString(PyExc_ValueError, "sketch: bad table or count buffers");
    else {
        Py_BEGIN_ALLOW_THREADS
        nans = sketch_f32(x.buf, x.len / 4, lut.buf, exact, inv_log_gamma, tiny, kmin, pos.len / 8,
                          pos.buf, neg.buf, &zeros);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x); PyBuffer_Release(&lut); PyBuffer_Release(&pos); PyBuffer_Release(&neg);
    if (nans < 0) return NULL;
    return Py_BuildValue("(nL)", nans, (long long)zeros);
}

/* DynaQuant partition and code assignment (quantizer.py), one pass over float32 weights:
 * code 1 if protected (|w| > tau_mag, or sens > tau_sens), else 0 if pruned (metric <
 * tau_prune, or metric exactly 0, the metric being |w| or sens; tau_prune < 0 disables pruning),
 * else 2 + the nearest of the sorted centres (2 when there are none yet). Returns the number of
 * protected values. */
static Py_ssize_t partition_f32(const float *w, const float *sens, Py_ssize_t n, double tau_mag,
                                double tau_sens, double tau_prune, int prune_by_sens,
                                const float *mids, Py_ssize_t nmids, uint8_t *codes) {
    Py_ssize_t nprot = 0, top = 1;
    while (top * 2 <= nmids) top *= 2;
    for (Py_ssize_t i = 0; i < n; i++) {
        const double a = fabs((double)w[i]);
        const double s = sens ? (double)sens[i] : 0.0;
        if (a > tau_mag || (sens && s > tau_sens)) { codes[i] = 1; nprot++; continue; }
        const double m = prune_by_sens && sens ? s : a;
        if (tau_prune >= 0 && (m < tau_prune || m == 0)) { codes[i] = 0; continue; }
        /* the number of midpoints below w is the nearest centre's index (branch-free search) */
        const float x = w[i];
        Py_ssize_t lo = 0;
        for (Py_ssize_t step = top; step > 0; step >>= 1)
            lo += (lo + step <= nmids && mids[lo + step - 1] < x) ? step : 0;
        codes[i] = (uint8_t)(2 + lo);
    }
    return nprot;
}

static PyObject *py_partition_f32(PyObject *self, PyObject *args) {
    Py_buffer w, sens, mids, codes;
    double tau_mag, tau_sens, tau_prune;
    int prune_by_sens, has_sens;
    if (!PyArg_ParseTuple(args, "y*y*pdddpy*w*", &w, &sens, &has_sens, &tau_mag, &tau_sens, &tau_prune,
                          &prune_by_sens, &mids, &codes))
        return NULL;
    Py_ssize_t n = w.len / 4, nprot = -1;
    if (codes.len != n || (has_sens && sens.len != w.len) || mids.len / 4 > 253)
        PyErr_SetString(PyExc_ValueError, "partition: buffers disagree in length or too many centres");
    else {
        Py_BEGIN_ALLOW_THREADS
        nprot = partition_f32(w.buf, has_sens ? sens.buf : NULL, n, tau_mag, tau_sens, tau_prune,
                              prune_by_sens, mids.buf, mids.len / 4, codes.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&w); PyBuffer_Release(&sens); PyBuffer_Release(&mids); PyBuffer_Release(&codes);
    return nprot < 0 ? NULL : PyLong_FromSsize_t(nprot);
}

static int check_width(int width) {
    if (width != 16 && width != 32 && width != 64) {
        PyErr_SetString(PyExc_ValueError, "width must be 16, 32 or 64");
        return 0;
    }
    return 1;
}

static PyObject *py_histogram(PyObject *self, PyObject *args) {
    Py_buffer x, counts;
    int width, e;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "y*nw*ii", &x, &stride, &counts, &width, &e)) return NULL;
    if (!check_width(width) || stride < 1) goto fail;
    Py_ssize_t n = x.len / (width / 8);
    Py_BEGIN_ALLOW_THREADS
    if (width == 16) hist_16(x.buf, n, stride, e, counts.buf);
    else if (width == 32) hist_32(x.buf, n, stride, e, counts.buf);
    else hist_64(x.buf, n, stride, e, counts.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x); PyBuffer_Release(&counts);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&x); PyBuffer_Release(&counts);
    return NULL;
}

static PyObject *py_split(PyObject *self, PyObject *args) {
    Py_buffer x, rank, head, side, rest, esc;
    int width, e, k;
    if (!PyArg_ParseTuple(args, "y*iiiy*w*w*w*w*", &x, &width, &e, &k, &rank, &head, &side, &rest, &esc))
        return NULL;
    Py_ssize_t nesc = -1;
    if (check_width(width)) {
        Py_ssize_t n = x.len / (width / 8);
        Py_BEGIN_ALLOW_THREADS
        if (width == 16) nesc = split_16(x.buf, n, e, k, rank.buf, head.buf, side.buf, rest.buf, esc.buf);
        else if (width == 32) nesc = split_32(x.buf, n, e, k, rank.buf, head.buf, side.buf, rest.buf, esc.buf);
        else nesc = split_64(x.buf, n, e, k, rank.buf, head.buf, side.buf, rest.buf, esc.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x); PyBuffer_Release(&rank); PyBuffer_Release(&head);
    PyBuffer_Release(&side); PyBuffer_Release(&rest); PyBuffer_Release(&esc);
    return nesc < 0 ? NULL : PyLong_FromSsize_t(nesc);
}

#define JOIN_BLOCK 4096 /* side values unpacked at a time (a multiple of 8, fits in L1) */

/* join all n elements; a packed side stream (b > 0 bits per value) is unpacked block by block */
static Py_ssize_t join_all(int width, void *x, Py_ssize_t n, int e, int k, const uint16_t *exps,
                           const uint8_t *head, const uint8_t *side, int b, const uint8_t *rest,
                           const uint16_t *esc, Py_ssize_t nesc) {
    const int sb = 16 - e - k;
    const unsigned cap = (1u << (8 - k)) - 1;
    uint16_t hl[256], sl[256];
    uint8_t block[JOIN_BLOCK];
    for (unsigned c = 0; c < 256; c++) {
        hl[c] = (uint16_t)((exps[(c >> k) & cap] << (15 - e)) | ((c & ((1u << k) - 1)) << (sb - 1)));
        sl[c] = (uint16_t)((c & ((1u << (sb - 1)) - 1)) | (((c >> (sb - 1)) & 1) << 15));
    }
    Py_ssize_t j = 0;
    for (Py_ssize_t i0 = 0; i0 < n; i0 += JOIN_BLOCK) {
        const Py_ssize_t i1 = i0 + JOIN_BLOCK < n ? i0 + JOIN_BLOCK : n;
        const uint8_t *sv = side + i0;
        if (b) {
            unpack_bits(side + i0 / 8 * b, i1 - i0, b, block);
            sv = block;
        }
        int rc = width == 16 ? join_16(x, i0, i1, n, e, k, hl, sl, head, sv, rest, esc, nesc, &j)
               : width == 32 ? join_32(x, i0, i1, n, e, k, hl, sl, head, sv, rest, esc, nesc, &j)
                             : join_64(x, i0, i1, n, e, k, hl, sl, head, sv, rest, esc, nesc, &j);
        if (rc) return -1;
    }
    return j;
}

static PyObject *py_join(PyObject *self, PyObject *args) {
    Py_buffer x, exps, head, side, rest, esc;
    int width, e, k, b;
    if (!PyArg_ParseTuple(args, "w*iiiy*y*y*iy*y*", &x, &width, &e, &k, &exps, &head, &side, &b, &rest, &esc))
        return NULL;
    Py_ssize_t used = -2, n = head.len;
    if (b < 0 || b > 8 || side.len != (b ? (n * b + 7) / 8 : n))
        PyErr_SetString(PyExc_ValueError, "join: side stream length does not match the element count");
    else if (check_width(width)) {
        Py_BEGIN_ALLOW_THREADS
        used = join_all(width, x.buf, n, e, k, exps.buf, head.buf, side.buf, b, rest.buf, esc.buf, esc.len / 2);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x); PyBuffer_Release(&exps); PyBuffer_Release(&head);
    PyBuffer_Release(&side); PyBuffer_Release(&rest); PyBuffer_Release(&esc);
    return used == -2 ? NULL : PyLong_FromSsize_t(used);
}

static PyMethodDef methods[] = {
    {"histogram", py_histogram, METH_VARARGS, "histogram(bits, stride, counts, width, exponent_bits)"},
    {"split", py_split, METH_VARARGS,
     "split(bits, width, exponent_bits, k, rank, head, side, rest, escapes) -> escape count"},
    {"join", py_join, METH_VARARGS,
     "join(out, width, exponent_bits, k, exponents, head, side, side_packed_bits, rest, escapes)"
     " -> escapes used or -1"},
    {"sketch_f32", py_sketch_f32, METH_VARARGS,
     "sketch_f32(values, lut, exact, inv_log_gamma, tiny_bits, kmin, pos, neg) -> (nans, zeros)"},
    {"partition_f32", py_partition_f32, METH_VARARGS,
     "partition_f32(w, sens, has_sens, tau_mag, tau_sens, tau_prune, prune_by_sens, midpoints, codes)"
     " -> protected count"},
    {"pack", py_pack, METH_VARARGS, "pack(values, bits, out): b-bit values packed LSB first"},
    {"unpack", py_unpack, METH_VARARGS, "unpack(packed, bits, values): inverse of pack"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bitplanes",
                                    "Compiled kernels of hf_dynaquant.core.bitplanes.", -1, methods};

PyMODINIT_FUNC PyInit__bitplanes(void) { return PyModule_Create(&module); }
