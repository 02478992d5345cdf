#include "kernels.h"

/* Log-sketch bucket counts of float32 values (sketch.py). The key of |x| is
 * ceil(log(|x|) / log(gamma)), counted in slot key - kmin (clamped to 0..nkeys-1) of counts:
 * positive values in counts[0..nkeys), negative ones in counts[nkeys..2 nkeys), magnitudes
 * below `tiny` in counts[2 nkeys] (zeros), and +-inf in the largest slot. lut (made by
 * py_sketch_table) maps the top 20 bits of |x| (exponent and 12 mantissa bits: a fine bucket)
 * to (slot << 12) + 4096 - offset, where the fine bucket's values whose low 11 bits reach offset
 * take slot + 1 (offset 2048: none; a fine bucket is narrower than a key, so it straddles at
 * most one key boundary): the slot is (entry + low bits) >> 12. It maps to INT32_MIN (a
 * negative slot) where the bucket straddles tiny, holds inf and NaN, or more than one boundary,
 * and everywhere when the slots do not fit an entry (alpha below about 3e-4): those values take
 * the exact path (log, comparisons). With `codes` (uint8, one per
 * value) only the values whose code is `only` are counted (the others go to counts[2 nkeys +
 * 1], a discard slot): the K-means sketch of the values a plan neither prunes nor protects,
 * without gathering them first. Branch-free but for the rare exact path; the table look-up,
 * a comparison and the increment are all a value costs. Returns the NaN count, and the key
 * slots (0..nkeys-1, either sign) of the least and the largest magnitude among the values (all
 * of them, with codes too), largest < least when none: every key counted lies between them, and
 * the counts outside, in both halves, are the caller's zeros (a sketch of alpha 0.001 has
 * 158,000 slots, of which a tensor's values take a few thousand). */

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

/* The least and the largest magnitude (float32 bits, sign cleared) of x at or above tiny and not
 * NaN, in a loop the compiler vectorises; 0 when there is none. */
SIMD_CLONES static int magnitude_range(const uint32_t *x, Py_ssize_t n, uint32_t tiny, uint32_t *least,
                                       uint32_t *largest) {
    uint32_t lo = UINT32_MAX, hi = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint32_t u = x[i] & 0x7FFFFFFFu, keep = 0u - ((u >= tiny) & (u <= 0x7F800000u));
        const uint32_t low = u | ~keep, high = u & keep; /* (all ones, or 0, where not counted) */
        lo = low < lo ? low : lo;
        hi = high > hi ? high : hi;
    }
    *least = lo, *largest = hi;
    return lo <= hi;
}

INLINE Py_ssize_t sketch(const uint32_t *x, Py_ssize_t n, const int32_t *lut, double inv_log_gamma, uint32_t tiny,
                         int32_t kmin, Py_ssize_t nkeys, int64_t *counts, const uint8_t *codes, int only,
                         Py_ssize_t span[2]) {
    Py_ssize_t nans = 0, lo = nkeys, hi = -1;
    const Py_ssize_t discard = 2 * nkeys + 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint32_t bits = x[i], u = bits & 0x7FFFFFFFu;
        Py_ssize_t slot = ((int64_t)lut[u >> 11] + (int64_t)(u & 0x7FFu)) >> 12;
        if ((size_t)slot > (size_t)(2 * nkeys)) { /* the exact path's mark, or (a table not made for nkeys) out of bounds */
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
    /* the key slots counted lie between those of the least and the largest magnitude at or
     * above tiny (the slot grows with the magnitude; NaN has none) */
    uint32_t least, largest;
    if (magnitude_range(x, n, tiny, &least, &largest)) {
        lo = exact_slot(least, inv_log_gamma, tiny, kmin, nkeys);
        hi = exact_slot(largest, inv_log_gamma, tiny, kmin, nkeys);
    }
    span[0] = lo, span[1] = hi;
    return nans;
}

static Py_ssize_t sketch_all(const uint32_t *x, Py_ssize_t n, const int32_t *lut, double inv_log_gamma,
                             uint32_t tiny, int32_t kmin, Py_ssize_t nkeys, int64_t *counts, Py_ssize_t span[2]) {
    return sketch(x, n, lut, inv_log_gamma, tiny, kmin, nkeys, counts, NULL, 0, span);
}

static Py_ssize_t sketch_only(const uint32_t *x, Py_ssize_t n, const int32_t *lut, double inv_log_gamma,
                              uint32_t tiny, int32_t kmin, Py_ssize_t nkeys, int64_t *counts, const uint8_t *codes,
                              int only, Py_ssize_t span[2]) {
    return sketch(x, n, lut, inv_log_gamma, tiny, kmin, nkeys, counts, codes, only, span);
}

#define SKETCH_MAX_SLOTS (1 << 19) /* 2 nkeys + 1 slots, shifted by 12 bits, fit an int32 entry */

/* The first value (low 11 bits) of fine bucket `first`'s values that take slot lo + 1 by the exact
 * rule, where its first takes lo and its last lo + 1: from the key boundary gamma^(lo + kmin)
 * (exp of the key over inv_log_gamma), checked and moved by the exact rule a few values, else
 * found by bisection (exact_slot grows with u: adjacent float32 values are far apart next to
 * log's rounding error, so the estimate is off by a value or two at most). */
static uint32_t split_at(uint32_t first, Py_ssize_t lo, double inv_log_gamma, uint32_t tiny, int32_t kmin,
                         Py_ssize_t nkeys) {
    const float edge = (float)exp((double)(lo + kmin) / inv_log_gamma);
    uint32_t bits;
    memcpy(&bits, &edge, 4);
    if (bits > first && bits - first < 2048) {
        uint32_t at = bits - first;
        for (int step = 0; step < 4 && at > 1 && exact_slot(first | (at - 1), inv_log_gamma, tiny, kmin, nkeys) != lo;
             step++)
            at--;
        for (int step = 0; step < 4 && at < 2047 && exact_slot(first | at, inv_log_gamma, tiny, kmin, nkeys) == lo;
             step++)
            at++;
        if (exact_slot(first | at, inv_log_gamma, tiny, kmin, nkeys) != lo &&
            exact_slot(first | (at - 1), inv_log_gamma, tiny, kmin, nkeys) == lo)
            return at;
    }
    uint32_t below = 0, at = 2047; /* exact_slot(first | below) == lo, (first | at) == lo + 1 */
    while (at - below > 1) {
        const uint32_t mid = (below + at) / 2;
        if (exact_slot(first | mid, inv_log_gamma, tiny, kmin, nkeys) == lo) below = mid; else at = mid;
    }
    return at;
}

/* The lut of py_sketch_f32 for a sketch's constants, each entry by the exact rule (exact_slot) at
 * its fine bucket's ends: one slot where they agree; where they differ by one, the offset of
 * the first value of the larger slot (split_at); INT32_MIN elsewhere (tiny, inf and NaN, two
 * boundaries, or more slots than an entry holds: every value then takes the exact path). As the
 * exact rule grows with u (within the values at or above tiny, and below it), a bucket whose
 * last value takes the slot the bucket before it ended on takes it throughout: its first value
 * needs no logarithm (a table took 22 ms at alpha 0.001, 3.4 million logarithms, before). */
PyObject *py_sketch_table(PyObject *self, PyObject *args) {
    Py_buffer lut;
    int kmin;
    double inv_log_gamma;
    unsigned int tiny;
    Py_ssize_t nkeys;
    if (!PyArg_ParseTuple(args, "w*dIin", &lut, &inv_log_gamma, &tiny, &kmin, &nkeys)) return NULL;
    int ok = lut.len == (1 << 20) * 4 && nkeys >= 1;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "sketch_table: the table must hold 2^20 int32, and nkeys be positive");
    else {
        int32_t *t = lut.buf;
        const int packed = nkeys < SKETCH_MAX_SLOTS / 2; /* 2 nkeys + 1 slots fit an entry */
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t before = -1; /* the slot of the bucket before's last value; -1: none to go by */
        for (uint32_t b = 0; b < (1u << 20); b++) {
            const uint32_t first = b << 11, last = first | 0x7FFu;
            t[b] = INT32_MIN;
            if (!packed || last >= 0x7F800000u || (first < tiny && last >= tiny)) {
                before = -1;
                continue;
            }
            const Py_ssize_t hi = exact_slot(last, inv_log_gamma, tiny, kmin, nkeys);
            const Py_ssize_t lo = hi == before ? hi : exact_slot(first, inv_log_gamma, tiny, kmin, nkeys);
            before = hi;
            if (hi == lo) {
                t[b] = (int32_t)((lo << 12) + 2048);
            } else if (hi == lo + 1) {
                t[b] = (int32_t)((lo << 12) + 4096 - split_at(first, lo, inv_log_gamma, tiny, kmin, nkeys));
            }
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&lut);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

PyObject *py_sketch_f32(PyObject *self, PyObject *args) {
    Py_buffer x, lut, counts, codes;
    int kmin, only;
    double inv_log_gamma;
    unsigned int tiny;
    if (!PyArg_ParseTuple(args, "y*y*dIiw*y*i", &x, &lut, &inv_log_gamma, &tiny, &kmin, &counts, &codes, &only))
        return NULL;
    Py_ssize_t nans = -1, span[2];
    const Py_ssize_t nkeys = (counts.len / 8 - 2) / 2;
    if (lut.len != (1 << 20) * 4 || counts.len % 8 || nkeys < 1 || counts.len / 8 != 2 * nkeys + 2 ||
        (codes.len && codes.len != x.len / 4))
        PyErr_SetString(PyExc_ValueError, "sketch: bad table, count or code buffers");
    else {
        Py_BEGIN_ALLOW_THREADS
        nans = codes.len ? sketch_only(x.buf, x.len / 4, lut.buf, inv_log_gamma, tiny, kmin, nkeys, counts.buf,
                                       codes.buf, only, span)
                         : sketch_all(x.buf, x.len / 4, lut.buf, inv_log_gamma, tiny, kmin, nkeys, counts.buf, span);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x); PyBuffer_Release(&lut); PyBuffer_Release(&counts); PyBuffer_Release(&codes);
    if (nans < 0) return NULL;
    return Py_BuildValue("nnn", nans, span[0], span[1]);
}
