// The host's passes over a parameter's flat fp32 buffers (runtime/host_kernels.py loads this):
//   adamw_step   AdamW, writing the low-precision transfer copy in the same pass (below);
//   land         a gradient landing from the device, added into the fp32 gradient, its squared
//                norm taken in the same pass (the clipping norm costs no pass of its own);
//   sum_squares  a squared norm alone;
//   stream_update  a memory-bandwidth probe with AdamW's access pattern.
//
// adamw_step, per element, with g = grad * grad_scale (the clipping factor, applied here instead of in a
// separate pass over the gradients):
//     p  = p * (1 - lr * weight_decay)                          decoupled weight decay
//     m  = m + (1 - beta1) * (g - m)                            = lerp(m, g, 1 - beta1), as torch
//     v  = beta2 * v + (1 - beta2) * g * g
//     p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//     low = round_to_nearest_even(p)                            bf16 or fp16 transfer copy
// and returns how many blocks of new weights hold a non-finite value (NaN or inf; 0: all finite;
// found in the same pass, so the trainer learns of a diverging update without reading the masters
// again: the exponent bits of each new weight, OR-ed).
// These are torch.optim.AdamW's formulas in its operation order. Memory traffic is 30 bytes per
// parameter for a bf16 copy (read p, g, m, v; write p, m, v, low) against 28 + 6 for torch's
// fused AdamW followed by a separate copy pass.
//
// The functions take buffer addresses and element counts, not tensors: runtime/host_kernels.py
// checks each tensor (CPU, contiguous, dtype, size) and passes its data pointer, so this file
// needs pybind11 and c10's two float types, not torch/extension.h (all of ATen): it builds in
// seconds, not half a minute. `threads` is always a count here (host_kernels passes torch's
// intra-op thread count where its caller said 0).
#include <pybind11/pybind11.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "check.h"

namespace {

using megatrain::check;

template <typename T>
T* buffer(int64_t address) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                                       // nearest even
  return static_cast<uint16_t>(u >> 16);
}

constexpr int64_t kGrain = 1 << 15;
constexpr int64_t kBlock = 1 << 11;   // 8 KiB of weights: still in L1 when they are checked

// body(begin, end) over [0, n) in chunks of kGrain, on `threads` OpenMP threads of the calling
// thread's own team (an update on a host thread next to the training thread leaves it and the
// gradient worker their cores instead of taking torch's whole pool); one chunk, or one thread,
// runs on the calling thread
template <typename F>
void parallel(int64_t n, int64_t threads, const F& body) {
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  if (chunks <= 1 || threads <= 1) {
    if (n > 0) body(0, n);
    return;
  }
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) body(c * kGrain, std::min(n, (c + 1) * kGrain));
}

template <int LOW>  // 0: no copy, 1: bf16, 2: fp16
int64_t run(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
         void* low, int64_t n, float decay, float beta1, float beta2, float one_minus_beta1,
         float one_minus_beta2, float eps, float step_size, float bc2_sqrt, float grad_scale, int64_t threads) {
  std::atomic<int64_t> nonfinite{0};
  parallel(n, threads, [&](int64_t begin, int64_t end) {
    uint32_t bad = 0;
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t e = std::min(end, b + kBlock);
#pragma omp simd
      for (int64_t i = b; i < e; ++i) {
        const float gi = g[i] * grad_scale;
        const float mi = m[i] + one_minus_beta1 * (gi - m[i]);
        const float vi = beta2 * v[i] + one_minus_beta2 * (gi * gi);
        const float denom = std::sqrt(vi) / bc2_sqrt + eps;
        const float pi = p[i] * decay - step_size * (mi / denom);   // (no FMA contraction: -ffp-contract=off)
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        if constexpr (LOW == 1) static_cast<uint16_t*>(low)[i] = to_bf16(pi);
        if constexpr (LOW == 2) static_cast<c10::Half*>(low)[i] = c10::Half(pi);
      }
      // the block just written, again, from L1: NaN and inf have every exponent bit set. (A
      // reduction inside the update loop stops gcc vectorizing it: 2.5x slower.)
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(p);
#pragma omp simd reduction(| : bad)
      for (int64_t i = b; i < e; ++i) bad |= static_cast<uint32_t>((bits[i] & 0x7f800000u) == 0x7f800000u);
    }
    if (bad) nonfinite += 1;
  });
  return nonfinite.load();
}

// Sums of squares, in double, the same way wherever they are taken: one partial sum per fixed
// chunk of kGrain elements (eight independent double lanes, element i of a chunk into lane i % 8,
// a tail into lane 0), the partials added in chunk order. So the result depends neither on the
// thread count nor on whether it was taken by sum_squares or by land.
struct Lanes {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  // x[b, e): (e - b) a multiple of 8 except for a chunk's last range
  inline void add(const float* __restrict__ x, int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + 8 <= e; i += 8) {
      for (int k = 0; k < 8; ++k) lane[k] += static_cast<double>(x[i + k]) * static_cast<double>(x[i + k]);
    }
    for (; i < e; ++i) lane[0] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  }
  inline double total() const {
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  }
};

// body(c) for each chunk c of [0, chunks): on torch's pool or on `threads` OpenMP threads; the
// partials added in chunk order
template <typename F>
double chunked_sum(int64_t n, int64_t threads, const F& body) {
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
  if (chunks <= 1 || threads <= 1) {
    for (int64_t c = 0; c < chunks; ++c) partial[static_cast<size_t>(c)] = body(c);
  } else {
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static)
    for (int64_t c = 0; c < chunks; ++c) partial[static_cast<size_t>(c)] = body(c);
  }
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }

// dst = src or dst += src (src widened to fp32 exactly: the same values torch's copy_/add_
// write), and the sum of the squares of the new dst, block by block while it is in L1
template <typename S>
double land_impl(float* __restrict__ dst, const S* __restrict__ src, int64_t n, bool add, int64_t threads) {
  return chunked_sum(n, threads, [&](int64_t c) {
    const int64_t b = c * kGrain, e = std::min(n, b + kGrain);
    Lanes lanes;
    for (int64_t s = b; s < e; s += kBlock) {
      const int64_t t = std::min(e, s + kBlock);
      if (add) {
#pragma omp simd
        for (int64_t i = s; i < t; ++i) dst[i] = dst[i] + widen(src[i]);
      } else {
#pragma omp simd
        for (int64_t i = s; i < t; ++i) dst[i] = widen(src[i]);
      }
      lanes.add(dst, s, t);
    }
    return lanes.total();
  });
}

}  // namespace

// kinds of a low-precision buffer or a landing gradient (host_kernels.py's _KINDS)
constexpr int kNone = 0, kBF16 = 1, kF16 = 2, kF32 = 3;

int64_t adamw_step(int64_t param, int64_t grad, int64_t exp_avg, int64_t exp_avg_sq, int64_t low, int low_kind,
                   int64_t n, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                   double grad_scale, int64_t threads) {
  check(step >= 1, "step must be at least 1");
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const float step_size = static_cast<float>(lr / bc1), bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  float* p = buffer<float>(param);
  const float* g = buffer<const float>(grad);
  float* m = buffer<float>(exp_avg);
  float* v = buffer<float>(exp_avg_sq);
  // scalars are computed in double and rounded once, as torch does with Python-float scalars
  const float decay = 1.0 - lr * weight_decay, b1 = beta1, b2 = beta2, omb1 = 1.0 - beta1, omb2 = 1.0 - beta2;
  const float f_eps = eps, f_gs = grad_scale;
  switch (low_kind) {
    case kNone:
      return run<0>(p, g, m, v, nullptr, n, decay, b1, b2, omb1, omb2, f_eps, step_size, bc2_sqrt, f_gs, threads);
    case kBF16:
      return run<1>(p, g, m, v, buffer<void>(low), n, decay, b1, b2, omb1, omb2, f_eps, step_size, bc2_sqrt, f_gs,
                    threads);
    case kF16:
      return run<2>(p, g, m, v, buffer<void>(low), n, decay, b1, b2, omb1, omb2, f_eps, step_size, bc2_sqrt, f_gs,
                    threads);
    default:
      check(false, "low must be bfloat16 or float16");
  }
  return 0;
}

// The sum of the squares of a flat fp32 buffer (a gradient's squared L2 norm), in double (Lanes).
// (torch.linalg.vector_norm over a host gradient runs on one core: a 1.2B-parameter model's
// norms measured 442 ms of a 1.8 s step on an H200 machine.)
double sum_squares(int64_t t, int64_t n, int64_t threads) {
  const float* x = buffer<const float>(t);
  return chunked_sum(n, threads, [&](int64_t c) {
    Lanes lanes;
    lanes.add(x, c * kGrain, std::min(n, (c + 1) * kGrain));
    return lanes.total();
  });
}

// A memory-bandwidth probe with AdamW's access pattern and this file's compiler flags and
// threading (megacompile/host_probe.py): a[i] = a[i] + s * b[i] in place (12 bytes/element:
// read a and b, write a back; no write-allocate reads uncounted, as with AdamW's buffers).
void stream_update(int64_t a, int64_t b, int64_t n, double scale, int64_t threads) {
  float* __restrict__ x = buffer<float>(a);
  const float* __restrict__ y = buffer<const float>(b);
  const float s = static_cast<float>(scale);
  parallel(n, threads, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) x[i] = x[i] + s * y[i];
  });
}

// A gradient landing on the host (runtime/store.py add_host_grad): dst (fp32) = src, or
// dst += src when `add`, src fp32, bf16 or fp16; returns the squared L2 norm of the new dst as
// sum_squares(dst) would, taken in the same pass. The global norm for clipping then needs no
// pass of its own over the gradients after the backward.
double land(int64_t dst, int64_t src, int src_kind, int64_t n, bool add, int64_t threads) {
  float* d = buffer<float>(dst);
  switch (src_kind) {
    case kF32: return land_impl(d, buffer<const float>(src), n, add, threads);
    case kBF16: return land_impl(d, buffer<const c10::BFloat16>(src), n, add, threads);
    case kF16: return land_impl(d, buffer<const c10::Half>(src), n, add, threads);
    default: check(false, "src must be float32, bfloat16 or float16");
  }
  return 0.0;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // without the GIL: the overlapped step runs on a host thread while the training thread goes on
  module.def("adamw_step", &adamw_step, "AdamW over flat fp32 buffers, writing the low-precision copy; returns "
             "the number of blocks of new weights holding a NaN or inf (0: all finite)",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("sum_squares", &sum_squares, "sum of squares of a contiguous CPU float32 tensor, in double",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("stream_update", &stream_update, "a += scale * b over contiguous CPU float32 tensors (a bandwidth "
             "probe)", pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("land", &land, "dst = src or dst += src (fp32 dst; src fp32/bf16/fp16), returning sum(dst ** 2) in "
             "double as sum_squares does", pybind11::call_guard<pybind11::gil_scoped_release>());
}
