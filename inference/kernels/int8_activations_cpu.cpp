// int4 and int8 weights times int8 activations on x86 CPUs: the decode-time kernels.
//
// Why: torch's CPU int4 kernel turns the 4-bit codes into bf16 and multiplies in floating
// point, and its int8 kernel likewise; decoding at batch 1 is then bound by that conversion, not
// by memory. Rounding the activations to int8 per block of 64 inputs lets integer dot products
// multiply codes by activations in int32 (as llama.cpp does for its Q4 and Q8 formats), and a
// layout where the 16 lanes of a vector are 16 output rows applies each scale once per block for
// 16 rows instead of once per row.
//
// Layout (built by pack in inference/cpu_kernels.py), for tiles of 16 output rows:
//   packed  int4: [N/16, K/8, 64] uint8: for inputs 8c .. 8c+7 of the tile, byte 4r+j holds row
//           r's input 8c+j in its low nibble and input 8c+4+j in its high nibble, so one 64-byte
//           load unpacks to two dot-product operands (4 inputs of 16 rows each)
//           int8: [N/16, K/8, 128] uint8: the same two operands stored whole, byte 4r+j of the
//           first 64 holding row r's input 8c+j and of the second 64 its input 8c+4+j
//   scales  [N/16, K/G, 16] bfloat16: w = scale * code - offset for the G inputs of a group
//   offsets [N/16, K/G, 16] bfloat16: scale * zero point; none for a symmetric scheme, whose
//           zero point is 8 (int4) or 128 (int8): the kernel multiplies it by the scale itself,
//           and the layer reads 2 bytes less per group (4.5 bits a weight at g32, as Q4_0)
// y[m, n] = sum_segments scale * a_scale * dot(codes, a_int8) - sum_groups offset * sum(a)
// over segments of min(G, 64) inputs (groups of 32, as llama.cpp's Q4_0, put two weight scales in
// one activation block), where a_scale is the 64-input block's absmax / 127 and sum(a) the sum of the group's rounded
// inputs (a_scale * sum(a_int8) per block): the offset then cancels against the same rounded
// inputs the codes met, and the result is the integer dot of (code - zero) and a_int8. With the
// exact sum instead, the activations' rounding error would be multiplied by the zero point (128
// for int8) rather than by code - zero; llama.cpp's Q4_1/Q8_1 keep the rounded sum likewise.
//
// Instruction sets (inference/cpu_kernels.py compiles with the flags of one): AVX512-VNNI holds
// a tile's 16 rows in one 512-bit register and multiplies with VPDPBUSD; laptop processors
// without AVX-512 hold them in two 256-bit halves of 8 rows, multiplied with AVX-VNNI's 256-bit
// VPDPBUSD where present, else with AVX2's VPMADDUBSW and VPMADDWD (llama.cpp's AVX2 way).
// Every path computes the same integer dots; only float summation order differs.
//
// A LoRA adapter trained beside the codes (y += B A x) runs inside the same call: A x in float
// from the unrounded input, once per token before the tiles, then each tile adds its 16 rows of
// B times it. B is stored per tile, only the span of columns the tile's rows use, so a fused
// layer's block-diagonal B (q/k/v, gate/up, each part its own adapter) is read without its zeros.
// As a separate pair of matmuls the adapter cost two library calls per layer, each dearer than
// the bytes it read.
//
// Two entry points, one per weight width: int4_int8_mm and int8_int8_mm, in the namespace
// SLIMLM_OPS (slimlm_ and the sources' digest, given by inference/cpu_kernels.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "ops_namespace.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SLIMLM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define SLIMLM_AVX512 0
#else
#error "the int8-activation kernels need AVX512-VNNI (with AVX512F and AVX512BW) or AVX2 with FMA"
#endif

namespace {

constexpr int64_t kBlock = 64;  // inputs per activation block (one int8 scale each)
constexpr int64_t kSegment = 32;  // the one weight group smaller than a block: two scales per block

// Weight groups the kernels take: 32 inputs (llama.cpp's Q4_0 and Q8_0 size) or a multiple of 64.
inline bool valid_group(int64_t group, int64_t K) { return (group == kSegment || (group > 0 && group % kBlock == 0)) && K % group == 0 && K % kBlock == 0; }

// Sixteen lanes, one per row of a tile (or per input when rounding activations), and the few
// operations the kernel needs on them.
#if SLIMLM_AVX512
using Floats = __m512;
using Ints = __m512i;
constexpr int kTokens = 4;  // tokens per pass over a tile's weights

inline Floats zero_floats() { return _mm512_setzero_ps(); }
inline Ints zero_ints() { return _mm512_setzero_si512(); }
inline Floats splat(float value) { return _mm512_set1_ps(value); }
inline Floats load16(const float* p) { return _mm512_loadu_ps(p); }
inline Floats load16(const uint16_t* bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16))), 16));
}
inline void store16(float* p, Floats v) { _mm512_storeu_ps(p, v); }
inline Floats add(Floats a, Floats b) { return _mm512_add_ps(a, b); }
inline Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline Floats max(Floats a, Floats b) { return _mm512_max_ps(a, b); }
inline Floats abs(Floats v) { return _mm512_abs_ps(v); }
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline Floats fnmadd(Floats a, Floats b, Floats c) { return _mm512_fnmadd_ps(a, b, c); }
inline float reduce_max(Floats v) { return _mm512_reduce_max_ps(v); }
inline float reduce_add(Floats v) { return _mm512_reduce_add_ps(v); }
// Round to nearest even (the default rounding mode) and saturate to int8.
inline void store_int8(int8_t* p, Floats v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v))); }
inline Floats to_floats(Ints v) { return _mm512_cvtepi32_ps(v); }
inline Ints splat_ints(int32_t value) { return _mm512_set1_epi32(value); }
inline Ints add(Ints a, Ints b) { return _mm512_add_epi32(a, b); }

// A chunk's codes: `first` inputs 8c..8c+3 of the 16 rows, `second` inputs 8c+4..8c+7.
template <int Bits>
inline void unpack(const uint8_t* w, Ints& first, Ints& second) {
  if constexpr (Bits == 4) {
    const __m512i bytes = _mm512_loadu_si512(w), low = _mm512_set1_epi8(0x0F);
    first = _mm512_and_si512(bytes, low);
    second = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
  } else {
    first = _mm512_loadu_si512(w);
    second = _mm512_loadu_si512(w + 64);
  }
}
// even += first . a[0..3], odd += second . a[4..7] per row: two chains in flight. VPDPBUSD
// multiplies unsigned codes up to 255 by signed activations without saturating.
template <int Bits>
inline void dot8(Ints& even, Ints& odd, Ints first, Ints second, int32_t a_low, int32_t a_high) {
  even = _mm512_dpbusd_epi32(even, first, _mm512_set1_epi32(a_low));
  odd = _mm512_dpbusd_epi32(odd, second, _mm512_set1_epi32(a_high));
}
#else
struct Floats { __m256 lo, hi; };
struct Ints { __m256i lo, hi; };
constexpr int kTokens = 2;  // sixteen 256-bit registers: fewer tokens per pass

inline Floats zero_floats() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Ints zero_ints() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Floats splat(float value) { return {_mm256_set1_ps(value), _mm256_set1_ps(value)}; }
inline Floats load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen_bf16(__m128i bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)); }
inline Floats load16(const uint16_t* bf16) {
  return {widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bf16))), widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bf16 + 8)))};
}
inline void store16(float* p, Floats v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline Floats add(Floats a, Floats b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Floats mul(Floats a, Floats b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Floats max(Floats a, Floats b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Floats abs(Floats v) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  return {_mm256_andnot_ps(sign, v.lo), _mm256_andnot_ps(sign, v.hi)};
}
inline Floats fmadd(Floats a, Floats b, Floats c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Floats fnmadd(Floats a, Floats b, Floats c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline float reduce_max(Floats v) {
  const __m256 m8 = _mm256_max_ps(v.lo, v.hi);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float reduce_add(Floats v) {
  const __m256 s8 = _mm256_add_ps(v.lo, v.hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline void store_int8(int8_t* p, Floats v) {
  const __m256i lo = _mm256_cvtps_epi32(v.lo), hi = _mm256_cvtps_epi32(v.hi);
  const __m128i lo16 = _mm_packs_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
  const __m128i hi16 = _mm_packs_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(lo16, hi16));
}
inline Floats to_floats(Ints v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
inline Ints splat_ints(int32_t value) { return {_mm256_set1_epi32(value), _mm256_set1_epi32(value)}; }
inline Ints add(Ints a, Ints b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
template <int Bits>
inline void unpack(const uint8_t* w, Ints& first, Ints& second) {
  if constexpr (Bits == 4) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i rows_lo = load32(w), rows_hi = load32(w + 32);  // rows 0-7, rows 8-15
    first = {_mm256_and_si256(rows_lo, low), _mm256_and_si256(rows_hi, low)};
    second = {_mm256_and_si256(_mm256_srli_epi16(rows_lo, 4), low), _mm256_and_si256(_mm256_srli_epi16(rows_hi, 4), low)};
  } else {
    first = {load32(w), load32(w + 32)};
    second = {load32(w + 64), load32(w + 96)};
  }
}
#if defined(__AVXVNNI__)
// even += first . a[0..3], odd += second . a[4..7] per row: four chains in flight.
template <int Bits>
inline void dot8(Ints& even, Ints& odd, Ints first, Ints second, int32_t a_low, int32_t a_high) {
  const __m256i low = _mm256_set1_epi32(a_low), high = _mm256_set1_epi32(a_high);
  even = {_mm256_dpbusd_avx_epi32(even.lo, first.lo, low), _mm256_dpbusd_avx_epi32(even.hi, first.hi, low)};
  odd = {_mm256_dpbusd_avx_epi32(odd.lo, second.lo, high), _mm256_dpbusd_avx_epi32(odd.hi, second.hi, high)};
}
#else
// Unsigned codes (at most 15) times signed activations: each 16-bit pair sum is at most
// 2 * 15 * 128 and the two products' sum 7680, far from int16 saturation. Only the final
// 32-bit add is a chain, so everything goes to `even`.
inline __m256i dot8_half(__m256i acc, __m256i first, __m256i second, __m256i low, __m256i high) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, low), _mm256_maddubs_epi16(second, high));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
// int8 codes reach 255, and 2 * 255 * 127 would saturate those pair sums: the codes are taken as
// code - 128 (signed) with their sign moved onto the activation (llama.cpp's Q8 way), pairs at
// most 2 * 128 * 127, and tile() starts each block's sums at 128 * sum(a) to give back code . a.
// Two such pair sums would overflow int16, so each is widened on its own, and both go to `even`,
// as for int4: one accumulator a token leaves more of the sixteen registers to the tile's loads.
inline __m256i pairs_recentred(__m256i codes, __m256i a) {
  const __m256i centred = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(a, centred)), _mm256_set1_epi16(1));
}
inline __m256i dot8_recentred(__m256i acc, __m256i first, __m256i second, __m256i low, __m256i high) {
  return _mm256_add_epi32(acc, _mm256_add_epi32(pairs_recentred(first, low), pairs_recentred(second, high)));
}
constexpr bool kRecentredInt8 = true;
template <int Bits>
inline void dot8(Ints& even, Ints&, Ints first, Ints second, int32_t a_low, int32_t a_high) {
  const __m256i low = _mm256_set1_epi32(a_low), high = _mm256_set1_epi32(a_high);
  if constexpr (Bits == 4) {
    even = {dot8_half(even.lo, first.lo, second.lo, low, high), dot8_half(even.hi, first.hi, second.hi, low, high)};
  } else {
    even = {dot8_recentred(even.lo, first.lo, second.lo, low, high), dot8_recentred(even.hi, first.hi, second.hi, low, high)};
  }
}
#endif  // __AVXVNNI__
#endif  // SLIMLM_AVX512

#if SLIMLM_AVX512 || defined(__AVXVNNI__)
constexpr bool kRecentredInt8 = false;  // VPDPBUSD takes codes up to 255 as they are
#endif

inline Floats load16(const at::BFloat16* p) { return load16(reinterpret_cast<const uint16_t*>(p)); }

inline int32_t four_bytes(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  return four;
}

struct Problem {
  int64_t M, N, K, group;
  const uint8_t* packed;    // [N/16, K/8, 16 * Bits]
  const uint16_t* scales;   // [N/16, K/group, 16] bf16 bits
  const uint16_t* offsets;  // [N/16, K/group, 16] bf16 bits, or null: the symmetric zero point times the scale
  int8_t* q;                // [M, K] activations rounded to int8
  float* block_scale;       // [M, K/64]
  float* group_sum;         // [M, K/group] sums of the rounded activations
  int32_t* code_sum;        // [M, K/step] sums of the int8 activations per segment
  // The LoRA adapter, if any (rank 0: none).
  int64_t rank = 0;
  const uint16_t* lora_down = nullptr;  // [rank, K] bf16 bits: A
  const uint16_t* lora_up = nullptr;    // per tile [count, 16] bf16 bits: columns first .. first+count of B, its 16 rows
  const int64_t* lora_tiles = nullptr;  // [N/16, 3]: first, count, offset into lora_up
  float* low = nullptr;                 // [M, rank]: A x
  int64_t blocks() const { return K / kBlock; }
  // Inputs per integer dot: a whole 64-input block, or a group of 32 (two weight scales in a block).
  int64_t step() const { return std::min(group, kBlock); }
  int64_t segments() const { return K / step(); }
  int64_t groups() const { return K / group; }
};

// Round each 64-input block of row m to int8 with its absmax scale; sum the rounded inputs per
// segment (as integers) and per group (scaled back).
template <typename In>
void quantize_row(const Problem& p, const In* row, int64_t m) {
  const int64_t blocks = p.blocks();
  for (int64_t b = 0; b < blocks; ++b) {
    Floats v[kBlock / 16];
    Floats amax = zero_floats();
    for (int i = 0; i < kBlock / 16; ++i) {
      v[i] = load16(row + b * kBlock + i * 16);
      amax = max(amax, abs(v[i]));
    }
    const float absmax = reduce_max(amax);
    const float scale = absmax > 0.f ? absmax / 127.f : 1.f;
    const Floats inverse = splat(1.f / scale);
    int8_t* q = p.q + m * p.K + b * kBlock;
    for (int i = 0; i < kBlock / 16; ++i) store_int8(q + i * 16, mul(v[i], inverse));
    p.block_scale[m * blocks + b] = scale;
  }
  const int64_t step = p.step(), segments = p.segments(), per_group = p.group / step;
  for (int64_t s = 0; s < segments; ++s) {
    const int8_t* q = p.q + m * p.K + s * step;
    int32_t sum = 0;
    for (int64_t i = 0; i < step; ++i) sum += q[i];
    p.code_sum[m * segments + s] = sum;
  }
  for (int64_t g = 0; g < p.groups(); ++g) {
    float sum = 0.f;
    for (int64_t s = g * per_group; s < (g + 1) * per_group; ++s) sum += p.block_scale[m * blocks + s * step / kBlock] * static_cast<float>(p.code_sum[m * segments + s]);
    p.group_sum[m * p.groups() + g] = sum;
  }
}

// low[m] = A x[m] in float from the unrounded input: A has a handful of rows, so integer dots
// would save nothing worth having, and the correction stays free of the activations' rounding.
template <typename In>
void project_row(const Problem& p, const In* row, int64_t m) {
  for (int64_t j = 0; j < p.rank; ++j) {
    const uint16_t* a = p.lora_down + j * p.K;
    Floats even = zero_floats(), odd = zero_floats();
    for (int64_t k = 0; k < p.K; k += 32) {
      even = fmadd(load16(row + k), load16(a + k), even);
      odd = fmadd(load16(row + k + 16), load16(a + k + 16), odd);
    }
    p.low[m * p.rank + j] = reduce_add(add(even, odd));
  }
}

// y[m0 .. m0+T, 16 rows of tile i]; each weight load feeds T tokens.
template <int Bits, int T, typename Out>
void tile(const Problem& p, Out* y, int64_t i, int64_t m0) {
  constexpr int64_t chunk = 16 * Bits;  // bytes of 8 inputs of 16 rows
  const int64_t blocks = p.blocks(), groups = p.groups(), step = p.step(), segments = p.segments(), per_group = p.group / step;
  const uint8_t* w = p.packed + i * (p.K / 8) * chunk;
  Floats acc[T];
  for (int t = 0; t < T; ++t) acc[t] = zero_floats();
  for (int64_t g = 0; g < groups; ++g) {
    const Floats w_scale = load16(p.scales + (i * groups + g) * 16);
    const Floats w_offset = p.offsets ? load16(p.offsets + (i * groups + g) * 16) : mul(w_scale, splat(Bits == 4 ? 8.f : 128.f));
    for (int64_t s = g * per_group; s < (g + 1) * per_group; ++s) {
      const int64_t b = s * step / kBlock;
      Ints even[T], odd[T];
      for (int t = 0; t < T; ++t) {
        even[t] = odd[t] = zero_ints();
        if constexpr (Bits == 8 && kRecentredInt8) even[t] = splat_ints(128 * p.code_sum[(m0 + t) * segments + s]);
      }
      for (int64_t c = s * (step / 8); c < (s + 1) * (step / 8); ++c) {
        Ints first, second;
        unpack<Bits>(w + c * chunk, first, second);
        for (int t = 0; t < T; ++t) {
          const int8_t* a = p.q + (m0 + t) * p.K + c * 8;
          dot8<Bits>(even[t], odd[t], first, second, four_bytes(a), four_bytes(a + 4));
        }
      }
      for (int t = 0; t < T; ++t) acc[t] = fmadd(to_floats(add(even[t], odd[t])), mul(w_scale, splat(p.block_scale[(m0 + t) * blocks + b])), acc[t]);
    }
    for (int t = 0; t < T; ++t) acc[t] = fnmadd(w_offset, splat(p.group_sum[(m0 + t) * groups + g]), acc[t]);
  }
  if (p.rank) {
    const int64_t* span = p.lora_tiles + i * 3;
    const uint16_t* up = p.lora_up + span[2];
    for (int64_t j = 0; j < span[1]; ++j) {
      const Floats column = load16(up + j * 16);
      for (int t = 0; t < T; ++t) acc[t] = fmadd(column, splat(p.low[(m0 + t) * p.rank + span[0] + j]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    float out[16];
    store16(out, acc[t]);
    for (int r = 0; r < 16; ++r) y[(m0 + t) * p.N + i * 16 + r] = static_cast<Out>(out[r]);
  }
}

// Tiles [begin, end) against every activation row, kTokens at a time, the rest one by one.
template <int Bits, typename Out>
void tiles(const Problem& p, Out* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    int64_t m0 = 0;
    for (; m0 + kTokens <= p.M; m0 += kTokens) tile<Bits, kTokens>(p, y, i, m0);
    for (; m0 < p.M; ++m0) tile<Bits, 1>(p, y, i, m0);
  }
}

template <int Bits, typename Scalar>
void run(Problem& p, const at::Tensor& x, at::Tensor& y) {
  const Scalar* xp = x.data_ptr<Scalar>();
  Scalar* yp = y.data_ptr<Scalar>();
  const auto prepare = [&](int64_t m) {
    quantize_row(p, xp + m * p.K, m);
    if (p.rank) project_row(p, xp + m * p.K, m);
  };
  if (p.M == 1) {
    prepare(0);
  } else {
    at::parallel_for(0, p.M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) prepare(m);
    });
  }
  at::parallel_for(0, p.N / 16, 1, [&](int64_t begin, int64_t end) { tiles<Bits>(p, yp, begin, end); });
}

using Optional = std::optional<at::Tensor>;

// A layer's offsets: bf16 shaped as its scales, or none for a symmetric scheme (null: the kernel
// takes the zero point times the scale).
const uint16_t* offsets_of(const char* name, const Optional& offsets, const at::Tensor& scales) {
  if (!offsets.has_value()) return nullptr;
  TORCH_CHECK(offsets->scalar_type() == at::kBFloat16 && offsets->sizes() == scales.sizes() && offsets->is_contiguous(), name, ": contiguous bfloat16 offsets shaped as the scales expected (or none, for a symmetric scheme)");
  return reinterpret_cast<const uint16_t*>(offsets->data_ptr<at::BFloat16>());
}

// The adapter's three tensors (all or none; cpu_kernels.pack_adapter lays them out), checked
// against the layer; returns its rank (0: none).
int64_t adapter_rank(const char* name, int64_t N, int64_t K, const Optional& down, const Optional& up, const Optional& tiles) {
  TORCH_CHECK(down.has_value() == up.has_value() && up.has_value() == tiles.has_value(), name, ": a LoRA adapter needs lora_down, lora_up and lora_tiles together");
  if (!down.has_value()) return 0;
  TORCH_CHECK(down->scalar_type() == at::kBFloat16 && down->dim() == 2 && down->size(1) == K && down->is_contiguous(), name, ": lora_down must be contiguous bfloat16 [rank, K=", K, "]");
  TORCH_CHECK(up->scalar_type() == at::kBFloat16 && up->dim() == 1 && up->is_contiguous(), name, ": lora_up must be a contiguous bfloat16 vector");
  TORCH_CHECK(tiles->scalar_type() == at::kLong && tiles->dim() == 2 && tiles->size(0) == N / 16 && tiles->size(1) == 3 && tiles->is_contiguous(), name, ": lora_tiles must be contiguous int64 [N/16=", N / 16, ", 3]");
  const int64_t rank = down->size(0);
  const int64_t* span = tiles->data_ptr<int64_t>();
  for (int64_t i = 0; i < N / 16; ++i, span += 3) {
    // Written so that no sum or product of the caller's values can overflow past the check.
    const bool in_rank = span[0] >= 0 && span[0] <= rank && span[1] >= 0 && span[1] <= rank - span[0];
    const bool in_up = span[2] >= 0 && span[2] <= up->numel() && span[1] <= (up->numel() - span[2]) / 16;
    TORCH_CHECK(in_rank && in_up, name, ": lora_tiles row ", i, " reaches outside lora_down's rank ", rank, " or lora_up");
  }
  return rank;
}

template <int Bits>
at::Tensor mm(const char* name, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const Optional& offsets, int64_t group_size,
              const Optional& lora_down, const Optional& lora_up, const Optional& lora_tiles) {
  constexpr int64_t chunk = 16 * Bits;
  TORCH_CHECK(x.dim() == 2 && packed.scalar_type() == at::kByte, name, ": x [M, K] and uint8 packed weights expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16 activations expected");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == chunk, name, ": packed weights [N/16, K/8, ", chunk, "] expected");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * 8 == K && valid_group(group_size, K), name, ": K=", K, " must match the packed width and be a multiple of the group size ", group_size, " and of 64 (groups: 32 or a multiple of 64)");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 3 && scales.size(0) == N / 16 && scales.size(1) == K / group_size && scales.size(2) == 16, name, ": bfloat16 scales [N/16, K/group, 16] expected");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous(), name, ": contiguous weights expected");
  const int64_t rank = adapter_rank(name, N, K, lora_down, lora_up, lora_tiles);
  const at::Tensor input = x.contiguous();
  // The rounded activations and their block scales and sums live in a per-thread scratch that
  // only grows: at batch 1 two allocations per call cost as much as a small layer's matmul.
  thread_local std::vector<float> scratch;
  thread_local std::vector<int32_t> code_sums;
  const size_t floats = M * (K / kBlock + K / group_size + rank);
  scratch.resize(std::max(scratch.size(), floats + (M * K + 3) / 4));
  code_sums.resize(std::max<size_t>(code_sums.size(), M * (K / std::min(group_size, kBlock))));
  at::Tensor y = at::empty({M, N}, x.options());
  Problem p{M, N, K, group_size, packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()),
            offsets_of(name, offsets, scales), reinterpret_cast<int8_t*>(scratch.data() + floats), scratch.data(), nullptr, code_sums.data()};
  p.group_sum = p.block_scale + M * (K / kBlock);
  if (rank) {
    p.rank = rank;
    p.lora_down = reinterpret_cast<const uint16_t*>(lora_down->data_ptr<at::BFloat16>());
    p.lora_up = reinterpret_cast<const uint16_t*>(lora_up->data_ptr<at::BFloat16>());
    p.lora_tiles = lora_tiles->data_ptr<int64_t>();
    p.low = p.group_sum + M * (K / group_size);
  }
  if (x.scalar_type() == at::kFloat) {
    run<Bits, float>(p, input, y);
  } else {
    run<Bits, at::BFloat16>(p, input, y);
  }
  return y;
}

at::Tensor int4_int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const Optional& offsets, int64_t group_size,
                        const Optional& lora_down, const Optional& lora_up, const Optional& lora_tiles) {
  return mm<4>("int4_int8_mm", x, packed, scales, offsets, group_size, lora_down, lora_up, lora_tiles);
}

at::Tensor int8_int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const Optional& offsets, int64_t group_size,
                        const Optional& lora_down, const Optional& lora_up, const Optional& lora_tiles) {
  return mm<8>("int8_int8_mm", x, packed, scales, offsets, group_size, lora_down, lora_up, lora_tiles);
}

// ---- Mixtures of experts -----------------------------------------------------------------
//
// A mixture-of-experts layer's routed experts in one call, as llama.cpp's mul_mat_id runs them.
// Why: called one by one from Python, a decode step's 8 experts cost 16 matmul calls per layer,
// each with its own thread fork and the Python between them: more time than the weights they
// read. Here the routes (token, slot) are sorted by expert, each token's input is rounded to
// int8 once per route, and one parallel pass covers every chosen expert's tiles of gate/up, then
// one pass their down projections; the weighted sum of the routes is added up in float.
//
// Experts are stacked: packed [E, N/16, K/8, 16 * Bits], scales and offsets (if any) [E, N/16, K/G, 16],
// each expert laid out as one layer above (inference/expert_stack.py builds the stack).

struct Routed {
  int64_t expert, first, count;  // expert `expert` holds routes [first, first + count) of the sorted order
};

// The int8 activations of M rows of K inputs in groups of `group`, and their scales and sums.
struct Rounded {
  std::vector<float> floats;
  std::vector<int32_t> sums;
  std::vector<int8_t> q;
  Problem problem;  // its M rows against N outputs; weights unset (each expert sets its own)
  Rounded(int64_t M, int64_t N, int64_t K, int64_t group)
      : floats(M * (K / kBlock + K / group)), sums(M * (K / std::min(group, kBlock))), q(M * K), problem{M, N, K, group, nullptr, nullptr, nullptr, q.data(), floats.data(), nullptr, sums.data()} {
    problem.group_sum = problem.block_scale + M * (K / kBlock);
  }
};

// Round row m of the problem from x's row source[m] (row m itself where source is null).
// A decode step's few rows are rounded in the calling thread: forking would cost more.
template <typename In>
void round_rows(const Problem& p, const In* x, const int64_t* source) {
  at::parallel_for(0, p.M, std::max<int64_t>(1, (int64_t{1} << 16) / p.K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(p, x + (source ? source[m] : m) * p.K, m);
  });
}

// One stacked projection: its weights and their group size.
struct Stack {
  const uint8_t* packed;
  const uint16_t* scales;
  const uint16_t* offsets;  // or null (symmetric)
  int64_t group;
};

// y[route, :] = the route's expert's projection of the route's rounded input, for every route.
template <int Bits>
void experts_matmul(const Problem& all, const std::vector<Routed>& routed, const Stack& stack, float* y) {
  const int64_t count = all.N / 16, blocks = all.blocks(), groups = all.groups();
  std::vector<Problem> problems;
  for (const Routed& r : routed) {
    Problem p = all;
    p.M = r.count;
    p.packed = stack.packed + r.expert * count * (all.K / 8) * (16 * Bits);
    p.scales = stack.scales + r.expert * count * groups * 16;
    p.offsets = stack.offsets ? stack.offsets + r.expert * count * groups * 16 : nullptr;
    p.q += r.first * all.K;
    p.block_scale += r.first * blocks;
    p.code_sum += r.first * all.segments();
    p.group_sum += r.first * groups;
    problems.push_back(p);
  }
  at::parallel_for(0, static_cast<int64_t>(routed.size()) * count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t e = j / count, i = j % count;
      tiles<Bits, float>(problems[e], y + routed[e].first * all.N, i, i + 1);
    }
  });
}

// The weights' layout checked against x [T, H]: gate/up [E, 2I/16, H/8, chunk], down [E, H/16,
// I/8, chunk], each with bf16 scales [E, tiles, K/G, 16] (offsets: offsets_of). Returns I.
int64_t expert_shapes(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& gate_up_scales, int64_t gate_up_group, const at::Tensor& down, const at::Tensor& down_scales, int64_t down_group) {
  const char* name = "routed_experts";
  TORCH_CHECK(gate_up.scalar_type() == at::kByte && down.scalar_type() == at::kByte && gate_up.dim() == 4 && down.dim() == 4 && gate_up.size(3) == down.size(3) && (gate_up.size(3) == 64 || gate_up.size(3) == 128),
              name, ": uint8 packed experts [E, N/16, K/8, 64 or 128] of one width expected");
  TORCH_CHECK(gate_up.size(0) == down.size(0) && gate_up.is_contiguous() && down.is_contiguous(), name, ": gate/up and down stacks of the same experts, contiguous, expected");
  const int64_t H = x.size(1), I = gate_up.size(1) * 8;
  TORCH_CHECK(gate_up.size(2) * 8 == H && down.size(1) * 16 == H && down.size(2) * 8 == I, name, ": gate/up [E, 2I/16, H/8, .] and down [E, H/16, I/8, .] do not match x's width ", H);
  for (const auto& [K, group, scales] : {std::tuple{H, gate_up_group, &gate_up_scales}, std::tuple{I, down_group, &down_scales}}) {
    TORCH_CHECK(valid_group(group, K), name, ": group size ", group, " must be 32 or a multiple of 64 dividing ", K, ", itself a multiple of 64");
    TORCH_CHECK(scales->scalar_type() == at::kBFloat16 && scales->dim() == 4 && scales->size(2) == K / group && scales->size(3) == 16 && scales->is_contiguous(), name, ": contiguous bfloat16 scales [E, tiles, K/group, 16] expected");
  }
  TORCH_CHECK(gate_up_scales.size(0) == gate_up.size(0) && gate_up_scales.size(1) == gate_up.size(1) && down_scales.size(0) == down.size(0) && down_scales.size(1) == down.size(1), name, ": scales for every expert's tiles expected");
  return I;
}

// The routes sorted by expert (dropped ones, index E as transformers marks them, left out):
// each route's token and weight, and each chosen expert's span of them.
std::vector<Routed> sort_routes(const at::Tensor& chosen, const at::Tensor& weights, int64_t experts, std::vector<int64_t>& token, std::vector<float>& weight) {
  const int64_t T = chosen.size(0), k = chosen.size(1);
  const int64_t* index = chosen.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  std::vector<int64_t> count(experts + 1, 0);
  for (int64_t j = 0; j < T * k; ++j) {
    TORCH_CHECK(index[j] >= 0 && index[j] <= experts, "routed_experts: expert index ", index[j], " outside 0..", experts);
    ++count[index[j]];
  }
  std::vector<Routed> routed;
  int64_t first = 0;
  for (int64_t e = 0; e < experts; first += count[e], ++e) {
    if (count[e]) routed.push_back({e, first, count[e]});
  }
  token.resize(first);
  weight.resize(first);
  std::vector<int64_t> next(experts, 0);
  for (const Routed& r : routed) next[r.expert] = r.first;
  for (int64_t j = 0; j < T * k; ++j) {
    if (index[j] == experts) continue;
    const int64_t at = next[index[j]]++;
    token[at] = j / k;
    weight[at] = w[j];
  }
  return routed;
}

template <int Bits, typename Scalar>
at::Tensor experts_forward(const at::Tensor& x, const std::vector<Routed>& routed, const std::vector<int64_t>& token, const std::vector<float>& weight, const Stack& gate_up, const Stack& down, int64_t I, bool gelu) {
  const int64_t T = x.size(0), H = x.size(1), routes = static_cast<int64_t>(token.size());
  const auto floats = x.options().dtype(at::kFloat);
  Rounded inputs(routes, 2 * I, H, gate_up.group);
  round_rows(inputs.problem, x.data_ptr<Scalar>(), token.data());
  at::Tensor hidden = at::empty({routes, 2 * I}, floats);
  experts_matmul<Bits>(inputs.problem, routed, gate_up, hidden.data_ptr<float>());
  const at::Tensor gate = hidden.narrow(1, 0, I);
  at::Tensor activated = (gelu ? at::gelu(gate, "tanh") : at::silu(gate)).mul_(hidden.narrow(1, I, I));
  Rounded middle(routes, H, I, down.group);
  round_rows(middle.problem, activated.data_ptr<float>(), nullptr);
  at::Tensor out = at::empty({routes, H}, floats);
  experts_matmul<Bits>(middle.problem, routed, down, out.data_ptr<float>());
  at::Tensor y = at::zeros({T, H}, floats);
  float* yp = y.data_ptr<float>();
  const float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < routes; ++r) {
    float* row = yp + token[r] * H;
    for (int64_t h = 0; h < H; ++h) row[h] += weight[r] * op[r * H + h];
  }
  return y.to(x.scalar_type());
}

at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& gate_up_scales, const Optional& gate_up_offsets,
                          int64_t gate_up_group, const at::Tensor& down, const at::Tensor& down_scales, const Optional& down_offsets, int64_t down_group, c10::string_view activation) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "routed_experts: float32 or bfloat16 activations [T, H] expected");
  TORCH_CHECK(chosen.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && chosen.dim() == 2 && chosen.sizes() == weights.sizes() && chosen.size(0) == x.size(0),
              "routed_experts: int64 expert indices and float32 weights [T, k] expected");
  TORCH_CHECK(activation == "silu" || activation == "gelu_pytorch_tanh", "routed_experts: activation silu or gelu_pytorch_tanh expected");
  const int64_t I = expert_shapes(x, gate_up, gate_up_scales, gate_up_group, down, down_scales, down_group);
  std::vector<int64_t> token;
  std::vector<float> weight;
  const std::vector<Routed> routed = sort_routes(chosen.contiguous(), weights.contiguous(), gate_up.size(0), token, weight);
  const auto bf16 = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  const Stack up{gate_up.data_ptr<uint8_t>(), bf16(gate_up_scales), offsets_of("routed_experts", gate_up_offsets, gate_up_scales), gate_up_group};
  const Stack dn{down.data_ptr<uint8_t>(), bf16(down_scales), offsets_of("routed_experts", down_offsets, down_scales), down_group};
  const at::Tensor input = x.contiguous();
  const bool gelu = activation != "silu", int4 = gate_up.size(3) == 64;
  if (input.scalar_type() == at::kFloat) {
    return int4 ? experts_forward<4, float>(input, routed, token, weight, up, dn, I, gelu) : experts_forward<8, float>(input, routed, token, weight, up, dn, I, gelu);
  }
  return int4 ? experts_forward<4, at::BFloat16>(input, routed, token, weight, up, dn, I, gelu) : experts_forward<8, at::BFloat16>(input, routed, token, weight, up, dn, I, gelu);
}

}  // namespace

SLIMLM_LIBRARY(m) {
  m.def("int4_int8_mm(Tensor x, Tensor packed, Tensor scales, Tensor? offsets, int group_size, Tensor? lora_down=None, Tensor? lora_up=None, Tensor? lora_tiles=None) -> Tensor");
  m.def("int8_int8_mm(Tensor x, Tensor packed, Tensor scales, Tensor? offsets, int group_size, Tensor? lora_down=None, Tensor? lora_up=None, Tensor? lora_tiles=None) -> Tensor");
  m.def("routed_experts(Tensor x, Tensor chosen, Tensor weights, Tensor gate_up, Tensor gate_up_scales, Tensor? gate_up_offsets, int gate_up_group, Tensor down, Tensor down_scales, Tensor? down_offsets, int down_group, str activation) -> Tensor");
}

SLIMLM_LIBRARY_IMPL(CPU, m) {
  m.impl("int4_int8_mm", &int4_int8_mm);
  m.impl("int8_int8_mm", &int8_int8_mm);
  m.impl("routed_experts", &routed_experts);
}
