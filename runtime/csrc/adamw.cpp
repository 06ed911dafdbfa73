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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                                       // nearest even
  return static_cast<uint16_t>(u >> 16);
}

constexpr int64_t kGrain = 1 << 15;
constexpr int64_t kBlock = 1 << 11;   // 8 KiB of weights: still in L1 when they are checked

// body(begin, end) over [0, n): on torch's intra-op pool (threads == 0), or on `threads` OpenMP
// threads of the calling thread's own team (an update on a host thread next to the training
// thread leaves it and the gradient worker their cores instead of taking torch's whole pool)
template <typename F>
void parallel(int64_t n, int64_t threads, const F& body) {
  if (threads <= 0) {
    at::parallel_for(0, n, kGrain, body);
    return;
  }
  const int64_t chunks = (n + kGrain - 1) / kGrain;
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

void check(const torch::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == n,
              name, " must be a contiguous CPU float32 tensor with ", n, " elements");
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
  if (threads <= 0) {
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) partial[static_cast<size_t>(c)] = body(c);
    });
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

int64_t adamw_step(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                c10::optional<torch::Tensor> low, double lr, double beta1, double beta2, double eps,
                double weight_decay, int64_t step, double grad_scale, int64_t threads) {
  const int64_t n = param.numel();
  check(param, "param", n);
  check(grad, "grad", n);
  check(exp_avg, "exp_avg", n);
  check(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(step >= 1, "step must be at least 1");
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const float step_size = static_cast<float>(lr / bc1), bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  // scalars are computed in double and rounded once, as torch does with Python-float scalars
  const float decay = 1.0 - lr * weight_decay, b1 = beta1, b2 = beta2, omb1 = 1.0 - beta1, omb2 = 1.0 - beta2;
  const float f_eps = eps, f_gs = grad_scale;
  if (!low.has_value()) {
    return run<0>(p, g, m, v, nullptr, n, decay, b1, b2, omb1, omb2, f_eps, step_size, bc2_sqrt, f_gs, threads);
  }
  const torch::Tensor& out = *low;
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.numel() == n,
              "low must be a contiguous CPU tensor with ", n, " elements");
  if (out.scalar_type() == torch::kBFloat16) {
    return run<1>(p, g, m, v, out.data_ptr(), n, decay, b1, b2, omb1, omb2, f_eps, step_size, bc2_sqrt, f_gs, threads);
  } else {
    TORCH_CHECK(out.scalar_type() == torch::kHalf, "low must be bfloat16 or float16");
    return run<2>(p, g, m, v, out.data_ptr(), n, decay, b1, b2, omb1, omb2, f_eps, step_size, bc2_sqrt, f_gs, threads);
  }
}

// The sum of the squares of a flat fp32 buffer (a gradient's squared L2 norm), in double (Lanes).
// (torch.linalg.vector_norm over a host gradient runs on one core: a 1.2B-parameter model's
// norms measured 442 ms of a 1.8 s step on an H200 machine.)
double sum_squares(torch::Tensor t, int64_t threads) {
  const int64_t n = t.numel();
  check(t, "t", n);
  const float* x = t.data_ptr<float>();
  return chunked_sum(n, threads, [&](int64_t c) {
    Lanes lanes;
    lanes.add(x, c * kGrain, std::min(n, (c + 1) * kGrain));
    return lanes.total();
  });
}

// A memory-bandwidth probe with AdamW's access pattern and this file's compiler flags and
// threading (megacompile/host_probe.py): a[i] = a[i] + s * b[i] in place (12 bytes/element:
// read a and b, write a back; no write-allocate reads uncounted, as with AdamW's buffers).
void stream_update(torch::Tensor a, torch::Tensor b, double scale, int64_t threads) {
  const int64_t n = a.numel();
  check(a, "a", n);
  check(b, "b", n);
  float* __restrict__ x = a.data_ptr<float>();
  const float* __restrict__ y = b.data_ptr<float>();
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
double land(torch::Tensor dst, torch::Tensor src, bool add, int64_t threads) {
  const int64_t n = dst.numel();
  check(dst, "dst", n);
  TORCH_CHECK(src.device().is_cpu() && src.is_contiguous() && src.numel() == n,
              "src must be a contiguous CPU tensor with ", n, " elements");
  float* d = dst.data_ptr<float>();
  switch (src.scalar_type()) {
    case torch::kFloat32: return land_impl(d, src.data_ptr<float>(), n, add, threads);
    case torch::kBFloat16: return land_impl(d, src.data_ptr<c10::BFloat16>(), n, add, threads);
    case torch::kHalf: return land_impl(d, src.data_ptr<c10::Half>(), n, add, threads);
    default: TORCH_CHECK(false, "src must be float32, bfloat16 or float16");
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
