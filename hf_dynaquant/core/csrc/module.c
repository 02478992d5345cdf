/* The method table of hf_dynaquant.core._kernels (the kernels are in the other files). */
#include "kernels.h"

static PyMethodDef methods[] = {
    {"histogram", py_histogram, METH_VARARGS, "histogram(bits, stride, counts, width, exponent_bits)"},
    {"split", py_split, METH_VARARGS,
     "split(bits, width, exponent_bits, k, rank, head, side, rest, escapes) -> escape count"},
    {"join", py_join, METH_VARARGS,
     "join(out, width, exponent_bits, k, exponents, head, side, side_packed_bits, rest, escapes)"
     " -> escapes used or -1"},
    {"sketch_f32", py_sketch_f32, METH_VARARGS,
     "sketch_f32(values, lut, inv_log_gamma, tiny_bits, kmin, counts, codes, only) -> (nans, least key slot, largest)"},
    {"sketch_table", py_sketch_table, METH_VARARGS,
     "sketch_table(lut, inv_log_gamma, tiny_bits, kmin, nkeys): the lut of sketch_f32, by the exact rule"},
    {"select_u8", py_select_u8, METH_VARARGS,
     "select_u8(codes, code, values, out) -> count: the values (float32 or bfloat16 bits) whose code is code, in order, into out"},
    {"stochastic_codes", py_stochastic_codes, METH_VARARGS,
     "stochastic_codes(codes, w, w_bf16, centres, seed, offset, first_centre, pruned): rounding.py's"
     " stochastic_codes with uniform(seed, offset, n), in place"},
    {"partition", py_partition, METH_VARARGS,
     "partition(w, w_bf16, sens, has_sens, tau_mag, tau_sens, tau_prune, prune_by_sens, midpoints, codes)"
     " -> protected count"},
    {"feedback_block_f32", py_feedback_block_f32, METH_VARARGS,
     "feedback_block_f32(block, sens, has_sens, rows, u, tau_mag, tau_sens, tau_prune, prune_by_sens, midpoints,"
     " table, codes, errors[, trellis, c0, step]): one block of error feedback, columns one after the other"},
    {"trellis_unpack_u8", py_trellis_unpack_u8, METH_VARARGS,
     "trellis_unpack_u8(codes, kinds, levels0, levels1): stored trellis symbols back to codes in place (0, or -1: corrupt)"},
    {"trellis_round_f32", py_trellis_round_f32, METH_VARARGS,
     "trellis_round_f32(x, codes, length, across, c0, step, table): the Viterbi search over each sequence of length "
     "values (across: the columns of a length-row matrix)"},
    {"regroup_u8", py_regroup_u8, METH_VARARGS,
     "regroup_u8(values, keys, out, inverse): values stably grouped by key (or, inverse, back)"},
    {"ungroup_cyclic_u8", py_ungroup_cyclic_u8, METH_VARARGS,
     "ungroup_cyclic_u8(grouped, keys, levels, out[, counts]): (keys - grouped ungrouped by keys) mod levels"},
    {"cyclic_u8", py_cyclic_u8, METH_VARARGS,
     "cyclic_u8(a, b, levels, out[, pairs]): (a - b) mod levels; with pairs[65536], regrouped by a (out apart from "
     "a and b) and the pairs (a, difference) counted"},
    {"cyclic_packed_u8", py_cyclic_packed_u8, METH_VARARGS,
     "cyclic_packed_u8(packed, bits, base, b, levels, out, pairs): cyclic_u8's grouped difference and pairs, the "
     "first codes packed bits a code less base (pack's), unpacked a chunk at a time"},
    {"allow_simd", py_allow_simd, METH_VARARGS,
     "allow_simd(flag) -> previous: whether the grouping, partition and rANS encoder kernels may take their"
     " AVX-512 paths (for tests)"},
    {"simd_paths", py_simd_paths, METH_NOARGS,
     "simd_paths() -> the AVX-512 paths the kernels take on this CPU now: 1 the partition, 2 the grouping,"
     " 4 the rANS encoder (0 while allow_simd(False))"},
    {"pair_up_u8", py_pair_up_u8, METH_VARARGS,
     "pair_up_u8(values, sizes, levels, out, counts): each group's values two to a byte, then the odd groups' last"},
    {"unpair_u8", py_unpair_u8, METH_VARARGS, "unpair_u8(symbols, sizes, levels, out): the inverse of pair_up_u8"},
    {"gap_up_u8", py_gap_up_u8, METH_VARARGS,
     "gap_up_u8(values, sizes, levels, tokens, token_counts, hist, changed) -> tokens written: each group's gaps"
     " before its values that are not 0 (and their histogram), and those values less 1"},
    {"ungap_u8", py_ungap_u8, METH_VARARGS,
     "ungap_u8(tokens, token_counts, changed, sizes, levels, out): the inverse of gap_up_u8"},
    {"uleb128_encode_u64", py_uleb128_encode_u64, METH_VARARGS,
     "uleb128_encode_u64(values, out) -> bytes written: the LEB128 bytes of uint64 values"},
    {"uleb128_decode_u64", py_uleb128_decode_u64, METH_VARARGS,
     "uleb128_decode_u64(data, out) -> values decoded, -1 for a stream cut inside a value, -2 for one past 10 bytes"},
    {"byte_counts", py_byte_counts, METH_VARARGS, "byte_counts(symbols, counts): counts[256] of each byte value"},
    {"pair_counts", py_pair_counts, METH_VARARGS, "pair_counts(keys, values, counts): counts[256 * key + value]"},
    {"factored_sums", py_factored_sums, METH_VARARGS,
     "factored_sums(codes, rows, row_sums, col_sums): a matrix of uint8 codes' row and column sums (int64)"},
    {"cyclic_factored_u8", py_cyclic_factored_u8, METH_VARARGS,
     "cyclic_factored_u8(row_terms, col_terms, contexts, b, levels, out, pairs): cyclic_u8's grouped difference and pairs, "
     "the first codes the factored contexts of row and column terms"},
    {"ungroup_factored_u8", py_ungroup_factored_u8, METH_VARARGS,
     "ungroup_factored_u8(grouped, row_terms, col_terms, contexts, levels, out): the codes (a - d) mod levels from "
     "differences grouped by the factored contexts a"},
    {"factored_counts", py_factored_counts, METH_VARARGS,
     "factored_counts(row_terms, col_terms, contexts, count): how many codes take each factored context (int64, 256)"},
    {"factored_contexts", py_factored_contexts, METH_VARARGS,
     "factored_contexts(row_terms, col_terms, contexts, out): clip(r[i] + c[j], 0, contexts - 1) (int16 terms, uint8 out)"},
    {"fidelity_f32", py_fidelity_f32, METH_VARARGS, "fidelity_f32(a, b) -> (a.b, a.a, b.b, (a-b).(a-b)) in float64"},
    {"fidelity_codes_f32", py_fidelity_codes_f32, METH_VARARGS,
     "fidelity_codes_f32(a, codes, table) -> fidelity_f32(a, table[codes]) (no protected code)"},
    {"adam_update", py_adam_update, METH_VARARGS, "adam_update(m, m_bf16, v, v_bf16, floor, u): Adam's update, float32"},
    {"scale_stats_f32", py_scale_stats_f32, METH_VARARGS,
     "scale_stats_f32(s, origin, step) -> (all finite, maximum, scale gain sum)"},
    {"adam_scale", py_adam_scale, METH_VARARGS, "adam_scale(v, v_bf16, floor, s): Adam's scale log(sqrt(v) + floor), float32"},
    {"adam_scale_stats", py_adam_scale_stats, METH_VARARGS,
     "adam_scale_stats(v, v_bf16, floor, origin, step) -> scale_stats_f32 of adam_scale's s, without s"},
    {"scale_to_adam_f32", py_scale_to_adam_f32, METH_VARARGS,
     "scale_to_adam_f32(u, s, floor, gain, scale_gain): u, s become Adam's m, v in place"},
    {"codes_to_adam", py_codes_to_adam, METH_VARARGS,
     "codes_to_adam(u_codes, u_table, u_protected, s_codes, s_table, s_protected, floor, gain, scale_gain, bf16, m, v)"
     " -> protected values taken (update, scale)"},
    {"dequantize_u8", py_dequantize_u8, METH_VARARGS,
     "dequantize_u8(codes, table, protected, ref, has_ref, out) -> protected codes"},
    {"pack", py_pack, METH_VARARGS, "pack(values, bits, out, base=0) -> all fit: b-bit values less base packed LSB first"},
    {"ans_encode", py_ans_encode, METH_VARARGS,
     "ans_encode(symbols, cdf, cdf_offsets, cdf_symbols, starts, stops, lanes) -> (the lanes' rANS words, each lane's"
     " word count), or a group holding a symbol past its table"},
    {"ans_decode", py_ans_decode, METH_VARARGS,
     "ans_decode(words, lane_bounds, cdf, cdf_offsets, sizes, starts, stops, out, hist) -> every lane ended empty"},
    {"lloyd_f64", py_lloyd_f64, METH_VARARGS,
     "lloyd_f64(points, weights, cum_w, cum_wx, centres, max_iter): weighted 1-D k-means's iterations, in place"},
    {"unpack", py_unpack, METH_VARARGS, "unpack(packed, bits, values, base=0): inverse of pack"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "Compiled kernels of hf_dynaquant.core (see hf_dynaquant.core.kernels).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
