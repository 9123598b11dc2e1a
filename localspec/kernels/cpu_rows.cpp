// Row-wise float work of a short pass on a CPU: RMSNorm and rotary position embedding.
//
// The meaning, its torch references and the reasons are in cpu_rows.py. Plain C++ (no intrinsics,
// no OpenMP: a row of a few thousand floats is a microsecond; the call is what costs). Built with
// -ffp-contract=off, so a product and a sum round as torch's separate mul and add do: the rotary
// here gives the bits transformers' apply_rotary_pos_emb gives.

#include <math.h>
#include <stdint.h>

extern "C" {

// out[r] = w * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)) for `rows` rows of `dim` floats (contiguous).
// The sum of squares runs in order, so a row's result does not depend on the other rows.
void rows_rms_norm(const float* x, int64_t rows, int64_t dim, const float* w, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * dim;
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum += row[i] * row[i];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    float* o = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = w[i] * (row[i] * inv);
  }
}

// In place, for `heads` heads of each of `t` rows: x = x * cos + rotate_half(x) * sin, where
// rotate_half(x) = (-x[half:], x[:half]). Head h of row i starts at x + i * row_stride + h * d;
// cos and sin are (t, d), contiguous.
void rows_rotary(float* x, int64_t t, int64_t heads, int64_t d, int64_t row_stride, const float* cos,
                 const float* sin) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < t; ++i) {
    const float* c = cos + i * d;
    const float* s = sin + i * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + i * row_stride + h * d;
      for (int64_t j = 0; j < half; ++j) {
        const float a = v[j], b = v[j + half];
        v[j] = a * c[j] + (-b) * s[j];
        v[j + half] = b * c[j + half] + a * s[j + half];
      }
    }
  }
}

}  // extern "C"
