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
