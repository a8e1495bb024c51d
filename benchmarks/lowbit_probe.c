/* The same-bytes probe of bench_lowbit_adam.py: one pass that reads and writes exactly the bytes of a
 * compressed-moment Adam step (fp32 master, fp16 grad in, fp16 copy out, the moments and their scales) and
 * does no arithmetic: what "at the speed of memory" means for that job.  Built with the kernel's flags, and
 * prefetching ahead as the kernel does (without it, the kernel's prefetch outran this bound). */
#include <stdint.h>

#define BLOCK 256
#define AHEAD 2

/* One block [b0, end) of moments of type T: the master negated, the grad copied out, both moments' sign bits
 * (SIGN) flipped; each byte read and written once, no arithmetic. */
#define TOUCH_BLOCK(T, SIGN)                       \
    do {                                           \
        T *restrict a = m, *restrict b = v;        \
        for (int64_t i = b0; i < end; i++) {       \
            p[i] = -p[i];                          \
            out[i] = g[i];                         \
            a[i] ^= (SIGN);                        \
            b[i] ^= (SIGN);                        \
        }                                          \
    } while (0)

/* state_kind 1: bf16 moments (2 + 2 bytes); 2: int8 codes (1 + 1 bytes) and fp32 scales per block */
void tm_probe(int64_t n, float *restrict p, const uint16_t *restrict g, uint16_t *restrict out, int state_kind,
              void *restrict m, void *restrict v, float *restrict ms, float *restrict vs) {
    for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
        const int64_t end = n - b0 < BLOCK ? n : b0 + BLOCK;
        if (b0 + (AHEAD + 1) * BLOCK <= n) {
            const int64_t a = b0 + AHEAD * BLOCK;
            const int msz = state_kind == 1 ? 2 : 1;
            for (int c = 0; c < BLOCK * 4; c += 64) __builtin_prefetch((const char *)(p + a) + c, 1);
            for (int c = 0; c < BLOCK * 2; c += 64) {
                __builtin_prefetch((const char *)(g + a) + c, 0);
                __builtin_prefetch((const char *)(out + a) + c, 1);
            }
            for (int c = 0; c < BLOCK * msz; c += 64) {
                __builtin_prefetch((const char *)m + a * msz + c, 1);
                __builtin_prefetch((const char *)v + a * msz + c, 1);
            }
        }
        if (state_kind == 1) {
            TOUCH_BLOCK(uint16_t, 0x8000u);
        } else {
            TOUCH_BLOCK(uint8_t, 0x80u);
            ms[b0 / BLOCK] = -ms[b0 / BLOCK];
            vs[b0 / BLOCK] = -vs[b0 / BLOCK];
        }
    }
}
