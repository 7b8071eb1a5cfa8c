// gdn_part.cpp — the contract of the mixer part "gdn" (gated_delta_net.h): a hybrid model's
// Gated DeltaNet layers. What it saves for the backward (Note [What a GatedDeltaNet layer
// saves]), its parameters, FLOPs and the memory pre-check's terms.
#include "actmem/model/gdn/gated_delta_net.h"

#include <algorithm>
#include <cmath>

namespace actmem {

// Note [What a GatedDeltaNet layer saves] (per rank: T = s*b tokens, the rank's Hk key heads
// of dk, Hv value heads of dv, qk = Hk dk, v = Hv dv, C = 2 qk + v; `actmem inspect --records`):
//   in_proj      its input, the input norm's output (as linear_qkv's)
//   conv1d       the convolution's input [b, C, s] and, for silu, the convolution's whole
//                output [b, C, s + K - 1] (silu reads its first s positions, a view)
//   prepare      l2norm's output [T, 2 Hk, dk] and 1/norm [T, 2 Hk] (upcast); softplus's input
//                and output [T, Hv] (upcast); exp(A_log) and its negation [Hv]; sigmoid's
//                output beta [T, Hv]
//   rule         q and k at Hv heads when Hk < Hv (the repeated copies; views of l2norm's
//                output otherwise), v [T, v], g [T, Hv] (upcast); beta counted above
//   out_norm     the rule's output [T, v] and the norm's statistics over T Hv rows; silu's
//                input, the upcast gate [T, v]; the product's operands, the norm output [T, v]
//                and silu's output (upcast)
//   out_proj     its input [T, v] (the gated norm's output, transposed to [s, b, v])
// gdn_norm_out recompute: the checkpoint keeps the rule's output and the gate [T, v] each (and
// a snapshot); out_proj's input is freed.
namespace {
class GatedDeltaNetPart final : public LayerPart {
 public:
  const char* name() const override { return "gdn"; }
  PartSlot slot() const override { return PartSlot::kMixer; }
  std::shared_ptr<PartModule> build(const TransformerConfig& config, const LayerPlan& plan, int64_t,
                                    at::ScalarType dtype) const override {
    return std::make_shared<GatedDeltaNet>(config, plan, dtype);
  }

  void saved_bytes(const SavedBytesContext& ctx) const override {
    const TransformerConfig& c = ctx.config;
    const int64_t e = ctx.e, up = ctx.up, t = c.tensor_model_parallel_size;
    const int64_t s = c.seq_length, b = c.micro_batch_size;
    const int64_t T = s * b, Hk = c.linear_num_key_heads / t, Hv = c.linear_num_value_heads / t;
    const int64_t dk = c.linear_key_head_dim, dvh = c.linear_value_head_dim;
    const int64_t qk = Hk * dk, vd = Hv * dvh, C = 2 * qk + vd, K = c.linear_conv_kernel_dim;
    // Under FP8 in_proj and out_proj keep their inputs quantized (Megatron sets no
    // set_save_original_input on GatedDeltaNet's projections).
    ctx.add("in_proj", ctx.gemm_input(ctx.tokens * c.hidden_size, ctx.input));
    ctx.add("conv1d", T * C * e + b * C * (s + K - 1) * e);
    ctx.add("prepare_input_for_gated_delta_rule",
            T * 2 * qk * e + T * 2 * Hk * up + 2 * T * Hv * up + 2 * Hv * e + T * Hv * e);
    ctx.add("gated_delta_rule", (Hv > Hk ? 2 * T * Hv * dk * e : 0) + T * vd * e + T * Hv * up);
    if (ctx.plan.recomputes(RecomputeModule::kGdnNormOut)) {
      ctx.add("out_norm", 2 * T * vd * e + ctx.snapshot);
      // The norm's output is freed; out_proj's quantized copy of it is not.
      if (ctx.fp8) ctx.add("out_proj", ctx.gemm_input(T * vd, 0));
      return;
    }
    ctx.add("out_norm",
            2 * T * vd * e + 2 * T * vd * up + ctx.norm_statistics(T * Hv) + ctx.norm_scale(dvh));
    ctx.add("out_proj", ctx.gemm_input(T * vd, T * vd * e));
  }
  bool paper_describes(const TransformerConfig&) const override { return false; }
  PartParameters parameters(const TransformerConfig& c) const override {
    const int64_t h = c.hidden_size, norm = c.use_rmsnorm() ? 1 : 2;
    const int64_t qk = c.linear_num_key_heads * c.linear_key_head_dim;
    const int64_t vd = c.linear_num_value_heads * c.linear_value_head_dim;
    const int64_t Hv = c.linear_num_value_heads;
    PartParameters p;
    p.sharded =
        h * (2 * qk + 2 * vd + 2 * Hv) + (2 * qk + vd) * c.linear_conv_kernel_dim + 2 * Hv + vd * h;
    p.replicated = c.linear_value_head_dim * norm;
    return p;
  }
  PartFlops megatron_flops(const TransformerConfig& c) const override {
    // transformer_flops' GatedDeltaNet terms: in_proj, the convolution, the rule (4 dv^2 per
    // value head) and out_proj; nothing grows with the sequence.
    const double E = 3.0, F = 2.0, h = static_cast<double>(c.hidden_size);
    const double qk_dim = static_cast<double>(c.linear_key_head_dim * c.linear_num_key_heads);
    const double v_head = static_cast<double>(c.linear_value_head_dim);
    const double v_heads = static_cast<double>(c.linear_num_value_heads);
    const double v_dim = v_head * v_heads;
    const double in_proj = 2.0 * qk_dim + 2.0 * v_dim + 2.0 * v_heads;
    PartFlops f;
    f.per_token =
        E * F *
        (h * in_proj + static_cast<double>(c.linear_conv_kernel_dim) * (2.0 * qk_dim + v_dim) +
         v_heads * v_head * v_head * 4.0 + h * v_dim);
    return f;
  }
  PeakTerms peak_terms(const TransformerConfig& c, double e) const override {
    // in_proj, conv1d, A_log, dt_bias, out_norm, out_proj with the column-parallel biases' 3h,
    // split t ways; its largest tensors in_proj's output [s, b, P/t] and the convolution's
    // [b, C/t, s + K - 1]. Its backward runs the chunked rule again under autograd (Note [One
    // node for the gated delta rule]): for the duration of one layer's backward its chunk
    // intermediates and their gradients exist, per (batch row, value head) and padded token at
    // most ~12 dk + 8 dv + 6 C + 8 compute-type elements each (the prepared inputs, the decay,
    // system, solution and within-chunk matrices, the chunk outputs and states), twice over.
    const double h = static_cast<double>(c.hidden_size),
                 t = static_cast<double>(c.tensor_model_parallel_size);
    const double s = static_cast<double>(c.seq_length), b = static_cast<double>(c.micro_batch_size);
    const double qk = static_cast<double>(c.linear_num_key_heads * c.linear_key_head_dim);
    const double vd = static_cast<double>(c.linear_num_value_heads * c.linear_value_head_dim);
    const double hv = static_cast<double>(c.linear_num_value_heads);
    const double dk = static_cast<double>(c.linear_key_head_dim);
    const double dv = static_cast<double>(c.linear_value_head_dim);
    const double K = static_cast<double>(c.linear_conv_kernel_dim);
    const double in = 2.0 * qk + 2.0 * vd + 2.0 * hv, conv = 2.0 * qk + vd;
    PeakTerms p;
    p.parameters = (h * in + conv * K + 2.0 * hv + 2.0 * dv + vd * h + 3.0 * h) / t;
    p.largest_tensor = std::max(s * b * in / t, b * conv / t * (s + K)) * e;
    const double chunk = 64.0, spad = std::ceil(s / chunk) * chunk, u = e == 2.0 ? 4.0 : e;
    p.backward_bytes =
        2.0 * b * hv / t *
        (spad * (12.0 * dk + 8.0 * dv + 6.0 * chunk + 8.0) + spad / chunk * 2.0 * dk * dv) * u;
    return p;
  }
  // Note [Analytic GatedDeltaNet]
  // The paper has no terms for a GatedDeltaNet layer: the analytic planner takes its bytes from
  // the exact predictor (Note [Analytic terms from the exact predictor] in plan_analytic.cpp), so
  // its tensors are none here. Its forward (T = s b tokens, Hk key heads of dk, Hv value heads
  // of dv, qk = Hk dk, v = Hv dv, C = 2 qk + v, all over t): in_proj 2 T h (2 qk + 2 v + 2 Hv),
  // out_proj 2 T v h as GEMMs; the chunked rule (chunks of c = 64, Yang et al. 2024 §3.2) per
  // token and value head 6 dk dv (the state's read, update and the inter-chunk output) plus
  // 2 c (3 dk + 2 dv) (K K^T, the WY products, Q K^T and the intra-chunk output), also at the
  // matmul rate; the convolution and its SiLU 8 T C bytes, the q/k l2 norms 8 T qk, the gated
  // output norm 6 T v (what gdn_norm_out recompute repeats).
  AnalyticTerms analytic_terms(const PaperShape& m) const override {
    TORCH_CHECK(m.config != nullptr,
                "actmem::estimate_plans_analytic: a GatedDeltaNet layer needs "
                "the configuration it was read from");
    const TransformerConfig& c = *m.config;
    const double sb = m.s * m.b, t = m.t, h = m.h;
    const double Hk = static_cast<double>(c.linear_num_key_heads);
    const double Hv = static_cast<double>(c.linear_num_value_heads);
    const double dk = static_cast<double>(c.linear_key_head_dim);
    const double dv = static_cast<double>(c.linear_value_head_dim);
    const double qkw = Hk * dk, vd = Hv * dv, C = 2 * qkw + vd, chunk = 64;
    const double in_proj = 2 * sb * h * (2 * qkw + 2 * vd + 2 * Hv) / t;
    const double out_proj = 2 * sb * vd * h / t;
    const double rule = sb * Hv / t * (6 * dk * dv + 2 * chunk * (3 * dk + 2 * dv));
    AnalyticTerms a;
    a.work = {{in_proj + out_proj + rule, 8 * sb * C / t + 8 * sb * qkw / t, {}},
              {0.0, 6 * sb * vd / t, {RecomputeModule::kGdnNormOut}}};
    return a;
  }
  std::vector<RecomputeModule> estimate_units(const TransformerConfig&) const override {
    return {RecomputeModule::kGdnNormOut};
  }
  std::string summary(const TransformerConfig& c, int64_t layers) const override {
    return std::to_string(layers) + " GatedDeltaNet layers (" +
           std::to_string(c.linear_num_key_heads) + " key heads of " +
           std::to_string(c.linear_key_head_dim) + ", " + std::to_string(c.linear_num_value_heads) +
           " value heads of " + std::to_string(c.linear_value_head_dim) + ", kernel " +
           std::to_string(c.linear_conv_kernel_dim) + ")";
  }
};
}  // namespace

const LayerPart& gated_delta_net_part() {
  static const GatedDeltaNetPart part;
  return part;
}

}  // namespace actmem
