// Row-exact attention for the few query rows of a decode step or a verify pass (x86: AVX-512F, or
// AVX2 with FMA).
//
// The meaning, its torch reference and the reasons are in cpu_attention.py. Each query row sees
// the cached slots [0, prefix) plus a list of extra slots (a tree node's ancestors and itself),
// and is computed by one thread with the same sequence of operations whatever the other rows of
// the call are: a verify pass gives, row for row, the bits one-token decoding gives.
// No torch headers: OpenMP resolves to the libgomp torch has already loaded.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

namespace {

// exp(x) = 2^n e^r, n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts, so r is exact enough),
// e^r = 1 + r + r^2 (P0 r^5 + ... + P5), Cephes' expf polynomial; both instruction sets use these.
constexpr float EXP_LOWEST = -87.0f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                            1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for x <= 0 (scores minus their maximum) on 16 lanes, 2^n by scalef.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LOWEST));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_P[0]);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[1]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[2]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[3]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[4]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[5]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u); }

// One query row and head: out (d) = softmax(q . k_j * scale) weighted sum of v_j over the visible slots.
__attribute__((target("avx512f,fma")))
void attend_avx512(const float* q, int64_t d, const float* k, const float* v, int64_t prefix, const int64_t* extra,
            int64_t extras, float scale, float* scores, float* out) {
  const int64_t n = prefix + extras;
  auto slot = [&](int64_t j) { return j < prefix ? j : extra[j - prefix]; };
  // scores, four keys at a time (independent sums keep the FMA units busy)
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* k0 = k + slot(j) * d;
    const float* k1 = k + slot(j + 1) * d;
    const float* k2 = k + slot(j + 2) * d;
    const float* k3 = k + slot(j + 3) * d;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t c = 0; c < d; c += 16) {
      const __mmask16 m = tail_mask(d - c);
      const __m512 qc = _mm512_maskz_loadu_ps(m, q + c);
      a0 = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(m, k0 + c), a0);
      a1 = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(m, k1 + c), a1);
      a2 = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(m, k2 + c), a2);
      a3 = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(m, k3 + c), a3);
    }
    scores[j] = _mm512_reduce_add_ps(a0) * scale;
    scores[j + 1] = _mm512_reduce_add_ps(a1) * scale;
    scores[j + 2] = _mm512_reduce_add_ps(a2) * scale;
    scores[j + 3] = _mm512_reduce_add_ps(a3) * scale;
  }
  for (; j < n; ++j) {
    const float* kj = k + slot(j) * d;
    __m512 a = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      const __mmask16 m = tail_mask(d - c);
      a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + c), _mm512_maskz_loadu_ps(m, kj + c), a);
    }
    scores[j] = _mm512_reduce_add_ps(a) * scale;
  }
  // softmax weights, unnormalized: exp(s - max)
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (j = 0; j < n; j += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n - j), scores + j));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 total = _mm512_setzero_ps();
  for (j = 0; j < n; j += 16) {
    const __mmask16 m = tail_mask(n - j);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + j), top)));
    _mm512_mask_storeu_ps(scores + j, m, e);
    total = _mm512_add_ps(total, e);
  }
  const float inv = 1.0f / _mm512_reduce_add_ps(total);
  // out = sum_j e_j v_j / sum_j e_j: keys outer, up to 256 features in independent sums
  constexpr int64_t WIDE = 256;
  for (int64_t c0 = 0; c0 < d; c0 += WIDE) {
    const int64_t chunks = ((d - c0 < WIDE ? d - c0 : WIDE) + 15) / 16;
    __m512 acc[WIDE / 16];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
    for (j = 0; j < n; ++j) {
      const __m512 w = _mm512_set1_ps(scores[j]);
      const float* vj = v + slot(j) * d + c0;
      for (int64_t c = 0; c < chunks; ++c)
        acc[c] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(tail_mask(d - c0 - 16 * c), vj + 16 * c), acc[c]);
    }
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_mask_storeu_ps(out + c0 + 16 * c, tail_mask(d - c0 - 16 * c), _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
  }
}

// exp(x) for x <= 0 on 8 lanes: the same polynomial, 2^n built in the exponent bits (n >= -126 here).
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LOWEST));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_P[0]);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[1]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[2]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[3]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[4]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[5]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

__attribute__((target("avx2"))) inline float sum8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// lanes i < left all ones, the others zero
__attribute__((target("avx2"))) inline __m256 lanes_below(int64_t left) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)), index));
}

// q . k over d features: 8 lanes, then the features past the last multiple of 8 one by one
__attribute__((target("avx2,fma"))) inline float dot_avx2(const float* q, const float* k, int64_t d) {
  const int64_t whole = d / 8 * 8;
  __m256 a = _mm256_setzero_ps();
  for (int64_t c = 0; c < whole; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), a);
  float total = sum8(a);
  for (int64_t c = whole; c < d; ++c) total += q[c] * k[c];
  return total;
}

// attend_avx512 on 8 lanes: features past the last multiple of 8 are summed one by one after the
// vector part, in the same order for every row.
__attribute__((target("avx2,fma")))
void attend_avx2(const float* q, int64_t d, const float* k, const float* v, int64_t prefix, const int64_t* extra,
                 int64_t extras, float scale, float* scores, float* out) {
  const int64_t n = prefix + extras, whole = d / 8 * 8;
  auto slot = [&](int64_t j) { return j < prefix ? j : extra[j - prefix]; };
  for (int64_t j = 0; j < n; ++j) scores[j] = dot_avx2(q, k + slot(j) * d, d) * scale;
  float top = -INFINITY;
  for (int64_t j = 0; j < n; ++j) top = scores[j] > top ? scores[j] : top;
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {  // scores has room for 16 past n: the last vector reads past it, then masks
    const __m256 keep = lanes_below(n - j);
    const __m256 e = _mm256_and_ps(keep, exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(top))));
    _mm256_storeu_ps(scores + j, e);
    total = _mm256_add_ps(total, e);
  }
  const float inv = 1.0f / sum8(total);
  constexpr int64_t WIDE = 128;
  for (int64_t c0 = 0; c0 < whole; c0 += WIDE) {
    const int64_t chunks = ((whole - c0 < WIDE ? whole - c0 : WIDE)) / 8;
    __m256 acc[WIDE / 8];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(scores[j]);
      const float* vj = v + slot(j) * d + c0;
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8 * c), acc[c]);
    }
    for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(out + c0 + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
  }
  for (int64_t c = whole; c < d; ++c) {
    float acc = 0.0f;
    for (int64_t j = 0; j < n; ++j) acc += scores[j] * v[slot(j) * d + c];
    out[c] = acc * inv;
  }
}

typedef void (*AttendFn)(const float*, int64_t, const float*, const float*, int64_t, const int64_t*, int64_t, float,
                         float*, float*);

}  // namespace

extern "C" {

// 2: AVX-512F, 1: AVX2 with FMA, 0: neither (the torch loop computes the rows).
int attention_supported(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("fma")) return 0;
  return __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
}

// q: row i, head h at q + i * q_row + h * q_head (d contiguous floats). k/v: kv head g, slot j at
// k + g * k_head + j * d. Row i sees slots [0, prefix[i]) and extra[offset[i] .. offset[i] + count[i]).
// out: (t, h, d) contiguous. Query head h reads kv head h / (heads / kv_heads).
void row_attention(const float* q, int64_t t, int64_t heads, int64_t d, int64_t q_row, int64_t q_head,
                   const float* k, const float* v, int64_t kv_heads, int64_t k_head, int64_t v_head,
                   const int64_t* prefix, const int64_t* extra, const int64_t* offset, const int64_t* count,
                   int64_t most_visible, float scale, float* out) {
  const int64_t group = heads / kv_heads;
  static const AttendFn attend = attention_supported() == 2 ? attend_avx512 : attend_avx2;  // asked once per process
#pragma omp parallel if (t * kv_heads > 1)
  {
    std::vector<float> scores(most_visible + 16);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < t * kv_heads; ++task) {
      const int64_t i = task / kv_heads, g = task % kv_heads;
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        attend(q + i * q_row + h * q_head, d, k + g * k_head, v + g * v_head, prefix[i], extra + offset[i], count[i],
               scale, scores.data(), out + (i * heads + h) * d);
    }
  }
}

}  // extern "C"
