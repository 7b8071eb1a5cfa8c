// mlp_part.cpp — the contract of the MLP part "mlp" (mlp.h): a dense layer's MLP. What it saves
// for the backward, Korthikanti's terms for its modules, its parameters, FLOPs and the memory
// pre-check's terms.
#include "actmem/model/mlp/mlp.h"

#include "actmem/model/fp8.h"

#include <algorithm>

namespace actmem {

namespace {
class MlpPart final : public LayerPart {
 public:
  const char* name() const override { return "mlp"; }
  PartSlot slot() const override { return PartSlot::kMlp; }
  std::shared_ptr<PartModule> build(const TransformerConfig& config, const LayerPlan& plan, int64_t,
                                    at::ScalarType dtype) const override {
    return std::make_shared<MLP>(config, dtype, plan);
  }

  // linear_fc1 keeps its input (the norm output), the activation its input (GeLU: fc1's output
  // sbf; SwiGLU: fc1's 2sbf and silu's output sbf), linear_fc2 the activation's output sbf, per
  // rank over the whole sequence's s b tokens and f/t columns. Under selective "mlp" the
  // checkpoint keeps its input and a snapshot.
  void saved_bytes(const SavedBytesContext& ctx) const override {
    const TransformerConfig& c = ctx.config;
    const int64_t sbf = c.seq_length * c.micro_batch_size * c.ffn() / c.tensor_model_parallel_size;
    if (ctx.plan.recomputes(RecomputeModule::kMlp)) {
      ctx.add("", ctx.input + ctx.snapshot);
      return;
    }
    // Under FP8 the GEMMs keep their inputs quantized; fc1 keeps the norm's output itself when
    // selective layernorm recompute frees it (MLP::use_fp8).
    ctx.add("linear_fc1",
            ctx.gemm_input(ctx.tokens * c.hidden_size, ctx.input,
                           fp8_keeps_recomputed_norm_output(c.fp8_recipe == "delayed", ctx.plan)));
    ctx.add("activation_func", c.gated_linear_unit ? 3 * sbf * ctx.e : sbf * ctx.e);
    ctx.add("linear_fc2", ctx.gemm_input(sbf, sbf * ctx.e));
  }
  // Korthikanti et al.'s MLP terms (Table 2, 16-bit terms scaled to `dtype_bytes`): fc1's input
  // 2sbh (replicated without SP), its output 8sbh and the GeLU's output 8sbh at ffn = 4h, split
  // t ways.
  ModuleTerms module_terms(const std::string& module, const TransformerConfig& c,
                           int64_t dtype_bytes, bool) const override {
    const double sbh = static_cast<double>(c.seq_length * c.micro_batch_size * c.hidden_size);
    const double k = static_cast<double>(dtype_bytes) / 2.0;
    const double ffn_ratio = static_cast<double>(c.ffn()) / static_cast<double>(c.hidden_size);
    const double t = static_cast<double>(c.tensor_model_parallel_size);
    ModuleTerms x;
    if (module == "linear_fc1") x.paper = 2 * sbh * k / (c.sequence_parallel ? t : 1.0);
    if (module == "activation_func" || module == "linear_fc2")
      x.paper = 2 * ffn_ratio * sbh * k / t;
    if (module == "activation_func" && c.gated_linear_unit) {
      const int64_t sbf_t =
          c.seq_length * c.micro_batch_size * c.ffn() / c.tensor_model_parallel_size;
      x.beyond = 2 * sbf_t * c.element_bytes();
      x.what = "SwiGLU: fc1's output is 2f wide, plus silu's output";
    }
    return x;
  }
  bool paper_describes(const TransformerConfig&) const override { return true; }
  PartParameters parameters(const TransformerConfig& c) const override {
    // Megatron's MLP: fc1 column-parallel (its bias split too), fc2 row-parallel (its bias
    // replicated).
    const int64_t h = c.hidden_size, bias = c.add_bias_linear ? 1 : 0, f = c.ffn();
    const int64_t fc1 = c.gated_linear_unit ? 2 * f : f;
    PartParameters p;
    p.sharded = h * fc1 + bias * fc1 + f * h;
    p.replicated = bias * h;
    return p;
  }
  PartFlops megatron_flops(const TransformerConfig& c) const override {
    // transformer_flops: 3 x 2 x h x ffn x (3 with SwiGLU's gate, else 2).
    const double E = 3.0, F = 2.0, h = static_cast<double>(c.hidden_size);
    PartFlops f;
    f.per_token = E * F * h * (static_cast<double>(c.ffn()) * (c.gated_linear_unit ? 3.0 : 2.0));
    return f;
  }
  PeakTerms peak_terms(const TransformerConfig& c, double e) const override {
    // fc1 (2f wide with SwiGLU) and fc2 with fc1's bias, split t ways; fc1's weight and output.
    const double h = static_cast<double>(c.hidden_size), f = static_cast<double>(c.ffn());
    const double t = static_cast<double>(c.tensor_model_parallel_size);
    const double fc1 = c.gated_linear_unit ? 2.0 * f : f;
    PeakTerms p;
    p.parameters = (h * fc1 + f * h + fc1) / t;
    p.largest_parameter = h * fc1 / t * e;
    p.largest_tensor =
        static_cast<double>(c.seq_length) * static_cast<double>(c.micro_batch_size) * fc1 / t * e;
    return p;
  }
  // The paper's MLP terms (Korthikanti et al. 2022 §4.1): fc1's input, the norm output 2sbh
  // (replicated without SP; layernorm drops it), fc1's output 2sb ffn (both halves with SwiGLU)
  // and the activation's output 2sb ffn (mlp drops both), split t ways. Its forward: fc1 and fc2
  // GEMMs, the activation reading fc1's output and writing its own.
  AnalyticTerms analytic_terms(const PaperShape& m) const override {
    const double sb = m.s * m.b, sbh = m.sbh(), t = m.t, r = m.sp ? m.t : 1.0;
    const double gated = m.swiglu ? 2.0 : 1.0;
    AnalyticTerms a;
    a.tensors = {{2 * sbh / r, {RecomputeModule::kLayernorm}, std::nullopt},
                 {2 * gated * sb * m.ffn / t, {RecomputeModule::kMlp}, std::nullopt},
                 {2 * sb * m.ffn / t, {RecomputeModule::kMlp}, std::nullopt}};
    const double fc1 = 2 * sbh * m.ffn * gated / t, fc2 = 2 * sbh * m.ffn / t;
    a.work = {{fc1 + fc2, (2 * gated + 2) * sb * m.ffn / t, {RecomputeModule::kMlp}}};
    return a;
  }
  std::vector<RecomputeModule> estimate_units(const TransformerConfig&) const override {
    return {RecomputeModule::kMlp};
  }
};
}  // namespace

const LayerPart& mlp_part() {
  static const MlpPart part;
  return part;
}

}  // namespace actmem
