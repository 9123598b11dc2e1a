// 4-bit weights x 8-bit activations for the few rows of a decode step or a verify pass (x86 CPUs).
//
// The layout and the arithmetic are described in cpu_w4a8.py, which builds this file on first use
// and holds the plain torch reference. In short, for each tile of 16 output features and each
// group of 32 inputs the weights are one 320-byte block: 256 bytes of 4-bit codes arranged for
// the integer dot-product instruction, then 16 fp16 scales, then 16 fp16 mins. A pass streams the
// blocks once; all of its rows are multiplied while a tile's blocks are in cache.
//
// A row's result depends only on that row: its quantization, its integer sums and the order of
// its float operations are the same whatever other rows share the call and however the tiles are
// split between threads. That is what keeps a verify pass equal to one-token decoding.
//
// No torch headers: the threads come from OpenMP, which resolves to the libgomp that torch has
// already loaded (same soname), so torch and this kernel share one thread pool.

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t GROUP = 32;          // inputs per scale/min
constexpr int64_t TILE = 16;           // outputs per block
constexpr int64_t CODE_BYTES = 256;    // TILE * GROUP / 2
constexpr int64_t BLOCK_BYTES = 320;   // codes + 16 fp16 scales + 16 fp16 mins
// Blocks are asked for this many groups before they are read. The hardware prefetcher alone left
// the cores waiting: measured on the 2-core VM over the 1.5B model's 28 layers of linears, 12
// groups ahead took one row from 45.9 to 36.2 ms, 4 rows from 57 to 41 ms and 16 rows from 96 to
// 76 ms (8 to 24 groups all measured within 2 ms of each other; into L2 instead of L1 no better).
// A hint past the end of the weights is harmless: prefetches do not fault.
constexpr int64_t PREFETCH_GROUPS = 12;

inline void prefetch_block(const uint8_t* block) {
  for (int64_t line = 0; line < BLOCK_BYTES; line += 64) _mm_prefetch((const char*)block + line, _MM_HINT_T0);
}

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

// ---- activations: each row quantized on its own (absmax / 127), with its sums per group ---------

__attribute__((target("avx512f,avx512bw")))
void quantize_row_avx512(const float* x, int64_t k, int8_t* q, float* scale, float* group_sums) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  float m = _mm512_reduce_max_ps(amax);
  float s = (m > 1e-12f ? m : 1e-12f) / 127.0f;
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t g = 0; g < k / GROUP; ++g) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t j = 0; j < GROUP; j += 16) {
      __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + g * GROUP + j), sv);
      v = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
      __m512i iv = _mm512_cvtps_epi32(v);
      sum = _mm512_add_epi32(sum, iv);
      _mm_storeu_si128((__m128i*)(q + g * GROUP + j), _mm512_cvtsepi32_epi8(iv));
    }
    group_sums[g] = (float)_mm512_reduce_add_epi32(sum);
  }
}

__attribute__((target("avx2,fma")))
void quantize_row_avx2(const float* x, int64_t k, int8_t* q, float* scale, float* group_sums) {
  float m = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    float a = x[i] < 0 ? -x[i] : x[i];
    m = a > m ? a : m;
  }
  float s = (m > 1e-12f ? m : 1e-12f) / 127.0f;
  *scale = s;
  const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int64_t g = 0; g < k / GROUP; ++g) {
    int32_t total = 0;
    for (int64_t j = 0; j < GROUP; j += 8) {
      __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + g * GROUP + j), sv);
      v = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
      int32_t ints[8];
      _mm256_storeu_si256((__m256i*)ints, _mm256_cvtps_epi32(v));
      for (int t = 0; t < 8; ++t) {
        q[g * GROUP + j + t] = (int8_t)ints[t];
        total += ints[t];
      }
    }
    group_sums[g] = (float)total;
  }
}

// ---- one tile of 16 outputs for R rows --------------------------------------------------------

// out[r][n0 ..] = total[r] * row_scales[r] + bias for the tile's outputs that exist
__attribute__((target("avx512f"), always_inline))
inline void store_tile(const __m512* total, int rows, const float* row_scales, const float* bias, float* out, int64_t n,
                       int64_t n0) {
  const int64_t width = n - n0 < TILE ? n - n0 : TILE;
  const __mmask16 keep = (__mmask16)((1u << width) - 1u);
  const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r)
    _mm512_mask_storeu_ps(out + r * n + n0, keep, _mm512_add_ps(_mm512_mul_ps(total[r], _mm512_set1_ps(row_scales[r])), add));
}

// out[r][n] = row_scale[r] * sum_g (scale[n,g] * sum_k code[n,k] q[r,k] + min[n,g] * sum_k q[r,k]) + bias[n]
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
void tile_avx512(const uint8_t* blocks, int64_t groups, const int8_t* q, int64_t k, const float* group_sums,
                 const float* row_scales, const float* bias, float* out, int64_t n, int64_t n0) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = blocks + g * BLOCK_BYTES;
    prefetch_block(b + PREFETCH_GROUPS * BLOCK_BYTES);
    __m512i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      // lane n holds codes of inputs 4p..4p+3 (low nibbles) and 16+4p..16+4p+3 (high nibbles)
      __m512i v = _mm512_loadu_si512((const void*)(b + 64 * p));
      __m512i lo = _mm512_and_si512(v, low);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = q + r * k + g * GROUP;
        sums[r] = _mm512_dpbusd_epi32(sums[r], lo, _mm512_set1_epi32(four_bytes(a + 4 * p)));
        sums[r] = _mm512_dpbusd_epi32(sums[r], hi, _mm512_set1_epi32(four_bytes(a + 16 + 4 * p)));
      }
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + CODE_BYTES)));
    const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + CODE_BYTES + 32)));
    for (int r = 0; r < R; ++r) {
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), scale, total[r]);
      total[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(group_sums[r * groups + g]), total[r]);
    }
  }
  store_tile(total, R, row_scales, bias, out, n, n0);
}

// The same sums with AVX2: u8 x s8 pairs (maddubs; at most 2 * 15 * 127, no saturation), then
// pairs of pairs (madd with ones). The 16 outputs of a tile are two halves of 8.
template <int R>
__attribute__((target("avx2,fma,f16c")))
void tile_avx2(const uint8_t* blocks, int64_t groups, const int8_t* q, int64_t k, const float* group_sums,
               const float* row_scales, const float* bias, float* out, int64_t n, int64_t n0) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = blocks + g * BLOCK_BYTES;
    prefetch_block(b + PREFETCH_GROUPS * BLOCK_BYTES);
    for (int h = 0; h < 2; ++h) {
      __m256i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(b + 64 * p + 32 * h));
        __m256i lo = _mm256_and_si256(v, low);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = q + r * k + g * GROUP;
          __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_bytes(a + 4 * p))), ones);
          __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_bytes(a + 16 + 4 * p))), ones);
          sums[r] = _mm256_add_epi32(sums[r], _mm256_add_epi32(plo, phi));
        }
      }
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + CODE_BYTES + 16 * h)));
      const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + CODE_BYTES + 32 + 16 * h)));
      for (int r = 0; r < R; ++r) {
        total[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scale, total[r][h]);
        total[r][h] = _mm256_fmadd_ps(mins, _mm256_set1_ps(group_sums[r * groups + g]), total[r][h]);
      }
    }
  }
  const int64_t width = n - n0 < TILE ? n - n0 : TILE;
  for (int r = 0; r < R; ++r) {
    float y[TILE];
    _mm256_storeu_ps(y, _mm256_mul_ps(total[r][0], _mm256_set1_ps(row_scales[r])));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(total[r][1], _mm256_set1_ps(row_scales[r])));
    for (int64_t j = 0; j < width; ++j) out[r * n + n0 + j] = bias ? y[j] + bias[n0 + j] : y[j];
  }
}

// ---- AMX: the same sums for 16 rows at once, on the tile unit ----------------------------------
//
// For a group, the 16 rows' 32 activations (a 16 x 32-byte tile read in place from the quantized
// rows) times the tile's codes (unpacked to bytes: 8 x 64, the layout the dot product wants, which
// is how the blocks already order them) give all 16 x 16 integer sums in one TDPBSSD (codes 0..15
// are valid signed bytes). The sums are exact int32, as with VNNI, and the float steps after them
// are the VNNI tile's, in the same order: a row's result is bit-identical on either path. The
// tile unit works on group g while the vector units scale and add group g - LAG's sums (a ring of
// sums tiles and buffers), so a group costs one TDPBSSD plus its float epilogue instead of 128
// VPDPBUSDs.

constexpr int AMX_ROWS = 16;
constexpr int LAG = 3;           // groups in flight on the tile unit while the vector units finish older ones
constexpr int UNPACK_AHEAD = 7;  // (both + 1 are powers of two: they index rings)

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0-3: sums (16 rows x 16 int32), 4/5: activations (16 x 32 bytes), 6/7: codes (8 x 64 bytes).
// A global, not a local: GCC 12 does not see that ldtilecfg reads the local and drops its stores.
const TileConfig TILES = [] {
  TileConfig config = {};
  config.palette = 1;
  for (int t = 0; t < 4; ++t) config.rows[t] = AMX_ROWS, config.colsb[t] = 64;
  for (int t = 0; t < 2; ++t) {
    config.rows[4 + t] = AMX_ROWS, config.colsb[4 + t] = GROUP;
    config.rows[6 + t] = GROUP / 4, config.colsb[6 + t] = 64;
  }
  return config;
}();

__attribute__((target("amx-tile")))
void configure_tiles() { _tile_loadconfig(&TILES); }

__attribute__((target("amx-tile")))
void release_tiles() { _tile_release(); }

// The tile numbers must be literals (the intrinsics paste them into the instruction).
#define GROUP_SUMS_AMX(SUMS, ACTIVATIONS, CODES, activations, k, codes, sums) \
  do {                                                                      \
    _tile_loadd(ACTIVATIONS, activations, k);                               \
    _tile_loadd(CODES, codes, 64);                                          \
    _tile_zero(SUMS);                                                       \
    _tile_dpbssd(SUMS, ACTIVATIONS, CODES);                                 \
    _tile_stored(SUMS, sums, 64);                                           \
  } while (0)

// A block's codes as bytes, 8 rows of 64: row p holds inputs 4p..4p+3 (the low nibbles of vector
// p), row 4 + p inputs 16 + 4p.. (its high nibbles). This runs a few groups before the tile load
// that reads it: a tile load waits for the stores it overlaps to reach the cache, which measured
// as long as the rest of a group's work.
__attribute__((target("avx512f,avx512bw"), always_inline))
inline void unpack(const uint8_t* block, int8_t* codes) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int p = 0; p < 4; ++p) {
    __m512i v = _mm512_loadu_si512((const void*)(block + 64 * p));
    _mm512_store_si512((void*)(codes + 64 * p), _mm512_and_si512(v, low));
    _mm512_store_si512((void*)(codes + 64 * (4 + p)), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
}

// total[r] += scale * sums[r] + min * (row r's sum of the group's activations), as in tile_avx512
__attribute__((target("avx512f,f16c,fma"), always_inline))
inline void add_group(__m512* total, const uint8_t* block, const int32_t* sums, const float* group_sums, int64_t groups) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + CODE_BYTES)));
  const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + CODE_BYTES + 32)));
  for (int r = 0; r < AMX_ROWS; ++r) {
    total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void*)(sums + r * TILE))), scale, total[r]);
    total[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(group_sums[r * groups]), total[r]);
  }
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c,fma")))
void tile_amx(const uint8_t* blocks, int64_t groups, const int8_t* q, int64_t k, const float* group_sums,
              const float* row_scales, const float* bias, float* out, int64_t n, int64_t n0) {
  alignas(64) int8_t codes[UNPACK_AHEAD + 1][8 * 64];
  alignas(64) int32_t sums[LAG + 1][AMX_ROWS * TILE];
  __m512 total[AMX_ROWS];
  for (int r = 0; r < AMX_ROWS; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < UNPACK_AHEAD && g < groups; ++g) unpack(blocks + g * BLOCK_BYTES, codes[g]);
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_block(blocks + (g + PREFETCH_GROUPS) * BLOCK_BYTES);
    if (g + UNPACK_AHEAD < groups) unpack(blocks + (g + UNPACK_AHEAD) * BLOCK_BYTES, codes[(g + UNPACK_AHEAD) & UNPACK_AHEAD]);
    const int8_t* c = codes[g & UNPACK_AHEAD];
    int32_t* s = sums[g & LAG];
    switch (g & LAG) {
      case 0: GROUP_SUMS_AMX(0, 4, 6, q + g * GROUP, k, c, s); break;
      case 1: GROUP_SUMS_AMX(1, 5, 7, q + g * GROUP, k, c, s); break;
      case 2: GROUP_SUMS_AMX(2, 4, 6, q + g * GROUP, k, c, s); break;
      default: GROUP_SUMS_AMX(3, 5, 7, q + g * GROUP, k, c, s); break;
    }
    if (g >= LAG) add_group(total, blocks + (g - LAG) * BLOCK_BYTES, sums[(g - LAG) & LAG], group_sums + g - LAG, groups);
  }
  for (int64_t g = groups > LAG ? groups - LAG : 0; g < groups; ++g)
    add_group(total, blocks + g * BLOCK_BYTES, sums[g & LAG], group_sums + g, groups);
  store_tile(total, AMX_ROWS, row_scales, bias, out, n, n0);
}

bool amx_usable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
  // Linux hands out the tile state only to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

// ---- prompts: bf16 on the tile unit ------------------------------------------------------------
//
// A prompt's pass has hundreds of rows, so each weight is used hundreds of times: a tile's blocks
// are de-quantized once to bf16 (code * scale + min in float, rounded to nearest even) in the
// layout TDPBF16PS reads, and every 16 rows of the prompt, rounded to bf16, multiply them with the
// sums kept in float32 inside the tile unit across all groups: no per-group epilogue, no int8
// rounding of the activations. These are different numbers from the decode path's, which is why
// only a prompt pass takes them (cpu_w4a8.prompt_pass); a row's result still depends only on that
// row.

const TileConfig PROMPT_TILES = [] {
  TileConfig config = {};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;  // see prompt_tiles
  return config;
}();

__attribute__((target("amx-tile")))
void configure_prompt_tiles() { _tile_loadconfig(&PROMPT_TILES); }

// x (m, k) float32 -> a: bf16 in the order the tile loads read it, for each set of 16 rows and
// each group the set's 16 x 32 values (1 KB, contiguous, so a load streams it); padding rows zero
__attribute__((target("avx512f,avx512bf16")))
void rows_to_bf16(const float* x, int64_t m, int64_t k, uint16_t* a) {
  const int64_t groups = k / GROUP;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < (m + 15) / 16 * 16; ++r) {
    uint16_t* row = a + (r / 16) * groups * 512 + (r % 16) * 32;
    for (int64_t g = 0; g < groups; ++g) {
      __m512i v = _mm512_setzero_si512();
      if (r < m) v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * k + g * GROUP + 16), _mm512_loadu_ps(x + r * k + g * GROUP));
      _mm512_storeu_si512((void*)(row + g * 512), v);
    }
  }
}

// One tile's blocks -> per group 16 rows of 64 bytes: row j holds, for each of the 16 outputs n,
// the bf16 weights of inputs 2j and 2j + 1 (TDPBF16PS's pairs). In the codes, the 32-bit lane n of
// vector p holds inputs 4p..4p+3 (low nibbles) and 16 + 4p.. (high nibbles): its low 16 bits are
// the pair of row 2p, its high 16 bits the pair of row 2p + 1 (8 + 2p, 9 + 2p for the high nibbles).
__attribute__((target("avx512f,avx512bw,avx512bf16,f16c")))
void dequantize_tile(const uint8_t* blocks, int64_t groups, uint16_t* w) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i first_outputs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i last_outputs = _mm512_add_epi32(first_outputs, _mm512_set1_epi32(8));
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = blocks + g * BLOCK_BYTES;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + CODE_BYTES)));
    const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + CODE_BYTES + 32)));
    const __m512 scale_first = _mm512_permutexvar_ps(first_outputs, scale), scale_last = _mm512_permutexvar_ps(last_outputs, scale);
    const __m512 min_first = _mm512_permutexvar_ps(first_outputs, mins), min_last = _mm512_permutexvar_ps(last_outputs, mins);
    uint16_t* out = w + g * 16 * 32;
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512((const void*)(b + 64 * p));
      const __m512i nibbles[2] = {_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
      for (int h = 0; h < 2; ++h)
        for (int half = 0; half < 2; ++half) {
          const __m256i pairs = _mm512_cvtepi32_epi16(half ? _mm512_srli_epi32(nibbles[h], 16) : nibbles[h]);  // 16 x (2 codes)
          __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(pairs)));  // outputs 0..7
          __m512 last = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(pairs, 1)));  // 8..15
          first = _mm512_fmadd_ps(first, scale_first, min_first);
          last = _mm512_fmadd_ps(last, scale_last, min_last);
          const int row = 8 * h + 2 * p + half;
          _mm512_storeu_si512((void*)(out + row * 32), (__m512i)_mm512_cvtne2ps_pbh(last, first));
        }
    }
  }
}

// Two sets of 16 rows times two tiles of 16 outputs: four sums tiles (0-3) kept in the tile unit
// across all groups, two row tiles (4, 5) and two weight tiles (6, 7). Each loaded tile serves two
// products: the loads, not the products, are what a prompt's pass waits for.
__attribute__((target("amx-tile,amx-bf16,avx512f")))
void prompt_tiles(const uint16_t* a, int64_t m, int64_t groups, const uint16_t* w0, const uint16_t* w1,
                  const float* bias, float* out, int64_t n, int64_t n0) {
  alignas(64) float sums[4][256];
  const int64_t padded = (m + 15) / 16 * 16;
  for (int64_t r0 = 0; r0 < padded; r0 += 32) {
    const bool two_sets = r0 + 16 < padded, two_tiles = w1 != nullptr;
    const uint16_t* rows0 = a + (r0 / 16) * groups * 512;
    const uint16_t* rows1 = rows0 + groups * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t g = 0; g < groups; ++g) {
      _tile_loadd(6, w0 + g * 512, 64);
      _tile_loadd(4, rows0 + g * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (two_tiles) {
        _tile_loadd(7, w1 + g * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (two_sets) {
        _tile_loadd(5, rows1 + g * 512, 64);
        _tile_dpbf16ps(2, 5, 6);
        if (two_tiles) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, sums[0], 64);
    if (two_tiles) _tile_stored(1, sums[1], 64);
    if (two_sets) _tile_stored(2, sums[2], 64);
    if (two_sets && two_tiles) _tile_stored(3, sums[3], 64);
    for (int tile = 0; tile < (two_tiles ? 2 : 1); ++tile) {
      const int64_t start = n0 + TILE * tile, width = n - start < TILE ? n - start : TILE;
      const __mmask16 keep = (__mmask16)((1u << width) - 1u);
      const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + start) : _mm512_setzero_ps();
      for (int64_t r = 0; r < (two_sets ? 32 : 16) && r0 + r < m; ++r)
        _mm512_mask_storeu_ps(out + (r0 + r) * n + start, keep, _mm512_add_ps(_mm512_load_ps(sums[2 * (r / 16) + tile] + (r % 16) * 16), add));
    }
  }
}

// ---- the gated MLP's SiLU(gate) * up, read straight from the fused gate/up output --------------

// e^x for float32: 2^n e^r with n = round(x / ln 2) and |r| <= ln 2 / 2 (ln 2 in two parts),
// e^r by its Taylor polynomial to r^7 (relative error about 1e-7, as float32 itself)
__attribute__((target("avx512f"), always_inline))
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  static const float taylor[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (float c : taylor) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

typedef void (*TileFn)(const uint8_t*, int64_t, const int8_t*, int64_t, const float*, const float*, const float*,
                       float*, int64_t, int64_t);

// Rows go in chunks of up to 8 (AVX-512: 2 x 8 accumulators fit in 32 registers) or 2 (AVX2).
TileFn tile_fn(int isa, int rows) {
  static const TileFn avx512[] = {tile_avx512<1>, tile_avx512<2>, tile_avx512<3>, tile_avx512<4>,
                                  tile_avx512<5>, tile_avx512<6>, tile_avx512<7>, tile_avx512<8>};
  static const TileFn avx2[] = {tile_avx2<1>, tile_avx2<2>};
  return isa >= 2 ? avx512[rows - 1] : avx2[rows - 1];
}

}  // namespace

extern "C" {

// 3: AMX with AVX-512 VNNI, 2: AVX-512 VNNI, 1: AVX2, 0: none (the caller falls back to other formats).
int w4a8_isa(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
    return amx_usable() ? 3 : 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 1;
  return 0;
}

// x (m, k) float32 -> out (m, n) float32. scratch: m * k bytes of int8 codes, then m * (k / 32 + 1)
// floats (group sums, row scales). k is a multiple of 32; blocks as built by cpu_w4a8.pack.
void w4a8_linear(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, const float* bias,
                 float* out, void* scratch, int isa) {
  const int64_t groups = k / GROUP;
  int8_t* q = (int8_t*)scratch;
  float* group_sums = (float*)((char*)scratch + ((m * k + 63) / 64) * 64);
  float* row_scales = group_sums + m * groups;
#pragma omp parallel for schedule(static) if (m * k >= (1 << 16))
  for (int64_t r = 0; r < m; ++r) {
    if (isa >= 2) quantize_row_avx512(x + r * k, k, q + r * k, row_scales + r, group_sums + r * groups);
    else quantize_row_avx2(x + r * k, k, q + r * k, row_scales + r, group_sums + r * groups);
  }
  const int64_t tiles = (n + TILE - 1) / TILE;
  const int chunk = isa >= 2 ? 8 : 2;
  // rows in whole sets of 16 go to the tile unit, the rest to the vector units (the same numbers)
  const int64_t amx_rows = isa == 3 ? m / AMX_ROWS * AMX_ROWS : 0;
#pragma omp parallel if (tiles > 1)
  {
    if (amx_rows) configure_tiles();
    // dynamic: a thread the OS preempts (2 cores, other processes) does not hold half the work
#pragma omp for schedule(dynamic, 4)
    for (int64_t t = 0; t < tiles; ++t) {
      const uint8_t* tile_blocks = blocks + t * groups * BLOCK_BYTES;
      for (int64_t r0 = 0; r0 < amx_rows; r0 += AMX_ROWS)
        tile_amx(tile_blocks, groups, q + r0 * k, k, group_sums + r0 * groups, row_scales + r0, bias, out + r0 * n, n,
                 t * TILE);
      for (int64_t r0 = amx_rows; r0 < m; r0 += chunk) {
        const int rows = (int)(m - r0 < chunk ? m - r0 : chunk);
        tile_fn(isa, rows)(tile_blocks, groups, q + r0 * k, k, group_sums + r0 * groups, row_scales + r0, bias,
                           out + r0 * n, n, t * TILE);
      }
    }
    if (amx_rows) release_tiles();
  }
}

// Whether this CPU runs w4a8_prompt (AMX-BF16).
int w4a8_prompt_usable(void) {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && __builtin_cpu_supports("avx512bf16") &&
         amx_usable();
}

// A prompt's pass: x (m, k) float32 -> out (m, n) float32 through bf16 tiles. scratch: at least
// w4a8_prompt_scratch(m, k) bytes.
int64_t w4a8_prompt_scratch(int64_t m, int64_t k) { return (m + 15) / 16 * 16 * k * 2; }

void w4a8_prompt(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, const float* bias, float* out,
                 void* scratch) {
  const int64_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
  uint16_t* a = (uint16_t*)scratch;
  rows_to_bf16(x, m, k, a);
#pragma omp parallel
  {
    configure_prompt_tiles();
    uint16_t* w = (uint16_t*)aligned_alloc(64, 2 * groups * 512 * sizeof(uint16_t));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tiles; t += 2) {
      uint16_t* w1 = t + 1 < tiles ? w + groups * 512 : nullptr;
      dequantize_tile(blocks + t * groups * BLOCK_BYTES, groups, w);
      if (w1) dequantize_tile(blocks + (t + 1) * groups * BLOCK_BYTES, groups, w1);
      prompt_tiles(a, m, groups, w, w1, bias, out, n, t * TILE);
    }
    free(w);
    release_tiles();
  }
}

// out (m, width) = silu(gate) * up for gate and up (m, width) with rows the given floats apart (AVX-512F).
__attribute__((target("avx512f")))
void w4a8_silu_mul(const float* gate, const float* up, int64_t m, int64_t width, int64_t gate_stride, int64_t up_stride,
                   float* out) {
#pragma omp parallel for schedule(static) if (m * width >= (1 << 16))
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 keep = width - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (width - j)) - 1u);
      const __m512 g = _mm512_maskz_loadu_ps(keep, gate + r * gate_stride + j);
      const __m512 u = _mm512_maskz_loadu_ps(keep, up + r * up_stride + j);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_mask_storeu_ps(out + r * width + j, keep, _mm512_mul_ps(silu, u));
    }
}

}  // extern "C"
