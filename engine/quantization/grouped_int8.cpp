// x W^T for W in 8-bit codes with a scale (and an optional offset) per group of 16 or 32 columns: GGUF's
// Q8_0, Q5_0, Q5_1 and Q6_K as they are, and 4-bit codes widened to bytes. The row is rounded to 16-bit integers
// per group (a step of its largest value / 32767, far below bf16's rounding), so that a group's dot product is
// exact in int32 (vpmaddwd, or VNNI's vpdpwssd) and only the group's sum meets the scales in float.
//
// Compiled on the machine that runs it, with -march=native (engine/quantization/native.py), so the #if branches
// below pick what this CPU has; the kernel chooser then measures it against PyTorch's own kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // columns one step reads: one group of 32, or two of 16

// The row's groups as int16 codes q with x ~ q * step; sums[g] = sum of the group's x (for the offsets).
void quantize_row(const float* x, int64_t k, int64_t padded_k, int64_t group, int16_t* q, float* step, float* sums) {
  for (int64_t g = 0; g * group < padded_k; ++g) {
    const int64_t start = g * group, stop = std::min(start + group, k);
    float amax = 0.f, sum = 0.f;
    for (int64_t i = start; i < stop; ++i) {
      amax = std::max(amax, std::fabs(x[i]));
      sum += x[i];
    }
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int64_t i = start; i < start + group; ++i) {
      q[i] = i < stop ? static_cast<int16_t>(std::nearbyint(x[i] * inv)) : 0;  // |q| <= 32767
    }
    step[g] = amax / 32767.f;
    sums[g] = sum;
  }
}

#if defined(__AVX2__)
// Eight int32 sums of pairs of products over 16 columns: a group of 32 never exceeds 32 * 32767 * 128 < 2^31.
inline __m256i dot16(const int16_t* q, const int8_t* w) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_madd_epi16(a, b);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// One output: sum over the row's groups of (scale * step) * (integer dot product).
inline float dot_row(const int8_t* w, const int16_t* q, const float* scale, const float* step, int64_t padded_k,
                     int64_t group) {
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < padded_k; b += kBlock) {
    const __m256i lo = dot16(q + b, w + b), hi = dot16(q + b + 16, w + b + 16);
    if (group == 32) {
      const int64_t g = b / 32;
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_set1_ps(scale[g] * step[g]), acc);
    } else {
      const int64_t g = b / 16;
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(scale[g] * step[g]), acc);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(scale[g + 1] * step[g + 1]), acc);
    }
  }
  return hsum(acc);
#else
  float total = 0.f;
  for (int64_t g = 0; g * group < padded_k; ++g) {
    int32_t d = 0;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) d += int32_t(w[i]) * int32_t(q[i]);
    total += scale[g] * step[g] * float(d);
  }
  return total;
#endif
}

#if defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr int64_t kRows = 4;  // outputs computed together: each 32 columns of the row is loaded once for all
#ifndef PAGODA_PREFETCH_BLOCKS
#define PAGODA_PREFETCH_BLOCKS 2
#endif
constexpr int64_t kPrefetchBlocks = PAGODA_PREFETCH_BLOCKS;

// kRows outputs (rows of W `stride` bytes apart, their scales `groups` apart) in 512-bit registers: one
// vpmaddwd takes a whole block of 32 columns, whose low eight sums are its first 16 columns.
inline void dot_rows(const int8_t* w, int64_t stride, const int16_t* q, const float* scale, int64_t groups,
                     const float* step, int64_t padded_k, int64_t group, float* out) {
  __m512 acc[kRows];
  for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < padded_k; b += kBlock) {
    const __m512i a = _mm512_loadu_si512(q + b);
    const int64_t g = b / group;
    for (int64_t r = 0; r < kRows; ++r) {
      // The same columns of the rows kPrefetchBlocks blocks on: a layer's weight comes from memory, not cache,
      // and the hardware's prefetcher alone left the kernel waiting on it (7-9 GB/s measured cold).
      if (b % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (r + kPrefetchBlocks * kRows) * stride + b),
                                    _MM_HINT_T0);
      const __m512i c = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * stride + b)));
      const __m512 d = _mm512_cvtepi32_ps(_mm512_madd_epi16(a, c));
      const float* s = scale + r * groups;
      const __m512 f = group == 32 ? _mm512_set1_ps(s[g] * step[g])
                                   : _mm512_insertf32x8(_mm512_set1_ps(s[g] * step[g]),
                                                        _mm256_set1_ps(s[g + 1] * step[g + 1]), 1);
      acc[r] = _mm512_fmadd_ps(d, f, acc[r]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#else
constexpr int64_t kRows = 1;

inline void dot_rows(const int8_t* w, int64_t, const int16_t* q, const float* scale, int64_t, const float* step,
                     int64_t padded_k, int64_t group, float* out) {
  out[0] = dot_row(w, q, scale, step, padded_k, group);
}
#endif

// x [M, K] float32; codes [N, P] int8 with P = K rounded up to 32 (zeros past K); scale and offset [N, P / group]
// float32; group 16 or 32. Returns [M, N] float32.
at::Tensor grouped_int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                           const std::optional<at::Tensor>& offset, int64_t group) {
  TORCH_CHECK(group == 16 || group == 32, "grouped_int8_mm: groups of 16 or 32 columns, not ", group);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(), "codes: int8 [N, P]");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0), padded_k = codes.size(1);
  TORCH_CHECK(padded_k % kBlock == 0 && padded_k >= k && padded_k - k < kBlock, "codes: K rounded up to 32 columns");
  const int64_t groups = padded_k / group;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.size(0) == n &&
                  scale.size(1) == groups, "scale: float32 [N, P / group]");
  const bool has_offset = offset.has_value() && offset->defined();
  if (has_offset) {
    TORCH_CHECK(offset->scalar_type() == at::kFloat && offset->is_contiguous() && offset->sizes() == scale.sizes(),
                "offset: like scale");
  }
  std::vector<int16_t> q(m * padded_k);
  std::vector<float> step(m * groups), sums(m * groups);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    quantize_row(xp + r * k, k, padded_k, group, q.data() + r * padded_k, step.data() + r * groups,
                 sums.data() + r * groups);
  }
  at::Tensor out = at::empty({m, n}, x.options());
  float* op = out.data_ptr<float>();
  const int8_t* wp = codes.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* fp = has_offset ? offset->data_ptr<float>() : nullptr;
  // Rows of W split across the threads; each row of W is read once for all M rows of x.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float y[kRows];
    for (int64_t j = begin; j < end; j += kRows) {
      const int64_t rows = std::min(kRows, end - j);
      for (int64_t r = 0; r < m; ++r) {
        const int16_t* qr = q.data() + r * padded_k;
        const float* st = step.data() + r * groups;
        if (rows == kRows) {
          dot_rows(wp + j * padded_k, padded_k, qr, sp + j * groups, groups, st, padded_k, group, y);
        } else {
          for (int64_t i = 0; i < rows; ++i) {
            y[i] = dot_row(wp + (j + i) * padded_k, qr, sp + (j + i) * groups, st, padded_k, group);
          }
        }
        for (int64_t i = 0; i < rows; ++i) {
          if (fp != nullptr) {
            const float* f = fp + (j + i) * groups;
            const float* sum = sums.data() + r * groups;
            for (int64_t g = 0; g < groups; ++g) y[i] += f[g] * sum[g];
          }
          op[r * n + j + i] = y[i];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pagoda_cpu, lib) {
  lib.def("grouped_int8_mm(Tensor x, Tensor codes, Tensor scale, Tensor? offset, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, lib) { lib.impl("grouped_int8_mm", &grouped_int8_mm); }
