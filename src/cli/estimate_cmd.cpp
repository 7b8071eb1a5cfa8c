// estimate_cmd.cpp — `actmem estimate`: the paper's activation-memory model for a named preset or
// the model train's flags describe, per layer and per pipeline stage, with Megatron's theoretical
// terms and the offload transfer time.
#include "actmem/base/report.h"
#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/flags/presets.h"
#include "actmem/flags/train_options.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/model/layer_spec.h"
#include "actmem/model/part_estimate.h"
#include "commands.h"

#include <c10/util/StringUtil.h>
#include <CLI/CLI.hpp>
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
  LayerBytes layer;  // the first stage's mean per layer over its layer kinds
  double per_stage = 0, selective_stage = 0, offload_s = 0, megatron = 0;
  WeightMemory w;
  std::vector<double> stage_in_flight;  // per stage, in micro-batches of the whole stage
  std::vector<std::pair<std::string, PartEstimate>> parts;  // the parts' own sections, by name
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

// The first stage's layer kinds (specs, in order of appearance among its first L/p layers) and
// how many layers each has.
std::vector<std::pair<LayerSpec, double>> first_stage_kinds(const TransformerConfig& config,
                                                            double per_stage) {
  std::vector<std::pair<LayerSpec, double>> kinds;
  const std::vector<LayerSpec> specs = layer_specs(config);
  for (size_t i = 0; i < specs.size() && static_cast<double>(i) < per_stage; ++i) {
    auto it = std::find_if(kinds.begin(), kinds.end(),
                           [&](const auto& k) { return k.first == specs[i]; });
    if (it == kinds.end()) it = kinds.insert(kinds.end(), {specs[i], 0.0});
    it->second += 1.0;
  }
  return kinds;
}

// Note [Estimate's layer as a sum of parts]
// The paper's layer (paper_layer_bytes: Korthikanti's eqs. (1), (2), (4) and Megatron's selective
// generalisation) is the layer of the paper's attention and dense MLP; each of a layer's parts
// replaces its slot's share (LayerPart::paper_layer_bytes: MoE layers by paper_moe_layer_bytes,
// multi-latent attention by paper_mla_attention_bytes), the MLP's part first, then the mixer's.
// A stage of several layer kinds prints their mean per layer, so every per-stage figure is the
// stage's mix (and the s^2 share is the stage's: the s^2 bytes of its layers over their bytes).
Estimate compute(const PaperShape& shape, const TransformerConfig& config, double bandwidth_gbps) {
  Estimate e;
  e.m = shape;
  e.attention = config.attention_summary();
  const PaperShape& m = e.m;
  e.bandwidth_gbps = bandwidth_gbps;
  e.per_stage = m.layers_per_stage();
  e.megatron = m.sp ? megatron_activation_memory(m) : megatron_activation_memory_without_sp(m);
  e.w = megatron_weight_and_optimizer_memory(m);
  e.stage_in_flight = stages_in_flight(m);
  const LayerBytes paper = paper_layer_bytes(m);
  struct KindBytes {
    LayerSpec spec;
    double count;
    LayerBytes layer, with_paper_mlp;
  };
  std::vector<KindBytes> kinds;
  for (const auto& [spec, count] : first_stage_kinds(config, e.per_stage)) {
    const LayerBytes with_paper_mlp = spec.mixer->paper_layer_bytes(m, paper);
    kinds.push_back({spec, count,
                     spec.mixer->paper_layer_bytes(m, spec.mlp->paper_layer_bytes(m, paper)),
                     with_paper_mlp});
  }
  e.layer = kinds.front().layer;
  if (kinds.size() > 1) {
    LayerBytes mix;
    double s2 = 0;
    for (const KindBytes& k : kinds) {
      mix.none += k.layer.none * k.count;
      mix.selective += k.layer.selective * k.count;
      mix.full += k.layer.full * k.count;
      s2 += k.layer.s2_fraction * k.layer.none * k.count;
    }
    mix.s2_fraction = s2 / mix.none;
    mix.none /= e.per_stage, mix.selective /= e.per_stage, mix.full /= e.per_stage;
    e.layer = mix;
  }
  e.selective_stage = e.layer.selective * e.per_stage;
  e.offload_s = offload_round_trip_seconds(e.selective_stage, bandwidth_gbps);
  // Each part's own section, the MLPs' then the mixers': from the first kind that has it.
  for (const PartSlot slot : {PartSlot::kMlp, PartSlot::kMixer}) {
    for (const KindBytes& k : kinds) {
      const LayerPart* part = slot == PartSlot::kMlp ? k.spec.mlp : k.spec.mixer;
      const auto done = [&](const auto& p) { return p.first == part->name(); };
      if (std::any_of(e.parts.begin(), e.parts.end(), done)) continue;
      double count = 0;
      for (const KindBytes& other : kinds) {
        if ((slot == PartSlot::kMlp ? other.spec.mlp : other.spec.mixer) == part)
          count += other.count;
      }
      PartEstimate out;
      part->paper_estimate({m, count, k.layer, k.with_paper_mlp, &e.w}, out);
      if (!out.json.is_null()) e.parts.emplace_back(part->name(), std::move(out));
    }
  }
  return e;
}

nlohmann::json to_json(const Estimate& e) {
  const PaperShape& m = e.m;
  const LayerBytes& layer = e.layer;
  const WeightMemory& w = e.w;
  const std::vector<double>& stage_in_flight = e.stage_in_flight;
  const double per_stage = e.per_stage, selective_stage = e.selective_stage;
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
           rows.push_back({{"stage", r},
                           {"microbatches_in_flight", stage_in_flight[r]},
                           {"activation_bytes",
                            {{"none", layer.none * n},
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
  for (const auto& [name, part] : e.parts) j[name] = part.json;
  return j;
}

// A count of micro-batches (fractional under the interleaved schedule) with up to 4 significant
// digits, whatever the stream's format: 10.33, not 1e+01.
std::string count_text(double x) {
  std::ostringstream os;
  os << std::setprecision(4) << x;
  return os.str();
}

// The header and the per-layer table: the paper's formula beside each recompute setting.
void print_layer_table(const Estimate& e) {
  const PaperShape& m = e.m;
  const LayerBytes& layer = e.layer;
  const double per_stage = e.per_stage, in_flight = e.stage_in_flight.front();
  std::cout
      << "actmem estimate: " << e.base_name << " — s=" << m.s << " b=" << m.b << " h=" << m.h
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
            << format_bytes_3sig(e.selective_stage) << "   " << selective_formula
            << (split_all ? div : "") << "\n"
            << std::left << std::setw(18) << "full" << std::right << std::setw(14)
            << format_bytes_3sig(layer.full) << std::setw(14)
            << format_bytes_3sig(layer.full * per_stage) << "   " << full_formula << "\n\n"
            << std::fixed << std::setprecision(1)
            << (m.flash ? "logsumexp share of a layer without recompute (the flash kernel keeps "
                          "no s^2 term): "
                        : "s^2 share of a layer without recompute: ")
            << 100.0 * layer.s2_fraction << "%\n"
            << e.schedule() << " first stage holds " << count_text(in_flight)
            << " micro-batches in flight: no recompute "
            << format_bytes_3sig(layer.none * per_stage * in_flight) << ", selective "
            << format_bytes_3sig(e.selective_stage * in_flight) << "\n"
            << "Megatron theoretical_memory_usage (first stage, "
            << (m.sp ? "compute_activation_memory" : "compute_activation_memory_without_sp")
            << "): " << format_bytes_3sig(e.megatron) << "\n"
            << std::setprecision(2) << "offloading the selective activations of one stage: "
            << format_bytes_3sig(e.selective_stage) << " each way at " << std::defaultfloat
            << e.bandwidth_gbps << std::fixed << " GB/s = " << e.offload_s
            << " s per micro-batch (not overlapped)\n";
}

// Activations per pipeline stage at the schedule's peak.
void print_stage_table(const Estimate& e) {
  const PaperShape& m = e.m;
  if (m.p <= 1) return;
  std::cout << "\nactivations per pipeline stage at the " << e.schedule()
            << " peak (micro-batches of "
            << "the stage's " << std::defaultfloat << e.per_stage << " layers"
            << (m.vpp ? ", v = " + c10::str(*m.vpp) + " chunks" : std::string()) << ")\n"
            << std::left << std::setw(8) << "stage" << std::right << std::setw(12) << "in flight"
            << std::setw(14) << "none" << std::setw(14) << "selective" << std::setw(14) << "full"
            << "\n";
  for (size_t r = 0; r < e.stage_in_flight.size(); ++r) {
    const double n = e.stage_in_flight[r] * e.per_stage;
    std::cout << std::left << std::setw(8) << r << std::right << std::setw(12) << std::defaultfloat
              << count_text(e.stage_in_flight[r]) << std::fixed << std::setw(14)
              << format_bytes_3sig(e.layer.none * n) << std::setw(14)
              << format_bytes_3sig(e.layer.selective * n) << std::setw(14)
              << format_bytes_3sig(e.layer.full * n) << "\n";
  }
}

// Weights, gradients and optimizer state per rank, and the device totals.
void print_weights(const Estimate& e) {
  const PaperShape& m = e.m;
  const WeightMemory& w = e.w;
  auto total = [&e](double per_layer) { return e.device_total(per_layer); };
  std::cout << "\ndevice memory per rank (the first pipeline stage, with the embedding), mixed "
               "precision, d="
            << std::defaultfloat << m.d
            << (m.distributed_optimizer ? " with the distributed optimizer" : "") << "\n"
            << "  parameters " << std::fixed << std::setprecision(2) << w.parameters / 1e9
            << " B in the model (" << (m.swiglu ? "SwiGLU" : "GeLU") << ", "
            << (m.untied ? "untied" : "tied") << " embeddings), " << w.parameters_on_rank / 1e9
            << " B on this rank\n";
  for (const auto& [name, part] : e.parts) std::cout << part.weights;
  auto row = [](const std::string& label, double bytes) {
    std::cout << std::left << std::setw(44) << label << std::right << std::setw(12)
              << format_bytes_3sig(bytes);
  };
  row("  weights (bf16, 2 B/param)", w.weight_bytes);
  std::cout << "\n";
  row("  gradients (fp32 main grads, 4 B/param)", w.gradient_bytes);
  std::cout << "\n";
  row(m.distributed_optimizer ? "  optimizer (fp32 params + Adam, 12/d B/param)"
                              : "  optimizer (fp32 params + Adam, 12 B/param)",
      w.optimizer_bytes);
  std::cout << "\n";
  row("  weights and optimizer", w.total());
  std::cout << "   " << std::defaultfloat << w.bytes_per_parameter
            << " B/param (Megatron's compute_weight_and_optimizer_memory)\n";
  row("  total, no recompute (first stage in flight)", total(e.layer.none));
  std::cout << "\n";
  row("  total, selective recompute (first stage)", total(e.layer.selective));
  std::cout << "\n";
  row("  total, full recompute (first stage)", total(e.layer.full));
  std::cout << "\n";
  row("  total, Megatron's report_theoretical_memory", w.total() + e.megatron);
  std::cout << "\n";
}

void print_table(const Estimate& e) {
  print_layer_table(e);
  print_stage_table(e);
  for (const auto& [name, part] : e.parts) std::cout << part.section;
  print_weights(e);
}

// Note [Estimating what the paper does not describe]
// Korthikanti et al.'s formulas and Megatron's theoretical_memory_usage.py describe layers of
// standard attention a x d = h wide; Megatron's counts every layer so, including a hybrid's
// linear-attention layers, and has no term for the output gate or the q/k norms (the parts whose
// LayerPart::paper_describes is false). For such models
// estimate prints the project's exact predictor instead (predict_activation_bytes, the one
// `inspect` and the tests check against the tracker to the byte), from the configuration alone:
// one micro-batch on one rank of the first pipeline stage (each of its model chunks), at 16 bits
// with the GPU's conventions (norm statistics in fp32, random-state snapshots on the host), the
// routed experts' rows at a balanced routing (each expert k T / E of the T tokens a router
// sees, from every rank that routes to it). Per layer kind and strategy; weights, gradients and
// optimizer from count_parameters at Megatron's 18 bytes per parameter (6 + 12/d with the
// distributed optimizer).
struct ExactEstimate {
  struct Kind {
    std::string name;    // LayerSpec::name()
    int64_t layers = 0;  // in the whole model
    int64_t first = -1;  // its first layer on the first stage, -1 when the stage has none
  };
  struct Strategy {
    std::string name;
    std::vector<double> layer;  // one layer of each kind (the first of the stage)
    double stage = 0;           // the first stage's layers, embedding, ...
  };
  std::vector<Kind> kinds;
  std::vector<Strategy> strategies;
  std::vector<std::pair<std::string, std::vector<double>>> modules;  // plain, per kind
  double in_flight = 1;
  ParameterCount params;
  double weight_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0;
};

// The layer kinds of `c` in order of appearance, with their counts and first layer on the first
// stage (any of its model chunks).
std::vector<ExactEstimate::Kind> exact_kinds(const TransformerConfig& c,
                                             std::vector<LayerSpec>& kind_specs) {
  const std::vector<LayerSpec> specs = layer_specs(c);
  std::vector<ExactEstimate::Kind> kinds;
  for (const LayerSpec& spec : specs) {
    auto it = std::find(kind_specs.begin(), kind_specs.end(), spec);
    if (it == kind_specs.end()) {
      kind_specs.push_back(spec);
      kinds.push_back({spec.name()});
      it = kind_specs.end() - 1;
    }
    kinds[static_cast<size_t>(it - kind_specs.begin())].layers += 1;
  }
  for (int64_t chunk = 0; chunk < c.virtual_pipeline_size(); ++chunk) {
    const TransformerConfig::StageLayers layers = c.model_chunk_layers(0, chunk);
    for (int64_t i = layers.offset; i < layers.offset + layers.count; ++i) {
      const auto k = static_cast<size_t>(
          std::find(kind_specs.begin(), kind_specs.end(), specs[static_cast<size_t>(i)]) -
          kind_specs.begin());
      if (kinds[k].first < 0) kinds[k].first = i;
    }
  }
  return kinds;
}

// Megatron's selective sets a user would try, cumulatively: each mixer kind's units (in the
// order of the kinds' names), then layernorm with the MLP kinds' units.
std::vector<std::vector<RecomputeModule>> exact_selective_sets(
    const TransformerConfig& c, const std::vector<LayerSpec>& kind_specs) {
  std::vector<const LayerPart*> mixers, mlps;
  for (const LayerSpec& spec : kind_specs) {
    if (std::find(mixers.begin(), mixers.end(), spec.mixer) == mixers.end())
      mixers.push_back(spec.mixer);
    if (std::find(mlps.begin(), mlps.end(), spec.mlp) == mlps.end()) mlps.push_back(spec.mlp);
  }
  std::sort(mixers.begin(), mixers.end(), [](const LayerPart* a, const LayerPart* b) {
    return std::string(a->name()) < b->name();
  });
  std::vector<std::vector<RecomputeModule>> sets;
  std::vector<RecomputeModule> set;
  auto add = [&set](const std::vector<RecomputeModule>& units) {
    for (const RecomputeModule r : units) {
      if (std::find(set.begin(), set.end(), r) == set.end()) set.push_back(r);
    }
  };
  for (const LayerPart* mixer : mixers) {
    const std::vector<RecomputeModule> units = mixer->estimate_units(c);
    if (units.empty()) continue;
    add(units);
    sets.push_back(set);
  }
  add({RecomputeModule::kLayernorm});
  for (const LayerPart* mlp : mlps) add(mlp->estimate_units(c));
  sets.push_back(set);
  return sets;
}

ExactEstimate compute_exact(const TransformerConfig& c, const PaperShape& m) {
  TORCH_CHECK(!c.is_moe() || m.moe.etp == m.t,
              "actmem estimate: an expert tensor-parallel "
              "size (",
              m.moe.etp, ") other than the tensor-parallel size (", m.t,
              ") is not "
              "modelled for models the paper's formulas do not describe");
  ExactEstimate x;
  std::vector<LayerSpec> kind_specs;
  x.kinds = exact_kinds(c, kind_specs);
  // A balanced routing for every MoE layer (Note [Estimating what the paper does not describe]).
  const MoERouting routing = balanced_moe_routing(c);
  auto strategy = [&](const std::string& name, const std::function<void(TransformerConfig&)>& set) {
    TransformerConfig cc = c;
    set(cc);
    const ActivationPlan plan = make_activation_plan(cc);
    ExactEstimate::Strategy s{name, std::vector<double>(x.kinds.size(), 0.0)};
    for (int64_t chunk = 0; chunk < c.virtual_pipeline_size(); ++chunk) {
      const PredictedBytes p =
          predict_activation_bytes(cc, plan, 2, /*snapshots_on_device=*/false,
                                   routing.empty() ? nullptr : &routing, 0, chunk);
      s.stage += static_cast<double>(p.total);
      for (const auto& [module, bytes] : p.by_module) {
        const std::string prefix = "decoder.layers.";
        if (module.rfind(prefix, 0) != 0) continue;
        const int64_t layer = std::stoll(module.substr(prefix.size()));
        for (size_t k = 0; k < x.kinds.size(); ++k) {
          if (x.kinds[k].first != layer) continue;
          s.layer[k] += static_cast<double>(bytes);
          if (name != "none") continue;
          // "decoder.layers.3.self_attention.linear_qkv" -> "self_attention.linear_qkv"
          const std::string rest = module.substr(module.find('.', prefix.size()) + 1);
          auto it = std::find_if(x.modules.begin(), x.modules.end(),
                                 [&](const auto& r) { return r.first == rest; });
          if (it == x.modules.end()) {
            it =
                x.modules.insert(x.modules.end(), {rest, std::vector<double>(x.kinds.size(), 0.0)});
          }
          it->second[k] += static_cast<double>(bytes);
        }
      }
    }
    x.strategies.push_back(s);
  };
  strategy("none", [](TransformerConfig&) {});
  for (const std::vector<RecomputeModule>& set : exact_selective_sets(c, kind_specs)) {
    std::vector<std::string> names;
    for (const RecomputeModule r : set) names.emplace_back(to_string(r));
    strategy("selective " + c10::Join("+", names), [names](TransformerConfig& cc) {
      cc.recompute_granularity = "selective";
      cc.recompute_modules = names;
    });
  }
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
  nlohmann::json kinds = nlohmann::json::array();
  for (const auto& k : x.kinds) {
    kinds.push_back({{"kind", k.name},
                     {"layers", k.layers},
                     {"first_layer_on_first_stage",
                      k.first >= 0 ? nlohmann::json(k.first) : nlohmann::json(nullptr)}});
  }
  nlohmann::json strategies = nlohmann::json::array();
  for (const auto& s : x.strategies) {
    nlohmann::json layer = nlohmann::json::object();
    for (size_t k = 0; k < x.kinds.size(); ++k) layer[x.kinds[k].name] = s.layer[k];
    strategies.push_back({{"name", s.name},
                          {"layer_bytes", layer},
                          {"first_stage_bytes", s.stage},
                          {"first_stage_in_flight_bytes", s.stage * x.in_flight}});
  }
  nlohmann::json modules = nlohmann::json::object();
  for (const auto& [name, bytes] : x.modules) {
    modules[name] = nlohmann::json::object();
    for (size_t k = 0; k < x.kinds.size(); ++k) modules[name][x.kinds[k].name] = bytes[k];
  }
  const double states = x.weight_bytes + x.gradient_bytes + x.optimizer_bytes;
  return {{"model", to_json(c)},
          {"base", base},
          {"method", "exact predictor (the paper's formulas do not describe this model)"},
          {"dtype_bytes", 2},
          {"layer_kinds", kinds},
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
  std::vector<std::string> kinds;
  for (const auto& k : x.kinds) kinds.push_back(std::to_string(k.layers) + " " + k.name);
  std::cout << "actmem estimate: " << base << " — " << c.num_layers << " layers ("
            << c10::Join(", ", kinds) << "), h " << c.hidden_size << ", s " << c.seq_length
            << ", b " << c.micro_batch_size << ", t " << c.tensor_model_parallel_size
            << (c.sequence_parallel ? " (SP)" : "") << ", p " << c.pipeline_model_parallel_size
            << (c.is_moe() ? ", e " + std::to_string(c.expert_model_parallel_size) : "")
            << "\n  the paper's formulas and Megatron's theoretical memory do not describe this "
               "model (a part with no paper terms: linear attention, or attention not h wide,\n"
               "  gated or normed per head): the project's exact predictor instead, 16-bit, one "
               "micro-batch on one rank of the first stage"
            << (c.is_moe() ? ", experts at a balanced routing" : "") << "\n\n";
  const int w = 68;
  // One column per layer kind the first stage has: one layer of it.
  auto header = [&](const char* first) {
    std::cout << std::left << std::setw(w) << first << std::right;
    for (const auto& k : x.kinds) {
      if (k.first >= 0) std::cout << std::setw(16) << k.name;
    }
  };
  header("module (no recompute)");
  std::cout << "\n";
  for (const auto& [name, bytes] : x.modules) {
    std::cout << std::left << std::setw(w) << ("  " + name) << std::right;
    for (size_t k = 0; k < x.kinds.size(); ++k) {
      if (x.kinds[k].first >= 0) {
        std::cout << std::setw(16) << (bytes[k] > 0 ? format_bytes_3sig(bytes[k]) : "-");
      }
    }
    std::cout << "\n";
  }
  std::cout << "\n";
  header("strategy");
  std::cout << std::setw(14) << "first stage" << std::setw(16) << "x in flight"
            << "\n";
  for (const auto& s : x.strategies) {
    std::cout << std::left << std::setw(w) << ("  " + s.name) << std::right;
    for (size_t k = 0; k < x.kinds.size(); ++k) {
      if (x.kinds[k].first >= 0) std::cout << std::setw(16) << format_bytes_3sig(s.layer[k]);
    }
    std::cout << std::setw(14) << format_bytes_3sig(s.stage) << std::setw(16)
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
    TORCH_CHECK(missing.empty(),
                "actmem estimate: a model given by its sizes needs --num-layers, "
                "--hidden-size, --num-attention-heads, --seq-length, --micro-batch-size and "
                "--vocab-size (missing: ",
                c10::Join(", ", missing), "); or name a --preset (",
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
  CLI::App* cmd =
      app.add_subcommand("estimate",
                         "Analytic activation memory (paper formulas) of a preset or of the model "
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
      ->capture_default_str()
      ->check(positive_number_validator());
  cmd->add_flag("--json", o->json, "print JSON instead of the table");
  return [o, cmd]() { return cmd->parsed() ? run(*o, *cmd) : -1; };
}

}  // namespace actmem::cli
