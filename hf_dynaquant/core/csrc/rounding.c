#include "kernels.h"

/* Stochastic rounding of a partition's codes (rounding.py's stochastic_codes, bit for bit), each
 * value's uniform number made as the value is read (rounding.py's uniform: SplitMix64 of the seed
 * and the element's index), so no array of them is made: numpy made them with a dozen passes over
 * 8-byte integers, and the rounding with a dozen more over gathered copies, some 150 ns a value
 * against about 4 here, the centres' codes vectorised (with AVX-512; the other builds of the loop
 * are scalar, 12-20 ns) (a 124M model's saves after a restore took
 * 4-5x a save before one). The float32 operations are numpy's, in its order, so the codes are the
 * same:
 *   a code of a centre i (code >= first): x rounds to the other centre j bracketing it (i + 1
 *     above c[i], else i - 1, clipped to the centres) when u < (x - c[i]) / (c[j] - c[i]) (0 for
 *     a gap of 0); only with two centres or more;
 *   a pruned code: x rounds to the centre k nearest it (the count of midpoints (c[m] + c[m+1]) / 2
 *     below x), or, when that one lies across zero, the innermost centre on x's side, when
 *     u < min(|x| / max(|c[k]|, 1e-30), 1) and c[k] lies on x's side (x not 0);
 *   others (protected) are kept. */

static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ull, M1 = 0xBF58476D1CE4E5B9ull, M2 = 0x94D049BB133111EBull;

/* rounding.py's uniform for element `index`. */
INLINE float uniform_at(uint64_t seed, uint64_t index) {
    uint64_t z = (index + 1) * GOLDEN + seed;
    z = (z ^ (z >> 30)) * M1;
    z = (z ^ (z >> 27)) * M2;
    z ^= z >> 31;
    return (float)(int32_t)(z >> 40) * (1.0f / (float)(1 << 24)); /* (24 bits: exact) */
}

/* numpy's sign as far as comparisons go: NaN equals no other sign. */
INLINE int sign_of(float x) { return x > 0 ? 1 : x < 0 ? -1 : x == 0 ? 0 : 2; }

/* The centres' codes of codes[0..n) rounded (the first rule), without a branch on the value
 * (which way a value rounds is a coin toss the CPU cannot predict), so the loop vectorises where
 * the CPU allows; pruned and protected codes kept. Returns 1 if a code lies past the centres. */
INLINE int round_centres(const int WB, uint8_t *restrict codes, const void *restrict w, Py_ssize_t n,
                         const float *restrict c, int top, uint64_t seed, uint64_t offset, int first) {
    int past = 0;
#pragma omp simd reduction(| : past)
    for (Py_ssize_t i = 0; i < n; i++) {
        const int code = codes[i], on = code >= first;
        int at = on ? code - first : 0;
        past |= at > top;
        at = at > top ? top : at;
        const float x = weight_at(WB, w, i), ci = c[at];
        int j = at - 1 + 2 * (x > ci);
        j = j < 0 ? 0 : j;
        j = j > top ? top : j;
        const float gap = c[j] - ci, ratio = (x - ci) / (gap != 0 ? gap : 1.0f), step = gap != 0 ? ratio : 0.0f;
        const int up = on & (uniform_at(seed, offset + (uint64_t)i) < step);
        codes[i] = (uint8_t)(up ? j + first : code);
    }
    return past;
}

SIMD_CLONES static int round_centres_f32(uint8_t *codes, const void *w, Py_ssize_t n, const float *c, int top,
                                         uint64_t seed, uint64_t offset, int first) {
    return round_centres(0, codes, w, n, c, top, seed, offset, first);
}

SIMD_CLONES static int round_centres_bf16(uint8_t *codes, const void *w, Py_ssize_t n, const float *c, int top,
                                          uint64_t seed, uint64_t offset, int first) {
    return round_centres(1, codes, w, n, c, top, seed, offset, first);
}

/* Rounds codes[0..n) in place: the centres' codes in one vectorised pass, then the pruned ones
 * (the second rule; a tenth of the values, with a branch each). Returns -1 for a code past the
 * centres (a partition never makes one), else 0. */
static int stochastic_codes(uint8_t *codes, const void *w, int wb, Py_ssize_t n, const float *c, Py_ssize_t k,
                            uint64_t seed, uint64_t offset, int first, int pruned, float *mids) {
    const Py_ssize_t top = k - 1;
    if (top > 0 && (wb ? round_centres_bf16 : round_centres_f32)(codes, w, n, c, (int)top, seed, offset, first))
        return -1;
    if (top == 0)
        for (Py_ssize_t i = 0; i < n; i++)
            if (codes[i] > first) return -1;
    Py_ssize_t zero = 0; /* centres at or below 0: c[zero:] are > 0 */
    for (Py_ssize_t m = 0; m < k; m++) zero += c[m] <= 0;
    for (Py_ssize_t m = 0; m < top; m++) mids[m] = (c[m + 1] + c[m]) / 2;
    const uint8_t *at = codes, *end = codes + n;
    while ((at = memchr(at, pruned, (size_t)(end - at))) != NULL) {
        const Py_ssize_t i = at++ - codes;
        const float x = weight_at(wb, w, i);
        Py_ssize_t nearest = 0;
        while (nearest < top && mids[nearest] < x) nearest++;
        if (x != x) nearest = top; /* (numpy sorts NaN past every midpoint) */
        Py_ssize_t inner = x > 0 ? zero : zero - 1;
        inner = inner < 0 ? 0 : inner > top ? top : inner;
        const Py_ssize_t near = sign_of(c[nearest]) == sign_of(x) ? nearest : inner;
        if (sign_of(c[near]) != sign_of(x) || x == 0) continue;
        const float scale = fabsf(c[near]) > 1e-30f ? fabsf(c[near]) : 1e-30f, q = fabsf(x) / scale;
        const float p = q > 1 ? 1.0f : q; /* (NaN stays NaN: np.minimum's, never below) */
        if (uniform_at(seed, offset + (uint64_t)i) < p) codes[i] = (uint8_t)(near + first);
    }
    return 0;
}

PyObject *py_stochastic_codes(PyObject *self, PyObject *args) {
    Py_buffer codes, w, centres;
    int wb, first, pruned;
    unsigned long long seed, offset;
    if (!PyArg_ParseTuple(args, "w*y*py*KKii", &codes, &w, &wb, &centres, &seed, &offset, &first, &pruned))
        return NULL;
    const Py_ssize_t size = wb ? 2 : 4, k = centres.len / 4;
    int status = -2;
    float *mids = NULL;
    if (w.len != codes.len * size || centres.len % 4 || k < 1 || k > 254 || first < 1 || first > 255 || pruned < 0 ||
        pruned >= first)
        PyErr_SetString(PyExc_ValueError, "stochastic_codes: one value per code, 1 to 254 float32 centres, "
                                          "0 <= pruned < first_centre");
    else if ((mids = malloc((size_t)k * sizeof(float))) == NULL)
        PyErr_NoMemory();
    else {
        Py_BEGIN_ALLOW_THREADS
        status = stochastic_codes(codes.buf, w.buf, wb, codes.len, centres.buf, k, (uint64_t)seed, (uint64_t)offset,
                                  first, pruned, mids);
        Py_END_ALLOW_THREADS
        if (status < 0) PyErr_SetString(PyExc_ValueError, "stochastic_codes: a code past the centres");
    }
    free(mids);
    PyBuffer_Release(&codes); PyBuffer_Release(&w); PyBuffer_Release(&centres);
    return status < 0 ? NULL : Py_NewRef(Py_None);
}
