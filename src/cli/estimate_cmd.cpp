// estimate_cmd.cpp — `actmem estimate`: the paper's activation-memory model for a named preset or
// the model train's flags describe, per layer and per pipeline stage, with Megatron's theoretical
// terms and the offload transfer time.
#include "actmem/base/report.h"
#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/flags/presets.h"
#include "actmem/flags/train_options.h"
#include "actmem/memory/memory_model.h"
#include "commands.h"

#include <CLI/CLI.hpp>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <vector>

namespace actmem::cli {

namespace {

struct EstimateOptions {
  TrainOptions model;  // the shape, parallel and MoE/MLA flags train takes
  DescribedLayout layout;
  std::string preset;  // "" = the model of the sizes given (expand_model_preset sets the default)
  double bandwidth_gbps = 50.0;
  bool json = false;
};

// Everything the table and the JSON print, computed once.
struct Estimate {
  PaperShape m;
  std::string preset, base_name;
  std::string attention;  // TransformerConfig::attention_summary()
  double bandwidth_gbps = 0;
  MLAAttentionBytes mla;
  LayerBytes dense_layer, layer;  // `layer`: the first stage's mean with MoE layers in it
  MoELayerBytes moe_layer;
  double moe_in_stage = 0, per_stage = 0, selective_stage = 0, offload_s = 0, megatron = 0;
  WeightMemory w;
  std::vector<double> stage_in_flight;  // per stage, in micro-batches of the whole stage
  const char* schedule() const { return m.vpp ? "interleaved 1F1B" : "1F1B"; }
  // Weights, gradients and optimizer, plus the first stage's activations in flight.
  double device_total(double per_layer) const {
    return w.total() + per_layer * per_stage * stage_in_flight.front();
  }
};

// Stage r's micro-batches in flight at its peak, in micro-batches of the whole stage (every
// chunk): 1F1B min(p - r, M) (Korthikanti eq. 5: the first stage holds p); interleaved with v
// chunks and groups of p micro-batches, min(2 (p - r - 1) + (v - 1) p + 1, M v) chunk-micro-
// batches (Megatron's warmup plus the first steady forward), so p (1 + (p - 1)/(p v)) on the
// first stage (Korthikanti's interleaved factor). M unset: as many as the schedule can use.
std::vector<double> stages_in_flight(const PaperShape& m) {
  std::vector<double> out;
  for (int r = 0; r < static_cast<int>(m.p); ++r) {
    const double rest = m.p - r - 1;
    if (m.vpp) {
      const double chunks = 2 * rest + (*m.vpp - 1) * m.p + 1;
      out.push_back((m.num_microbatches ? std::min(chunks, *m.num_microbatches * *m.vpp) : chunks) /
                    *m.vpp);
    } else {
      out.push_back(m.num_microbatches ? std::min(rest + 1, *m.num_microbatches) : rest + 1);
    }
  }
  return out;
}

Estimate compute(const PaperShape& shape, const TransformerConfig& config, double bandwidth_gbps) {
  Estimate e;
  e.m = shape;
  e.attention = config.attention_summary();
  const PaperShape& m = e.m;
  e.bandwidth_gbps = bandwidth_gbps;
  if (m.is_mla()) e.mla = paper_mla_attention_bytes(m);
  // MLA replaces the paper's attention terms (q, k, v inputs and outputs, the scores, the
  // context: (10 sbh + 5as^2b)/t without recompute, 10 sbh/t with selective core_attn; without
  // sequence parallelism the qkv input's 2 sbh is replicated) by its own.
  auto with_mla = [&](LayerBytes l) {
    if (!m.is_mla()) return l;
    const double sq = 5.0 * m.a * m.s * m.s * m.b / m.t;
    const double lin =
        m.sp || m.t == 1.0 ? 10.0 * m.sbh() / m.t : 2.0 * m.sbh() + 8.0 * m.sbh() / m.t;
    l.none += e.mla.none() - (lin + sq);
    l.selective += e.mla.kept(true, false) - lin;
    l.s2_fraction = e.mla.scores / l.none;
    return l;
  };
  e.dense_layer = with_mla(paper_layer_bytes(m));
  e.per_stage = m.layers_per_stage();
  e.layer = e.dense_layer;
  if (m.is_moe()) {
    // The first stage's layers [0, L/p) that are MoE; `layer` is then the stage's mean per
    // layer, so every per-stage total is the mix.
    const std::vector<bool> is_moe = config.moe_layers();
    for (size_t i = 0; i < is_moe.size() && static_cast<double>(i) < e.per_stage; ++i) {
      e.moe_in_stage += is_moe[i] ? 1.0 : 0.0;
    }
    e.moe_layer = paper_moe_layer_bytes(m);
    e.moe_layer.layer = with_mla(e.moe_layer.layer);
    auto mix = [&](double dense, double moe) {
      return (dense * (e.per_stage - e.moe_in_stage) + moe * e.moe_in_stage) / e.per_stage;
    };
    e.layer.none = mix(e.dense_layer.none, e.moe_layer.layer.none);
    e.layer.selective = mix(e.dense_layer.selective, e.moe_layer.layer.selective);
    e.layer.full = mix(e.dense_layer.full, e.moe_layer.layer.full);
  }
  e.selective_stage = e.layer.selective * e.per_stage;
  e.offload_s = offload_round_trip_seconds(e.selective_stage, bandwidth_gbps);
  e.megatron = m.sp ? megatron_activation_memory(m) : megatron_activation_memory_without_sp(m);
  e.w = megatron_weight_and_optimizer_memory(m);
  e.stage_in_flight = stages_in_flight(m);
  return e;
}

nlohmann::json to_json(const Estimate& e) {
  const PaperShape& m = e.m;
  const LayerBytes &layer = e.layer, &dense_layer = e.dense_layer;
  const MoELayerBytes& moe_layer = e.moe_layer;
  const MLAAttentionBytes& mla = e.mla;
  const WeightMemory& w = e.w;
  const std::vector<double>& stage_in_flight = e.stage_in_flight;
  const double per_stage = e.per_stage, selective_stage = e.selective_stage;
  const double moe_in_stage = e.moe_in_stage;
  const double meg = e.megatron, offload_s = e.offload_s;
  const char* schedule = e.schedule();
  auto total = [&e](double per_layer) { return e.device_total(per_layer); };
  nlohmann::json j = {
      {"model",
       {{"seq_length", m.s},
        {"micro_batch_size", m.b},
        {"hidden_size", m.h},
        {"num_attention_heads", m.a},
        {"num_query_groups", m.g > 0 ? m.g : m.a},
        {"num_layers", m.L},
        {"ffn_hidden_size", m.ffn},
        {"vocab_size", m.v},
        {"tensor_model_parallel_size", m.t},
        {"pipeline_model_parallel_size", m.p},
        {"sequence_parallel", m.sp},
        {"swiglu", m.swiglu},
        {"untied", m.untied},
        {"normalization", m.rmsnorm ? "RMSNorm" : "LayerNorm"},
        {"attention_kernel", m.flash ? "flash" : "unfused"},
        {"base", e.preset.empty() ? nlohmann::json(nullptr) : nlohmann::json(e.preset)}}},
      {"per_layer_bytes",
       {{"none", layer.none}, {"selective", layer.selective}, {"full", layer.full}}},
      {"per_stage_bytes",
       {{"none", layer.none * per_stage},
        {"selective", selective_stage},
        {"full", layer.full * per_stage}}},
      {"s2_fraction", layer.s2_fraction},
      {"layers_per_stage", per_stage},
      {"megatron_theoretical_activation_bytes", meg},
      {"weights_and_optimizer",
       {{"parameters", w.parameters},
        {"parameters_on_rank", w.parameters_on_rank},
        {"active_parameters", w.active_parameters},
        {"expert_parameters_on_rank", w.expert_parameters_on_rank},
        {"bytes_per_parameter", w.bytes_per_parameter},
        {"weight_bytes", w.weight_bytes},
        {"gradient_bytes", w.gradient_bytes},
        {"optimizer_bytes", w.optimizer_bytes},
        {"total_bytes", w.total()},
        {"data_parallel_size", m.d},
        {"distributed_optimizer", m.distributed_optimizer},
        {"swiglu", m.swiglu},
        {"untied", m.untied}}},
      {"schedule", schedule},
      {"virtual_pipeline_size", m.vpp ? nlohmann::json(*m.vpp) : nlohmann::json(nullptr)},
      {"per_pipeline_stage",
       [&] {
         nlohmann::json rows = nlohmann::json::array();
         for (size_t r = 0; r < stage_in_flight.size(); ++r) {
           const double n = stage_in_flight[r] * per_stage;
           rows.push_back({{"stage", r}, {"microbatches_in_flight", stage_in_flight[r]},
                           {"activation_bytes", {{"none", layer.none * n},
                                                 {"selective", layer.selective * n},
                                                 {"full", layer.full * n}}}});
         }
         return rows;
       }()},
      {"device_bytes_per_rank",
       {{"none", total(layer.none)},
        {"selective", total(layer.selective)},
        {"full", total(layer.full)},
        {"megatron_theoretical", w.total() + meg}}},
      {"offload",
       {{"bytes_each_way", selective_stage},
        {"bandwidth_gbps", e.bandwidth_gbps},
        {"round_trip_s", offload_s}}}};
  if (m.is_moe()) {
    j["moe"] = {{"num_experts", m.moe.experts}, {"topk", m.moe.topk}, {"ffn", m.moe.ffn},
                {"shared_ffn", m.moe.shared_ffn}, {"capacity_factor", m.moe.capacity_factor},
                {"moe_layers", m.moe.layers}, {"moe_layers_in_first_stage", moe_in_stage},
                {"rows_per_layer", moe_layer.rows},
                {"per_moe_layer_bytes", {{"none", moe_layer.layer.none},
                                         {"selective", moe_layer.layer.selective},
                                         {"full", moe_layer.layer.full}}},
                {"terms", {{"router", moe_layer.router}, {"dispatch", moe_layer.dispatch},
                           {"experts", moe_layer.experts}, {"shared_experts", moe_layer.shared}}},
                {"dense_layer_bytes", {{"none", dense_layer.none},
                                       {"selective", dense_layer.selective}}}};
  }
  if (m.is_mla()) {
    j["mla"] = {{"q_lora_rank", m.mla.q_lora > 0 ? nlohmann::json(m.mla.q_lora) : nlohmann::json(nullptr)},
                {"kv_lora_rank", m.mla.kv_lora}, {"qk_head_dim", m.mla.qk},
                {"qk_pos_emb_head_dim", m.mla.pos}, {"v_head_dim", m.mla.v},
                {"qk_layernorm", m.mla.qk_layernorm},
                {"terms", {{"latents", mla.latents}, {"qkv", mla.qkv}, {"scores", mla.scores},
                           {"context", mla.context}}},
                {"attention_bytes", {{"none", mla.none()},
                                     {"core_attn", mla.kept(true, false)},
                                     {"mla_up_proj", mla.kept(false, true)},
                                     {"core_attn_mla_up_proj", mla.kept(true, true)}}}};
  }
  return j;
}

void print_table(const Estimate& e) {
  const PaperShape& m = e.m;
  const LayerBytes &layer = e.layer, &dense_layer = e.dense_layer;
  const MoELayerBytes& moe_layer = e.moe_layer;
  const MLAAttentionBytes& mla = e.mla;
  const WeightMemory& w = e.w;
  const std::vector<double>& stage_in_flight = e.stage_in_flight;
  const double per_stage = e.per_stage, selective_stage = e.selective_stage;
  const double moe_in_stage = e.moe_in_stage, in_flight = e.stage_in_flight.front();
  const double meg = e.megatron, offload_s = e.offload_s;
  const char* schedule = e.schedule();
  auto total = [&e](double per_layer) { return e.device_total(per_layer); };
  const std::string& base_name = e.base_name;
  // A count of micro-batches (fractional under the interleaved schedule) with up to 4
  // significant digits, whatever the stream's format: 10.33, not 1e+01.
  auto count = [](double x) {
    std::ostringstream os;
    os << std::setprecision(4) << x;
    return os.str();
  };
  std::cout
      << "actmem estimate: " << base_name << " — s=" << m.s << " b=" << m.b << " h=" << m.h
      << " a=" << m.a << (m.g > 0 && m.g != m.a ? " G=" + c10::str(m.g) : std::string())
      << " L=" << m.L << " ffn=" << m.ffn << " V=" << m.v << " t=" << m.t << (m.sp ? " (SP)" : "")
      << " p=" << m.p << " (" << per_stage << " layers per stage)"
      << (m.vpp ? ", v=" + c10::str(*m.vpp) : "") << "; " << (m.swiglu ? "SwiGLU" : "GeLU") << ", "
      << (m.untied ? "untied" : "tied") << " embeddings, " << (m.rmsnorm ? "RMSNorm" : "LayerNorm")
      << ", attention " << e.attention << "\n"
      << "activation memory of one micro-batch, 16-bit activations (Korthikanti et al. 2022)\n\n"
      << std::left << std::setw(18) << "recompute" << std::right << std::setw(14) << "per layer"
      << std::setw(14) << "per stage"
      << "   formula\n";
  // The formulas paper_layer_bytes computes: with t = 1 or SP every term divided by t (eq. 1/4);
  // without SP the norms and dropouts (10 sbh) replicated (eq. 2).
  const bool split_all = m.t == 1 || m.sp;
  // Flash: the s^2 term 5as/h becomes the logsumexp's 4a/h.
  const std::string sq_term = m.flash ? "4a/h" : "5as/h";
  const std::string none_formula =
      split_all ? "sbh(34 + " + sq_term + ")" : "sbh(10 + 24/t + " + sq_term + "t)";
  const std::string selective_formula =
      split_all ? "sbh(18 + 4 ffn/h)" : "sbh(10 + (8 + 4 ffn/h)/t)";
  const std::string div = m.sp ? "/t" : "";
  const std::string full_formula = m.sp ? "2sbh/t" : "2sbh";
  std::cout << std::left << std::setw(18) << "none" << std::right << std::setw(14)
            << format_bytes_3sig(layer.none) << std::setw(14)
            << format_bytes_3sig(layer.none * per_stage) << "   " << none_formula << div << "\n"
            << std::left << std::setw(18) << "selective" << std::right << std::setw(14)
            << format_bytes_3sig(layer.selective) << std::setw(14)
            << format_bytes_3sig(selective_stage) << "   " << selective_formula
            << (split_all ? div : "") << "\n"
            << std::left << std::setw(18) << "full" << std::right << std::setw(14)
            << format_bytes_3sig(layer.full) << std::setw(14)
            << format_bytes_3sig(layer.full * per_stage) << "   " << full_formula << "\n\n"
            << std::fixed << std::setprecision(1)
            << (m.flash ? "logsumexp share of a layer without recompute (the flash kernel keeps "
                          "no s^2 term): "
                        : "s^2 share of a layer without recompute: ")
            << 100.0 * layer.s2_fraction << "%\n"
            << schedule << " first stage holds " << count(in_flight)
            << " micro-batches in flight: no recompute "
            << format_bytes_3sig(layer.none * per_stage * in_flight) << ", selective "
            << format_bytes_3sig(selective_stage * in_flight) << "\n"
            << "Megatron theoretical_memory_usage (first stage, "
            << (m.sp ? "compute_activation_memory" : "compute_activation_memory_without_sp")
            << "): " << format_bytes_3sig(meg) << "\n"
            << std::setprecision(2) << "offloading the selective activations of one stage: "
            << format_bytes_3sig(selective_stage) << " each way at " << std::defaultfloat
            << e.bandwidth_gbps << std::fixed << " GB/s = " << offload_s
            << " s per micro-batch (not overlapped)\n";
  if (m.p > 1) {
    std::cout << "\nactivations per pipeline stage at the " << schedule << " peak (micro-batches of "
              << "the stage's " << std::defaultfloat << per_stage << " layers"
              << (m.vpp ? ", v = " + c10::str(*m.vpp) + " chunks" : std::string()) << ")\n"
              << std::left << std::setw(8) << "stage" << std::right << std::setw(12) << "in flight"
              << std::setw(14) << "none" << std::setw(14) << "selective" << std::setw(14) << "full"
              << "\n";
    for (size_t r = 0; r < stage_in_flight.size(); ++r) {
      const double n = stage_in_flight[r] * per_stage;
      std::cout << std::left << std::setw(8) << r << std::right << std::setw(12) << std::defaultfloat
                << count(stage_in_flight[r]) << std::fixed << std::setw(14) << format_bytes_3sig(layer.none * n)
                << std::setw(14) << format_bytes_3sig(layer.selective * n) << std::setw(14)
                << format_bytes_3sig(layer.full * n) << "\n";
    }
  }
  if (m.is_moe()) {
    auto n = [](double x) { return static_cast<int64_t>(x); };
    std::cout << "\nMoE: " << n(m.moe.layers) << " of " << n(m.L) << " layers ("
              << n(moe_in_stage) << " in the first stage), " << n(m.moe.experts) << " experts top-"
              << n(m.moe.topk) << " of ffn " << n(m.moe.ffn)
              << (m.moe.shared_ffn > 0 ? ", shared experts ffn " + c10::str(n(m.moe.shared_ffn)) : "")
              << ", " << (m.moe.capacity_factor > 0 ? "capacity factor " + c10::str(m.moe.capacity_factor)
                                                    : std::string("dropless"))
              << "; the experts compute " << n(moe_layer.rows) << " rows per layer\n"
              << "  per MoE layer: none " << format_bytes_3sig(moe_layer.layer.none) << ", selective "
              << format_bytes_3sig(moe_layer.layer.selective) << ", full "
              << format_bytes_3sig(moe_layer.layer.full) << " (a dense layer: none "
              << format_bytes_3sig(dense_layer.none) << ")\n"
              << "  of which router " << format_bytes_3sig(moe_layer.router) << ", dispatch "
              << format_bytes_3sig(moe_layer.dispatch) << ", experts "
              << format_bytes_3sig(moe_layer.experts) << ", shared experts "
              << format_bytes_3sig(moe_layer.shared) << "\n"
              << "  the per-layer and per-stage figures above are the first stage's mix of dense "
                 "and MoE layers; Megatron's theoretical_memory_usage counts every layer as dense\n";
  }
  if (m.is_mla()) {
    std::cout << "\nmulti-latent attention: q_lora_rank "
              << (m.mla.q_lora > 0 ? c10::str(static_cast<int64_t>(m.mla.q_lora)) : std::string("none"))
              << ", kv_lora_rank " << static_cast<int64_t>(m.mla.kv_lora) << ", head dims qk "
              << static_cast<int64_t>(m.mla.qk) << " + rope " << static_cast<int64_t>(m.mla.pos)
              << ", v " << static_cast<int64_t>(m.mla.v) << (m.mla.qk_layernorm ? ", latent norms" : "")
              << "\n  attention per layer: none " << format_bytes_3sig(mla.none()) << ", core_attn "
              << format_bytes_3sig(mla.kept(true, false)) << ", mla_up_proj "
              << format_bytes_3sig(mla.kept(false, true)) << ", both "
              << format_bytes_3sig(mla.kept(true, true)) << "\n  of which latents "
              << format_bytes_3sig(mla.latents) << ", q/k/v after RoPE " << format_bytes_3sig(mla.qkv)
              << ", scores " << format_bytes_3sig(mla.scores) << ", context "
              << format_bytes_3sig(mla.context)
              << "\n  the per-layer figures above use these attention terms\n";
  }
  std::cout << "\ndevice memory per rank (the first pipeline stage, with the embedding), mixed "
               "precision, d=" << std::defaultfloat << m.d
            << (m.distributed_optimizer ? " with the distributed optimizer" : "") << "\n"
            << "  parameters " << std::fixed
            << std::setprecision(2) << w.parameters / 1e9 << " B in the model ("
            << (m.swiglu ? "SwiGLU" : "GeLU") << ", " << (m.untied ? "untied" : "tied")
            << " embeddings), " << w.parameters_on_rank / 1e9 << " B on this rank\n";
  if (m.is_moe()) {
    std::cout << "  active per token " << w.active_parameters / 1e9 << " B (top-"
              << static_cast<int64_t>(m.moe.topk) << " of the routed experts); routed experts on "
              << "this rank " << w.expert_parameters_on_rank / 1e9 << " B (split etp x ep = "
              << static_cast<int64_t>(m.moe.etp > 0 ? m.moe.etp : m.t) << " x "
              << static_cast<int64_t>(m.moe.ep) << ")\n";
  }
  std::cout
            << std::left << std::setw(44) << "  weights (bf16, 2 B/param)" << std::right
            << std::setw(12) << format_bytes_3sig(w.weight_bytes) << "\n"
            << std::left << std::setw(44) << "  gradients (fp32 main grads, 4 B/param)" << std::right
            << std::setw(12) << format_bytes_3sig(w.gradient_bytes) << "\n"
            << std::left << std::setw(44)
            << (m.distributed_optimizer ? "  optimizer (fp32 params + Adam, 12/d B/param)"
                                        : "  optimizer (fp32 params + Adam, 12 B/param)")
            << std::right << std::setw(12) << format_bytes_3sig(w.optimizer_bytes) << "\n"
            << std::left << std::setw(44) << "  weights and optimizer" << std::right
            << std::setw(12) << format_bytes_3sig(w.total()) << "   " << std::defaultfloat
            << w.bytes_per_parameter << " B/param (Megatron's compute_weight_and_optimizer_memory)\n"
            << std::left << std::setw(44) << "  total, no recompute (first stage in flight)" << std::right
            << std::setw(12) << format_bytes_3sig(total(layer.none)) << "\n"
            << std::left << std::setw(44) << "  total, selective recompute (first stage)" << std::right
            << std::setw(12) << format_bytes_3sig(total(layer.selective)) << "\n"
            << std::left << std::setw(44) << "  total, full recompute (first stage)" << std::right
            << std::setw(12) << format_bytes_3sig(total(layer.full)) << "\n"
            << std::left << std::setw(44) << "  total, Megatron's report_theoretical_memory" << std::right
            << std::setw(12) << format_bytes_3sig(w.total() + meg) << "\n";
}

// Note [Estimating what the paper does not describe]
// Korthikanti et al.'s formulas and Megatron's theoretical_memory_usage.py describe layers of
// standard attention a x d = h wide; Megatron's counts every layer so, including a hybrid's
// GatedDeltaNet layers, and has no term for the output gate or the q/k norms. For such models
// estimate prints the project's exact predictor instead (predict_activation_bytes, the one
// `inspect` and the tests check against the tracker to the byte), from the configuration alone:
// one micro-batch on one rank of the first pipeline stage (each of its model chunks), at 16 bits
// with the GPU's conventions (norm statistics in fp32, random-state snapshots on the host), the
// routed experts' rows at a balanced routing (each expert k T / E of the T tokens a router
// sees, from every rank that routes to it). Per layer kind and strategy; weights, gradients and
// optimizer from count_parameters at Megatron's 18 bytes per parameter (6 + 12/d with the
// distributed optimizer).
struct ExactEstimate {
  struct Strategy {
    std::string name;
    double gdn_layer = 0, attention_layer = 0;  // one layer of each kind (first of the stage)
    double stage = 0;                           // the first stage's layers, embedding, ...
  };
  std::vector<Strategy> strategies;
  std::vector<std::pair<std::string, std::pair<double, double>>> modules;  // plain, per kind
  int64_t gdn_layers = 0, attention_layers = 0, gdn_index = -1, attention_index = -1;
  double in_flight = 1;
  ParameterCount params;
  double weight_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0;
};

ExactEstimate compute_exact(const TransformerConfig& c, const PaperShape& m) {
  TORCH_CHECK(!c.multi_latent_attention,
              "actmem estimate: multi-latent attention on a hybrid "
              "model is not implemented");
  TORCH_CHECK(!c.is_moe() || m.moe.etp == m.t,
              "actmem estimate: an expert tensor-parallel "
              "size (",
              m.moe.etp, ") other than the tensor-parallel size (", m.t,
              ") is not "
              "modelled for models the paper's formulas do not describe");
  ExactEstimate x;
  const std::vector<bool> linear = c.gdn_layers();
  for (int64_t i = 0; i < c.num_layers; ++i) {
    (linear[static_cast<size_t>(i)] ? x.gdn_layers : x.attention_layers) += 1;
  }
  // The first layer of each kind on the first stage (any of its model chunks).
  for (int64_t chunk = 0; chunk < c.virtual_pipeline_size(); ++chunk) {
    const TransformerConfig::StageLayers layers = c.model_chunk_layers(0, chunk);
    for (int64_t i = layers.offset; i < layers.offset + layers.count; ++i) {
      int64_t& index = linear[static_cast<size_t>(i)] ? x.gdn_index : x.attention_index;
      if (index < 0) index = i;
    }
  }
  // A balanced routing for every MoE layer (Note [Estimating what the paper does not describe]).
  const MoERouting routing = balanced_moe_routing(c);
  auto strategy = [&](const std::string& name, const std::function<void(TransformerConfig&)>& set) {
    TransformerConfig cc = c;
    set(cc);
    const ActivationPlan plan = make_activation_plan(cc);
    ExactEstimate::Strategy s{name};
    std::map<int64_t, double> per_layer;
    for (int64_t chunk = 0; chunk < c.virtual_pipeline_size(); ++chunk) {
      const PredictedBytes p =
          predict_activation_bytes(cc, plan, 2, /*snapshots_on_device=*/false,
                                   routing.empty() ? nullptr : &routing, 0, chunk);
      s.stage += static_cast<double>(p.total);
      for (const auto& [module, bytes] : p.by_module) {
        const std::string prefix = "decoder.layers.";
        if (module.rfind(prefix, 0) != 0) continue;
        const int64_t layer = std::stoll(module.substr(prefix.size()));
        per_layer[layer] += static_cast<double>(bytes);
        if (name == "none") {
          const bool gdn = layer == x.gdn_index;
          if (!gdn && layer != x.attention_index) continue;
          // "decoder.layers.3.self_attention.linear_qkv" -> "self_attention.linear_qkv"
          const std::string rest = module.substr(module.find('.', prefix.size()) + 1);
          auto it = std::find_if(x.modules.begin(), x.modules.end(),
                                 [&](const auto& r) { return r.first == rest; });
          if (it == x.modules.end()) it = x.modules.insert(x.modules.end(), {rest, {0.0, 0.0}});
          (gdn ? it->second.first : it->second.second) += static_cast<double>(bytes);
        }
      }
    }
    s.gdn_layer = x.gdn_index >= 0 ? per_layer[x.gdn_index] : 0.0;
    s.attention_layer = x.attention_index >= 0 ? per_layer[x.attention_index] : 0.0;
    x.strategies.push_back(s);
  };
  auto selective = [](std::vector<std::string> modules) {
    return [modules](TransformerConfig& cc) {
      cc.recompute_granularity = "selective";
      cc.recompute_modules = modules;
    };
  };
  strategy("none", [](TransformerConfig&) {});
  std::vector<std::string> modules;
  if (x.attention_layers > 0) {
    modules.emplace_back("core_attn");
    strategy("selective core_attn", selective(modules));
  }
  if (x.gdn_layers > 0) {
    modules.emplace_back("gdn_norm_out");
    strategy("selective " + c10::Join("+", modules), selective(modules));
  }
  modules.emplace_back("layernorm");
  if (c.is_moe() && c.moe_grouped_gemm) modules.emplace_back("moe_act");
  if (c.moe_shared_expert_intermediate_size) modules.emplace_back("shared_experts");
  const std::vector<bool> moe = c.is_moe() ? c.moe_layers() : std::vector<bool>();
  if (!c.is_moe() || std::find(moe.begin(), moe.end(), false) != moe.end())
    modules.emplace_back("mlp");
  strategy("selective " + c10::Join("+", modules), selective(modules));
  strategy("full uniform 1", [](TransformerConfig& cc) {
    cc.recompute_granularity = "full";
    cc.recompute_method = "uniform";
    cc.recompute_num_layers = 1;
  });
  x.in_flight = stages_in_flight(m).front();
  x.params = count_parameters(c);
  const WeightMemory w = config_weight_and_optimizer_memory(c, m.d, m.distributed_optimizer);
  x.weight_bytes = w.weight_bytes;
  x.gradient_bytes = w.gradient_bytes;
  x.optimizer_bytes = w.optimizer_bytes;
  return x;
}

nlohmann::json to_json(const ExactEstimate& x, const TransformerConfig& c,
                       const std::string& base) {
  nlohmann::json strategies = nlohmann::json::array();
  for (const auto& s : x.strategies) {
    strategies.push_back({{"name", s.name},
                          {"gdn_layer_bytes", s.gdn_layer},
                          {"attention_layer_bytes", s.attention_layer},
                          {"first_stage_bytes", s.stage},
                          {"first_stage_in_flight_bytes", s.stage * x.in_flight}});
  }
  nlohmann::json modules = nlohmann::json::object();
  for (const auto& [name, bytes] : x.modules) {
    modules[name] = {{"gdn_layer", bytes.first}, {"attention_layer", bytes.second}};
  }
  const double states = x.weight_bytes + x.gradient_bytes + x.optimizer_bytes;
  return {{"model", to_json(c)},
          {"base", base},
          {"method", "exact predictor (the paper's formulas do not describe this model)"},
          {"dtype_bytes", 2},
          {"gdn_layers", x.gdn_layers},
          {"attention_layers", x.attention_layers},
          {"microbatches_in_flight_first_stage", x.in_flight},
          {"strategies", strategies},
          {"plain_bytes_per_module", modules},
          {"parameters",
           {{"total", x.params.total},
            {"active", x.params.active},
            {"on_rank", x.params.on_rank},
            {"experts_on_rank", x.params.experts_on_rank}}},
          {"weights_and_optimizer",
           {{"weight_bytes", x.weight_bytes},
            {"gradient_bytes", x.gradient_bytes},
            {"optimizer_bytes", x.optimizer_bytes},
            {"total_bytes", states}}}};
}

void print_exact(const ExactEstimate& x, const TransformerConfig& c, const std::string& base) {
  std::cout << "actmem estimate: " << base << " — " << c.num_layers << " layers (" << x.gdn_layers
            << " Gated DeltaNet, " << x.attention_layers << " attention), h " << c.hidden_size
            << ", s " << c.seq_length << ", b " << c.micro_batch_size << ", t "
            << c.tensor_model_parallel_size << (c.sequence_parallel ? " (SP)" : "") << ", p "
            << c.pipeline_model_parallel_size
            << (c.is_moe() ? ", e " + std::to_string(c.expert_model_parallel_size) : "")
            << "\n  the paper's formulas and Megatron's theoretical memory do not describe this "
               "model (GDN layers, or attention not h wide, gated or normed per head): the\n"
               "  project's exact predictor instead, 16-bit, one micro-batch on one rank of the "
               "first stage"
            << (c.is_moe() ? ", experts at a balanced routing" : "") << "\n\n";
  const int w = 68;
  std::cout << std::left << std::setw(w) << "module (no recompute)" << std::right << std::setw(14)
            << (x.gdn_index >= 0 ? "GDN layer" : "") << std::setw(16)
            << (x.attention_index >= 0 ? "attention layer" : "") << "\n";
  for (const auto& [name, bytes] : x.modules) {
    auto cell = [](bool shown, double v) {
      return shown && v > 0 ? format_bytes_3sig(v) : std::string(shown ? "-" : "");
    };
    std::cout << std::left << std::setw(w) << ("  " + name) << std::right << std::setw(14)
              << cell(x.gdn_index >= 0, bytes.first) << std::setw(16)
              << cell(x.attention_index >= 0, bytes.second) << "\n";
  }
  std::cout << "\n"
            << std::left << std::setw(w) << "strategy" << std::right << std::setw(14) << "GDN layer"
            << std::setw(16) << "attention layer" << std::setw(14) << "first stage" << std::setw(16)
            << "x in flight"
            << "\n";
  for (const auto& s : x.strategies) {
    std::cout << std::left << std::setw(w) << ("  " + s.name) << std::right << std::setw(14)
              << (x.gdn_index >= 0 ? format_bytes_3sig(s.gdn_layer) : "-") << std::setw(16)
              << (x.attention_index >= 0 ? format_bytes_3sig(s.attention_layer) : "-")
              << std::setw(14) << format_bytes_3sig(s.stage) << std::setw(16)
              << format_bytes_3sig(s.stage * x.in_flight) << "\n";
  }
  const double states = x.weight_bytes + x.gradient_bytes + x.optimizer_bytes;
  std::cout << "\nfirst stage in flight: " << x.in_flight << " micro-batch(es) (1F1B)\n"
            << "parameters: " << std::fixed << std::setprecision(2)
            << static_cast<double>(x.params.total) / 1e9 << " B total, "
            << static_cast<double>(x.params.active) / 1e9 << " B active, " << x.params.on_rank / 1e9
            << " B on a rank of the first stage\n"
            << std::defaultfloat
            << "weights + gradients + optimizer per rank: " << format_bytes_3sig(states) << " ("
            << format_bytes_3sig(x.weight_bytes) << " + " << format_bytes_3sig(x.gradient_bytes)
            << " + " << format_bytes_3sig(x.optimizer_bytes) << ")\n";
  for (const auto& s : x.strategies) {
    std::cout << std::left << std::setw(w) << ("  device total, " + s.name) << std::right
              << std::setw(14) << format_bytes_3sig(states + s.stage * x.in_flight) << "\n";
  }
}

int run(EstimateOptions& o, const CLI::App& cmd) {
  if (o.preset.empty()) {
    // Sizes without a preset describe a model of their own: all of them, nothing inherited.
    std::vector<std::string> missing;
    for (const char* flag : {"--num-layers", "--hidden-size", "--num-attention-heads",
                             "--seq-length", "--micro-batch-size", "--vocab-size"}) {
      if (cmd.count(flag) == 0) missing.emplace_back(flag);
    }
    TORCH_CHECK(missing.empty(), "actmem estimate: a model given by its sizes needs --num-layers, "
                "--hidden-size, --num-attention-heads, --seq-length, --micro-batch-size and "
                "--vocab-size (missing: ", c10::Join(", ", missing), "); or name a --preset (",
                c10::Join(", ", model_preset_names()), ") for the flags to modify");
  }
  const PaperShape shape = describe_model(o.model, o.layout, "actmem estimate");
  const std::string base = o.preset.empty() ? "custom"
                           : to_json(preset_options(o.preset).model) == to_json(o.model.model)
                               ? o.preset
                               : o.preset + " (with the flags given)";
  if (!paper_describes(o.model.model)) {
    // Note [Estimating what the paper does not describe].
    const ExactEstimate x = compute_exact(o.model.model, shape);
    if (o.json) {
      std::cout << to_json(x, o.model.model, base).dump(2) << std::endl;
    } else {
      print_exact(x, o.model.model, base);
    }
    return 0;
  }
  Estimate e = compute(shape, o.model.model, o.bandwidth_gbps);
  e.preset = o.preset;
  e.base_name = base;
  if (o.json) {
    std::cout << to_json(e).dump(2) << std::endl;
  } else {
    print_table(e);
  }
  return 0;
}

}  // namespace

Runner add_estimate_command(CLI::App& app) {
  auto o = std::make_shared<EstimateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "estimate", "Analytic activation memory (paper formulas) of a preset or of the model "
                  "train's flags describe");
  add_preset_option(*cmd, o->preset,
                    "the flags of a named model (the default when no size is given), which the "
                    "flags given replace; sizes without --preset describe a model of their own, "
                    "with Megatron's defaults");
  // The model flags are train's, checked by the same rules (Note [One model description] in
  // memory_model.cpp): a train command line estimates as it is.
  add_flags(*cmd, o->model, kShapeFlags | kParallelFlags | kMoEFlags);
  add_described_layout_flags(*cmd, o->model, o->layout, /*optimizer_flags_registered=*/false);
  cmd->add_option("--offload-bandwidth-gbps", o->bandwidth_gbps, "host link, GB/s per direction")
      ->capture_default_str()->check(positive_number_validator());
  cmd->add_flag("--json", o->json, "print JSON instead of the table");
  return [o, cmd]() { return cmd->parsed() ? run(*o, *cmd) : -1; };
}

}  // namespace actmem::cli
