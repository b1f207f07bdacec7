/* int4 weights times float32 activations for the draft's small forwards, on a CPU with AVX-512 VNNI.
 *
 * Weights: groups of 32 along a row, each group's value = level * scale + low (level 0..15), rows in blocks of 16
 * (one row per 32-bit lane). For row block b, group g and sub-block j (the group's weights k = 32g + 8j .. +7)
 * 64 bytes: lane r holds row 16b + r, its byte i = level[k + i] | level[k + 4 + i] << 4. scales, lows: [N/16, G, 16].
 * Activations: each row of x per group of 32 as two int8 parts, x ~ high * step + low * step / 254 (step = max |x| /
 * 127; what rounding to whole steps leaves, within half a step, in 254ths of one: ~16 bits in all), so one vpdpbusd
 * multiplies 16 rows by 4 weights and adds them up, twice.
 * y[q, n] = sum_g scale[n, g] (levels . x)[g] + low[n, g] sum(x)[g], every product of levels and int8 parts exact.
 * The draft's tokens are proposals the target verifies: this changes how often one is accepted, never the output. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static void quantize(const float* x, int groups, int8_t* high, int8_t* low, float* step, float* total) {
    for (int g = 0; g < groups; g++) {
        float top = 0.f;
        for (int k = 0; k < 32; k++) top = fmaxf(top, fabsf(x[32 * g + k]));
        float coarse = top / 127.f, fine = coarse / 254.f;  /* what rounding to coarse steps leaves: within 127 fine */
        int sum_high = 0, sum_low = 0;
        for (int k = 0; k < 32; k++) {
            int h = top > 0.f ? (int)lrintf(x[32 * g + k] / coarse) : 0;
            int l = top > 0.f ? (int)lrintf((x[32 * g + k] - h * coarse) / fine) : 0;
            l = l > 127 ? 127 : (l < -127 ? -127 : l);
            high[32 * g + k] = (int8_t)h;
            low[32 * g + k] = (int8_t)l;
            sum_high += h;
            sum_low += l;
        }
        step[2 * g] = coarse;
        step[2 * g + 1] = fine;
        total[g] = (float)sum_high * coarse + (float)sum_low * fine;
    }
}

/* x: [rows, k] float32, y: [rows, n] float32. Returns 0, or -1 for a shape it does not take (or no memory). Each block
   of 16 weight rows (k / 2 bytes a row: 4.5 KB for k = 576) is read from memory once and kept in cache for every row
   of x, so a forward of a few tokens costs little more than one. */
int q4_vnni_matmul(const uint8_t* levels, const float* scales, const float* lows, const float* x, float* y,
                   int rows, int n, int k) {
    if (k % 32 || n % 16) return -1;
    if (rows < 1) return 0;
    int groups = k / 32;
    int8_t* parts = aligned_alloc(64, (size_t)rows * 2 * k);  /* per row: k high parts, then k low parts */
    float* steps = malloc(sizeof(float) * (size_t)rows * 3 * groups);  /* per row: 2 steps a group, then sums */
    if (!parts || !steps) {
        free(parts);
        free(steps);
        return -1;
    }
    for (int q = 0; q < rows; q++) {
        float* step = steps + (size_t)q * 3 * groups;
        quantize(x + (size_t)q * k, groups, parts + (size_t)q * 2 * k, parts + (size_t)q * 2 * k + k, step,
                 step + 2 * groups);
    }
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < n / 16; b++) {
        const uint8_t* block = levels + (size_t)b * groups * 256;
        const float* scale = scales + (size_t)b * groups * 16;
        const float* low = lows + (size_t)b * groups * 16;
        for (int q = 0; q < rows; q++) {
            const int32_t* h4 = (const int32_t*)(parts + (size_t)q * 2 * k);  /* 4 int8 activations a lane */
            const int32_t* l4 = (const int32_t*)(parts + (size_t)q * 2 * k + k);
            const float* step = steps + (size_t)q * 3 * groups;
            const float* total = step + 2 * groups;
            __m512 acc = _mm512_setzero_ps();
            for (int g = 0; g < groups; g++) {
                __m512i dot_high = _mm512_setzero_si512(), dot_low = _mm512_setzero_si512();
                for (int j = 0; j < 4; j++) {
                    __m512i packed = _mm512_loadu_si512((const void*)(block + g * 256 + j * 64));
                    __m512i first = _mm512_and_si512(packed, nibble);
                    __m512i second = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
                    int at = 8 * g + 2 * j;
                    dot_high = _mm512_dpbusd_epi32(dot_high, first, _mm512_set1_epi32(h4[at]));
                    dot_high = _mm512_dpbusd_epi32(dot_high, second, _mm512_set1_epi32(h4[at + 1]));
                    dot_low = _mm512_dpbusd_epi32(dot_low, first, _mm512_set1_epi32(l4[at]));
                    dot_low = _mm512_dpbusd_epi32(dot_low, second, _mm512_set1_epi32(l4[at + 1]));
                }
                __m512 s = _mm512_loadu_ps(scale + g * 16);
                __m512 coarse = _mm512_mul_ps(s, _mm512_set1_ps(step[2 * g]));
                __m512 fine = _mm512_mul_ps(s, _mm512_set1_ps(step[2 * g + 1]));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_high), coarse, acc);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_low), fine, acc);
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(low + g * 16), _mm512_set1_ps(total[g]), acc);
            }
            _mm512_storeu_ps(y + (size_t)q * n + 16 * b, acc);
        }
    }
    free(parts);
    free(steps);
    return 0;
}
