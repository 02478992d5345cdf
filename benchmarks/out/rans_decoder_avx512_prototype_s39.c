/* Session 39: an AVX-512 decoder for the 8-lane rANS streams, measured and not kept (RESULTS,
 * "Restores along a chain, session 39"). It replaced decode_8 in csrc/ans.c (py_ans_decode chose it
 * where dq_simd_paths() & DQ_AVX512DQ) and decoded the same symbols as the plain loops on all 346
 * streams of a 124M delta (272M symbols); it needs ans.c's model_t, decode_symbol, model_symbol,
 * in_registers, lanes_begin / lanes_empty (the scalar decoder's state set-up and end check, split
 * out of decode()) and a byte counter exported from delta.c (dq_count_bytes).
 *
 * Per stream, ns a symbol (vector / plain loops, best of two x 10 decodes, this machine, AMD EPYC;
 * the code below):
 *   10-level weights' delta, 0.09 bits a symbol   1.59 / 1.63
 *   4-level update's delta, 0.61 bits             1.55 / 1.79
 *   4-level update's pairs, 1.85 bits             2.92 / 2.12
 *   15-level scale's pairs, 2.77 bits             2.88 / 2.65 (plain loops: alphabet > 32)
 *   34-level embedding, 0.28 bits                 2.18 / 1.67 (plain loops, then a count pass)
 * A first version that gathered each lane's slot (slot_t, 2048 of them) and, masked, the next
 * word of every lane: 3.07 against 2.79 ns over all streams; perf put a third of its time on the
 * gathers' results. Eight lanes are one chain of states in one vector: each row waits on the
 * symbol's look-up and a multiply, where the plain loops overlap eight. */

/* The decoder of 8 lanes with AVX-512 (F, DQ, BW, VL): the 8 states in one vector, a row of 8
 * symbols a step; the symbols are decode(8, ...)'s, the same arithmetic lane by lane. Up to
 * COUNT_SYMBOLS symbols, a lane's symbol is the count of its group's starts at or below its
 * quantile (compares in the vector) and its frequency and start come from registers (permutes);
 * larger alphabets take the plain loops. Lanes below 2^32 read their next word one by one (the
 * vector stored and reloaded). The rows a group begins or ends in are decoded by decode_symbol,
 * and a group's histogram is counted once it is decoded. (The first version, slower: each lane's
 * slot gathered from the 2048-entry slot table, and every lane's next word gathered, masked.) */
#define COUNT_SYMBOLS 32 /* the largest alphabet whose symbols the vector decoder finds by counting */

AVX512DQ static int decode_8_avx512(DECODE_ARGS) {
    uint64_t st[8] __attribute__((aligned(64)));
    int64_t top[8] __attribute__((aligned(64)));
    lanes_begin(8, w, b, st, top);
    const __m512i qmask = _mm512_set1_epi64(QMASK);
    for (Py_ssize_t g = 0; g < n; g++) {
        model_init(m, cdf + off[g], (int)k[g]);
        const uint8_t *first = m->first;
        const slot_t *sl = m->slot;
        const uint32_t *c = m->cdf;
        const int kg = m->k;
        const int64_t a = start[g], z = stop[g];
        int64_t row = a & ~(int64_t)7;
        for (; row < z && (row < a || row + 8 > z); row += 8) /* rows the group begins or ends in */
            for (int j = 0; j < 8; j++)
                if (row + j >= a && row + j < z) out[row + j] = decode_symbol(&st[j], &top[j], b[j], w, sl, first, c, kg);
        if (row + 8 <= z && kg <= COUNT_SYMBOLS) {
            __m512i bc[COUNT_SYMBOLS]; /* c[1..kg-1], each in every lane */
            uint64_t fl[64] __attribute__((aligned(64)));
            __m512i t[8];
            for (int s = 0; s < 64; s++) fl[s] = s < kg ? (c[s + 1] - c[s]) | (uint64_t)c[s] << 32 : 0;
            for (int i = 0; i < 8; i++) t[i] = _mm512_load_si512(fl + 8 * i);
            for (int s = 1; s < kg; s++) bc[s] = _mm512_set1_epi64(c[s]);
            __m512i x = _mm512_load_si512(st);
            const __m512i one = _mm512_set1_epi64(1);
            for (; row + 8 <= z; row += 8) {
                const __m512i q = _mm512_and_si512(x, qmask);
                __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0; /* the symbol: the starts at or below q */
                int s = 1;
                for (; s + 4 <= kg; s += 4) {
                    s0 = _mm512_mask_add_epi64(s0, _mm512_cmpge_epu64_mask(q, bc[s]), s0, one);
                    s1 = _mm512_mask_add_epi64(s1, _mm512_cmpge_epu64_mask(q, bc[s + 1]), s1, one);
                    s2 = _mm512_mask_add_epi64(s2, _mm512_cmpge_epu64_mask(q, bc[s + 2]), s2, one);
                    s3 = _mm512_mask_add_epi64(s3, _mm512_cmpge_epu64_mask(q, bc[s + 3]), s3, one);
                }
                for (; s < kg; s++) s0 = _mm512_mask_add_epi64(s0, _mm512_cmpge_epu64_mask(q, bc[s]), s0, one);
                const __m512i sym = _mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3));
                const __m512i e = in_registers(sym, kg, t);
                const __m512i freq = _mm512_and_si512(e, _mm512_set1_epi64(0xffffffff)), left = _mm512_srli_epi64(e, 32);
                x = _mm512_add_epi64(_mm512_mullo_epi64(_mm512_srli_epi64(x, PRECISION), freq), _mm512_sub_epi64(q, left));
                _mm_storel_epi64((__m128i *)(out + row), _mm512_cvtepi64_epi8(sym));
                const __mmask8 pull = _mm512_cmplt_epu64_mask(x, _mm512_set1_epi64((long long)STATE_LOW));
                if (pull) { /* lanes below 2^32 read their next word, if they have one */
                    _mm512_store_si512(st, x);
                    for (unsigned r = pull; r; r &= r - 1) {
                        const int j = __builtin_ctz(r);
                        if (top[j] > b[j]) st[j] = (st[j] << 32) | w[--top[j]];
                    }
                    x = _mm512_load_si512(st);
                }
            }
            _mm512_store_si512(st, x);
        }
        for (; row + 8 <= z; row += 8) /* whole rows of a larger alphabet: the lanes unrolled */
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) out[row + j] = decode_symbol(&st[j], &top[j], b[j], w, sl, first, c, kg);
        for (; row < z; row += 8) /* the last row */
            for (int j = 0; j < 8; j++)
                if (row + j < z) out[row + j] = decode_symbol(&st[j], &top[j], b[j], w, sl, first, c, kg);
        int64_t counts[256];
        dq_count_bytes(out + a, z - a, counts);
        memcpy(h + off[g], counts, (size_t)kg * sizeof(int64_t)); /* (every symbol decoded is below kg) */
    }
    return lanes_empty(8, b, st, top);
}

/* The 32-lane prototype (a format extension: "ans32"; MAX_LANES 32, valid_lanes and the Python
 * checks let 32 through, encode(32, ...) and decode(32, ...) instantiated as the plain loops):
 * four vectors of 8 states, so four chains overlap. Same symbols as the plain loops on every
 * stream of a 124M delta re-encoded at 32 lanes; figures in rans_decoder_lanes32_s39.log. */
#define COUNT_SYMBOLS 32
/* 32 lanes in four vectors: four chains of states overlap. */
AVX512DQ static int decode_32_avx512(DECODE_ARGS) {
    uint64_t st[32] __attribute__((aligned(64)));
    int64_t top[32] __attribute__((aligned(64)));
    for (int j = 0; j < 32; j++) {
        top[j] = b[j + 1];
        st[j] = 0;
        if (top[j] > b[j]) {
            st[j] = w[--top[j]];
            while (top[j] > b[j]) {
                st[j] = (st[j] << 32) | w[--top[j]];
                if (st[j] >= STATE_LOW) break;
            }
        }
    }
    const __m512i qmask = _mm512_set1_epi64(QMASK), one = _mm512_set1_epi64(1), lowst = _mm512_set1_epi64((long long)STATE_LOW);
    __m512i lowv[4];
    for (int v = 0; v < 4; v++) lowv[v] = _mm512_loadu_si512(b + 8 * v);
    for (Py_ssize_t g = 0; g < n; g++) {
        model_init(m, cdf + off[g], (int)k[g]);
        const uint8_t *first = m->first;
        const slot_t *sl = m->slot;
        const uint32_t *c = m->cdf;
        const int kg = m->k;
        const int64_t a = start[g], z = stop[g];
        int64_t row = a & ~(int64_t)31;
        for (; row < z && (row < a || row + 32 > z); row += 32)
            for (int j = 0; j < 32; j++)
                if (row + j >= a && row + j < z) out[row + j] = decode_symbol(&st[j], &top[j], b[j], w, sl, first, c, kg);
        if (row + 32 <= z) {
            __m512i bc[COUNT_SYMBOLS];
            uint64_t fl[64] __attribute__((aligned(64)));
            __m512i t[8];
            const int counted = kg <= COUNT_SYMBOLS;
            for (int s = 0; s < 64; s++) fl[s] = s < kg ? (c[s + 1] - c[s]) | (uint64_t)c[s] << 32 : 0;
            for (int i = 0; i < 8; i++) t[i] = _mm512_load_si512(fl + 8 * i);
            for (int s = 1; s < kg && s < COUNT_SYMBOLS; s++) bc[s] = _mm512_set1_epi64(c[s]);
            __m512i x[4];
            for (int v = 0; v < 4; v++) x[v] = _mm512_load_si512(st + 8 * v);
            for (; row + 32 <= z; row += 32) {
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) {
                    const __m512i q = _mm512_and_si512(x[v], qmask);
                    __m512i e, sym;
                    if (counted) {
                        __m512i s0 = _mm512_setzero_si512(), s1 = s0;
                        int s = 1;
                        for (; s + 2 <= kg; s += 2) {
                            s0 = _mm512_mask_add_epi64(s0, _mm512_cmpge_epu64_mask(q, bc[s]), s0, one);
                            s1 = _mm512_mask_add_epi64(s1, _mm512_cmpge_epu64_mask(q, bc[s + 1]), s1, one);
                        }
                        if (s < kg) s0 = _mm512_mask_add_epi64(s0, _mm512_cmpge_epu64_mask(q, bc[s]), s0, one);
                        sym = _mm512_add_epi64(s0, s1);
                        e = in_registers(sym, kg, t);
                    } else {
                        e = _mm512_i64gather_epi64(_mm512_srli_epi64(q, PRECISION - SLOT_BITS), sl, 8);
                        const __mmask8 shared = _mm512_testn_epi64_mask(e, _mm512_set1_epi64(0xffffffff));
                        if (shared) {
                            uint64_t qs[8] __attribute__((aligned(64))), es[8] __attribute__((aligned(64)));
                            _mm512_store_si512(qs, q);
                            _mm512_store_si512(es, e);
                            for (unsigned r = shared; r; r &= r - 1) {
                                const int j = __builtin_ctz(r), s = model_symbol(first, c, kg, (uint32_t)qs[j]);
                                es[j] = (c[s + 1] - c[s]) | (uint64_t)s << 24 | (uint64_t)c[s] << 32;
                            }
                            e = _mm512_load_si512(es);
                        }
                        sym = _mm512_and_si512(_mm512_srli_epi64(e, PRECISION), _mm512_set1_epi64(255));
                    }
                    const __m512i freq = _mm512_and_si512(e, qmask), left = _mm512_srli_epi64(e, 32);
                    __m512i y = _mm512_add_epi64(_mm512_mullo_epi64(_mm512_srli_epi64(x[v], PRECISION), freq), _mm512_sub_epi64(q, left));
                    __mmask8 pull = _mm512_cmplt_epu64_mask(y, lowst);
                    if (pull) {
                        __m256i word = _mm256_setzero_si256();
                        for (unsigned r = pull; r; r &= r - 1) {
                            const int j = __builtin_ctz(r), i = 8 * v + j;
                            if (top[i] > b[i]) word = _mm256_mask_set1_epi32(word, (__mmask8)(1u << j), (int)w[--top[i]]);
                            else pull &= (__mmask8)~(1u << j);
                        }
                        y = _mm512_mask_or_epi64(y, pull, _mm512_slli_epi64(y, 32), _mm512_cvtepu32_epi64(word));
                    }
                    x[v] = y;
                    _mm_storel_epi64((__m128i *)(out + row + 8 * v), _mm512_cvtepi64_epi8(sym));
                }
            }
            for (int v = 0; v < 4; v++) _mm512_store_si512(st + 8 * v, x[v]);
        }
        for (; row < z; row += 32)
            for (int j = 0; j < 32; j++)
                if (row + j < z) out[row + j] = decode_symbol(&st[j], &top[j], b[j], w, sl, first, c, kg);
        int64_t counts[256];
        dq_count_bytes(out + a, z - a, counts);
        memcpy(h + off[g], counts, (size_t)kg * sizeof(int64_t));
    }
    int empty = 1;
    for (int j = 0; j < 32; j++) empty &= st[j] == 0 && top[j] == b[j];
    return empty;
}
