"""Fused Triton training kernels (forward + backward), each with a plain-torch reference.

- `rmsnorm.rmsnorm`                          RMSNorm, Llama cast order; Gemma's `(1 + weight)`
                                             convention via `offset=1.0`.
- `swiglu.swiglu`                            `silu(gate) * up`, the gated-MLP activation.
- `linear_cross_entropy.linear_cross_entropy`  chunked LM head + cross entropy that never
                                             materialises the [N, V] logits; the gradient is
                                             computed in the forward ("gradient in the forward").
- `_common`                                  shared @triton.jit helpers (reductions, bf16 casts
                                             that round to nearest even under the interpreter).

Import the submodules (`from megacompile.runtime.kernels.rmsnorm import rmsnorm`); this package
itself does not import triton, so a test can set TRITON_INTERPRET=1 before the kernels are
defined, and `megacompile.runtime` stays importable without triton. With TRITON_INTERPRET=1 the
kernels run on CPU tensors (Triton's interpreter); without it they need a GPU.
"""
