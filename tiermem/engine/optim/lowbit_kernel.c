/* One fused pass of AdamW over compressed moments: tiermem.core.lowbit's scheme, bit for bit.
 *
 * Per block of BLOCK elements: read the fp32 master, the grad (fp32, fp16 or bf16) and the moments
 * (bf16, or int8/uint8 codes and their blocks' fp32 scales), dequantize, update, write the master and the
 * working copy (fp16 or bf16, optional), round the new moments stochastically and write them back.  The
 * new moments of a block stay in two stack arrays between the update and the rounding, so every byte is
 * read and written once.
 *
 * The arithmetic is tiermem.core.adam_math's op for op, in fp32, built with -ffp-contract=off and fused
 * multiply-adds written out exactly where torch's vectorised CPU kernels use them (lerp, addcmul, add with
 * alpha): the new moments, hence their codes, scales and rounding, equal tiermem.core.lowbit.lowbit_update's
 * bits.  The master may differ from it by an ulp or two: torch's vectorised sqrt is not correctly rounded,
 * and the kernel multiplies by 1 / sqrt(1 - beta2^t) where torch divides.  Single-threaded: the caller cuts the range into pieces, each
 * starting on a block.  No allocation, no global state.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#define BLOCK 256
#define AHEAD 2 /* blocks prefetched ahead: 2 measured best of 1, 2, 3, 4 and 8 */
#define SHIFT 20
#define ONE (127 << 3)
#define HALF_STEP (1u << (SHIFT - 16 - 1)) /* lowbit._HALF_STEP: a dequantized value quantizes to its own code */
#define SIGNED_LEVELS 127
#define UNSIGNED_LEVELS 255

enum { G_F32 = 0, G_F16 = 1, G_BF16 = 2 };
enum { O_NONE = 0, O_F16 = 1, O_BF16 = 2 };
enum { S_BF16 = 1, S_INT8 = 2 };
enum { K_GRAD_SCALE, K_L2, K_DECAY, K_LERP, K_BETA2, K_OMB2, K_BIAS2_SQRT, K_EPS, K_NEG_STEP };

static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

static inline float bf16_to_f32(uint16_t b) { return u2f((uint32_t)b << 16); }

/* torch's float -> bfloat16: round to nearest even, NaN to the canonical quiet NaN */
static inline uint16_t f32_to_bf16_rne(float x) {
    uint32_t u = f2u(x);
    if (x != x) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline uint32_t hash32(uint32_t index, uint32_t step_term) {
    uint32_t h = index * 0x9E3779B1u + step_term;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    return h ^ (h >> 16);
}

/* fp16 <-> fp32 for n elements (round to nearest even, as torch): F16C where the build has it */
static inline void f16_to_f32(const uint16_t *restrict src, float *restrict dst, int n) {
    int j = 0;
#ifdef __F16C__
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + j))));
#endif
    for (; j < n; j++) dst[j] = (float)((const _Float16 *)src)[j];
}

static inline void f32_to_f16(const float *restrict src, uint16_t *restrict dst, int n) {
    int j = 0;
#ifdef __F16C__
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; j < n; j++) ((_Float16 *)dst)[j] = (_Float16)src[j];
}

/* x rounded to bfloat16 stochastically by r16 (lowbit.round_bf16) */
static inline uint16_t round_bf16(float x, uint32_t r16) {
    uint32_t u = f2u(x);
    if (!isfinite(x)) return x != x ? 0x7FC0 : (uint16_t)(u >> 16);
    return (uint16_t)((u + r16) >> 16);
}

static inline float code_value(int32_t code, int levels) {
    return code > 0 ? u2f((uint32_t)(code + ONE - levels) << SHIFT) : 0.0f;
}

/* codes 0..levels of a normalised magnitude n in [0, 1] (lowbit._quantize_magnitude, HALF_STEP included),
 * branch-free */
static inline int32_t quantize_magnitude(float n, uint32_t r16, int levels, float smallest, float below_step) {
    int32_t code = (int32_t)((f2u(n) + HALF_STEP + (r16 << (SHIFT - 16))) >> SHIFT) - (ONE - levels);
    code = code > levels ? levels : code;
    const int32_t below = (float)r16 * below_step < n;
    return n < smallest ? below : code;
}

/* One block of len <= BLOCK elements, in phases that each vectorise: load and widen, update, narrow and
 * store, reduce, round. */
static inline __attribute__((always_inline)) void run(
    int64_t numel, uint32_t start, uint32_t step_term, float *restrict p, const void *restrict grad,
    void *restrict out, void *restrict m_store, void *restrict v_store, float *restrict m_scale,
    float *restrict v_scale, const float *restrict k, const int gk, const int ok, const int sk) {
    const float gs = k[K_GRAD_SCALE], l2 = k[K_L2], decay = k[K_DECAY], w = k[K_LERP], beta2 = k[K_BETA2],
                omb2 = k[K_OMB2], bias2_sqrt = k[K_BIAS2_SQRT], eps = k[K_EPS], nss = k[K_NEG_STEP];
    const float m_smallest = code_value(1, SIGNED_LEVELS), v_smallest = code_value(1, UNSIGNED_LEVELS);
    const float m_below = m_smallest * (1.0f / 65536.0f), v_below = v_smallest * (1.0f / 65536.0f);
    /* one division fewer an element than torch's sqrt(v) / bias2_sqrt: the divider is the loop's bottleneck */
    const float inv_bias2_sqrt = 1.0f / bias2_sqrt;
    /* torch's vectorised lerp: a fused multiply-add from the nearer end */
    const int lerp_low = w < 0.5f;
    const float lerp_coef = lerp_low ? w : w - 1.0f;
    float gg[BLOCK], mm[BLOCK], vv[BLOCK];
    for (int64_t b0 = 0; b0 < numel; b0 += BLOCK) {
        const int len = numel - b0 < BLOCK ? (int)(numel - b0) : BLOCK;
        const int64_t blk = b0 / BLOCK;
        if (b0 + (AHEAD + 1) * BLOCK <= numel) {
            /* the lines of the block AHEAD blocks on, so that they arrive while this one computes: the
             * hardware prefetchers alone leave the pass waiting on memory (measured at 16M params on 2
             * threads: 1.23 to 1.54 Gparam/s for int8, 1.47 to 1.73 for bf16) */
            const int64_t a = b0 + AHEAD * BLOCK;
            const int gsz = gk == G_F32 ? 4 : 2, msz = sk == S_BF16 ? 2 : 1;
            for (int c = 0; c < BLOCK * 4; c += 64) __builtin_prefetch((const char *)(p + a) + c, 1);
            for (int c = 0; c < BLOCK * gsz; c += 64) __builtin_prefetch((const char *)grad + a * gsz + c, 0);
            if (ok != O_NONE)
                for (int c = 0; c < BLOCK * 2; c += 64) __builtin_prefetch((const char *)out + a * 2 + c, 1);
            for (int c = 0; c < BLOCK * msz; c += 64) {
                __builtin_prefetch((const char *)m_store + a * msz + c, 1);
                __builtin_prefetch((const char *)v_store + a * msz + c, 1);
            }
        }
        float *restrict pb = p + b0;
        if (gk == G_F16) {
            f16_to_f32((const uint16_t *)grad + b0, gg, len);
            for (int j = 0; j < len; j++) gg[j] = gg[j] * gs;
        } else if (gk == G_BF16) {
            for (int j = 0; j < len; j++) gg[j] = bf16_to_f32(((const uint16_t *)grad)[b0 + j]) * gs;
        } else {
            for (int j = 0; j < len; j++) gg[j] = ((const float *)grad)[b0 + j] * gs;
        }
        if (l2 != 0.0f)
            for (int j = 0; j < len; j++) gg[j] = fmaf(pb[j], l2, gg[j]); /* torch's add(alpha=): fused */
        if (sk == S_BF16) {
            for (int j = 0; j < len; j++) {
                mm[j] = bf16_to_f32(((const uint16_t *)m_store)[b0 + j]);
                vv[j] = bf16_to_f32(((const uint16_t *)v_store)[b0 + j]);
            }
        } else {
            const float ms = m_scale[blk], vs = v_scale[blk];
            for (int j = 0; j < len; j++) {
                const int32_t mc = ((const int8_t *)m_store)[b0 + j];
                const int32_t am = mc < 0 ? -mc : mc;
                const float mag = code_value(am, SIGNED_LEVELS);
                mm[j] = (mc < 0 ? -mag : mag) * ms;
                vv[j] = code_value(((const uint8_t *)v_store)[b0 + j], UNSIGNED_LEVELS) * vs;
            }
        }
        for (int j = 0; j < len; j++) {
            const float g = gg[j], m0 = mm[j], v0 = vv[j];
            const float p1 = pb[j] * decay;
            const float m1 = fmaf(lerp_coef, g - m0, lerp_low ? m0 : g);
            const float v1 = fmaf(omb2 * g, g, v0 * beta2); /* torch's addcmul: fused */
            const float denom = sqrtf(v1) * inv_bias2_sqrt + eps;
            const float pn = p1 + (nss * m1) / denom; /* torch's addcdiv: self + (value * t1) / t2 */
            pb[j] = v1 > 0.0f ? pn : p1;
            mm[j] = m1;
            vv[j] = v1;
        }
        if (ok == O_F16)
            f32_to_f16(pb, (uint16_t *)out + b0, len);
        else if (ok == O_BF16)
            for (int j = 0; j < len; j++) ((uint16_t *)out)[b0 + j] = f32_to_bf16_rne(pb[j]);
        if (sk == S_BF16) {
            for (int j = 0; j < len; j++) {
                const uint32_t h = hash32(start + (uint32_t)(b0 + j), step_term);
                ((uint16_t *)m_store)[b0 + j] = round_bf16(mm[j], h & 0xFFFFu);
                ((uint16_t *)v_store)[b0 + j] = round_bf16(vv[j], h >> 16);
            }
            continue;
        }
        /* the largest magnitudes as bits: for non-negative floats the integer order is the float order,
         * and anything at or above the bits of inf is not finite */
        uint32_t m_bits = 0, v_bits = 0;
        for (int j = 0; j < len; j++) {
            const uint32_t a = f2u(mm[j]) & 0x7FFFFFFFu, b = f2u(vv[j]) & 0x7FFFFFFFu;
            m_bits = a > m_bits ? a : m_bits;
            v_bits = b > v_bits ? b : v_bits;
        }
        if (m_bits >= 0x7F800000u || v_bits >= 0x7F800000u) {
            /* a non-finite moment poisons its block, as it would poison AdamW's state */
            m_scale[blk] = NAN;
            v_scale[blk] = NAN;
            memset((int8_t *)m_store + b0, 0, (size_t)len);
            memset((uint8_t *)v_store + b0, 0, (size_t)len);
            continue;
        }
        const float m_max = u2f(m_bits), v_max = u2f(v_bits);
        m_scale[blk] = m_max;
        v_scale[blk] = v_max;
        /* normalised by a product with the fp32 reciprocal, the block's largest exactly 1 (lowbit._normalised) */
        const float m_inv = 1.0f / (m_max > 0.0f ? m_max : 1.0f), v_inv = 1.0f / (v_max > 0.0f ? v_max : 1.0f);
        for (int j = 0; j < len; j++) {
            const uint32_t h = hash32(start + (uint32_t)(b0 + j), step_term);
            const float x = mm[j], ax = fabsf(x), v = vv[j];
            const float mn = ax == m_max ? 1.0f : ax * m_inv, vn = v == v_max ? 1.0f : v * v_inv;
            const int32_t mag = quantize_magnitude(mn, h & 0xFFFFu, SIGNED_LEVELS, m_smallest, m_below);
            ((int8_t *)m_store)[b0 + j] = (int8_t)(x < 0.0f ? -mag : mag);
            ((uint8_t *)v_store)[b0 + j] = (uint8_t)quantize_magnitude(vn, h >> 16, UNSIGNED_LEVELS, v_smallest, v_below);
        }
    }
}

#define RUN(G, O, S) run(numel, start, step_term, p, grad, out, m, v, m_scale, v_scale, k, G, O, S)
#define BY_OUT(G, S)                           \
    switch (out_kind) {                        \
        case O_NONE: RUN(G, O_NONE, S); break; \
        case O_F16: RUN(G, O_F16, S); break;   \
        case O_BF16: RUN(G, O_BF16, S); break; \
        default: return -2;                    \
    }
#define BY_GRAD(S)                           \
    switch (grad_kind) {                     \
        case G_F32: BY_OUT(G_F32, S); break;   \
        case G_F16: BY_OUT(G_F16, S); break;   \
        case G_BF16: BY_OUT(G_BF16, S); break; \
        default: return -1;                  \
    }

/* Elements [0, numel) of one piece, which begins on a block of its moments (int8); ``start`` is the index
 * of its first element in its state (what the rounding hashes), ``m_scale``/``v_scale`` its first block's
 * scales (int8; unused for bf16).  ``k``: the step's AdamScalars in fp32, in their order.
 * Returns 0, or a negative number for a kind it does not know. */
int tm_lowbit_adam(int64_t numel, uint32_t start, uint32_t step_term, float *p, const void *grad, int grad_kind,
                   void *out, int out_kind, int state_kind, void *m, void *v, float *m_scale, float *v_scale,
                   const float *k) {
    if (state_kind == S_BF16) {
        BY_GRAD(S_BF16);
    } else if (state_kind == S_INT8) {
        BY_GRAD(S_INT8);
    } else {
        return -3;
    }
    return 0;
}
