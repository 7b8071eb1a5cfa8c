// gated_delta_rule.h — the gated delta rule of Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024,
// "Gated Delta Networks: Improving Mamba2 with Delta Rule", arXiv 2412.06464), the linear
// attention of Megatron-LM's GatedDeltaNet layer (megatron/core/ssm/gated_delta_net/gdn.py).
//
// Note [Gated delta rule]
// Per batch row and value head, with a state S_t in R^{dk x dv}, S_0 = 0, the keys and queries
// already L2-normalised, g_t <= 0 the log of the decay and beta_t in (0, 1) the write strength:
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
//   o_t = S_t^T (scale q_t)                       (the current token included; scale = dk^-1/2)
// which is the recurrence of FLA's naive_recurrent_gated_delta_rule: decay, read what the state
// holds for k_t, write beta_t of the difference to v_t back under k_t, read with q_t.
//
// The chunked form (Megatron's torch_chunk_gated_delta_rule, gdn.py, from the Qwen3-Next
// reference; the paper's §3.2 WY representation) computes the same in chunks of C tokens: within
// a chunk the C writes form a unit lower-triangular system, solved once, so the chunk's outputs
// and its state update are matrix products, and the recurrence runs over s/C chunks instead of s
// tokens. Here the system (I + K) T = I, K the strictly lower triangle of
// (beta_i k_i . k_j) exp(G_i - G_j) with G the in-chunk cumulative g, is solved by a triangular
// solve where the reference substitutes row by row (the same T up to rounding). Both forms
// compute in fp32 (double for double inputs) and return v's dtype; both are compositions of
// libtorch ops, so autograd differentiates them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace actmem {

/// q, k: [b, s, H, dk] (L2-normalised, one key head per value head: expand grouped key heads
/// first), v: [b, s, H, dv], g: [b, s, H] (log decay, <= 0), beta: [b, s, H]. Returns the
/// outputs o [b, s, H, dv] in v's dtype. The token-by-token recurrence (Note [Gated delta rule]).
at::Tensor gated_delta_rule_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta, double scale);

/// The same outputs by chunks of `chunk_size` tokens (the sequence zero-padded to a multiple of
/// it; padding tokens write nothing, beta 0, and their outputs are dropped).
at::Tensor gated_delta_rule_chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& g, const at::Tensor& beta, double scale,
                                    int64_t chunk_size = 64);

/// The chunked rule as one autograd node that keeps only its inputs for the backward (q, k, v, g,
/// beta: the bytes of those five tensors) and runs the chunked forward again there to
/// differentiate it; its gradients are bitwise those of autograd through
/// gated_delta_rule_chunked(), which keeps every intermediate of the chunks instead. FLA's
/// chunk_gated_delta_rule, Megatron's kernel, likewise keeps its inputs (plus the chunks'
/// triangular solutions) and recomputes the states in its backward.
at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& g, const at::Tensor& beta, double scale,
                            int64_t chunk_size = 64);

}  // namespace actmem
