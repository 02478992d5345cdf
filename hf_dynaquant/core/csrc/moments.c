#include "kernels.h"

/* The sums the fidelity check of optimizer moments is made of (moments.py, fidelity_sums):
 * a.b, a.a, b.b and (a-b).(a-b) of two float32 arrays, accumulated in float64 in one pass
 * (four partial sums each, added at the end: the same sums as the float64 reference up to the
 * order of the additions). */
static void fidelity_f32(const float *a, const float *b, Py_ssize_t n, double out[4]) {
    double ab[4] = {0}, aa[4] = {0}, bb[4] = {0}, dd[4] = {0};
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        for (int j = 0; j < 4; j++) {
            const double x = a[i + j], y = b[i + j], d = x - y;
            ab[j] += x * y; aa[j] += x * x; bb[j] += y * y; dd[j] += d * d;
        }
    }
    for (; i < n; i++) {
        const double x = a[i], y = b[i], d = x - y;
        ab[0] += x * y; aa[0] += x * x; bb[0] += y * y; dd[0] += d * d;
    }
    out[0] = (ab[0] + ab[1]) + (ab[2] + ab[3]);
    out[1] = (aa[0] + aa[1]) + (aa[2] + aa[3]);
    out[2] = (bb[0] + bb[1]) + (bb[2] + bb[3]);
    out[3] = (dd[0] + dd[1]) + (dd[2] + dd[3]);
}

PyObject *py_fidelity_f32(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    if (!PyArg_ParseTuple(args, "y*y*", &a, &b)) return NULL;
    double out[4];
    int ok = a.len == b.len;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "fidelity: the two arrays differ in length");
    else {
        Py_BEGIN_ALLOW_THREADS
        fidelity_f32(a.buf, b.buf, a.len / 4, out);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&a); PyBuffer_Release(&b);
    return ok ? Py_BuildValue("dddd", out[0], out[1], out[2], out[3]) : NULL;
}

/* fidelity_f32(a, b) for b the float32 values of uint8 codes through a table of k values
 * (the quantizer's dequantization of codes that hold no protected value), without making b:
 * the same sums bit for bit, in one pass. Returns 0, or -1 if a code is the protected code
 * (1, whose value is stored apart) or at or beyond k (nothing is summed then). */
static int fidelity_codes_f32(const float *a, const uint8_t *codes, const float *table, Py_ssize_t k, Py_ssize_t n,
                              double out[4]) {
    float t[256] = {0};
    uint8_t bad[256];
    for (int c = 0; c < 256; c++) bad[c] = c == 1 || c >= k;
    memcpy(t, table, (size_t)(k < 256 ? k : 256) * sizeof(float));
    int any = 0;
    for (Py_ssize_t i = 0; i < n; i++) any |= bad[codes[i]];
    if (any) return -1;
    double ab[4] = {0}, aa[4] = {0}, bb[4] = {0}, dd[4] = {0};
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        for (int j = 0; j < 4; j++) {
            const double x = a[i + j], y = t[codes[i + j]], d = x - y;
            ab[j] += x * y; aa[j] += x * x; bb[j] += y * y; dd[j] += d * d;
        }
    }
    for (; i < n; i++) {
        const double x = a[i], y = t[codes[i]], d = x - y;
        ab[0] += x * y; aa[0] += x * x; bb[0] += y * y; dd[0] += d * d;
    }
    out[0] = (ab[0] + ab[1]) + (ab[2] + ab[3]);
    out[1] = (aa[0] + aa[1]) + (aa[2] + aa[3]);
    out[2] = (bb[0] + bb[1]) + (bb[2] + bb[3]);
    out[3] = (dd[0] + dd[1]) + (dd[2] + dd[3]);
    return 0;
}

PyObject *py_fidelity_codes_f32(PyObject *self, PyObject *args) {
    Py_buffer a, codes, table;
    if (!PyArg_ParseTuple(args, "y*y*y*", &a, &codes, &table)) return NULL;
    double out[4];
    int status = 0, ok = a.len == codes.len * 4 && table.len % 4 == 0;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "fidelity_codes: the values and the codes differ in length");
    else {
        Py_BEGIN_ALLOW_THREADS
        status = fidelity_codes_f32(a.buf, codes.buf, table.buf, table.len / 4, codes.len, out);
        Py_END_ALLOW_THREADS
        if (status) PyErr_SetString(PyExc_ValueError, "fidelity_codes: a code is protected or beyond the table");
    }
    PyBuffer_Release(&a); PyBuffer_Release(&codes); PyBuffer_Release(&table);
    return ok && !status ? Py_BuildValue("dddd", out[0], out[1], out[2], out[3]) : NULL;
}

/* A float32 value from float32 (bf16 = 0) or bfloat16 bits (bf16 = 1; exact). */
static inline float load(const void *p, Py_ssize_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

/* Adam's update u = m / (sqrt(v) + floor) in float32 (moments.py, adam_update), v < 0 counting
 * as 0 and NaN staying NaN, from float32 or bfloat16 moments in one pass (torch's five passes
 * took 8x longer). IEEE sqrt, add and divide: within an ulp of torch's, whose vectorised sqrt is
 * not always correctly rounded. */
static void adam_update(const void *m, int m_bf16, const void *v, int v_bf16, Py_ssize_t n, float floor, float *u) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const float vi = load(v, i, v_bf16);
        u[i] = load(m, i, m_bf16) / (sqrtf(vi < 0.0f ? 0.0f : vi) + floor); /* NaN < 0 is false */
    }
}

PyObject *py_adam_update(PyObject *self, PyObject *args) {
    Py_buffer m, v, u;
    int m_bf16, v_bf16;
    double floor;
    if (!PyArg_ParseTuple(args, "y*py*pdw*", &m, &m_bf16, &v, &v_bf16, &floor, &u)) return NULL;
    const Py_ssize_t n = u.len / 4;
    int ok = m.len == n * (m_bf16 ? 2 : 4) && v.len == n * (v_bf16 ? 2 : 4);
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "adam_update: the moments and the output differ in length");
    else {
        Py_BEGIN_ALLOW_THREADS
        adam_update(m.buf, m_bf16, v.buf, v_bf16, n, (float)floor, u.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&m); PyBuffer_Release(&v); PyBuffer_Release(&u);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* exp of a decoded Adam scale, which holds at most MAX_SCALE_LEVELS distinct values (the
 * grid's centres): each distinct value's expf is taken once and kept in a small two-way cache
 * keyed by the value's bits (a value that finds both ways taken only costs another expf). */
#define EXP_SETS 1024
typedef struct {
    uint32_t key[EXP_SETS][2];
    float value[EXP_SETS][2];
    uint8_t used[EXP_SETS]; /* ways filled, 0-2 */
    uint8_t next[EXP_SETS]; /* the way a miss replaces */
} exp_cache;

static inline float cached_expf(exp_cache *c, float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    const uint32_t set = (bits * 2654435761u) >> 22; /* the top 10 bits of a multiplicative hash */
    if (c->used[set] > 0 && c->key[set][0] == bits) return c->value[set][0];
    if (c->used[set] > 1 && c->key[set][1] == bits) return c->value[set][1];
    const float e = expf(x);
    const int way = c->used[set] < 2 ? c->used[set]++ : (c->next[set] ^= 1);
    c->key[set][way] = bits;
    c->value[set][way] = e;
    return e;
}

/* The denominator d = sqrt(v) + floor of a decoded Adam scale s (moments.py,
 * update_scale_to_adam): exp(s), with a scale gain max(exp(s) - floor, 0) * scale_gain + floor,
 * each operation rounded to float32 as torch's sequence of in-place operations rounds it (NaN
 * stays NaN: NaN < 0 is false). */
INLINE float adam_denominator(float e, float floor, float scale_gain) {
    if (scale_gain == 1.0f) return e;
    float x = e - floor;
    x = x < 0.0f ? 0.0f : x;
    return x * scale_gain + floor;
}

/* Adam's m = u * d (* gain) and v = max(d - floor, 0)^2 from a decoded update u and the
 * denominator d: the one rule of both kernels below. */
INLINE void adam_moments(float u, float d, float floor, float gain, float *m, float *v) {
    float x = u * d;
    *m = gain != 1.0f ? x * gain : x;
    float y = d - floor;
    y = y < 0.0f ? 0.0f : y;
    *v = y * y;
}

/* Adam's moments back from a decoded update u and scale s, in place: u becomes m and s becomes
 * v. One pass, with one expf per distinct scale value, where torch made six passes and an exp
 * per value. */
static void scale_to_adam_f32(float *u, float *s, Py_ssize_t n, float floor, float gain, float scale_gain,
                              exp_cache *cache) {
    for (Py_ssize_t i = 0; i < n; i++)
        adam_moments(u[i], adam_denominator(cached_expf(cache, s[i]), floor, scale_gain), floor, gain, &u[i], &s[i]);
}

PyObject *py_scale_to_adam_f32(PyObject *self, PyObject *args) {
    Py_buffer u, s;
    double floor, gain, scale_gain;
    if (!PyArg_ParseTuple(args, "w*w*ddd", &u, &s, &floor, &gain, &scale_gain)) return NULL;
    exp_cache *cache = NULL;
    if (u.len != s.len)
        PyErr_SetString(PyExc_ValueError, "scale_to_adam: the update and the scale differ in length");
    else if ((cache = PyMem_RawCalloc(1, sizeof(exp_cache))) == NULL)
        PyErr_NoMemory();
    else {
        Py_BEGIN_ALLOW_THREADS
        scale_to_adam_f32(u.buf, s.buf, u.len / 4, (float)floor, (float)gain, (float)scale_gain, cache);
        Py_END_ALLOW_THREADS
        PyMem_RawFree(cache);
    }
    PyBuffer_Release(&u); PyBuffer_Release(&s);
    if (cache == NULL) return NULL;
    Py_RETURN_NONE;
}

/* bfloat16 bits of a float32, rounded to nearest even as torch rounds (a NaN stays a NaN; torch's
 * vectorised conversion spells it 0xFFFF, its scalar one and this 0x7FC0). */
static inline uint16_t bf16_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if (x != x) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* A quantized tensor's codes (quantizer.py, decoded_values): code 0 is pruned (0), code 1 the
 * next stored bfloat16 value in order, code c >= 2 table[c] (the table being 0, 0, then the
 * centres). */
typedef struct {
    const uint8_t *codes;
    const float *table;
    Py_ssize_t ntable;
    const uint16_t *prot;
    Py_ssize_t nprot, used; /* protected values stored, and taken so far */
} coded;

INLINE float coded_value(coded *c, Py_ssize_t i) {
    const uint8_t k = c->codes[i];
    if (k != 1) return c->table[k];
    uint32_t bits = c->used < c->nprot ? (uint32_t)c->prot[c->used] << 16 : 0;
    c->used++;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

/* Whether every code names a table entry. */
static int codes_in_table(const coded *c, Py_ssize_t n) {
    uint8_t top = 0;
    for (Py_ssize_t i = 0; i < n; i++) top = c->codes[i] > top ? c->codes[i] : top;
    return n == 0 || top < c->ntable;
}

/* Adam's moments straight from the codes of a quantized update and scale: bit for bit what
 * decoding both (decoded_values) and then scale_to_adam_f32 give, written as float32 or as
 * bfloat16 (rounded as torch rounds), without the float32 update and scale ever being held
 * (a restore's largest temporaries: 8 bytes a value, where the codes take 2). The scale's
 * denominator is taken once per code; u and s count the protected values they take
 * (the caller checks them against those stored). */
static void codes_to_adam(coded *u, coded *s, Py_ssize_t n, float floor, float gain, float scale_gain, int bf16,
                          void *m_out, void *v_out) {
    float d[256];
    for (Py_ssize_t k = 0; k < s->ntable; k++) d[k] = adam_denominator(expf(s->table[k]), floor, scale_gain);
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t k = s->codes[i];
        const float di = k == 1 ? adam_denominator(expf(coded_value(s, i)), floor, scale_gain) : d[k];
        float mi, vi;
        adam_moments(coded_value(u, i), di, floor, gain, &mi, &vi);
        if (bf16) {
            ((uint16_t *)m_out)[i] = bf16_bits(mi);
            ((uint16_t *)v_out)[i] = bf16_bits(vi);
        } else {
            ((float *)m_out)[i] = mi;
            ((float *)v_out)[i] = vi;
        }
    }
}

PyObject *py_codes_to_adam(PyObject *self, PyObject *args) {
    Py_buffer cu, tu, pu, cs, ts, ps, m, v;
    double floor, gain, scale_gain;
    int bf16;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*dddpw*w*", &cu, &tu, &pu, &cs, &ts, &ps, &floor, &gain, &scale_gain,
                          &bf16, &m, &v))
        return NULL;
    const Py_ssize_t n = cu.len, width = bf16 ? 2 : 4;
    coded u = {cu.buf, tu.buf, tu.len / 4, pu.buf, pu.len / 2, 0};
    coded s = {cs.buf, ts.buf, ts.len / 4, ps.buf, ps.len / 2, 0};
    int in_table = 0;
    if (cs.len != n || m.len != width * n || v.len != width * n || u.ntable > 256 || s.ntable > 256)
        PyErr_SetString(PyExc_ValueError, "codes_to_adam: buffers disagree in length or too large a table");
    else {
        Py_BEGIN_ALLOW_THREADS
        in_table = codes_in_table(&u, n) && codes_in_table(&s, n);
        if (in_table) codes_to_adam(&u, &s, n, (float)floor, (float)gain, (float)scale_gain, bf16, m.buf, v.buf);
        Py_END_ALLOW_THREADS
        if (!in_table) PyErr_SetString(PyExc_ValueError, "a code lies beyond the stored centres");
    }
    PyBuffer_Release(&cu); PyBuffer_Release(&tu); PyBuffer_Release(&pu); PyBuffer_Release(&cs);
    PyBuffer_Release(&ts); PyBuffer_Release(&ps); PyBuffer_Release(&m); PyBuffer_Release(&v);
    return in_table ? Py_BuildValue("nn", u.used, s.used) : NULL;
}

/* exp(r) for |r| <= 1/2 to about 1e-7 relative (Taylor to degree 7; the term left out is under
 * 0.5^8 / 8! = 1e-7), as plain arithmetic the compiler can vectorise. */
static inline double exp_small(double r) {
    const double tail = 1.0 / 24 + r * (1.0 / 120 + r * (1.0 / 720 + r / 5040));
    return 1.0 + r * (1.0 + r * (1.0 / 2 + r * (1.0 / 6 + r * tail)));
}

/* Of Adam's scale s (float32; moments.py, scale_stats): whether every value is finite, the
 * maximum, and the scale gain's sum of exp(x - step * round(x / step)) for x = s - origin, in
 * float64 (rounding half to even, as torch.round; scale_gain_sums is the reference). Grid steps
 * in [1e-6, 1] (the default is 1) take a loop the compiler vectorises: the rounding by adding
 * and subtracting 1.5 * 2^52 (exact for |x / step| < 2^51, which such a step guarantees for s the
 * log of any float32, |s| < 104) and exp_small (|x - step * k| <= 1/2); other steps take nearbyint and exp. */
typedef struct { int finite; double top, gain; } scale_stats;

static scale_stats scale_stats_f32(const float *s, Py_ssize_t n, double origin, double step) {
    const double magic = 6755399441055744.0, inv = 1.0 / step;
    double gain = 0.0;
    float top = -INFINITY;
    int bad;
    if (step >= 1e-6 && step <= 1.0) {
#pragma omp simd reduction(+ : gain) reduction(max : top)
        for (Py_ssize_t i = 0; i < n; i++) {
            const double x = (double)s[i] - origin, k = (x * inv + magic) - magic;
            top = s[i] > top ? s[i] : top;
            gain += exp_small(x - step * k); /* NaN for a NaN or infinite s */
        }
        bad = !isfinite(gain);
    } else {
        bad = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            const double x = (double)s[i] - origin;
            bad |= !(x - x == 0.0);
            top = s[i] > top ? s[i] : top;
            gain += exp(x - step * nearbyint(x * inv));
        }
    }
    scale_stats st = {!bad, top, gain};
    return st;
}

PyObject *py_scale_stats_f32(PyObject *self, PyObject *args) {
    Py_buffer s;
    double origin, step;
    if (!PyArg_ParseTuple(args, "y*dd", &s, &origin, &step)) return NULL;
    scale_stats st;
    int ok = step > 0;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "scale_stats: the grid step must be positive");
    else {
        Py_BEGIN_ALLOW_THREADS
        st = scale_stats_f32(s.buf, s.len / 4, origin, step);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&s);
    return ok ? Py_BuildValue("Odd", st.finite ? Py_True : Py_False, st.top, st.gain) : NULL;
}

/* log(y) of a positive, finite, normal float32 y in float64, as plain arithmetic the compiler
 * vectorises: y = 2^e * m with m in [sqrt(2)/2, sqrt(2)), and log(m) = 2 atanh(t) for
 * t = (m - 1) / (m + 1), |t| <= 0.172, by its series to t^11 (the first term left out is
 * under 1e-10 of the result). Rounded to float32 it is the correctly rounded log but for values
 * within about 1e-10 of a rounding boundary, which may take the neighbour: within an ulp. */
static inline double log_normal(float y) {
    uint32_t b;
    memcpy(&b, &y, 4);
    const uint32_t upper = (b & 0x7fffffu) >= 0x3504f3u; /* mantissa >= sqrt(2): halve it */
    const int32_t e = (int32_t)(b >> 23) - 127 + (int32_t)upper;
    const uint32_t mb = (b & 0x7fffffu) | (0x3f800000u - (upper << 23));
    float mf;
    memcpy(&mf, &mb, 4);
    const double m = mf, t = (m - 1.0) / (m + 1.0), z = t * t;
    const double series = 1.0 + z * (1.0 / 3 + z * (1.0 / 5 + z * (1.0 / 7 + z * (1.0 / 9 + z * (1.0 / 11)))));
    return (double)e * 0.6931471805599453 + 2.0 * t * series;
}

/* Adam's scale s = log(sqrt(v) + floor) in float32 (moments.py, adam_scale), v < 0 counting as
 * 0 and NaN staying NaN, from float32 or bfloat16 v in one pass (torch's five took 6x longer).
 * IEEE sqrtf and add, then log_normal where y = sqrt(v) + floor is normal and finite (always,
 * as floor >= 1e-12, but for NaN and infinite v) and the C library's logf in a second pass
 * over the others. Returns whether every s is finite. */
/* The normal values' pass of adam_scale_f32: whether any y is not a normal finite float. */
INLINE int adam_scale_pass(const void *v, int v_bf16, Py_ssize_t n, float floor, float *s) {
    int special = 0;
#pragma omp simd reduction(| : special)
    for (Py_ssize_t i = 0; i < n; i++) {
        const float vi = load(v, i, v_bf16), y = sqrtf(vi < 0.0f ? 0.0f : vi) + floor;
        special |= !((y >= 1.17549435e-38f) & (y <= 3.40282347e+38f)); /* NaN fails both; & keeps it branch-free */
        s[i] = (float)log_normal(y);
    }
    return special;
}

SIMD_CLONES static int adam_scale_f32(const void *v, int v_bf16, Py_ssize_t n, float floor, float *s) {
    if (!(v_bf16 ? adam_scale_pass(v, 1, n, floor, s) : adam_scale_pass(v, 0, n, floor, s))) return 1;
    int finite = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        const float vi = load(v, i, v_bf16), y = sqrtf(vi < 0.0f ? 0.0f : vi) + floor;
        if (!(y >= 1.17549435e-38f && y <= 3.40282347e+38f)) {
            s[i] = logf(y);
            finite &= isfinite(s[i]) != 0;
        }
    }
    return finite;
}

PyObject *py_adam_scale(PyObject *self, PyObject *args) {
    Py_buffer v, s;
    int v_bf16;
    double floor;
    if (!PyArg_ParseTuple(args, "y*pdw*", &v, &v_bf16, &floor, &s)) return NULL;
    const Py_ssize_t n = s.len / 4;
    int ok = v.len == n * (v_bf16 ? 2 : 4);
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "adam_scale: v and the output differ in length");
    else {
        Py_BEGIN_ALLOW_THREADS
        adam_scale_f32(v.buf, v_bf16, n, (float)floor, s.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&v); PyBuffer_Release(&s);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* scale_stats_f32 of adam_scale_f32(v) without the scale: block by block through a buffer on
 * the stack (the scale of a large tensor is 4 bytes a value of new memory, and a pass). The
 * same finiteness and maximum; the gain sum the same but for the order of its additions. */
#define SCALE_BLOCK 4096
static scale_stats adam_scale_stats(const void *v, int v_bf16, Py_ssize_t n, float floor, double origin, double step) {
    scale_stats all = {1, -INFINITY, 0.0};
    float block[SCALE_BLOCK];
    const Py_ssize_t width = v_bf16 ? 2 : 4;
    for (Py_ssize_t at = 0; at < n; at += SCALE_BLOCK) {
        const Py_ssize_t k = n - at < SCALE_BLOCK ? n - at : SCALE_BLOCK;
        const int finite = adam_scale_f32((const char *)v + at * width, v_bf16, k, floor, block);
        const scale_stats part = scale_stats_f32(block, k, origin, step);
        all.finite &= finite && part.finite;
        all.top = part.top > all.top ? part.top : all.top;
        all.gain += part.gain;
    }
    return all;
}

PyObject *py_adam_scale_stats(PyObject *self, PyObject *args) {
    Py_buffer v;
    int v_bf16;
    double floor, origin, step;
    if (!PyArg_ParseTuple(args, "y*pddd", &v, &v_bf16, &floor, &origin, &step)) return NULL;
    scale_stats st;
    int ok = step > 0 && v.len % (v_bf16 ? 2 : 4) == 0;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "adam_scale_stats: the grid step must be positive, v whole values");
    else {
        Py_BEGIN_ALLOW_THREADS
        st = adam_scale_stats(v.buf, v_bf16, v.len / (v_bf16 ? 2 : 4), (float)floor, origin, step);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&v);
    return ok ? Py_BuildValue("Odd", st.finite ? Py_True : Py_False, st.top, st.gain) : NULL;
}
