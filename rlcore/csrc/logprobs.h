// Per-row log-softmax statistics of logits [..., V] in one read of the logits: the CPU kernels
// behind rlcore.logprobs.token_logprobs and rlcore.logprobs.entropy_from_logits.
//
// This file is compiled once per instruction set (logprobs_default.cpp, logprobs_avx2.cpp,
// logprobs_avx512.cpp, logprobs_avx512bf16.cpp; flags in rlcore/_kernel_build.py) into a plain
// shared library: loading it (torch.ops.load_library) runs the registrations at the end of this
// file, and it needs no Python headers. rlcore/_kernels.py loads the best build the CPU runs.
//
// A row is read in blocks of kBlock elements (8 KB of float32: L1-resident). Per block: its
// maximum, then Σ exp((x − m)/τ) against the running maximum m, the running sums rescaled by
// exp((m_old − m_new)/τ) when the maximum grows (Milakov & Gimelshein, "Online normalizer
// calculation for softmax", arXiv:1805.02867). Statistics are float32 for float32, bfloat16 and
// float16 logits. Shifting by the row maximum keeps (x − m)/τ ≤ 0 for logits anywhere in the
// float range, so nothing overflows; log p is clamped to ≤ 0 against the rounding of the sums.
//
// Saved per row for the backward: the shift m and lse = log Σ exp((x − m)/τ), so that
// log p_v = (x_v − m)/τ − lse is recomputed from the logits in the same single pass that writes
// the gradient.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace rlcore_kernels {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 2048;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kLowest = std::numeric_limits<float>::lowest();

// Two float vectors' worth of elements per step, for float32 and the 16-bit types alike.
template <typename T>
struct Io {
  using VecT = at::vec::Vectorized<T>;
  static_assert(VecT::size() == 2 * Vec::size(), "a 16-bit vector holds two float vectors");
  static constexpr int64_t kStep = VecT::size();
  static inline void load(const T* p, Vec& a, Vec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(VecT::loadu(p));
  }
  static inline void store(T* p, const Vec& a, const Vec& b) {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
};

template <>
struct Io<float> {
  static constexpr int64_t kStep = 2 * Vec::size();
  static inline void load(const float* p, Vec& a, Vec& b) {
    a = Vec::loadu(p);
    b = Vec::loadu(p + Vec::size());
  }
  static inline void store(float* p, const Vec& a, const Vec& b) {
    a.store(p);
    b.store(p + Vec::size());
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// bfloat16 on AVX-512: a bfloat16 is the high half of a float32, so 32 of them widen by two
// interleaves with zero (2 instructions where ATen's conversion takes 6). The interleave permutes
// the values within each 128-bit lane, which sums and maxima do not see and elementwise results
// undo: the store rounds to nearest even and packs with the inverse interleave.
template <>
struct Io<c10::BFloat16> {
  static constexpr int64_t kStep = 2 * Vec::size();
  static inline void load(const c10::BFloat16* p, Vec& a, Vec& b) {
    const __m512i v = _mm512_loadu_si512(p), zero = _mm512_setzero_si512();
    a = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v));
    b = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v));
  }
  static inline __m512i round(const Vec& f) {  // float32 → bfloat16 bits in the low half, NaN kept
    const __m512i i = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(0x7fff)), lsb), 16);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_ORD_Q), _mm512_set1_epi32(0x7fc0), r);
  }
#if defined(__AVX512BF16__)
  // the avx512bf16 build: one instruction rounds 32 floats (nearest even; float32 denormals, below
  // 1.2e-38, become 0), a permutation puts them back in place
  static inline void store(c10::BFloat16* p, const Vec& a, const Vec& b) {
    alignas(64) static constexpr int16_t kOrder[32] = {0,  1,  2,  3,  16, 17, 18, 19, 4,  5,  6,
                                                       7,  20, 21, 22, 23, 8,  9,  10, 11, 24, 25,
                                                       26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    const __m512i w = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));  // a → 0..15, b → 16..31
    _mm512_storeu_si512(p, _mm512_permutexvar_epi16(_mm512_load_si512(kOrder), w));
  }
#else
  static inline void store(c10::BFloat16* p, const Vec& a, const Vec& b) {
    _mm512_storeu_si512(p, _mm512_packus_epi32(round(a), round(b)));
  }
#endif
};
#endif

// Exponentials are most of the arithmetic (SLEEF's 1-ulp exp made the forward compute-bound).
// They are taken of u = (x − m)·k with k = kUnit/τ: exp_u(u) = e^{u/kUnit} = e^{(x − m)/τ}, for
// u ≤ 0 (every argument here is), within 4e-7 of the exact value relative to the row's largest
// term, and 0 where e^{(x − m)/τ} < 1.2e-38 (a −inf logit gets exactly 0).
#if defined(CPU_CAPABILITY_AVX512)
// u in log2 units (kUnit = log2 e): 2^u = 2^n·2^r, n = round(u), |r| ≤ 1/2, 2^r by ATen's exp_u20
// polynomial (degree 5, coefficients a_k·ln2^k), 2^n applied by vscalefps, whose mask zeroes the
// lanes below 2^-126 (NaN passes): 9 instructions where exp_u20 takes 17 and a multiply.
constexpr float kUnit = 1.44269504f;
inline Vec exp_u(const Vec& v) {
  const __m512 u = v;
  const __mmask16 keep = _mm512_cmp_ps_mask(u, _mm512_set1_ps(-126.f), _CMP_NLT_UQ);
  const __m512 n = _mm512_roundscale_ps(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(u, n);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.32630886e-3f), _mm512_set1_ps(9.67148789e-3f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(5.55073904e-2f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.240222426f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.693146973f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}
// The block maximum without NaN bookkeeping: a NaN logit reaches the sums through exp_u instead.
inline Vec vmax(const Vec& a, const Vec& b) { return _mm512_max_ps(a, b); }
#else
constexpr float kUnit = 1.f;
inline Vec exp_u(const Vec& u) { return u.exp_u20(); }  // 2^n built in the exponent bits
inline Vec vmax(const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }  // NaN propagates
#endif

inline float max_nan(float a, float b) { return (b > a || std::isnan(b)) ? b : a; }

// Running statistics of one row: shift m, s = Σ e^{x'}, t = Σ e^{x'}·max(u, lowest) with
// x' = (x − m)/τ, u = x'·kUnit (t only for the entropy: Σ p·x' = t/(s·kUnit)).
struct Stats {
  float m = -kInf, s = 0.f, t = 0.f;
};

template <typename T, bool kEntropy>
inline Stats row_stats(const T* x, int64_t V, float inv_t) {
  constexpr int64_t kStep = Io<T>::kStep;
  Stats st;
  const Vec vlow(kLowest), vk(kUnit * inv_t);
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    const int64_t len = std::min(kBlock, V - b0);
    const T* xb = x + b0;
    Vec vm0(-kInf), vm1(-kInf);
    int64_t j = 0;
    for (; j + kStep <= len; j += kStep) {
      Vec a, b;
      Io<T>::load(xb + j, a, b);
      vm0 = vmax(vm0, a);
      vm1 = vmax(vm1, b);
    }
    float bm = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return at::vec::maximum(p, q); },
                                              at::vec::maximum(vm0, vm1));
    for (; j < len; ++j) bm = max_nan(bm, static_cast<float>(xb[j]));
    if (bm > st.m || std::isnan(bm)) {  // a new maximum: rescale what was summed against the old one
      if (st.s != 0.f) {
        const float d = (st.m - bm) * inv_t;  // ≤ 0
        const float a = std::exp(d);
        if (a == 0.f) {
          st.s = st.t = 0.f;
        } else {
          if (kEntropy) st.t = a * (st.t + d * kUnit * st.s);
          st.s *= a;
        }
      }
      st.m = bm;
    }
    if (st.m == -kInf) continue;  // every logit so far is −inf: nothing to add
    const Vec vsh(st.m);
    Vec vs0(0.f), vs1(0.f), vt0(0.f), vt1(0.f);
    for (j = 0; j + kStep <= len; j += kStep) {
      // fetch the next block while this one's exponentials are computed (a hint: past the end it
      // is dropped); the hardware prefetcher alone left the arithmetic and the reads in turns
      for (int64_t o = 0; o < kStep * int64_t(sizeof(T)); o += 64)
        __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(xb + j) + kBlock * sizeof(T) + o));
      Vec a, b;
      Io<T>::load(xb + j, a, b);
      const Vec ua = (a - vsh) * vk, ub = (b - vsh) * vk;
      const Vec ea = exp_u(ua), eb = exp_u(ub);
      vs0 = vs0 + ea;
      vs1 = vs1 + eb;
      if (kEntropy) {
        vt0 = at::vec::fmadd(ea, at::vec::maximum(ua, vlow), vt0);
        vt1 = at::vec::fmadd(eb, at::vec::maximum(ub, vlow), vt1);
      }
    }
    float s = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, vs0 + vs1);
    float t = kEntropy ? at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, vt0 + vt1) : 0.f;
    for (; j < len; ++j) {
      const float xv = (static_cast<float>(xb[j]) - st.m) * inv_t;
      const float e = std::exp(xv);
      s += e;
      if (kEntropy) t += e * std::max(xv * kUnit, kLowest);
    }
    st.s += s;
    st.t += t;
  }
  return st;
}

// The rows of logits [..., V] (last dim contiguous, any strides before it) as pointers.
template <typename T>
struct Rows {
  const T* base;
  std::vector<int64_t> sizes, strides;  // leading dims, innermost first
  explicit Rows(const at::Tensor& logits) : base(logits.const_data_ptr<T>()) {
    for (int64_t d = logits.dim() - 2; d >= 0; --d) {
      sizes.push_back(logits.size(d));
      strides.push_back(logits.stride(d));
    }
  }
  inline const T* operator[](int64_t r) const {
    int64_t off = 0;
    for (size_t d = 0; d < sizes.size(); ++d) {
      off += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return base + off;
  }
};

inline int64_t grain(int64_t V) { return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(V, 1)); }

inline void check_logits(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), "logits: expected a CPU tensor");
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) > 0, "logits: expected shape [..., V] with V > 0");
  TORCH_CHECK(logits.stride(-1) == 1 || logits.size(-1) == 1, "logits: expected a contiguous last dim");
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "logits: expected float32, bfloat16 or float16, got ", dt);
}

inline void check_rows(const at::Tensor& t, int64_t n, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.numel() == n && t.is_contiguous() && t.scalar_type() == dtype, name,
              ": expected a contiguous [N] tensor of ", dtype, " (N = ", n, ")");
}

// A fresh gradient buffer is hundreds of MB of untouched pages: the page faults on first write
// cost more than the kernel's arithmetic (4 KB pages: 290 ms to allocate and fill 524 MB on the
// benchmark machine, 2 MB pages: 85 ms). Ask for huge pages on the 2 MB-aligned part of the buffer
// (a hint; Linux only, ignored where transparent huge pages are off).
inline at::Tensor fresh_like(const at::Tensor& logits) {
  at::Tensor out = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const auto begin = reinterpret_cast<uintptr_t>(out.data_ptr());
  const uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1), hi = (begin + out.nbytes()) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#endif
  return out;
}

inline int64_t rows_of(const at::Tensor& logits) { return logits.numel() / logits.size(-1); }

#define RLCORE_DISPATCH(dtype, ...)                                  \
  switch (dtype) {                                                   \
    case at::kFloat: { using T = float; __VA_ARGS__(); break; }      \
    case at::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__(); break; } \
    default: { using T = c10::Half; __VA_ARGS__(); break; }          \
  }

// --- token log-probs --------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> logprobs_fwd(const at::Tensor& logits, const at::Tensor& labels,
                                                            double temperature) {
  check_logits(logits);
  const int64_t n = rows_of(logits), V = logits.size(-1);
  check_rows(labels, n, at::kLong, "labels");
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor out = at::empty({n}, opts), shift = at::empty({n}, opts), lse = at::empty({n}, opts);
  const float inv_t = static_cast<float>(1.0 / temperature);
  const int64_t* y = labels.const_data_ptr<int64_t>();
  float *po = out.data_ptr<float>(), *pm = shift.data_ptr<float>(), *pl = lse.data_ptr<float>();
  RLCORE_DISPATCH(logits.scalar_type(), [&] {
    const Rows<T> rows(logits);
    at::parallel_for(0, n, grain(V), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* x = rows[r];
        const Stats st = row_stats<T, false>(x, V, inv_t);
        const float l = std::log(st.s), xy = static_cast<float>(x[y[r]]);
        // in double: x_y − m may pass the float range (−3e38 − 3e38) where (x_y − m)/τ does not
        float lp = static_cast<float>((static_cast<double>(xy) - st.m) / temperature - l);
        // log p ≤ 0; a finite label logit further below the maximum than the float range
        // reaches gives the largest negative value, a −inf one (masked vocabulary) −inf
        lp = lp > 0.f ? 0.f : (lp < kLowest && xy != -kInf ? kLowest : lp);
        po[r] = lp;
        pm[r] = st.m;
        pl[r] = l;
      }
    });
  });
  return {out, shift, lse};
}

// The frame both backward kernels share: a fresh gradient and, per row r, its logits x, its
// gradient row g and the row's c = grad_r/τ, shift m and log-normaliser l; `row(x, g, r, c, m, l)`
// writes g (its element type T: the logits').
template <typename Row>
at::Tensor backward_rows(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& shift,
                         const at::Tensor& lse, double temperature, const Row& row) {
  const int64_t n = rows_of(logits), V = logits.size(-1);
  for (auto [t, name] : {std::pair{&grad, "grad"}, {&shift, "shift"}, {&lse, "lse"}}) check_rows(*t, n, at::kFloat, name);
  at::Tensor out = fresh_like(logits);
  const float tau = static_cast<float>(temperature);
  const float *pg = grad.const_data_ptr<float>(), *pm = shift.const_data_ptr<float>(),
              *pl = lse.const_data_ptr<float>();
  RLCORE_DISPATCH(logits.scalar_type(), [&] {
    const Rows<T> rows(logits);
    T* base = out.data_ptr<T>();
    at::parallel_for(0, n, grain(V), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) row(rows[r], base + r * V, r, pg[r] / tau, pm[r], pl[r]);
    });
  });
  return out;
}

at::Tensor logprobs_bwd(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& labels,
                        const at::Tensor& shift, const at::Tensor& lse, double temperature) {
  check_logits(logits);
  const int64_t V = logits.size(-1);
  check_rows(labels, rows_of(logits), at::kLong, "labels");
  const float inv_t = static_cast<float>(1.0 / temperature);
  const int64_t* y = labels.const_data_ptr<int64_t>();
  return backward_rows(grad, logits, shift, lse, temperature, [&](const auto* x, auto* g, int64_t r, float c,
                                                                  float m, float l) {
    using T = std::remove_pointer_t<decltype(g)>;
    constexpr int64_t kStep = Io<T>::kStep;
    // log p_v·kUnit = (x_v − m)·k − lse·kUnit, clamped to ≤ 0
    const Vec vsh(m), vk(kUnit * inv_t), vl(l * kUnit), vnc(-c), vzero(0.f);
    int64_t j = 0;
    for (; j + kStep <= V; j += kStep) {  // g_v = −c·p_v
      Vec a, b;
      Io<T>::load(x + j, a, b);
      const Vec pa = exp_u(at::vec::minimum(at::vec::fmsub(a - vsh, vk, vl), vzero));
      const Vec pb = exp_u(at::vec::minimum(at::vec::fmsub(b - vsh, vk, vl), vzero));
      Io<T>::store(g + j, pa * vnc, pb * vnc);
    }
    for (; j < V; ++j) g[j] = static_cast<T>(-c * std::exp(std::min((static_cast<float>(x[j]) - m) * inv_t - l, 0.f)));
    // the label: c·(1 − p_y)
    const float py = std::exp(std::min((static_cast<float>(x[y[r]]) - m) * inv_t - l, 0.f));
    g[y[r]] = static_cast<T>(-c * py + c);
  });
}

// --- entropy ----------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> entropy_fwd(const at::Tensor& logits, double temperature) {
  check_logits(logits);
  const int64_t n = rows_of(logits), V = logits.size(-1);
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor ent = at::empty({n}, opts), shift = at::empty({n}, opts), lse = at::empty({n}, opts);
  const float inv_t = static_cast<float>(1.0 / temperature);
  float *ph = ent.data_ptr<float>(), *pm = shift.data_ptr<float>(), *pl = lse.data_ptr<float>();
  RLCORE_DISPATCH(logits.scalar_type(), [&] {
    const Rows<T> rows(logits);
    at::parallel_for(0, n, grain(V), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const Stats st = row_stats<T, true>(rows[r], V, inv_t);
        const float l = std::log(st.s);
        const float h = l - st.t / (st.s * kUnit);  // −Σ p log p = lse − Σ p x'
        ph[r] = h < 0.f ? 0.f : h;
        pm[r] = st.m;
        pl[r] = l;
      }
    });
  });
  return {ent, shift, lse};
}

at::Tensor entropy_bwd(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& ent,
                       const at::Tensor& shift, const at::Tensor& lse, double temperature) {
  check_logits(logits);
  const int64_t V = logits.size(-1);
  check_rows(ent, rows_of(logits), at::kFloat, "ent");
  const float inv_t = static_cast<float>(1.0 / temperature);
  const float* ph = ent.const_data_ptr<float>();
  return backward_rows(grad, logits, shift, lse, temperature, [&](const auto* x, auto* g, int64_t r, float c,
                                                                  float m, float l) {
    using T = std::remove_pointer_t<decltype(g)>;
    constexpr int64_t kStep = Io<T>::kStep;
    const float h = ph[r];
    const Vec vsh(m), vk(kUnit * inv_t), vl(l * kUnit), vnc(-c), vzero(0.f), vlow(kLowest), vh(h),
        vunit(1.f / kUnit);
    // g_v = −c·p_v·(log p_v + H), log p_v clamped to [lowest, 0]
    auto one = [&](const Vec& v) {
      const Vec lu = at::vec::minimum(at::vec::fmsub(v - vsh, vk, vl), vzero);  // log p_v·kUnit
      return exp_u(lu) * (at::vec::maximum(lu * vunit, vlow) + vh) * vnc;
    };
    int64_t j = 0;
    for (; j + kStep <= V; j += kStep) {
      Vec a, b;
      Io<T>::load(x + j, a, b);
      Io<T>::store(g + j, one(a), one(b));
    }
    for (; j < V; ++j) {
      const float lp = std::min((static_cast<float>(x[j]) - m) * inv_t - l, 0.f);
      g[j] = static_cast<T>(-c * std::exp(lp) * (std::max(lp, kLowest) + h));
    }
  });
}

}  // namespace
}  // namespace rlcore_kernels

// How many threads the kernels' at::parallel_for runs n rows on (one where the build has no
// OpenMP): the tests check that the rows really spread over torch's intra-op threads.
static int64_t parallel_threads(int64_t n) {
  std::vector<char> used(static_cast<size_t>(std::max<int64_t>(at::get_num_threads(), 1)), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { used[static_cast<size_t>(at::get_thread_num())] = 1; });
  return std::count(used.begin(), used.end(), 1);
}

TORCH_LIBRARY(rlcore, m) {
  m.def("parallel_threads(int n) -> int", &parallel_threads);
  m.def("logprobs_fwd(Tensor logits, Tensor labels, float temperature) -> (Tensor, Tensor, Tensor)");
  m.def("logprobs_bwd(Tensor grad, Tensor logits, Tensor labels, Tensor shift, Tensor lse, float temperature) -> Tensor");
  m.def("entropy_fwd(Tensor logits, float temperature) -> (Tensor, Tensor, Tensor)");
  m.def("entropy_bwd(Tensor grad, Tensor logits, Tensor ent, Tensor shift, Tensor lse, float temperature) -> Tensor");
}

TORCH_LIBRARY_IMPL(rlcore, CPU, m) {
  m.impl("logprobs_fwd", &rlcore_kernels::logprobs_fwd);
  m.impl("logprobs_bwd", &rlcore_kernels::logprobs_bwd);
  m.impl("entropy_fwd", &rlcore_kernels::entropy_fwd);
  m.impl("entropy_bwd", &rlcore_kernels::entropy_bwd);
}
