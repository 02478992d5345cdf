#include "kernels.h"

/* Unsigned LEB128 varints (varint.py): 7 bits a byte, least significant first, the high bit set
 * on every byte but a value's last. rANS tables, gap streams' token counts and every length
 * prefix are a few to a few thousand of them, so the cost was numpy's: about twenty array
 * operations a call, 30-40 us, which a 124M delta save paid about 900 times with the interpreter
 * lock held. The bytes are the numpy reference's (tested against it). */

/* uleb128_encode_u64(values, out) -> bytes written (out: at least 10 a value). */
PyObject *py_uleb128_encode_u64(PyObject *self, PyObject *args) {
    Py_buffer values, out;
    if (!PyArg_ParseTuple(args, "y*w*", &values, &out)) return NULL;
    const Py_ssize_t n = values.len / 8;
    int ok = values.len % 8 == 0 && out.len / 10 >= n;
    Py_ssize_t o = 0;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "uleb128_encode: values must be uint64, and out hold 10 bytes a value");
    else {
        const uint64_t *v = values.buf;
        uint8_t *b = out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t x = v[i];
            while (x >= 0x80) { b[o++] = (uint8_t)(x | 0x80); x >>= 7; }
            b[o++] = (uint8_t)x;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&values); PyBuffer_Release(&out);
    if (!ok) return NULL;
    return PyLong_FromSsize_t(o);
}

/* uleb128_decode_u64(data, out) -> values decoded, or -1 when the stream ends inside a value, -2
 * when a value takes more than 10 bytes (out: at least one a byte). Bits past 64 of a tenth
 * byte are dropped, as the numpy reference drops them. */
PyObject *py_uleb128_decode_u64(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    if (!PyArg_ParseTuple(args, "y*w*", &data, &out)) return NULL;
    int ok = out.len % 8 == 0 && out.len / 8 >= data.len;
    Py_ssize_t count = 0;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "uleb128_decode: out must be uint64, one a byte of data");
    else {
        const uint8_t *b = data.buf;
        uint64_t *u = out.buf;
        const Py_ssize_t n = data.len;
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t i = 0;
        while (i < n && count >= 0) {
            uint64_t x = 0;
            int j = 0;
            for (;; j++) {
                if (i >= n) { count = -1; break; }
                if (j == 10) { count = -2; break; }
                const uint8_t c = b[i++];
                x |= (uint64_t)(c & 0x7F) << (7 * j); /* (j = 9: the low bit only, as numpy's shift wraps) */
                if (!(c & 0x80)) break;
            }
            if (count >= 0) u[count++] = x;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data); PyBuffer_Release(&out);
    if (!ok) return NULL;
    return PyLong_FromSsize_t(count);
}
