/* The float bit-plane split and join of bitplanes.py (see its docstring and FORMAT.md section
 * 8), and dense b-bit packing. */
#include "kernels.h"

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

/* b-bit values (b <= 8, one per byte) packed densely, least significant bits first, each less
 * a base (mod 256): v - base is what is packed, and the bits of every v - base are OR-ed into
 * *seen, so that the caller learns in the same pass whether any value fell outside base ..
 * base + 2^b - 1 (its bits above the b low ones). Unpacking adds the base back. Eight values fill
 * exactly b bytes, so the bulk runs eight at a time through a 64-bit word; one copy of the loop
 * per b lets the compiler unroll it. */
#define PACK8(B)                                                                             \
    static Py_ssize_t pack8_##B(const uint8_t *v, Py_ssize_t n, uint8_t base, uint8_t *out,   \
                                uint8_t *seen) {                                             \
        Py_ssize_t i = 0;                                                                    \
        uint8_t any = 0;                                                                     \
        for (; i + 8 <= n; i += 8, out += B) {                                               \
            uint64_t w = 0;                                                                  \
            for (int j = 0; j < 8; j++) {                                                    \
                const uint8_t x = (uint8_t)(v[i + j] - base);                                \
                any |= x;                                                                    \
                w |= (uint64_t)(x & ((1u << B) - 1)) << (j * B);                             \
            }                                                                                \
            for (int j = 0; j < B; j++) out[j] = (uint8_t)(w >> (8 * j));                   \
        }                                                                                    \
        *seen |= any;                                                                        \
        return i;                                                                            \
    }                                                                                        \
    static Py_ssize_t unpack8_##B(const uint8_t *in, Py_ssize_t n, uint8_t base, uint8_t *v) { \
        Py_ssize_t i = 0;                                                                    \
        for (; i + 8 <= n; i += 8, in += B) {                                                \
            uint64_t w = 0;                                                                  \
            for (int j = 0; j < B; j++) w |= (uint64_t)in[j] << (8 * j);                     \
            for (int j = 0; j < 8; j++) v[i + j] = (uint8_t)(((w >> (j * B)) & ((1u << B) - 1)) + base); \
        }                                                                                    \
        return i;                                                                            \
    }
PACK8(3) PACK8(5) PACK8(6) PACK8(7) PACK8(8)

/* Codes are packed 1, 2 or 4 bits to a value (FORMAT.md "pack<N>+<B>"), whole values to a byte:
 * a byte at a time, in loops the compiler vectorises (packing 2.8x faster at 4 bits), and
 * unpacked through a table of each byte's 8 / B values, the base added (4-6x faster). The bytes
 * are those of the loops above. */
#define PACK_WHOLE(B)                                                                                \
    SIMD_CLONES static Py_ssize_t pack8_##B(const uint8_t *restrict v, Py_ssize_t n, uint8_t base,   \
                                            uint8_t *restrict out, uint8_t *seen) {                 \
        const Py_ssize_t whole = n / (8 / B);                                                        \
        uint8_t any = 0;                                                                             \
        for (Py_ssize_t k = 0; k < whole; k++) {                                                     \
            uint8_t w = 0;                                                                           \
            for (int j = 0; j < 8 / B; j++) {                                                        \
                const uint8_t x = (uint8_t)(v[k * (8 / B) + j] - base);                              \
                any |= x;                                                                            \
                w |= (uint8_t)((x & ((1u << B) - 1)) << (j * B));                                    \
            }                                                                                        \
            out[k] = w;                                                                              \
        }                                                                                            \
        *seen |= any;                                                                                \
        return whole * (8 / B);                                                                      \
    }                                                                                                \
    static Py_ssize_t unpack8_##B(const uint8_t *restrict in, Py_ssize_t n, uint8_t base, uint8_t *restrict v) { \
        uint8_t table[256][8 / B];                                                                   \
        for (int x = 0; x < 256; x++)                                                                \
            for (int j = 0; j < 8 / B; j++) table[x][j] = (uint8_t)(((x >> (j * B)) & ((1u << B) - 1)) + base); \
        const Py_ssize_t whole = n / (8 / B);                                                        \
        for (Py_ssize_t k = 0; k < whole; k++) memcpy(v + k * (8 / B), table[in[k]], 8 / B);        \
        return whole * (8 / B);                                                                      \
    }
PACK_WHOLE(1) PACK_WHOLE(2) PACK_WHOLE(4)

typedef Py_ssize_t (*pack_fn)(const uint8_t *, Py_ssize_t, uint8_t, uint8_t *, uint8_t *);
typedef Py_ssize_t (*unpack_fn)(const uint8_t *, Py_ssize_t, uint8_t, uint8_t *);
static const pack_fn PACKERS[9] = {NULL, pack8_1, pack8_2, pack8_3, pack8_4, pack8_5, pack8_6, pack8_7, pack8_8};
static const unpack_fn UNPACKERS[9] = {NULL, unpack8_1, unpack8_2, unpack8_3, unpack8_4,
                                       unpack8_5, unpack8_6, unpack8_7, unpack8_8};

/* Returns the OR of every v - base (its bits above the b low ones: values outside the range). */
static uint8_t pack_bits(const uint8_t *v, Py_ssize_t n, int b, uint8_t base, uint8_t *out) {
    uint8_t seen = 0;
    Py_ssize_t i = PACKERS[b](v, n, base, out, &seen), o = i * b / 8; /* (i * b: whole bytes) */
    uint64_t w = 0;
    int filled = 0;
    for (; i < n; i++, filled += b) {
        const uint8_t x = (uint8_t)(v[i] - base);
        seen |= x;
        w |= (uint64_t)(x & ((1u << b) - 1)) << filled;
    }
    for (; filled > 0; filled -= 8) { out[o++] = (uint8_t)w; w >>= 8; }
    return seen;
}

void dq_unpack_bits(const uint8_t *in, Py_ssize_t n, int b, uint8_t base, uint8_t *v) {
    Py_ssize_t i = UNPACKERS[b](in, n, base, v), p = i * b / 8;
    if (i < n) {
        uint64_t w = 0;
        const Py_ssize_t rest = (n * b + 7) / 8 - p;
        for (Py_ssize_t j = 0; j < rest; j++) w |= (uint64_t)in[p + j] << (8 * j);
        for (int j = 0; i < n; i++, j++) v[i] = (uint8_t)(((w >> (j * b)) & ((1u << b) - 1)) + base);
    }
}

/* pack(values, bits, out, base=0) -> whether every value lies in base .. base + 2^bits - 1
 * (the packing is written either way; a caller refuses it when not). */
PyObject *py_pack(PyObject *self, PyObject *args) {
    Py_buffer v, out;
    int b, base = 0;
    if (!PyArg_ParseTuple(args, "y*iw*|i", &v, &b, &out, &base)) return NULL;
    int ok = b >= 1 && b <= 8 && base >= 0 && base <= 255 && out.len >= (v.len * b + 7) / 8;
    uint8_t seen = 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        seen = pack_bits(v.buf, v.len, b, (uint8_t)base, out.buf);
        Py_END_ALLOW_THREADS
    } else PyErr_SetString(PyExc_ValueError, "pack: bits must be 1..8, base 0..255 and the output large enough");
    PyBuffer_Release(&v); PyBuffer_Release(&out);
    if (!ok) return NULL;
    return PyBool_FromLong(b == 8 || (seen >> b) == 0);
}

/* unpack(packed, bits, values, base=0): inverse of pack; base + 2^bits - 1 must stay under 256. */
PyObject *py_unpack(PyObject *self, PyObject *args) {
    Py_buffer in, v;
    int b, base = 0;
    if (!PyArg_ParseTuple(args, "y*iw*|i", &in, &b, &v, &base)) return NULL;
    int ok = b >= 1 && b <= 8 && base >= 0 && base + (1 << b) - 1 <= 255 && in.len == (v.len * b + 7) / 8;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        dq_unpack_bits(in.buf, v.len, b, (uint8_t)base, v.buf);
        Py_END_ALLOW_THREADS
    } else PyErr_SetString(PyExc_ValueError,
                           "unpack: packed length does not match the value count, or values would pass 255");
    PyBuffer_Release(&in); PyBuffer_Release(&v);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static int check_width(int width) {
    if (width != 16 && width != 32 && width != 64) {
        PyErr_SetString(PyExc_ValueError, "width must be 16, 32 or 64");
        return 0;
    }
    return 1;
}

PyObject *py_histogram(PyObject *self, PyObject *args) {
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

PyObject *py_split(PyObject *self, PyObject *args) {
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
            dq_unpack_bits(side + i0 / 8 * b, i1 - i0, b, 0, block);
            sv = block;
        }
        int rc = width == 16 ? join_16(x, i0, i1, n, e, k, hl, sl, head, sv, rest, esc, nesc, &j)
               : width == 32 ? join_32(x, i0, i1, n, e, k, hl, sl, head, sv, rest, esc, nesc, &j)
                             : join_64(x, i0, i1, n, e, k, hl, sl, head, sv, rest, esc, nesc, &j);
        if (rc) return -1;
    }
    return j;
}

PyObject *py_join(PyObject *self, PyObject *args) {
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
