/* int4 weights times float32 activations for the draft's small forwards: one kernel for CPUs with AVX-512 VNNI, one
 * for CPUs with AVX2 and FMA; both read the same layout and give the same floats, bit for bit.
 *
 * Weights: groups of 32 along a row, each group's value = level * scale + low (level 0..15), rows in blocks of 16
 * (one row per 32-bit lane). For row block b, group g and sub-block j (the group's weights k = 32g + 8j .. +7)
 * 64 bytes: lane r holds row 16b + r, its byte i = level[k + i] | level[k + 4 + i] << 4. scales, lows: [N/16, G, 16].
 * Activations: each row of x per group of 32 as two int8 parts, x ~ high * step + low * step / 254 (step = max |x| /
 * 127; what rounding to whole steps leaves, within half a step, in 254ths of one: ~16 bits in all), so one vpdpbusd
 * multiplies 16 rows by 4 weights and adds them up, twice (with AVX2: vpmaddubsw for 8 rows by 2 weights into int16,
 * a group's 8 of them summed in int16, |sum| <= 8 * 2 * 15 * 127 = 30480, then vpmaddwd into int32).
 * y[q, n] = sum_g scale[n, g] (levels . x)[g] + low[n, g] sum(x)[g], every product of levels and int8 parts exact.
 * The draft's tokens are proposals the target verifies: this changes how often one is accepted, never the output. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

/* Each group of 32 activations as two int8 parts: high = round(x / coarse), low = round((x - high * coarse) / fine)
 * within +-127 (coarse = max |x| / 127, fine = coarse / 254: what rounding to whole coarse steps leaves, within 127
 * fine steps; a group too small for a normal fine step is all zero), its two steps and its sum in them. One function
 * for both variants (built with -fno-math-errno: lrintf is one instruction), so both give the same floats. */
static void quantize(const float* x, int groups, int8_t* high, int8_t* low, float* step, float* total) {
    for (int g = 0; g < groups; g++) {
        const float* v = x + 32 * g;
        float top = 0.f;
        for (int k = 0; k < 32; k++) top = fmaxf(top, fabsf(v[k]));
        float coarse = top / 127.f, fine = coarse / 254.f;
        int nonzero = fine > 1e-37f, sum_high = 0, sum_low = 0;
        for (int k = 0; k < 32; k++) {
            int h = nonzero ? (int)lrintf(v[k] / coarse) : 0;
            int l = nonzero ? (int)lrintf((v[k] - (float)h * coarse) / fine) : 0;
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

/* Every row of x quantized: per row k high parts then k low parts, and per row 2 steps a group then the sums. */
typedef struct {
    int8_t* parts;
    float* steps;
} Quantized;

static int quantize_rows(const float* x, int rows, int k, Quantized* out) {
    int groups = k / 32;
    out->parts = aligned_alloc(64, (size_t)rows * 2 * k);
    out->steps = malloc(sizeof(float) * (size_t)rows * 3 * groups);
    if (!out->parts || !out->steps) {
        free(out->parts);
        free(out->steps);
        return -1;
    }
    for (int q = 0; q < rows; q++) {
        float* step = out->steps + (size_t)q * 3 * groups;
        quantize(x + (size_t)q * k, groups, out->parts + (size_t)q * 2 * k, out->parts + (size_t)q * 2 * k + k, step,
                 step + 2 * groups);
    }
    return 0;
}

/* x: [rows, k] float32, y: [rows, n] float32. Returns 0, or -1 for a shape it does not take (or no memory). Each group
   of a block of 16 weight rows is unpacked once for every row of x, and the block (k / 2 bytes a row: 4.5 KB for
   k = 576) read from memory once, so a forward of a few tokens costs little more than one. */
AVX512 int q4_matmul_avx512vnni(const uint8_t* levels, const float* scales, const float* lows, const float* x,
                                float* y, int rows, int n, int k) {
    if (k % 32 || n % 16) return -1;
    if (rows < 1) return 0;
    int groups = k / 32;
    Quantized qx;
    if (quantize_rows(x, rows, k, &qx)) return -1;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < n / 16; b++) {
        const uint8_t* block = levels + (size_t)b * groups * 256;
        for (int q = 0; q < rows; q++) _mm512_storeu_ps(y + (size_t)q * n + 16 * b, _mm512_setzero_ps());
        for (int g = 0; g < groups; g++) {
            __m512i first[4], second[4];
            for (int j = 0; j < 4; j++) {
                __m512i packed = _mm512_loadu_si512((const void*)(block + g * 256 + j * 64));
                first[j] = _mm512_and_si512(packed, nibble);
                second[j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
            }
            __m512 scale = _mm512_loadu_ps(scales + ((size_t)b * groups + g) * 16);
            __m512 low = _mm512_loadu_ps(lows + ((size_t)b * groups + g) * 16);
            for (int q = 0; q < rows; q++) {
                const int32_t* h4 = (const int32_t*)(qx.parts + (size_t)q * 2 * k) + 8 * g;  /* 4 int8s a lane */
                const int32_t* l4 = (const int32_t*)(qx.parts + (size_t)q * 2 * k + k) + 8 * g;
                const float* step = qx.steps + (size_t)q * 3 * groups;
                __m512i dot_high = _mm512_setzero_si512(), dot_low = _mm512_setzero_si512();
                for (int j = 0; j < 4; j++) {
                    dot_high = _mm512_dpbusd_epi32(dot_high, first[j], _mm512_set1_epi32(h4[2 * j]));
                    dot_high = _mm512_dpbusd_epi32(dot_high, second[j], _mm512_set1_epi32(h4[2 * j + 1]));
                    dot_low = _mm512_dpbusd_epi32(dot_low, first[j], _mm512_set1_epi32(l4[2 * j]));
                    dot_low = _mm512_dpbusd_epi32(dot_low, second[j], _mm512_set1_epi32(l4[2 * j + 1]));
                }
                float* out = y + (size_t)q * n + 16 * b;
                __m512 acc = _mm512_loadu_ps(out);
                __m512 coarse = _mm512_mul_ps(scale, _mm512_set1_ps(step[2 * g]));
                __m512 fine = _mm512_mul_ps(scale, _mm512_set1_ps(step[2 * g + 1]));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_high), coarse, acc);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_low), fine, acc);
                acc = _mm512_fmadd_ps(low, _mm512_set1_ps(step[2 * groups + g]), acc);
                _mm512_storeu_ps(out, acc);
            }
        }
    }
    free(qx.parts);
    free(qx.steps);
    return 0;
}

/* The same with AVX2: each 64-byte sub-block as two halves of 8 rows. */
AVX2 int q4_matmul_avx2(const uint8_t* levels, const float* scales, const float* lows, const float* x, float* y,
                        int rows, int n, int k) {
    if (k % 32 || n % 16) return -1;
    if (rows < 1) return 0;
    int groups = k / 32;
    Quantized qx;
    if (quantize_rows(x, rows, k, &qx)) return -1;
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int b = 0; b < n / 16; b++) {
        const uint8_t* block = levels + (size_t)b * groups * 256;
        for (int q = 0; q < rows; q++) {
            _mm256_storeu_ps(y + (size_t)q * n + 16 * b, _mm256_setzero_ps());
            _mm256_storeu_ps(y + (size_t)q * n + 16 * b + 8, _mm256_setzero_ps());
        }
        for (int g = 0; g < groups; g++) {
            for (int half = 0; half < 2; half++) {
                __m256i first[4], second[4];
                for (int j = 0; j < 4; j++) {
                    __m256i packed = _mm256_loadu_si256((const __m256i*)(block + g * 256 + j * 64 + 32 * half));
                    first[j] = _mm256_and_si256(packed, nibble);
                    second[j] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
                }
                __m256 scale = _mm256_loadu_ps(scales + ((size_t)b * groups + g) * 16 + 8 * half);
                __m256 low = _mm256_loadu_ps(lows + ((size_t)b * groups + g) * 16 + 8 * half);
                for (int q = 0; q < rows; q++) {
                    const int32_t* h4 = (const int32_t*)(qx.parts + (size_t)q * 2 * k) + 8 * g;
                    const int32_t* l4 = (const int32_t*)(qx.parts + (size_t)q * 2 * k + k) + 8 * g;
                    const float* step = qx.steps + (size_t)q * 3 * groups;
                    __m256i dot_high = _mm256_setzero_si256(), dot_low = _mm256_setzero_si256();  /* int16 pairs */
                    for (int j = 0; j < 4; j++) {
                        __m256i high_first = _mm256_set1_epi32(h4[2 * j]);
                        __m256i high_second = _mm256_set1_epi32(h4[2 * j + 1]);
                        __m256i low_first = _mm256_set1_epi32(l4[2 * j]), low_second = _mm256_set1_epi32(l4[2 * j + 1]);
                        dot_high = _mm256_add_epi16(dot_high, _mm256_maddubs_epi16(first[j], high_first));
                        dot_high = _mm256_add_epi16(dot_high, _mm256_maddubs_epi16(second[j], high_second));
                        dot_low = _mm256_add_epi16(dot_low, _mm256_maddubs_epi16(first[j], low_first));
                        dot_low = _mm256_add_epi16(dot_low, _mm256_maddubs_epi16(second[j], low_second));
                    }
                    float* out = y + (size_t)q * n + 16 * b + 8 * half;
                    __m256 acc = _mm256_loadu_ps(out);
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot_high, ones)),
                                          _mm256_mul_ps(scale, _mm256_set1_ps(step[2 * g])), acc);
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot_low, ones)),
                                          _mm256_mul_ps(scale, _mm256_set1_ps(step[2 * g + 1])), acc);
                    acc = _mm256_fmadd_ps(low, _mm256_set1_ps(step[2 * groups + g]), acc);
                    _mm256_storeu_ps(out, acc);
                }
            }
        }
    }
    free(qx.parts);
    free(qx.steps);
    return 0;
}
