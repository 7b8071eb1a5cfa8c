// moe_part.cpp — the contract of the MLP part "moe" (moe.h): an MoE layer's router, experts and
// shared experts. What it saves for the backward (Note [What an MoE layer saves]), its
// parameters, FLOPs and the memory pre-check's terms.
#include "actmem/model/moe/moe.h"

#include "actmem/base/report.h"
#include "actmem/model/part_estimate.h"

#include "actmem/model/moe/moe_rows.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <iomanip>
#include <sstream>

namespace actmem {

// Note [What an MoE layer saves] (T = s*b tokens, N rows the experts compute, E experts,
// k = topk, f = each expert's ffn, fs = the shared experts' ffn; fp32 parts are 4 bytes at every
// precision, as the router computes its scores in fp32; ledger of `actmem inspect --records`):
//   router            its input (the norm output; counted by the shared experts when they run
//                     first) Th·e; z-loss: the fp32 logits TE·4 and their logsumexp T·4;
//                     top-k indices Tk·8 and the fp32 softmax over the top-k Tk·4 (pre-softmax:
//                     the fp32 softmax over all experts TE·4; sigmoid: its output TE·4, and with
//                     k > 1 the top-k scores Tk·4 and their sum T·4); capacity: the kept-pairs
//                     mask TE (bool); load-balancing loss: the fp32 scores over all experts TE·4
//                     (sigmoid: plus their sum T·4) and the token counts E·4
//   token_dispatcher  the token index and the flat (expert, token) index, N·8 each
//   experts           linear_fc1: the permuted tokens Nh·e; activation_func: GeLU its input
//                     Nf·e and output Nf·e (SwiGLU: fc1's 2Nf·e, silu's Nf·e, the gated product
//                     Nf·e), the permuted probabilities N·e, expert dropout's mask Nf; moe_act
//                     recompute instead keeps fc1's output and the probabilities (and a
//                     snapshot); linear_fc2: its input Nf·e (0 with moe_act recompute)
//   shared_experts    a dense MLP of ffn fs (its linear_fc1 counts the norm output), the gate's
//                     sigmoid T·e and the gated MLP output Th·e
// Biases are parameters; fc2's bias times the probability keeps only the probabilities.
//
MoELayerBytes paper_moe_layer_bytes(const PaperShape& m) {
  const MoEPaperShape& e = m.moe;
  TORCH_CHECK(e.experts >= 1 && e.topk >= 1 && e.topk <= e.experts && e.ffn > 0,
              "actmem::paper_moe_layer_bytes: needs experts >= 1, 1 <= topk <= experts and an "
              "expert ffn > 0");
  TORCH_CHECK(m.t == 1 || m.sp,
              "actmem::paper_moe_layer_bytes: MoE with tensor parallelism "
              "needs sequence parallelism (Megatron refuses it otherwise)");
  const double sb = m.s * m.b, t = m.t, h = m.h, E = e.experts, k = e.topk;
  double rows = sb * k;
  if (e.capacity_factor > 0) {
    const double cap = std::min(std::ceil(sb * k / E * e.capacity_factor), sb);
    rows = e.pad_to_capacity ? E * cap : std::min(sb * k, E * cap);
  }
  MoELayerBytes r;
  r.rows = rows;
  r.router = (2 * sb * h + 8 * sb * k + 4 * sb * k + (e.aux_loss ? 4 * sb * E + 4 * E : 0) +
              (e.z_loss ? 4 * sb * E + 4 * sb : 0) + (e.capacity_factor > 0 ? sb * E : 0)) /
             t;
  r.dispatch = 16 * rows + 2 * rows + 2 * rows * h;
  r.experts = (m.swiglu ? 10 : 6) * rows * e.ffn / t;
  r.shared = (m.swiglu ? 8 : 4) * sb * e.shared_ffn / t;
  const double sq = paper_squared_term(m);
  const double attention = m.sbh() * (13.0 + sq) / t;
  const double norm_and_mask = 3 * m.sbh() / t;
  r.layer.none = attention + norm_and_mask + r.mlp();
  r.layer.selective = 13.0 * m.sbh() / t + norm_and_mask + r.mlp();
  r.layer.full = 2.0 * m.sbh() / t;
  r.layer.s2_fraction = sq * m.sbh() / t / r.layer.none;
  return r;
}

namespace {
class MoePart final : public LayerPart {
 public:
  const char* name() const override { return "moe"; }
  PartSlot slot() const override { return PartSlot::kMlp; }
  std::shared_ptr<PartModule> build(const TransformerConfig& config, const LayerPlan& plan,
                                    int64_t layer_number, at::ScalarType dtype) const override {
    return std::make_shared<MoELayer>(config, plan, layer_number, dtype);
  }

  void saved_bytes(const SavedBytesContext& ctx) const override {
    const TransformerConfig& c = ctx.config;
    const LayerPlan& lp = ctx.plan;
    const int64_t e = ctx.e, t = c.tensor_model_parallel_size;
    if (lp.recomputes(RecomputeModule::kMoe)) {
      ctx.add("", ctx.input + ctx.snapshot);
      return;
    }
    // The rows the experts compute: the router's measured counts, exact up front where the
    // routing cannot change them, or at the most (the memory pre-check's bound).
    const MoELayerRouting* lr = moe_layer_routing(ctx.routing, ctx.kind_index);
    std::optional<int64_t> rows = moe_expert_rows(c, ctx.kind_index, ctx.routing);
    MoELayerRouting bound;
    if (!rows && ctx.upper_bound) {
      rows = moe_max_expert_rows(c);
      bound = MoELayerRouting({*rows}, moe_max_routed_rows(c));
      lr = &bound;
    }
    TORCH_CHECK(rows.has_value(),
                "actmem::predict_activation_bytes: with a capacity factor and "
                "no padding the experts' rows depend on the routing; pass the router's counts "
                "(MoEStats::routing()) for MoE layer ",
                ctx.kind_index);
    // T: the tokens this rank routes (s/t of the sequence with sequence parallelism); the
    // experts and the shared experts hold their 1/t column slices (expert tensor parallelism).
    const int64_t N = *rows, T = ctx.tokens, E = c.num_moe_experts, k = c.moe_router_topk;
    const int64_t h = c.hidden_size;
    const int64_t fm = c.moe_ffn() / t, fc1w = c.gated_linear_unit ? 2 * fm : fm;
    int64_t router_in = ctx.input;
    if (c.moe_shared_expert_intermediate_size) {
      // A dense MLP on the tensor-parallel group: its activations cover all s*b tokens, fs/t
      // columns (with sequence parallelism fc1 keeps the s/t shard, the norm output).
      const int64_t fs = *c.moe_shared_expert_intermediate_size / t;
      const int64_t Tf = c.seq_length * c.micro_batch_size;
      if (lp.recomputes(RecomputeModule::kSharedExperts)) {
        ctx.add("shared_experts", ctx.input + ctx.snapshot);
      } else {
        ctx.add("shared_experts.linear_fc1", ctx.input);
        ctx.add("shared_experts.activation_func", (c.gated_linear_unit ? 3 : 1) * Tf * fs * e);
        ctx.add("shared_experts.linear_fc2", Tf * fs * e);
        if (c.moe_shared_expert_gate) ctx.add("shared_experts", T * e + T * h * e);
      }
      router_in = 0;  // counted by the shared experts
    }
    int64_t router = router_in;
    if (c.moe_z_loss_coeff && *c.moe_z_loss_coeff > 0.0) router += T * E * 4 + T * 4;
    router += T * k * 8;  // the top-k indices
    if (c.moe_router_score_function == "softmax") {
      router += c.moe_router_pre_softmax ? T * E * 4 : T * k * 4;
    } else {
      router += T * E * 4 + (k > 1 ? T * k * 4 + T * 4 : 0);
    }
    if (c.moe_expert_capacity_factor) router += T * E;
    if (c.moe_router_load_balancing_type == "aux_loss" && c.moe_aux_loss_coeff > 0.0) {
      router += T * E * 4 + E * 4 + (c.moe_router_score_function == "sigmoid" ? T * 4 : 0);
    }
    ctx.add("router", router);
    // The permutation's indices: of the rows this rank routed with the all-to-all dispatcher
    // (the rows travel; their indices stay), of the rows its experts compute otherwise (the
    // all-gather dispatcher permutes the gathered tokens of its own experts).
    int64_t routed = N;
    if ((c.expert_model_parallel_size > 1 || t > 1) && c.moe_token_dispatcher_type == "alltoall") {
      routed =
          lr != nullptr && lr->dispatched_rows >= 0 ? lr->dispatched_rows : moe_max_routed_rows(c);
    }
    ctx.add("token_dispatcher", 2 * routed * 8);
    // What the experts keep for n of their rows (the probabilities apart).
    auto act_bytes = [&](int64_t n) {
      const int64_t mask = c.moe_expert_dropout > 0.0 ? n * fm : 0;
      return (c.gated_linear_unit ? 4 * n * fm * e : 2 * n * fm * e) + mask;
    };
    if (c.moe_grouped_gemm) {
      ctx.add("experts.linear_fc1", N * h * e);
      if (lp.recomputes(RecomputeModule::kMoeAct)) {
        ctx.add("experts.activation_func", N * fc1w * e + N * e + ctx.snapshot);
      } else {
        ctx.add("experts.activation_func", act_bytes(N) + N * e);
        ctx.add("experts.linear_fc2", N * fm * e);
      }
      return;
    }
    // SequentialMLP: the experts' inputs and probabilities are views of the permuted tensors,
    // counted where expert 0 first saves them; the rest is per expert, which takes the routing.
    const std::vector<int64_t>* counts = lr != nullptr ? &lr->expert_rows : nullptr;
    if (counts == nullptr) {
      ctx.add("experts.local_experts", N * h * e + act_bytes(N) + N * e + N * fm * e);
      return;
    }
    for (size_t j = 0; j < counts->size(); ++j) {
      const std::string ex = "experts.local_experts." + std::to_string(j);
      const int64_t n = (*counts)[j];
      ctx.add(ex + ".linear_fc1", j == 0 ? N * h * e : 0);
      ctx.add(ex + ".activation_func", act_bytes(n) + (j == 0 ? N * e : 0));
      ctx.add(ex + ".linear_fc2", n * fm * e);
    }
  }
  bool paper_describes(const TransformerConfig&) const override { return true; }
  PartParameters parameters(const TransformerConfig& c) const override {
    // The router (replicated), the shared experts (a dense MLP on the tensor-parallel group)
    // and their gate (replicated); the routed experts, each split over the t expert-tensor
    // ranks but for fc2's bias (added after the reduction, replicated), E/e of them on a rank.
    const int64_t h = c.hidden_size, bias = c.add_bias_linear ? 1 : 0;
    const int64_t fm = c.moe_ffn(), fc1 = c.gated_linear_unit ? 2 * fm : fm;
    const int64_t expert = h * fc1 + fm * h + bias * (fc1 + h);
    PartParameters p;
    p.replicated = c.num_moe_experts * h + bias * c.num_moe_experts;
    if (c.moe_shared_expert_intermediate_size) {
      const int64_t fs = *c.moe_shared_expert_intermediate_size,
                    sfc1 = c.gated_linear_unit ? 2 * fs : fs;
      p.sharded += h * sfc1 + bias * sfc1 + fs * h;
      p.replicated += bias * h + (c.moe_shared_expert_gate ? h : 0);
    }
    p.experts = c.num_moe_experts * expert;
    p.active_experts = c.moe_router_topk * expert;
    const double t = static_cast<double>(c.tensor_model_parallel_size);
    const double e = static_cast<double>(c.expert_model_parallel_size);
    p.experts_on_rank =
        static_cast<double>(c.num_moe_experts) / e *
        (static_cast<double>(expert - bias * h) / t + static_cast<double>(bias * h));
    return p;
  }
  PartFlops megatron_flops(const TransformerConfig& c) const override {
    // transformer_flops: the top-k routed experts and the shared experts, each as a dense MLP.
    const double E = 3.0, F = 2.0, h = static_cast<double>(c.hidden_size);
    const double factor = c.gated_linear_unit ? 3.0 : 2.0;
    const double shared = static_cast<double>(c.moe_shared_expert_intermediate_size.value_or(0));
    PartFlops f;
    f.per_token =
        E * F * h *
        (static_cast<double>(c.moe_ffn()) * static_cast<double>(c.moe_router_topk) * factor +
         shared * factor);
    return f;
  }
  PeakTerms peak_terms(const TransformerConfig& c, double e) const override {
    // The router, every expert and the shared experts unsplit (an upper bound); an expert's fc1
    // weight; the experts' [N, fc1] rows at the most the routing can give them, and the router's
    // fp32 scores [T, E]; four parameter tensors per expert.
    const double h = static_cast<double>(c.hidden_size), E = static_cast<double>(c.num_moe_experts);
    const double fm = static_cast<double>(c.moe_ffn()), fc1m = c.gated_linear_unit ? 2.0 * fm : fm;
    const double T = static_cast<double>(c.seq_length * c.micro_batch_size);
    PeakTerms p;
    p.parameters = E * h + E + E * (h * fc1m + fc1m + fm * h + h);
    if (c.moe_shared_expert_intermediate_size) {
      const double fs = static_cast<double>(*c.moe_shared_expert_intermediate_size);
      p.parameters += h * (c.gated_linear_unit ? 2.0 * fs : fs) + fs * h + h;
    }
    p.largest_parameter = h * fc1m * e;
    p.largest_tensor =
        std::max(static_cast<double>(moe_max_expert_rows(c)) * std::max(fc1m, h) * e, T * E * 4.0);
    p.parameter_tensors = 4.0 * E;
    return p;
  }
  // Note [Analytic MoE]
  // The terms of paper_moe_layer_bytes(): the router's input is the pre-MLP norm's output
  // (layernorm drops it), the rest of `router` its own; of the dispatch the 2Nh permuted tokens
  // are the experts' fc1 input (expert_fc1 moves them), the index vectors and probabilities
  // stay; the experts' fc1 output (SwiGLU 4Nf/t, GeLU 2Nf/t) is the activation's input (moe_act
  // offload moves it; moe_act recompute keeps it as its checkpoint's input and drops what the
  // activation made from it: SwiGLU's SiLU output, gated product and fc2's input 6Nf/t, GeLU's
  // output and fc2's input 4Nf/t); shared_experts recompute drops the shared experts' tensors,
  // moe recompute everything of the MoE layer but its input. The routing is taken as balanced
  // (N = s*b*topk rows, Megatron's dropless dispatch; the capacity bound otherwise). Its forward:
  // the router's GEMM over the rank's tokens; the experts' GEMMs over N rows (all of the tensor-
  // parallel group's, their columns split t ways), the activation and the probabilities'
  // product read and written, the tokens permuted and unpermuted; the shared experts' dense MLP.
  AnalyticTerms analytic_terms(const PaperShape& m) const override {
    const MoELayerBytes e = paper_moe_layer_bytes(m);
    const double sb = m.s * m.b, sbh = m.sbh(), t = m.t, r = m.sp ? m.t : 1.0, h = m.h;
    const double gated = m.swiglu ? 2.0 : 1.0;
    const double N = e.rows, f = m.moe.ffn, fs = m.moe.shared_ffn;
    const double input = 2 * sbh / r, expert_in = 2 * N * h;
    const double expert_act_in = 2 * gated * N * f / t;
    using R = RecomputeModule;
    AnalyticTerms a;
    a.tensors = {{input, {R::kLayernorm}, std::nullopt},
                 {e.router - input, {R::kMoe}, std::nullopt},
                 {e.dispatch - expert_in, {R::kMoe}, std::nullopt},
                 {expert_in, {R::kMoe}, OffloadModule::kExpertFc1},
                 {expert_act_in, {R::kMoe}, OffloadModule::kMoeAct},
                 {e.experts - expert_act_in, {R::kMoe, R::kMoeAct}, std::nullopt},
                 {e.shared, {R::kMoe, R::kSharedExperts}, std::nullopt}};
    const double router = 2 * sb / r * h * m.moe.experts;
    const double experts = 2 * N * h * f * (gated + 1) / t;
    const double permute = 2 * 2 * (2 * N * h + 2 * sbh / r);
    a.work = {{router + experts, permute, {R::kMoe}},
              {0.0, ((2 * gated + 2) + 4) * N * f / t, {R::kMoe, R::kMoeAct}},
              {2 * sbh * fs * (gated + 1) / t,
               (2 * gated + 2) * sb * fs / t,
               {R::kMoe, R::kSharedExperts}}};
    return a;
  }
  /// The grouped experts' fc1 input (expert_fc1) and activation (moe_act), Megatron's groups in
  /// TEGroupedMLP.
  std::optional<OffloadModule> offload_group(const std::string& module) const override {
    auto ends = [&module](const std::string& suffix) {
      return module.size() >= suffix.size() &&
             module.compare(module.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (module.rfind("experts.", 0) != 0) return std::nullopt;
    if (ends(".linear_fc1")) return OffloadModule::kExpertFc1;
    if (ends(".activation_func")) return OffloadModule::kMoeAct;
    return std::nullopt;
  }
  // An MoE layer is paper_moe_layer_bytes()'s whole layer (its attention half the paper's).
  LayerBytes paper_layer_bytes(const PaperShape& m, const LayerBytes&) const override {
    return paper_moe_layer_bytes(m).layer;
  }
  void paper_estimate(const PartEstimateContext& ctx, PartEstimate& out) const override {
    const PaperShape& m = ctx.m;
    const MoELayerBytes moe = paper_moe_layer_bytes(m);
    const LayerBytes &layer = ctx.layer, &dense = ctx.layer_with_paper_mlp;
    out.json = {{"num_experts", m.moe.experts},
                {"topk", m.moe.topk},
                {"ffn", m.moe.ffn},
                {"shared_ffn", m.moe.shared_ffn},
                {"capacity_factor", m.moe.capacity_factor},
                {"moe_layers", m.moe.layers},
                {"moe_layers_in_first_stage", ctx.layers_in_stage},
                {"rows_per_layer", moe.rows},
                {"per_moe_layer_bytes",
                 {{"none", layer.none}, {"selective", layer.selective}, {"full", layer.full}}},
                {"terms",
                 {{"router", moe.router},
                  {"dispatch", moe.dispatch},
                  {"experts", moe.experts},
                  {"shared_experts", moe.shared}}},
                {"dense_layer_bytes", {{"none", dense.none}, {"selective", dense.selective}}}};
    auto n = [](double x) { return static_cast<int64_t>(x); };
    std::ostringstream os;
    os << "\nMoE: " << n(m.moe.layers) << " of " << n(m.L) << " layers (" << n(ctx.layers_in_stage)
       << " in the first stage), " << n(m.moe.experts) << " experts top-" << n(m.moe.topk)
       << " of ffn " << n(m.moe.ffn)
       << (m.moe.shared_ffn > 0 ? ", shared experts ffn " + c10::str(n(m.moe.shared_ffn)) : "")
       << ", "
       << (m.moe.capacity_factor > 0 ? "capacity factor " + c10::str(m.moe.capacity_factor)
                                     : std::string("dropless"))
       << "; the experts compute " << n(moe.rows) << " rows per layer\n"
       << "  per MoE layer: none " << format_bytes_3sig(layer.none) << ", selective "
       << format_bytes_3sig(layer.selective) << ", full " << format_bytes_3sig(layer.full)
       << " (a dense layer: none " << format_bytes_3sig(dense.none) << ")\n"
       << "  of which router " << format_bytes_3sig(moe.router) << ", dispatch "
       << format_bytes_3sig(moe.dispatch) << ", experts " << format_bytes_3sig(moe.experts)
       << ", shared experts " << format_bytes_3sig(moe.shared) << "\n"
       << "  the per-layer and per-stage figures above are the first stage's mix of dense "
          "and MoE layers; Megatron's theoretical_memory_usage counts every layer as dense\n";
    out.section = os.str();
    if (ctx.weights != nullptr) {
      std::ostringstream w;
      w << std::fixed << std::setprecision(2) << "  active per token "
        << ctx.weights->active_parameters / 1e9 << " B (top-" << n(m.moe.topk)
        << " of the routed experts); routed experts on this rank "
        << ctx.weights->expert_parameters_on_rank / 1e9
        << " B (split etp x ep = " << n(m.moe.etp > 0 ? m.moe.etp : m.t) << " x " << n(m.moe.ep)
        << ")\n";
      out.weights = w.str();
    }
  }
  std::vector<RecomputeModule> estimate_units(const TransformerConfig& c) const override {
    std::vector<RecomputeModule> units;
    if (c.moe_grouped_gemm) units.push_back(RecomputeModule::kMoeAct);
    if (c.moe_shared_expert_intermediate_size) units.push_back(RecomputeModule::kSharedExperts);
    return units;
  }
  std::string summary(const TransformerConfig& c, int64_t layers) const override {
    std::ostringstream out;
    out << layers << " MoE layers of " << c.num_moe_experts << " experts top-" << c.moe_router_topk
        << " (ffn " << c.moe_ffn() << ")";
    if (c.moe_shared_expert_intermediate_size) {
      out << " and a shared expert (ffn " << *c.moe_shared_expert_intermediate_size << ")";
    }
    if (c.expert_model_parallel_size > 1)
      out << ", expert parallel " << c.expert_model_parallel_size;
    return out.str();
  }
};
}  // namespace

const LayerPart& moe_part() {
  static const MoePart part;
  return part;
}

}  // namespace actmem
