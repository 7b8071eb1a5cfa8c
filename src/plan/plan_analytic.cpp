// plan_analytic.cpp — the planner for models that cannot run here: the paper's per-module
// activation terms, Megatron's weight terms and a roofline step time (Note [Analytic plan] in
// plan_analytic.h).
#include "actmem/plan/plan_analytic.h"

#include "actmem/config/activation_plan.h"
#include "actmem/model/layer_spec.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <optional>

namespace actmem {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Achieved rates (docs/planner.md, "Paper presets"): GEMMs at 70% of the dense BF16 peak,
// device memory at 80% of its peak bandwidth, the host link at its measured pinned copy rate.
const std::map<std::string, DeviceSpec>& devices() {
  static const std::map<std::string, DeviceSpec> table = {
      {"a100",
       {"a100", 80 * kGiB, 0.7 * 312e12, 0.8 * 2.039e12, 25e9, 25e9,
        "A100 80GB SXM: 312 TFLOP/s dense BF16, 2.04 TB/s HBM2e, PCIe Gen4 x16 "
        "(about 25 GB/s pinned)"}},
      {"h100",
       {"h100", 80 * kGiB, 0.7 * 989e12, 0.8 * 3.35e12, 55.6e9, 55.6e9,
        "H100 SXM: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, PCIe Gen5 x16 (55.6 GB/s "
        "pinned, nvbandwidth)"}},
      {"h200",
       {"h200", 141 * kGiB, 0.7 * 989e12, 0.8 * 4.8e12, 55.6e9, 55.6e9,
        "H200 SXM: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, PCIe Gen5 x16 (55.6 GB/s "
        "pinned)"}},
      {"gh200",
       {"gh200", 96 * kGiB, 0.7 * 989e12, 0.8 * 4.0e12, 297e9, 375e9,
        "GH200 96GB: 989 TFLOP/s dense BF16, 4.0 TB/s HBM3, NVLink-C2C (297 GB/s "
        "device to host, 375 GB/s host to device, measured)"}},
  };
  return table;
}

// Note [Analytic layers as a sum of parts]
// One transformer layer for one micro-batch on one rank is its own terms — the norms' inputs
// (attn_norm and mlp_norm move them), the residual dropout masks, the norms' and the
// bias-dropout-adds' element-wise work (layernorm recompute repeats the norms') — and its parts'
// (LayerPart::analytic_terms: the paper's 16-bit terms of each module, Korthikanti et al. 2022
// §4.1, with the selective units that drop them and the offload group that moves them, and the
// forward as a roofline). With sequence parallelism everything is split t ways; without it the
// norms' inputs and outputs and the dropout masks are replicated (the paper's eq. (2): 10sbh of
// them). A selective set drops the tensors any of its units drops and repeats the work any of
// them repeats; an offload group moves the tensors it names that stay kept. The stage's layers
// are counted by spec (layer_spec.h): its parts' kinds.
struct LayerTensor {
  AnalyticTensor tensor;
  bool attention_half = false;  // the input norm, the mixer and its dropout
};
struct LayerTerms {
  std::vector<LayerTensor> tensors;
  std::vector<AnalyticWork> work;
  double backward_extra_flops = 0;
  double input = 0;  // what full recompute keeps of a layer: its input
};

LayerTerms layer_terms(const PaperShape& m, const LayerSpec& spec) {
  const double sbh = m.sbh(), r = m.sp ? m.t : 1.0;
  LayerTerms x;
  auto add = [&x](const std::vector<AnalyticTensor>& tensors, bool attention) {
    for (const AnalyticTensor& t : tensors) x.tensors.push_back({t, attention});
  };
  const AnalyticTerms mixer = spec.mixer->analytic_terms(m);
  const AnalyticTerms mlp = spec.mlp->analytic_terms(m);
  add({{2 * sbh / r, {}, OffloadModule::kAttnNorm}}, true);  // input_layernorm's input
  add(mixer.tensors, true);
  add({{sbh / r, {}, std::nullopt}}, true);                  // self_attn_bda's dropout mask
  add({{2 * sbh / r, {}, OffloadModule::kMlpNorm}}, false);  // pre_mlp_layernorm's input
  add(mlp.tensors, false);
  add({{sbh / r, {}, std::nullopt}}, false);  // mlp_bda's dropout mask
  // Two norms read and write; the two bias-dropout-adds read the output, bias and residual and
  // write the sum and the mask.
  x.work = {{0.0, 2 * (2 * sbh + 2 * sbh) / r, {RecomputeModule::kLayernorm}},
            {0.0, 2 * (2 * sbh + 2 * sbh + 2 * sbh + sbh) / r, {}}};
  x.work.insert(x.work.end(), mixer.work.begin(), mixer.work.end());
  x.work.insert(x.work.end(), mlp.work.begin(), mlp.work.end());
  x.backward_extra_flops = mixer.backward_extra_flops + mlp.backward_extra_flops;
  x.input = 2 * sbh / r;
  return x;
}

template <typename T>
bool has(const std::vector<T>& names, T name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

bool any_of(const std::vector<RecomputeModule>& units, const Strategy& s) {
  return std::any_of(units.begin(), units.end(),
                     [&s](RecomputeModule r) { return has(s.recompute_modules, r); });
}

// What one layer's selective recompute drops, and its rebuild at once in the backward (the MLP
// half's and the attention half's, the larger of them).
struct Dropped {
  double bytes = 0, transient = 0;
};

double total_bytes(const LayerTerms& x) {
  double n = 0;
  for (const LayerTensor& t : x.tensors) n += t.tensor.bytes;
  return n;
}

Dropped selective_dropped(const LayerTerms& x, const Strategy& s) {
  double attn = 0, mlp = 0;
  for (const LayerTensor& t : x.tensors) {
    if (any_of(t.tensor.dropped_by, s)) (t.attention_half ? attn : mlp) += t.tensor.bytes;
  }
  return {attn + mlp, std::max(attn, mlp)};
}

double offloaded_per_layer(const LayerTerms& x, const Strategy& s) {
  double moved = 0;
  for (const LayerTensor& t : x.tensors) {
    if (t.tensor.moved_by && has(s.offload_modules, *t.tensor.moved_by) &&
        !any_of(t.tensor.dropped_by, s)) {
      moved += t.tensor.bytes;
    }
  }
  return moved;
}

// One layer's forward on one micro-batch, and what a strategy's recompute repeats of it.
double work_seconds(const AnalyticWork& w, const DeviceSpec& gpu) {
  return w.flops / gpu.matmul_flops + w.bytes / gpu.memory_bandwidth;
}
double forward_seconds(const LayerTerms& x, const DeviceSpec& gpu) {
  double s = 0;
  for (const AnalyticWork& w : x.work) s += work_seconds(w, gpu);
  return s;
}
double repeated_seconds(const LayerTerms& x, const Strategy& s, const DeviceSpec& gpu) {
  double seconds = 0;
  for (const AnalyticWork& w : x.work) {
    if (any_of(w.repeated_by, s)) seconds += work_seconds(w, gpu);
  }
  return seconds;
}

// The layer specs of `m`'s model, one per layer.
std::vector<LayerSpec> shape_specs(const PaperShape& m) {
  const std::vector<LayerSpec> specs = layer_specs(analytic_config(m));
  TORCH_CHECK(specs.size() == static_cast<size_t>(m.L),
              "actmem::estimate_plans_analytic: the "
              "configuration has ",
              specs.size(), " layers, the shape ", m.L);
  return specs;
}

using KindCounts = std::vector<double>;  // per layer kind of the stage (StageLayers::specs)

// The first pipeline stage's layers by kind (their specs): its v model chunks hold layers
// [j p Lc, j p Lc + Lc) for j < v (Megatron's interleaved assignment; v = 1 without it).
struct StageLayers {
  std::vector<LayerSpec> specs;  // each kind once, in order of appearance
  KindCounts count;
  std::vector<int64_t> first;  // the first layer of each kind
  std::vector<int64_t> chunk;  // and its model chunk
  // Per model chunk, the layers of each kind among its first n (block recompute's), n = 1..Lc.
  std::vector<std::vector<KindCounts>> chunk_prefix;
};

double virtual_stages(const PaperShape& m) {
  return m.p > 1 && m.vpp ? *m.vpp : 1.0;
}

StageLayers stage_layers(const PaperShape& m) {
  const int64_t v = static_cast<int64_t>(virtual_stages(m));
  const int64_t Lc = static_cast<int64_t>(m.layers_per_stage() / static_cast<double>(v));
  const int64_t p = static_cast<int64_t>(m.p);
  const std::vector<LayerSpec> specs = shape_specs(m);
  StageLayers out;
  for (int64_t j = 0; j < v; ++j) {
    for (int64_t i = 0; i < Lc; ++i) {
      const LayerSpec& spec = specs[static_cast<size_t>(j * p * Lc + i)];
      if (std::find(out.specs.begin(), out.specs.end(), spec) == out.specs.end()) {
        out.specs.push_back(spec);
      }
    }
  }
  const size_t kinds = out.specs.size();
  out.count.assign(kinds, 0.0);
  out.first.assign(kinds, -1);
  out.chunk.assign(kinds, 0);
  for (int64_t j = 0; j < v; ++j) {
    std::vector<KindCounts> prefix;
    KindCounts n(kinds, 0.0);
    for (int64_t i = 0; i < Lc; ++i) {
      const int64_t layer = j * p * Lc + i;
      const auto k = static_cast<size_t>(
          std::find(out.specs.begin(), out.specs.end(), specs[static_cast<size_t>(layer)]) -
          out.specs.begin());
      n[k] += 1;
      if (out.first[k] < 0) {
        out.first[k] = layer;
        out.chunk[k] = j;
      }
      prefix.push_back(n);
    }
    for (size_t k = 0; k < kinds; ++k) out.count[k] += n[k];
    out.chunk_prefix.push_back(std::move(prefix));
  }
  return out;
}

// The output layer and the loss on one micro-batch (forward): the logits GEMM and the fp32
// logits written and read by the cross-entropy.
double head_forward_s(const PaperShape& m, const DeviceSpec& gpu) {
  const double sbv = m.s * m.b * m.v;
  return 2 * sbv * m.h / m.t / gpu.matmul_flops + 8 * sbv / m.t / gpu.memory_bandwidth;
}

// Micro-batches in flight on the first stage in units of the stage's layers: p under 1F1B
// (fewer when there are fewer micro-batches), times Megatron's interleave factor 1 + (p-1)/(pv).
double in_flight(const PaperShape& m) {
  if (m.p <= 1) return 1.0;
  if (m.vpp) return m.p * (1.0 + (m.p - 1.0) / (m.p * *m.vpp));
  if (m.num_microbatches) return std::min(m.p, *m.num_microbatches);
  return m.p;
}

// Exposed copy time of `bytes` per layer: the forward's copy hides behind the next layer's
// forward, the backward's reload behind the layer's backward (twice the forward).
double exposed_copy_s(double bytes, double forward_s, const DeviceSpec& gpu) {
  return std::max(0.0, bytes / gpu.d2h_bandwidth - forward_s) +
         std::max(0.0, bytes / gpu.h2d_bandwidth - 2 * forward_s);
}

}  // namespace

nlohmann::json DeviceSpec::to_json() const {
  return {{"name", name},
          {"memory_bytes", memory_bytes},
          {"matmul_flops", matmul_flops},
          {"memory_bandwidth_bytes_per_s", memory_bandwidth},
          {"d2h_bytes_per_s", d2h_bandwidth},
          {"h2d_bytes_per_s", h2d_bandwidth},
          {"source", source}};
}

std::vector<std::string> device_spec_names() {
  std::vector<std::string> names;
  for (const auto& [name, _] : devices()) names.push_back(name);
  return names;
}

DeviceSpec device_spec(const std::string& name) {
  const auto it = devices().find(name);
  TORCH_CHECK(it != devices().end(), "actmem::device_spec: unknown GPU '", name,
              "'; known: ", c10::Join(", ", device_spec_names()));
  return it->second;
}

TransformerConfig analytic_config(const PaperShape& m) {
  TORCH_CHECK(m.config != nullptr || (!m.is_moe() && !m.is_mla()),
              "actmem::analytic_config: "
              "an MoE or multi-latent attention shape needs the configuration it was read from "
              "(paper_shape): the doubles do not say which layers are MoE");
  auto whole = [](double x, const char* what) {
    TORCH_CHECK(x >= 1 && x <= 9.0e15 && std::floor(x) == x, "actmem::analytic_config: ", what,
                " must be a positive integer (got ", x, ")");
    return static_cast<int64_t>(x);
  };
  // The configuration's MoE and MLA switches and layer pattern, the shape's sizes and layout
  // (a shape may be changed after paper_shape(): the tests plan one stage of a preset).
  TransformerConfig c = m.config != nullptr ? *m.config : TransformerConfig{};
  // Models the paper does not describe take their terms from the exact predictor (Note
  // [Analytic terms from the exact predictor]), which counts neither MLA on a hybrid nor another
  // expert tensor-parallel size.
  TORCH_CHECK(paper_describes(c) || !m.is_moe() || m.moe.etp <= 0 || m.moe.etp == m.t,
              "actmem::analytic_config: an expert tensor-parallel size (", m.moe.etp,
              ") other than the tensor-parallel size (", m.t,
              ") is not modelled for models the "
              "paper's formulas do not describe");
  TORCH_CHECK(c.is_moe() == m.is_moe() && c.multi_latent_attention == m.is_mla(),
              "actmem::analytic_config: the shape ", m.is_moe() ? "has" : "has no", " experts and ",
              m.is_mla() ? "" : "no ", "multi-latent attention, its configuration ",
              c.is_moe() ? "has" : "has no", " experts and ", c.multi_latent_attention ? "" : "no ",
              "multi-latent attention");
  c.num_layers = whole(m.L, "num_layers");
  c.hidden_size = whole(m.h, "hidden_size");
  c.num_attention_heads = whole(m.a, "num_attention_heads");
  c.num_query_groups = m.g > 0 && m.g != m.a && !m.is_mla() ? whole(m.g, "num_query_groups") : 0;
  c.ffn_hidden_size = whole(m.ffn, "ffn_hidden_size");
  c.seq_length = whole(m.s, "seq_length");
  c.micro_batch_size = whole(m.b, "micro_batch_size");
  c.vocab_size = whole(m.v, "vocab_size");
  c.tensor_model_parallel_size = whole(m.t, "tensor_model_parallel_size");
  c.pipeline_model_parallel_size = whole(m.p, "pipeline_model_parallel_size");
  c.sequence_parallel = m.sp;
  c.gated_linear_unit = m.swiglu;
  c.untie_embeddings_and_output_weights = m.untied;
  c.bf16 = true;
  c.fp16 = false;
  // The shape's attention kernel (plan --preset costs both): the exact predictor reads it from
  // the configuration; flash cannot drop attention probabilities, so its configuration is the
  // one with --attention-dropout 0 (Note [Plan a preset under each kernel] in plan_cmd.cpp).
  if (m.flash != c.flash_attention() && !c.multi_latent_attention) {
    c.attention_backend = m.flash ? "flash" : "unfused";
    if (m.flash) c.attention_dropout = 0.0;
  }
  c.num_virtual_stages_per_pipeline_rank.reset();
  if (m.p > 1 && m.vpp && *m.vpp > 1) {
    c.num_virtual_stages_per_pipeline_rank = whole(*m.vpp, "virtual pipeline stages");
  }
  c.validate_shape();
  return c;
}

std::vector<Strategy> analytic_strategies(const PaperShape& m) {
  // Layer-level offload is proposed where Megatron allows it (no pipeline parallelism): here the
  // peak is the model's, not a copy thread's timing (the measured planner's reason to skip it).
  return enumerate_strategies(analytic_config(m), /*layer_offload=*/m.p == 1);
}

nlohmann::json AnalyticBasis::to_json() const {
  return {{"static_bytes", static_bytes},
          {"microbatches_in_flight", microbatches_in_flight},
          {"layers_per_stage", layers_per_stage},
          {"layer_forward_s", layer_forward_s},
          {"plain_step_s", plain_step_s}};
}

namespace {
// A stage's layers of each kind with their terms and their forward time.
struct Kind {
  double count = 0;
  size_t index = 0;  // in StageLayers::specs
  LayerSpec spec;
  LayerTerms x;
  double forward_s = 0;
};

std::vector<Kind> stage_kinds(const PaperShape& m, const StageLayers& stage,
                              const DeviceSpec& gpu) {
  std::vector<Kind> kinds;
  for (size_t k = 0; k < stage.specs.size(); ++k) {
    LayerTerms x = layer_terms(m, stage.specs[k]);
    const double forward = forward_seconds(x, gpu);
    kinds.push_back({stage.count[k], k, stage.specs[k], std::move(x), forward});
  }
  return kinds;
}

bool beyond_paper(const PaperShape& m) {
  return m.config != nullptr && !paper_describes(*m.config);
}

// Note [Analytic terms from the exact predictor]
// For a model the paper does not describe (a part whose LayerPart::paper_describes is false:
// the output gate, q/k norms, heads wider than h / a, linear-attention mixers) a layer's terms
// are the exact predictor's (predict_activation_bytes,
// which the tests of inspect and of every strategy check against the tracker to the byte) for
// the first layer of each kind on the first stage: at 16 bits with the GPU's conventions (norm
// statistics in fp32, random-state snapshots on the host), the routed experts at a balanced
// routing, dropout as configured — what `estimate` prints for such a model. Under a selective
// set the predictor runs with that set; what the set drops is the plain layer's bytes less
// those, in two halves each rebuilt at once in the backward (the attention half: the input norm,
// the mixer, its dropout; the MLP half: the rest). An offload group moves the bytes of the
// modules it wraps: attn_norm input_layernorm's, mlp_norm pre_mlp_layernorm's, and each part's
// own groups (LayerPart::offload_group: attention's qkv_linear, core_attn and attn_proj, the
// grouped experts' expert_fc1 and moe_act) — what the offloader copies when every tensor passes
// its size threshold. The embedding, output layer and loss keep the paper path's terms.
class PredictedLayers {
 public:
  using Modules = std::vector<std::pair<std::string, double>>;  // module under the layer, bytes
  PredictedLayers(TransformerConfig c, const StageLayers& stage)
      : c_(std::move(c)), stage_(stage), routing_(balanced_moe_routing(c_)) {}
  // The first layer of kind `kind` on the first stage under selective set `set`.
  const Modules& layer(size_t kind, const std::vector<RecomputeModule>& set) {
    auto it = cache_.find(set);
    if (it == cache_.end()) it = cache_.emplace(set, predict(set)).first;
    return it->second[kind];
  }

 private:
  std::vector<Modules> predict(const std::vector<RecomputeModule>& set) const {
    Strategy selective;
    selective.recompute_modules = set;
    const TransformerConfig cc = selective.apply(c_);
    const ActivationPlan plan = make_activation_plan(cc);
    std::map<int64_t, PredictedBytes> chunks;
    std::vector<Modules> out(stage_.specs.size());
    for (size_t k = 0; k < stage_.specs.size(); ++k) {
      const int64_t first = stage_.first[k];
      const int64_t chunk = stage_.chunk[k];
      auto it = chunks.find(chunk);
      if (it == chunks.end()) {
        it = chunks
                 .emplace(chunk, predict_activation_bytes(
                                     cc, plan, 2, /*snapshots_on_device=*/false,
                                     routing_.empty() ? nullptr : &routing_, 0, chunk))
                 .first;
      }
      const std::string prefix = "decoder.layers." + std::to_string(first) + ".";
      for (const auto& [module, bytes] : it->second.by_module) {
        if (module.rfind(prefix, 0) == 0) {
          out[k].emplace_back(module.substr(prefix.size()), static_cast<double>(bytes));
        }
      }
    }
    return out;
  }
  TransformerConfig c_;
  StageLayers stage_;
  MoERouting routing_;
  std::map<std::vector<RecomputeModule>, std::vector<Modules>> cache_;
};

bool attention_half(const std::string& module) {
  return module.rfind("input_layernorm", 0) == 0 || module.rfind("self_attention", 0) == 0 ||
         module.rfind("self_attn_bda", 0) == 0;
}

// Whether offload group `g` moves what `module` (a path under the layer) saves.
bool group_moves(OffloadModule g, const std::string& module, const LayerSpec& spec) {
  if (g == OffloadModule::kAttnNorm) return module == "input_layernorm";
  if (g == OffloadModule::kMlpNorm) return module == "pre_mlp_layernorm";
  for (const auto& [slot, part] :
       {std::pair<std::string, const LayerPart*>{"self_attention.", spec.mixer},
        std::pair<std::string, const LayerPart*>{"mlp.", spec.mlp}}) {
    if (module.rfind(slot, 0) == 0) return part->offload_group(module.substr(slot.size())) == g;
  }
  return false;
}

// One layer of a kind under strategy `s`'s selective set and offload groups: its plain bytes,
// what the set drops (and rebuilds at once), what the groups move.
struct KindCost {
  double plain = 0;
  Dropped dropped;
  double moved = 0;
};

KindCost kind_cost(const Kind& k, const Strategy& s, PredictedLayers* exact) {
  if (exact == nullptr) {
    return {total_bytes(k.x), selective_dropped(k.x, s), offloaded_per_layer(k.x, s)};
  }
  double plain_attn = 0, plain_mlp = 0, attn = 0, mlp = 0, moved = 0;
  for (const auto& [module, bytes] : exact->layer(k.index, {})) {
    (attention_half(module) ? plain_attn : plain_mlp) += bytes;
  }
  for (const auto& [module, bytes] : exact->layer(k.index, s.recompute_modules)) {
    (attention_half(module) ? attn : mlp) += bytes;
    for (const OffloadModule g : s.offload_modules) {
      if (group_moves(g, module, k.spec)) moved += bytes;
    }
  }
  KindCost cost;
  cost.plain = plain_attn + plain_mlp;
  cost.dropped = {cost.plain - attn - mlp, std::max(plain_attn - attn, plain_mlp - mlp)};
  cost.moved = moved;
  return cost;
}
}  // namespace

WeightMemory analytic_weight_memory(const PaperShape& m) {
  return beyond_paper(m)
             ? config_weight_and_optimizer_memory(analytic_config(m), m.d, m.distributed_optimizer)
             : megatron_weight_and_optimizer_memory(m);
}

AnalyticBasis analytic_basis(const PaperShape& m, const DeviceSpec& gpu) {
  TORCH_CHECK(gpu.matmul_flops > 0 && gpu.memory_bandwidth > 0 && gpu.d2h_bandwidth > 0 &&
                  gpu.h2d_bandwidth > 0,
              "actmem::analytic_basis: the GPU's rates must be positive");
  AnalyticBasis basis;
  basis.static_bytes = analytic_weight_memory(m).total();
  basis.microbatches_in_flight = in_flight(m);
  basis.layers_per_stage = m.layers_per_stage();
  double forward = 0, step = 0;
  for (const Kind& k : stage_kinds(m, stage_layers(m), gpu)) {
    forward += k.count * k.forward_s;
    step += k.count * (3 * k.forward_s + k.x.backward_extra_flops / gpu.matmul_flops);
  }
  basis.layer_forward_s = forward / basis.layers_per_stage;
  basis.plain_step_s = step + (m.p == 1 ? 3 * head_forward_s(m, gpu) : 0.0);
  return basis;
}

std::vector<PlanEstimate> estimate_plans_analytic(const PaperShape& m,
                                                  const std::vector<Strategy>& strategies,
                                                  const DeviceSpec& gpu) {
  const AnalyticBasis basis = analytic_basis(m, gpu);
  const StageLayers stage = stage_layers(m);
  const std::vector<Kind> kinds = stage_kinds(m, stage, gpu);
  std::optional<PredictedLayers> predicted;
  if (beyond_paper(m)) predicted.emplace(analytic_config(m), stage);
  PredictedLayers* exact = predicted ? &*predicted : nullptr;
  const Strategy plain;
  const double Ls = basis.layers_per_stage, v = virtual_stages(m), Lc = Ls / v;
  const double flight = basis.microbatches_in_flight;
  const double input = kinds.front().x.input;     // the same for every kind
  double largest = 0;                             // the largest layer's bytes
  std::vector<double> plain_bytes(kinds.size());  // each kind's layer without recompute or offload
  for (const Kind& k : kinds) {
    plain_bytes[k.index] = kind_cost(k, plain, exact).plain;
    largest = std::max(largest, plain_bytes[k.index]);
  }
  // The first stage's embedding (int64 input ids and its dropout mask, Megatron's terms) per
  // micro-batch in flight; the output layer's input and fp32 logits once without pipelining.
  const double embedding = (8 * m.s * m.b + m.sbh()) / m.t;
  const double head = m.p == 1 ? m.sbh() * 4 * (1 + m.v / m.h) / m.t : 0.0;
  // What the backward starts from: the fp32 logits' gradient, or the received output gradient.
  const double backward_start = m.p == 1 ? 4 * m.s * m.b * m.v / m.t : input;
  // Layer-level offload moves the model's first K layers (no pipeline stages: the stage is the
  // model); their kinds, K = 1..L.
  std::vector<KindCounts> first_layers;
  if (!stage.chunk_prefix.empty()) first_layers = stage.chunk_prefix.front();
  std::vector<PlanEstimate> out;
  for (const Strategy& s : strategies) {
    double per_microbatch = 0;  // the stage's layers' kept bytes for one micro-batch
    double transient = 0;       // rebuilt or reloaded at once at the backward's start
    double extra_s = 0;         // per micro-batch
    double moved = 0;           // offloaded bytes in all
    if (s.full_method == RecomputeMethod::kUniform) {
      const double n = std::min<double>(static_cast<double>(s.full_layers), Lc);
      per_microbatch = v * std::ceil(Lc / n) * input;
      transient = n * largest - input;  // the last chunk rebuilt, its input already held
      for (const Kind& k : kinds) extra_s += k.count * k.forward_s;
    } else if (s.full_method == RecomputeMethod::kBlock) {
      const size_t n =
          static_cast<size_t>(std::min<double>(static_cast<double>(s.full_layers), Lc));
      // Each model chunk's first n layers keep their input, the others everything.
      for (const auto& prefix : stage.chunk_prefix) {
        per_microbatch += static_cast<double>(n) * input;
        for (const Kind& k : kinds) {
          const double rebuilt = prefix[n - 1][k.index], all = prefix.back()[k.index];
          per_microbatch += (all - rebuilt) * plain_bytes[k.index];
          extra_s += rebuilt * k.forward_s;
        }
      }
      // With plain layers after the block, rebuilding one layer comes after they are freed.
      transient = static_cast<double>(n) == Lc ? largest - input : 0.0;
    } else {
      double per_layer_moved = 0, exposed = 0;
      for (const Kind& k : kinds) {
        const KindCost cost = kind_cost(k, s, exact);
        per_microbatch += k.count * (cost.plain - cost.dropped.bytes);
        transient = std::max(transient, cost.dropped.transient);
        extra_s += k.count * repeated_seconds(k.x, s, gpu);
        per_layer_moved = std::max(per_layer_moved, cost.moved);
        moved += k.count / Ls * cost.moved;
        exposed += k.count / Ls * exposed_copy_s(cost.moved, k.forward_s, gpu);
      }
      if (!s.offload_modules.empty()) {
        // Every layer of every forward in flight but the margin (the last layer before the
        // backward, Note [Offload warmup and margin] in offload_schedule.h), the stage's kinds
        // in proportion; the backward reloads one layer ahead.
        const double layers_moved = std::max(0.0, flight * Ls - 1);
        moved *= layers_moved;
        transient += per_layer_moved;
        extra_s += layers_moved / flight * exposed;
      } else {
        moved = 0;
      }
      if (s.offload_layers > 0) {
        // The first K layers' saved tensors; their reload comes after later layers are freed.
        const KindCounts& first = first_layers[static_cast<size_t>(s.offload_layers) - 1];
        for (const Kind& k : kinds) {
          const KindCost cost = kind_cost(k, s, exact);
          const double layer = cost.plain - cost.dropped.bytes;
          const double count = first[k.index];
          moved += count * layer;
          extra_s += count * exposed_copy_s(layer, k.forward_s, gpu);
        }
      }
    }
    const double kept = flight * (per_microbatch + embedding) + head - moved;
    const double peak = basis.static_bytes + kept + std::max(backward_start, transient);
    PlanEstimate e;
    e.strategy = s;
    e.kept_bytes = std::llround(kept);
    e.peak_bytes = std::llround(peak);
    e.step_ratio = 1.0 + extra_s / basis.plain_step_s;
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace actmem
