// activation_bytes.cpp — the exact predictor, the memory pre-check's bound, the parameter count
// and the per-module paper terms (activation_bytes.h), each a sum over every layer's parts
// (Note [A layer part owns its contract] in layer_part.h) plus what every layer and the model
// around the layers hold.
#include "actmem/model/activation_bytes.h"

#include "actmem/model/layer_spec.h"
#include "actmem/recompute/rng.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

namespace actmem {

int64_t SavedBytesContext::gemm_input(int64_t elements, int64_t kept_bytes,
                                      bool save_original) const {
  if (!fp8) return kept_bytes;
  // The weight's scale (4 bytes) always; the 16-bit input, or its quantized copy and scale_inv.
  if (save_original || !config.fp8_wgrad) return kept_bytes + 4;
  return elements + 8;
}

int64_t SavedBytesContext::norm_statistics(int64_t rows) const {
  return config.use_rmsnorm() ? rows * up : 2 * rows * ln_stat;
}

int64_t SavedBytesContext::norm_scale(int64_t features) const {
  return config.layernorm_zero_centered_gamma ? features * e : 0;
}

int64_t checkpoint_snapshot_bytes(bool snapshots_on_device) {
  if (!snapshots_on_device) return 0;
  // The CPU (and CUDA) generator states and the tracker's three streams of
  // model_parallel_manual_seed, which are CPU generator states on CPU. Read off the live
  // generators, so it is exact on every build.
  const RngSnapshot s = get_all_rng_states();
  const int64_t cpu = static_cast<int64_t>(s.cpu.nbytes());
  int64_t n = cpu + 3 * cpu;
  if (s.cuda.defined()) n += static_cast<int64_t>(s.cuda.nbytes());
  return n;
}

// Note [What this model saves] (read off the activation ledger, `actmem inspect --records`;
// e = dtype bytes, masks 1 byte, mean/rstd in the dtype; at 16 bits the loss's values and
// RMSNorm's rstd are fp32, and so are LayerNorm's mean/rstd on CUDA — 2 bytes on CPU). Around
// the layers' parts (each part's own Note in its <kind>_part.cpp, Note [What standard attention
// keeps] for one):
//   embedding            dropout mask sbh                           (if hidden_dropout > 0)
//   input_layernorm      input sbh·e + mean, rstd 2·sb·e (LayerNorm) | input + rstd sb·e (RMSNorm);
//                        its output sbh·e is counted by the mixer that saves it first
//   self_attn_bda        dropout mask sbh                           (if hidden_dropout > 0)
//   pre_mlp_layernorm    as input_layernorm (its output counted by the MLP part)
//   mlp_bda              dropout mask sbh                           (if hidden_dropout > 0)
//   final_layernorm      as a layer norm;  output_layer: its input sbh·e
//   loss                 log-softmax output sbv·e, int64 targets 8sb (a copy when b, s > 1),
//                        total weight e
// plus the loss value itself (e), and one random-state snapshot per checkpoint. Selective
// "layernorm" keeps each norm's input through its checkpoint with a snapshot instead of the
// statistics, and frees the norm's output (the parts then count 0 for their input).
namespace {

// What one prediction needs besides the config and the plan.
struct PredictOptions {
  int64_t e = 0;
  bool cpu = true;  // snapshots on the device, CPU LayerNorm statistics
  const MoERouting* routing = nullptr;
  bool upper_bound = false;
  int64_t stage = 0, chunk = 0;
};

class Accumulator {
 public:
  void add(const std::string& module, int64_t bytes) {
    if (bytes == 0) return;
    auto it = std::find_if(p_.by_module.begin(), p_.by_module.end(),
                           [&](const auto& m) { return m.first == module; });
    if (it == p_.by_module.end()) {
      p_.by_module.emplace_back(module, bytes);
    } else {
      it->second += bytes;
    }
    p_.total += bytes;
  }
  PredictedBytes take() { return std::move(p_); }

 private:
  PredictedBytes p_;
};

// The sizes every layer's norms, masks and the model's ends share.
struct Common {
  int64_t e, up, ln_stat, snapshot;
  int64_t sb;        // this rank's residual-stream tokens
  int64_t sbh;       // sb h
  int64_t sbh_full;  // s b h
  // A norm's input and statistics, or with selective layernorm recompute its checkpoint's input
  // and snapshot.
  int64_t norm, norm_recomputed;
  bool hidden_dropout;
};

Common common_sizes(const TransformerConfig& c, const PredictOptions& o) {
  Common k;
  k.e = o.e;
  k.up = o.e == 2 ? 4 : o.e;  // upcast values: fp32 at 16 bits, the dtype otherwise
  // LayerNorm's mean and rstd: libtorch's CPU kernel keeps them in the input's type, the CUDA
  // kernel in fp32 at 16 bits (its accumulate type). RMSNorm (ours) keeps rstd upcast.
  k.ln_stat = o.cpu ? o.e : k.up;
  k.snapshot = checkpoint_snapshot_bytes(o.cpu);
  const int64_t t = c.tensor_model_parallel_size;
  k.sb = c.sequence_parallel ? c.seq_length * c.micro_batch_size / t
                             : c.seq_length * c.micro_batch_size;
  k.sbh = k.sb * c.hidden_size;
  k.sbh_full = c.seq_length * c.micro_batch_size * c.hidden_size;
  const int64_t stats = c.use_rmsnorm() ? k.sb * k.up : 2 * k.sb * k.ln_stat;
  const int64_t gamma1p = c.layernorm_zero_centered_gamma ? k.e * c.hidden_size : 0;
  k.norm = k.sbh * k.e + stats + gamma1p;
  k.norm_recomputed = k.sbh * k.e + k.snapshot;
  k.hidden_dropout = c.hidden_dropout > 0.0;
  return k;
}

// One layer outside a full-recompute chunk: its norms and masks, and its parts' bytes.
void add_layer(Accumulator& acc, const TransformerConfig& c, const Common& k, const LayerSpec& spec,
               const LayerPlan& lp, int64_t index, const std::string& layer,
               const PredictOptions& o, const std::map<const LayerPart*, size_t>& kind_index) {
  const bool sel_norm = lp.recomputes(RecomputeModule::kLayernorm);
  const int64_t norm = sel_norm ? k.norm_recomputed : k.norm;
  auto part = [&](const LayerPart* p, const std::string& slot) {
    SavedBytesContext ctx{c, lp};
    ctx.e = k.e, ctx.up = k.up, ctx.ln_stat = k.ln_stat, ctx.cpu = o.cpu;
    ctx.snapshot = k.snapshot, ctx.tokens = k.sb;
    ctx.input = sel_norm ? 0 : k.sbh * k.e;  // the norm's output, freed by layernorm recompute
    ctx.fp8 = c.quantized_layer(index);
    ctx.kind_index = kind_index.at(p);
    ctx.routing = o.routing, ctx.upper_bound = o.upper_bound;
    ctx.add = [&](const std::string& module, int64_t bytes) {
      acc.add(module.empty() ? slot : slot + "." + module, bytes);
    };
    p->saved_bytes(ctx);
  };
  const int64_t mask = k.hidden_dropout ? k.sbh : 0;
  acc.add(layer + ".input_layernorm", norm);
  part(spec.mixer, layer + ".self_attention");
  acc.add(layer + ".self_attn_bda", mask);
  acc.add(layer + ".pre_mlp_layernorm", norm);
  part(spec.mlp, layer + ".mlp");
  acc.add(layer + ".mlp_bda", mask);
}

// The final norm, the output layer and the loss, on the last stage.
void add_head(Accumulator& acc, const TransformerConfig& c, const Common& k) {
  const int64_t s = c.seq_length, b = c.micro_batch_size;
  acc.add("decoder.final_layernorm", k.norm);
  acc.add("output_layer",
          k.sbh_full * k.e);  // the gathered [s, b, h] input of the replicated layer
  // The targets are labels.t() flattened: a copy, unless the transpose is already contiguous.
  // At 16 bits the loss runs on the upcast logits: fp32 log-softmax output and total weight.
  acc.add("loss", s * b * c.vocab_size * k.up + (b > 1 && s > 1 ? 8 * s * b : 0) + k.up);
  acc.add("loss value", k.up);
}

PredictedBytes predict(const TransformerConfig& c, const ActivationPlan& plan, PredictOptions o) {
  c.validate_shape();
  // A pipeline stage (or one model chunk of it) counts its own layers; the embedding is the first
  // stage's (its first chunk's), the final norm, output layer and loss the last's (its last
  // chunk's).
  const TransformerConfig::StageLayers stage = c.model_chunk_layers(o.stage, o.chunk);
  TORCH_CHECK(plan.layers.size() == static_cast<size_t>(c.num_layers),
              "actmem::predict_activation_bytes: the plan has ", plan.layers.size(),
              " layers, the config ", c.num_layers);
  if (o.e == 0) o.e = c.element_bytes();
  TORCH_CHECK(o.e == 2 || o.e == 4 || o.e == 8,
              "actmem::predict_activation_bytes: dtype_bytes "
              "must be 2, 4 or 8 (or 0 for the config's precision), got ",
              o.e);
  const Common k = common_sizes(c, o);
  const std::vector<LayerSpec> specs = layer_specs(c);
  Accumulator acc;
  if (o.stage == 0 && o.chunk == 0) acc.add("embedding", k.hidden_dropout ? k.sbh : 0);
  // Each layer's index among the predicted layers of its parts' kinds (an MoE layer's entry in
  // the routing), counted whether or not the layer runs in a chunk.
  std::map<const LayerPart*, size_t> seen;
  for (int64_t i = stage.offset; i < stage.offset + stage.count; ++i) {
    const auto g = static_cast<size_t>(i);
    const LayerPlan& lp = plan.layers[g];
    const std::string layer = "decoder.layers." + std::to_string(i);
    std::map<const LayerPart*, size_t> kind_index;
    for (const LayerPart* p : specs[g].parts()) kind_index[p] = seen[p]++;
    if (!lp.in_chunk()) {
      add_layer(acc, c, k, specs[g], lp, i, layer, o, kind_index);
    } else if (lp.starts_chunk) {
      // Only the chunk's input (and its snapshot) is kept, attributed to the chunk's first layer.
      // With distribute_saved_activations it is this rank's 1/t chunk.
      acc.add(layer, (plan.distribute_saved_activations ? k.sbh_full / c.tensor_model_parallel_size
                                                        : k.sbh) *
                             k.e +
                         k.snapshot);
    }
  }
  if (o.stage == c.pipeline_model_parallel_size - 1 && o.chunk == c.virtual_pipeline_size() - 1) {
    add_head(acc, c, k);
  }
  return acc.take();
}

}  // namespace

PredictedBytes predict_activation_bytes(const TransformerConfig& c, int64_t e,
                                        bool snapshots_on_device, const MoERouting* routing) {
  return predict_activation_bytes(c, make_activation_plan(c), e, snapshots_on_device, routing);
}

PredictedBytes predict_activation_bytes(const TransformerConfig& c, const ActivationPlan& plan,
                                        int64_t e, bool snapshots_on_device,
                                        const MoERouting* routing, int64_t pipeline_stage,
                                        int64_t model_chunk) {
  PredictOptions o;
  o.e = e, o.cpu = snapshots_on_device, o.routing = routing;
  o.stage = pipeline_stage, o.chunk = model_chunk;
  return predict(c, plan, o);
}

// Note [Memory pre-check]
// The Trainer refuses a configuration whose step cannot fit before it allocates anything, so the
// bound must cover the whole peak of a step, for every strategy:
// - parameters, gradients and both AdamW moments (4 x parameters), plus the optimizer step's
//   temporaries (at most two of the largest parameter);
// - the activations the plain forward leaves for the backward (the exact predictor for the
//   config without recompute or offload: every strategy leaves less, and a recomputed chunk is
//   rebuilt from what the plain run would have kept), data-dependent sizes at their most (an
//   MoE layer's rows);
// - the backward's transients on top of them: the gradient flowing through the op being
//   differentiated, its result and one temporary, each at most the largest single tensor of
//   the step (the logits [s, b, v], the scores [a/t, s, s, b], the MLP's [s, b, fc1/t]), and
//   what a part's backward adds for the duration of one layer (PeakTerms::backward_bytes).
// Each layer's parts give their terms (LayerPart::peak_terms: parameters generously counted,
// largest parameter and tensor); every layer adds its norms and row-parallel biases (6h
// replicated). Checked against the tracker's measured peak over a sweep of models and strategies
// (MemoryPreCheck.CountsEverythingTheRunAllocates in tests/test_robustness.cpp, and each part's
// suite). The Trainer refuses a configuration above its device-memory limit
// before it allocates anything.
// Under pipeline parallelism a stage counts its own layers, the embedding only on the first stage
// and the output layer (or the tied embedding's copy) only on the last, and keeps
// `microbatches_in_flight` micro-batches of its activations plus the tensors crossing its
// boundaries (the received input's leaf and the output before it is sent, one of each at most
// beyond the micro-batches' own: Note [Pipeline step] in schedules.cpp). Checked against each
// stage's measured peak in Pipeline.EveryRecomputeStrategyBitwiseEqualsPlainAndThePredictorHolds-
// PerStage (tests/test_tensor_parallel.cpp).
double predict_step_peak_bound(const TransformerConfig& c, int64_t dtype_bytes,
                               int64_t pipeline_stage, int64_t microbatches_in_flight,
                               int64_t optimizer_shards) {
  TORCH_CHECK(microbatches_in_flight >= 1,
              "actmem::predict_step_peak_bound: at least one "
              "micro-batch in flight, got ",
              microbatches_in_flight);
  return predict_step_peak_bound(c, dtype_bytes, pipeline_stage, {microbatches_in_flight}, 2,
                                 optimizer_shards);
}

namespace {
// The stage's weights, largest parameter and tensor, parameter tensors and backward transient:
// its layers' parts' terms and every layer's own, the embedding and the head.
PeakTerms stage_peak_terms(const TransformerConfig& c, int64_t pipeline_stage, double e) {
  const std::vector<LayerSpec> specs = layer_specs(c);
  const double h = static_cast<double>(c.hidden_size), v = static_cast<double>(c.vocab_size);
  const double s = static_cast<double>(c.seq_length), b = static_cast<double>(c.micro_batch_size);
  const bool first_stage = pipeline_stage == 0;
  const bool last_stage = pipeline_stage == c.pipeline_model_parallel_size - 1;
  PeakTerms stage;
  // The word embedding and an untied output layer (2vh, an upper bound), the positions, the
  // final norm; the logits [s, b, v] on the last stage, the residual stream [s, b, h].
  stage.parameters = (first_stage ? v * h + static_cast<double>(c.max_positions()) * h : 0.0) +
                     (last_stage ? v * h + 2.0 * h : 0.0);
  stage.largest_parameter = (first_stage || last_stage ? v * h : 0.0) * e;
  stage.largest_tensor = std::max(last_stage ? s * b * v : 0.0, s * b * h) * e;
  stage.parameter_tensors = 8.0;
  for (int64_t k = 0; k < c.virtual_pipeline_size(); ++k) {
    const TransformerConfig::StageLayers chunk = c.model_chunk_layers(pipeline_stage, k);
    for (int64_t i = chunk.offset; i < chunk.offset + chunk.count; ++i) {
      // Two norms (weight and bias, 4h) and the row-parallel biases (2h), replicated; at most
      // 16 parameter tensors.
      stage.parameters += 6.0 * h;
      stage.parameter_tensors += 16.0;
      for (const LayerPart* part : specs[static_cast<size_t>(i)].parts()) {
        const PeakTerms p = part->peak_terms(c, e);
        stage.parameters += p.parameters;
        stage.largest_parameter = std::max(stage.largest_parameter, p.largest_parameter);
        stage.largest_tensor = std::max(stage.largest_tensor, p.largest_tensor);
        stage.parameter_tensors += p.parameter_tensors;
        stage.backward_bytes = std::max(stage.backward_bytes, p.backward_bytes);
      }
    }
  }
  return stage;
}
}  // namespace

double predict_step_peak_bound(const TransformerConfig& c, int64_t dtype_bytes,
                               int64_t pipeline_stage,
                               const std::vector<int64_t>& in_flight_per_chunk,
                               int64_t boundary_tensors, int64_t optimizer_shards) {
  TORCH_CHECK(optimizer_shards >= 1,
              "actmem::predict_step_peak_bound: optimizer_shards must be "
              "at least 1, got ",
              optimizer_shards);
  TORCH_CHECK(static_cast<int64_t>(in_flight_per_chunk.size()) == c.virtual_pipeline_size(),
              "actmem::predict_step_peak_bound: one in-flight count per model chunk (",
              c.virtual_pipeline_size(), "), got ", in_flight_per_chunk.size());
  if (dtype_bytes == 0) dtype_bytes = c.element_bytes();
  const double e = static_cast<double>(dtype_bytes);
  const PeakTerms stage = stage_peak_terms(c, pipeline_stage, e);
  // Sizes whose exact count would not fit the predictor's 64-bit integers cannot fit a device.
  if (stage.largest_tensor * static_cast<double>(c.num_layers) * 64.0 > 0x1p62) {
    return std::numeric_limits<double>::infinity();
  }
  // Per parameter: fp32 (or double) training keeps parameter, gradient and both AdamW moments
  // (4e). 16-bit training keeps the 16-bit parameter, fp32 main grad, main parameter and moments
  // (Megatron's 18 bytes) and, transiently, a 16-bit gradient before its hook adds it into the
  // main grad (2 more). The distributed optimizer keeps 1/d of the moments and main parameters,
  // and a rank's piece may hold more than 1/d of the real elements by the buffer's padding
  // (distributed_optimizer.h): under 64 elements per parameter tensor and lcm(d, 128) per bucket
  // (one per tensor at most).
  const double d = static_cast<double>(optimizer_shards);
  const double state_bytes = e == 2.0 ? 12.0 : 2.0 * e;  // per element: moments (+ main param)
  const double per_param = e == 2.0 ? 8.0 + 12.0 / d : 2.0 * e + 2.0 * e / d;
  const double padding =
      optimizer_shards > 1
          ? stage.parameter_tensors *
                (64.0 + static_cast<double>(std::lcm(optimizer_shards, int64_t{128}))) * state_bytes
          : 0.0;
  const ActivationPlan keep_all = keep_everything_plan(c);
  // What crosses a stage boundary: [s, b, h] ([s/t, b, h] with sequence parallelism).
  const double boundary =
      c.pipeline_model_parallel_size > 1
          ? static_cast<double>(c.seq_length * c.micro_batch_size * c.hidden_size) * e /
                (c.sequence_parallel ? static_cast<double>(c.tensor_model_parallel_size) : 1.0)
          : 0.0;
  double activations = static_cast<double>(boundary_tensors) * boundary;
  for (int64_t k = 0; k < c.virtual_pipeline_size(); ++k) {
    PredictOptions o;
    o.e = dtype_bytes, o.upper_bound = true, o.stage = pipeline_stage, o.chunk = k;
    activations += static_cast<double>(predict(c, keep_all, o).total) *
                   static_cast<double>(in_flight_per_chunk[static_cast<size_t>(k)]);
  }
  // The logits' fp32 copy and its log-softmax at 16 bits are counted by the predictor (the
  // kept output) and by largest_tensor (the transient), at twice the 16-bit size.
  const double upcast = e == 2.0 ? 2.0 : 1.0;
  return per_param * stage.parameters + padding + 2.0 * stage.largest_parameter * upcast +
         activations + 3.0 * stage.largest_tensor * upcast + stage.backward_bytes;
}

// ---- parameters -------------------------------------------------------------------------------

ParameterCount count_parameters(const TransformerConfig& c) {
  const double t = static_cast<double>(c.tensor_model_parallel_size);
  const int64_t h = c.hidden_size, norm = c.use_rmsnorm() ? 1 : 2;  // weight (and bias) per feature
  auto on_first_stage = [&c](int64_t i) {  // each of the first stage's model chunks
    for (int64_t k = 0; k < c.virtual_pipeline_size(); ++k) {
      if (c.model_chunk_layers(0, k).contains(i)) return true;
    }
    return false;
  };
  const std::vector<LayerSpec> specs = layer_specs(c);
  ParameterCount n;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    // The layer's two norms, replicated, and its parts.
    int64_t sharded = 0, replicated = 2 * h * norm, experts = 0, active = 0;
    double experts_on_rank = 0.0;
    for (const LayerPart* part : specs[static_cast<size_t>(i)].parts()) {
      const PartParameters p = part->parameters(c);
      sharded += p.sharded;
      replicated += p.replicated;
      experts += p.experts;
      active += p.active_experts;
      experts_on_rank += p.experts_on_rank;
    }
    n.total += sharded + replicated + experts;
    n.active += sharded + replicated + active;
    if (on_first_stage(i)) {
      n.experts_on_rank += experts_on_rank;
      n.on_rank += static_cast<double>(sharded) / t + static_cast<double>(replicated);
    }
  }
  n.on_rank += n.experts_on_rank;
  const int64_t v = c.vocab_size, positions = c.learned_positions() ? c.max_positions() * h : 0;
  const int64_t output = c.untie_embeddings_and_output_weights ? v * h : 0;
  n.total += v * h + positions + output + h * norm;
  n.active += v * h + positions + output + h * norm;
  n.on_rank += static_cast<double>(v * h) / t + static_cast<double>(positions);
  if (c.pipeline_model_parallel_size == 1) {
    n.on_rank += static_cast<double>(output) / t + static_cast<double>(h * norm);
  }
  return n;
}

WeightMemory config_weight_and_optimizer_memory(const TransformerConfig& c, double d,
                                                bool distributed_optimizer) {
  TORCH_CHECK(d >= 1,
              "actmem::config_weight_and_optimizer_memory: the data-parallel size must be "
              ">= 1, got ",
              d);
  const ParameterCount n = count_parameters(c);
  WeightMemory w;
  w.parameters = static_cast<double>(n.total);
  w.active_parameters = static_cast<double>(n.active);
  w.parameters_on_rank = n.on_rank;
  w.expert_parameters_on_rank = n.experts_on_rank;
  // The routed experts' data-parallel size: world / (ETP EP p) with ETP = t here.
  const double expert_dp = std::max(1.0, d / static_cast<double>(c.expert_model_parallel_size));
  auto optimizer = [&](double dp) { return distributed_optimizer ? 12.0 / dp : 12.0; };
  w.weight_bytes = 2.0 * n.on_rank;
  w.gradient_bytes = 4.0 * n.on_rank;
  w.optimizer_bytes =
      optimizer(d) * (n.on_rank - n.experts_on_rank) + optimizer(expert_dp) * n.experts_on_rank;
  w.bytes_per_parameter = w.total() / n.on_rank;
  return w;
}

bool paper_describes(const TransformerConfig& c) {
  const std::vector<LayerSpec> specs = layer_specs(c);
  return std::all_of(specs.begin(), specs.end(), [&c](const LayerSpec& spec) {
    return spec.mixer->paper_describes(c) && spec.mlp->paper_describes(c);
  });
}

// ---- the paper's terms per module -------------------------------------------------------------

namespace {
// A ledger path decoder.layers.i.<rest>: the layer i and <rest>, or (-1, "") for another path.
std::pair<int64_t, std::string> layer_module(const std::string& path) {
  const std::string key = "layers.";
  const size_t at = path.rfind(key);
  if (at == std::string::npos || (at > 0 && path[at - 1] != '.')) return {-1, ""};
  size_t end = at + key.size();
  while (end < path.size() && std::isdigit(static_cast<unsigned char>(path[end]))) ++end;
  if (end == at + key.size() || end >= path.size() || path[end] != '.') return {-1, ""};
  return {std::stoll(path.substr(at + key.size(), end - at - key.size())), path.substr(end + 1)};
}

// The terms of module `path` as a layer's own (its norms and masks) or its part's.
ModuleTerms module_terms(const std::string& path, const TransformerConfig& c, int64_t dtype_bytes,
                         bool cpu) {
  const auto [layer, rest] = layer_module(path);
  ModuleTerms x;
  if (layer < 0 || layer >= c.num_layers) return x;
  const double t = static_cast<double>(c.tensor_model_parallel_size);
  const double rep = c.sequence_parallel ? t : 1.0;
  const double sbh = static_cast<double>(c.seq_length * c.micro_batch_size * c.hidden_size);
  const double k = static_cast<double>(dtype_bytes) / 2.0;  // 16-bit terms at this dtype
  const int64_t e = c.element_bytes(), up = e == 2 ? 4 : e;
  const int64_t sb = c.sequence_parallel
                         ? c.seq_length * c.micro_batch_size / c.tensor_model_parallel_size
                         : c.seq_length * c.micro_batch_size;
  auto add = [&x](int64_t bytes, const std::string& what) {
    x.beyond += bytes;
    x.what += (x.what.empty() ? "" : "; ") + what;
  };
  if (rest == "input_layernorm" || rest == "pre_mlp_layernorm") {
    // Table 2's norms: the input 2sbh, replicated without sequence parallelism.
    x.paper = 2 * sbh * k / rep;
    if (c.layernorm_zero_centered_gamma) {
      add(c.hidden_size * e, "--apply-layernorm-1p: the scale 1 + weight [h]");
    }
    if (c.use_rmsnorm()) {
      add(sb * up, "RMSNorm's rstd [s, b, 1] in " + std::string(up == 4 ? "fp32" : "the dtype"));
    } else {
      const int64_t stat = cpu ? e : up;
      add(2 * sb * stat, std::string("LayerNorm's mean and rstd [s, b, 1] in ") +
                             (stat == e ? c.precision() : "fp32"));
    }
    return x;
  }
  if (rest == "self_attn_bda" || rest == "mlp_bda") {
    x.paper = sbh / rep;  // the dropout mask
    if (c.hidden_dropout == 0.0) add(-sb * c.hidden_size, "no hidden dropout: no mask");
    return x;
  }
  const LayerSpec spec = layer_spec(c, layer);
  for (const auto& [slot, part] :
       {std::pair<std::string, const LayerPart*>{"self_attention.", spec.mixer},
        std::pair<std::string, const LayerPart*>{"mlp.", spec.mlp}}) {
    if (rest.rfind(slot, 0) == 0)
      return part->module_terms(rest.substr(slot.size()), c, dtype_bytes, cpu);
  }
  return x;
}
}  // namespace

double korthikanti_module_bytes(const std::string& path, const TransformerConfig& c,
                                int64_t dtype_bytes) {
  return module_terms(path, c, dtype_bytes, true).paper;
}

ModuleExtra module_bytes_beyond_paper(const std::string& path, const TransformerConfig& c,
                                      bool cpu) {
  const ModuleTerms x = module_terms(path, c, c.element_bytes(), cpu);
  return {x.beyond, x.what};
}

}  // namespace actmem
