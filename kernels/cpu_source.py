"""The C source of the CPU kernels (``kernels/cpu.py`` builds and loads it; the numerics are described there)."""

SOURCE = r"""/* mxq CPU kernels: MX activation rounding and the MX GEMV/dequantize (see kernels/cpu.py).
 *
 * Built once per machine by kernels/cpu.py with the system C compiler (-O3 -march=native -fopenmp,
 * never -ffast-math: every elementwise step below is the IEEE operation the torch reference does)
 * and loaded with ctypes. Threads: OpenMP, the runtime torch itself loaded (libgomp.so.1), with the
 * thread count torch uses, passed in by the caller.
 *
 * Formats (fmt): 0 = E4M3 (bias 7, max 448, no inf, S.1111.111 NaN), 1 = E5M2 (bias 15, IEEE-like).
 * Scale bytes: biased E8M0, 0xFF = NaN, byte 0 = 2**-127.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef struct {
    int mbits, bias, emax;
    float max_normal;
    int nan_byte;
} fmt_t;

static const fmt_t FMTS[2] = {{3, 7, 8, 448.0f, 0x7F}, {2, 15, 15, 57344.0f, 0x7E}};

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* 2**e for integer e, from bits as formats.exp2_f32 does ((e + 127) << 23; e = -127 gives 0.0) */
static inline float exp2_bits(int e) { return u2f((uint32_t)(e + 127) << 23); }

/* One fp8 value of format f from its byte, as float (exact). */
static float decode_fp8(uint8_t b, const fmt_t *f) {
    int ebits = 7 - f->mbits;
    int sign = b >> 7, e = (b >> f->mbits) & ((1 << ebits) - 1), m = b & ((1 << f->mbits) - 1);
    float v;
    if (f->mbits == 3 && (b & 0x7F) == 0x7F) return NAN;
    if (f->mbits == 2 && e == 31) return m ? NAN : (sign ? -INFINITY : INFINITY);
    if (e == 0) v = ldexpf((float)m, 1 - f->bias - f->mbits);
    else v = ldexpf((float)((1 << f->mbits) | m), e - f->bias - f->mbits);
    return sign ? -v : v;
}

/* Shared exponent of a finite block from its amax (>= 0), formats._rule_exponent then the clamp.
 * rule: 0 floor, 1 rceil, 2 even. */
static int block_exponent(float amax, const fmt_t *f, int rule) {
    if (!(amax > 0.0f)) return -126;
    uint32_t bits = f2u(amax);
    int e = (int)((bits >> 23) & 0xFF) - 127;
    uint32_t mant = bits & 0x7FFFFF;
    if (rule == 0) {
        e = e - f->emax;
    } else if (rule == 1) {
        uint32_t max_mant = (uint32_t)((f->max_normal / ldexpf(1.0f, f->emax) - 1.0f) * 8388608.0f);
        e = e - f->emax + (mant > max_mant);
    } else {
        int shift = 23 - f->mbits;
        uint32_t rounded = (mant + (1u << (shift - 1))) >> shift;
        e = e + (int)(rounded >> f->mbits) - f->emax;
    }
    return e < -126 ? -126 : (e > 127 ? 127 : e);
}

/* x (already multiplied by 2**-e, clamped to +-max_normal) rounded to the fp8 grid, ties to even:
 * the value and its byte. */
static inline float round_fp8(float q, const fmt_t *f, uint8_t *byte) {
    uint32_t u = f2u(q);
    uint32_t sign = u >> 31;
    float a = fabsf(q);
    int emin = 1 - f->bias; /* exponent of the smallest normal */
    int ea = (int)((f2u(a) >> 23) & 0xFF) - 127;
    if (ea < emin) ea = emin; /* subnormal grid (also fp32 zero/subnormal inputs) */
    float ulp = exp2_bits(ea - f->mbits);
    float r = nearbyintf(a / ulp) * ulp; /* exact scalings by powers of two; nearbyint: ties to even */
    if (byte) {
        uint32_t rb = f2u(r);
        int er = (int)((rb >> 23) & 0xFF) - 127;
        uint32_t code;
        if (r == 0.0f) code = 0;
        else if (er >= emin) code = ((uint32_t)(er + f->bias) << f->mbits) | ((rb >> (23 - f->mbits)) & ((1u << f->mbits) - 1));
        else code = (uint32_t)(r / exp2_bits(emin - f->mbits));
        *byte = (uint8_t)((sign << 7) | code);
    }
    return sign ? -r : r;
}

static inline float bf16_to_f(uint16_t h) { return u2f((uint32_t)h << 16); }
static inline uint16_t f_to_bf16(float v) { /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u = f2u(v);
    return v != v ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

#ifdef __AVX512F__
/* One finite block of 32 (fp32 in xb) rounded as the scalar loop below does, 16 lanes at a time. */
static inline void quant_block32(const float *xb, const fmt_t *f, int e, float *ob, uint8_t *cb, uint16_t *o16) {
    const int mb = f->mbits, emin = 1 - f->bias, sh = 23 - mb;
    const __m512 down = _mm512_set1_ps(exp2_bits(-e)), up = _mm512_set1_ps(exp2_bits(e));
    const __m512 magic = _mm512_set1_ps(exp2_bits(emin - mb + 23)), sub_inv = _mm512_set1_ps(exp2_bits(mb - emin));
    const __m512i maxbits = _mm512_set1_epi32((int)f2u(f->max_normal)), absm = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i half = _mm512_set1_epi32((1 << (sh - 1)) - 1), one = _mm512_set1_epi32(1);
    const __m512i keep = _mm512_set1_epi32(~((1 << sh) - 1)), subtop = _mm512_set1_epi32((emin + 127) << 23);
    const __m512i rebias = _mm512_set1_epi32(f->bias - 127), mmask = _mm512_set1_epi32((1 << mb) - 1);
    for (int h = 0; h < 2; h++) {
        __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), down));
        __m512i sign = _mm512_andnot_si512(absm, u);
        __m512i a = _mm512_min_epu32(_mm512_and_si512(u, absm), maxbits);
        __m512i rn = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(a, half),
                                                       _mm512_and_si512(_mm512_srli_epi32(a, sh), one)), keep);
        __m512 rs = _mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(a), magic), magic);
        __mmask16 sub = _mm512_cmplt_epu32_mask(a, subtop);
        __m512i r = _mm512_mask_blend_epi32(sub, rn, _mm512_castps_si512(rs));
        __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(r, sign)), up);
        if (ob) _mm512_storeu_ps(ob + 16 * h, v);
        if (o16) {
            __m512i vb = _mm512_castps_si512(v);
            vb = _mm512_srli_epi32(_mm512_add_epi32(vb, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                   _mm512_and_si512(_mm512_srli_epi32(vb, 16), one))), 16);
            _mm256_storeu_si256((__m256i *)(o16 + 16 * h), _mm512_cvtepi32_epi16(vb));
        }
        if (cb) {
            __m512i cn = _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(_mm512_srli_epi32(r, 23), rebias), mb),
                                         _mm512_and_si512(_mm512_srli_epi32(r, sh), mmask));
            cn = _mm512_and_si512(cn, _mm512_set1_epi32(0x7F));
            __m512i cs = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(r), sub_inv));
            __m512i c = _mm512_or_si512(_mm512_mask_blend_epi32(sub, cn, cs), _mm512_srli_epi32(sign, 24));
            _mm_storeu_si128((__m128i *)(cb + 16 * h), _mm512_cvtepi32_epi8(c));
        }
    }
}
#endif

/* Rows of x [M, K] (fp32, or bf16 bits when in16) rounded to MX along K in blocks of bs
 * (K % bs == 0), as formats.fake_quantize_mx / quantize_mx: the rounded values into out32 (fp32)
 * or out16 (bf16 bits, rounded to nearest even: exact when the block exponent is >= -117), NaN for a block holding NaN or
 * Inf; codes [M, K] and scales [M, K / bs] when not NULL. Returns the smallest scale byte of the
 * finite blocks (255 if none). */
int mxq_quant_rows(const void *xin, int in16, int64_t M, int64_t K, int64_t bs, int fmt, int rule, float *out32,
                   uint16_t *out16, uint8_t *codes, uint8_t *scales, int nthreads) {
    const fmt_t *f = &FMTS[fmt];
    int64_t nb = K / bs;
    int smin = 255;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(min : smin) if (M * K >= 65536)
    for (int64_t r = 0; r < M * nb; r++) {
        float xb[256], ob[256];
        float amax = 0.0f;
        int finite = 1;
        for (int64_t j = 0; j < bs; j++) {
            xb[j] = in16 ? bf16_to_f(((const uint16_t *)xin)[r * bs + j]) : ((const float *)xin)[r * bs + j];
            float a = fabsf(xb[j]);
            if (!(a <= 3.4028234663852886e38f)) finite = 0;
            amax = a > amax ? a : amax;
        }
        uint8_t *cb = codes ? codes + r * bs : 0;
        if (!finite) {
            for (int64_t j = 0; j < bs; j++) ob[j] = NAN;
            if (cb) memset(cb, f->nan_byte, bs);
            if (scales) scales[r] = 0xFF;
        } else {
            int e = block_exponent(amax, f, rule);
#ifdef __AVX512F__
            if (bs == 32) {
                quant_block32(xb, f, e, out32 ? out32 + r * bs : 0, cb, out16 ? out16 + r * bs : 0);
                if (scales) scales[r] = (uint8_t)(e + 127);
                if (e + 127 < smin) smin = e + 127;
                continue;
            }
#endif
            float down = exp2_bits(-e), up = exp2_bits(e), maxn = f->max_normal;
            /* round to the fp8 grid, ties to even, branch-free (vectorizes): normal range by rounding
             * the fp32 mantissa to mbits bits (a carry moves into the exponent), subnormal range by
             * adding and subtracting 2**(emin - mbits + 23), whose ulp is the subnormal spacing */
            const int mb = f->mbits, emin = 1 - f->bias, sh = 23 - mb;
            const float magic = exp2_bits(emin - mb + 23), sub_inv = exp2_bits(mb - emin);
            uint8_t cbuf[256];
            for (int64_t j = 0; j < bs; j++) {
                float q = xb[j] * down;
                q = q < -maxn ? -maxn : (q > maxn ? maxn : q);
                uint32_t u = f2u(q), sign = u & 0x80000000u, a = u & 0x7FFFFFFFu;
                uint32_t rn = (a + ((1u << (sh - 1)) - 1) + ((a >> sh) & 1)) & ~((1u << sh) - 1);
                float rs = (u2f(a) + magic) - magic;
                int sub = (int)(a >> 23) < emin + 127;
                uint32_t r = sub ? f2u(rs) : rn;
                ob[j] = u2f(r | sign) * up;
                uint32_t cn = ((((r >> 23) - 127 + f->bias) << mb) | ((r >> sh) & ((1u << mb) - 1))) & 0x7F;
                uint32_t cs = (uint32_t)(u2f(r) * sub_inv);
                cbuf[j] = (uint8_t)((sign >> 24) | (sub ? cs : cn));
            }
            if (cb) memcpy(cb, cbuf, bs);
            if (scales) scales[r] = (uint8_t)(e + 127);
            if (e + 127 < smin) smin = e + 127;
        }
        if (out32) memcpy(out32 + r * bs, ob, bs * sizeof(float));
        if (out16)
            for (int64_t j = 0; j < bs; j++) out16[r * bs + j] = f_to_bf16(ob[j]);
    }
    return smin;
}

/* Per block scale of a weight row as a float: 2**(s - 127), byte 0 = 2**-127, 0xFF = NaN. */
static inline float scale_of(uint8_t s) {
    if (s == 0xFF) return NAN;
    if (s == 0) return ldexpf(1.0f, -127);
    return u2f((uint32_t)s << 23);
}

/* The weight [N, K] (codes, scales [N, K/bs]) dequantized, as fp32 (out32) or bf16 bits (out16):
 * code * scale exactly (bf16 holds every E4M3/E5M2 value times a power of two in its range). */
void mxq_dequant(const uint8_t *w, const uint8_t *s, int64_t N, int64_t K, int64_t bs, int fmt, float *out32,
                 uint16_t *out16, int nthreads) {
    const fmt_t *f = &FMTS[fmt];
    float lut[256];
    for (int i = 0; i < 256; i++) lut[i] = decode_fp8((uint8_t)i, f);
    int64_t nb = K / bs;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < nb; b++) {
            float sc = scale_of(s[n * nb + b]);
            const uint8_t *wb = w + n * K + b * bs;
            if (out32) {
                float *ob = out32 + n * K + b * bs;
                for (int64_t j = 0; j < bs; j++) ob[j] = lut[wb[j]] * sc;
            } else {
                uint16_t *ob = out16 + n * K + b * bs;
                for (int64_t j = 0; j < bs; j++) {
                    float v = lut[wb[j]] * sc;
                    uint32_t u = f2u(v);
                    if (v != v) ob[j] = 0x7FC0;
                    else ob[j] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16); /* RNE; exact for MX values */
                }
            }
        }
    }
}

#ifdef __AVX512F__
/* 16 fp8 codes -> 16 floats equal to value * 2**-8 (E4M3) or the value (E5M2), via fp16 bits. */
static inline __m512 codes16(const uint8_t *p, int fmt) {
    __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i h;
    if (fmt == 0) {
        /* S.EEEE.MMM -> fp16 S.0EEEE.MMM0000000: value * 2**(7 - 15) = value * 2**-8 */
        h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                            _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
        __m512 v = _mm512_cvtph_ps(h);
        /* S.1111.111 is NaN in E4M3 (fp16 would read 1.875 * 2**-8 ...) */
        __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7F));
        return _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(NAN));
    }
    h = _mm256_slli_epi16(b, 8); /* E5M2 is the top byte of fp16 */
    return _mm512_cvtph_ps(h);
}
#endif

/* y [M, N] = x [M, K] . W^T (+ bias), fp32 accumulation; W as codes [N, K] and scales [N, K/bs].
 * Per output and block: the block's products summed, times the block scale (a power of two, so
 * the same as summing code * scale * x), added to the row's sum. M <= 8 per pass over W. */
void mxq_gemv(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint8_t *s, int64_t N, int64_t bs,
              int fmt, const float *bias, float *y, int nthreads) {
    const fmt_t *f = &FMTS[fmt];
    int64_t nb = K / bs;
#ifdef __AVX512F__
    if (bs == 32) {
        const float fold = fmt == 0 ? 256.0f : 1.0f; /* codes16 gives E4M3 values times 2**-8 */
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *wr = w + n * K;
            const uint8_t *sr = s + n * nb;
            for (int64_t m0 = 0; m0 < M; m0 += 8) {
                int mm = (int)(M - m0 < 8 ? M - m0 : 8);
                __m512 acc[8];
                for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
                for (int64_t b = 0; b < nb; b++) {
                    uint8_t sb = sr[b];
                    float sc = scale_of(sb);
                    __m512 scv;
                    int twostep = fmt == 0 && sb > 246; /* 2**(s-127) * 256 would overflow */
                    scv = _mm512_set1_ps(twostep ? sc : sc * fold);
                    __m512 w0 = codes16(wr + b * 32, fmt), w1 = codes16(wr + b * 32 + 16, fmt);
                    if (twostep) {
                        w0 = _mm512_mul_ps(w0, _mm512_set1_ps(fold));
                        w1 = _mm512_mul_ps(w1, _mm512_set1_ps(fold));
                    }
                    for (int i = 0; i < mm; i++) {
                        const float *xr = x + (m0 + i) * K + b * 32;
                        __m512 p = _mm512_mul_ps(w0, _mm512_loadu_ps(xr));
                        p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), p);
                        acc[i] = _mm512_fmadd_ps(p, scv, acc[i]);
                    }
                }
                for (int i = 0; i < mm; i++) {
                    float v = _mm512_reduce_add_ps(acc[i]);
                    if (bias) v += bias[n];
                    y[(m0 + i) * N + n] = v;
                }
            }
        }
        return;
    }
#endif
    float lut[256];
    for (int i = 0; i < 256; i++) lut[i] = decode_fp8((uint8_t)i, f);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * K;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                const uint8_t *wb = w + n * K + b * bs;
                float sc = scale_of(s[n * nb + b]);
                /* A dequantized weight may overflow (E5M2's top code is < 2**16): scale each one first, as
                 * the reference does, so mixed-sign infinities sum to NaN as there. Exact otherwise. */
                int each = sc >= 0x1p112f;
                for (int64_t j = 0; j < bs; j++) part[j & 7] += (each ? lut[wb[j]] * sc : lut[wb[j]]) * xr[b * bs + j];
                float p = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
                acc += each ? p : p * sc;
            }
            if (bias) acc += bias[n];
            y[m * N + n] = acc;
        }
    }
}

/* bf16 bits of every fp8 code of format f (exact: at most 3 mantissa bits, exponents in range). */
static void bf16_table(const fmt_t *f, uint16_t *t) {
    for (int i = 0; i < 256; i++) {
        float v = decode_fp8((uint8_t)i, f);
        uint32_t u = f2u(v);
        t[i] = v != v ? (uint16_t)(0x7FC0 | ((u >> 16) & 0x8000)) : (uint16_t)(u >> 16);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MXQ_DOT 1
/* 32 codes -> 32 bf16 values (as epi16) through the 128-entry table of positive codes, sign ORed in */
static inline __m512i codes32(const uint8_t *p, __m512i t0, __m512i t1, __m512i t2, __m512i t3) {
    __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    __m512i lo = _mm512_permutex2var_epi16(t0, b, t1);
    __m512i hi = _mm512_permutex2var_epi16(t2, b, t3);
    __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)), lo, hi);
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(b, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}

/* Rows m0..m0+mm of y, columns 4g..4g+3 (those below N): each accumulator's lanes summed, plus the bias. */
static inline void store_rows(__m512 (*acc)[4], int mm, int64_t m0, int64_t g, int64_t N, const float *bias, float *y) {
    for (int i = 0; i < mm; i++)
        for (int r = 0; r < 4; r++) {
            if (g * 4 + r >= N) break;
            float v = _mm512_reduce_add_ps(acc[i][r]);
            if (bias) v += bias[g * 4 + r];
            y[(m0 + i) * N + g * 4 + r] = v;
        }
}

/* y [M, N] = x [M, K] (bf16 bits, every value exact) . W^T (+ bias) with AVX512-BF16 dot products:
 * each product exact in fp32, summed in fp32 (products below 2**-126 flush to zero). Four rows of W
 * and up to four rows of x per step; blocks of 32 along K. */
int mxq_gemv_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const uint8_t *s, int64_t N,
                  int fmt, const float *bias, float *y, int nthreads) {
    const fmt_t *f = &FMTS[fmt];
    uint16_t tab[256];
    float stab[256];
    bf16_table(f, tab);
    for (int i = 0; i < 256; i++) stab[i] = scale_of((uint8_t)i);
    __m512i t0 = _mm512_loadu_si512(tab), t1 = _mm512_loadu_si512(tab + 32);
    __m512i t2 = _mm512_loadu_si512(tab + 64), t3 = _mm512_loadu_si512(tab + 96);
    int64_t nb = K / 32, groups = (N + 3) / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t rows[4];
        for (int r = 0; r < 4; r++) rows[r] = g * 4 + r < N ? g * 4 + r : N - 1;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int mm = (int)(M - m0 < 4 ? M - m0 : 4);
            __m512 acc[4][4];
            for (int i = 0; i < 4; i++)
                for (int r = 0; r < 4; r++) acc[i][r] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m512i wv[4];
                __m512 sc[4];
                for (int r = 0; r < 4; r++) {
                    wv[r] = codes32(w + rows[r] * K + b * 32, t0, t1, t2, t3);
                    sc[r] = _mm512_set1_ps(stab[s[rows[r] * nb + b]]);
                }
                for (int i = 0; i < 4; i++) {
                    if (i >= mm) break;
                    __m512i xv = _mm512_loadu_si512(x + (m0 + i) * K + b * 32);
                    for (int r = 0; r < 4; r++) {
                        __m512 blk = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)wv[r], (__m512bh)xv);
                        acc[i][r] = _mm512_fmadd_ps(blk, sc[r], acc[i][r]);
                    }
                }
            }
            store_rows(acc, mm, m0, g, N, bias, y);
        }
    }
    return 1;
}
#else
int mxq_gemv_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const uint8_t *s, int64_t N,
                  int fmt, const float *bias, float *y, int nthreads) {
    return 0; /* no AVX512-BF16: the caller takes mxq_gemv */
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define MXQ_VBMI 1
/* Position in a 64-code chunk of word j of the "lo" (h = 0) or "hi" (h = 1) vector that
 * _mm512_unpack{lo,hi}_epi8 build from the decoded low and high bytes: 16 * lane + 8 * h + j % 8. */
static inline int chunk_pos(int h, int j) { return 16 * (j / 8) + 8 * h + (j % 8); }

/* MT rows of x (bf16, permuted per 64-chunk to the decoded weights' order, natural in a 32 tail)
 * times 4 rows of W. */
static inline void gemv_vbmi_tile(const uint16_t *xp, int64_t K, const uint8_t *w, const uint8_t *s,
                                  const int64_t rows[4], const float *stab, __m512i h0, __m512i h1, __m512i l0,
                                  __m512i l1, __m512i t0, __m512i t1, __m512i t2, __m512i t3, int MT, __m512 acc[2][4]) {
    int64_t nb = K / 32, nc = K / 64;
    for (int i = 0; i < MT; i++)
        for (int r = 0; r < 4; r++) acc[i][r] = _mm512_setzero_ps();
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    for (int64_t c = 0; c < nc; c++) {
        __m512i x0[2], x1[2];
        for (int i = 0; i < MT; i++) {
            x0[i] = _mm512_loadu_si512(xp + i * K + c * 64);
            x1[i] = _mm512_loadu_si512(xp + i * K + c * 64 + 32);
        }
        for (int r = 0; r < 4; r++) {
            __m512i b = _mm512_loadu_si512(w + rows[r] * K + c * 64);
            __m512i hi = _mm512_permutex2var_epi8(h0, b, h1);
            __m512i lo = _mm512_permutex2var_epi8(l0, b, l1);
            hi = _mm512_ternarylogic_epi32(hi, b, sign, 0xF8); /* hi | (b & 0x80) */
            __m512i wa = _mm512_unpacklo_epi8(lo, hi), wb = _mm512_unpackhi_epi8(lo, hi);
            const uint8_t *sr = s + rows[r] * nb + c * 2;
            __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(stab[sr[0]]), _mm256_set1_ps(stab[sr[1]]), 1);
            for (int i = 0; i < MT; i++) {
                __m512 blk = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)wa, (__m512bh)x0[i]);
                blk = _mm512_dpbf16_ps(blk, (__m512bh)wb, (__m512bh)x1[i]);
                acc[i][r] = _mm512_fmadd_ps(blk, sc, acc[i][r]);
            }
        }
    }
    if (nb & 1) { /* a last block of 32, natural order */
        int64_t b0 = nb - 1;
        for (int r = 0; r < 4; r++) {
            __m512i wv = codes32(w + rows[r] * K + b0 * 32, t0, t1, t2, t3);
            __m512 sc = _mm512_set1_ps(stab[s[rows[r] * nb + b0]]);
            for (int i = 0; i < MT; i++) {
                __m512i xv = _mm512_loadu_si512(xp + i * K + b0 * 32);
                __m512 blk = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)wv, (__m512bh)xv);
                acc[i][r] = _mm512_fmadd_ps(blk, sc, acc[i][r]);
            }
        }
    }
}

int mxq_gemv_vbmi(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const uint8_t *s, int64_t N,
                  int fmt, const float *bias, float *y, int nthreads) {
    const fmt_t *f = &FMTS[fmt];
    uint16_t tab[256];
    uint8_t hib[128], lob[128];
    float stab[256];
    bf16_table(f, tab);
    for (int i = 0; i < 128; i++) { hib[i] = (uint8_t)(tab[i] >> 8); lob[i] = (uint8_t)tab[i]; }
    /* E4M3 NaN codes keep their NaN high byte (0x7F | sign): 0x7FC0 | 0x8000 is still NaN */
    for (int i = 0; i < 256; i++) stab[i] = scale_of((uint8_t)i);
    __m512i h0 = _mm512_loadu_si512(hib), h1 = _mm512_loadu_si512(hib + 64);
    __m512i l0 = _mm512_loadu_si512(lob), l1 = _mm512_loadu_si512(lob + 64);
    __m512i t0 = _mm512_loadu_si512(tab), t1 = _mm512_loadu_si512(tab + 32);
    __m512i t2 = _mm512_loadu_si512(tab + 64), t3 = _mm512_loadu_si512(tab + 96);
    int64_t nc = K / 64;
    uint16_t *xp = (uint16_t *)malloc((size_t)(M * K) * sizeof(uint16_t));
    if (!xp) return 0;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t c = 0; c < nc; c++)
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 32; j++) xp[m * K + c * 64 + h * 32 + j] = x[m * K + c * 64 + chunk_pos(h, j)];
        for (int64_t k = nc * 64; k < K; k++) xp[m * K + k] = x[m * K + k];
    }
    int64_t groups = (N + 3) / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t rows[4];
        for (int r = 0; r < 4; r++) rows[r] = g * 4 + r < N ? g * 4 + r : N - 1;
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            __m512 acc[2][4];
            int mm = M - m0 >= 2 ? 2 : 1;
            if (mm == 2) gemv_vbmi_tile(xp + m0 * K, K, w, s, rows, stab, h0, h1, l0, l1, t0, t1, t2, t3, 2, acc);
            else gemv_vbmi_tile(xp + m0 * K, K, w, s, rows, stab, h0, h1, l0, l1, t0, t1, t2, t3, 1, acc);
            store_rows(acc, mm, m0, g, N, bias, y);
        }
    }
    free(xp);
    return 1;
}
#else
int mxq_gemv_vbmi(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const uint8_t *s, int64_t N,
                  int fmt, const float *bias, float *y, int nthreads) {
    return 0;
}
#endif
"""
