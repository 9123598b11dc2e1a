// 4-, 6- or 8-bit weights x 8-bit activations for the few rows of a decode step or a verify pass
// (x86 CPUs).
//
// The layout and the arithmetic are described in cpu_w4a8.py, which builds this file on first use
// and holds the plain torch reference. In short, for each tile of 16 output features the weights
// are a run of blocks, one per group of 32 inputs (4-bit codes) or of 16 inputs (6- and 8-bit
// codes): 256 bytes of codes (192 for 6-bit ones) arranged for the integer dot-product instruction,
// then 16 fp16 scales, then 16 fp16 mins. Each row's activations are quantized with one scale per 32 inputs.
// A pass streams the blocks once; all of its rows are multiplied while a tile's blocks are in cache.
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

constexpr int64_t GROUP = 32;          // inputs per activation scale, and per block of 4-bit codes
constexpr int64_t BYTE_GROUP = 16;     // inputs per block of 6- and 8-bit codes
constexpr int64_t TILE = 16;           // outputs per block
constexpr int AVX2_ROWS = 4;           // rows an AVX2 tile call takes at most

// inputs one block covers in the format of `bits`-bit codes
constexpr int64_t block_inputs(int bits) { return bits == 4 ? GROUP : BYTE_GROUP; }
// bytes of codes in a block: TILE * GROUP / 2 = TILE * BYTE_GROUP = 256, or 6/8 of that
constexpr int64_t code_bytes(int bits) { return bits == 6 ? 192 : 256; }
// a whole block: codes, then 16 fp16 scales and 16 fp16 mins
constexpr int64_t block_bytes(int bits) { return code_bytes(bits) + 64; }
// the tile unit's paths take the 4- and 8-bit formats only, whose blocks are the same size
static_assert(code_bytes(4) == code_bytes(8), "the tile paths read both formats with one stride");
constexpr int64_t CODE_BYTES = code_bytes(8);
constexpr int64_t BLOCK_BYTES = block_bytes(8);
// Blocks are asked for this many groups before they are read. The hardware prefetcher alone left
// the cores waiting: measured on the 2-core VM over the 1.5B model's 28 layers of linears, 12
// groups ahead took one row from 45.9 to 36.2 ms, 4 rows from 57 to 41 ms and 16 rows from 96 to
// 76 ms (8 to 24 groups all measured within 2 ms of each other; into L2 instead of L1 no better).
// A hint past the end of the weights is harmless: prefetches do not fault.
constexpr int64_t PREFETCH_GROUPS = 12;

inline void prefetch_block(const uint8_t* block, int bits) {
  for (int64_t line = 0; line < block_bytes(bits); line += 64) _mm_prefetch((const char*)block + line, _MM_HINT_T0);
}

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

// ---- activations: each group of 32 inputs of a row quantized on its own (absmax / 127) ----------
//
// steps: for each block of the row (32 inputs for 4-bit codes, 16 for 8-bit ones) the pair
// (s, s * the sum of the block's quantized activations), s the scale of the group of 32 holding it.
// The tiles fold s into their two multiply-adds per block; the pairs of a row lie together.

inline float activation_scale(float absmax) { return (absmax > 1e-12f ? absmax : 1e-12f) / 127.0f; }

// (s, sums of the group's two halves of 16) -> the group's one or two (s, s * sum) pairs
inline void store_steps(float s, int32_t first, int32_t second, int bits, float* steps) {
  if (bits == 4) {
    steps[0] = s, steps[1] = s * (float)(first + second);
  } else {
    steps[0] = s, steps[1] = s * (float)first;
    steps[2] = s, steps[3] = s * (float)second;
  }
}

__attribute__((target("avx512f,avx512bw")))
void quantize_row_avx512(const float* x, int64_t k, int bits, int8_t* q, float* steps) {
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const int64_t pair_floats = 2 * GROUP / block_inputs(bits);
  for (int64_t g = 0; g < k / GROUP; ++g) {
    const __m512 halves[2] = {_mm512_loadu_ps(x + g * GROUP), _mm512_loadu_ps(x + g * GROUP + 16)};
    const float s = activation_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(halves[0]), _mm512_abs_ps(halves[1]))));
    const __m512 sv = _mm512_set1_ps(s);
    int32_t sums[2];
    for (int h = 0; h < 2; ++h) {
      __m512 v = _mm512_div_ps(halves[h], sv);
      v = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
      const __m512i iv = _mm512_cvtps_epi32(v);
      sums[h] = _mm512_reduce_add_epi32(iv);
      _mm_storeu_si128((__m128i*)(q + g * GROUP + 16 * h), _mm512_cvtsepi32_epi8(iv));
    }
    store_steps(s, sums[0], sums[1], bits, steps + g * pair_floats);
  }
}

__attribute__((target("avx2,fma")))
void quantize_row_avx2(const float* x, int64_t k, int bits, int8_t* q, float* steps) {
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const int64_t pair_floats = 2 * GROUP / block_inputs(bits);
  for (int64_t g = 0; g < k / GROUP; ++g) {
    const float* group = x + g * GROUP;
    float m = 0.0f;
    for (int64_t i = 0; i < GROUP; ++i) {
      const float a = group[i] < 0 ? -group[i] : group[i];
      m = a > m ? a : m;
    }
    const float s = activation_scale(m);
    const __m256 sv = _mm256_set1_ps(s);
    int32_t sums[2] = {0, 0};
    for (int64_t j = 0; j < GROUP; j += 8) {
      __m256 v = _mm256_div_ps(_mm256_loadu_ps(group + j), sv);
      v = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
      int32_t ints[8];
      _mm256_storeu_si256((__m256i*)ints, _mm256_cvtps_epi32(v));
      for (int t = 0; t < 8; ++t) {
        q[g * GROUP + j + t] = (int8_t)ints[t];
        sums[j / 16] += ints[t];
      }
    }
    store_steps(s, sums[0], sums[1], bits, steps + g * pair_floats);
  }
}

// ---- one tile of 16 outputs for R rows --------------------------------------------------------
//
// A tile's `count` blocks (K / 32 of 4-bit codes or K / 16 of 8-bit ones) are read in order; block
// j's integer sums for a row are scaled and added by add_block, the one float step order of every
// path. `steps` are the quantizer's pairs, 2 * count floats per row.

// out[r][n0 ..] = total[r] + bias for the tile's outputs that exist
__attribute__((target("avx512f"), always_inline))
inline void store_tile(const __m512* total, int rows, const float* bias, float* out, int64_t n, int64_t n0) {
  const int64_t width = n - n0 < TILE ? n - n0 : TILE;
  const __mmask16 keep = (__mmask16)((1u << width) - 1u);
  const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(out + r * n + n0, keep, _mm512_add_ps(total[r], add));
}

// total += (scale * s) * sums + min * (s * sum of the activations), step = the row's (s, s * sum)
__attribute__((target("avx512f,fma"), always_inline))
inline __m512 add_block(__m512 total, __m512i sums, __m512 scale, __m512 mins, const float* step) {
  total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, _mm512_set1_ps(step[0])), total);
  return _mm512_fmadd_ps(mins, _mm512_set1_ps(step[1]), total);
}

// out[r][n] = sum_j (scale[n,j] s[r,j] * sum_k code[n,k] q[r,k] + min[n,j] * s[r,j] sum_k q[r,k]) + bias[n]
// 6-bit codes: vector p of byte codes (lane n: inputs 4p..4p+3) from the block's two nibble vectors
// (vector p % 2: its low nibbles for p < 2, its high ones for p >= 2) and the vector of high bit
// pairs (bits 2p, 2p + 1 of each byte).
__attribute__((target("avx512f,avx512bw"), always_inline))
inline __m512i six_bit_codes(const uint8_t* b, int p) {
  const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
  const __m512i nibbles = _mm512_loadu_si512((const void*)(b + 64 * (p & 1)));
  const __m512i lo = _mm512_and_si512(p < 2 ? nibbles : _mm512_srli_epi16(nibbles, 4), low);
  const __m512i pairs = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void*)(b + 128)), 2 * p), two);
  return _mm512_or_si512(lo, _mm512_slli_epi16(pairs, 4));
}

// The same for 8 outputs (half h of the tile), on AVX2.
__attribute__((target("avx2"), always_inline))
inline __m256i six_bit_codes_avx2(const uint8_t* b, int p, int h) {
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
  const __m256i nibbles = _mm256_loadu_si256((const __m256i*)(b + 64 * (p & 1) + 32 * h));
  const __m256i lo = _mm256_and_si256(p < 2 ? nibbles : _mm256_srli_epi16(nibbles, 4), low);
  const __m256i pairs = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)), 2 * p), two);
  return _mm256_or_si256(lo, _mm256_slli_epi16(pairs, 4));
}

template <int R, int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
void tile_avx512(const uint8_t* blocks, int64_t count, const int8_t* q, int64_t k, const float* steps,
                 const float* bias, float* out, int64_t n, int64_t n0) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    const uint8_t* b = blocks + j * block_bytes(BITS);
    prefetch_block(b + PREFETCH_GROUPS * block_bytes(BITS), BITS);
    __m512i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      const __m512i v = BITS == 6 ? six_bit_codes(b, p) : _mm512_loadu_si512((const void*)(b + 64 * p));
      if constexpr (BITS == 4) {
        // lane n holds codes of inputs 4p..4p+3 (low nibbles) and 16+4p..16+4p+3 (high nibbles)
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = q + r * k + j * GROUP;
          sums[r] = _mm512_dpbusd_epi32(sums[r], lo, _mm512_set1_epi32(four_bytes(a + 4 * p)));
          sums[r] = _mm512_dpbusd_epi32(sums[r], hi, _mm512_set1_epi32(four_bytes(a + 16 + 4 * p)));
        }
      } else {
        // lane n holds the byte codes of inputs 4p..4p+3 (6-bit ones unpacked to bytes)
        for (int r = 0; r < R; ++r)
          sums[r] = _mm512_dpbusd_epi32(sums[r], v, _mm512_set1_epi32(four_bytes(q + r * k + j * BYTE_GROUP + 4 * p)));
      }
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + code_bytes(BITS))));
    const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + code_bytes(BITS) + 32)));
    for (int r = 0; r < R; ++r) total[r] = add_block(total[r], sums[r], scale, mins, steps + r * 2 * count + 2 * j);
  }
  store_tile(total, R, bias, out, n, n0);
}

// The same sums with AVX2: u8 x s8 pairs (maddubs), then pairs of pairs (madd). The 16 outputs of a
// tile are two halves of 8. maddubs saturates a pair past 32767, and so would the 16-bit sums of
// pairs that save most of the madds (the multiplier ports are what bound this loop): a pair of
// 4-bit codes is at most 2 * 15 * 127 = 3810, so a half's 8 of them add up in 16 bits; a pair of
// 6-bit codes is at most 2 * 63 * 127 = 16002, so two of them do. Byte codes are split into their
// low 7 bits (2 * 127 * 127, one madd each) and their top bit, whose pairs add up in 16 bits and
// are weighed by 128 in one madd. All exact: the integer sums are those of any other order.
// Half h (8 outputs) of block j for R rows: total[r] += the block's scaled sums (add_block's steps,
// on 8 lanes).
template <int R, int BITS>
__attribute__((target("avx2,fma,f16c"), always_inline))
inline void add_half_avx2(const uint8_t* b, int64_t j, int h, int64_t count, const int8_t* q, int64_t k,
                          const float* steps, __m256* total) {
  const __m256i low = _mm256_set1_epi8(0x0F), low7 = _mm256_set1_epi8(0x7F), bit = _mm256_set1_epi8(1);
  const __m256i ones = _mm256_set1_epi16(1), top_weight = _mm256_set1_epi16(128);
  __m256i sums[R], pairs[R];  // 32-bit sums of 8 outputs; 16-bit sums of pairs not yet in them
  for (int r = 0; r < R; ++r) sums[r] = pairs[r] = _mm256_setzero_si256();
  for (int p = 0; p < 4; ++p) {
    const __m256i v = BITS == 6 ? six_bit_codes_avx2(b, p, h) : _mm256_loadu_si256((const __m256i*)(b + 64 * p + 32 * h));
    if constexpr (BITS == 4) {
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = q + r * k + j * GROUP;
        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_bytes(a + 4 * p))));
        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_bytes(a + 16 + 4 * p))));
      }
    } else if constexpr (BITS == 6) {
      for (int r = 0; r < R; ++r) {
        const __m256i a = _mm256_set1_epi32(four_bytes(q + r * k + j * BYTE_GROUP + 4 * p));
        pairs[r] = p % 2 ? _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(v, a)) : _mm256_maddubs_epi16(v, a);
      }
      if (p % 2)
        for (int r = 0; r < R; ++r) sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs[r], ones));
    } else {
      const __m256i rest = _mm256_and_si256(v, low7);
      const __m256i top = _mm256_and_si256(_mm256_srli_epi16(v, 7), bit);
      for (int r = 0; r < R; ++r) {
        const __m256i a = _mm256_set1_epi32(four_bytes(q + r * k + j * BYTE_GROUP + 4 * p));
        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(rest, a), ones));
        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(top, a));
      }
    }
  }
  if constexpr (BITS == 4)
    for (int r = 0; r < R; ++r) sums[r] = _mm256_madd_epi16(pairs[r], ones);
  if constexpr (BITS == 8)
    for (int r = 0; r < R; ++r) sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs[r], top_weight));
  const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + code_bytes(BITS) + 16 * h)));
  const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + code_bytes(BITS) + 32 + 16 * h)));
  for (int r = 0; r < R; ++r) {
    const float* step = steps + r * 2 * count + 2 * j;
    total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(scale, _mm256_set1_ps(step[0])), total[r]);
    total[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(step[1]), total[r]);
  }
}

// Up to 2 rows take both halves of a block before the next block (one pass over the tile's blocks,
// as a decode step streams them from memory); 3 and 4 rows, whose accumulators for both halves
// would not fit in 16 registers, take the tile's first half over all its blocks and then the
// second (the blocks are then in cache). The same sums and float steps either way.
template <int R, int BITS>
__attribute__((target("avx2,fma,f16c")))
void tile_avx2(const uint8_t* blocks, int64_t count, const int8_t* q, int64_t k, const float* steps,
               const float* bias, float* out, int64_t n, int64_t n0) {
  __m256 total[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) total[h][r] = _mm256_setzero_ps();
  if constexpr (R <= 2) {
    for (int64_t j = 0; j < count; ++j) {
      const uint8_t* b = blocks + j * block_bytes(BITS);
      prefetch_block(b + PREFETCH_GROUPS * block_bytes(BITS), BITS);
      for (int h = 0; h < 2; ++h) add_half_avx2<R, BITS>(b, j, h, count, q, k, steps, total[h]);
    }
  } else {
    for (int h = 0; h < 2; ++h)
      for (int64_t j = 0; j < count; ++j) {
        const uint8_t* b = blocks + j * block_bytes(BITS);
        if (h == 0) prefetch_block(b + PREFETCH_GROUPS * block_bytes(BITS), BITS);
        add_half_avx2<R, BITS>(b, j, h, count, q, k, steps, total[h]);
      }
  }
  const int64_t width = n - n0 < TILE ? n - n0 : TILE;
  for (int r = 0; r < R; ++r) {
    float y[TILE];
    _mm256_storeu_ps(y, total[0][r]);
    _mm256_storeu_ps(y + 8, total[1][r]);
    for (int64_t i = 0; i < width; ++i) out[r * n + n0 + i] = bias ? y[i] + bias[n0 + i] : y[i];
  }
}

// ---- AMX: the same sums for 16 rows at once, on the tile unit ----------------------------------
//
// 4-bit codes: for a group, the 16 rows' 32 activations (a 16 x 32-byte tile read in place from the
// quantized rows) times the tile's codes (unpacked to bytes: 8 x 64, the layout the dot product
// wants, which is how the blocks already order them) give all 16 x 16 integer sums in one TDPBSSD
// (codes 0..15 are valid signed bytes). 8-bit codes: a block's 16 inputs are a 16 x 16-byte tile of
// activations times its 256 code bytes read in place as a 4 x 64 tile, in one TDPBSUD (signed
// activations, unsigned codes). The sums are exact int32, as with VNNI, and the float steps after
// them are the VNNI tile's (add_block), in the same order: a row's result is bit-identical on
// either path. The tile unit works on block j while the vector units scale and add block j - LAG's
// sums (a ring of sums tiles and buffers), so a block costs one tile product plus its float
// epilogue instead of 128 (or 64) VPDPBUSDs.

constexpr int AMX_ROWS = 16;
constexpr int LAG = 3;           // blocks in flight on the tile unit while the vector units finish older ones
constexpr int UNPACK_AHEAD = 7;  // (both + 1 are powers of two: they index rings)

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0-3: sums (16 rows x 16 int32), 4/5: activations (16 rows x a block's inputs, one byte
// each), 6/7: codes (a block's inputs / 4 rows of 64 bytes: 8 for 4-bit codes, 4 for 8-bit ones).
// Globals, not locals: GCC 12 does not see that ldtilecfg reads a local and drops its stores.
TileConfig tile_config(int bits) {
  TileConfig config = {};
  config.palette = 1;
  for (int t = 0; t < 4; ++t) config.rows[t] = AMX_ROWS, config.colsb[t] = 64;
  for (int t = 0; t < 2; ++t) {
    config.rows[4 + t] = AMX_ROWS, config.colsb[4 + t] = (uint16_t)block_inputs(bits);
    config.rows[6 + t] = (uint8_t)(block_inputs(bits) / 4), config.colsb[6 + t] = 64;
  }
  return config;
}
const TileConfig NIBBLE_TILES = tile_config(4);
const TileConfig BYTE_TILES = tile_config(8);

__attribute__((target("amx-tile")))
void configure_tiles(int bits) { _tile_loadconfig(bits == 4 ? &NIBBLE_TILES : &BYTE_TILES); }

__attribute__((target("amx-tile")))
void release_tiles() { _tile_release(); }

// The tile numbers must be literals (the intrinsics paste them into the instruction); DOT is
// _tile_dpbssd or _tile_dpbsud.
#define BLOCK_SUMS_AMX(DOT, SUMS, ACTIVATIONS, CODES, activations, k, codes, sums) \
  do {                                                                           \
    _tile_loadd(ACTIVATIONS, activations, k);                                    \
    _tile_loadd(CODES, codes, 64);                                               \
    _tile_zero(SUMS);                                                            \
    DOT(SUMS, ACTIVATIONS, CODES);                                               \
    _tile_stored(SUMS, sums, 64);                                                \
  } while (0)

// A block's 4-bit codes as bytes, 8 rows of 64: row p holds inputs 4p..4p+3 (the low nibbles of
// vector p), row 4 + p inputs 16 + 4p.. (its high nibbles). This runs a few groups before the tile
// load that reads it: a tile load waits for the stores it overlaps to reach the cache, which
// measured as long as the rest of a group's work. (Byte codes need no unpacking.)
__attribute__((target("avx512f,avx512bw"), always_inline))
inline void unpack(const uint8_t* block, int8_t* codes) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int p = 0; p < 4; ++p) {
    __m512i v = _mm512_loadu_si512((const void*)(block + 64 * p));
    _mm512_store_si512((void*)(codes + 64 * p), _mm512_and_si512(v, low));
    _mm512_store_si512((void*)(codes + 64 * (4 + p)), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
}

// total[r] += block's steps for row r's sums (sums: 16 rows x 16 int32; step: row 0's pair)
__attribute__((target("avx512f,f16c,fma"), always_inline))
inline void add_sums(__m512* total, const uint8_t* block, const int32_t* sums, const float* step, int64_t row_floats) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + CODE_BYTES)));
  const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + CODE_BYTES + 32)));
  for (int r = 0; r < AMX_ROWS; ++r)
    total[r] = add_block(total[r], _mm512_load_si512((const void*)(sums + r * TILE)), scale, mins, step + r * row_floats);
}

template <int BITS>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c,fma")))
void tile_amx(const uint8_t* blocks, int64_t count, const int8_t* q, int64_t k, const float* steps,
              const float* bias, float* out, int64_t n, int64_t n0) {
  alignas(64) int8_t codes[BITS == 4 ? UNPACK_AHEAD + 1 : 1][8 * 64];
  alignas(64) int32_t sums[LAG + 1][AMX_ROWS * TILE];
  __m512 total[AMX_ROWS];
  for (int r = 0; r < AMX_ROWS; ++r) total[r] = _mm512_setzero_ps();
  if constexpr (BITS == 4)
    for (int64_t j = 0; j < UNPACK_AHEAD && j < count; ++j) unpack(blocks + j * BLOCK_BYTES, codes[j]);
  for (int64_t j = 0; j < count; ++j) {
    prefetch_block(blocks + (j + PREFETCH_GROUPS) * BLOCK_BYTES, BITS);
    const int8_t* a = q + j * block_inputs(BITS);  // (16 rows, block_inputs) with rows k bytes apart
    int32_t* s = sums[j & LAG];
    if constexpr (BITS == 4) {
      if (j + UNPACK_AHEAD < count) unpack(blocks + (j + UNPACK_AHEAD) * BLOCK_BYTES, codes[(j + UNPACK_AHEAD) & UNPACK_AHEAD]);
      const int8_t* c = codes[j & UNPACK_AHEAD];
      switch (j & LAG) {
        case 0: BLOCK_SUMS_AMX(_tile_dpbssd, 0, 4, 6, a, k, c, s); break;
        case 1: BLOCK_SUMS_AMX(_tile_dpbssd, 1, 5, 7, a, k, c, s); break;
        case 2: BLOCK_SUMS_AMX(_tile_dpbssd, 2, 4, 6, a, k, c, s); break;
        default: BLOCK_SUMS_AMX(_tile_dpbssd, 3, 5, 7, a, k, c, s); break;
      }
    } else {
      const uint8_t* c = blocks + j * BLOCK_BYTES;  // (4 rows, 64 bytes): already the tile's layout
      switch (j & LAG) {
        case 0: BLOCK_SUMS_AMX(_tile_dpbsud, 0, 4, 6, a, k, c, s); break;
        case 1: BLOCK_SUMS_AMX(_tile_dpbsud, 1, 5, 7, a, k, c, s); break;
        case 2: BLOCK_SUMS_AMX(_tile_dpbsud, 2, 4, 6, a, k, c, s); break;
        default: BLOCK_SUMS_AMX(_tile_dpbsud, 3, 5, 7, a, k, c, s); break;
      }
    }
    if (j >= LAG) add_sums(total, blocks + (j - LAG) * BLOCK_BYTES, sums[(j - LAG) & LAG], steps + 2 * (j - LAG), 2 * count);
  }
  for (int64_t j = count > LAG ? count - LAG : 0; j < count; ++j)
    add_sums(total, blocks + j * BLOCK_BYTES, sums[j & LAG], steps + 2 * j, 2 * count);
  store_tile(total, AMX_ROWS, bias, out, n, n0);
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

// A block's scales and mins, each spread over the two halves of 16 bf16 pairs' lanes (outputs 0..7, 8..15).
struct PairSteps {
  __m512 scale_first, scale_last, min_first, min_last;
};

__attribute__((target("avx512f,f16c"), always_inline))
inline PairSteps pair_steps(const uint8_t* block) {
  const __m512i first_outputs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i last_outputs = _mm512_add_epi32(first_outputs, _mm512_set1_epi32(8));
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + CODE_BYTES)));
  const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + CODE_BYTES + 32)));
  return {_mm512_permutexvar_ps(first_outputs, scale), _mm512_permutexvar_ps(last_outputs, scale),
          _mm512_permutexvar_ps(first_outputs, mins), _mm512_permutexvar_ps(last_outputs, mins)};
}

// codes: lane n holds the codes of 4 consecutive inputs of output n, one per byte (0..255) -> rows
// `row` and `row + 1` of a bf16 weight tile (row j: for each output, the weights of inputs 2j, 2j + 1)
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
inline void store_bf16_rows(__m512i codes, const PairSteps& steps, uint16_t* tile, int row) {
  for (int half = 0; half < 2; ++half) {
    const __m256i pairs = _mm512_cvtepi32_epi16(half ? _mm512_srli_epi32(codes, 16) : codes);  // 16 x (2 codes)
    __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(pairs)));  // outputs 0..7
    __m512 last = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(pairs, 1)));  // 8..15
    first = _mm512_fmadd_ps(first, steps.scale_first, steps.min_first);
    last = _mm512_fmadd_ps(last, steps.scale_last, steps.min_last);
    _mm512_storeu_si512((void*)(tile + (row + half) * 32), (__m512i)_mm512_cvtne2ps_pbh(last, first));
  }
}

// One tile's blocks -> per group of 32 inputs 16 rows of 64 bytes: row j holds, for each of the 16
// outputs n, the bf16 weights of inputs 2j and 2j + 1 (TDPBF16PS's pairs). In 4-bit codes, the
// 32-bit lane n of vector p holds inputs 4p..4p+3 (low nibbles) and 16 + 4p.. (high nibbles): its
// low 16 bits are the pair of row 2p, its high 16 bits the pair of row 2p + 1 (8 + 2p, 9 + 2p for
// the high nibbles). In 8-bit codes a group is two blocks, the second one's vectors in rows 8 + 2p.
__attribute__((target("avx512f,avx512bw,avx512bf16,f16c")))
void dequantize_tile(const uint8_t* blocks, int64_t groups, int bits, uint16_t* w) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t* tile = w + g * 16 * 32;
    if (bits == 4) {
      const uint8_t* b = blocks + g * BLOCK_BYTES;
      const PairSteps steps = pair_steps(b);
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512((const void*)(b + 64 * p));
        store_bf16_rows(_mm512_and_si512(v, low), steps, tile, 2 * p);
        store_bf16_rows(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), steps, tile, 8 + 2 * p);
      }
    } else {
      for (int h = 0; h < 2; ++h) {
        const uint8_t* b = blocks + (2 * g + h) * BLOCK_BYTES;
        const PairSteps steps = pair_steps(b);
        for (int p = 0; p < 4; ++p) store_bf16_rows(_mm512_loadu_si512((const void*)(b + 64 * p)), steps, tile, 8 * h + 2 * p);
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

typedef void (*TileFn)(const uint8_t*, int64_t, const int8_t*, int64_t, const float*, const float*, float*, int64_t,
                       int64_t);

#define TILES_AVX512(BITS)                                                                                \
  { tile_avx512<1, BITS>, tile_avx512<2, BITS>, tile_avx512<3, BITS>, tile_avx512<4, BITS>, tile_avx512<5, BITS>, \
    tile_avx512<6, BITS>, tile_avx512<7, BITS>, tile_avx512<8, BITS> }

#define TILES_AVX2(BITS) { tile_avx2<1, BITS>, tile_avx2<2, BITS>, tile_avx2<3, BITS>, tile_avx2<4, BITS> }

// Rows go in chunks of up to 8 (AVX-512: 2 x 8 accumulators fit in 32 registers) or AVX2_ROWS.
TileFn tile_fn(int isa, int bits, int rows) {
  static const TileFn avx512[3][8] = {TILES_AVX512(4), TILES_AVX512(6), TILES_AVX512(8)};
  static const TileFn avx2[3][AVX2_ROWS] = {TILES_AVX2(4), TILES_AVX2(6), TILES_AVX2(8)};
  const int format = bits / 2 - 2;  // 4, 6, 8 -> 0, 1, 2
  return isa >= 2 ? avx512[format][rows - 1] : avx2[format][rows - 1];
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

// x (m, k) float32 -> out (m, n) float32 for blocks of `bits`-bit codes (4, 6 or 8) as built by
// cpu_w4a8.pack / pack_six / pack_bytes. scratch: m * k bytes of int8 activations (rounded up to 64), then per
// row 2 * k / (32 or 16) floats (each block's scale and weighted activation sum). k is a multiple of 32.
void w4a8_linear(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, const float* bias,
                 float* out, void* scratch, int isa, int bits) {
  const int64_t count = k / block_inputs(bits);  // blocks per tile
  int8_t* q = (int8_t*)scratch;
  float* steps = (float*)((char*)scratch + ((m * k + 63) / 64) * 64);  // (m, count, 2)
#pragma omp parallel for schedule(static) if (m * k >= (1 << 16))
  for (int64_t r = 0; r < m; ++r) {
    if (isa >= 2) quantize_row_avx512(x + r * k, k, bits, q + r * k, steps + r * 2 * count);
    else quantize_row_avx2(x + r * k, k, bits, q + r * k, steps + r * 2 * count);
  }
  const int64_t tiles = (n + TILE - 1) / TILE;
  const int chunk = isa >= 2 ? 8 : AVX2_ROWS;
  // rows in whole sets of 16 go to the tile unit, the rest to the vector units (the same numbers);
  // 6-bit codes always to the vector units, which unpack them in registers
  const int64_t amx_rows = isa == 3 && bits != 6 ? m / AMX_ROWS * AMX_ROWS : 0;
  const TileFn amx = bits == 4 ? tile_amx<4> : tile_amx<8>;
#pragma omp parallel if (tiles > 1)
  {
    if (amx_rows) configure_tiles(bits);
    // dynamic: a thread the OS preempts (2 cores, other processes) does not hold half the work
#pragma omp for schedule(dynamic, 4)
    for (int64_t t = 0; t < tiles; ++t) {
      const uint8_t* tile_blocks = blocks + t * count * block_bytes(bits);
      for (int64_t r0 = 0; r0 < amx_rows; r0 += AMX_ROWS)
        amx(tile_blocks, count, q + r0 * k, k, steps + r0 * 2 * count, bias, out + r0 * n, n, t * TILE);
      for (int64_t r0 = amx_rows; r0 < m; r0 += chunk) {
        const int rows = (int)(m - r0 < chunk ? m - r0 : chunk);
        tile_fn(isa, bits, rows)(tile_blocks, count, q + r0 * k, k, steps + r0 * 2 * count, bias, out + r0 * n, n, t * TILE);
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

// A prompt's pass: x (m, k) float32 -> out (m, n) float32 through bf16 tiles, for blocks of
// `bits`-bit codes (4 or 8; 6-bit ones take w4a8_linear). scratch: at least
// w4a8_prompt_scratch(m, k) bytes.
int64_t w4a8_prompt_scratch(int64_t m, int64_t k) { return (m + 15) / 16 * 16 * k * 2; }

void w4a8_prompt(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, const float* bias, float* out,
                 void* scratch, int bits) {
  const int64_t groups = k / GROUP, count = k / block_inputs(bits), tiles = (n + TILE - 1) / TILE;
  uint16_t* a = (uint16_t*)scratch;
  rows_to_bf16(x, m, k, a);
#pragma omp parallel
  {
    configure_prompt_tiles();
    uint16_t* w = (uint16_t*)aligned_alloc(64, 2 * groups * 512 * sizeof(uint16_t));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tiles; t += 2) {
      uint16_t* w1 = t + 1 < tiles ? w + groups * 512 : nullptr;
      dequantize_tile(blocks + t * count * BLOCK_BYTES, groups, bits, w);
      if (w1) dequantize_tile(blocks + (t + 1) * count * BLOCK_BYTES, groups, bits, w1);
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
