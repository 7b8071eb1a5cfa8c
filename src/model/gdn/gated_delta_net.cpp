// gated_delta_net.cpp — Megatron's GatedDeltaNet (Note [GatedDeltaNet as actmem builds it] in
// gated_delta_net.h).
#include "actmem/model/gdn/gated_delta_net.h"

#include "actmem/memory/ledger.h"
#include "actmem/model/gdn/gated_delta_rule.h"
#include "actmem/model/weight_init.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/recompute/recompute.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>

namespace actmem {

namespace {

struct L2NormFunction : torch::autograd::Function<L2NormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            double eps) {
    const at::Tensor xf = x.to(compute_dtype(x.scalar_type()));
    const at::Tensor rstd = (xf.square().sum(-1, /*keepdim=*/true) + eps).rsqrt();
    const at::Tensor y = (xf * rstd).to(x.scalar_type());
    ctx->save_for_backward({y, rstd});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 const torch::autograd::variable_list& grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& y = saved[0];
    const at::Tensor& rstd = saved[1];
    const at::ScalarType ct = rstd.scalar_type();
    // d/dx of x r with r = (|x|^2 + eps)^-1/2: r (dy - y (y . dy)), y = x r.
    const at::Tensor dy = grads[0].to(ct), yf = y.to(ct);
    const at::Tensor dx = rstd * (dy - yf * (dy * yf).sum(-1, /*keepdim=*/true));
    return {dx.to(y.scalar_type()), at::Tensor()};
  }
};

// A plain holder so the convolution's weight is named conv1d.weight, as nn.Conv1d's in Megatron.
class Conv1dWeight : public torch::nn::Module {
 public:
  explicit Conv1dWeight(const at::Tensor& w) { weight = register_parameter("weight", w); }
  at::Tensor weight;
};

}  // namespace

at::Tensor l2norm(const at::Tensor& x, double eps) {
  return L2NormFunction::apply(x, eps);
}

GatedDeltaNet::GatedDeltaNet(const TransformerConfig& c, const LayerPlan& plan,
                             at::ScalarType dtype)
    : key_heads_(c.linear_num_key_heads / c.tensor_model_parallel_size),
      value_heads_(c.linear_num_value_heads / c.tensor_model_parallel_size),
      key_dim_(c.linear_key_head_dim),
      value_dim_(c.linear_value_head_dim),
      kernel_(c.linear_conv_kernel_dim),
      plan_(plan) {
  const int64_t h = c.hidden_size;
  const bool sp = c.sequence_parallel;
  const auto sections = in_proj_sections();
  int64_t rows = 0;
  for (const int64_t n : sections) rows += n;
  in_proj = register_module("in_proj", std::make_shared<Linear>(h, rows, false, false, dtype,
                                                                LinearParallel::kColumn, sp));
  const auto opts = at::TensorOptions().dtype(dtype);
  const int64_t conv_dim = 2 * key_heads_ * key_dim_ + value_heads_ * value_dim_;
  auto conv = register_module(
      "conv1d", std::make_shared<Conv1dWeight>(at::zeros({conv_dim, 1, kernel_}, opts)));
  conv1d_weight = conv->weight;
  // Megatron registers dt_bias before A_log (common.py).
  dt_bias = register_parameter("dt_bias", at::ones({value_heads_}, opts));
  A_log = register_parameter("A_log", at::zeros({value_heads_}, opts));
  out_norm = register_module("out_norm", std::make_shared<Norm>(c, dtype, value_dim_));
  out_norm->partial_over_heads = true;
  out_proj =
      register_module("out_proj", std::make_shared<Linear>(value_heads_ * value_dim_, h, false,
                                                           true, dtype, LinearParallel::kRow, sp));
}

std::array<int64_t, 6> GatedDeltaNet::in_proj_sections() const {
  const int64_t qk = key_heads_ * key_dim_, v = value_heads_ * value_dim_;
  return {qk, qk, v, v, value_heads_, value_heads_};
}

std::optional<ParameterAttributes> GatedDeltaNet::parameter_attributes(
    const std::string& name) const {
  if (name == "conv1d.weight" || name == "A_log" || name == "dt_bias") {
    return ParameterAttributes{/*tensor_parallel=*/true, false, false};
  }
  return std::nullopt;
}

at::Tensor GatedDeltaNet::gated_norm(const at::Tensor& o, const at::Tensor& z) const {
  // Megatron's _apply_gated_norm: out_norm over each head's values, times silu of the gate in
  // fp32, back to the rule's dtype; then [b, s, H dv] -> [s, b, H dv] for out_proj.
  const int64_t b = o.size(0), s = o.size(1);
  const at::Tensor y = out_norm->forward(o.reshape({-1, value_dim_}));
  const at::Tensor gate = at::silu(z.reshape({-1, value_dim_}).to(compute_dtype(z.scalar_type())));
  // A copy even when the transpose is already contiguous (b = 1): out_proj's input must own its
  // storage for gdn_norm_out to free it.
  return (y * gate)
      .to(o.scalar_type())
      .reshape({b, s, -1})
      .transpose(0, 1)
      .clone(at::MemoryFormat::Contiguous);
}

std::pair<at::Tensor, at::Tensor> GatedDeltaNet::forward(const at::Tensor& x,
                                                         const LayerContext& ctx) {
  const bool train = is_training();
  at::Tensor projected;
  {
    ModuleScope scope("in_proj");
    projected = in_proj->forward(x).first;  // [s, b, P]: the whole sequence
  }
  const int64_t s = projected.size(0), b = projected.size(1);
  const auto sec = in_proj_sections();
  // [b, s, P] views: q, k, v together (the convolution's channels), z, beta, alpha.
  const auto parts = projected.transpose(0, 1).split_with_sizes(
      {sec[0] + sec[1] + sec[2], sec[3], sec[4], sec[5]}, -1);
  at::Tensor qkv;
  {
    // Megatron's torch path: F.conv1d over [b, C, s] with K - 1 zeros on both sides, the first s
    // outputs (the causal ones), silu.
    ModuleScope scope("conv1d");
    const at::Tensor conv = at::conv1d(parts[0].transpose(1, 2).contiguous(), conv1d_weight,
                                       at::Tensor(), 1, kernel_ - 1, 1, conv1d_weight.size(0));
    qkv = at::silu(conv.narrow(2, 0, s)).transpose(1, 2);  // [b, s, C]
  }
  at::Tensor q, k, v, g, beta, z;
  {
    ModuleScope scope("prepare_input_for_gated_delta_rule");
    const int64_t qk = sec[0];
    const at::Tensor qk_heads =
        l2norm(qkv.narrow(-1, 0, 2 * qk).reshape({b, s, 2 * key_heads_, key_dim_}).contiguous());
    q = qk_heads.narrow(2, 0, key_heads_);
    k = qk_heads.narrow(2, key_heads_, key_heads_);
    const int64_t repeat = value_heads_ / key_heads_;
    if (repeat > 1) {
      // Grouped keys, each serving `repeat` adjacent value heads (Megatron's repeat_interleave),
      // as expand and a copying reshape: autograd keeps nothing for either.
      auto spread = [&](const at::Tensor& x) {
        return x.unsqueeze(3)
            .expand({b, s, key_heads_, repeat, key_dim_})
            .reshape({b, s, value_heads_, key_dim_});
      };
      q = spread(q);
      k = spread(k);
    }
    v = qkv.narrow(-1, 2 * qk, sec[2]).reshape({b, s, value_heads_, value_dim_}).contiguous();
    // The decay and the write strength (Megatron's _compute_gates): g in fp32.
    const at::ScalarType up = compute_dtype(x.scalar_type());
    g = -A_log.exp() * at::softplus(parts[3].contiguous().to(up) + dt_bias);
    beta = at::sigmoid(parts[2].contiguous());
    z = parts[1].reshape({b, s, value_heads_, value_dim_}).contiguous();
  }
  at::Tensor o;
  {
    ModuleScope scope("gated_delta_rule");
    o = gated_delta_rule(q, k, v, g, beta, 1.0 / std::sqrt(static_cast<double>(key_dim_)));
  }
  // Selective gdn_norm_out (Megatron's recompute_norm_out): output-discarding recompute of the
  // gated norm, rebuilt from the gradient hook of out_proj's output.
  const bool recompute = plan_.recomputes(RecomputeModule::kGdnNormOut) && train;
  CheckpointWithoutOutput ckpt;
  at::Tensor normed;
  {
    ModuleScope scope("out_norm");
    if (recompute) {
      normed = ckpt.checkpoint(
          [this](const TensorList& in) { return TensorList{gated_norm(in[0], in[1])}; }, {o, z})[0];
      // An output that output-discarding recompute frees is not worth a copy.
      if (ctx.offloader != nullptr) ctx.offloader->exclude_this_forward(normed);
    } else {
      normed = gated_norm(o, z);
    }
  }
  at::Tensor out, bias;
  {
    ModuleScope scope("out_proj");
    std::tie(out, bias) = out_proj->forward(normed);
  }
  if (recompute) ckpt.discard_output_and_register_recompute(out);
  return {out, bias};
}

void GatedDeltaNet::init_weights(WeightInit& init) {
  const int64_t t = init.tp_size(), h = in_proj->weight.size(1);
  std::vector<int64_t> sections;
  for (const int64_t n : in_proj_sections()) sections.push_back(n * t);
  in_proj->weight.copy_(
      init.section_rows(init.normal({in_proj->weight.size(0) * t, h}, init.std()), sections));
  const double bound = 1.0 / std::sqrt(static_cast<double>(kernel_));
  conv1d_weight.copy_(
      init.section_rows(init.uniform({conv1d_weight.size(0) * t, 1, kernel_}, -bound, bound),
                        {sections[0], sections[1], sections[2]}));
  const at::ScalarType dtype = init.dtype();
  A_log.copy_(init.rows(
      init.uniform({A_log.size(0) * t}, 1.0, 16.0, compute_dtype(dtype)).log().to(dtype)));
  out_proj->weight.copy_(
      init.cols(init.normal({h, out_proj->weight.size(1) * t}, init.scaled_std())));
}

std::unique_ptr<DecodeState> GatedDeltaNet::make_decode_state(int64_t,
                                                              const at::TensorOptions&) const {
  TORCH_CHECK(false,
              "actmem::KVCache: generation with GatedDeltaNet layers (their recurrent "
              "state instead of a key/value cache) is not implemented");
}

}  // namespace actmem
