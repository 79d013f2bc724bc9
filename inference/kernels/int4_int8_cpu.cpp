// int4 weights times int8 activations on x86 CPUs with AVX512-VNNI: the decode-time kernel.
//
// Why: torch's CPU int4 kernel turns the 4-bit codes into bf16 and multiplies in floating
// point; decoding at batch 1 is then bound by that conversion, not by memory. Rounding the
// activations to int8 per block of 64 inputs lets VPDPBUSD multiply codes by activations in
// int32 (as llama.cpp does for its Q4 formats), and a layout where the 16 lanes of a vector
// are 16 output rows applies each scale once per block for 16 rows instead of once per row.
//
// Layout (built by pack_int4 in inference/cpu_kernels.py), for tiles of 16 output rows:
//   packed  [N/16, K/8, 64] uint8: for inputs 8c .. 8c+7 of the tile, byte 4r+j holds row r's
//           input 8c+j in its low nibble and input 8c+4+j in its high nibble, so one 64-byte
//           load unpacks to two VPDPBUSD operands (4 inputs of 16 rows each)
//   scales  [N/16, K/G, 16] bfloat16: w = scale * code - offset for the G inputs of a group
//   offsets [N/16, K/G, 16] bfloat16: scale * zero point
// y[m, n] = sum_blocks scale * a_scale * dot(codes, a_int8) - sum_groups offset * sum(a)
// where a_scale is the 64-input block's absmax / 127 and sum(a) the exact sum of the group's inputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "the int4 x int8 kernel needs AVX512F, AVX512BW and AVX512-VNNI"
#endif

namespace {

constexpr int64_t kBlock = 64;  // inputs per activation block and per VNNI step

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

struct Problem {
  int64_t M, N, K, group;
  const uint8_t* packed;    // [N/16, K/8, 64]
  const uint16_t* scales;   // [N/16, K/group, 16] bf16 bits
  const uint16_t* offsets;  // [N/16, K/group, 16] bf16 bits
  int8_t* q;                // [M, K] activations rounded to int8
  float* block_scale;       // [M, K/64]
  float* group_sum;         // [M, K/group]
  int64_t blocks() const { return K / kBlock; }
  int64_t groups() const { return K / group; }
};

// Round each 64-input block of row m to int8 with its absmax scale; also sum each group exactly.
template <typename In>
void quantize_row(const Problem& p, const In* row, int64_t m) {
  const int64_t blocks = p.blocks();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 v[kBlock / 16];
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < kBlock / 16; ++i) {
      v[i] = load16(row + b * kBlock + i * 16);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
    }
    const float absmax = _mm512_reduce_max_ps(amax);
    const float scale = absmax > 0.f ? absmax / 127.f : 1.f;
    const __m512 inverse = _mm512_set1_ps(1.f / scale);
    for (int i = 0; i < kBlock / 16; ++i) {
      const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inverse));  // round to nearest even
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p.q + m * p.K + b * kBlock + i * 16), _mm512_cvtsepi32_epi8(rounded));
    }
    p.block_scale[m * blocks + b] = scale;
  }
  for (int64_t g = 0; g < p.groups(); ++g) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < p.group; i += 16) sum = _mm512_add_ps(sum, load16(row + g * p.group + i));
    p.group_sum[m * p.groups() + g] = _mm512_reduce_add_ps(sum);
  }
}

inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  return _mm512_set1_epi32(four);
}

// y[m0 .. m0+T, 16 rows of tile i]. Two int32 sums per token (even and odd groups of four
// inputs) keep two VPDPBUSD chains in flight.
template <int T, typename Out>
void tile(const Problem& p, Out* y, int64_t i, int64_t m0) {
  const int64_t blocks = p.blocks(), groups = p.groups(), per_group = p.group / kBlock;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const uint8_t* w = p.packed + i * (p.K / 8) * 64;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 w_scale = load_bf16x16(p.scales + (i * groups + g) * 16);
    const __m512 w_offset = load_bf16x16(p.offsets + (i * groups + g) * 16);
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m512i even[T], odd[T];
      for (int t = 0; t < T; ++t) even[t] = odd[t] = _mm512_setzero_si512();
      for (int64_t c = b * (kBlock / 8); c < (b + 1) * (kBlock / 8); ++c) {
        const __m512i bytes = _mm512_loadu_si512(w + c * 64);
        const __m512i first = _mm512_and_si512(bytes, low_nibbles);
        const __m512i second = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
        for (int t = 0; t < T; ++t) {
          const int8_t* a = p.q + (m0 + t) * p.K + c * 8;
          even[t] = _mm512_dpbusd_epi32(even[t], first, broadcast4(a));
          odd[t] = _mm512_dpbusd_epi32(odd[t], second, broadcast4(a + 4));
        }
      }
      for (int t = 0; t < T; ++t) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even[t], odd[t]));
        acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(w_scale, _mm512_set1_ps(p.block_scale[(m0 + t) * blocks + b])), acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) acc[t] = _mm512_fnmadd_ps(w_offset, _mm512_set1_ps(p.group_sum[(m0 + t) * groups + g]), acc[t]);
  }
  for (int t = 0; t < T; ++t) {
    alignas(64) float out[16];
    _mm512_store_ps(out, acc[t]);
    for (int r = 0; r < 16; ++r) y[(m0 + t) * p.N + i * 16 + r] = static_cast<Out>(out[r]);
  }
}

// Tiles [begin, end) against every activation row, four tokens at a time (each 64-byte
// weight load then feeds four tokens), the rest one by one.
template <typename Out>
void tiles(const Problem& p, Out* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    int64_t m0 = 0;
    for (; m0 + 4 <= p.M; m0 += 4) tile<4>(p, y, i, m0);
    for (; m0 < p.M; ++m0) tile<1>(p, y, i, m0);
  }
}

template <typename Scalar>
void run(Problem& p, const at::Tensor& x, at::Tensor& y) {
  const Scalar* xp = x.data_ptr<Scalar>();
  Scalar* yp = y.data_ptr<Scalar>();
  if (p.M == 1) {
    quantize_row(p, xp, 0);
  } else {
    at::parallel_for(0, p.M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) quantize_row(p, xp + m * p.K, m);
    });
  }
  at::parallel_for(0, p.N / 16, 1, [&](int64_t begin, int64_t end) { tiles(p, yp, begin, end); });
}

at::Tensor int4_int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && packed.scalar_type() == at::kByte, "int4_int8_mm: x [M, K] and uint8 packed weights expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int4_int8_mm: float32 or bfloat16 activations expected");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 64, "int4_int8_mm: packed weights [N/16, K/8, 64] expected");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * 8 == K && group_size > 0 && K % group_size == 0 && group_size % kBlock == 0, "int4_int8_mm: K=", K, " must match the packed width and be a multiple of the group size ", group_size, " (itself a multiple of 64)");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && offsets.scalar_type() == at::kBFloat16 && scales.dim() == 3 && scales.size(0) == N / 16 && scales.size(1) == K / group_size && scales.size(2) == 16 && offsets.sizes() == scales.sizes(), "int4_int8_mm: bfloat16 scales and offsets [N/16, K/group, 16] expected");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && offsets.is_contiguous(), "int4_int8_mm: contiguous weights expected");
  const at::Tensor input = x.contiguous();
  // The rounded activations and their block scales and group sums live in a per-thread scratch
  // that only grows: at batch 1 two allocations per call cost as much as a small layer's matmul.
  thread_local std::vector<float> scratch;
  const size_t floats = M * (K / kBlock + K / group_size);
  scratch.resize(std::max(scratch.size(), floats + (M * K + 3) / 4));
  at::Tensor y = at::empty({M, N}, x.options());
  Problem p{M, N, K, group_size, packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()),
            reinterpret_cast<const uint16_t*>(offsets.data_ptr<at::BFloat16>()), reinterpret_cast<int8_t*>(scratch.data() + floats), scratch.data(), nullptr};
  p.group_sum = p.block_scale + M * (K / kBlock);
  if (x.scalar_type() == at::kFloat) {
    run<float>(p, input, y);
  } else {
    run<at::BFloat16>(p, input, y);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(slimlm, m) {
  m.def("int4_int8_mm(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(slimlm, CPU, m) {
  m.impl("int4_int8_mm", &int4_int8_mm);
}
