// Attention of one query per sequence over the key/value cache, on x86 CPUs: a decode step's
// attention (inference/model.py), for an fp32 cache or an int8 one (codes and a scale per slot).
//
// Why: at a few thousand tokens of context a small model's decode step reads more cache than
// weights. Compiled by torch.compile the step's attention is one fused loop that read an fp32
// cache at a fraction of the memory bandwidth, and an int8 cache was dequantized into a float
// copy four times its size before it was read. This kernel reads each slot once, converts int8
// codes to floats in registers, and keeps a block's scores in the first-level cache.
//
// Inputs (views of the cache; the last dimension contiguous, every other stride honoured):
//   q         [B, H, 1, D] float32, bf16 or fp16: query heads kvh*G .. kvh*G+G-1 share key/value head kvh
//   k         [B, KVH, T, D] float32, or int8 codes with k_scales [B, KVH, T, 1] float32 (key = scale * code)
//   v         likewise, with v_scales for int8
//   mask      optional [B or 1, 1, 1, T] bool, false where a slot is not visible
//   rows      optional [B] int64: sequence b reads cache row rows[b], k and v (and their scales)
//             then being the whole cache [R, KVH, T, D] (continuous batching, whose sequences sit
//             in rows of their own: a gather of those rows would copy them every step)
// Output: [B, H, 1, D] float32, softmax(q . k * softmax_scale) . v per query head.
//
// The T slots of each key/value head are split into chunks so that two threads share even a
// single sequence's three heads; each chunk keeps its own running maximum, sum and weighted
// values, combined at the end (flash-decoding's split). 256-bit AVX2 with FMA throughout: every
// build of slimlm's CPU kernels has it, and this loop is bound by memory, not by vector width.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops_namespace.h"

namespace {

constexpr int64_t kSlots = 8;         // slots per vector of scores
constexpr int64_t kMinChunk = 64;     // fewest slots a thread's chunk is given
constexpr float kLowest = -87.3f;     // below this expf underflows to (sub)normals: taken as 0

// Eight cached values as floats: int8 codes converted (the scale is applied later), or floats.
inline __m256 load8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// exp for 8 floats: 2^n * exp(r) with n = round(x / ln 2) and |r| <= ln(2)/2, a degree-7
// Taylor polynomial for exp(r) (relative error below 1e-7); 0 below kLowest (and for -inf).
inline __m256 exp8(__m256 x) {
  const __m256 visible = _mm256_cmp_ps(x, _mm256_set1_ps(kLowest), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kLowest));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  // ln 2 in two parts (Cody-Waite)
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), visible);
}

// Lane j: the sum of the 8 lanes of v[j].
inline __m256 sum_each(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline float max_of(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)));
}

inline float sum_of(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
}

// One key/value head's cached vectors (and scales, for int8) for one sequence, and that sequence's mask.
template <typename T>
struct Head {
  const T* k;
  const float* k_scales;  // nullptr for a float cache
  const T* v;
  const float* v_scales;
  const bool* mask;  // nullptr: every slot visible
  int64_t k_stride, v_stride, k_scale_stride, v_scale_stride, mask_stride;  // between slots
};

// The part of one key/value head's attention over slots [begin, end): for each of the G queries
// q (already multiplied by the softmax scale), its largest score, the sum of exp(score - largest)
// and the values weighted by those exponentials (not yet divided by the sum).
struct Partial {
  float* largest;   // [G]
  float* total;     // [G]
  float* weighted;  // [G, D]
};

// Values weighted by each query's numerators, outputs d0 .. d0 + 8C of the G queries held in
// registers while each slot's values are loaded (and converted) once.
template <int G, int C, typename T>
void weigh_values(const float* numerators, int64_t padded, const Head<T>& h, int64_t begin, int64_t end, int64_t d0, int64_t dim, float* weighted) {
  __m256 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t s = begin; s < end; ++s) {
    const T* values = h.v + s * h.v_stride + d0;
    __m256 v[C];
    for (int c = 0; c < C; ++c) v[c] = load8(values + 8 * c);
    for (int g = 0; g < G; ++g) {
      const __m256 w = _mm256_broadcast_ss(numerators + g * padded + (s - begin));
      for (int c = 0; c < C; ++c) acc[g][c] = _mm256_fmadd_ps(w, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(weighted + g * dim + d0 + 8 * c, acc[g][c]);
}

template <int G, typename T>
void attend_chunk(const float* q, const Head<T>& h, int64_t dim, int64_t begin, int64_t end, Partial& out) {
  const int64_t padded = (end - begin + kSlots - 1) / kSlots * kSlots;
  thread_local std::vector<float> scores;  // [G, padded]: scores, then softmax numerators
  scores.resize(G * padded);
  // Scores, eight slots at a time: each slot's keys are loaded (and converted) once for all G queries.
  for (int64_t s0 = begin; s0 < end; s0 += kSlots) {
    const int64_t n = std::min(kSlots, end - s0);
    alignas(32) float scale[kSlots] = {0}, bias[kSlots];
    __m256 dots[G][kSlots];
    for (int64_t j = 0; j < kSlots; ++j) {
      const bool seen = j < n && (h.mask == nullptr || h.mask[(s0 + j) * h.mask_stride]);
      bias[j] = seen ? 0.f : -std::numeric_limits<float>::infinity();
      __m256 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
      if (seen) {  // a hidden slot's keys are not read: its score is exactly 0 * 0 - inf, whatever they hold
        scale[j] = h.k_scales ? h.k_scales[(s0 + j) * h.k_scale_stride] : 1.f;
        const T* keys = h.k + (s0 + j) * h.k_stride;
        for (int64_t d = 0; d < dim; d += 8) {
          const __m256 k = load8(keys + d);
          for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + d), k, acc[g]);
        }
      }
      for (int g = 0; g < G; ++g) dots[g][j] = acc[g];
    }
    for (int g = 0; g < G; ++g)
      _mm256_storeu_ps(&scores[g * padded + (s0 - begin)], _mm256_fmadd_ps(sum_each(dots[g]), _mm256_load_ps(scale), _mm256_load_ps(bias)));
  }
  // Softmax numerators, each folded with its slot's value scale if any (padding slots hold -inf: 0).
  for (int g = 0; g < G; ++g) {
    float* row = &scores[g * padded];
    __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t s = 0; s < padded; s += kSlots) top = _mm256_max_ps(top, _mm256_loadu_ps(row + s));
    const float largest = max_of(top);
    out.largest[g] = largest;
    if (largest == -std::numeric_limits<float>::infinity()) {  // nothing visible in this chunk
      std::fill_n(row, padded, 0.f);
      out.total[g] = 0.f;
      continue;
    }
    __m256 sum = _mm256_setzero_ps();
    for (int64_t s = 0; s < padded; s += kSlots) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + s), _mm256_set1_ps(largest)));
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(row + s, e);
    }
    out.total[g] = sum_of(sum);
    if (h.v_scales)
      for (int64_t s = begin; s < end; ++s) row[s - begin] *= h.v_scales[s * h.v_scale_stride];
  }
  constexpr int kWide = G <= 3 ? 4 : G <= 6 ? 2 : 1;  // 8-float vectors of outputs per pass: accumulators fit the registers
  int64_t d0 = 0;
  for (; d0 + 8 * kWide <= dim; d0 += 8 * kWide) weigh_values<G, kWide>(scores.data(), padded, h, begin, end, d0, dim, out.weighted);
  for (; d0 < dim; d0 += 8) weigh_values<G, 1>(scores.data(), padded, h, begin, end, d0, dim, out.weighted);
}

constexpr int kMaxGroup = 8;  // query heads per key/value head attended in one pass

// `count` (at most kMaxGroup) queries of one key/value head.
template <typename T>
void attend_group(int64_t count, const float* q, const Head<T>& h, int64_t dim, int64_t begin, int64_t end, Partial& out) {
  switch (count) {
    case 1: return attend_chunk<1>(q, h, dim, begin, end, out);
    case 2: return attend_chunk<2>(q, h, dim, begin, end, out);
    case 3: return attend_chunk<3>(q, h, dim, begin, end, out);
    case 4: return attend_chunk<4>(q, h, dim, begin, end, out);
    case 5: return attend_chunk<5>(q, h, dim, begin, end, out);
    case 6: return attend_chunk<6>(q, h, dim, begin, end, out);
    case 7: return attend_chunk<7>(q, h, dim, begin, end, out);
    default: return attend_chunk<8>(q, h, dim, begin, end, out);
  }
}

// Sequence b's key/value head kvh in cache row r, slots [begin, end), all its queries.
template <typename T>
void attend_head(const float* queries, int64_t groups, const at::Tensor& k, const std::optional<at::Tensor>& k_scales, const at::Tensor& v, const std::optional<at::Tensor>& v_scales, const std::optional<at::Tensor>& mask, int64_t b, int64_t r, int64_t kvh, int64_t begin, int64_t end, const Partial& p) {
  const auto scales_of = [&](const std::optional<at::Tensor>& scales) { return scales ? scales->data_ptr<float>() + r * scales->stride(0) + kvh * scales->stride(1) : nullptr; };
  const Head<T> head{
      k.data_ptr<T>() + r * k.stride(0) + kvh * k.stride(1), scales_of(k_scales), v.data_ptr<T>() + r * v.stride(0) + kvh * v.stride(1), scales_of(v_scales),
      mask ? mask->data_ptr<bool>() + (mask->size(0) == 1 ? 0 : b * mask->stride(0)) : nullptr,
      k.stride(2), v.stride(2), k_scales ? k_scales->stride(2) : 0, v_scales ? v_scales->stride(2) : 0, mask ? mask->stride(3) : 0};
  const int64_t dim = k.size(3);
  for (int64_t g = 0; g < groups; g += kMaxGroup) {  // more than 8 queries a head: its cache is read once per 8
    Partial part{p.largest + g, p.total + g, p.weighted + g * dim};
    attend_group(std::min<int64_t>(kMaxGroup, groups - g), queries + g * dim, head, dim, begin, end, part);
  }
}

// Over 80 lines because most of it is argument checks, one per input with its own message (the op
// is callable from Python with anything); the arithmetic is in the functions above.
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k, const std::optional<at::Tensor>& k_scales, const at::Tensor& v, const std::optional<at::Tensor>& v_scales, const std::optional<at::Tensor>& mask, double softmax_scale, const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.size(2) == 1, "decode_attention: q must be [batch, heads, 1, head_dim], got ", q_in.sizes());
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "decode_attention: keys and values must be [batch, kv_heads, slots, head_dim] of one shape and dtype");
  const bool codes = k.scalar_type() == at::kChar;
  TORCH_CHECK(codes || k.scalar_type() == at::kFloat, "decode_attention: the cache must be float32 or int8 codes, not ", k.scalar_type());
  const int64_t batch = q_in.size(0), heads = q_in.size(1), dim = q_in.size(3);
  const int64_t cache_rows = k.size(0), kv_heads = k.size(1), slots = k.size(2);
  std::vector<int64_t> row_of(batch);  // the cache row each sequence reads
  if (rows) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->size(0) == batch, "decode_attention: rows must be int64 [batch]=[", batch, "], one cache row per sequence, got ", rows->scalar_type(), " ", rows->sizes());
    const at::Tensor indices = rows->contiguous();
    for (int64_t b = 0; b < batch; ++b) {
      row_of[b] = indices.data_ptr<int64_t>()[b];
      TORCH_CHECK(row_of[b] >= 0 && row_of[b] < cache_rows, "decode_attention: rows[", b, "]=", row_of[b], " is not one of the cache's ", cache_rows, " rows");
    }
  } else {
    for (int64_t b = 0; b < batch; ++b) row_of[b] = b;
  }
  TORCH_CHECK(rows || cache_rows == batch, "decode_attention: ", batch, " sequences but ", cache_rows, " cache rows: without rows, sequence b reads cache row b");
  TORCH_CHECK(k.size(3) == dim && kv_heads > 0 && heads % kv_heads == 0, "decode_attention: q ", q_in.sizes(), " does not match the cache's ", k.sizes(), " (a whole number of query heads per key/value head)");
  TORCH_CHECK(dim % 8 == 0, "decode_attention: head_dim must be a multiple of 8, not ", dim);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: each key and value vector must be contiguous (strides ", k.strides(), " and ", v.strides(), ")");
  for (const auto* scales : {&k_scales, &v_scales}) {
    TORCH_CHECK(scales->has_value() == codes, "decode_attention: int8 codes need float32 scales [cache rows, kv_heads, slots, 1], a float cache none");
    if (codes) TORCH_CHECK((*scales)->scalar_type() == at::kFloat && (*scales)->dim() == 4 && (*scales)->size(0) == cache_rows && (*scales)->size(1) == kv_heads && (*scales)->size(2) == slots && (*scales)->size(3) == 1, "decode_attention: int8 codes need float32 scales [cache rows, kv_heads, slots, 1]=[", cache_rows, ", ", kv_heads, ", ", slots, ", 1], got ", (*scales)->scalar_type(), " ", (*scales)->sizes());
  }
  if (mask) TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(1) == 1 && mask->size(2) == 1 && mask->size(3) == slots && (mask->size(0) == 1 || mask->size(0) == batch), "decode_attention: mask must be bool [batch or 1, 1, 1, slots]=[", batch, ", 1, 1, ", slots, "] (one for all heads), got ", mask->scalar_type(), " ", mask->sizes());
  // The queries as contiguous floats times the softmax scale: [B, H, D].
  std::vector<float> q(batch * heads * dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q_in.scalar_type(), "decode_attention", [&] {
    const scalar_t* source = q_in.data_ptr<scalar_t>();
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d) q[(b * heads + h) * dim + d] = static_cast<float>(source[b * q_in.stride(0) + h * q_in.stride(1) + d * q_in.stride(3)]) * static_cast<float>(softmax_scale);
  });
  at::Tensor result = at::empty({batch, heads, 1, dim}, q_in.options().dtype(at::kFloat));
  if (result.numel() == 0) return result;  // no sequences or no heads: nothing to attend
  const int64_t groups = heads / kv_heads;
  // Chunks per head: enough work items for every thread, none under kMinChunk slots.
  const int64_t items_wanted = 2 * at::get_num_threads();
  const int64_t chunks = std::max<int64_t>(1, std::min((items_wanted + batch * kv_heads - 1) / (batch * kv_heads), slots / kMinChunk));
  const int64_t chunk = (slots + chunks - 1) / chunks;
  const int64_t items = batch * kv_heads * chunks, per_item = groups * (dim + 2);
  std::vector<float> partial_floats(items * per_item);
  std::vector<Partial> partials(items);
  for (int64_t i = 0; i < items; ++i) {
    float* p = &partial_floats[i * per_item];
    partials[i] = {p, p + groups, p + 2 * groups};
  }
  at::parallel_for(0, items, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / (kv_heads * chunks), kvh = item / chunks % kv_heads, c = item % chunks;
      const int64_t begin = c * chunk, end = std::min(slots, begin + chunk);
      if (begin >= end) {
        std::fill_n(partials[item].largest, groups, -std::numeric_limits<float>::infinity());
        continue;
      }
      const float* queries = q.data() + (b * heads + kvh * groups) * dim;
      if (codes)
        attend_head<int8_t>(queries, groups, k, k_scales, v, v_scales, mask, b, row_of[b], kvh, begin, end, partials[item]);
      else
        attend_head<float>(queries, groups, k, k_scales, v, v_scales, mask, b, row_of[b], kvh, begin, end, partials[item]);
    }
  });
  // Combine each head's chunks: rescale each to the head's largest score, then divide by the total.
  float* out = result.data_ptr<float>();
  for (int64_t bh = 0; bh < batch * kv_heads; ++bh)
    for (int64_t g = 0; g < groups; ++g) {
      float largest = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) largest = std::max(largest, partials[bh * chunks + c].largest[g]);
      float* row = out + (bh * groups + g) * dim;
      std::fill_n(row, dim, 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const Partial& p = partials[bh * chunks + c];
        if (p.largest[g] == -std::numeric_limits<float>::infinity()) continue;
        const float factor = std::exp(p.largest[g] - largest);
        total += factor * p.total[g];
        for (int64_t d = 0; d < dim; ++d) row[d] += factor * p.weighted[g * dim + d];
      }
      const float inverse = total > 0.f ? 1.f / total : 0.f;
      for (int64_t d = 0; d < dim; ++d) row[d] *= inverse;
    }
  return result;
}

}  // namespace

SLIMLM_LIBRARY_FRAGMENT(m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor? k_scales, Tensor v, Tensor? v_scales, Tensor? mask, float softmax_scale, Tensor? rows=None) -> Tensor");
}

SLIMLM_LIBRARY_IMPL(CPU, m) { m.impl("decode_attention", &decode_attention); }
