// plan_analytic.cpp — the planner for models that cannot run here: the paper's per-module
// activation terms, Megatron's weight terms and a roofline step time (Note [Analytic plan] in
// plan_analytic.h).
#include "actmem/plan/plan_analytic.h"

#include "actmem/config/activation_plan.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>

namespace actmem {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Achieved rates (docs/planner.md, "Paper presets"): GEMMs at 70% of the dense BF16 peak,
// device memory at 80% of its peak bandwidth, the host link at its measured pinned copy rate.
const std::map<std::string, DeviceSpec>& devices() {
  static const std::map<std::string, DeviceSpec> table = {
      {"a100", {"a100", 80 * kGiB, 0.7 * 312e12, 0.8 * 2.039e12, 25e9, 25e9,
                "A100 80GB SXM: 312 TFLOP/s dense BF16, 2.04 TB/s HBM2e, PCIe Gen4 x16 "
                "(about 25 GB/s pinned)"}},
      {"h100", {"h100", 80 * kGiB, 0.7 * 989e12, 0.8 * 3.35e12, 55.6e9, 55.6e9,
                "H100 SXM: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, PCIe Gen5 x16 (55.6 GB/s "
                "pinned, nvbandwidth)"}},
      {"h200", {"h200", 141 * kGiB, 0.7 * 989e12, 0.8 * 4.8e12, 55.6e9, 55.6e9,
                "H200 SXM: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, PCIe Gen5 x16 (55.6 GB/s "
                "pinned)"}},
      {"gh200", {"gh200", 96 * kGiB, 0.7 * 989e12, 0.8 * 4.0e12, 297e9, 375e9,
                 "GH200 96GB: 989 TFLOP/s dense BF16, 4.0 TB/s HBM3, NVLink-C2C (297 GB/s "
                 "device to host, 375 GB/s host to device, measured)"}},
  };
  return table;
}

// One transformer layer's saved tensors for one micro-batch on one rank, in bytes: the paper's
// 16-bit terms (Korthikanti et al. 2022, §4.1) split as Megatron's modules save them. With
// sequence parallelism everything is split t ways; without it the norms' inputs and outputs and
// the dropout masks are replicated (the paper's eq. (2): 10sbh of them).
struct LayerTensors {
  double attn_norm_in = 0;  // input_layernorm's input (offload group attn_norm)
  double qkv_in = 0;        // its output, linear_qkv's input (qkv_linear; layernorm recompute)
  double qkv_out = 0;       // q, k, v kept by the core attention (core_attn)
  double scores = 0;        // softmax output, dropout mask, dropped scores (core_attn); with
                            // the flash kernel its fp32 logsumexp [b, a, s] instead
  double proj_in = 0;       // linear_proj's input (attn_proj)
  double attn_mask = 0;     // self_attn_bda's dropout mask
  double mlp_norm_in = 0;   // pre_mlp_layernorm's input (mlp_norm)
  double fc1_in = 0;        // its output, linear_fc1's input (layernorm recompute)
  double act_in = 0;        // fc1's output (both halves with SwiGLU) (mlp recompute)
  double fc2_in = 0;        // the activation's output (mlp recompute)
  double mlp_mask = 0;      // mlp_bda's dropout mask
  double input = 0;         // what full recompute keeps of a layer: its input
  double total() const {
    return attn_norm_in + qkv_in + qkv_out + scores + proj_in + attn_mask + mlp_norm_in + fc1_in +
           act_in + fc2_in + mlp_mask;
  }
};

LayerTensors layer_tensors(const PaperShape& m) {
  const double sb = m.s * m.b, sbh = m.sbh(), t = m.t, r = m.sp ? m.t : 1.0;
  const double gated = m.swiglu ? 2.0 : 1.0;
  LayerTensors x;
  x.attn_norm_in = 2 * sbh / r;
  x.qkv_in = 2 * sbh / r;
  x.qkv_out = 6 * sbh / t;
  // The flash kernel keeps no s x s tensor: its logsumexp, 4 bytes per head and token (its
  // output is linear_proj's input, proj_in below; docs/memory-model.md, "Attention backends").
  x.scores = (m.flash ? 4 * m.a * sb : 5 * m.a * m.s * sb) / t;
  x.proj_in = 2 * sbh / t;
  x.attn_mask = sbh / r;
  x.mlp_norm_in = 2 * sbh / r;
  x.fc1_in = 2 * sbh / r;
  x.act_in = 2 * gated * sb * m.ffn / t;
  x.fc2_in = 2 * sb * m.ffn / t;
  x.mlp_mask = sbh / r;
  x.input = 2 * sbh / r;
  return x;
}

template <typename T>
bool has(const std::vector<T>& names, T name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// What one layer keeps under a selective set, and what its fine-grained groups then move.
double selective_kept(const LayerTensors& x, const Strategy& s) {
  double dropped = 0;
  if (has(s.recompute_modules, RecomputeModule::kCoreAttn)) dropped += x.scores;
  if (has(s.recompute_modules, RecomputeModule::kLayernorm)) dropped += x.qkv_in + x.fc1_in;
  if (has(s.recompute_modules, RecomputeModule::kMlp)) dropped += x.act_in + x.fc2_in;
  return x.total() - dropped;
}

double offloaded_per_layer(const LayerTensors& x, const Strategy& s) {
  double moved = 0;
  if (has(s.offload_modules, OffloadModule::kAttnNorm)) moved += x.attn_norm_in;
  if (has(s.offload_modules, OffloadModule::kQkvLinear) && !has(s.recompute_modules, RecomputeModule::kLayernorm)) {
    moved += x.qkv_in;  // with layernorm recompute the norm's output is not kept to move
  }
  if (has(s.offload_modules, OffloadModule::kCoreAttn)) moved += x.qkv_out + x.scores;
  if (has(s.offload_modules, OffloadModule::kAttnProj)) moved += x.proj_in;
  if (has(s.offload_modules, OffloadModule::kMlpNorm)) moved += x.mlp_norm_in;
  return moved;
}

// One layer's forward on one micro-batch, and the parts recompute repeats: GEMMs at the achieved
// matmul rate, element-wise ops at the achieved memory bandwidth (bytes read and written).
struct LayerTimes {
  double forward = 0, core_attn = 0, norms = 0, mlp = 0;
  // What the backward adds beyond twice the forward: the flash kernel's backward computes
  // Q K^T again inside the kernel (it kept no scores), one of the two s^2 GEMMs.
  double backward_extra = 0;
};

LayerTimes layer_times(const PaperShape& m, const DeviceSpec& gpu) {
  const double sb = m.s * m.b, sbh = m.sbh(), t = m.t, r = m.sp ? m.t : 1.0, h = m.h;
  const double gated = m.swiglu ? 2.0 : 1.0, F = gpu.matmul_flops, B = gpu.memory_bandwidth;
  const double groups = m.g > 0 ? m.g : m.a;  // grouped-query attention: (a + 2G) d = h (1 + 2G/a)
  const double qkv = 2 * sbh * h * (1 + 2 * groups / m.a) / t, proj = 2 * sbh * h / t;
  const double scores = 4 * m.b * m.s * m.s * h / t;  // Q K^T and the scores times V
  const double fc1 = 2 * sbh * m.ffn * gated / t, fc2 = 2 * sbh * m.ffn / t;
  const double norms = 2 * (2 * sbh + 2 * sbh) / r;              // two norms, read and write
  // 2+2 softmax, 2+2+1 dropout; the flash kernel keeps the scores on chip (online softmax).
  const double softmax_dropout = m.flash ? 0.0 : 9 * m.a * m.s * sb / t;
  const double activation = (2 * gated + 2) * sb * m.ffn / t;    // read fc1's output, write
  const double bias_dropout_add = 2 * (2 * sbh + 2 * sbh + 2 * sbh + sbh) / r;
  LayerTimes lt;
  lt.forward = (qkv + proj + scores + fc1 + fc2) / F +
               (norms + softmax_dropout + activation + bias_dropout_add) / B;
  lt.core_attn = scores / F + softmax_dropout / B;
  lt.norms = norms / B;
  lt.mlp = (fc1 + fc2) / F + activation / B;
  lt.backward_extra = m.flash ? scores / 2 / F : 0.0;
  return lt;
}

// The output layer and the loss on one micro-batch (forward): the logits GEMM and the fp32
// logits written and read by the cross-entropy.
double head_forward_s(const PaperShape& m, const DeviceSpec& gpu) {
  const double sbv = m.s * m.b * m.v;
  return 2 * sbv * m.h / m.t / gpu.matmul_flops + 8 * sbv / m.t / gpu.memory_bandwidth;
}

double virtual_stages(const PaperShape& m) { return m.p > 1 && m.vpp ? *m.vpp : 1.0; }

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
  return {{"name", name}, {"memory_bytes", memory_bytes}, {"matmul_flops", matmul_flops},
          {"memory_bandwidth_bytes_per_s", memory_bandwidth},
          {"d2h_bytes_per_s", d2h_bandwidth}, {"h2d_bytes_per_s", h2d_bandwidth},
          {"source", source}};
}

std::vector<std::string> device_spec_names() {
  std::vector<std::string> names;
  for (const auto& [name, _] : devices()) names.push_back(name);
  return names;
}

DeviceSpec device_spec(const std::string& name) {
  const auto it = devices().find(name);
  TORCH_CHECK(it != devices().end(), "actmem::device_spec: unknown GPU '", name, "'; known: ",
              c10::Join(", ", device_spec_names()));
  return it->second;
}

TransformerConfig analytic_config(const PaperShape& m) {
  TORCH_CHECK(!m.is_moe() && !m.is_mla(), "actmem::analytic_config: MoE and multi-latent "
              "attention shapes are not planned analytically yet (dense models only)");
  auto whole = [](double x, const char* what) {
    TORCH_CHECK(x >= 1 && x <= 9.0e15 && std::floor(x) == x, "actmem::analytic_config: ", what,
                " must be a positive integer (got ", x, ")");
    return static_cast<int64_t>(x);
  };
  TransformerConfig c;
  c.num_layers = whole(m.L, "num_layers");
  c.hidden_size = whole(m.h, "hidden_size");
  c.num_attention_heads = whole(m.a, "num_attention_heads");
  if (m.g > 0 && m.g != m.a) c.num_query_groups = whole(m.g, "num_query_groups");
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
  return {{"static_bytes", static_bytes}, {"microbatches_in_flight", microbatches_in_flight},
          {"layers_per_stage", layers_per_stage}, {"layer_forward_s", layer_forward_s},
          {"plain_step_s", plain_step_s}};
}

AnalyticBasis analytic_basis(const PaperShape& m, const DeviceSpec& gpu) {
  TORCH_CHECK(gpu.matmul_flops > 0 && gpu.memory_bandwidth > 0 && gpu.d2h_bandwidth > 0 &&
                  gpu.h2d_bandwidth > 0,
              "actmem::analytic_basis: the GPU's rates must be positive");
  AnalyticBasis basis;
  basis.static_bytes = megatron_weight_and_optimizer_memory(m).total();
  basis.microbatches_in_flight = in_flight(m);
  basis.layers_per_stage = m.layers_per_stage();
  const LayerTimes lt = layer_times(m, gpu);
  basis.layer_forward_s = lt.forward;
  basis.plain_step_s = basis.layers_per_stage * (3 * lt.forward + lt.backward_extra) +
                       (m.p == 1 ? 3 * head_forward_s(m, gpu) : 0.0);
  return basis;
}

std::vector<PlanEstimate> estimate_plans_analytic(const PaperShape& m,
                                                  const std::vector<Strategy>& strategies,
                                                  const DeviceSpec& gpu) {
  const AnalyticBasis basis = analytic_basis(m, gpu);
  const LayerTensors x = layer_tensors(m);
  const LayerTimes lt = layer_times(m, gpu);
  const double Ls = basis.layers_per_stage, v = virtual_stages(m), Lc = Ls / v;
  const double flight = basis.microbatches_in_flight;
  // The first stage's embedding (int64 input ids and its dropout mask, Megatron's terms) per
  // micro-batch in flight; the output layer's input and fp32 logits once without pipelining.
  const double embedding = (8 * m.s * m.b + m.sbh()) / m.t;
  const double head = m.p == 1 ? m.sbh() * 4 * (1 + m.v / m.h) / m.t : 0.0;
  // What the backward starts from: the fp32 logits' gradient, or the received output gradient.
  const double backward_start = m.p == 1 ? 4 * m.s * m.b * m.v / m.t : x.input;
  std::vector<PlanEstimate> out;
  for (const Strategy& s : strategies) {
    double per_microbatch = 0;  // the stage's layers' kept bytes for one micro-batch
    double transient = 0;       // rebuilt or reloaded at once at the backward's start
    double extra_s = 0;         // per micro-batch
    double moved = 0;           // offloaded bytes in all
    const double layer = selective_kept(x, s);
    if (s.full_method == RecomputeMethod::kUniform) {
      const double n = std::min<double>(static_cast<double>(s.full_layers), Lc);
      per_microbatch = v * std::ceil(Lc / n) * x.input;
      transient = n * x.total() - x.input;  // the last chunk rebuilt, its input already held
      extra_s = Ls * lt.forward;
    } else if (s.full_method == RecomputeMethod::kBlock) {
      const double n = std::min<double>(static_cast<double>(s.full_layers), Lc);
      per_microbatch = v * (n * x.input + (Lc - n) * x.total());
      // With plain layers after the block, rebuilding one layer comes after they are freed.
      transient = n == Lc ? x.total() - x.input : 0.0;
      extra_s = v * n * lt.forward;
    } else {
      per_microbatch = Ls * layer;
      const bool ln = has(s.recompute_modules, RecomputeModule::kLayernorm);
      const double mlp_part = (has(s.recompute_modules, RecomputeModule::kMlp) ? x.act_in + x.fc2_in : 0.0) +
                              (ln ? x.fc1_in : 0.0);
      const double attn_part = (has(s.recompute_modules, RecomputeModule::kCoreAttn) ? x.scores : 0.0) +
                               (ln ? x.qkv_in : 0.0);
      transient = std::max(mlp_part, attn_part);
      extra_s = Ls * ((has(s.recompute_modules, RecomputeModule::kCoreAttn) ? lt.core_attn : 0.0) +
                      (ln ? lt.norms : 0.0) +
                      (has(s.recompute_modules, RecomputeModule::kMlp) ? lt.mlp : 0.0));
      if (!s.offload_modules.empty()) {
        // Every layer of every forward in flight but the margin (the last layer before the
        // backward, Note [Offload warmup and margin] in offload_schedule.h); the backward
        // reloads one layer ahead.
        const double per_layer = offloaded_per_layer(x, s);
        const double layers_moved = std::max(0.0, flight * Ls - 1);
        moved = layers_moved * per_layer;
        transient += per_layer;
        extra_s += layers_moved / flight * exposed_copy_s(per_layer, lt.forward, gpu);
      }
      if (s.offload_layers > 0) {
        // The first K layers' saved tensors; their reload comes after later layers are freed.
        const double k = static_cast<double>(s.offload_layers);
        moved = k * layer;
        extra_s += k * exposed_copy_s(layer, lt.forward, gpu);
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
