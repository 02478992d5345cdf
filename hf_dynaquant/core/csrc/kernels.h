/* The compiled kernels of hf_dynaquant.core (the extension module hf_dynaquant.core._kernels).
 * Each computes exactly what its numpy reference does, in one pass over the data and with the
 * GIL released; buffers are little-endian and contiguous, and the Python wrappers check sizes.
 *   bitplanes.c  the float bit-plane split and join of bitplanes.py (FORMAT.md section 8), and
 *                dense b-bit packing;
 *   sketch.c     log-sketch bucket counts of float32 values and their look-up table (sketch.py);
 *   partition.c  DynaQuant's partition and code assignment of float32 or bfloat16 weights
 *                (AVX-512 where the CPU has it, chosen at run time), a block of
 *                error feedback over it (feedback.py), and codes back to float32 values
 *                (quantizer.py);
 *   rounding.c   stochastic rounding of a partition's codes, its uniform numbers made as each
 *                value is read (rounding.py);
 *   moments.c    the float64 sums of the optimizer moments' fidelity check, Adam's update
 *                and scale, the finiteness, maximum and scale-gain sum of the scale, and Adam's
 *                moments back from a decoded update and scale, or from their codes (moments.py);
 *   delta.c      the delta encoder's cyclic difference and regrouping of uint8 codes by the
 *                previous codes, kept packed or not, or by factored contexts (delta.py; AVX-512
 *                VBMI2 where the CPU has it, chosen at run time), and counts of uint8 symbols and of pairs of them
 *                (histogram.py);
 *   varint.c     unsigned LEB128 varints of uint64 values, and back (varint.py);
 *   factored.c   a matrix of codes' row and column sums, each code's context from row and
 *                column terms, and the columns' classes of equal terms, by which delta.c groups
 *                codes on those contexts and counts them (factored.py);
 *   ans.c        rANS coding of uint8 symbols, constriction's streams bit for bit (ans.py; the
 *                encoder's eight lanes in one AVX-512 vector where the CPU has it);
 *   kmeans.c     the Lloyd iterations of weighted 1-D k-means (kmeans.py);
 *   trellis.c    trellis-coded quantization: the Viterbi search inside a block of error feedback,
 *                and the decoder's state machine (trellis.py);
 *   module.c     the module's method table. */
#ifndef HF_DYNAQUANT_KERNELS_H
#define HF_DYNAQUANT_KERNELS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* A function the compiler must inline (specialised for its constant arguments at each call). */
#define INLINE static inline __attribute__((always_inline))

/* Value i of w: float32, or bfloat16 bits (WB) widened exactly (the partition and the stochastic
 * rounding read a bfloat16 tensor as it is). */
INLINE float weight_at(const int WB, const void *restrict w, Py_ssize_t i) {
    if (!WB) return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}
/* A loop the compiler vectorises, built three times on x86-64 Linux with glibc (the loader picks
 * the x86-64-v4 build, AVX-512, where the CPU has it, else AVX2, else the baseline SSE2 build,
 * through an ifunc, which musl lacks); the same results either way, as the loops are elementwise
 * or reduce in an order-free way and setup.py turns off contracting a * b + c into one rounding
 * (the v4 build has FMA). Compilers that do not know x86-64-v4 (GCC before 11) build two.
 * Elsewhere it is built once, for the baseline. */
#if defined(__has_attribute)
#if __has_attribute(target_clones) && defined(__linux__) && defined(__x86_64__) && defined(__GLIBC__)
#if defined(__clang__) || __GNUC__ >= 11
#define SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#endif
#ifndef SIMD_CLONES
#define SIMD_CLONES
#endif

PyObject *py_histogram(PyObject *self, PyObject *args);
PyObject *py_split(PyObject *self, PyObject *args);
PyObject *py_join(PyObject *self, PyObject *args);
PyObject *py_pack(PyObject *self, PyObject *args);
PyObject *py_unpack(PyObject *self, PyObject *args);
/* n values of b bits (1 to 8) from in, as py_pack packed them, each plus base, into v. */
void dq_unpack_bits(const uint8_t *in, Py_ssize_t n, int b, uint8_t base, uint8_t *v);
PyObject *py_sketch_f32(PyObject *self, PyObject *args);
PyObject *py_sketch_table(PyObject *self, PyObject *args);
PyObject *py_partition(PyObject *self, PyObject *args);
PyObject *py_select_u8(PyObject *self, PyObject *args);
PyObject *py_stochastic_codes(PyObject *self, PyObject *args);
PyObject *py_lloyd_f64(PyObject *self, PyObject *args);
PyObject *py_feedback_block_f32(PyObject *self, PyObject *args);
PyObject *py_trellis_unpack_u8(PyObject *self, PyObject *args);
PyObject *py_trellis_round_f32(PyObject *self, PyObject *args);
void trellis_round_f32(const float *x, Py_ssize_t n, double c0, double step, const float *table, Py_ssize_t levels,
                       uint8_t *codes, uint8_t *scratch);
PyObject *py_fidelity_f32(PyObject *self, PyObject *args);
PyObject *py_fidelity_codes_f32(PyObject *self, PyObject *args);
PyObject *py_adam_update(PyObject *self, PyObject *args);
PyObject *py_scale_stats_f32(PyObject *self, PyObject *args);
PyObject *py_adam_scale(PyObject *self, PyObject *args);
PyObject *py_adam_scale_stats(PyObject *self, PyObject *args);
PyObject *py_scale_to_adam_f32(PyObject *self, PyObject *args);
PyObject *py_codes_to_adam(PyObject *self, PyObject *args);
PyObject *py_dequantize_u8(PyObject *self, PyObject *args);
PyObject *py_regroup_u8(PyObject *self, PyObject *args);
PyObject *py_byte_counts(PyObject *self, PyObject *args);
PyObject *py_pair_counts(PyObject *self, PyObject *args);
PyObject *py_factored_sums(PyObject *self, PyObject *args);
PyObject *py_factored_contexts(PyObject *self, PyObject *args);
PyObject *py_cyclic_factored_u8(PyObject *self, PyObject *args);
PyObject *py_ungroup_factored_u8(PyObject *self, PyObject *args);
PyObject *py_factored_counts(PyObject *self, PyObject *args);

/* Whether each of n int16 terms lies within +-2^12 (what the factored kernels assume: r + c fits an int16). */
INLINE int terms_bounded(const int16_t *t, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (t[i] < -(1 << 12) || t[i] > (1 << 12)) return 0;
    return 1;
}

/* A factored matrix's contexts by class (factored.c): rows x cols codes, row i's context at
 * column j clip(r[i] + c[j], 0, top). Its columns ordered stably by their term, order[0..cols),
 * fall in classes of equal terms, class k holding order[start[k] .. start[k + 1]) with term
 * value[k], ascending: a row takes one context over each class, and the contexts grow with k.
 * So the codes of one context in one row are one class's (unless two classes or more clip to
 * the same end context), a run of columns known before the codes are read. */
typedef struct {
    const int16_t *r, *c;
    Py_ssize_t rows, cols, classes;
    int16_t top;
    int32_t *order, *start;
    int16_t *value;
} factored_t;
int factored_init(factored_t *f, const int16_t *r, Py_ssize_t rows, const int16_t *c, Py_ssize_t cols, int contexts);
void factored_free(factored_t *f);
void factored_counts(const factored_t *f, int64_t count[256]);
int factored_fits(const Py_buffer *r, const Py_buffer *c, int contexts);

/* The context of class k in a row of term r. */
INLINE int class_context(const factored_t *f, int r, Py_ssize_t k) {
    const int v = r + f->value[k];
    return v < 0 ? 0 : v > f->top ? f->top : v;
}

/* Whether each context of a row of term r holds one class (else two classes or more clip to an
 * end context, whose codes are then taken in column order). */
INLINE int row_by_class(const factored_t *f, int r) {
    return f->classes < 2 || (r + f->value[1] > 0 && r + f->value[f->classes - 2] < f->top);
}
PyObject *py_cyclic_u8(PyObject *self, PyObject *args);
PyObject *py_cyclic_packed_u8(PyObject *self, PyObject *args);
PyObject *py_pair_up_u8(PyObject *self, PyObject *args);
PyObject *py_unpair_u8(PyObject *self, PyObject *args);
PyObject *py_gap_up_u8(PyObject *self, PyObject *args);
PyObject *py_ungap_u8(PyObject *self, PyObject *args);
PyObject *py_uleb128_encode_u64(PyObject *self, PyObject *args);
PyObject *py_uleb128_decode_u64(PyObject *self, PyObject *args);
PyObject *py_allow_simd(PyObject *self, PyObject *args);
PyObject *py_simd_paths(PyObject *self, PyObject *args);
/* The hand-written vector paths this CPU has and kernels may take (py_allow_simd: tests turn
 * them off): DQ_AVX512F (the partition), DQ_AVX512_VBMI2 (the grouping), DQ_AVX512DQ (the rANS
 * encoder's 8 lanes), DQ_AVX512BW (count_small's widest build) and DQ_AVX2 (the partition without
 * AVX-512, count_small's 32-byte build); asked of the CPU once. */
#define DQ_AVX512F 1
#define DQ_AVX512_VBMI2 2
#define DQ_AVX512DQ 4
#define DQ_AVX512BW 8
#define DQ_AVX2 16
int dq_simd_paths(void);
PyObject *py_ungroup_cyclic_u8(PyObject *self, PyObject *args);
PyObject *py_ans_encode(PyObject *self, PyObject *args);
PyObject *py_ans_decode(PyObject *self, PyObject *args);

#endif
