/* One decode step on the CPU, the whole model in one call: one new token for each of up to
   `max_batch` requests.

   Contract (the Python side is minisgl/models/native.py):
   - `minisgl_decode(model, step)` runs every decoder layer and the final norm for the
     step's tokens: the input rows `x` (batch x hidden floats: the tokens' embeddings)
     become the final hidden states in place; each layer stores token b's K/V at
     `step->slot[b]` of the pool and attends over its request's first `seq_len[b]` keys,
     read page by page through its block table row (native_attention.h).
   - `minisgl_gemm(w, x, m, y)` is y = x @ w.T (+ bias) for m rows: the LM head, outside the
     step so that the logits come back to Python like the torch path's.
   - The weights are read where torch keeps them, in the layout of its CPU int4 kernel: no
     second copy (native_gemv.h, which says how the codes lie and how each kernel sums them;
     `minisgl_gemv_kernel()` names the kernel this build uses). In a batch, each block of
     weight rows is read from memory once for all the tokens.
   - Activations are float32 between the projections; inside one, the AVX-512 kernels round
     x per group of 32 to 15-bit integers (native_gemv.h).
   - The work inside each projection and each layer's attention is split over OpenMP
     threads (the runtime torch itself uses, so the thread count torch is set to is the
     count used here), in pieces fixed by the shapes alone: a token's results depend on
     neither the thread count nor the other tokens of the step.
*/
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define GROUP 32 /* inputs per scale and zero */

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
    int32_t max_batch; /* the most tokens a step takes: what `work` is sized for */
    float eps;
    const Layer *layers;
    const float *norm;       /* the final RMSNorm's weight */
    float *k_cache, *v_cache; /* (num_layers, slots, kv_heads, head_dim) */
    int64_t slots;
    const float *cos, *sin;  /* (positions, head_dim): RoPE's tables, sin signed */
    float *work;             /* minisgl_work_floats(model) floats of scratch */
} Model;

typedef struct {
    float *x;               /* (batch, hidden) in: the embeddings; out: the final hidden states */
    const int64_t *pos;     /* (batch,) each token's position */
    const int64_t *slot;    /* (batch,) the pool slot its K/V goes to */
    const int32_t *pages;   /* (batch, page_stride) each token's request's block table row */
    const int32_t *seq_len; /* (batch,) keys after this step, the token's own included */
    int32_t batch, page_stride;
} Step;

#include "native_gemv.h"
#include "native_attention.h"

/* y = x @ w.T (+ bias) for m rows (x: (m, k), y: (m, n)): the LM head, outside the step so
   that the logits come back to Python like the torch path's. 0, or -1 without memory. */
int32_t minisgl_gemm(const Weight *w, const float *x, int32_t m, float *y, int32_t block)
{
    void *scratch = malloc(gemm_scratch(m, w->k) * 4);
    if (scratch == NULL)
        return -1;
    gemm(w, x, m, w->k, y, w->n, block, scratch);
    free(scratch);
    return 0;
}

const char *minisgl_gemv_kernel(void) { return GEMV_KERNEL; }

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

/* out = silu(gate) * up over n values: gate sigmoid(gate) up, the sigmoid from
   e = exp(-|gate|) <= 1 (1 / (1 + e) above 0, e / (1 + e) below), in a loop compilers
   vectorize (expf is a call per value: 46,000 a token for the embedded model) */
static void silu_mul(const float *gate, const float *up, float *out, int n)
{
    for (int i = 0; i < n; i++) {
        const float g = gate[i], e = exp_nonpos(g > 0.0f ? -g : g);
        out[i] = g * (g > 0.0f ? 1.0f : e) / (1.0f + e) * up[i];
    }
}

/* The widths of a token's rows of scratch in a step, in the order they lie in `work` */
enum { XN, QKV, ATT, GU, ACT, OUT, PART, ROWS };

static void row_widths(const Model *m, int64_t width[ROWS])
{
    width[XN] = m->hidden;                                           /* a block's normed input */
    width[QKV] = (int64_t)(m->heads + 2 * m->kv_heads) * m->head_dim; /* q, k, v heads */
    width[ATT] = (int64_t)m->heads * m->head_dim;                    /* attention's output */
    width[GU] = 2 * (int64_t)m->inter;                               /* gate, then up */
    width[ACT] = m->inter;                                           /* silu(gate) * up */
    width[OUT] = m->hidden;                                          /* a projection's output */
    width[PART] = attend_floats(m);                                  /* attention's runs */
}

static int max_inputs(const Model *m)
{
    const int hd = m->heads * m->head_dim, k = m->hidden > m->inter ? m->hidden : m->inter;
    return k > hd ? k : hd;
}

/* floats of scratch a step of up to max_batch tokens needs */
int64_t minisgl_work_floats(const Model *m)
{
    int64_t width[ROWS], total = 0;
    row_widths(m, width);
    for (int i = 0; i < ROWS; i++)
        total += width[i] * m->max_batch;
    return total + (int64_t)gemm_scratch(m->max_batch, max_inputs(m));
}

/* rms_norm of each of `batch` rows of n floats */
static void rms_norm_rows(const float *x, const float *weight, float *y, int batch, int n,
                          float eps)
{
    for (int b = 0; b < batch; b++)
        rms_norm(x + (size_t)b * n, weight, y + (size_t)b * n, n, eps);
}

void minisgl_decode(const Model *m, const Step *step)
{
    const int H = m->heads, Hkv = m->kv_heads, D = m->head_dim, hidden = m->hidden;
    const int B = step->batch;
    int64_t width[ROWS];
    row_widths(m, width);
    float *row[ROWS], *at = m->work; /* each: (B, width) */
    for (int i = 0; i < ROWS; i++) {
        row[i] = at;
        at += width[i] * m->max_batch;
    }
    void *scratch = at; /* the projections' quantized inputs */
    float *x = step->x, *xn = row[XN], *qkv = row[QKV], *att = row[ATT], *gu = row[GU];
    float *act = row[ACT], *out = row[OUT];
    const size_t kv_row = (size_t)Hkv * D;
    for (int l = 0; l < m->num_layers; l++) {
        const Layer *L = &m->layers[l];
        rms_norm_rows(x, L->ln1, xn, B, hidden, m->eps);
        gemm(&L->qkv, xn, B, hidden, qkv, width[QKV], m->block, scratch);
        for (int b = 0; b < B; b++) {
            float *q = qkv + b * width[QKV], *k = q + H * D, *v = k + Hkv * D;
            const float *cos = m->cos + step->pos[b] * D, *sin = m->sin + step->pos[b] * D;
            for (int h = 0; h < H + Hkv; h++) { /* q's heads then k's: contiguous */
                if (L->q_norm)
                    rms_norm(q + h * D, h < H ? L->q_norm : L->k_norm, q + h * D, D, m->eps);
                rotate(q + h * D, cos, sin, D);
            }
            const size_t to = ((size_t)l * m->slots + step->slot[b]) * kv_row;
            memcpy(m->k_cache + to, k, kv_row * sizeof(float));
            memcpy(m->v_cache + to, v, kv_row * sizeof(float));
        }
        attend(m, l, B, qkv, width[QKV], att, width[ATT], step->pages, step->page_stride,
               step->seq_len, row[PART]);
        gemm(&L->o, att, B, width[ATT], out, hidden, m->block, scratch);
        for (int i = 0; i < B * hidden; i++)
            x[i] += out[i];
        rms_norm_rows(x, L->ln2, xn, B, hidden, m->eps);
        gemm(&L->gate_up, xn, B, hidden, gu, width[GU], m->block, scratch);
        for (int b = 0; b < B; b++)
            silu_mul(gu + b * width[GU], gu + b * width[GU] + m->inter, act + b * width[ACT],
                     m->inter);
        gemm(&L->down, act, B, width[ACT], out, hidden, m->block, scratch);
        for (int i = 0; i < B * hidden; i++)
            x[i] += out[i];
    }
    rms_norm_rows(x, m->norm, x, B, hidden, m->eps);
}
