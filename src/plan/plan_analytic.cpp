// plan_analytic.cpp — the planner for models that cannot run here: the paper's per-module
// activation terms, Megatron's weight terms and a roofline step time (Note [Analytic plan] in
// plan_analytic.h).
#include "actmem/plan/plan_analytic.h"

#include "actmem/config/activation_plan.h"

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
// the dropout masks are replicated (the paper's eq. (2): 10sbh of them). Multi-latent attention
// and MoE layers take the terms of paper_mla_attention_bytes() and paper_moe_layer_bytes()
// (memory_model.h), split the same way (Note [Analytic MoE and MLA layers]).
struct LayerTensors {
  double attn_norm_in = 0;  // input_layernorm's input (offload group attn_norm)
  double qkv_in = 0;        // its output, linear_qkv's input (qkv_linear; layernorm recompute)
  double mla_latents = 0;   // MLA: the latents the up-projections and their norms keep
  double qkv_out = 0;       // q, k, v kept by the core attention (core_attn; MLA: mla_up_proj)
  double scores = 0;        // softmax output, dropout mask, dropped scores (core_attn); with
                            // the flash kernel its fp32 logsumexp [b, a, s] instead
  double proj_in = 0;       // linear_proj's input (attn_proj)
  double attn_mask = 0;     // self_attn_bda's dropout mask
  double mlp_norm_in = 0;   // pre_mlp_layernorm's input (mlp_norm)
  double fc1_in = 0;        // its output, linear_fc1's (MoE: the router's) input (layernorm)
  double act_in = 0;        // fc1's output (both halves with SwiGLU) (mlp recompute)
  double fc2_in = 0;        // the activation's output (mlp recompute)
  double mlp_mask = 0;      // mlp_bda's dropout mask
  // An MoE layer's MLP (all 0 in a dense layer; act_in and fc2_in are 0 in an MoE layer):
  double router = 0;          // the router's fp32 scores, indices and losses' terms
  double dispatch = 0;        // the dispatcher's index vectors and permuted probabilities
  double expert_in = 0;       // the permuted tokens, the experts' fc1 input (expert_fc1)
  double expert_act_in = 0;   // the experts' fc1 output, the activation's input (moe_act offload)
  double expert_act_out = 0;  // what the activation keeps beyond its input and fc2's input
                              // (moe_act recompute drops both)
  double shared = 0;          // the shared experts' tensors beyond their input (shared_experts)
  double input = 0;         // what full recompute keeps of a layer: its input
  double moe() const {      // what moe recompute drops
    return router + dispatch + expert_in + expert_act_in + expert_act_out + shared;
  }
  double total() const {
    return attn_norm_in + qkv_in + mla_latents + qkv_out + scores + proj_in + attn_mask +
           mlp_norm_in + fc1_in + act_in + fc2_in + mlp_mask + moe();
  }
};

// Note [Analytic MoE and MLA layers]
// An MoE layer keeps the paper_moe_layer_bytes() terms: the router's input is the pre-MLP norm's
// output (fc1_in above, dropped by layernorm recompute), the rest of `router` its own; of the
// dispatch the 2Nh permuted tokens are the experts' fc1 input (expert_fc1 offload), the index
// vectors and probabilities stay; the experts' fc1 output (SwiGLU 4Nf/t, GeLU 2Nf/t) is the
// activation's input (moe_act offload moves it; moe_act recompute keeps it as its checkpoint's
// input and drops what the activation made from it: SwiGLU's SiLU output, gated product and
// fc2's input 6Nf/t, GeLU's output and fc2's input 4Nf/t); shared_experts recompute drops the
// shared experts' tensors, moe recompute everything of the MoE layer but its input. An MLA
// attention keeps paper_mla_attention_bytes(): the down projections' input is the input norm's
// output (qkv_in), the latents beyond it stay under every selective set, mla_up_proj drops
// q, k, v. Per rank the routing is taken as balanced (N = s*b*topk rows, Megatron's dropless
// dispatch; the capacity bound otherwise). A stage's layers are counted by kind (dense or MoE)
// from the configuration's moe_layer_freq.
LayerTensors layer_tensors(const PaperShape& m, bool moe_layer) {
  const double sb = m.s * m.b, sbh = m.sbh(), t = m.t, r = m.sp ? m.t : 1.0;
  const double gated = m.swiglu ? 2.0 : 1.0;
  // Grouped-query attention keeps k and v at G heads: q sbh, k and v sbh G/a each.
  const double groups = m.g > 0 ? m.g : m.a;
  LayerTensors x;
  x.attn_norm_in = 2 * sbh / r;
  x.qkv_in = 2 * sbh / r;
  x.qkv_out = 2 * sbh * (1 + 2 * groups / m.a) / t;
  // The flash kernel keeps no s x s tensor: its logsumexp, 4 bytes per head and token (its
  // output is linear_proj's input, proj_in below; docs/memory-model.md, "Attention backends").
  x.scores = (m.flash ? 4 * m.a * sb : 5 * m.a * m.s * sb) / t;
  x.proj_in = 2 * sbh / t;
  if (m.is_mla()) {
    const MLAAttentionBytes mla = paper_mla_attention_bytes(m);
    x.mla_latents = mla.latents - x.qkv_in;
    x.qkv_out = mla.qkv;
    if (!m.flash) x.scores = mla.scores;
    x.proj_in = mla.context;
  }
  x.attn_mask = sbh / r;
  x.mlp_norm_in = 2 * sbh / r;
  x.fc1_in = 2 * sbh / r;
  x.mlp_mask = sbh / r;
  x.input = 2 * sbh / r;
  if (!moe_layer) {
    x.act_in = 2 * gated * sb * m.ffn / t;
    x.fc2_in = 2 * sb * m.ffn / t;
    return x;
  }
  const MoELayerBytes e = paper_moe_layer_bytes(m);
  const double N = e.rows, f = m.moe.ffn;
  x.router = e.router - x.fc1_in;
  x.expert_in = 2 * N * m.h;
  x.dispatch = e.dispatch - x.expert_in;
  x.expert_act_in = 2 * gated * N * f / t;
  x.expert_act_out = e.experts - x.expert_act_in;
  x.shared = e.shared;
  return x;
}

template <typename T>
bool has(const std::vector<T>& names, T name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// Whether selective set `s` recomputes module `r` in a layer of this kind (recompute_scope).
bool recomputes(const Strategy& s, RecomputeModule r, bool moe_layer, bool gdn_layer = false) {
  return has(s.recompute_modules, r) && scope_includes(recompute_scope(r), moe_layer, gdn_layer);
}

// What one layer's selective recompute drops, and its rebuild at once in the backward (the MLP
// half's and the attention half's, the larger of them).
struct Dropped {
  double bytes = 0, transient = 0;
};

Dropped selective_dropped(const LayerTensors& x, const Strategy& s, bool moe_layer) {
  const bool ln = recomputes(s, RecomputeModule::kLayernorm, moe_layer);
  double attn = ln ? x.qkv_in : 0.0, mlp = ln ? x.fc1_in : 0.0;
  if (recomputes(s, RecomputeModule::kCoreAttn, moe_layer)) attn += x.scores;
  if (recomputes(s, RecomputeModule::kMlaUpProj, moe_layer)) attn += x.qkv_out;
  if (recomputes(s, RecomputeModule::kMlp, moe_layer)) mlp += x.act_in + x.fc2_in;
  if (recomputes(s, RecomputeModule::kMoe, moe_layer)) {
    mlp += x.moe();
  } else {
    if (recomputes(s, RecomputeModule::kMoeAct, moe_layer)) mlp += x.expert_act_out;
    if (recomputes(s, RecomputeModule::kSharedExperts, moe_layer)) mlp += x.shared;
  }
  return {attn + mlp, std::max(attn, mlp)};
}

double offloaded_per_layer(const LayerTensors& x, const Strategy& s, bool moe_layer) {
  double moved = 0;
  if (has(s.offload_modules, OffloadModule::kAttnNorm)) moved += x.attn_norm_in;
  if (has(s.offload_modules, OffloadModule::kQkvLinear) &&
      !recomputes(s, RecomputeModule::kLayernorm, moe_layer)) {
    moved += x.qkv_in;  // with layernorm recompute the norm's output is not kept to move
  }
  if (has(s.offload_modules, OffloadModule::kCoreAttn)) {
    moved += x.scores + (recomputes(s, RecomputeModule::kMlaUpProj, moe_layer) ? 0.0 : x.qkv_out);
  }
  if (has(s.offload_modules, OffloadModule::kAttnProj)) moved += x.proj_in;
  if (has(s.offload_modules, OffloadModule::kMlpNorm)) moved += x.mlp_norm_in;
  if (moe_layer && has(s.offload_modules, OffloadModule::kExpertFc1)) moved += x.expert_in;
  if (moe_layer && has(s.offload_modules, OffloadModule::kMoeAct)) moved += x.expert_act_in;
  return moved;
}

// One layer's forward on one micro-batch, and the parts recompute repeats: GEMMs at the achieved
// matmul rate, element-wise ops at the achieved memory bandwidth (bytes read and written).
struct LayerTimes {
  double forward = 0, core_attn = 0, norms = 0, mlp = 0;
  double mla_up_proj = 0;                   // MLA's up-projections
  double moe = 0, moe_act = 0, shared = 0;  // an MoE layer's MLP, its experts' activation, its
                                            // shared experts
  double gdn_norm_out = 0;                  // a GatedDeltaNet layer's gated output norm
  // What the backward adds beyond twice the forward: the flash kernel's backward computes
  // Q K^T again inside the kernel (it kept no scores), one of the two s^2 GEMMs.
  double backward_extra = 0;
};

// Note [Analytic GatedDeltaNet and attention beyond the paper]
// Models the paper does not describe (paper_describes() in memory_model.h) are costed from their
// configuration. Standard attention with H = a heads of d = kv_channels, G groups and the output
// gate: linear_qkv 2 T h (H (1 + gate) + 2G) d / t, the two s^2 GEMMs 4 b s^2 H d / t, linear_proj
// 2 T H d h / t; the q/k norms read and write q and k (8 T (H + G) d / t bytes), the gate reads
// the context and the gate and writes the product with its fp32 sigmoid (10 T H d / t); the
// softmax's dropout only when the attention dropout is on. A GatedDeltaNet layer (T = s b tokens,
// Hk key heads of dk, Hv value heads of dv, qk = Hk dk, v = Hv dv, C = 2 qk + v, all over t):
// in_proj 2 T h (2 qk + 2 v + 2 Hv), out_proj 2 T v h as GEMMs; the chunked rule (chunks of
// c = 64, Yang et al. 2024 §3.2) per token and value head 6 dk dv (the state's read, update and
// the inter-chunk output) plus 2 c (3 dk + 2 dv) (K K^T, the WY products, Q K^T and the
// intra-chunk output), also at the matmul rate; the convolution and its SiLU 8 T C bytes, the
// q/k l2 norms 8 T qk, the gated output norm 6 T v (what gdn_norm_out recompute repeats).
LayerTimes layer_times(const PaperShape& m, const DeviceSpec& gpu, bool moe_layer,
                       bool gdn_layer = false) {
  const double sb = m.s * m.b, sbh = m.sbh(), t = m.t, r = m.sp ? m.t : 1.0, h = m.h;
  const double gated = m.swiglu ? 2.0 : 1.0, F = gpu.matmul_flops, B = gpu.memory_bandwidth;
  const double groups = m.g > 0 ? m.g : m.a;  // grouped-query attention: (a + 2G) d = h (1 + 2G/a)
  double qkv = 2 * sbh * h * (1 + 2 * groups / m.a) / t, proj = 2 * sbh * h / t;
  double scores = 4 * m.b * m.s * m.s * h / t;  // Q K^T and the scores times V
  double qk = scores / 2, up = 0, latent_norms = 0;
  double softmax_bytes = 9;  // per score: 2+2 softmax, 2+2+1 dropout
  const TransformerConfig* c = m.config.get();
  const bool beyond = c != nullptr && !paper_describes(*c);
  if (beyond && !gdn_layer) {
    const double d = static_cast<double>(c->kv_channels());
    const double gate = c->attention_output_gate ? 1.0 : 0.0;
    qkv = 2 * sb * h * (m.a * (1 + gate) + 2 * groups) * d / t;
    proj = 2 * sb * m.a * d * h / t;
    scores = 4 * m.b * m.s * m.s * m.a * d / t;
    qk = scores / 2;
    latent_norms = (c->qk_layernorm ? 8 * sb * (m.a + groups) * d / t : 0.0) +
                   (c->attention_output_gate ? 10 * sb * m.a * d / t : 0.0);
    softmax_bytes = c->attention_dropout > 0 ? 9 : 4;
  }
  if (m.is_mla()) {
    // Down projections on every tensor-parallel rank (the duplicated linears, over the sequence
    // shard with SP), up projections and heads split t ways; heads of dq = qk + pos for q and k.
    const MLAPaperShape& x = m.mla;
    const double dq = x.qk + x.pos;
    const double down = 2 * sb * h * (x.q_lora + x.kv_lora + x.pos) / r;
    const double q_proj = x.q_lora > 0 ? 0.0 : 2 * sb * h * m.a * dq / t;
    up = ((x.q_lora > 0 ? 2 * sb * x.q_lora * m.a * dq : 0.0) +
          2 * sb * x.kv_lora * m.a * (x.qk + x.v)) /
         t;
    qkv = down + q_proj + up;
    qk = 2 * m.b * m.s * m.s * m.a * dq / t;
    scores = qk + 2 * m.b * m.s * m.s * m.a * x.v / t;
    proj = 2 * sb * m.a * x.v * h / t;
    if (x.qk_layernorm) latent_norms = 2 * (2 * sb * x.q_lora + 2 * sb * x.kv_lora) / r;
  }
  const double norms = 2 * (2 * sbh + 2 * sbh) / r;              // two norms, read and write
  // The flash kernel keeps the scores on chip (online softmax).
  const double softmax_dropout = m.flash ? 0.0 : softmax_bytes * m.a * m.s * sb / t;
  const double bias_dropout_add = 2 * (2 * sbh + 2 * sbh + 2 * sbh + sbh) / r;
  LayerTimes lt;
  lt.core_attn = scores / F + softmax_dropout / B;
  lt.norms = norms / B;
  lt.mla_up_proj = up / F;
  lt.backward_extra = m.flash ? qk / F : 0.0;
  double attention = (qkv + proj + scores) / F + (softmax_dropout + latent_norms) / B;
  if (gdn_layer) {
    TORCH_CHECK(c != nullptr,
                "actmem::estimate_plans_analytic: a GatedDeltaNet layer needs the "
                "configuration it was read from");
    const double Hk = static_cast<double>(c->linear_num_key_heads);
    const double Hv = static_cast<double>(c->linear_num_value_heads);
    const double dk = static_cast<double>(c->linear_key_head_dim);
    const double dv = static_cast<double>(c->linear_value_head_dim);
    const double qkw = Hk * dk, vd = Hv * dv, C = 2 * qkw + vd, chunk = 64;
    const double in_proj = 2 * sb * h * (2 * qkw + 2 * vd + 2 * Hv) / t;
    const double out_proj = 2 * sb * vd * h / t;
    const double rule = sb * Hv / t * (6 * dk * dv + 2 * chunk * (3 * dk + 2 * dv));
    lt.gdn_norm_out = 6 * sb * vd / t / B;
    lt.core_attn = 0;
    lt.backward_extra = 0;
    attention =
        (in_proj + out_proj + rule) / F + (8 * sb * C / t + 8 * sb * qkw / t) / B + lt.gdn_norm_out;
  }
  const double rest = (norms + bias_dropout_add) / B;
  if (!moe_layer) {
    const double fc1 = 2 * sbh * m.ffn * gated / t, fc2 = 2 * sbh * m.ffn / t;
    const double activation = (2 * gated + 2) * sb * m.ffn / t;  // read fc1's output, write
    lt.mlp = (fc1 + fc2) / F + activation / B;
    lt.forward = attention + rest + lt.mlp;
    return lt;
  }
  // The router's GEMM over the rank's tokens; the experts' GEMMs over N rows (all of the tensor-
  // parallel group's, their columns split t ways), the activation and the probabilities'
  // product read and written, the tokens permuted and unpermuted; the shared experts' dense MLP.
  const MoEPaperShape& e = m.moe;
  const double N = paper_moe_layer_bytes(m).rows, f = e.ffn, fs = e.shared_ffn;
  const double router = 2 * sb / r * h * e.experts;
  const double experts = 2 * N * h * f * (gated + 1) / t;
  lt.moe_act = ((2 * gated + 2) + 4) * N * f / t / B;
  const double permute = 2 * 2 * (2 * N * h + 2 * sbh / r) / B;
  lt.shared = 2 * sbh * fs * (gated + 1) / t / F + (2 * gated + 2) * sb * fs / t / B;
  lt.moe = (router + experts) / F + lt.moe_act + permute + lt.shared;
  lt.forward = attention + rest + lt.moe;
  return lt;
}

// A layer's kind: its mixer (attention, or a GatedDeltaNet layer) and its MLP (dense or MoE),
// as an index 0..3 (moe + 2 gdn).
constexpr int kKinds = 4;
int kind_index(bool moe, bool gdn) {
  return (moe ? 1 : 0) + (gdn ? 2 : 0);
}
bool kind_moe(int kind) {
  return (kind & 1) != 0;
}
bool kind_gdn(int kind) {
  return (kind & 2) != 0;
}
using KindCounts = std::array<double, kKinds>;

// The first pipeline stage's layers by kind: its v model chunks hold layers
// [j p Lc, j p Lc + Lc) for j < v (Megatron's interleaved assignment; v = 1 without it).
struct StageLayers {
  KindCounts count{};
  std::array<int64_t, kKinds> first{-1, -1, -1, -1};  // the first layer of each kind
  std::array<int64_t, kKinds> chunk{};                // and its model chunk
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
  std::vector<bool> moe(static_cast<size_t>(m.L), false), gdn = moe;
  if (m.is_moe()) {
    TORCH_CHECK(m.config != nullptr,
                "actmem::estimate_plans_analytic: an MoE shape needs the "
                "configuration it was read from (paper_shape) for its layer pattern");
    moe = m.config->moe_layers();
    TORCH_CHECK(moe.size() == static_cast<size_t>(m.L),
                "actmem::estimate_plans_analytic: the "
                "configuration has ",
                moe.size(), " layers, the shape ", m.L);
  }
  if (m.config != nullptr && m.config->gated_delta_net()) {
    gdn = m.config->gdn_layers();
    TORCH_CHECK(gdn.size() == static_cast<size_t>(m.L),
                "actmem::estimate_plans_analytic: the "
                "configuration has ",
                gdn.size(), " layers, the shape ", m.L);
  }
  StageLayers out;
  for (int64_t j = 0; j < v; ++j) {
    std::vector<KindCounts> prefix;
    KindCounts n{};
    for (int64_t i = 0; i < Lc; ++i) {
      const int64_t layer = j * p * Lc + i;
      const int k = kind_index(moe[static_cast<size_t>(layer)], gdn[static_cast<size_t>(layer)]);
      n[static_cast<size_t>(k)] += 1;
      if (out.first[static_cast<size_t>(k)] < 0) {
        out.first[static_cast<size_t>(k)] = layer;
        out.chunk[static_cast<size_t>(k)] = j;
      }
      prefix.push_back(n);
    }
    for (int k = 0; k < kKinds; ++k) out.count[static_cast<size_t>(k)] += n[static_cast<size_t>(k)];
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
  TORCH_CHECK(!(c.gated_delta_net() && c.multi_latent_attention),
              "actmem::analytic_config: multi-latent attention on a hybrid model is not modelled");
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
  return {{"static_bytes", static_bytes}, {"microbatches_in_flight", microbatches_in_flight},
          {"layers_per_stage", layers_per_stage}, {"layer_forward_s", layer_forward_s},
          {"plain_step_s", plain_step_s}};
}

namespace {
// A stage's layers of each kind with their terms.
struct Kind {
  double count = 0;
  bool moe = false, gdn = false;
  int index = 0;  // kind_index(moe, gdn)
  LayerTensors x;
  LayerTimes lt;
};

std::vector<Kind> stage_kinds(const PaperShape& m, const StageLayers& stage,
                              const DeviceSpec& gpu) {
  std::vector<Kind> kinds;
  for (int k = 0; k < kKinds; ++k) {
    const double n = stage.count[static_cast<size_t>(k)];
    const bool moe = kind_moe(k), gdn = kind_gdn(k);
    if (n > 0)
      kinds.push_back({n, moe, gdn, k, layer_tensors(m, moe), layer_times(m, gpu, moe, gdn)});
  }
  return kinds;
}

bool beyond_paper(const PaperShape& m) {
  return m.config != nullptr && !paper_describes(*m.config);
}

// Note [Analytic terms from the exact predictor]
// For a model the paper does not describe (GatedDeltaNet layers, the output gate, q/k norms,
// heads wider than h / a) a layer's terms are the exact predictor's (predict_activation_bytes,
// which the tests of inspect and of every strategy check against the tracker to the byte) for
// the first layer of each kind on the first stage: at 16 bits with the GPU's conventions (norm
// statistics in fp32, random-state snapshots on the host), the routed experts at a balanced
// routing, dropout as configured — what `estimate` prints for such a model. Under a selective
// set the predictor runs with that set; what the set drops is the plain layer's bytes less
// those, in two halves each rebuilt at once in the backward (the attention half: the input norm,
// the mixer, its dropout; the MLP half: the rest). An offload group moves the bytes of the
// modules it wraps: attn_norm input_layernorm's, qkv_linear linear_qkv's and the q/k norms',
// core_attn core_attention's, attn_proj linear_proj's (attention layers only), mlp_norm
// pre_mlp_layernorm's, expert_fc1 and moe_act the routed experts' fc1 and activation's: what
// the offloader copies when every tensor passes its size threshold. The embedding, output layer
// and loss keep the paper path's terms.
class PredictedLayers {
 public:
  using Modules = std::vector<std::pair<std::string, double>>;  // module under the layer, bytes
  PredictedLayers(TransformerConfig c, const StageLayers& stage)
      : c_(std::move(c)), stage_(stage), routing_(balanced_moe_routing(c_)) {}
  // The first layer of `kind` on the first stage under selective set `set`.
  const Modules& layer(int kind, const std::vector<RecomputeModule>& set) {
    auto it = cache_.find(set);
    if (it == cache_.end()) it = cache_.emplace(set, predict(set)).first;
    return it->second[static_cast<size_t>(kind)];
  }

 private:
  std::array<Modules, kKinds> predict(const std::vector<RecomputeModule>& set) const {
    Strategy selective;
    selective.recompute_modules = set;
    const TransformerConfig cc = selective.apply(c_);
    const ActivationPlan plan = make_activation_plan(cc);
    std::map<int64_t, PredictedBytes> chunks;
    std::array<Modules, kKinds> out;
    for (int k = 0; k < kKinds; ++k) {
      const int64_t first = stage_.first[static_cast<size_t>(k)];
      if (first < 0) continue;
      const int64_t chunk = stage_.chunk[static_cast<size_t>(k)];
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
          out[static_cast<size_t>(k)].emplace_back(module.substr(prefix.size()),
                                                   static_cast<double>(bytes));
        }
      }
    }
    return out;
  }
  TransformerConfig c_;
  StageLayers stage_;
  MoERouting routing_;
  std::map<std::vector<RecomputeModule>, std::array<Modules, kKinds>> cache_;
};

bool starts(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}
bool ends(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool attention_half(const std::string& module) {
  return starts(module, "input_layernorm") || starts(module, "self_attention") ||
         starts(module, "self_attn_bda");
}
bool group_moves(OffloadModule g, const std::string& module, bool gdn_layer) {
  switch (g) {
    case OffloadModule::kAttnNorm:
      return module == "input_layernorm";
    case OffloadModule::kQkvLinear:
      return !gdn_layer &&
             (module == "self_attention.linear_qkv" || module == "self_attention.q_layernorm" ||
              module == "self_attention.k_layernorm");
    case OffloadModule::kCoreAttn:
      return !gdn_layer && module == "self_attention.core_attention";
    case OffloadModule::kAttnProj:
      return !gdn_layer && module == "self_attention.linear_proj";
    case OffloadModule::kMlpNorm:
      return module == "pre_mlp_layernorm";
    case OffloadModule::kExpertFc1:
      return starts(module, "mlp.experts.") && ends(module, ".linear_fc1");
    case OffloadModule::kMoeAct:
      return starts(module, "mlp.experts.") && ends(module, ".activation_func");
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
    return {k.x.total(), selective_dropped(k.x, s, k.moe), offloaded_per_layer(k.x, s, k.moe)};
  }
  double plain_attn = 0, plain_mlp = 0, attn = 0, mlp = 0, moved = 0;
  for (const auto& [module, bytes] : exact->layer(k.index, {})) {
    (attention_half(module) ? plain_attn : plain_mlp) += bytes;
  }
  for (const auto& [module, bytes] : exact->layer(k.index, s.recompute_modules)) {
    (attention_half(module) ? attn : mlp) += bytes;
    for (const OffloadModule g : s.offload_modules) {
      if (group_moves(g, module, k.gdn)) moved += bytes;
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
    forward += k.count * k.lt.forward;
    step += k.count * (3 * k.lt.forward + k.lt.backward_extra);
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
  const double input = kinds.front().x.input;  // the same for every kind
  double largest = 0;                          // the largest layer's bytes
  std::array<double, kKinds> plain_bytes{};    // each kind's layer without recompute or offload
  for (const Kind& k : kinds) {
    plain_bytes[static_cast<size_t>(k.index)] = kind_cost(k, plain, exact).plain;
    largest = std::max(largest, plain_bytes[static_cast<size_t>(k.index)]);
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
      for (const Kind& k : kinds) extra_s += k.count * k.lt.forward;
    } else if (s.full_method == RecomputeMethod::kBlock) {
      const size_t n =
          static_cast<size_t>(std::min<double>(static_cast<double>(s.full_layers), Lc));
      // Each model chunk's first n layers keep their input, the others everything.
      for (const auto& prefix : stage.chunk_prefix) {
        per_microbatch += static_cast<double>(n) * input;
        for (const Kind& k : kinds) {
          const size_t i = static_cast<size_t>(k.index);
          const double rebuilt = prefix[n - 1][i], all = prefix.back()[i];
          per_microbatch += (all - rebuilt) * plain_bytes[i];
          extra_s += rebuilt * k.lt.forward;
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
        const auto rebuilt = [&](RecomputeModule r, double seconds) {
          return recomputes(s, r, k.moe, k.gdn) ? seconds : 0.0;
        };
        extra_s += k.count * (rebuilt(RecomputeModule::kCoreAttn, k.lt.core_attn) +
                              rebuilt(RecomputeModule::kLayernorm, k.lt.norms) +
                              rebuilt(RecomputeModule::kMlp, k.lt.mlp) +
                              rebuilt(RecomputeModule::kMlaUpProj, k.lt.mla_up_proj) +
                              rebuilt(RecomputeModule::kGdnNormOut, k.lt.gdn_norm_out) +
                              (recomputes(s, RecomputeModule::kMoe, k.moe)
                                   ? k.lt.moe
                                   : rebuilt(RecomputeModule::kMoeAct, k.lt.moe_act) +
                                         rebuilt(RecomputeModule::kSharedExperts, k.lt.shared)));
        per_layer_moved = std::max(per_layer_moved, cost.moved);
        moved += k.count / Ls * cost.moved;
        exposed += k.count / Ls * exposed_copy_s(cost.moved, k.lt.forward, gpu);
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
          const double count = first[static_cast<size_t>(k.index)];
          moved += count * layer;
          extra_s += count * exposed_copy_s(layer, k.lt.forward, gpu);
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
