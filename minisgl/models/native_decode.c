/* One decode step of one request on the CPU, the whole model in one call.

   Contract (the Python side is minisgl/models/native.py):
   - `minisgl_decode(model, step)` runs every decoder layer and the final norm for one
     token: the input row `x` (hidden floats: the token's embedding) becomes the final
     hidden state in place; each layer stores the token's K/V at `step->slot` of the pool
     and attends over the request's first `seq_len` keys, read page by page through its
     block table.
   - `minisgl_gemv(w, x, y)` is y = x @ w.T (+ bias) for one row: the LM head, outside the
     step so that the logits come back to Python like the torch path's.
   - The weights are read where torch keeps them, in the layout of its CPU int4 kernel
     (aten._weight_int4pack_mm_for_cpu): no second copy. Blocks of `block` output rows
     (64 where torch was built for AVX-512, 32 for AVX2); within a block, for every input
     k, block / 2 bytes whose low nibble is row j's code and high nibble row j + block / 2's.
     One bf16 scale and zero per group of 32 inputs and output row: w = (code - 8) s + z.
     An 8-bit weight is two 4-bit ones side by side (high codes times 16 s, then low), its
     input read twice.
   - Activations are float32 between the projections. Inside one, the AVX-512 kernel
     rounds its input to 16-bit integers per group of 32 (xq * dx, within half a step of
     dx = the group's largest |x| / 32767) and sums code * xq exactly in int32; the AVX2
     and plain C kernels multiply in float32.
   - Output rows are split over OpenMP threads (the runtime torch itself uses, so the
     thread count torch is set to is the count used here); each row is summed by one
     thread in a fixed order, so results do not depend on the thread count.
*/
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32

typedef struct {
    const uint8_t *packed;  /* (n_pad / block, kp, block / 2) bytes */
    const uint16_t *sz;     /* (kp / GROUP, n_pad, 2) bf16: scale, zero */
    const float *bias;      /* (n,) or NULL */
    int32_t n, n_pad, k, kp; /* outputs, padded outputs, inputs, packed inputs (2k: 8-bit) */
} Weight;

typedef struct {
    const float *ln1, *ln2;       /* the two RMSNorm weights (hidden,) */
    const float *q_norm, *k_norm; /* per-head RMSNorm weights (head_dim,), or NULL */
    Weight qkv, o, gate_up, down;
} Layer;

typedef struct {
    int32_t num_layers, hidden, heads, kv_heads, head_dim, inter, page_size, block;
    float eps;
    const Layer *layers;
    const float *norm;       /* the final RMSNorm's weight */
    float *k_cache, *v_cache; /* (num_layers, slots, kv_heads, head_dim) */
    int64_t slots;
    const float *cos, *sin;  /* (positions, head_dim): RoPE's tables, sin signed */
    float *work;             /* minisgl_work_floats(model) floats of scratch */
} Model;

typedef struct {
    float *x;              /* (hidden,) in: the embedding; out: the final hidden state */
    const int64_t *pos;    /* the token's position */
    const int64_t *slot;   /* the pool slot its K/V goes to */
    const int32_t *pages;  /* the request's block table row */
    const int32_t *seq_len; /* keys after this step, this token's included */
} Step;

static inline float bf16_to_float(uint16_t v)
{
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

/* Rows [nb * block, nb * block + block) of y = x @ w.T: per group, the codes times x summed
   per row in float32, then the group's scale and zero applied once:
   sum_k x_k ((c_k - 8) s + z) = s (sum_k x_k c_k) + (z - 8 s) (sum_k x_k).
   Three versions of one loop: AVX-512 for torch's 64-row blocks, AVX2 for its 32-row
   ones, and plain C for any block (which compilers vectorize poorly here: they widen the
   bytes in steps, so the intrinsics pay). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* 16 rows' (scale, zero) pairs as floats: each 32-bit lane holds two bf16, scale low */
static inline void scale_zero16(const uint16_t *sz, __m512 *s, __m512 *z)
{
    const __m512i pair = _mm512_loadu_si512(sz);
    *s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
    *z = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000)));
}

/* acc + the products of a's and b's 16-bit pairs, summed per 32-bit lane */
static inline __m512i dot_pairs(__m512i acc, __m512i a, __m512i b)
{
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* Integer dot products: x is rounded per group to 16-bit integers (xq * dx, |xq| < 2^15,
   about 5 significant digits; bf16, what the torch kernel takes, keeps 3), and two
   inputs at a time meet their codes as 16-bit pairs, summed exactly in int32. */
static void gemv_block64(const Weight *w, const int32_t *xpairs, const float *dx,
                         const float *xsum, int nb, float *y)
{
    const int groups = w->kp / GROUP, x_groups = w->k / GROUP;
    const uint8_t *codes = w->packed + (size_t)nb * w->kp * 32;
    const __m512 eight = _mm512_set1_ps(8.0f);
    const __m512i nibble = _mm512_set1_epi16(15);
    /* unpacklo/hi interleave within 128-bit lanes: lane L of `a` holds rows 8L..8L+3,
       of `b` rows 8L+4..8L+7; these put rows 0-15 and 16-31 back in order */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21,
                                            22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15,
                                             28, 29, 30, 31);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (int g = 0; g < groups; g++) {
        const int gx = g % x_groups; /* 8-bit: x again */
        const int32_t *xp = xpairs + (size_t)gx * GROUP / 2;
        const uint8_t *b = codes + (size_t)g * GROUP * 32;
        __m512i lo_a = _mm512_setzero_si512(), lo_b = lo_a, hi_a = lo_a, hi_b = lo_a;
        for (int i = 0; i < GROUP / 2; i++, b += 64) { /* inputs 2i and 2i + 1 */
            const __m512i xv = _mm512_set1_epi32(xp[i]);
            const __m512i w0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)b));
            const __m512i w1 =
                _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 32)));
            const __m512i pa = _mm512_unpacklo_epi16(w0, w1), pb = _mm512_unpackhi_epi16(w0, w1);
            lo_a = dot_pairs(lo_a, _mm512_and_si512(pa, nibble), xv);
            lo_b = dot_pairs(lo_b, _mm512_and_si512(pb, nibble), xv);
            hi_a = dot_pairs(hi_a, _mm512_srli_epi16(pa, 4), xv);
            hi_b = dot_pairs(hi_b, _mm512_srli_epi16(pb, 4), xv);
        }
        const __m512 fa = _mm512_cvtepi32_ps(lo_a), fb = _mm512_cvtepi32_ps(lo_b);
        const __m512 ga = _mm512_cvtepi32_ps(hi_a), gb = _mm512_cvtepi32_ps(hi_b);
        const __m512 part[4] = {
            _mm512_permutex2var_ps(fa, first, fb), _mm512_permutex2var_ps(fa, second, fb),
            _mm512_permutex2var_ps(ga, first, gb), _mm512_permutex2var_ps(ga, second, gb)};
        const __m512 xs = _mm512_set1_ps(xsum[gx]), d = _mm512_set1_ps(dx[gx]);
        const uint16_t *sz = w->sz + ((size_t)g * w->n_pad + (size_t)nb * 64) * 2;
        for (int r = 0; r < 4; r++) {
            __m512 s, z;
            scale_zero16(sz + 32 * r, &s, &z);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s, d), part[r], acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_fnmadd_ps(eight, s, z), xs, acc[r]);
        }
    }
    float out[64];
    for (int r = 0; r < 4; r++)
        _mm512_storeu_ps(out + 16 * r, acc[r]);
    const int row0 = nb * 64;
    for (int j = 0; j < 64 && row0 + j < w->n; j++)
        y[row0 + j] = out[j] + (w->bias ? w->bias[row0 + j] : 0.0f);
}
#define GEMV_INT16 1
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static void gemv_block32(const Weight *w, const float *x, const float *xsum, int nb, float *y)
{
    const int groups = w->kp / GROUP, x_groups = w->k / GROUP;
    const uint8_t *codes = w->packed + (size_t)nb * w->kp * 16;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int g = 0; g < groups; g++) {
        const float *xg = x + (size_t)(g % x_groups) * GROUP;
        const uint8_t *b = codes + (size_t)g * GROUP * 16;
        __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
        for (int i = 0; i < GROUP; i++, b += 16) {
            const __m256 xi = _mm256_set1_ps(xg[i]);
            const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
            const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8)));
            const __m256i low = _mm256_set1_epi32(15);
            p0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, low)), xi, p0);
            p1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, low)), xi, p1);
            p2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), xi, p2);
            p3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), xi, p3);
        }
        const float xs = xsum[g % x_groups];
        const uint16_t *sz = w->sz + ((size_t)g * w->n_pad + (size_t)nb * 32) * 2;
        float part[32];
        _mm256_storeu_ps(part, p0);
        _mm256_storeu_ps(part + 8, p1);
        _mm256_storeu_ps(part + 16, p2);
        _mm256_storeu_ps(part + 24, p3);
        float sum[32];
        for (int j = 0; j < 32; j++) {
            const float s = bf16_to_float(sz[2 * j]), z = bf16_to_float(sz[2 * j + 1]);
            sum[j] = s * part[j] + (z - 8.0f * s) * xs;
        }
        for (int r = 0; r < 4; r++)
            acc[r] = _mm256_add_ps(acc[r], _mm256_loadu_ps(sum + 8 * r));
    }
    float out[32];
    for (int r = 0; r < 4; r++)
        _mm256_storeu_ps(out + 8 * r, acc[r]);
    const int first = nb * 32;
    for (int j = 0; j < 32 && first + j < w->n; j++)
        y[first + j] = out[j] + (w->bias ? w->bias[first + j] : 0.0f);
}
#define GEMV_BLOCK32 gemv_block32
#endif

/* the plain C version, for any block */
static void gemv_block_c(const Weight *w, const float *x, const float *xsum, int nb, float *y,
                         int block)
{
    const int half = block / 2, groups = w->kp / GROUP, x_groups = w->k / GROUP;
    const uint8_t *codes = w->packed + (size_t)nb * w->kp * half;
    float acc[64] = {0};
    for (int g = 0; g < groups; g++) {
        const float *xg = x + (size_t)(g % x_groups) * GROUP;
        const uint8_t *cg = codes + (size_t)g * GROUP * half;
        float part[64] = {0};
        for (int i = 0; i < GROUP; i++) {
            const uint8_t *b = cg + (size_t)i * half;
            for (int j = 0; j < half; j++) {
                part[j] += (float)(b[j] & 15) * xg[i];
                part[j + half] += (float)(b[j] >> 4) * xg[i];
            }
        }
        const uint16_t *sz = w->sz + ((size_t)g * w->n_pad + (size_t)nb * block) * 2;
        const float xs = xsum[g % x_groups];
        for (int j = 0; j < block; j++) {
            const float s = bf16_to_float(sz[2 * j]), z = bf16_to_float(sz[2 * j + 1]);
            acc[j] += s * part[j] + (z - 8.0f * s) * xs;
        }
    }
    const int first = nb * block;
    for (int j = 0; j < block && first + j < w->n; j++)
        y[first + j] = acc[j] + (w->bias ? w->bias[first + j] : 0.0f);
}

static inline void gemv_block(const Weight *w, const float *x, const float *xsum, int nb,
                              float *y, int block)
{
#ifdef GEMV_BLOCK32
    if (block == 32)
        return GEMV_BLOCK32(w, x, xsum, nb, y);
#endif
    gemv_block_c(w, x, xsum, nb, y, block);
}

static void gemv(const Weight *w, const float *x, float *y, int block)
{
    const int x_groups = w->k / GROUP, blocks = w->n_pad / block;
    float xsum[x_groups];
    for (int g = 0; g < x_groups; g++) {
        float s = 0.0f;
        for (int i = 0; i < GROUP; i++)
            s += x[g * GROUP + i];
        xsum[g] = s;
    }
#ifdef GEMV_INT16
    if (block == 64) {
        int32_t xpairs[w->k / 2];
        float dx[x_groups];
        for (int g = 0; g < x_groups; g++) {
            float top = 0.0f;
            for (int i = 0; i < GROUP; i++)
                top = fmaxf(top, fabsf(x[g * GROUP + i]));
            dx[g] = top / 32767.0f;
            const float inv = top > 0.0f ? 32767.0f / top : 0.0f;
            for (int i = 0; i < GROUP; i += 2) {
                const int a = (int)lrintf(x[g * GROUP + i] * inv);
                const int b = (int)lrintf(x[g * GROUP + i + 1] * inv);
                xpairs[(g * GROUP + i) / 2] = (int32_t)((uint32_t)(uint16_t)a | ((uint32_t)b << 16));
            }
        }
#pragma omp parallel for schedule(static)
        for (int nb = 0; nb < blocks; nb++)
            gemv_block64(w, xpairs, dx, xsum, nb, y);
        return;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int nb = 0; nb < blocks; nb++)
        gemv_block(w, x, xsum, nb, y, block);
}

void minisgl_gemv(const Weight *w, const float *x, float *y, int32_t block)
{
    gemv(w, x, y, block);
}

/* y = x / rms(x) * weight, over n floats (y may be x) */
static void rms_norm(const float *x, const float *weight, float *y, int n, float eps)
{
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++)
        y[i] = x[i] * r * weight[i];
}

/* rotate-half RoPE of one head in place: x cos + roll(x, d / 2) sin (sin signed) */
static void rotate(float *x, const float *cos, const float *sin, int d)
{
    float t[d];
    const int h = d / 2;
    for (int i = 0; i < d; i++)
        t[i] = x[i] * cos[i] + x[i < h ? i + h : i - h] * sin[i];
    memcpy(x, t, sizeof t);
}

/* One query head over the request's keys: softmax(q k / sqrt(d)) v, online (one pass, a
   running maximum rescales what is summed so far), page by page through the block table */
static void attend_head(const Model *m, int layer, int head, const float *q, float *out,
                        const int32_t *pages, int len)
{
    const int d = m->head_dim, kvh = head / (m->heads / m->kv_heads), ps = m->page_size;
    const size_t row = (size_t)m->kv_heads * d, base = (size_t)layer * m->slots * row;
    const float scale = 1.0f / sqrtf((float)d);
    float acc[d];
    memset(acc, 0, sizeof acc);
    float best = -INFINITY, total = 0.0f;
    for (int p = 0; p < len; p++) {
        const size_t slot = (size_t)pages[p / ps] * ps + p % ps;
        const float *k = m->k_cache + base + slot * row + (size_t)kvh * d;
        const float *v = m->v_cache + base + slot * row + (size_t)kvh * d;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int i = 0; i < d; i++)
            s += q[i] * k[i];
        s *= scale;
        if (s > best) { /* rescale the sums to the new maximum */
            const float c = expf(best - s);
            total *= c;
            for (int i = 0; i < d; i++)
                acc[i] *= c;
            best = s;
        }
        const float e = expf(s - best);
        total += e;
        for (int i = 0; i < d; i++)
            acc[i] += e * v[i];
    }
    for (int i = 0; i < d; i++)
        out[i] = acc[i] / total;
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* floats of scratch a step needs */
int64_t minisgl_work_floats(const Model *m)
{
    const int64_t qkv = (int64_t)(m->heads + 2 * m->kv_heads) * m->head_dim;
    return m->hidden + qkv + (int64_t)m->heads * m->head_dim + 2 * (int64_t)m->inter +
           m->inter + m->hidden;
}

void minisgl_decode(const Model *m, const Step *step)
{
    const int H = m->heads, Hkv = m->kv_heads, D = m->head_dim, hidden = m->hidden;
    const int len = *step->seq_len;
    const int64_t slot = *step->slot;
    const float *cos = m->cos + *step->pos * D, *sin = m->sin + *step->pos * D;
    float *x = step->x;
    float *xn = m->work;                   /* (hidden,) normed input of a block */
    float *qkv = xn + hidden;              /* q heads, then k heads, then v heads */
    float *att = qkv + (H + 2 * Hkv) * D;  /* (H * D,) attention output */
    float *gu = att + H * D;               /* (2 * inter,) gate, then up */
    float *act = gu + 2 * m->inter;        /* (inter,) silu(gate) * up */
    float *out = act + m->inter;           /* (hidden,) a block's output */
    const size_t kv_row = (size_t)Hkv * D;
    for (int l = 0; l < m->num_layers; l++) {
        const Layer *L = &m->layers[l];
        rms_norm(x, L->ln1, xn, hidden, m->eps);
        gemv(&L->qkv, xn, qkv, m->block);
        float *q = qkv, *k = qkv + H * D, *v = k + Hkv * D;
        for (int h = 0; h < H + Hkv; h++) { /* q's heads then k's: contiguous */
            if (L->q_norm)
                rms_norm(q + h * D, h < H ? L->q_norm : L->k_norm, q + h * D, D, m->eps);
            rotate(q + h * D, cos, sin, D);
        }
        const size_t at = ((size_t)l * m->slots + slot) * kv_row;
        memcpy(m->k_cache + at, k, kv_row * sizeof(float));
        memcpy(m->v_cache + at, v, kv_row * sizeof(float));
#pragma omp parallel for schedule(static)
        for (int h = 0; h < H; h++)
            attend_head(m, l, h, q + h * D, att + h * D, step->pages, len);
        gemv(&L->o, att, out, m->block);
        for (int i = 0; i < hidden; i++)
            x[i] += out[i];
        rms_norm(x, L->ln2, xn, hidden, m->eps);
        gemv(&L->gate_up, xn, gu, m->block);
        for (int i = 0; i < m->inter; i++)
            act[i] = silu(gu[i]) * gu[m->inter + i];
        gemv(&L->down, act, out, m->block);
        for (int i = 0; i < hidden; i++)
            x[i] += out[i];
    }
    rms_norm(x, m->norm, x, hidden, m->eps);
}
