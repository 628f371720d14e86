/* y = x @ w.T for a few rows x (a decode step's tokens), on torch's packed int4 weights.
   Included once, by native_decode.c (after its `Weight` and GROUP), which compiles
   everything as one unit.

   Contract:
   - `gemm(w, x, m, ldx, y, ldy, block, scratch)`: for each of m rows, y (w->n floats) =
     x (w->k floats) @ w.T (+ bias), with gemm_scratch(m, k) words of scratch. Output rows
     are split over OpenMP threads in blocks; each output is summed by one thread in a fixed
     order, whatever the thread count and whatever the other rows: a row's result is the
     same alone or in a batch.
   - The layout is torch's CPU int4 kernel's (aten._weight_int4pack_mm_for_cpu): blocks of
     `block` output rows (64 where torch was built for AVX-512, 32 for AVX2); within a
     block, for every input k, block / 2 bytes whose low nibble is row j's code and high
     nibble row j + block / 2's. One bf16 scale and zero per group of 32 inputs and output
     row: w = (code - 8) s + z. An 8-bit weight is two 4-bit ones side by side (high codes
     times 16 s, then low), its input read twice.
   - Per group the codes times x are summed per row, then the group's scale and zero are
     applied once: sum_k x_k ((c_k - 8) s + z) = s (sum_k x_k c_k) + (z - 8 s) (sum_k x_k).
   - Four versions of that loop, the first the compiler's flags allow (GEMV_KERNEL names it,
     `minisgl_gemv_kernel()` reports it): AVX-512 with VBMI and VNNI ("quads": four inputs
     per instruction, two x rows per pass), AVX-512 ("pairs": two inputs), both for 64-row
     blocks, on x rounded per group of 32 to 15-bit integers (within half a step of the
     group's largest |x| / 16383; bf16, what torch's kernel takes, keeps 8 bits) and summed
     exactly in int32; AVX2 for 32-row blocks and plain C for any block (compilers vectorize
     it poorly: they widen the bytes in steps), both in float32. */

#define XQ_MAX 16383 /* |x| rounded per group to integers up to this: 15 bits */

static inline float bf16_to_float(uint16_t v)
{
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

/* y[first + j] = sums[j] (+ bias) for the block's `count` rows that exist (n is not always a
   multiple of the block) */
static inline void store_rows(const Weight *w, const float *sums, int first, int count, float *y)
{
    for (int j = 0; j < count && first + j < w->n; j++)
        y[first + j] = sums[j] + (w->bias ? w->bias[first + j] : 0.0f);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 16 rows' (scale, zero) pairs as floats: each 32-bit lane holds two bf16, scale low */
static inline void scale_zero16(const uint16_t *sz, __m512 *s, __m512 *z)
{
    const __m512i pair = _mm512_loadu_si512(sz);
    *s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
    *z = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000)));
}

/* acc[r] += each of 16 rows' integer sum `part[r]` (rows 16r .. 16r + 15 of the block) times
   its scale and the group's step, plus (z - 8 s) times the group's sum of x */
static inline void apply_scales(__m512 acc[4], const __m512 part[4], const uint16_t *sz,
                                const __m512 step[4], float xsum)
{
    const __m512 eight = _mm512_set1_ps(8.0f), xs = _mm512_set1_ps(xsum);
    for (int r = 0; r < 4; r++) {
        __m512 s, z;
        scale_zero16(sz + 32 * r, &s, &z);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s, step[r]), part[r], acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_fnmadd_ps(eight, s, z), xs, acc[r]);
    }
}

static inline void store_rows64(const Weight *w, const __m512 acc[4], int nb, float *y)
{
    float out[64];
    for (int r = 0; r < 4; r++)
        _mm512_storeu_ps(out + 16 * r, acc[r]);
    store_rows(w, out, nb * 64, 64, y);
}
#endif

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
/* Rows [64 nb, 64 nb + 64), four inputs per instruction. x's integers are split into bytes,
   xq = 128 xh + xl (xh in [-128, 127], xl in [0, 127]); vpdpbusd sums four code-times-byte
   products per 32-bit lane, once for xh and once for xl, exactly in int32. One byte
   permutation (vpermt2b) turns four inputs' 32 bytes each into lanes that hold one row's
   four codes; a high nibble stays in place (16 times its code), the 16 comes out with the
   scale. `xq4`: per four inputs, their xh bytes as one int32, then their xl bytes. */
#define GEMV_KERNEL "quads"
#define ROWS64 2 /* x rows a call takes: the permuted codes serve both (registers allow 2) */
static inline __attribute__((always_inline)) void
block64_rows(const Weight *w, const int32_t *const *xq4, const float *const *dx,
             const float *const *xsum, int nb, float *const *y, const int rows)
{
    const int groups = w->kp / GROUP, x_groups = w->k / GROUP;
    const uint8_t *codes = w->packed + (size_t)nb * w->kp * 32;
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    /* byte 4j + t of the result <- byte j (rows j, j + 32) of input t's 32: lane j holds
       the bytes j, j + 32, j + 64, j + 96; the second index takes bytes 16 .. 31 (rows
       j + 16, j + 48) */
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i index[2] = {
        _mm512_add_epi32(_mm512_mullo_epi32(lanes, _mm512_set1_epi32(0x01010101)),
                         _mm512_set1_epi32(0x60402000)),
        _mm512_add_epi32(_mm512_mullo_epi32(lanes, _mm512_set1_epi32(0x01010101)),
                         _mm512_set1_epi32(0x70503010))};
    __m512 acc[ROWS64][4];
    for (int m = 0; m < rows; m++)
        for (int r = 0; r < 4; r++)
            acc[m][r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const int gx = g % x_groups; /* 8-bit: x again */
        const uint8_t *b = codes + (size_t)g * GROUP * 32;
        /* per x row, rows 0-15, 16-31 (low nibbles), 32-47, 48-63 (high) of the block;
           xh's sums, then xl's */
        __m512i sh[ROWS64][4], sl[ROWS64][4];
        for (int m = 0; m < rows; m++)
            for (int r = 0; r < 4; r++)
                sh[m][r] = sl[m][r] = _mm512_setzero_si512();
        for (int i = 0; i < GROUP / 4; i++, b += 128) { /* inputs 4i .. 4i + 3 */
            const __m512i z0 = _mm512_loadu_si512(b), z1 = _mm512_loadu_si512(b + 64);
            const __m512i a = _mm512_permutex2var_epi8(z0, index[0], z1);
            const __m512i c = _mm512_permutex2var_epi8(z0, index[1], z1);
            const __m512i codes4[4] = {_mm512_and_si512(a, low), _mm512_and_si512(c, low),
                                       _mm512_and_si512(a, high), _mm512_and_si512(c, high)};
            for (int m = 0; m < rows; m++) {
                const int32_t *x4 = xq4[m] + (size_t)gx * GROUP / 2 + 2 * i;
                const __m512i vh = _mm512_set1_epi32(x4[0]), vl = _mm512_set1_epi32(x4[1]);
                for (int r = 0; r < 4; r++) {
                    sh[m][r] = _mm512_dpbusd_epi32(sh[m][r], codes4[r], vh);
                    sl[m][r] = _mm512_dpbusd_epi32(sl[m][r], codes4[r], vl);
                }
            }
        }
        const uint16_t *sz = w->sz + ((size_t)g * w->n_pad + (size_t)nb * 64) * 2;
        for (int m = 0; m < rows; m++) {
            __m512 part[4], step[4];
            for (int r = 0; r < 4; r++) {
                part[r] = _mm512_cvtepi32_ps(
                    _mm512_add_epi32(_mm512_slli_epi32(sh[m][r], 7), sl[m][r]));
                step[r] = _mm512_set1_ps(r < 2 ? dx[m][gx] : dx[m][gx] / 16.0f);
            }
            apply_scales(acc[m], part, sz, step, xsum[m][gx]);
        }
    }
    for (int m = 0; m < rows; m++)
        store_rows64(w, acc[m], nb, y[m]);
}

/* Rows [64 nb, 64 nb + 64) of y[m] = x[m] @ w.T for `rows` x rows (ROWS64 at most) */
static void block64(const Weight *w, const int32_t *const *xq4, const float *const *dx,
                    const float *const *xsum, int nb, float *const *y, int rows)
{
    if (rows == 2)
        block64_rows(w, xq4, dx, xsum, nb, y, 2);
    else
        block64_rows(w, xq4, dx, xsum, nb, y, 1);
}

/* x's integers as the quads kernel reads them */
static void pack_x(const int16_t *xq, int k, int32_t *xq4)
{
    for (int i = 0; i < k; i += 4) {
        uint32_t h = 0, l = 0;
        for (int t = 0; t < 4; t++) {
            const int hi = xq[i + t] >> 7; /* floor(xq / 128): xq - 128 hi is in [0, 127] */
            h |= (uint32_t)(uint8_t)(int8_t)hi << (8 * t);
            l |= (uint32_t)(xq[i + t] - 128 * hi) << (8 * t);
        }
        xq4[i / 2] = (int32_t)h;
        xq4[i / 2 + 1] = (int32_t)l;
    }
}

#elif defined(__AVX512F__) && defined(__AVX512BW__)
/* Rows [64 nb, 64 nb + 64), two inputs per instruction: their integers meet their codes as
   16-bit pairs (vpdpwssd, or vpmaddwd and an add), summed exactly in int32. `xq2`: per two
   inputs, their int16s as one int32, the first low. */
#define GEMV_KERNEL "pairs"
static inline __m512i dot_pairs(__m512i acc, __m512i a, __m512i b)
{
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

static void block64_row(const Weight *w, const int32_t *xq2, const float *dx,
                        const float *xsum, int nb, float *y)
{
    const int groups = w->kp / GROUP, x_groups = w->k / GROUP;
    const uint8_t *codes = w->packed + (size_t)nb * w->kp * 32;
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
        const int32_t *xp = xq2 + (size_t)gx * GROUP / 2;
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
        const __m512 d = _mm512_set1_ps(dx[gx]), step[4] = {d, d, d, d};
        apply_scales(acc, part, w->sz + ((size_t)g * w->n_pad + (size_t)nb * 64) * 2, step,
                     xsum[gx]);
    }
    store_rows64(w, acc, nb, y);
}

#define ROWS64 1
static void block64(const Weight *w, const int32_t *const *xq2, const float *const *dx,
                    const float *const *xsum, int nb, float *const *y, int rows)
{
    (void)rows; /* ROWS64: one */
    block64_row(w, xq2[0], dx[0], xsum[0], nb, y[0]);
}

/* x's integers as the pairs kernel reads them: the int16s themselves, two to an int32 */
static void pack_x(const int16_t *xq, int k, int32_t *xq2) { memcpy(xq2, xq, sizeof(int16_t) * k); }
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* Rows [32 nb, 32 nb + 32) in float32, for torch's AVX2 packing */
static void block32(const Weight *w, const float *x, const float *xsum, int nb, float *y)
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
    store_rows(w, out, nb * 32, 32, y);
}
#define HAVE_BLOCK32 1
#ifndef GEMV_KERNEL
#define GEMV_KERNEL "avx2"
#endif
#endif

#ifndef GEMV_KERNEL
#define GEMV_KERNEL "plain"
#endif

/* Rows [block nb, block nb + block) in plain C, for any block */
static void block_c(const Weight *w, const float *x, const float *xsum, int nb, float *y,
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
    store_rows(w, acc, nb * block, block, y);
}

/* Scratch `gemm` needs for m rows of k inputs, in 4-byte words: per row, the sums and steps
   of its groups and its integers packed two or four to a word */
static inline size_t gemm_scratch(int m, int k) { return (size_t)m * (k / 2 + 2 * (k / GROUP)); }

/* y[r] = x[r] @ w.T (+ bias) for m rows (x: row r at x + r ldx, y: at y + r ldy). Each block
   of output rows goes to one thread, which runs it for every row in turn: the block's codes
   (kp x 32 bytes) are read from memory once, then from the core's cache. */
static void gemm(const Weight *w, const float *x, int m, size_t ldx, float *y, size_t ldy,
                 int block, void *scratch)
{
    const int x_groups = w->k / GROUP, blocks = w->n_pad / block;
    float *xsum = scratch, *dx = xsum + (size_t)m * x_groups;
    for (int r = 0; r < m; r++)
        for (int g = 0; g < x_groups; g++) {
            const float *xg = x + r * ldx + (size_t)g * GROUP;
            float s = 0.0f;
            for (int i = 0; i < GROUP; i++)
                s += xg[i];
            xsum[(size_t)r * x_groups + g] = s;
        }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (block == 64) { /* x rounded per group: xq dx, |xq| <= XQ_MAX */
        int32_t *packed = (int32_t *)(dx + (size_t)m * x_groups);
        int16_t xq[w->k];
        for (int r = 0; r < m; r++) {
            for (int g = 0; g < x_groups; g++) {
                const float *xg = x + r * ldx + (size_t)g * GROUP;
                float top = 0.0f;
                for (int i = 0; i < GROUP; i++)
                    top = fabsf(xg[i]) > top ? fabsf(xg[i]) : top;
                dx[(size_t)r * x_groups + g] = top / XQ_MAX;
                const float inv = top > 0.0f ? XQ_MAX / top : 0.0f;
                for (int i = 0; i < GROUP; i++)
                    xq[g * GROUP + i] = (int16_t)lrintf(xg[i] * inv);
            }
            pack_x(xq, w->k, packed + (size_t)r * (w->k / 2));
        }
#pragma omp parallel for schedule(static)
        for (int nb = 0; nb < blocks; nb++)
            for (int r = 0; r < m; r += ROWS64) {
                const int rows = m - r < ROWS64 ? m - r : ROWS64;
                const int32_t *xr[ROWS64];
                const float *dr[ROWS64], *sr[ROWS64];
                float *yr[ROWS64];
                for (int i = 0; i < rows; i++) {
                    xr[i] = packed + (size_t)(r + i) * (w->k / 2);
                    dr[i] = dx + (size_t)(r + i) * x_groups;
                    sr[i] = xsum + (size_t)(r + i) * x_groups;
                    yr[i] = y + (r + i) * ldy;
                }
                block64(w, xr, dr, sr, nb, yr, rows);
            }
        return;
    }
#endif
    (void)dx;
#pragma omp parallel for schedule(static)
    for (int nb = 0; nb < blocks; nb++)
        for (int r = 0; r < m; r++) {
#ifdef HAVE_BLOCK32
            if (block == 32) {
                block32(w, x + r * ldx, xsum + (size_t)r * x_groups, nb, y + r * ldy);
                continue;
            }
#endif
            block_c(w, x + r * ldx, xsum + (size_t)r * x_groups, nb, y + r * ldy, block);
        }
}
