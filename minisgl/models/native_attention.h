/* Attention of decode tokens, each over its own request's keys, read page by page from the
   KV pool. Included once, by native_decode.c (after its `Model`), which compiles
   everything as one unit.

   Contract: `attend(m, layer, batch, q, .., out, .., pages, .., lens, part)` writes, for
   each of `batch` decode tokens, softmax(q k / sqrt(d)) v for every query head (q and out:
   heads x head_dim floats; a query head h reads KV head h / (heads / kv_heads)) over the
   first lens[b] positions of its block table row, in `layer` of the pool. `part` is
   scratch of batch x attend_floats(m) floats. A token's result depends on neither the
   thread count nor the other tokens.

   The shape of the work: each token's positions are cut into up to SPLIT runs (split-K, as
   GPU decode kernels do), all shared out over the threads, each run's partial softmax
   merged after; in a run, TILE positions at a time, one pass over the keys for the scores,
   one over the values. A position's keys for every KV head are one row of the pool,
   contiguous with the next position's within a page, so memory is read in order. The
   loops over scores are written out in AVX-512 where the CPU has it (compilers leave them
   scalar: the plain C versions below are several times slower). */

/* exp(x) for x <= 0, in a form compilers vectorize (libm's expf is a call per value):
   2^(x log2 e) as 2^n times a degree-7 polynomial of 2^f, f in [-1/2, 1/2] (relative error
   about 1e-8, under float32's own rounding). Below -87 it gives about 1e-38, not 0: a
   weight that small against the largest (1) changes no sum. */
#define EXP_FLOOR (-87.0f)
#define LOG2E 1.44269504088896341f
/* 2^f's polynomial, highest power first (ln 2^k / k!) */
static const float EXP2_POLY[8] = {1.52527338e-5f, 1.54035304e-4f, 1.33335581e-3f,
                                   9.61812911e-3f, 5.55041087e-2f, 2.40226507e-1f,
                                   6.93147181e-1f, 1.0f};

static inline float exp_nonpos(float x)
{
    const float t = (x > EXP_FLOOR ? x : EXP_FLOOR) * LOG2E;
    const int n = -(int)(0.5f - t); /* round(t): t <= 0, so truncation is a ceiling here */
    const float f = t - (float)n;
    float p = EXP2_POLY[0];
    for (int i = 1; i < 8; i++)
        p = p * f + EXP2_POLY[i];
    union { int32_t i; float f; } scale = {.i = (n + 127) << 23};
    return p * scale.f;
}

/* q . k over d floats */
static inline float dot(const float *q, const float *k, int d)
{
#if defined(__AVX512F__)
    if (d % 16 == 0) { /* one vector sum at the end, not a scalar chain of 16 adds */
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
        for (int i = 16; i < d; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < d; i++)
        s += q[i] * k[i];
    return s;
}

/* The three loops of a tile's softmax and values, in AVX-512 where the CPU has it (16 floats
   at a time; compilers leave these loops scalar) and plain C elsewhere.
   row_max: the largest of x[0:n] and `init`. exp_row: x[j] = exp(x[j] - top), returning
   their sum. weighted_rows: acc[0:w] += sum over j < n of weight[j] * rows[j][offset:][0:w],
   w <= 16: one head's output slice summed over a tile's value rows in a register, not
   through memory at every row. */
#if defined(__AVX512F__)
static inline __mmask16 first(int k) { return k >= 16 ? 0xFFFF : (__mmask16)((1u << k) - 1); }

static inline float row_max(const float *x, int n, float init)
{
    __m512 top = _mm512_set1_ps(init);
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = first(n - j);
        top = _mm512_mask_max_ps(top, k, top, _mm512_maskz_loadu_ps(k, x + j));
    }
    return _mm512_reduce_max_ps(top);
}

static inline float exp_row(float *x, int n, float top)
{
    __m512 sum = _mm512_setzero_ps();
    const __m512 floor = _mm512_set1_ps(EXP_FLOOR), log2e = _mm512_set1_ps(LOG2E);
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = first(n - j);
        const __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), _mm512_set1_ps(top));
        const __m512 t = _mm512_mul_ps(_mm512_max_ps(v, floor), log2e);
        const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 f = _mm512_sub_ps(t, r);
        __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
        for (int i = 1; i < 8; i++)
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
        const __m512 e = _mm512_scalef_ps(p, r); /* p 2^r */
        _mm512_mask_storeu_ps(x + j, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

static inline void weighted_rows(float *acc, const float *weight, const float *const *rows,
                                 size_t offset, int n, int w)
{
    const __mmask16 k = first(w);
    __m512 a = _mm512_maskz_loadu_ps(k, acc);
    for (int j = 0; j < n; j++)
        a = _mm512_fmadd_ps(_mm512_set1_ps(weight[j]),
                            _mm512_maskz_loadu_ps(k, rows[j] + offset), a);
    _mm512_mask_storeu_ps(acc, k, a);
}
#else
static inline float row_max(const float *x, int n, float init)
{
    for (int j = 0; j < n; j++)
        init = fmaxf(init, x[j]);
    return init;
}

static inline float exp_row(float *x, int n, float top)
{
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {
        x[j] = exp_nonpos(x[j] - top);
        sum += x[j];
    }
    return sum;
}

static inline void weighted_rows(float *acc, const float *weight, const float *const *rows,
                                 size_t offset, int n, int w)
{
    float a[16];
    memcpy(a, acc, sizeof(float) * w);
    for (int j = 0; j < n; j++)
        for (int u = 0; u < w; u++)
            a[u] += weight[j] * rows[j][offset + u];
    memcpy(acc, a, sizeof(float) * w);
}
#endif

/* Every query head over positions [p0, p1) of the request: softmax(q k / sqrt(d)) v,
   unnormalised. Positions go TILE at a time: their scores (a position's keys for all KV
   heads are one row of the pool, read once for every head), the scores' maximum and
   exponentials, then the values; a running maximum per head rescales what was summed
   before a larger score. Out: per head its maximum `best`, the sum of exponentials
   `total`, and `acc` (heads x head_dim) the exponential-weighted sum of values. */
#define TILE 64
static void attend_run(const Model *m, int layer, const float *q, const int32_t *pages, int p0,
                       int p1, float *acc, float *best, float *total)
{
    const int d = m->head_dim, H = m->heads, G = m->heads / m->kv_heads, ps = m->page_size;
    const size_t row = (size_t)m->kv_heads * d;
    const float *keys = m->k_cache + (size_t)layer * m->slots * row;
    const float *values = m->v_cache + (size_t)layer * m->slots * row;
    const float scale = 1.0f / sqrtf((float)d);
    float s[H][TILE];
    const float *rows[TILE];
    for (int h = 0; h < H; h++) {
        best[h] = -INFINITY;
        total[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * H * d);
    for (int t0 = p0; t0 < p1; t0 += TILE) {
        const int n = p1 - t0 < TILE ? p1 - t0 : TILE;
        for (int j = 0; j < n; j++) {
            const size_t slot = (size_t)pages[(t0 + j) / ps] * ps + (t0 + j) % ps;
            const float *k = keys + slot * row;
            rows[j] = values + slot * row;
            for (int h = 0; h < H; h++)
                s[h][j] = dot(q + (size_t)h * d, k + (size_t)(h / G) * d, d) * scale;
        }
        for (int h = 0; h < H; h++) {
            float *sh = s[h];
            const float top = row_max(sh, n, best[h]);
            if (top > best[h]) { /* a larger score: what was summed is rescaled to it */
                const float c = exp_nonpos(best[h] - top); /* ~0 for the first tile */
                total[h] *= c;
                for (int i = 0; i < d; i++)
                    acc[(size_t)h * d + i] *= c;
                best[h] = top;
            }
            total[h] += exp_row(sh, n, top);
            for (int c = 0; c < d; c += 16)
                weighted_rows(acc + (size_t)h * d + c, sh, rows, (size_t)(h / G) * d + c, n,
                              d - c < 16 ? d - c : 16);
        }
    }
}

/* Attention of a batch of decode tokens, each over its own request's keys: for token b,
   every query head of q + b q_stride over the first lens[b] positions of the block table
   row pages + b page_stride, into out + b out_stride (heads x head_dim). Each token's
   positions are cut into up to SPLIT runs (split-K, as GPU decode kernels do); all the
   tokens' runs are shared out over the threads together, and each token's are then merged.
   A run's bounds depend on its token's length alone, never on the thread count or the other
   tokens, so a token's result is the same on any number of threads, alone or in a batch. */
#define SPLIT 4    /* runs: shared out evenly over 1, 2 or 4 threads */
#define MIN_RUN 32 /* fewer positions per run than this and the runs are fewer */

/* floats of scratch `attend` needs per token: per run, each head's acc, best and total */
static int64_t attend_floats(const Model *m)
{
    return (int64_t)SPLIT * m->heads * (m->head_dim + 2);
}

static inline int runs_of(int len)
{
    const int runs = (len + MIN_RUN - 1) / MIN_RUN;
    return runs < SPLIT ? runs : SPLIT;
}

static void attend(const Model *m, int layer, int batch, const float *q, size_t q_stride,
                   float *out, size_t out_stride, const int32_t *pages, size_t page_stride,
                   const int32_t *lens, float *part)
{
    const int d = m->head_dim, H = m->heads;
    const size_t stride = (size_t)H * (d + 2); /* one run's part: acc, best, total */
    int items = 0, item_token[batch * SPLIT], item_run[batch * SPLIT];
    for (int b = 0; b < batch; b++)
        for (int r = 0; r < runs_of(lens[b]); r++, items++) {
            item_token[items] = b;
            item_run[items] = r;
        }
#pragma omp parallel for schedule(static)
    for (int i = 0; i < items; i++) {
        const int b = item_token[i], r = item_run[i], len = lens[b];
        const int per = (len + runs_of(len) - 1) / runs_of(len);
        const int p0 = r * per < len ? r * per : len, p1 = p0 + per < len ? p0 + per : len;
        float *at = part + ((size_t)b * SPLIT + r) * stride;
        attend_run(m, layer, q + b * q_stride, pages + b * page_stride, p0, p1, at, at + H * d,
                   at + H * d + H);
    }
    for (int b = 0; b < batch; b++) {
        const float *token_part = part + (size_t)b * SPLIT * stride;
        const int runs = runs_of(lens[b]);
        for (int h = 0; h < H; h++) {
            float top = -INFINITY, total = 0.0f, *o = out + b * out_stride + (size_t)h * d;
            for (int r = 0; r < runs; r++)
                top = fmaxf(top, token_part[(size_t)r * stride + H * d + h]);
            memset(o, 0, sizeof(float) * d);
            for (int r = 0; r < runs; r++) {
                const float *at = token_part + (size_t)r * stride;
                if (at[H * d + H + h] == 0.0f) /* an empty run */
                    continue;
                const float c = exp_nonpos(at[H * d + h] - top);
                total += c * at[H * d + H + h];
                for (int i = 0; i < d; i++)
                    o[i] += c * at[(size_t)h * d + i];
            }
            for (int i = 0; i < d; i++)
                o[i] /= total;
        }
    }
}
