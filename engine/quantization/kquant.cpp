// x W^T with W in GGUF's K-quant blocks exactly as the file stores them (issue 38): Q4_K (144 bytes per 256
// weights), Q5_K (176) and Q6_K (210); and the 32-value blocks Q8_0 (34 bytes) and MXFP4 (17, gpt-oss's experts). The weight stays at its file size; each thread unpacks one row of W at a
// time into a few KB of codes and per-16 scales, and multiplies it by every row of x.
//
// Every K-quant weight of a 256-block is w = dw * sc_j * u - mw * mn_j, u an unsigned code (Q4_K 0..15, Q5_K 0..31,
// Q6_K 0..63), sc_j and mn_j small integers per 16 columns (Q6_K: mn_j = sc_j, mw = 32 dw; Q4_K/Q5_K: per-32 scale
// and min, dw = d, mw = dmin). So with x rounded per block to int8 (x ~ dx * q, as llama.cpp's q8_K):
//   x . w = dx * (dw * sum_j sc_j * (u . q)_j - mw * sum_j mn_j * sum(q)_j)
// with (u . q) exact in integers: vpmaddubsw (u8 x s8 pairs, at most 2 * 63 * 127, no saturation) and vpmaddwd by
// the scales. Or x kept in float32 (act = 1): the codes are widened to float and the sums taken in float.
//
// Compiled on the machine that runs it (engine/quantization/kquant.py): -march=native, or an AVX2-only build
// (-march=haswell) forced by PAGODA_KQUANT_ISA=avx2; the #if branches pick the widest the build allows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef PAGODA_KQ_NS
#define PAGODA_KQ_NS pagoda_kquant
#endif

namespace {

constexpr int64_t QK = 256;
// Weight bytes read ahead of the block being multiplied. Decode streams weights from memory with little arithmetic
// between loads; left to the hardware prefetcher a thread read Q4_K at 5 GB/s where plain streaming reads 13
// (bench/RESULTS.md). 2 KB ahead measured best of 0.5-8 KB.
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_line(const uint8_t* blk) {
  _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes), _MM_HINT_T0);
}

// A K-quant block spans 3-4 cache lines; the 32-value blocks (34, 17 bytes) take prefetch_line each
inline void prefetch_block(const uint8_t* blk, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) prefetch_line(blk + line);
}
enum Kind : int64_t { kQ4K = 0, kQ5K = 1, kQ6K = 2, kQ80 = 3, kMXFP4 = 4, kQ40 = 5, kQ41 = 6 };
constexpr int64_t QK8 = 32;  // Q8_0's block: an fp16 scale and 32 int8 codes; MXFP4's: an exponent and 16 bytes

int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case kQ4K: return 144;
    case kQ5K: return 176;
    case kQ6K: return 210;
    case kQ80: return 34;
    case kMXFP4: return 17;
    case kQ40: return 18;
    case kQ41: return 20;
  }
  TORCH_CHECK(false, "kquant: unknown block kind ", kind);
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable conversion is a dozen, twice a block
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// One row of W unpacked: codes u[K], scales expanded to one int16 per pair of columns (scx[K/2], what vpmaddwd
// multiplies the pair sums by), the scale and min per 16 columns (sc16, mn16: K/16) and per block dw, mw.
struct Row {
  std::vector<uint8_t> u;
  std::vector<int16_t> scx, sc16, mn16;
  std::vector<float> dw, mw;
  explicit Row(int64_t k) : u(k), scx(k / 2), sc16(k / 16), mn16(k / 16), dw(k / QK), mw(k / QK) {}
};

inline void k4_scale_min(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void unpack_block(const uint8_t* b, int64_t kind, uint8_t* u, int16_t* sc16, int16_t* mn16, float& dw, float& mw) {
  if (kind == kQ6K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int half = 0; half < 2; ++half) {
      uint8_t* y = u + 128 * half;
      const uint8_t* l = ql + 64 * half;
      const uint8_t* h = qh + 32 * half;
      for (int i = 0; i < 32; ++i) {
        y[i] = (l[i] & 0xF) | ((h[i] & 3) << 4);
        y[i + 32] = (l[i + 32] & 0xF) | (((h[i] >> 2) & 3) << 4);
        y[i + 64] = (l[i] >> 4) | (((h[i] >> 4) & 3) << 4);
        y[i + 96] = (l[i + 32] >> 4) | (((h[i] >> 6) & 3) << 4);
      }
    }
    for (int j = 0; j < 16; ++j) sc16[j] = mn16[j] = sc[j];
    dw = d;
    mw = 32.f * d;
    return;
  }
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = kind == kQ5K ? b + 16 : nullptr;
  const uint8_t* ql = kind == kQ5K ? b + 48 : b + 16;
  for (int c = 0; c < 4; ++c) {  // 64 columns: 32 low nibbles, then 32 high ones
    const uint8_t* q = ql + 32 * c;
    uint8_t* y = u + 64 * c;
    for (int i = 0; i < 32; ++i) {
      y[i] = q[i] & 0xF;
      y[i + 32] = q[i] >> 4;
    }
    if (qh != nullptr) {
      for (int i = 0; i < 32; ++i) {
        y[i] |= ((qh[i] >> (2 * c)) & 1) << 4;
        y[i + 32] |= ((qh[i] >> (2 * c + 1)) & 1) << 4;
      }
    }
    for (int s = 0; s < 2; ++s) {
      int sc, m;
      k4_scale_min(2 * c + s, scales, sc, m);
      sc16[4 * c + 2 * s] = sc16[4 * c + 2 * s + 1] = static_cast<int16_t>(sc);
      mn16[4 * c + 2 * s] = mn16[4 * c + 2 * s + 1] = static_cast<int16_t>(m);
    }
  }
  dw = d;
  mw = dmin;
}

void unpack_row(const uint8_t* w, int64_t kind, int64_t k, Row& r) {
  const int64_t nb = k / QK, bytes = block_bytes(kind);
  for (int64_t b = 0; b < nb; ++b) {
    unpack_block(w + b * bytes, kind, r.u.data() + b * QK, r.sc16.data() + b * 16, r.mn16.data() + b * 16, r.dw[b],
                 r.mw[b]);
  }
  for (int64_t j = 0; j < k / 16; ++j) {
    for (int i = 0; i < 8; ++i) r.scx[8 * j + i] = r.sc16[j];
  }
}

// x rounded per 256-block: q (int8, |q| <= 127), dx (the step), bsum (the sum of q per 16 columns).
struct Q8Row {
  const int8_t* q;
  const float* dx;
  const int16_t* bsum;
};

void quantize_row(const float* x, int64_t k, int8_t* q, float* dx, int16_t* bsum) {
  for (int64_t b = 0; b < k / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t* qb = q + b * QK;
    for (int i = 0; i < QK; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += qb[16 * j + i];
      bsum[b * 16 + j] = static_cast<int16_t>(s);
    }
    dx[b] = amax / 127.f;
  }
}

#if defined(__AVX2__)
// Q4_K/Q5_K's 12 bytes of 6-bit scales and mins as 16 bytes: the eight scales, then the eight mins. Kept in
// registers: stored as four words and loaded as one vector, they would wait on a failed store forward every block.
inline __m128i k4_scales_mins(const uint8_t* p) {
  uint64_t lo;
  uint32_t t2;
  std::memcpy(&lo, p, 8);
  std::memcpy(&t2, p + 8, 4);
  const uint32_t t0 = static_cast<uint32_t>(lo), t1 = static_cast<uint32_t>(lo >> 32);
  const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  const uint64_t scales = (t0 & k1) | (static_cast<uint64_t>((t2 & k2) | (((t0 >> 6) & k3) << 4)) << 32);
  const uint64_t mins = (t1 & k1) | (static_cast<uint64_t>(((t2 >> 4) & k2) | (((t1 >> 6) & k3) << 4)) << 32);
  return _mm_set_epi64x(static_cast<int64_t>(mins), static_cast<int64_t>(scales));
}

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

float dot_q8(const Row& r, const Q8Row& x, int64_t k) {
  const int64_t nb = k / QK;
#if defined(__AVX512BW__) && defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  __m256 macc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* u = r.u.data() + b * QK;
    const int8_t* q = x.q + b * QK;
    const int16_t* scx = r.scx.data() + b * (QK / 2);
    __m512i isum = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i p = _mm512_maddubs_epi16(_mm512_loadu_si512(u + 64 * c), _mm512_loadu_si512(q + 64 * c));
      isum = _mm512_add_epi32(isum, _mm512_madd_epi16(p, _mm512_loadu_si512(scx + 32 * c)));
    }
    const __m256i mins = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsum + b * 16)),
                                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.mn16.data() + b * 16)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(r.dw[b] * x.dx[b]), acc);
    macc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(-r.mw[b] * x.dx[b]), macc);
  }
  return _mm512_reduce_add_ps(acc) + hsum256(macc);
#elif defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  __m256 macc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* u = r.u.data() + b * QK;
    const int8_t* q = x.q + b * QK;
    const int16_t* scx = r.scx.data() + b * (QK / 2);
    __m256i isum = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32 * c)),
                                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c)));
      isum = _mm256_add_epi32(
          isum, _mm256_madd_epi16(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scx + 16 * c))));
    }
    const __m256i mins = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsum + b * 16)),
                                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.mn16.data() + b * 16)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(r.dw[b] * x.dx[b]), acc);
    macc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(-r.mw[b] * x.dx[b]), macc);
  }
  return hsum256(_mm256_add_ps(acc, macc));
#else
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < 16; ++j) {
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) s += int32_t(r.u[b * QK + 16 * j + i]) * int32_t(x.q[b * QK + 16 * j + i]);
      isum += s * r.sc16[b * 16 + j];
      msum += int32_t(x.bsum[b * 16 + j]) * r.mn16[b * 16 + j];
    }
    total += x.dx[b] * (r.dw[b] * float(isum) - r.mw[b] * float(msum));
  }
  return total;
#endif
}

// x in float32: xsum is the sum of x per 16 columns.
float dot_f32(const Row& r, const float* x, const float* xsum, int64_t k) {
  const int64_t nb = k / QK;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  float mins = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 block = _mm512_setzero_ps();
    for (int j = 0; j < 16; ++j) {
      const int64_t at = b * QK + 16 * j;
      const __m512 w = _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.u.data() + at))));
      block = _mm512_fmadd_ps(_mm512_mul_ps(w, _mm512_loadu_ps(x + at)), _mm512_set1_ps(float(r.sc16[b * 16 + j])),
                              block);
      mins += r.mw[b] * float(r.mn16[b * 16 + j]) * xsum[b * 16 + j];
    }
    acc = _mm512_fmadd_ps(block, _mm512_set1_ps(r.dw[b]), acc);
  }
  return _mm512_reduce_add_ps(acc) - mins;
#elif defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    __m256 block = _mm256_setzero_ps();
    for (int j = 0; j < 16; ++j) {
      const int64_t at = b * QK + 16 * j;
      const __m256 s = _mm256_set1_ps(float(r.sc16[b * 16 + j]));
      for (int h = 0; h < 2; ++h) {
        const __m256 w = _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.u.data() + at + 8 * h))));
        block = _mm256_fmadd_ps(_mm256_mul_ps(w, _mm256_loadu_ps(x + at + 8 * h)), s, block);
      }
      mins += r.mw[b] * float(r.mn16[b * 16 + j]) * xsum[b * 16 + j];
    }
    acc = _mm256_fmadd_ps(block, _mm256_set1_ps(r.dw[b]), acc);
  }
  return hsum256(acc) - mins;
#else
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < 16; ++j) {
      float s = 0.f;
      for (int i = 0; i < 16; ++i) s += float(r.u[b * QK + 16 * j + i]) * x[b * QK + 16 * j + i];
      total += r.dw[b] * float(r.sc16[b * 16 + j]) * s - r.mw[b] * float(r.mn16[b * 16 + j]) * xsum[b * 16 + j];
    }
  }
  return total;
#endif
}

#if defined(__AVX512BW__) && defined(__AVX512F__)
#define PAGODA_KQ_FUSED 1
constexpr int64_t kMaxM = 16;  // rows of x one pass over a weight row serves

// Lane i of the int16 scale vector for 64 columns starting at sub-block 4c (of 16 columns) is sub-block 4c + i / 8:
// a pair sum of vpmaddubsw covers columns 2i, 2i + 1.
inline __m512i scale_index(int c) {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 32; ++i) idx[i] = static_cast<int16_t>(4 * c + i / 8);
  return _mm512_load_si512(idx);
}

// One weight row straight from its blocks, times up to kMaxM rows of x (rounded to int8): the codes of each block
// are unpacked in registers once for all rows.
void dot_fused(const uint8_t* w, int64_t kind, int64_t k, const Q8Row* xs, int64_t m, float* out) {
  static const __m512i idx0 = scale_index(0), idx1 = scale_index(1), idx2 = scale_index(2), idx3 = scale_index(3);
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const int64_t nb = k / QK, bytes = block_bytes(kind);
  __m512 acc[kMaxM];
  __m256 macc[kMaxM];
  for (int64_t r = 0; r < m; ++r) {
    acc[r] = _mm512_setzero_ps();
    macc[r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    prefetch_block(blk, bytes);
    __m512i u[4];
    __m256i sc16, mn16;  // per 16 columns
    float dw, mw;
    if (kind == kQ6K) {
      for (int h = 0; h < 2; ++h) {
        const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
        const __m256i qhh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const __m512i qhz = _mm512_inserti64x4(_mm512_castsi256_si512(qhh), _mm256_srli_epi16(qhh, 2), 1);
        // (a & 0x0F) | b in one vpternlogd (0xEC: a & c | b, c the mask); the high bits already at bits 4-5 of qhz
        // for the second half, shifted there for the first (what crosses bytes in the 16-bit shift is masked off)
        u[2 * h] = _mm512_ternarylogic_epi32(ql, _mm512_and_si512(_mm512_slli_epi16(qhz, 4), m30), m4, 0xEC);
        u[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), _mm512_and_si512(qhz, m30), m4, 0xEC);
      }
      sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      mn16 = sc16;
      dw = half_at(blk + 208);
      mw = 32.f * dw;
    } else {
      const __m128i sm = k4_scales_mins(blk + 4);
      const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
      sc16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, twice));
      mn16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_srli_si128(sm, 8), twice));
      dw = half_at(blk);
      mw = half_at(blk + 2);
      const uint8_t* ql = blk + (kind == kQ5K ? 48 : 16);
      __m512i qhz = _mm512_setzero_si512();
      if (kind == kQ5K) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
        qhz = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
      }
      for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * c));
        const __m256i lo = _mm256_and_si256(q, _mm512_castsi512_si256(m4));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm512_castsi512_si256(m4));
        u[c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        if (kind == kQ5K) {
          const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * c))),
                                                 _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1))), 1);
          const __mmask64 set = _mm512_test_epi8_mask(qhz, bit);
          u[c] = _mm512_mask_add_epi8(u[c], set, u[c], _mm512_set1_epi8(16));
        }
      }
    }
    const __m512i scz = _mm512_castsi256_si512(sc16);
    const __m512i s[4] = {_mm512_permutexvar_epi16(idx0, scz), _mm512_permutexvar_epi16(idx1, scz),
                          _mm512_permutexvar_epi16(idx2, scz), _mm512_permutexvar_epi16(idx3, scz)};
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* q = xs[r].q + b * QK;
      __m512i isum = _mm512_madd_epi16(_mm512_maddubs_epi16(u[0], _mm512_loadu_si512(q)), s[0]);
      for (int c = 1; c < 4; ++c) {
        isum = _mm512_add_epi32(isum,
                                _mm512_madd_epi16(_mm512_maddubs_epi16(u[c], _mm512_loadu_si512(q + 64 * c)), s[c]));
      }
      const __m256i mins =
          _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[r].bsum + b * 16)), mn16);
      const float dx = xs[r].dx[b];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dw * dx), acc[r]);
      macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(-mw * dx), macc[r]);
    }
  }
  for (int64_t r = 0; r < m; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) + hsum256(macc[r]);
}
#elif defined(__AVX2__)
#define PAGODA_KQ_FUSED 1
constexpr int64_t kMaxM = 16;

// The same in 256-bit registers: 32 columns a step, eight steps a block.
void dot_fused(const uint8_t* w, int64_t kind, int64_t k, const Q8Row* xs, int64_t m, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  // vpshufb patterns for step c % 4 of each half block: the low 128 bits take scale 2c, the high ones 2c + 1
  __m256i pick[4];
  for (int j = 0; j < 4; ++j) {
    pick[j] = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(((4 * j + 3) << 8) | (4 * j + 2))),
                               _mm_set1_epi16(static_cast<int16_t>(((4 * j + 1) << 8) | (4 * j))));
  }
  const int64_t nb = k / QK, bytes = block_bytes(kind);
  __m256 acc[kMaxM];
  for (int64_t r = 0; r < m; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    prefetch_block(blk, bytes);
    __m256i u[8];
    __m256i sc16, mn16;
    float dw, mw;
    if (kind == kQ6K) {
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        // each pair of high bits shifted to bits 4-5 (what the 16-bit shifts carry across bytes is masked off)
        u[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
        u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
      }
      sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      mn16 = sc16;
      dw = half_at(blk + 208);
      mw = 32.f * dw;
    } else {
      const __m128i sm = k4_scales_mins(blk + 4);
      const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
      sc16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, twice));
      mn16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_srli_si128(sm, 8), twice));
      dw = half_at(blk);
      mw = half_at(blk + 2);
      const uint8_t* ql = blk + (kind == kQ5K ? 48 : 16);
      const __m256i qh = kind == kQ5K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16))
                                      : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * c));
        u[2 * c] = _mm256_and_si256(q, m4);
        u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (kind == kQ5K) {
          const __m256i sixteen = _mm256_set1_epi8(16);
          const __m256i lo = _mm256_set1_epi8(static_cast<char>(1 << (2 * c)));
          const __m256i hi = _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1)));
          u[2 * c] = _mm256_or_si256(u[2 * c],
                                     _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, lo), lo), sixteen));
          u[2 * c + 1] = _mm256_or_si256(
              u[2 * c + 1], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, hi), hi), sixteen));
        }
      }
    }
    // Step c's 32 columns take scales 2c and 2c + 1 (one per 16): each half block's eight scales in both 128-bit
    // lanes, then one in-lane shuffle a step
    const __m256i first = _mm256_permute2x128_si256(sc16, sc16, 0x00), second = _mm256_permute2x128_si256(sc16, sc16, 0x11);
    __m256i s[8];
    for (int c = 0; c < 8; ++c) s[c] = _mm256_shuffle_epi8(c < 4 ? first : second, pick[c % 4]);
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* q = xs[r].q + b * QK;
      __m256i isum = _mm256_madd_epi16(
          _mm256_maddubs_epi16(u[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))), s[0]);
      for (int c = 1; c < 8; ++c) {
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(
                                          u[c], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c))),
                                                        s[c]));
      }
      const __m256i mins =
          _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[r].bsum + b * 16)), mn16);
      const float dx = xs[r].dx[b];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dw * dx), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(-mw * dx), acc[r]);
    }
  }
  for (int64_t r = 0; r < m; ++r) out[r] = hsum256(acc[r]);
}
#endif

// Q8_0: w = d * c per 32 columns, c int8; x rounded per 32 columns to int8 as llama.cpp's q8_0. A block's product
// is |c| times x's codes with c's sign (vpsignb), so vpmaddubsw takes it (pairs at most 2 * 128 * 127, no saturation).
//
// MXFP4 (OCP microscaling; gpt-oss's experts as GGUF stores them): per 32 columns an E8M0 exponent e, then 16 bytes of
// E2M1 codes, value j in the low nibble of byte j and value j + 16 in its high nibble. Doubled, the E2M1 values are
// the integers of kMxfp4Values (llama.cpp's kvalues_mxfp4), so w = 2^(e - 128) * c: a block is Q8_0's int8 codes
// (looked up with vpshufb) under a power-of-two scale, and takes Q8_0's product.
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128) for every exponent byte, built when the library loads (2^-128 and 2^-127 are float32 subnormals)
const std::vector<float> kMxfp4Scales = [] {
  std::vector<float> t(256);
  for (int i = 0; i < 256; ++i) t[i] = std::ldexp(1.0f, i - 128);
  return t;
}();

inline float mxfp4_scale(uint8_t e) { return kMxfp4Scales[e]; }

void quantize_row_q80(const float* x, int64_t k, int8_t* q, float* dx) {
  for (int64_t b = 0; b < k / QK8; ++b) {
    const float* xb = x + b * QK8;
    float amax = 0.f;
    for (int i = 0; i < QK8; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < QK8; ++i) q[b * QK8 + i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
    dx[b] = amax / 127.f;
  }
}

// Q4_0 and Q4_1: an fp16 scale d (Q4_1: and an fp16 min m), then 16 bytes of 4-bit codes, value i in byte i's low
// nibble and value i + 16 in its high one. A value is d * code - 8 * d (Q4_0) or d * code + m (Q4_1).
inline bool is_q4(int64_t kind) { return kind == kQ40 || kind == kQ41; }
inline float q4_offset(const uint8_t* blk, int64_t kind) {
  return kind == kQ41 ? half_at(blk + 2) : -8.f * half_at(blk);
}

// One 32-value block's int8 codes and scale: Q8_0's as stored, MXFP4's looked up, Q4_0's and Q4_1's 0..15 (their
// offset is q4_offset's).
inline float block32_codes(const uint8_t* blk, int64_t kind, int8_t* c) {
  if (kind == kQ80) {
    std::memcpy(c, blk + 2, QK8);
    return half_at(blk);
  }
  if (is_q4(kind)) {
    const uint8_t* packed = blk + (kind == kQ41 ? 4 : 2);
    for (int i = 0; i < 16; ++i) {
      c[i] = static_cast<int8_t>(packed[i] & 0x0F);
      c[i + 16] = static_cast<int8_t>(packed[i] >> 4);
    }
    return half_at(blk);
  }
  for (int i = 0; i < 16; ++i) {
    c[i] = kMxfp4Values[blk[1 + i] & 0x0F];
    c[i + 16] = kMxfp4Values[blk[1 + i] >> 4];
  }
  return mxfp4_scale(blk[0]);
}

// Any 32-value block kind, without vector instructions.
float dot_block32_scalar(const uint8_t* w, int64_t kind, const int8_t* q, const float* dx, int64_t nb) {
  const int64_t bytes = block_bytes(kind);
  float total = 0.f;
  int8_t c[QK8];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    const float d = block32_codes(blk, kind, c);
    int32_t s = 0, xs = 0;
    for (int i = 0; i < QK8; ++i) s += int32_t(c[i]) * int32_t(q[b * QK8 + i]), xs += q[b * QK8 + i];
    total += d * dx[b] * float(s);
    if (is_q4(kind)) total += q4_offset(blk, kind) * dx[b] * float(xs);
  }
  return total;
}

#if defined(__AVX2__)
// MXFP4's codes plus 12 (0..24, unsigned): vpmaddubsw's unsigned side, x's codes the signed one (pairs at most
// 2 * 24 * 127, no saturation). The 12 comes back as 12 * d * dx * sum(x) per block, from x's block sums.
constexpr int8_t kMxfp4Offset = 12;
constexpr int8_t kMxfp4Shifted[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

inline __m256i mxfp4_shifted_codes(const uint8_t* blk, __m128i table) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1));
  const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(packed, low4));
  const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(packed, 4), low4));
  return _mm256_set_m128i(hi, lo);  // values 0..15, then 16..31
}

// Q4_0's and Q4_1's codes 0..15 as they are: vpmaddubsw's unsigned side (pairs at most 2 * 15 * 127).
inline __m256i q4_codes(const uint8_t* packed) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
}

// A block's codes, its scale d, and what to take off per unit of xc (x's block sum, as block32_mm makes it):
// MXFP4's shift of 12 (xc already holds the 12), Q4_0's 8 (times d), Q4_1's min (added: taken off negated). Q8_0's
// codes are signed: vpmaddubsw takes their magnitudes, and each row of x takes their signs (vpsignb).
template <int64_t kKind>
struct Block32 {
  static constexpr int64_t bytes = kKind == kMXFP4 ? 17 : kKind == kQ41 ? 20 : kKind == kQ80 ? 34 : 18;
  static inline __m256i codes(const uint8_t* blk, __m128i table) {
    if constexpr (kKind == kQ80) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    if constexpr (kKind == kMXFP4) return mxfp4_shifted_codes(blk, table);
    return q4_codes(blk + (kKind == kQ41 ? 4 : 2));
  }
  static inline __m256i magnitudes(__m256i c) {
    if constexpr (kKind == kQ80) return _mm256_sign_epi8(c, c);
    return c;
  }
  static inline float scale(const uint8_t* blk) {
    if constexpr (kKind == kMXFP4) return mxfp4_scale(blk[0]);
    return half_at(blk);
  }
  static inline float correction(const uint8_t* blk, float d) {
    if constexpr (kKind == kQ80) return 0.f;
    if constexpr (kKind == kMXFP4) return d;
    return -q4_offset(blk, kKind);
  }
};

// One weight row of 32-value blocks (Q8_0, MXFP4, Q4_0, Q4_1) times `rows` (at most kRows) rows of x: each block's
// codes are unpacked once for all of them. xc[r * nb + b]: dx times the sum of x's block codes (MXFP4: times 12 too). Each
// row sums even and odd blocks apart, so that consecutive blocks' multiply-adds do not wait on each other; one path
// for any number of rows, so a row's result does not depend on the rows beside it (speculative decoding's checked
// rows must compute what plain decode steps would).
constexpr int64_t kRows = 8;
template <int64_t kKind, int64_t kFixedRows>
void dot_block32_rows_of(const uint8_t* w, const int8_t* q, const float* dx, const float* xc, int64_t k,
                          int64_t any_rows, float* out) {
  const int64_t rows = kFixedRows ? kFixedRows : any_rows;  // fixed at one row (decode): sums kept in registers
  using B = Block32<kKind>;
  constexpr int64_t bytes = B::bytes;
  const int64_t nb = k / QK8;
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Shifted));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 even[kRows], odd[kRows];
  float correction[kRows];
  for (int64_t r = 0; r < rows; ++r) even[r] = odd[r] = _mm256_setzero_ps(), correction[r] = 0.f;
  auto add = [&](__m256 acc, __m256i c, __m256i u, int64_t r, int64_t b, float d) {
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * k + b * QK8));
    if constexpr (kKind == kQ80) x = _mm256_sign_epi8(x, c);
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[r * nb + b]), acc);
  };
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    const uint8_t* blk = w + b * bytes;
    prefetch_line(blk);
    const __m256i c0 = B::codes(blk, table), c1 = B::codes(blk + bytes, table);
    const __m256i u0 = B::magnitudes(c0), u1 = B::magnitudes(c1);
    const float d0 = B::scale(blk), d1 = B::scale(blk + bytes);
    const float k0 = B::correction(blk, d0), k1 = B::correction(blk + bytes, d1);
    for (int64_t r = 0; r < rows; ++r) {
      even[r] = add(even[r], c0, u0, r, b, d0);
      odd[r] = add(odd[r], c1, u1, r, b + 1, d1);
      if constexpr (kKind != kQ80) correction[r] += k0 * xc[r * nb + b] + k1 * xc[r * nb + b + 1];
    }
  }
  for (; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    const __m256i c = B::codes(blk, table), u = B::magnitudes(c);
    const float d = B::scale(blk), kc = B::correction(blk, d);
    for (int64_t r = 0; r < rows; ++r) {
      even[r] = add(even[r], c, u, r, b, d);
      if constexpr (kKind != kQ80) correction[r] += kc * xc[r * nb + b];
    }
  }
  for (int64_t r = 0; r < rows; ++r) out[r] = hsum256(_mm256_add_ps(even[r], odd[r])) - correction[r];
}

template <int64_t kKind>
void dot_block32_rows(const uint8_t* w, const int8_t* q, const float* dx, const float* xc, int64_t k, int64_t rows,
                      float* out) {
  if (rows == 1) return dot_block32_rows_of<kKind, 1>(w, q, dx, xc, k, 1, out);
  dot_block32_rows_of<kKind, 0>(w, q, dx, xc, k, rows, out);
}
#endif

// x W^T for W in 32-value blocks (Q8_0, MXFP4, Q4_0, Q4_1), with x rounded per block to int8.
at::Tensor block32_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), nb = k / QK8, bytes = block_bytes(kind);
  TORCH_CHECK(k % QK8 == 0 && blocks.size(1) == nb * bytes, "blocks: ", nb, " blocks of ", bytes, " bytes per row");
  std::vector<int8_t> q(m * k);
  std::vector<float> dx(m * nb);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) quantize_row_q80(xp + r * k, k, q.data() + r * k, dx.data() + r * nb);
  at::Tensor out = at::empty({m, n}, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
#if defined(__AVX2__)
  {
    std::vector<float> xc(m * nb);  // Q8_0 has no offset to take off: zeros
    const float shift = kind == kMXFP4 ? float(kMxfp4Offset) : kind == kQ80 ? 0.f : 1.f;
    for (int64_t i = 0; i < m * nb; ++i) {
      int32_t sum = 0;
      for (int j = 0; j < QK8; ++j) sum += q[i * QK8 + j];
      xc[i] = shift * dx[i] * float(sum);
    }
    const auto dot_rows = kind == kQ80     ? dot_block32_rows<kQ80>
                          : kind == kMXFP4 ? dot_block32_rows<kMXFP4>
                          : kind == kQ40   ? dot_block32_rows<kQ40>
                                           : dot_block32_rows<kQ41>;
    at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
      float y[kRows];
      for (int64_t j = begin; j < end; ++j) {
        for (int64_t r0 = 0; r0 < m; r0 += kRows) {
          const int64_t rows = std::min(kRows, m - r0);
          dot_rows(wp + j * nb * bytes, q.data() + r0 * k, dx.data() + r0 * nb, xc.data() + r0 * nb, k, rows, y);
          for (int64_t r = 0; r < rows; ++r) op[(r0 + r) * n + j] = y[r];
        }
      }
    });
    return out;
  }
#else
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t r = 0; r < m; ++r) {
        op[r * n + j] = dot_block32_scalar(wp + j * nb * bytes, kind, q.data() + r * k, dx.data() + r * nb, nb);
      }
    }
  });
  return out;
#endif
}

// x [M, K] float32 (K a multiple of 256); blocks [N, K / 256 * bytes] uint8; act 0: x rounded to int8 per block,
// 1: x in float32. Returns [M, N] float32.
at::Tensor kquant_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t kind, int64_t act) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blocks: contiguous uint8 [N, row bytes]");
  if (kind == kQ80 || kind == kMXFP4 || is_q4(kind)) return block32_mm(x, blocks, kind);  // int8 activations whatever `act` says
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % QK == 0 && blocks.size(1) == k / QK * block_bytes(kind), "blocks: ", k / QK, " blocks per row");
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> q;
  std::vector<float> dx, xsum;
  std::vector<int16_t> bsum;
  if (act == 0) {
    q.resize(m * k);
    dx.resize(m * (k / QK));
    bsum.resize(m * (k / 16));
    for (int64_t r = 0; r < m; ++r) {
      quantize_row(xp + r * k, k, q.data() + r * k, dx.data() + r * (k / QK), bsum.data() + r * (k / 16));
    }
  } else {
    xsum.resize(m * (k / 16));
    for (int64_t i = 0; i < m * (k / 16); ++i) {
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += xp[16 * i + j];
      xsum[i] = s;
    }
  }
  at::Tensor out = at::empty({m, n}, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
#if defined(PAGODA_KQ_FUSED)
  if (act == 0) {
    std::vector<Q8Row> xs(m);
    for (int64_t r = 0; r < m; ++r) xs[r] = Q8Row{q.data() + r * k, dx.data() + r * (k / QK), bsum.data() + r * (k / 16)};
    at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
      float y[kMaxM];
      for (int64_t j = begin; j < end; ++j) {
        for (int64_t r0 = 0; r0 < m; r0 += kMaxM) {
          const int64_t rows = std::min(kMaxM, m - r0);
          dot_fused(wp + j * row_bytes, kind, k, xs.data() + r0, rows, y);
          for (int64_t r = 0; r < rows; ++r) op[(r0 + r) * n + j] = y[r];
        }
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    Row row(k);
    for (int64_t j = begin; j < end; ++j) {
      unpack_row(wp + j * row_bytes, kind, k, row);
      for (int64_t r = 0; r < m; ++r) {
        if (act == 0) {
          const Q8Row xr{q.data() + r * k, dx.data() + r * (k / QK), bsum.data() + r * (k / 16)};
          op[r * n + j] = dot_q8(row, xr, k);
        } else {
          op[r * n + j] = dot_f32(row, xp + r * k, xsum.data() + r * (k / 16), k);
        }
      }
    }
  });
  return out;
}

// One weight row of K-quant blocks times m (at most 16) rows of x rounded as quantize_row rounds them.
void row_dot(const uint8_t* w, int64_t kind, int64_t k, const Q8Row* xs, int64_t m, float* out, Row& scratch) {
#if defined(PAGODA_KQ_FUSED)
  (void)scratch;
  dot_fused(w, kind, k, xs, m, out);
#else
  unpack_row(w, kind, k, scratch);
  for (int64_t r = 0; r < m; ++r) out[r] = dot_q8(scratch, xs[r], k);
#endif
}

// Rows of float32 values rounded to int8 per 256 columns, and each row's Q8Row.
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int16_t> bsum;
  Q8Rows(const float* x, int64_t rows, int64_t k) : q(rows * k), dx(rows * (k / QK)), bsum(rows * (k / 16)) {
    for (int64_t r = 0; r < rows; ++r) {
      quantize_row(x + r * k, k, q.data() + r * k, dx.data() + r * (k / QK), bsum.data() + r * (k / 16));
    }
  }
  Q8Row row(int64_t r, int64_t k) const {
    return Q8Row{q.data() + r * k, dx.data() + r * (k / QK), bsum.data() + r * (k / 16)};
  }
};

// A mixture of experts' SwiGLU layer for a few tokens (decode) in one call, its weights K-quant blocks as a GGUF
// file stacks them: gate and up [experts * I, row bytes], down [experts * H, row bytes]. Each token's x is rounded
// once; the gate and up rows of every expert any token chose are one parallel pass, their activations rounded once,
// and the down rows one more pass: the per-expert calls it replaces each paid the threads' start and the host's
// glue (bench/RESULTS.md). x [T, H] float32 (T at most 16), ids [T, k] int64, weights [T, k] float32 -> [T, H].
at::Tensor kquant_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& gate,
                      const at::Tensor& up, const at::Tensor& down, int64_t gate_kind, int64_t up_kind,
                      int64_t down_kind, int64_t num_experts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [T, H]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && ids.sizes() == weights.sizes(),
              "ids int64 and weights float32, both [T, k]");
  const int64_t tokens = x.size(0), hidden = x.size(1), k = ids.size(1);
  const int64_t inter = gate.size(0) / num_experts;
  TORCH_CHECK(tokens <= 16, "kquant_moe serves at most 16 tokens a call");
  TORCH_CHECK(gate_kind <= kQ6K && up_kind <= kQ6K && down_kind <= kQ6K, "kquant_moe reads Q4_K, Q5_K and Q6_K only");
  TORCH_CHECK(hidden % QK == 0 && inter % QK == 0, "hidden and intermediate sizes must be multiples of 256");
  TORCH_CHECK(gate.size(0) == num_experts * inter && up.size(0) == gate.size(0) && down.size(0) == num_experts * hidden,
              "gate/up [experts * I, bytes] and down [experts * H, bytes]");
  const Q8Rows xq(x.data_ptr<float>(), tokens, hidden);
  const int64_t* id = ids.contiguous().data_ptr<int64_t>();
  // Each expert any token chose, and its (token, slot) pairs
  std::vector<std::vector<int64_t>> pairs_of(num_experts);
  for (int64_t p = 0; p < tokens * k; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "expert id out of range");
    pairs_of[id[p]].push_back(p);
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (!pairs_of[e].empty()) active.push_back(e);
  }
  const int64_t n_active = static_cast<int64_t>(active.size());
  std::vector<float> g(tokens * k * inter), u(tokens * k * inter), y(tokens * k * hidden);
  const uint8_t* gp = gate.data_ptr<uint8_t>();
  const uint8_t* upp = up.data_ptr<uint8_t>();
  const uint8_t* dp = down.data_ptr<uint8_t>();
  const int64_t gate_bytes = gate.size(1), up_bytes = up.size(1), down_bytes = down.size(1);
  at::parallel_for(0, n_active * 2 * inter, 16, [&](int64_t begin, int64_t end) {
    Row scratch(hidden);
    Q8Row xs[16];
    float out[16];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = active[i / (2 * inter)], which = (i / inter) % 2, r = i % inter;
      const std::vector<int64_t>& pairs = pairs_of[e];
      for (size_t j = 0; j < pairs.size(); ++j) xs[j] = xq.row(pairs[j] / k, hidden);
      const uint8_t* w = which == 0 ? gp + (e * inter + r) * gate_bytes : upp + (e * inter + r) * up_bytes;
      row_dot(w, which == 0 ? gate_kind : up_kind, hidden, xs, static_cast<int64_t>(pairs.size()), out, scratch);
      float* dst = which == 0 ? g.data() : u.data();
      for (size_t j = 0; j < pairs.size(); ++j) dst[pairs[j] * inter + r] = out[j];
    }
  });
  for (int64_t i = 0; i < tokens * k * inter; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];  // silu(gate) * up
  const Q8Rows hq(g.data(), tokens * k, inter);
  at::parallel_for(0, n_active * hidden, 16, [&](int64_t begin, int64_t end) {
    Row scratch(inter);
    Q8Row xs[16];
    float out[16];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = active[i / hidden], r = i % hidden;
      const std::vector<int64_t>& pairs = pairs_of[e];
      for (size_t j = 0; j < pairs.size(); ++j) xs[j] = hq.row(pairs[j], inter);
      row_dot(dp + (e * hidden + r) * down_bytes, down_kind, inter, xs, static_cast<int64_t>(pairs.size()), out, scratch);
      for (size_t j = 0; j < pairs.size(); ++j) y[pairs[j] * hidden + r] = out[j];
    }
  });
  at::Tensor result = at::zeros({tokens, hidden}, x.options());
  float* rp = result.data_ptr<float>();
  const float* wt = weights.contiguous().data_ptr<float>();
  for (int64_t p = 0; p < tokens * k; ++p) {  // in slot order per token
    const int64_t t = p / k;
    for (int64_t c = 0; c < hidden; ++c) rp[t * hidden + c] += wt[p] * y[p * hidden + c];
  }
  return result;
}

// The weight's rows in float32 [rows, K]: the reference, the looked-up rows of a tied table, and prefill's tiles.
at::Tensor kquant_dequant(const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blocks: contiguous uint8 [N, row bytes]");
  const int64_t n = blocks.size(0), bytes = block_bytes(kind);
  TORCH_CHECK(blocks.size(1) % bytes == 0, "blocks: whole blocks per row");
  if (kind == kQ80 || kind == kMXFP4 || is_q4(kind)) {
    const int64_t nb = blocks.size(1) / bytes;
    at::Tensor out = at::empty({n, nb * QK8}, blocks.options().dtype(at::kFloat));
    float* op = out.data_ptr<float>();
    const uint8_t* wp = blocks.data_ptr<uint8_t>();
    at::parallel_for(0, n * nb, 256, [&](int64_t begin, int64_t end) {
      int8_t c[QK8];
      for (int64_t b = begin; b < end; ++b) {
        const float d = block32_codes(wp + b * bytes, kind, c);
        const float offset = is_q4(kind) ? q4_offset(wp + b * bytes, kind) : 0.f;
        for (int i = 0; i < QK8; ++i) op[b * QK8 + i] = d * float(c[i]) + offset;
      }
    });
    return out;
  }
  const int64_t k = blocks.size(1) / bytes * QK;
  at::Tensor out = at::empty({n, k}, blocks.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    Row row(k);
    for (int64_t j = begin; j < end; ++j) {
      unpack_row(wp + j * blocks.size(1), kind, k, row);
      float* y = op + j * k;
      for (int64_t g = 0; g < k / 16; ++g) {  // 16 columns of one scale and min: vectorized by the compiler
        const float a = row.dw[g / 16] * float(row.sc16[g]), c = row.mw[g / 16] * float(row.mn16[g]);
        const uint8_t* u = row.u.data() + 16 * g;
        for (int i = 0; i < 16; ++i) y[16 * g + i] = a * float(u[i]) - c;
      }
    }
  });
  return out;
}

int64_t kquant_isa(const at::Tensor&) {
#if defined(__AVX512BW__) && defined(__AVX512F__)
  return 512;
#elif defined(__AVX2__)
  return 256;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY(PAGODA_KQ_NS, lib) {
  lib.def("kquant_mm(Tensor x, Tensor blocks, int kind, int act) -> Tensor");
  lib.def("kquant_dequant(Tensor blocks, int kind) -> Tensor");
  lib.def("kquant_isa(Tensor any) -> int");
  lib.def(
      "kquant_moe(Tensor x, Tensor ids, Tensor weights, Tensor gate, Tensor up, Tensor down, int gate_kind, "
      "int up_kind, int down_kind, int num_experts) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGODA_KQ_NS, CPU, lib) {
  lib.impl("kquant_mm", &kquant_mm);
  lib.impl("kquant_dequant", &kquant_dequant);
  lib.impl("kquant_isa", &kquant_isa);
  lib.impl("kquant_moe", &kquant_moe);
}
