// estimate_cmd.cpp — `actmem estimate`: the paper's activation-memory model for a named preset or
// explicit sizes, per layer and per pipeline stage, with Megatron's theoretical terms and the
// offload transfer time.
#include "actmem/memory/memory_model.h"
#include "actmem/base/report.h"
#include "actmem/flags/train_options.h"
#include "commands.h"

#include <CLI/CLI.hpp>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <iomanip>
#include <limits>
#include <iostream>
#include <memory>
#include <sstream>
#include <vector>

namespace actmem::cli {

namespace {

struct EstimateOptions {
  std::string preset = "7b";
  double s = 0, b = 0, h = 0, a = 0, L = 0, ffn = 0, v = 0, t = 0, p = 0, m = 0;
  double layers_per_vp = 0, vp = 0;  // the interleaved schedule: one of the two
  double d = 0;
  bool sp = false, no_sp = false, json = false, swiglu = false, untie = false, dist_opt = false;
  bool no_swiglu = false, tie = false;
  bool preset_given = false, normalization_given = false;  // set from the parse
  double bandwidth_gbps = 50.0;
  // MoE (docs/moe.md): experts 0 = dense.
  double experts = 0, topk = 2, moe_ffn = 0, shared_ffn = 0, capacity = 0;
  std::string moe_freq = "1";  // Megatron's int or 0/1 pattern (TransformerConfig::moe_layers)
  double aux_coeff = 0, z_coeff = 0, ep = 1, etp = 0;
  bool pad = false, shared_gate = false;
  std::string normalization = "LayerNorm";
  // Multi-latent attention (docs/mla.md), Megatron's CLI defaults.
  bool mla = false, qk_layernorm = false;
  double q_lora = 0, kv_lora = 32, qk_head = 128, pos_head = 64, v_head = 128;
};

// Megatron's ffn_hidden_size when none is given (arguments.py, validate_args): 4h, or with
// SwiGLU two thirds of it rounded down to a multiple of 64.
double megatron_default_ffn(double h, bool swiglu) {
  return swiglu ? std::floor(4.0 * h * 2.0 / 3.0 / 64.0) * 64.0 : 4.0 * h;
}

bool sizes_given(const EstimateOptions& o) {
  return o.s > 0 || o.h > 0 || o.a > 0 || o.L > 0 || o.ffn > 0 || o.v > 0;
}
// With --preset (or no size at all: the 7b preset) the preset is the base and each flag replaces
// its field; without --preset, sizes describe a model of their own.
bool on_preset(const EstimateOptions& o) { return o.preset_given || !sizes_given(o); }

// The model the flags describe: a preset, or Megatron's defaults for everything the sizes do
// not give (LayerNorm, GeLU, tied embeddings, no parallelism), so nothing is inherited from a
// preset the user never named.
PaperShape base_shape(const EstimateOptions& o) {
  if (on_preset(o)) return paper_preset(o.preset);
  std::vector<std::string> missing;
  if (o.L <= 0) missing.emplace_back("--num-layers");
  if (o.h <= 0) missing.emplace_back("--hidden-size");
  if (o.a <= 0) missing.emplace_back("--num-attention-heads");
  if (o.s <= 0) missing.emplace_back("--seq-length");
  if (o.b <= 0) missing.emplace_back("--micro-batch-size");
  if (o.v <= 0) missing.emplace_back("--vocab-size");
  TORCH_CHECK(missing.empty(), "actmem estimate: a model given by its sizes needs --num-layers, "
              "--hidden-size, --num-attention-heads, --seq-length, --micro-batch-size and "
              "--vocab-size (missing: ", c10::Join(", ", missing), "); or name a --preset (",
              c10::Join(", ", paper_preset_names()), ") for the flags to modify");
  return PaperShape{};  // Megatron's defaults: t = p = d = 1, no SP, LayerNorm, GeLU, tied
}

int run(const EstimateOptions& o) {
  PaperShape m = base_shape(o);
  auto set = [](double& field, double value) {
    if (value > 0) field = value;
  };
  set(m.s, o.s), set(m.b, o.b), set(m.h, o.h), set(m.a, o.a), set(m.L, o.L), set(m.v, o.v);
  set(m.t, o.t), set(m.p, o.p);
  if (o.swiglu) m.swiglu = true;
  if (o.no_swiglu) m.swiglu = false;
  if (o.untie) m.untied = true;
  if (o.tie) m.untied = false;
  if (o.ffn > 0) m.ffn = o.ffn;
  else if (o.h > 0 || m.ffn <= 0) m.ffn = megatron_default_ffn(m.h, m.swiglu);
  if (o.m > 0) m.num_microbatches = o.m;
  if (o.d > 0) m.d = o.d;
  if (o.dist_opt) m.distributed_optimizer = true;
  if (o.normalization_given) m.rmsnorm = o.normalization == "RMSNorm";
  if (o.sp) m.sp = true;
  if (o.no_sp) m.sp = false;
  TORCH_CHECK(!(o.swiglu && o.no_swiglu) && !(o.untie && o.tie) && !(o.sp && o.no_sp),
              "actmem estimate: a switch and its --no-/--tie- opposite were both given");
  TORCH_CHECK(!(m.sp && m.t == 1), "actmem estimate: --sequence-parallel needs "
              "--tensor-model-parallel-size > 1");
  TORCH_CHECK(std::fmod(m.L, m.p) == 0, "actmem estimate: num_layers (", m.L,
              ") must be divisible by the pipeline size (", m.p, ")");
  TORCH_CHECK(!(o.layers_per_vp > 0 && o.vp > 0), "actmem estimate: No more than one of the "
              "following arguments can be set at the same time: --num-layers-per-virtual-"
              "pipeline-stage, --num-virtual-stages-per-pipeline-rank");
  if (o.layers_per_vp > 0) {
    // Megatron's validate_args: v = (num_layers / p) / layers per virtual stage.
    const double per_stage = m.L / m.p;
    TORCH_CHECK(std::fmod(per_stage, o.layers_per_vp) == 0, "actmem estimate: number of layers "
                "per pipeline stage must be divisible number of layers per virtual pipeline stage (",
                per_stage, " per stage, ", o.layers_per_vp, " per virtual stage)");
    m.vpp = per_stage / o.layers_per_vp;
  }
  if (o.vp > 0) m.vpp = o.vp;
  if (m.vpp && *m.vpp == 1) m.vpp.reset();  // Megatron: one virtual stage is no interleaving
  // A preset's chunks are kept only while they still cut the stage evenly (Megatron's
  // TransformerConfig and get_num_layers_to_build: layers per rank divisible by the virtual
  // stages), also after --num-layers or --pipeline-model-parallel-size changed the stage.
  TORCH_CHECK(!m.vpp || std::fmod(m.L / m.p, *m.vpp) == 0, "actmem estimate: number of layers on "
              "each pipeline rank (", m.L / m.p, ") must be divisible by "
              "virtual_pipeline_model_parallel_size (", *m.vpp, ")",
              o.vp > 0 || o.layers_per_vp > 0
                  ? std::string()
                  : "; the preset's " + c10::str(*m.vpp) + " chunks per stage no longer fit: give "
                    "--num-virtual-stages-per-pipeline-rank (1 for no interleaving)");
  // Megatron's interleaved rule with its default groups of p micro-batches: M a multiple of p.
  TORCH_CHECK(!m.vpp || !m.num_microbatches || std::fmod(*m.num_microbatches, m.p) == 0,
              "actmem estimate: with the interleaved schedule the number of micro-batches (",
              *m.num_microbatches, ") must be a multiple of the pipeline size (", m.p, "): "
              "Megatron's groups of p micro-batches per virtual stage");
  TORCH_CHECK(o.mla || std::fmod(m.h, m.a) == 0, "actmem estimate: num_attention_heads (", m.a,
              ") must divide hidden_size (", m.h, ")");
  // Megatron's tensor-parallel rules: heads and the MLP's columns split evenly over t ranks, and
  // with sequence parallelism the sequence too.
  TORCH_CHECK(std::fmod(m.a, m.t) == 0, "actmem estimate: num_attention_heads (", m.a,
              ") must be divisible by tensor_model_parallel_size (", m.t, ")");
  TORCH_CHECK(std::fmod(m.ffn, m.t) == 0, "actmem estimate: ffn_hidden_size (", m.ffn,
              ") must be divisible by tensor_model_parallel_size (", m.t, ")");
  TORCH_CHECK(!m.sp || std::fmod(m.s, m.t) == 0, "actmem estimate: with sequence parallelism "
              "seq_length (", m.s, ") must be divisible by tensor_model_parallel_size (", m.t, ")");
  if (o.experts > 0) {
    m.moe.experts = o.experts;
    m.moe.topk = o.topk;
    m.moe.ffn = o.moe_ffn > 0 ? o.moe_ffn : m.ffn;
    m.moe.shared_ffn = o.shared_ffn;
    m.moe.capacity_factor = o.capacity;
    m.moe.pad_to_capacity = o.pad;
    m.moe.aux_loss = o.aux_coeff > 0;
    m.moe.z_loss = o.z_coeff > 0;
    m.moe.shared_gate = o.shared_gate;
    m.moe.ep = o.ep;
    m.moe.etp = o.etp;
    TORCH_CHECK(std::fmod(m.moe.experts, o.ep) == 0, "actmem estimate: Number of experts should be "
                "a multiple of expert model parallel_size.");
    const double etp = o.etp > 0 ? o.etp : m.t;
    TORCH_CHECK(std::fmod(m.t * m.d, etp * o.ep) == 0, "actmem estimate: world_size (t x d x p = ",
                m.t * m.d * m.p, ") is not divisible by expert_tensor_model_pipeline_parallel size (",
                etp * o.ep * m.p, ")");
    TORCH_CHECK(o.topk <= o.experts, "actmem estimate: --moe-router-topk (", o.topk,
                ") must be at most --num-experts (", o.experts, ")");
    TORCH_CHECK(!o.pad || o.capacity > 0, "actmem estimate: --moe-pad-expert-input-to-capacity "
                "needs --moe-expert-capacity-factor");
    TORCH_CHECK(std::fmod(m.moe.ffn, m.t) == 0, "actmem estimate: the expert ffn (", m.moe.ffn,
                ") must be divisible by tensor_model_parallel_size (", m.t, ")");
    TORCH_CHECK(m.t == 1 || m.sp, "actmem estimate: MoE with tensor parallelism needs "
                "--sequence-parallel (Megatron refuses MoE and TP without it)");
  } else {
    TORCH_CHECK(o.moe_ffn == 0 && o.shared_ffn == 0 && o.capacity == 0 && !o.pad && o.ep == 1 &&
                    o.etp == 0 && !o.shared_gate,
                "actmem estimate: MoE options need --num-experts");
  }
  MLAAttentionBytes mla;
  if (o.mla) {
    m.mla.q_lora = o.q_lora, m.mla.kv_lora = o.kv_lora, m.mla.qk = o.qk_head;
    m.mla.pos = o.pos_head, m.mla.v = o.v_head, m.mla.qk_layernorm = o.qk_layernorm;
    TORCH_CHECK(m.t == 1 || m.sp, "actmem estimate: multi-latent attention with tensor "
                "parallelism is estimated with --sequence-parallel only");
    TORCH_CHECK(std::fmod(m.mla.pos, 2) == 0, "actmem estimate: --qk-pos-emb-head-dim must be even");
    mla = paper_mla_attention_bytes(m);
  } else {
    TORCH_CHECK(o.q_lora == 0 && !o.qk_layernorm, "actmem estimate: --q-lora-rank and "
                "--qk-layernorm need --multi-latent-attention");
  }
  // MLA replaces the paper's attention terms (q, k, v inputs and outputs, the scores, the
  // context: (10 sbh + 5as^2b)/t without recompute, 10 sbh/t with selective core_attn) by its own.
  auto with_mla = [&](LayerBytes l) {
    if (!m.is_mla()) return l;
    const double sq = 5.0 * m.a * m.s * m.s * m.b / m.t, lin = 10.0 * m.sbh() / m.t;
    l.none += mla.none() - (lin + sq);
    l.selective += mla.kept(true, false) - lin;
    l.s2_fraction = mla.scores / l.none;
    return l;
  };
  const LayerBytes dense_layer = with_mla(paper_layer_bytes(m));
  const double per_stage = m.layers_per_stage();
  // MoE: the first stage's layers [0, L/p) that are MoE (by --moe-layer-freq), each with
  // the MoE layer's bytes; `layer` is then the stage's mean per layer, so every per-stage total
  // below is the mix.
  double moe_in_stage = 0;
  MoELayerBytes moe_layer;
  LayerBytes layer = dense_layer;
  if (m.is_moe()) {
    // Which layers are MoE, by the model's own parser of --moe-layer-freq (its errors too).
    TransformerConfig pattern;
    pattern.num_layers = static_cast<int64_t>(m.L);
    pattern.num_moe_experts = static_cast<int64_t>(m.moe.experts);
    pattern.moe_layer_freq = o.moe_freq;
    const std::vector<bool> is_moe = pattern.moe_layers();
    for (size_t i = 0; i < is_moe.size(); ++i) {
      if (!is_moe[i]) continue;
      m.moe.layers += 1;
      if (static_cast<double>(i) < per_stage) moe_in_stage += 1;
    }
    moe_layer = paper_moe_layer_bytes(m);
    moe_layer.layer = with_mla(moe_layer.layer);
    auto mix = [&](double dense, double moe) {
      return (dense * (per_stage - moe_in_stage) + moe * moe_in_stage) / per_stage;
    };
    layer.none = mix(dense_layer.none, moe_layer.layer.none);
    layer.selective = mix(dense_layer.selective, moe_layer.layer.selective);
    layer.full = mix(dense_layer.full, moe_layer.layer.full);
  }
  const double selective_stage = layer.selective * per_stage;
  const double offload_s = offload_round_trip_seconds(selective_stage, o.bandwidth_gbps);
  const double meg = m.sp ? megatron_activation_memory(m) : megatron_activation_memory_without_sp(m);
  const WeightMemory w = megatron_weight_and_optimizer_memory(m);
  // Stage r's micro-batches in flight at its peak, in micro-batches of the whole stage (every
  // chunk): 1F1B min(p - r, M) (Korthikanti eq. 5: the first stage holds p); interleaved with v
  // chunks and groups of p micro-batches, min(2 (p - r - 1) + (v - 1) p + 1, M v) chunk-micro-
  // batches (Megatron's warmup plus the first steady forward), so p (1 + (p - 1)/(p v)) on the
  // first stage (Korthikanti's interleaved factor). M unset: as many as the schedule can use.
  std::vector<double> stage_in_flight;
  for (int r = 0; r < static_cast<int>(m.p); ++r) {
    const double rest = m.p - r - 1;
    if (m.vpp) {
      const double chunks = 2 * rest + (*m.vpp - 1) * m.p + 1;
      stage_in_flight.push_back(
          (m.num_microbatches ? std::min(chunks, *m.num_microbatches * *m.vpp) : chunks) / *m.vpp);
    } else {
      stage_in_flight.push_back(m.num_microbatches ? std::min(rest + 1, *m.num_microbatches)
                                                   : rest + 1);
    }
  }
  const double in_flight = stage_in_flight.front();
  const char* schedule = m.vpp ? "interleaved 1F1B" : "1F1B";
  // A count of micro-batches (fractional under the interleaved schedule) with up to 4
  // significant digits, whatever the stream's format: 10.33, not 1e+01.
  auto count = [](double x) {
    std::ostringstream os;
    os << std::setprecision(4) << x;
    return os.str();
  };
  const std::string base_name =
      on_preset(o) ? o.preset + (sizes_given(o) ? " (with the sizes given)" : "") : "custom";
  auto total = [&](double per_layer) { return w.total() + per_layer * per_stage * in_flight; };
  if (o.json) {
    nlohmann::json j = {
        {"model", {{"seq_length", m.s}, {"micro_batch_size", m.b}, {"hidden_size", m.h},
                   {"num_attention_heads", m.a}, {"num_layers", m.L}, {"ffn_hidden_size", m.ffn},
                   {"vocab_size", m.v}, {"tensor_model_parallel_size", m.t},
                   {"pipeline_model_parallel_size", m.p}, {"sequence_parallel", m.sp},
                   {"swiglu", m.swiglu}, {"untied", m.untied},
                   {"normalization", m.rmsnorm ? "RMSNorm" : "LayerNorm"},
                   {"base", on_preset(o) ? nlohmann::json(o.preset) : nlohmann::json(nullptr)}}},
        {"per_layer_bytes", {{"none", layer.none}, {"selective", layer.selective}, {"full", layer.full}}},
        {"per_stage_bytes", {{"none", layer.none * per_stage},
                             {"selective", selective_stage},
                             {"full", layer.full * per_stage}}},
        {"s2_fraction", layer.s2_fraction},
        {"layers_per_stage", per_stage},
        {"megatron_theoretical_activation_bytes", meg},
        {"weights_and_optimizer",
         {{"parameters", w.parameters}, {"parameters_on_rank", w.parameters_on_rank},
          {"active_parameters", w.active_parameters},
          {"expert_parameters_on_rank", w.expert_parameters_on_rank},
          {"bytes_per_parameter", w.bytes_per_parameter}, {"weight_bytes", w.weight_bytes},
          {"gradient_bytes", w.gradient_bytes}, {"optimizer_bytes", w.optimizer_bytes},
          {"total_bytes", w.total()}, {"data_parallel_size", m.d},
          {"distributed_optimizer", m.distributed_optimizer}, {"swiglu", m.swiglu},
          {"untied", m.untied}}},
        {"schedule", schedule},
        {"virtual_pipeline_size", m.vpp ? nlohmann::json(*m.vpp) : nlohmann::json(nullptr)},
        {"per_pipeline_stage", [&] {
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
        {"device_bytes_per_rank", {{"none", total(layer.none)},
                                   {"selective", total(layer.selective)},
                                   {"full", total(layer.full)},
                                   {"megatron_theoretical", w.total() + meg}}},
        {"offload", {{"bytes_each_way", selective_stage},
                     {"bandwidth_gbps", o.bandwidth_gbps},
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
    std::cout << j.dump(2) << std::endl;
    return 0;
  }
  std::cout << "actmem estimate: " << base_name << " — s=" << m.s
            << " b=" << m.b << " h=" << m.h << " a=" << m.a << " L=" << m.L << " ffn=" << m.ffn
            << " V=" << m.v << " t=" << m.t << (m.sp ? " (SP)" : "") << " p=" << m.p << " ("
            << per_stage << " layers per stage)" << (m.vpp ? ", v=" + c10::str(*m.vpp) : "")
            << "; " << (m.swiglu ? "SwiGLU" : "GeLU") << ", " << (m.untied ? "untied" : "tied")
            << " embeddings, " << (m.rmsnorm ? "RMSNorm" : "LayerNorm") << "\n"
            << "activation memory of one micro-batch, 16-bit activations (Korthikanti et al. 2022)\n\n"
            << std::left << std::setw(18) << "recompute" << std::right << std::setw(14) << "per layer"
            << std::setw(14) << "per stage" << "   formula\n";
  // The formulas paper_layer_bytes computes: with t = 1 or SP every term divided by t (eq. 1/4);
  // without SP the norms and dropouts (10 sbh) replicated (eq. 2).
  const bool split_all = m.t == 1 || m.sp;
  const std::string none_formula = split_all ? "sbh(34 + 5as/h)" : "sbh(10 + 24/t + 5as/ht)";
  const std::string selective_formula =
      split_all ? "sbh(18 + 4 ffn/h)" : "sbh(10 + (8 + 4 ffn/h)/t)";
  const std::string div = m.sp ? "/t" : "";
  const std::string full_formula = m.sp ? "2sbh/t" : "2sbh";
  std::cout << std::left << std::setw(18) << "none" << std::right << std::setw(14) << format_bytes_3sig(layer.none)
            << std::setw(14) << format_bytes_3sig(layer.none * per_stage) << "   " << none_formula << div << "\n"
            << std::left << std::setw(18) << "selective" << std::right << std::setw(14)
            << format_bytes_3sig(layer.selective) << std::setw(14) << format_bytes_3sig(selective_stage) << "   "
            << selective_formula << (split_all ? div : "") << "\n"
            << std::left << std::setw(18) << "full" << std::right << std::setw(14) << format_bytes_3sig(layer.full)
            << std::setw(14) << format_bytes_3sig(layer.full * per_stage) << "   " << full_formula << "\n\n"
            << std::fixed << std::setprecision(1) << "s^2 share of a layer without recompute: "
            << 100.0 * layer.s2_fraction << "%\n"
            << schedule << " first stage holds " << count(in_flight)
            << " micro-batches in flight: no recompute "
            << format_bytes_3sig(layer.none * per_stage * in_flight) << ", selective "
            << format_bytes_3sig(selective_stage * in_flight) << "\n"
            << "Megatron theoretical_memory_usage (first stage, "
            << (m.sp ? "compute_activation_memory" : "compute_activation_memory_without_sp")
            << "): " << format_bytes_3sig(meg) << "\n"
            << std::setprecision(2) << "offloading the selective activations of one stage: "
            << format_bytes_3sig(selective_stage) << " each way at " << std::defaultfloat << o.bandwidth_gbps
            << std::fixed << " GB/s = "
            << offload_s << " s per micro-batch (not overlapped)\n";
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
  return 0;
}

}  // namespace

Runner add_estimate_command(CLI::App& app) {
  auto o = std::make_shared<EstimateOptions>();
  CLI::App* cmd = app.add_subcommand("estimate", "Analytic activation memory (paper formulas)");
  CLI::Option* preset = cmd->add_option(
      "--preset", o->preset, "7b (the 7B worked example in docs/memory-model.md), 22b, 175b, 530b "
      "or 1t: the base the other flags modify (the default when no size is given; sizes without "
      "--preset describe a model of their own, with Megatron's defaults)")
      ->capture_default_str();
  cmd->add_option("--seq-length", o->s, "s");
  cmd->add_option("--micro-batch-size", o->b, "b");
  cmd->add_option("--hidden-size", o->h, "h");
  cmd->add_option("--num-attention-heads", o->a, "a");
  cmd->add_option("--num-layers", o->L, "L");
  cmd->add_option("--ffn-hidden-size", o->ffn, "ffn (default 4h when --hidden-size is given)");
  cmd->add_option("--vocab-size", o->v, "V");
  cmd->add_option("--tensor-model-parallel-size", o->t, "t");
  cmd->add_option("--pipeline-model-parallel-size", o->p, "p");
  cmd->add_option("--num-layers-per-virtual-pipeline-stage", o->layers_per_vp,
                  "layers per virtual stage (interleaved 1F1B: v = L / p / this)");
  cmd->add_option("--num-virtual-stages-per-pipeline-rank", o->vp,
                  "virtual stages (model chunks) per pipeline rank (interleaved 1F1B)");
  cmd->add_option("--num-microbatches", o->m, "micro-batches per step (Megatron's min(1, m/p))");
  cmd->add_option("--data-parallel-size", o->d, "d (divides the optimizer state with "
                  "--use-distributed-optimizer)");
  cmd->add_flag("--use-distributed-optimizer", o->dist_opt,
                "optimizer state sharded over the data-parallel ranks (6 + 12/d bytes/param)");
  cmd->add_flag("--swiglu", o->swiglu, "gated MLP (the 7b preset has it)");
  cmd->add_flag("--no-swiglu", o->no_swiglu, "GeLU MLP (turns off a preset's SwiGLU)");
  CLI::Option* normalization = cmd->add_option(
      "--normalization", o->normalization, "LayerNorm (weight and bias) or RMSNorm "
      "(weight): the norms' parameters")->capture_default_str();
  cmd->add_flag("--untie-embeddings-and-output-weights", o->untie,
                "separate output layer (the 7b preset has it)");
  cmd->add_flag("--tie-embeddings-and-output-weights", o->tie,
                "output layer tied to the embedding (Megatron's default; turns off a preset's "
                "untied one)");
  cmd->add_flag("--sequence-parallel", o->sp, "sequence parallelism on");
  cmd->add_flag("--no-sequence-parallel", o->no_sp, "sequence parallelism off");
  cmd->add_option("--offload-bandwidth-gbps", o->bandwidth_gbps, "host link, GB/s per direction")
      ->capture_default_str();
  cmd->add_option("--num-experts", o->experts, "MoE: experts per MoE layer (docs/moe.md)");
  cmd->add_option("--moe-router-topk", o->topk, "MoE: experts per token")->capture_default_str();
  cmd->add_option("--moe-ffn-hidden-size", o->moe_ffn, "MoE: each expert's ffn (default ffn)");
  cmd->add_option("--moe-layer-freq", o->moe_freq, "MoE: every N-th layer from layer 0, or a "
                  "0/1 pattern: \"([0]*3+[1]*58)\"")
      ->capture_default_str();
  cmd->add_option("--moe-shared-expert-intermediate-size", o->shared_ffn, "MoE: shared experts' ffn");
  cmd->add_option("--moe-expert-capacity-factor", o->capacity, "MoE: capacity factor (default dropless)");
  cmd->add_flag("--moe-pad-expert-input-to-capacity", o->pad, "MoE: pad every expert to capacity");
  cmd->add_option("--moe-aux-loss-coeff", o->aux_coeff, "MoE: load-balancing loss (> 0: its scores are kept)");
  cmd->add_option("--moe-z-loss-coeff", o->z_coeff, "MoE: z-loss (> 0: its fp32 logits are kept)");
  cmd->add_flag("--moe-shared-expert-gate", o->shared_gate, "MoE: the shared experts' gate (h weights)");
  cmd->add_option("--expert-model-parallel-size", o->ep, "MoE: e, the routed experts split e ways")
      ->capture_default_str();
  cmd->add_option("--expert-tensor-parallel-size", o->etp, "MoE: each expert split this many ways (default t)");
  cmd->add_flag("--multi-latent-attention", o->mla, "MLA: attention terms of docs/mla.md");
  cmd->add_option("--q-lora-rank", o->q_lora, "MLA: the query latent's rank (default none)");
  cmd->add_option("--kv-lora-rank", o->kv_lora, "MLA: the key/value latent's rank")->capture_default_str();
  cmd->add_option("--qk-head-dim", o->qk_head, "MLA: per-head q/k width without RoPE")->capture_default_str();
  cmd->add_option("--qk-pos-emb-head-dim", o->pos_head, "MLA: per-head RoPE width")->capture_default_str();
  cmd->add_option("--v-head-dim", o->v_head, "MLA: per-head value width")->capture_default_str();
  cmd->add_flag("--qk-layernorm", o->qk_layernorm, "MLA: norms on the latents");
  cmd->add_flag("--json", o->json, "print JSON instead of the table");
  // Sizes are positive integers written in full (no "inf", no "2.5" layers); the bandwidth is a
  // positive finite number.
  for (auto* opt : cmd->get_options()) {
    const std::string name = opt->get_name();
    if (opt->get_expected_max() == 0 || name == "--help" || name == "--preset" ||
        name == "--moe-layer-freq") {
      continue;
    }
    if (name == "--normalization") {
      opt->check(CLI::IsMember({"LayerNorm", "RMSNorm"}));
      continue;
    }
    if (name == "--offload-bandwidth-gbps" || name == "--moe-expert-capacity-factor" ||
        name == "--moe-aux-loss-coeff" || name == "--moe-z-loss-coeff") {
      opt->check(positive_number_validator());
    } else {
      opt->check(integer_in_range(1, std::numeric_limits<int64_t>::max()));
    }
  }
  return [o, cmd, preset, normalization]() {
    if (!cmd->parsed()) return -1;
    o->preset_given = preset->count() > 0;
    o->normalization_given = normalization->count() > 0;
    return run(*o);
  };
}

}  // namespace actmem::cli
