/* Fused dequantize-dot kernels for the CPU: y[M, N] = x[M, K] @ W[N, K]^T with W kept in
 * quantized blocks of 32 weights (GGUF Q4_0 / Q4_1 / Q8_0 read in place, or the engine's
 * canonical int4 / int8 layouts), activations quantized to int8 per block of 32 (scale dx,
 * block sum sx), as llama.cpp does for its integer dot products.
 *
 * Every weight block is (q, s, o) with w = q * s + o: 4-bit q unsigned 0..15 (Q4_0: o = -8 s,
 * Q4_1: o = m, canonical int4: the stored offset), 8-bit q signed (o = 0). So
 *   dot(w_b, x_b) ~= s * dx_b * sum(q * xq_b) + o * dx_b * sum(xq_b).
 * The integer sums run on the vector units: AVX-512 VNNI (vpdpbusd on 256-bit lanes), AVX2
 * (vpmaddubsw + vpmaddwd), or plain C. Each path lives in a function compiled for its ISA with
 * a target pragma; the caller picks one (rl_best_isa() says what this CPU supports), so an
 * older CPU never executes an instruction it lacks. Output rows are split over a small
 * persistent thread pool (pool.c). The int16-activation kernels are gemm16_512.inc (AVX-512
 * VNNI) and the row loop rows16.inc (AVX2).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define RL_X86 1
#include <immintrin.h>
#endif

enum { FMT_Q4_0 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2, FMT_I4 = 3, FMT_I8 = 4 };
enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 2 };

typedef struct {
    int fmt;
    const uint8_t *const *rows; /* GGUF formats: one pointer per output row */
    const uint8_t *q;           /* canonical: qweight [N, row_bytes] */
    int64_t row_bytes;
    const void *scales, *offsets; /* canonical: [N, groups], fp32 or fp16 (half_scales) */
    int64_t groups, blocks_per_group;
    int half_scales;
    int64_t N, K, M;
    const void *xq;    /* [M, K] int8, or int16 when act16 */
    int act16;
    const float *dx;   /* [M, K / 32] */
    const float *dsx;  /* [M, K / 32]: dx * sum(xq) of the block */
    float *y;          /* [M, ldy] */
    int64_t ldy;
    const float *bias; /* [N] or NULL */
    const int32_t *xt; /* int16 tiles: [tiles, K / 32, 16 pairs, 16 rows] int16 pairs */
    const float *dxt, *dsxt; /* [tiles, K / 32, 16 rows] */
} rl_job;

/* ---------------------------------------------------------------- scalar helpers */
static float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float h2f_table[65536];

__attribute__((constructor)) static void init_h2f_table(void) {
    for (uint32_t i = 0; i < 65536; i++) h2f_table[i] = h2f((uint16_t)i);
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float scale_at(const void *base, int64_t g, int half) {
    return half ? h2f_table[((const uint16_t *)base)[g]] : ((const float *)base)[g];
}

/* Block b of row n: pointer to its quants, its scale and offset. */
static inline __attribute__((always_inline)) const uint8_t *block_of(const rl_job *j, int64_t n, int64_t b, float *s, float *o) {
    switch (j->fmt) {
    case FMT_Q4_0: {
        const uint8_t *p = j->rows[n] + b * 18;
        *s = h2f_table[rd16(p)];
        *o = -8.0f * *s;
        return p + 2;
    }
    case FMT_Q4_1: {
        const uint8_t *p = j->rows[n] + b * 20;
        *s = h2f_table[rd16(p)];
        *o = h2f_table[rd16(p + 2)];
        return p + 4;
    }
    case FMT_Q8_0: {
        const uint8_t *p = j->rows[n] + b * 34;
        *s = h2f_table[rd16(p)];
        *o = 0.0f;
        return p + 2;
    }
    case FMT_I4: {
        int64_t g = n * j->groups + b / j->blocks_per_group;
        *s = scale_at(j->scales, g, j->half_scales);
        *o = j->offsets ? scale_at(j->offsets, g, j->half_scales) : 0.0f;
        return j->q + n * j->row_bytes + b * 16;
    }
    default: { /* FMT_I8 */
        int64_t g = n * j->groups + b / j->blocks_per_group;
        *s = scale_at(j->scales, g, j->half_scales);
        *o = 0.0f;
        return j->q + n * j->row_bytes + b * 32;
    }
    }
}

static inline int is8(int fmt) { return fmt == FMT_Q8_0 || fmt == FMT_I8; }

/* ---------------------------------------------------------------- generic C path */
static void rows_generic(const rl_job *j, int64_t n0, int64_t n1) {
    const int64_t nb = j->K / 32;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m = 0; m < j->M; m++) {
            const int8_t *xq = (const int8_t *)j->xq + m * j->K;
            const float *dx = j->dx + m * nb, *dsx = j->dsx + m * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                float s, o;
                const uint8_t *qs = block_of(j, n, b, &s, &o);
                int32_t isum = 0;
                if (j->act16) {
                    const int16_t *xb = (const int16_t *)j->xq + m * j->K + b * 32;
                    if (is8(j->fmt)) {
                        for (int i = 0; i < 32; i++) isum += (int8_t)qs[i] * xb[i];
                    } else {
                        for (int i = 0; i < 16; i++)
                            isum += (qs[i] & 15) * xb[i] + (qs[i] >> 4) * xb[i + 16];
                    }
                } else {
                    const int8_t *xb = xq + b * 32;
                    if (is8(j->fmt)) {
                        for (int i = 0; i < 32; i++) isum += (int8_t)qs[i] * xb[i];
                    } else { /* nibble i: low = element i, high = element i + 16 (xq so) */
                        for (int i = 0; i < 16; i++)
                            isum += (qs[i] & 15) * xb[i] + (qs[i] >> 4) * xb[i + 16];
                    }
                }
                acc += s * dx[b] * (float)isum + o * dsx[b];
            }
            if (j->bias) acc += j->bias[n];
            j->y[m * j->ldy + n] = acc;
        }
    }
}

#ifdef RL_X86
/* ---------------------------------------------------------------- shared vector pieces */
#define RL_MT 4 /* activation rows per register tile */

#define RL_DISPATCH(NAME)                                                                  \
    static void NAME(const rl_job *j, int64_t n0, int64_t n1) {                            \
        switch (j->fmt) {                                                                  \
        case FMT_Q4_0: NAME##_fmt(j, n0, n1, FMT_Q4_0); break;                             \
        case FMT_Q4_1: NAME##_fmt(j, n0, n1, FMT_Q4_1); break;                             \
        case FMT_Q8_0: NAME##_fmt(j, n0, n1, FMT_Q8_0); break;                             \
        case FMT_I4: NAME##_fmt(j, n0, n1, FMT_I4); break;                                 \
        default: NAME##_fmt(j, n0, n1, FMT_I8); break;                                     \
        }                                                                                  \
    }

#define RL_VECTOR_ROWS(NAME, DOT)                                                          \
    static inline __attribute__((always_inline)) void NAME##_fmt(const rl_job *j, int64_t n0,  \
                                                                  int64_t n1, const int fmt) { \
        const int64_t nb = j->K / 32;                                                      \
        const int eight = is8(fmt);                                                        \
        const __m256i low = _mm256_set1_epi8(15);                                          \
        rl_job jj = *j;                                                                    \
        jj.fmt = fmt;                                                                      \
        for (int64_t n = n0; n < n1; n++) {                                                \
            for (int64_t m0 = 0; m0 < j->M; m0 += RL_MT) {                                 \
                const int mt = (int)(j->M - m0 < RL_MT ? j->M - m0 : RL_MT);               \
                __m256 acc[RL_MT];                                                         \
                float oacc[RL_MT];                                                         \
                for (int t = 0; t < RL_MT; t++) {                                          \
                    acc[t] = _mm256_setzero_ps();                                          \
                    oacc[t] = 0.0f;                                                        \
                }                                                                          \
                for (int64_t b = 0; b < nb; b++) {                                         \
                    float s, o;                                                            \
                    const uint8_t *qs = block_of(&jj, n, b, &s, &o);                       \
                    __m256i w, wsign = _mm256_setzero_si256();                             \
                    if (eight) {                                                           \
                        wsign = _mm256_loadu_si256((const __m256i *)qs);                   \
                        w = _mm256_sign_epi8(wsign, wsign);                                \
                    } else {                                                               \
                        __m128i p = _mm_loadu_si128((const __m128i *)qs);                  \
                        __m256i pp = _mm256_set_m128i(_mm_srli_epi16(p, 4), p);            \
                        w = _mm256_and_si256(pp, low);                                     \
                    }                                                                      \
                    for (int t = 0; t < mt; t++) {                                         \
                        const int64_t m = m0 + t;                                          \
                        __m256i xv =                                                       \
                            _mm256_loadu_si256((const __m256i *)((const int8_t *)j->xq +     \
                                                                 m * j->K + b * 32));       \
                        if (eight) xv = _mm256_sign_epi8(xv, wsign);                       \
                        __m256 isum = _mm256_cvtepi32_ps(DOT(w, xv));                      \
                        acc[t] = _mm256_fmadd_ps(isum, _mm256_set1_ps(s * j->dx[m * nb + b]), \
                                                 acc[t]);                                  \
                        if (o != 0.0f || !eight) oacc[t] += o * j->dsx[m * nb + b];        \
                    }                                                                      \
                }                                                                          \
                for (int t = 0; t < mt; t++) {                                             \
                    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[t]),                  \
                                          _mm256_extractf128_ps(acc[t], 1));               \
                    h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                \
                    h = _mm_add_ss(h, _mm_movehdup_ps(h));                                 \
                    float v = _mm_cvtss_f32(h) + oacc[t];                                  \
                    if (j->bias) v += j->bias[n];                                          \
                    j->y[(m0 + t) * j->ldy + n] = v;                                       \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    RL_DISPATCH(NAME)

/* ---------------------------------------------------------------- AVX2 path */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static inline __m256i dot_avx2(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
RL_VECTOR_ROWS(rows_avx2, dot_avx2)
#pragma GCC pop_options

/* ---------------------------------------------------------------- AVX-512 VNNI path */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
/* Two blocks per 512-bit register: lanes 0-7 hold block b's dot products, 8-15 block b + 1's;
 * the per-block scales are spread over those lanes, so one convert and two FMAs serve 64
 * weights. A tail block (odd K / 32) goes through the 256-bit code above. */
static inline __attribute__((always_inline)) __m512 pair_of(const float *p, __m512i idx) {
    __m128 two = _mm_castpd_ps(_mm_load_sd((const double *)p));
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two));
}

static inline __attribute__((always_inline)) void rows_vnni512_fmt(const rl_job *j, int64_t n0,
                                                                    int64_t n1, const int fmt) {
    const int64_t nb = j->K / 32, npairs = nb / 2;
    const int eight = is8(fmt);
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    rl_job jj = *j;
    jj.fmt = fmt;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m0 = 0; m0 < j->M; m0 += RL_MT) {
            const int mt = (int)(j->M - m0 < RL_MT ? j->M - m0 : RL_MT);
            __m512 acc[RL_MT];
            for (int t = 0; t < RL_MT; t++) acc[t] = _mm512_setzero_ps();
            for (int64_t pb = 0; pb < npairs; pb++) {
                const int64_t b = 2 * pb;
                float s0, o0, s1, o1;
                const uint8_t *q0 = block_of(&jj, n, b, &s0, &o0);
                const uint8_t *q1 = block_of(&jj, n, b + 1, &s1, &o1);
                __m512i w;
                __mmask64 neg = 0;
                if (eight) {
                    __m256i a = _mm256_loadu_si256((const __m256i *)q0);
                    __m256i c = _mm256_loadu_si256((const __m256i *)q1);
                    __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
                    neg = _mm512_movepi8_mask(raw);
                    w = _mm512_abs_epi8(raw);
                } else { /* [lo_b, hi_b, lo_b1, hi_b1] = elements 0..31 of b, then of b + 1 */
                    __m128i a = _mm_loadu_si128((const __m128i *)q0);
                    __m128i c = _mm_loadu_si128((const __m128i *)q1);
                    __m256i ac = _mm256_set_m128i(c, a);
                    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(ac),
                                                      _mm256_srli_epi16(ac, 4), 1);
                    both = _mm512_and_si512(both, low); /* [lo_b, lo_b1, hi_b, hi_b1] */
                    w = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
                }
                const __m512 sv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0),
                                                       _mm512_set1_ps(s1));
                const __m512 ov = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(o0 * 0.125f),
                                                       _mm512_set1_ps(o1 * 0.125f));
                for (int t = 0; t < mt; t++) {
                    const int64_t m = m0 + t;
                    __m512i xv = _mm512_loadu_si512(
                        (const void *)((const int8_t *)j->xq + m * j->K + b * 32));
                    if (eight) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                    __m512 isum = _mm512_cvtepi32_ps(
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv));
                    __m512 scale = _mm512_mul_ps(sv, pair_of(j->dx + m * nb + b, idx));
                    acc[t] = _mm512_fmadd_ps(isum, scale, acc[t]);
                    if (!eight) /* offsets: dsx / 8 in each of a block's 8 lanes */
                        acc[t] = _mm512_fmadd_ps(ov, pair_of(j->dsx + m * nb + b, idx), acc[t]);
                }
            }
            for (int t = 0; t < mt; t++) {
                const int64_t m = m0 + t;
                float v = _mm512_reduce_add_ps(acc[t]);
                if (nb & 1) { /* tail block */
                    float s, o;
                    const uint8_t *qs = block_of(&jj, n, nb - 1, &s, &o);
                    __m256i wt, ws = _mm256_setzero_si256();
                    __m256i xv = _mm256_loadu_si256(
                        (const __m256i *)((const int8_t *)j->xq + m * j->K + (nb - 1) * 32));
                    if (eight) {
                        ws = _mm256_loadu_si256((const __m256i *)qs);
                        wt = _mm256_sign_epi8(ws, ws);
                        xv = _mm256_sign_epi8(xv, ws);
                    } else {
                        __m128i p = _mm_loadu_si128((const __m128i *)qs);
                        wt = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p),
                                              _mm256_set1_epi8(15));
                    }
                    __m256i is = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wt, xv);
                    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(is),
                                              _mm256_extracti128_si256(is, 1));
                    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
                    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
                    v += s * j->dx[m * nb + nb - 1] * (float)_mm_cvtsi128_si32(h) +
                         o * j->dsx[m * nb + nb - 1];
                }
                if (j->bias) v += j->bias[n];
                j->y[m * j->ldy + n] = v;
            }
        }
    }
}

RL_DISPATCH(rows_vnni512)
#pragma GCC pop_options
#endif

#ifdef RL_X86
/* ---------------------------------------------------------------- int16 activations */
/* Activations with 15 bits per block of 32, multiplied by the widened weights with vpdpwssd
 * (AVX-512 VNNI, gemm16_512.inc) or vpmaddwd (AVX2, the row loop rows16.inc), exact int32
 * sums; results stay within ~1e-5 of the fp32 reference, where int8 activations (above) are
 * 2x cheaper in compute but move greedy tokens on small models. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#include "gemm16_512.inc"
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define rl_vi __m256i
#define RL_SFX avx2
#define RL_WPB 2
static inline __attribute__((always_inline)) void widen_avx2(const uint8_t *qs, int eight,
                                                              __m256i *w) {
    __m128i p = _mm_loadu_si128((const __m128i *)qs);
    if (eight) {
        w[0] = _mm256_cvtepi8_epi16(p);
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
    } else {
        const __m128i low = _mm_set1_epi8(15);
        w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(p, low));
        w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(p, 4), low));
    }
}
static inline __attribute__((always_inline)) __m256i dot16_avx2(const __m256i *w,
                                                                 const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(w[1],
                                              _mm256_loadu_si256((const __m256i *)(x + 16))));
}
static inline __attribute__((always_inline)) float hsum_avx2(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#define RL_WIDEN(qs, eight, w) widen_avx2(qs, eight, w)
#define rl_vf __m256
#define RL_DOT(w, x) dot16_avx2(w, x)
#define RL_CVT _mm256_cvtepi32_ps
#define RL_SET1F _mm256_set1_ps
#define RL_FMADD _mm256_fmadd_ps
#define RL_ZEROF _mm256_setzero_ps
#define RL_HSUM hsum_avx2
#include "rows16.inc"
#pragma GCC pop_options
#endif

int rl_best_isa(void) {
#ifdef RL_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return ISA_AVX512VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
    return ISA_GENERIC;
}

typedef void (*rows_fn)(const rl_job *, int64_t, int64_t);

static rows_fn pick(int isa, int act16) {
#ifdef RL_X86
    static int best = -1;
    if (best < 0) best = rl_best_isa();
    if (act16 && isa >= ISA_AVX512VNNI && best >= ISA_AVX512VNNI) return rowsx_vnni512;
    if (act16 && isa >= ISA_AVX2 && best >= ISA_AVX2) return rows16_avx2;
    if (act16) return rows_generic;
    if (isa >= ISA_AVX512VNNI && best >= ISA_AVX512VNNI) return rows_vnni512;
    if (isa >= ISA_AVX2 && best >= ISA_AVX2) return rows_avx2;
#endif
    (void)isa;
    return rows_generic;
}

/* ---------------------------------------------------------------- threads (pool.c) */
typedef void (*task_fn)(const void *, int64_t, int64_t); /* rows [n0, n1) of a job */
void rl_parallel_for(task_fn fn, const void *job, int64_t num_rows, int64_t chunk_rows);
int rl_num_threads(void);

typedef struct {
    const rl_job *job;
    rows_fn fn;
} gemm_task;

static void gemm_rows(const void *p, int64_t n0, int64_t n1) {
    const gemm_task *t = p;
    t->fn(t->job, n0, n1);
}

/* The 16-row tiles of int16 activations for tiles_vnni512: pairs (2p, 2p + 1) of each block
 * of rows m0 .. m0 + 15 side by side, and their scales, the last tile padded with zero rows
 * (per-thread scratch, 64-byte aligned). */
static __thread int32_t *tile_x;
static __thread float *tile_f;
static __thread int64_t tile_elems;

#define RL_TILE_MIN_ROWS 4 /* fewer activation rows run rowsx_vnni512 (same bits either way) */

static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* Scratch for the tiles of M rows (the rows of a last partial tile zeroed); 0 if none. */
static int alloc_tiles(rl_job *j) {
    const int64_t nb = j->K / 32, tiles = (j->M + 15) / 16, pairs = tiles * 16 * j->K / 2;
    if (pairs > tile_elems) {
        free(tile_x);
        free(tile_f);
        tile_x = alloc64(sizeof(int32_t) * (size_t)pairs);
        tile_f = alloc64(sizeof(float) * (size_t)(2 * tiles * 16 * nb));
        tile_elems = tile_x && tile_f ? pairs : 0;
        if (!tile_elems) return 0;
    }
    j->xt = tile_x;
    j->dxt = tile_f;
    j->dsxt = tile_f + tiles * 16 * nb;
    const int64_t t = tiles - 1;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t m = j->M - t * 16; m < 16; m++) {
            int32_t *dst = tile_x + (t * nb + b) * 256 + m;
            for (int p = 0; p < 16; p++) dst[p * 16] = 0;
            tile_f[(t * nb + b) * 16 + m] = 0.0f;
            tile_f[tiles * 16 * nb + (t * nb + b) * 16 + m] = 0.0f;
        }
    return 1;
}

/* Activation row m (xq, dx, dsx) into its tile lane. */
static void fill_tile_row(const rl_job *j, int64_t m) {
    const int64_t nb = j->K / 32, t = m / 16, lane = m % 16;
    const int32_t *src = (const int32_t *)j->xq + m * (j->K / 2); /* int16 pairs */
    int32_t *xt = (int32_t *)j->xt;
    float *dxt = (float *)j->dxt, *dsxt = (float *)j->dsxt;
    for (int64_t b = 0; b < nb; b++) {
        int32_t *dst = xt + (t * nb + b) * 256 + lane;
        for (int p = 0; p < 16; p++) dst[p * 16] = src[b * 16 + p];
        dxt[(t * nb + b) * 16 + lane] = j->dx[m * nb + b];
        dsxt[(t * nb + b) * 16 + lane] = j->dsx[m * nb + b];
    }
}

/* Whether this job runs the 16-row tiles (AVX-512 VNNI, int16 activations, enough rows). */
static int wants_tiles(const rl_job *j, int isa) {
#ifdef RL_X86
    return pick(isa, j->act16) == rowsx_vnni512 && j->M >= RL_TILE_MIN_ROWS;
#else
    (void)j;
    (void)isa;
    return 0;
#endif
}

/* The GEMM of a job whose activations (and tiles, if tiled) are ready. */
static void run_ready(const rl_job *j, int isa, int tiled) {
    gemm_task task = {j, pick(isa, j->act16)};
#ifdef RL_X86
    if (tiled) task.fn = tiles_vnni512;
#endif
    /* Small problems stay on the caller: waking a worker costs more than it saves. */
    if (rl_num_threads() == 1 || j->N * j->K * (j->M < 4 ? j->M : 4) < 65536 || j->N < 32) {
        task.fn(j, 0, j->N);
        return;
    }
    /* tiles: 8 chunks per thread (a late chunk costs less at the end); rowsx: 4. Both of
     * 16-row multiples (rowsx's lane width, the tile kernel's staged output rows). */
    const int64_t chunks = (tiled ? 8 : 4) * rl_num_threads(), align = 16;
    const int64_t rows = (j->N + chunks - 1) / chunks;
    rl_parallel_for(gemm_rows, &task, j->N, (rows + align - 1) / align * align);
}

static void run(const rl_job *job, int isa) {
    rl_job j = *job;
    int tiled = wants_tiles(&j, isa) && alloc_tiles(&j);
    if (tiled)
        for (int64_t m = 0; m < j.M; m++) fill_tile_row(&j, m);
    run_ready(&j, isa, tiled);
}

/* ---------------------------------------------------------------- entry points */
static void quantize_row(const float *xr, int64_t K, int even_odd, int bits, void *xq_row,
                         float *dx, float *dsx) {
    const float qmax = bits == 16 ? 32767.0f : 127.0f;
    const int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = xr + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / qmax, inv = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            int v = (int)lrintf(xb[i] * inv);
            int64_t pos = b * 32 + (even_odd ? (i & 1) * 16 + (i >> 1) : i);
            if (bits == 16)
                ((int16_t *)xq_row)[pos] = (int16_t)v;
            else
                ((int8_t *)xq_row)[pos] = (int8_t)v;
            sum += v;
        }
        dx[b] = d;
        dsx[b] = d * (float)sum;
    }
}

#ifdef RL_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
/* quantize_row for 16 bits in the GGUF order, the same values: max|x| is order-free, and
 * vcvtps2dq rounds to nearest even as lrintf does. */
static void quantize_row16_512(const float *xr, int64_t K, int16_t *q, float *dx, float *dsx) {
    for (int64_t b = 0; b < K / 32; b++) {
        const __m512 a = _mm512_loadu_ps(xr + b * 32), c = _mm512_loadu_ps(xr + b * 32 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        const float d = amax / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(inv)));
        _mm256_storeu_si256((__m256i *)(q + b * 32), _mm512_cvtepi32_epi16(qa));
        _mm256_storeu_si256((__m256i *)(q + b * 32 + 16), _mm512_cvtepi32_epi16(qc));
        dx[b] = d;
        dsx[b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
    }
}
/* h = silu(g) * u over n elements (n % 16 == 0): exp by range reduction to [-ln2/2, ln2/2]
 * and a degree-6 polynomial (~1 ulp; the scalar path uses libm's expf). */
static void silu_mul_512(const float *g, const float *u, int64_t n, float *h) {
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 z = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x),
                                                     _mm512_set1_ps(-87.0f)),
                                       _mm512_set1_ps(88.0f)); /* -x, clamped */
        const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(z, _mm512_set1_ps(1.44269504089f)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), z);
        r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
        __m512 p = _mm512_set1_ps(1.9875691500e-4f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
        p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
        const __m512 e = _mm512_scalef_ps(p, k); /* exp(-x) */
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(h + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
    }
}

/* o[p] lane m = r[m] lane p (16 x 16 int32). */
static inline __attribute__((always_inline)) void transpose16_512(const __m512i *r, __m512i *o) {
    __m512i t[16], u[16], x[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        x[i] = _mm512_shuffle_i32x4(u[i], u[4 + i], 0x88);
        x[4 + i] = _mm512_shuffle_i32x4(u[i], u[4 + i], 0xdd);
        x[8 + i] = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0x88);
        x[12 + i] = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        o[i] = _mm512_shuffle_i32x4(x[i], x[8 + i], 0x88);
        o[8 + i] = _mm512_shuffle_i32x4(x[i], x[8 + i], 0xdd);
    }
}

/* Tile t from its (up to) 16 quantized rows, one 16 x 16 transpose per block (fill_tile_row's
 * layout; rows past M are zero). */
static void fill_tile_512(const rl_job *j, int64_t t) {
    const int64_t nb = j->K / 32, rows = j->M - t * 16 < 16 ? j->M - t * 16 : 16;
    const int32_t *x = (const int32_t *)j->xq; /* int16 pairs: [M, K / 2] */
    int32_t *xt = (int32_t *)j->xt;
    float *dxt = (float *)j->dxt, *dsxt = (float *)j->dsxt;
    for (int64_t b = 0; b < nb; b++) {
        __m512i r[16], o[16];
        for (int64_t m = 0; m < 16; m++)
            r[m] = m < rows ? _mm512_loadu_si512((const void *)(x + (t * 16 + m) * (j->K / 2) +
                                                                b * 16))
                            : _mm512_setzero_si512();
        transpose16_512(r, o);
        int32_t *dst = xt + (t * nb + b) * 256;
        for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(dst + p * 16), o[p]);
        for (int64_t m = 0; m < 16; m++) {
            dxt[(t * nb + b) * 16 + m] = m < rows ? j->dx[(t * 16 + m) * nb + b] : 0.0f;
            dsxt[(t * nb + b) * 16 + m] = m < rows ? j->dsx[(t * 16 + m) * nb + b] : 0.0f;
        }
    }
}
#pragma GCC pop_options
#endif

/* x [M, K] (row stride ldx) -> xq int8 [M, K], dx and dsx [M, K / 32]. With even_odd, each
 * block's int8 values are stored as its 16 even elements then its 16 odd ones (the order in
 * which the canonical int4 layout's low and high nibbles unpack); else low/high = first/second
 * 16 elements (the GGUF order). */
void rl_quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int even_odd, int bits,
                      void *xq_out, float *dx, float *dsx) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * ldx, K, even_odd, bits, (int8_t *)xq_out + m * K * (bits / 8),
                     dx + m * nb, dsx + m * nb);
}

void rl_gemm_gguf(int fmt, const uint8_t *const *rows, int64_t N, int64_t K, const void *xq,
                  int act_bits, const float *dx, const float *dsx, int64_t M, float *y,
                  int64_t ldy, const float *bias, int isa) {
    rl_job j = {.fmt = fmt, .rows = rows, .N = N, .K = K, .M = M, .xq = xq,
                .act16 = act_bits == 16, .dx = dx,
                .dsx = dsx, .y = y, .ldy = ldy, .bias = bias};
    run(&j, isa);
}

void rl_gemm_canonical(int bits, const uint8_t *q, const void *scales, const void *offsets,
                       int half_scales, int64_t group, int64_t N, int64_t K, const void *xq,
                       int act_bits, const float *dx,
                       const float *dsx, int64_t M, float *y, int64_t ldy, const float *bias,
                       int isa) {
    rl_job j = {.fmt = bits == 4 ? FMT_I4 : FMT_I8, .q = q, .row_bytes = bits == 4 ? K / 2 : K,
                .scales = scales, .offsets = offsets, .half_scales = half_scales,
                .groups = K / group, .act16 = act_bits == 16,
                .blocks_per_group = group / 32, .N = N, .K = K, .M = M, .xq = xq, .dx = dx,
                .dsx = dsx, .y = y, .ldy = ldy, .bias = bias};
    run(&j, isa);
}

/* x fp32 [M, K] (row stride ldx) -> y: quantizes the activations into scratch buffers (rows
 * spread over the pool), then runs the GEMM: one call per linear layer from Python. */
static __thread int8_t *scratch_q;
static __thread float *scratch_f;
static __thread int64_t scratch_elems;

typedef struct {
    const float *x;
    int64_t ldx;
    int silu_mul, bits, fast16;
    rl_job *job; /* xq, dx, dsx out; tiles filled when tiled */
    int tiled;
} prep_task;

/* Row m: silu(gate) * up when asked, then quantized into the job's xq, dx, dsx. */
static void prep_row(const prep_task *t, int64_t m) {
    static __thread float *h;
    static __thread int64_t h_elems;
    const rl_job *j = t->job;
    const int64_t K = j->K, nb = K / 32;
    const float *xr = t->x + m * t->ldx;
    if (t->silu_mul) {
        if (K > h_elems) {
            free(h);
            h = malloc(sizeof(float) * (size_t)K);
            h_elems = h ? K : 0;
        }
        const float *u = xr + K;
#ifdef RL_X86
        if (t->fast16 && K % 16 == 0)
            silu_mul_512(xr, u, K, h);
        else
#endif
            for (int64_t i = 0; i < K; i++) h[i] = xr[i] / (1.0f + expf(-xr[i])) * u[i];
        xr = h;
    }
    void *q = (int8_t *)j->xq + m * K * (t->bits / 8);
    float *dx = (float *)j->dx + m * nb, *dsx = (float *)j->dsx + m * nb;
#ifdef RL_X86
    if (t->fast16) {
        quantize_row16_512(xr, K, q, dx, dsx);
        return;
    }
#endif
    quantize_row(xr, K, 0, t->bits, q, dx, dsx);
}

/* Rows [m0, m1), each placed in its tile lane when tiled. */
static void prep_rows(const void *p, int64_t m0, int64_t m1) {
    const prep_task *t = p;
    for (int64_t m = m0; m < m1; m++) {
        prep_row(t, m);
        if (t->tiled) fill_tile_row(t->job, m);
    }
}

#ifdef RL_X86
/* Tiles [t0, t1) (AVX-512): their rows, then one transpose per block. */
static void prep_tiles(const void *p, int64_t t0, int64_t t1) {
    const prep_task *t = p;
    const int64_t M = t->job->M;
    for (int64_t tile = t0; tile < t1; tile++) {
        for (int64_t m = tile * 16; m < M && m < tile * 16 + 16; m++) prep_row(t, m);
        fill_tile_512(t->job, tile);
    }
}
#endif

/* silu_mul: x is [M, 2K] (gate | up) and the GEMM's input is silu(gate) * up, computed here. */
int rl_linear_gguf(int fmt, const uint8_t *const *rows, int64_t N, int64_t K, const float *x,
                   int64_t M, int64_t ldx, int act_bits, int silu_mul, float *y, int64_t ldy,
                   const float *bias, int isa) {
    if (M * K > scratch_elems) {
        free(scratch_q);
        free(scratch_f);
        scratch_q = malloc(2 * (size_t)(M * K));
        scratch_f = malloc(sizeof(float) * (size_t)(M * K / 32) * 2);
        scratch_elems = scratch_q && scratch_f ? M * K : 0;
        if (!scratch_elems) return -1;
    }
    rl_job j = {.fmt = fmt, .rows = rows, .N = N, .K = K, .M = M, .xq = scratch_q,
                .act16 = act_bits == 16, .dx = scratch_f, .dsx = scratch_f + M * K / 32,
                .y = y, .ldy = ldy, .bias = bias};
    prep_task t = {.x = x, .ldx = ldx, .silu_mul = silu_mul, .bits = act_bits, .job = &j};
    t.tiled = wants_tiles(&j, isa) && alloc_tiles(&j);
#ifdef RL_X86
    static int best = -1;
    if (best < 0) best = rl_best_isa();
    t.fast16 = act_bits == 16 && best >= ISA_AVX512VNNI;
#endif
#ifdef RL_X86
    if (t.tiled && t.fast16) { /* tiles on the pool (tiled means AVX-512 VNNI) */
        const int64_t tiles = (M + 15) / 16;
        if (tiles > 1 && rl_num_threads() > 1)
            rl_parallel_for(prep_tiles, &t, tiles, 1);
        else
            prep_tiles(&t, 0, tiles);
        run_ready(&j, isa, 1);
        return 0;
    }
#endif
    if (M >= 8 && rl_num_threads() > 1)
        rl_parallel_for(prep_rows, &t, M, (M + 2 * rl_num_threads() - 1) / (2 * rl_num_threads()));
    else
        prep_rows(&t, 0, M);
    run_ready(&j, isa, t.tiled);
    return 0;
}

/* Dequantize whole GGUF rows (embedding lookups): out [num_rows, K] fp32. */
void rl_dequant_gguf_rows(int fmt, const uint8_t *const *rows, int64_t num_rows, int64_t K,
                          float *out) {
    rl_job j = {.fmt = fmt, .rows = rows};
    for (int64_t r = 0; r < num_rows; r++) {
        for (int64_t b = 0; b < K / 32; b++) {
            float s, o;
            const uint8_t *qs = block_of(&j, r, b, &s, &o);
            float *dst = out + r * K + b * 32;
            if (is8(fmt)) {
                for (int i = 0; i < 32; i++) dst[i] = (int8_t)qs[i] * s;
            } else {
                for (int i = 0; i < 16; i++) {
                    dst[i] = (qs[i] & 15) * s + o;
                    dst[i + 16] = (qs[i] >> 4) * s + o;
                }
            }
        }
    }
}
