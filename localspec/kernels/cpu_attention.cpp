// Row-exact attention for the few query rows of a decode step or a verify pass (x86, AVX-512F).
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

// exp(x) for x <= 0 (scores minus their maximum): Cephes' expf polynomial, 2^n by scalef.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u); }

// One query row and head: out (d) = softmax(q . k_j * scale) weighted sum of v_j over the visible slots.
__attribute__((target("avx512f,fma")))
void attend(const float* q, int64_t d, const float* k, const float* v, int64_t prefix, const int64_t* extra,
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

}  // namespace

extern "C" {

int attention_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
}

// q: row i, head h at q + i * q_row + h * q_head (d contiguous floats). k/v: kv head g, slot j at
// k + g * k_head + j * d. Row i sees slots [0, prefix[i]) and extra[offset[i] .. offset[i] + count[i]).
// out: (t, h, d) contiguous. Query head h reads kv head h / (heads / kv_heads).
void row_attention(const float* q, int64_t t, int64_t heads, int64_t d, int64_t q_row, int64_t q_head,
                   const float* k, const float* v, int64_t kv_heads, int64_t k_head, int64_t v_head,
                   const int64_t* prefix, const int64_t* extra, const int64_t* offset, const int64_t* count,
                   int64_t most_visible, float scale, float* out) {
  const int64_t group = heads / kv_heads;
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
