/* One decode step of one request on the CPU, the whole model in one call.

   Contract (the Python side is minisgl/models/native.py):
   - `minisgl_decode(model, step)` runs every decoder layer and the final norm for one
     token: the input row `x` (hidden floats: the token's embedding) becomes the final
     hidden state in place; each layer stores the token's K/V at `step->slot` of the pool
     and attends over the request's first `seq_len` keys, read page by page through its
     block table (native_attention.h).
   - `minisgl_gemv(w, x, y)` is y = x @ w.T (+ bias) for one row: the LM head, outside the
     step so that the logits come back to Python like the torch path's.
   - The weights are read where torch keeps them, in the layout of its CPU int4 kernel: no
     second copy (native_gemv.h, which says how the codes lie and how each kernel sums them;
     `minisgl_gemv_kernel()` names the kernel this build uses).
   - Activations are float32 between the projections; inside one, the AVX-512 kernels round
     x per group of 32 to 15-bit integers (native_gemv.h).
   - The work inside each projection and each layer's attention is split over OpenMP
     threads (the runtime torch itself uses, so the thread count torch is set to is the
     count used here), in pieces fixed by the shapes alone: results do not depend on the
     thread count.
*/
#include <math.h>
#include <stddef.h>
#include <stdint.h>
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

#include "native_gemv.h"
#include "native_attention.h"

void minisgl_gemv(const Weight *w, const float *x, float *y, int32_t block)
{
    gemv(w, x, y, block);
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

/* floats of scratch a step needs */
int64_t minisgl_work_floats(const Model *m)
{
    const int64_t qkv = (int64_t)(m->heads + 2 * m->kv_heads) * m->head_dim;
    return m->hidden + qkv + (int64_t)m->heads * m->head_dim + 2 * (int64_t)m->inter +
           m->inter + m->hidden + attend_floats(m);
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
    float *part = out + hidden;            /* attention's parts before they are merged */
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
        attend(m, l, q, att, step->pages, len, part);
        gemv(&L->o, att, out, m->block);
        for (int i = 0; i < hidden; i++)
            x[i] += out[i];
        rms_norm(x, L->ln2, xn, hidden, m->eps);
        gemv(&L->gate_up, xn, gu, m->block);
        silu_mul(gu, gu + m->inter, act, m->inter);
        gemv(&L->down, act, out, m->block);
        for (int i = 0; i < hidden; i++)
            x[i] += out[i];
    }
    rms_norm(x, m->norm, x, hidden, m->eps);
}
