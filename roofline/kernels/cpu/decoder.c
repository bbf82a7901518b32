/* One decode step of a Llama-family model (Llama, Mistral, SmolLM2, Qwen2's q/k/v bias, Qwen3's
 * per-head q/k RMSNorm) in one call from Python: embedding rows, then per layer RMSNorm, the
 * q/k/v GEMM, RoPE, the paged K/V store, attention of each request over its own keys, the o
 * GEMM and residual add, RMSNorm, the gate/up GEMM, SiLU-and-mul inside the down GEMM and the
 * residual add; the final RMSNorm last. At 135M parameters the ~12 small torch ops per layer
 * between the GEMMs cost as much as the GEMMs themselves (~5 us each, 30 layers); here they are
 * a few microseconds per layer. Linear layers are the GGUF-block GEMMs of quant_gemm.c
 * (rl_linear_gguf, the thread pool's rows); attention runs on the same pool over (request, KV
 * head) pairs. Every output row depends only on its own request: a request decodes the same
 * tokens alone or in any batch.
 *
 * Layouts: hidden states fp32 [M, H]; KV pages fp32 or fp16 (C_KV_HALF, AVX-512 only) [num_pages,
 * page_size, num_kv_heads, D] per layer; cos_sin fp32 [max_positions, D] (cos of the D / 2 frequencies, then their sin,
 * rotate-half RoPE). Each layer is described by LAYER_FIELDS int64 words (see rl_layer_field).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int rl_linear_gguf(int fmt, const uint8_t *const *rows, int64_t N, int64_t K, const float *x,
                   int64_t M, int64_t ldx, int act_bits, int silu_mul, float *y, int64_t ldy,
                   const float *bias, int isa);
typedef void (*task_fn)(const void *, int64_t, int64_t);
void rl_parallel_for(task_fn fn, const void *job, int64_t num_rows, int64_t chunk_rows);
int rl_num_threads(void);

/* Per-layer words: pointers as int64, formats as GGUF codes (0 Q4_0, 1 Q4_1, 2 Q8_0). */
enum {
    L_IN_NORM, L_POST_NORM, L_QKV_ROWS, L_QKV_FMT, L_QKV_BIAS, L_O_ROWS, L_O_FMT, L_GU_ROWS,
    L_GU_FMT, L_DOWN_ROWS, L_DOWN_FMT, L_Q_NORM, L_K_NORM, L_K_CACHE, L_V_CACHE, LAYER_FIELDS
};
/* Model words. */
enum { C_LAYERS, C_HIDDEN, C_HEADS, C_KV_HEADS, C_HEAD_DIM, C_INTER, C_PAGE, C_ACT_BITS, C_ISA,
       C_VOCAB, C_EMBED_FMT, C_KV_HALF, CONFIG_FIELDS };

int rl_layer_field(int i) { return i < 0 ? LAYER_FIELDS : i; }
int rl_config_fields(void) { return CONFIG_FIELDS; }

#define PTR(T, v) ((T)(intptr_t)(v))
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RL_CLONES
#endif

/* ---------------------------------------------------------------- row-wise pieces */
/* out = w * x / rms(x), x [n]; sums in 16 lanes (the same order for every row). */
RL_CLONES static void rms_norm(const float *x, const float *w, float eps, int64_t n, float *out) {
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += x[i + l] * x[i + l];
    float ss = 0.0f;
    for (int l = 0; l < 16; l++) ss += lanes[l];
    for (; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

static void rope(float *x, const float *cos_sin, int64_t d) {
    const int64_t half = d / 2;
    const float *c = cos_sin, *s = cos_sin + half;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i] + a * s[i];
    }
}

/* exp(x) for x <= 0 (softmax after the max is taken): 2^n * p(r), |rel err| < 2e-7. */
static inline float exp_neg(float x) {
    if (x < -87.0f) return 0.0f;
    const float t = x * 1.44269504089f; /* x / ln 2 */
    const float n = floorf(t);
    const float r = (t - n) * 0.69314718056f; /* in [0, ln 2) */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* ---------------------------------------------------------------- greedy argmax */
typedef struct {
    const float *x;
    int64_t cols, ld;
    int64_t *out;
} argmax_job;

/* out[r] = the first index of row r's largest value, a NaN counting as the largest (torch's
 * argmax): per-lane maxima (NaN skipped, flagged), then the first column equal to the max. */
RL_CLONES static void argmax_rows(const void *p, int64_t r0, int64_t r1) {
    const argmax_job *a = p;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = a->x + r * a->ld;
        const int64_t n = a->cols;
        float lanes[16];
        int nan = 0;
        for (int l = 0; l < 16; l++) lanes[l] = -INFINITY;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            for (int l = 0; l < 16; l++) {
                const float v = x[i + l];
                nan |= v != v;
                lanes[l] = v > lanes[l] ? v : lanes[l];
            }
        float mx = -INFINITY;
        for (int l = 0; l < 16; l++) mx = lanes[l] > mx ? lanes[l] : mx;
        for (; i < n; i++) {
            nan |= x[i] != x[i];
            mx = x[i] > mx ? x[i] : mx;
        }
        int64_t best = 0;
        for (i = 0; i < n; i++)
            if (nan ? x[i] != x[i] : x[i] == mx) {
                best = i;
                break;
            }
        a->out[r] = best;
    }
}

/* x fp32 [rows, cols] (row stride ld) -> out int64 [rows]; rows spread over the pool. */
void rl_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t ld, int64_t *out) {
    argmax_job a = {.x = x, .cols = cols, .ld = ld, .out = out};
    const int64_t threads = rl_num_threads();
    if (threads == 1 || rows < 2 || rows * cols < 65536)
        argmax_rows(&a, 0, rows);
    else
        rl_parallel_for(argmax_rows, &a, rows, (rows + 2 * threads - 1) / (2 * threads));
}

/* ---------------------------------------------------------------- attention */
typedef struct {
    const float *qkv; /* [M, (NH + 2 NKV) D], q and k rotated */
    float *out;       /* [M, NH D] */
    const void *k_cache, *v_cache; /* fp32, or fp16 (half: the AVX-512 kernel only) */
    int half;
    const int32_t *seq_lens, *block_table;
    int64_t table_stride, page, nh, nkv, d;
    float scale;
    float *scores; /* [tasks, group, max_seq_len] scratch: one row per query head */
    int64_t max_seq_len;
} attn_job;

/* Tasks n = r * NKV + g: request r's query heads that share KV head g, each key and value
 * row read once for all of them. */
RL_CLONES static void attend_rows(const void *p, int64_t n0, int64_t n1) {
    const attn_job *a = p;
    const int64_t d = a->d, group = a->nh / a->nkv, width = (a->nh + 2 * a->nkv) * d;
    for (int64_t n = n0; n < n1; n++) {
        const int64_t r = n / a->nkv, g = n % a->nkv, len = a->seq_lens[r];
        const int32_t *pages = a->block_table + r * a->table_stride;
        float *sc = a->scores + n * a->max_seq_len * group; /* [group, len] */
        const float *q = a->qkv + r * width + g * group * d; /* the group's heads, [group, d] */
        for (int64_t t = 0; t < len; t++) {
            const int64_t slot = (int64_t)pages[t / a->page] * a->page + t % a->page;
            const float *k = (const float *)a->k_cache + (slot * a->nkv + g) * d;
            for (int64_t h = 0; h < group; h++) {
                const float *qh = q + h * d;
                float lanes[16] = {0};
                for (int64_t i = 0; i < d; i += 16)
                    for (int l = 0; l < 16; l++) lanes[l] += qh[i + l] * k[i + l];
                float s = 0.0f;
                for (int l = 0; l < 16; l++) s += lanes[l];
                sc[h * len + t] = s * a->scale;
            }
        }
        float inv[64];
        for (int64_t h = 0; h < group; h++) {
            float *sh = sc + h * len, mx = -INFINITY, sum = 0.0f;
            for (int64_t t = 0; t < len; t++) mx = sh[t] > mx ? sh[t] : mx;
            for (int64_t t = 0; t < len; t++) {
                sh[t] = exp_neg(sh[t] - mx);
                sum += sh[t];
            }
            inv[h] = 1.0f / sum;
        }
        float *o = a->out + r * a->nh * d + g * group * d; /* [group, d] */
        for (int64_t i = 0; i < group * d; i++) o[i] = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            const int64_t slot = (int64_t)pages[t / a->page] * a->page + t % a->page;
            const float *v = (const float *)a->v_cache + (slot * a->nkv + g) * d;
            for (int64_t h = 0; h < group; h++) {
                const float w = sc[h * len + t] * inv[h];
                float *oh = o + h * d;
                for (int64_t i = 0; i < d; i++) oh[i] += w * v[i];
            }
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define RL_ATTEND512 1
#include "attend512.inc"
#endif
int rl_best_isa(void);
void rl_dequant_gguf_rows(int fmt, const uint8_t *const *rows, int64_t num_rows, int64_t K,
                          float *out);

/* ---------------------------------------------------------------- the step */
static __thread float *scratch;
static __thread int64_t scratch_floats;

static float *grow(int64_t floats) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = malloc(sizeof(float) * (size_t)floats);
        scratch_floats = scratch ? floats : 0;
    }
    return scratch;
}

/* One decode row per request: ids, positions, slots [M] int64; seq_lens [M] int32 (after this
 * step); block_table int32 [M, table_stride]; embed fp32 [vocab, H] (C_EMBED_FMT -1) or
 * the GGUF rows' int64 pointers [vocab] (C_EMBED_FMT the GGUF code); out [M, H] fp32 (the final
 * RMSNorm's output). Returns 0; -1 when scratch memory could not be had, -2 for a token id
 * outside the embedding (nothing computed), -3 for fp16 KV pages on a CPU without the AVX-512
 * kernels (nothing computed). */
int rl_decode_step(const int64_t *cfg, const int64_t *layers, const void *embed,
                   const float *final_norm, const float *cos_sin, float eps, int64_t M,
                   const int64_t *ids, const int64_t *positions, const int64_t *slots,
                   const int32_t *seq_lens, const int32_t *block_table, int64_t table_stride,
                   float *out) {
    const int64_t H = cfg[C_HIDDEN], NH = cfg[C_HEADS], NKV = cfg[C_KV_HEADS], D = cfg[C_HEAD_DIM];
    const int64_t I = cfg[C_INTER], page = cfg[C_PAGE];
    const int act_bits = (int)cfg[C_ACT_BITS], isa = (int)cfg[C_ISA];
    const int64_t W = (NH + 2 * NKV) * D;
    int64_t max_len = 1;
    for (int64_t r = 0; r < M; r++) {
        if (ids[r] < 0 || ids[r] >= cfg[C_VOCAB]) return -2;
        max_len = seq_lens[r] > max_len ? seq_lens[r] : max_len;
    }
    const int half = (int)cfg[C_KV_HALF];
    task_fn attend = half ? NULL : attend_rows;
#ifdef RL_ATTEND512
    if (isa >= 2 && rl_best_isa() >= 2 && D % 16 == 0 && D <= 256)
        attend = half ? attend_rows_512_half : attend_rows_512;
#endif
    if (attend == NULL) return -3; /* fp16 pages need the AVX-512 kernels */
    /* residual, normed x, qkv, attention out, gate|up, a GEMM's output, scores */
    const int64_t need = M * (H + H + W + NH * D + 2 * I + H) + M * NH * (max_len + 16);
    float *base = grow(need);
    if (base == NULL) return -1;
    float *res = base, *x = res + M * H, *qkv = x + M * H, *att = qkv + M * W;
    float *gu = att + M * NH * D, *y = gu + M * 2 * I, *scores = y + M * H;
    for (int64_t r = 0; r < M; r++) {
        if (cfg[C_EMBED_FMT] < 0) /* fp32 rows */
            memcpy(res + r * H, (const float *)embed + ids[r] * H, sizeof(float) * H);
        else /* GGUF block rows: embed is their row pointers */
            rl_dequant_gguf_rows((int)cfg[C_EMBED_FMT], (const uint8_t *const *)embed + ids[r], 1,
                                 H, res + r * H);
    }
    int status = 0; /* a GEMM's scratch allocation failed: -1 */
    for (int64_t l = 0; l < cfg[C_LAYERS]; l++) {
        const int64_t *L = layers + l * LAYER_FIELDS;
        for (int64_t r = 0; r < M; r++)
            rms_norm(res + r * H, PTR(const float *, L[L_IN_NORM]), eps, H, x + r * H);
        status |= rl_linear_gguf((int)L[L_QKV_FMT], PTR(const uint8_t *const *, L[L_QKV_ROWS]), W, H, x, M,
                       H, act_bits, 0, qkv, W, PTR(const float *, L[L_QKV_BIAS]), isa);
        void *k_cache = PTR(void *, L[L_K_CACHE]), *v_cache = PTR(void *, L[L_V_CACHE]);
        for (int64_t r = 0; r < M; r++) {
            float *q = qkv + r * W, *k = q + NH * D, *v = k + NKV * D;
            const float *cs = cos_sin + positions[r] * D;
            for (int64_t h = 0; h < NH; h++) {
                if (L[L_Q_NORM]) rms_norm(q + h * D, PTR(const float *, L[L_Q_NORM]), eps, D, q + h * D);
                rope(q + h * D, cs, D);
            }
            for (int64_t h = 0; h < NKV; h++) {
                if (L[L_K_NORM]) rms_norm(k + h * D, PTR(const float *, L[L_K_NORM]), eps, D, k + h * D);
                rope(k + h * D, cs, D);
            }
#ifdef RL_ATTEND512
            if (half) { /* rounded to nearest even, as torch's .to(float16) */
                store_half_512((uint16_t *)k_cache + slots[r] * NKV * D, k, NKV * D);
                store_half_512((uint16_t *)v_cache + slots[r] * NKV * D, v, NKV * D);
                continue;
            }
#endif
            memcpy((float *)k_cache + slots[r] * NKV * D, k, sizeof(float) * NKV * D);
            memcpy((float *)v_cache + slots[r] * NKV * D, v, sizeof(float) * NKV * D);
        }
        attn_job a = {.qkv = qkv, .out = att, .k_cache = k_cache, .v_cache = v_cache, .half = half,
                      .seq_lens = seq_lens, .block_table = block_table,
                      .table_stride = table_stride, .page = page, .nh = NH, .nkv = NKV, .d = D,
                      .scale = 1.0f / sqrtf((float)D), .scores = scores, .max_seq_len = max_len};
        /* a (query head, key) pair costs ~7 ns here (32 requests x ~100 keys x 3 heads: ~0.2 ms
         * a layer on one core); a step of more than ~4k pairs (~30 us) is cut into at least 4
         * chunks per thread, a short batch-1 context stays on the caller */
        const int64_t tasks = M * NKV, per_task = max_len * (NH / NKV);
        int64_t chunk = 1 + 4096 / (per_task > 0 ? per_task : 1);
        const int64_t spread = (tasks + 4 * rl_num_threads() - 1) / (4 * rl_num_threads());
        if (tasks * per_task > 4096 && chunk > spread) chunk = spread;
        rl_parallel_for(attend, &a, tasks, chunk);
        status |= rl_linear_gguf((int)L[L_O_FMT], PTR(const uint8_t *const *, L[L_O_ROWS]), H, NH * D, att,
                       M, NH * D, act_bits, 0, y, H, NULL, isa);
        for (int64_t i = 0; i < M * H; i++) res[i] += y[i];
        for (int64_t r = 0; r < M; r++)
            rms_norm(res + r * H, PTR(const float *, L[L_POST_NORM]), eps, H, x + r * H);
        status |= rl_linear_gguf((int)L[L_GU_FMT], PTR(const uint8_t *const *, L[L_GU_ROWS]), 2 * I, H, x,
                       M, H, act_bits, 0, gu, 2 * I, NULL, isa);
        status |= rl_linear_gguf((int)L[L_DOWN_FMT], PTR(const uint8_t *const *, L[L_DOWN_ROWS]), H, I, gu,
                       M, 2 * I, act_bits, 1, y, H, NULL, isa);
        for (int64_t i = 0; i < M * H; i++) res[i] += y[i];
    }
    for (int64_t r = 0; r < M; r++) rms_norm(res + r * H, final_norm, eps, H, out + r * H);
    return status ? -1 : 0;
}
