#include "kernels.h"

/* The Lloyd iterations of weighted 1-D k-means over sorted points (kmeans.py's weighted_kmeans),
 * bit for bit what its numpy loop computes, with the GIL released: in Python each iteration is
 * a dozen small numpy calls, which a background save's thread would hold the GIL for while the
 * training loop waits on it.
 *
 * Cluster j holds points[bounds[j] .. bounds[j+1]): bounds are numpy's searchsorted of the
 * midpoints between consecutive centres (side="right"); its mass and weighted sum are
 * differences of the prefix sums cum_w and cum_wx. An empty cluster keeps its centre, then the
 * empty clusters, in order, take the points worst served (largest weight * squared distance to
 * their centre, the lowest index first among equals: a stable argsort of -err), and the centres
 * are sorted. The iterations stop when the bounds repeat, or after max_iter. */

/* numpy's binary search (npysort/binsearch.cpp), walked the same way, so that it answers as
 * numpy does on any array, sorted or not. right: side="right", else side="left". */
static void searchsorted(const double *arr, Py_ssize_t n, const double *keys, Py_ssize_t n_keys, int right,
                         Py_ssize_t *out) {
    Py_ssize_t lo = 0, hi = n;
    double last = n_keys ? keys[0] : 0.0;
    for (Py_ssize_t i = 0; i < n_keys; i++) {
        const double key = keys[i];
        if (right ? !(key < last) : last < key) {
            hi = n;
        } else {
            lo = 0;
            hi = hi < n ? hi + 1 : n;
        }
        last = key;
        while (lo < hi) {
            const Py_ssize_t mid = lo + ((hi - lo) >> 1);
            if (right ? !(key < arr[mid]) : arr[mid] < key)
                lo = mid + 1;
            else
                hi = mid;
        }
        out[i] = lo;
    }
}

static void midpoints(const double *c, Py_ssize_t k, double *mids) {
    for (Py_ssize_t j = 0; j + 1 < k; j++) mids[j] = (c[j + 1] + c[j]) / 2;
}

static void sort_doubles(double *c, Py_ssize_t k) { /* k is a codebook's size: insertion sort */
    for (Py_ssize_t i = 1; i < k; i++) {
        const double x = c[i];
        Py_ssize_t j = i;
        for (; j > 0 && x < c[j - 1]; j--) c[j] = c[j - 1];
        c[j] = x;
    }
}

/* Returns 0, or -1 when memory ran out. */
static int lloyd(const double *p, const double *w, const double *cum_w, const double *cum_wx, Py_ssize_t m,
                        double *c, Py_ssize_t k, Py_ssize_t max_iter) {
    Py_ssize_t *bounds = malloc(sizeof(Py_ssize_t) * (size_t)(k + 1) * 2), *assigned = NULL;
    Py_ssize_t *chosen = malloc(sizeof(Py_ssize_t) * (size_t)k);
    double *mids = malloc(sizeof(double) * (size_t)(k > 1 ? k - 1 : 1)), *err = NULL;
    unsigned char *empty = malloc((size_t)k), *taken = NULL;
    Py_ssize_t it = 0, have_bounds = 0, *old = bounds, *now = bounds + k + 1;
    if (bounds == NULL || chosen == NULL || mids == NULL || empty == NULL) goto fail;
    for (; it < max_iter; it++) {
        midpoints(c, k, mids);
        now[0] = 0;
        now[k] = m;
        searchsorted(p, m, mids, k - 1, 1, now + 1);
        if (have_bounds && memcmp(old, now, sizeof(Py_ssize_t) * (size_t)(k + 1)) == 0) break;
        Py_ssize_t *swap = old;
        old = now;
        now = swap;
        have_bounds = 1;
        Py_ssize_t n_empty = 0;
        for (Py_ssize_t j = 0; j < k; j++) {
            const double mass = cum_w[old[j + 1]] - cum_w[old[j]], sum = cum_wx[old[j + 1]] - cum_wx[old[j]];
            empty[j] = mass <= 0;
            if (empty[j])
                n_empty++;
            else
                c[j] = sum / mass;
        }
        if (n_empty) { /* re-seed the empty clusters at the points worst served */
            if (err == NULL) {
                err = malloc(sizeof(double) * (size_t)m);
                assigned = malloc(sizeof(Py_ssize_t) * (size_t)m);
                taken = calloc((size_t)m, 1);
                if (err == NULL || assigned == NULL || taken == NULL) goto fail;
            }
            midpoints(c, k, mids);
            searchsorted(mids, k - 1, p, m, 0, assigned);
            for (Py_ssize_t i = 0; i < m; i++) {
                const double d = p[i] - c[assigned[i]];
                err[i] = w[i] * (d * d);
            }
            Py_ssize_t j = 0, n_chosen = 0;
            for (Py_ssize_t e = 0; e < n_empty; e++) { /* (m > k points: there is always one left) */
                Py_ssize_t best = -1;
                for (Py_ssize_t i = 0; i < m; i++)
                    if (!taken[i] && (best < 0 || err[i] > err[best])) best = i;
                taken[best] = 1;
                chosen[n_chosen++] = best;
            }
            for (Py_ssize_t e = 0; e < n_chosen; e++) {
                while (!empty[j]) j++;
                c[j++] = p[chosen[e]];
            }
            for (Py_ssize_t e = 0; e < n_chosen; e++) taken[chosen[e]] = 0;
        }
        sort_doubles(c, k);
    }
    free(bounds), free(chosen), free(mids), free(empty), free(err), free(assigned), free(taken);
    return 0;
fail:
    free(bounds), free(chosen), free(mids), free(empty), free(err), free(assigned), free(taken);
    return -1;
}

/* lloyd_f64(points, weights, cum_w, cum_wx, centres, max_iter): centres (float64, k of them,
 * seeded, fewer than the points) are updated in place. The points and prefix sums must
 * be finite: numpy orders NaN last, this code does not compare them at all. */
PyObject *py_lloyd_f64(PyObject *self, PyObject *args) {
    Py_buffer p, w, cw, cwx, c;
    Py_ssize_t max_iter;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*n", &p, &w, &cw, &cwx, &c, &max_iter)) return NULL;
    const Py_ssize_t m = p.len / 8, k = c.len / 8;
    PyObject *result = NULL;
    if (w.len != p.len || cw.len != (m + 1) * 8 || cwx.len != (m + 1) * 8 || k < 1 || m <= k) {
        PyErr_SetString(PyExc_ValueError, "lloyd_f64: points, weights, prefix sums or centres of the wrong size");
    } else {
        int failed;
        Py_BEGIN_ALLOW_THREADS
        failed = lloyd(p.buf, w.buf, cw.buf, cwx.buf, m, c.buf, k, max_iter);
        Py_END_ALLOW_THREADS
        if (failed) {
            PyErr_NoMemory();
        } else {
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    PyBuffer_Release(&p), PyBuffer_Release(&w), PyBuffer_Release(&cw), PyBuffer_Release(&cwx), PyBuffer_Release(&c);
    return result;
}
