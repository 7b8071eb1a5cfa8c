// gated_delta_rule.cpp — the gated delta rule, token by token and by chunks (Note [Gated delta
// rule] in gated_delta_rule.h).
#include "actmem/model/gdn/gated_delta_rule.h"

#include <ATen/ops/linalg_solve_triangular.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

namespace actmem {

namespace {

// The compute type: fp32 for 16- and 32-bit inputs, double for double.
at::ScalarType compute_type(const at::Tensor& v) {
  return v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_inputs(const char* api, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& g, const at::Tensor& beta) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, api,
              ": expected q, k [b, s, H, dk] "
              "and v [b, s, H, dv], got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.sizes() == k.sizes(), api, ": q and k must have one shape, got ", q.sizes(),
              " and ", k.sizes());
  TORCH_CHECK(v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2), api,
              ": v must be [b, s, H, dv] with q's b, s, H; got ", v.sizes(), " for q ", q.sizes());
  TORCH_CHECK(g.sizes() == q.sizes().slice(0, 3) && beta.sizes() == q.sizes().slice(0, 3), api,
              ": g and beta must be [b, s, H] = ", q.sizes().slice(0, 3), ", got ", g.sizes(),
              " and ", beta.sizes());
}

}  // namespace

at::Tensor gated_delta_rule_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta, double scale) {
  check_inputs("actmem::gated_delta_rule_recurrent", q, k, v, g, beta);
  const at::ScalarType ct = compute_type(v);
  // [b, H, s, d] in the compute type.
  const at::Tensor Q = q.transpose(1, 2).to(ct) * scale, K = k.transpose(1, 2).to(ct);
  const at::Tensor V = v.transpose(1, 2).to(ct);
  const at::Tensor decay = g.transpose(1, 2).to(ct).exp(), B = beta.transpose(1, 2).to(ct);
  const int64_t s = q.size(1);
  at::Tensor S = at::zeros({q.size(0), q.size(2), q.size(3), v.size(3)}, V.options());
  std::vector<at::Tensor> outputs;
  outputs.reserve(static_cast<size_t>(s));
  for (int64_t t = 0; t < s; ++t) {
    const at::Tensor k_t = K.select(2, t), q_t = Q.select(2, t);  // [b, H, dk]
    S = S * decay.select(2, t).unsqueeze(-1).unsqueeze(-1);
    // What the state holds under k_t, S^T k_t: [b, H, dv].
    const at::Tensor read = at::matmul(k_t.unsqueeze(-2), S).squeeze(-2);
    const at::Tensor u = (V.select(2, t) - read) * B.select(2, t).unsqueeze(-1);
    S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2);
    outputs.push_back(at::matmul(q_t.unsqueeze(-2), S).squeeze(-2));
  }
  return at::stack(outputs, 2).transpose(1, 2).to(v.scalar_type()).contiguous();
}

at::Tensor gated_delta_rule_chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& g, const at::Tensor& beta, double scale,
                                    int64_t chunk_size) {
  check_inputs("actmem::gated_delta_rule_chunked", q, k, v, g, beta);
  TORCH_CHECK(chunk_size >= 1, "actmem::gated_delta_rule_chunked: chunk_size must be >= 1, got ",
              chunk_size);
  const at::ScalarType ct = compute_type(v);
  const int64_t b = q.size(0), s = q.size(1), H = q.size(2), dk = q.size(3), dv = v.size(3);
  const int64_t C = chunk_size, pad = (C - s % C) % C, n = (s + pad) / C;
  // [b, H, s + pad, d] in the compute type, padded with zeros (beta 0: a padding token writes
  // nothing; g 0: it does not decay the state either).
  auto prepare = [&](const at::Tensor& x) {
    at::Tensor y = x.transpose(1, 2).to(ct);
    if (pad == 0) return y;
    std::vector<int64_t> sizes = y.sizes().vec();
    sizes[2] = pad;
    return at::cat({y, at::zeros(sizes, y.options())}, 2);
  };
  const at::Tensor Q = (prepare(q) * scale).view({b, H, n, C, dk});
  const at::Tensor K = prepare(k).view({b, H, n, C, dk});
  const at::Tensor V = prepare(v).view({b, H, n, C, dv});
  const at::Tensor B = prepare(beta).view({b, H, n, C, 1});
  // The cumulative log decay within each chunk, G_i = g_1 + ... + g_i.
  const at::Tensor G = prepare(g).view({b, H, n, C}).cumsum(-1);
  const at::TensorOptions opts = Q.options();
  const at::Tensor lower = at::ones({C, C}, opts.dtype(at::kBool)).tril();
  const at::Tensor strictly_lower = at::ones({C, C}, opts.dtype(at::kBool)).tril(-1);
  // exp(G_i - G_j) for j <= i, 0 above the diagonal (the exponent there is masked to 0 first:
  // G_i - G_j > 0 for j > i could overflow).
  const at::Tensor gap = G.unsqueeze(-1) - G.unsqueeze(-2);
  const at::Tensor decay = at::where(lower, gap, at::zeros({}, opts)).exp() * lower;
  // The chunk's writes: (I + K) T = I with K = strictlylower((beta_i k_i . k_j) exp(G_i - G_j)).
  const at::Tensor Kb = K * B, Vb = V * B;
  const at::Tensor system =
      at::matmul(Kb, K.transpose(-1, -2)) * decay * strictly_lower + at::eye(C, opts);
  const at::Tensor T = at::linalg_solve_triangular(system, at::eye(C, opts).expand_as(system),
                                                   /*upper=*/false, /*left=*/true,
                                                   /*unitriangular=*/true);
  const at::Tensor values = at::matmul(T, Vb);                             // [b, H, n, C, dv]
  const at::Tensor key_decay = at::matmul(T, Kb * G.exp().unsqueeze(-1));  // [b, H, n, C, dk]
  // Within-chunk attention (q_i . k_j) exp(G_i - G_j), j <= i.
  const at::Tensor inner = at::matmul(Q, K.transpose(-1, -2)) * decay;  // [b, H, n, C, C]
  const at::Tensor last = G.select(-1, C - 1);                          // [b, H, n]
  at::Tensor S = at::zeros({b, H, dk, dv}, opts);
  std::vector<at::Tensor> outputs;
  outputs.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor G_i = G.select(2, i), K_i = K.select(2, i);
    // The chunk's writes less what the state before it already holds under their keys.
    const at::Tensor fresh = values.select(2, i) - at::matmul(key_decay.select(2, i), S);
    outputs.push_back(at::matmul(Q.select(2, i) * G_i.exp().unsqueeze(-1), S) +
                      at::matmul(inner.select(2, i), fresh));
    const at::Tensor last_i = last.select(2, i);  // [b, H]
    const at::Tensor carried = K_i * (last_i.unsqueeze(-1) - G_i).exp().unsqueeze(-1);
    S = S * last_i.exp().unsqueeze(-1).unsqueeze(-1) + at::matmul(carried.transpose(-1, -2), fresh);
  }
  at::Tensor o = at::stack(outputs, 2).view({b, H, n * C, dv});
  if (pad > 0) o = o.narrow(2, 0, s);
  // [b, s, H, dv] on storage of its own: contiguous, without the padding (a checkpoint keeping
  // it keeps T H dv elements; a consumer reshaping it to rows keeps a view).
  return o.transpose(1, 2).to(v.scalar_type()).contiguous();
}

namespace {
// Note [One node for the gated delta rule]
// The forward runs without autograd and keeps the five inputs; the backward runs the same
// chunked forward again with autograd on detached copies of them and differentiates it, so its
// ops and their order are those of autograd through gated_delta_rule_chunked() (bitwise the
// same gradients) while the forward's intermediates (per chunk: the decay and within-chunk
// matrices, the triangular solution, the states) live only inside the backward.
struct GatedDeltaRuleFunction : torch::autograd::Function<GatedDeltaRuleFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, double scale, int64_t chunk_size) {
    ctx->save_for_backward({q, k, v, g, beta});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["chunk_size"] = chunk_size;
    return gated_delta_rule_chunked(q, k, v, g, beta, scale, chunk_size);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 const torch::autograd::variable_list& grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    torch::autograd::variable_list inputs;
    for (const at::Tensor& x : saved) inputs.push_back(x.detach().requires_grad_(true));
    at::Tensor out;
    {
      at::AutoGradMode enable(true);
      out = gated_delta_rule_chunked(inputs[0], inputs[1], inputs[2], inputs[3], inputs[4],
                                     ctx->saved_data["scale"].toDouble(),
                                     ctx->saved_data["chunk_size"].toInt());
    }
    torch::autograd::variable_list d = torch::autograd::grad({out}, inputs, {grads[0]});
    d.push_back(at::Tensor());  // scale
    d.push_back(at::Tensor());  // chunk_size
    return d;
  }
};
}  // namespace

at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& g, const at::Tensor& beta, double scale,
                            int64_t chunk_size) {
  check_inputs("actmem::gated_delta_rule", q, k, v, g, beta);
  TORCH_CHECK(chunk_size >= 1, "actmem::gated_delta_rule: chunk_size must be >= 1, got ",
              chunk_size);
  return GatedDeltaRuleFunction::apply(q, k, v, g, beta, scale, chunk_size);
}

}  // namespace actmem
