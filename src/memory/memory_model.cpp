// memory_model.cpp — the paper's formulas, Megatron's theoretical terms and the exact predictor.
#include "actmem/memory/memory_model.h"

#include "actmem/recompute/rng.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <cmath>
#include <numeric>

namespace actmem {

namespace {
// The paper's s^2 term 5as/h in units of sbh; with the flash kernel its logsumexp [b, a, s] in
// fp32, 4a/h, instead (docs/memory-model.md, "Attention backends").
double squared_term(const PaperShape& m) {
  return m.flash ? 4.0 * m.a / m.h : 5.0 * m.a * m.s / m.h;
}

// Megatron's interleave and in-flight factors, shared by both of its formulas.
double pipeline_factor(const PaperShape& m) {
  if (m.vpp) return 1.0 + (m.p - 1.0) / (m.p * *m.vpp);
  if (m.p > 1 && m.num_microbatches) return std::min(1.0, *m.num_microbatches / m.p);
  return 1.0;
}
}  // namespace

// Note [One model description]
// A model is described once, by TransformerConfig (Megatron's TransformerConfig), whose flags
// train, estimate and plan share (flags/train_options.h) and whose validate() states each of
// Megatron's rules once. The paper's formulas want the same model as doubles (a 1T model's
// s^2 terms overflow nothing), so PaperShape is derived from the config here, never bound to
// flags of its own.
PaperShape paper_shape(const TransformerConfig& c) {
  auto d = [](int64_t v) { return static_cast<double>(v); };
  PaperShape m;
  m.s = d(c.seq_length), m.b = d(c.micro_batch_size), m.h = d(c.hidden_size);
  m.a = d(c.num_attention_heads), m.g = d(c.query_groups()), m.L = d(c.num_layers),
  m.ffn = d(c.ffn()), m.v = d(c.vocab_size);
  m.t = d(c.tensor_model_parallel_size), m.p = d(c.pipeline_model_parallel_size);
  m.sp = c.sequence_parallel;
  if (c.virtual_pipeline_size() > 1) m.vpp = d(c.virtual_pipeline_size());
  m.swiglu = c.gated_linear_unit;
  m.untied = c.untie_embeddings_and_output_weights;
  m.rmsnorm = c.use_rmsnorm();
  m.flash = c.flash_attention();
  m.config = std::make_shared<const TransformerConfig>(c);
  if (c.is_moe()) {
    MoEPaperShape& e = m.moe;
    e.experts = d(c.num_moe_experts), e.topk = d(c.moe_router_topk), e.ffn = d(c.moe_ffn());
    e.shared_ffn = d(c.moe_shared_expert_intermediate_size.value_or(0));
    e.capacity_factor = c.moe_expert_capacity_factor.value_or(0.0);
    e.pad_to_capacity = c.moe_pad_expert_input_to_capacity;
    // The router keeps the load-balancing scores only when the loss is computed.
    e.aux_loss = c.moe_router_load_balancing_type == "aux_loss" && c.moe_aux_loss_coeff > 0.0;
    e.z_loss = c.moe_z_loss_coeff.value_or(0.0) > 0.0;
    e.shared_gate = c.moe_shared_expert_gate;
    e.ep = d(c.expert_model_parallel_size);
    for (const bool moe : c.moe_layers()) e.layers += moe ? 1.0 : 0.0;
  }
  if (c.multi_latent_attention) {
    MLAPaperShape& x = m.mla;
    x.q_lora = d(c.q_lora_rank.value_or(0)), x.kv_lora = d(c.kv_lora_rank);
    x.qk = d(c.qk_head_dim), x.pos = d(c.qk_pos_emb_head_dim), x.v = d(c.v_head_dim);
    x.qk_layernorm = c.qk_layernorm;
  }
  return m;
}

LayerBytes paper_layer_bytes(const PaperShape& m) {
  TORCH_CHECK(m.s > 0 && m.b > 0 && m.h > 0 && m.a > 0 && m.t >= 1 && m.ffn > 0,
              "actmem::paper_layer_bytes: sizes must be positive and t >= 1");
  const double sbh = m.sbh(), t = m.t;
  const double sq = squared_term(m);
  const double lin_sel = 18.0 + 4.0 * m.ffn / m.h;  // Megatron's selective term (34 at ffn = 4h)
  LayerBytes r;
  if (t == 1.0 || m.sp) {
    // eq. (1) / eq. (4): the paper's 34 (kept even for ffn != 4h, as the 7B preset's numbers in
    // docs/memory-model.md do) plus the s^2 term.
    r.none = sbh * (34.0 + sq) / t;
    r.selective = sbh * lin_sel / t;
    r.full = 2.0 * sbh / (m.sp ? t : 1.0);
    r.s2_fraction = sq / (34.0 + sq);
  } else {
    // eq. (2): layer norms and dropouts (10 sbh) replicated on every tensor-parallel rank.
    r.none = sbh * (10.0 + 24.0 / t + sq / t);
    r.selective = sbh * (10.0 + (lin_sel - 10.0) / t);
    r.full = 2.0 * sbh;
    r.s2_fraction = (sq / t) / (10.0 + 24.0 / t + sq / t);
  }
  return r;
}

MoELayerBytes paper_moe_layer_bytes(const PaperShape& m) {
  const MoEPaperShape& e = m.moe;
  TORCH_CHECK(e.experts >= 1 && e.topk >= 1 && e.topk <= e.experts && e.ffn > 0,
              "actmem::paper_moe_layer_bytes: needs experts >= 1, 1 <= topk <= experts and an "
              "expert ffn > 0");
  TORCH_CHECK(m.t == 1 || m.sp, "actmem::paper_moe_layer_bytes: MoE with tensor parallelism "
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
              (e.z_loss ? 4 * sb * E + 4 * sb : 0) + (e.capacity_factor > 0 ? sb * E : 0)) / t;
  r.dispatch = 16 * rows + 2 * rows + 2 * rows * h;
  r.experts = (m.swiglu ? 10 : 6) * rows * e.ffn / t;
  r.shared = (m.swiglu ? 8 : 4) * sb * e.shared_ffn / t;
  const double sq = squared_term(m);
  const double attention = m.sbh() * (13.0 + sq) / t;
  const double norm_and_mask = 3 * m.sbh() / t;
  r.layer.none = attention + norm_and_mask + r.mlp();
  r.layer.selective = 13.0 * m.sbh() / t + norm_and_mask + r.mlp();
  r.layer.full = 2.0 * m.sbh() / t;
  r.layer.s2_fraction = sq * m.sbh() / t / r.layer.none;
  return r;
}

MLAAttentionBytes paper_mla_attention_bytes(const PaperShape& m) {
  const MLAPaperShape& x = m.mla;
  TORCH_CHECK(x.kv_lora > 0 && x.qk > 0 && x.pos > 0 && x.v > 0 && x.q_lora >= 0,
              "actmem::paper_mla_attention_bytes: needs kv_lora, qk, pos, v > 0 and q_lora >= 0");
  const double sb = m.s * m.b, t = m.t, rep = m.sp ? t : 1.0, a = m.a;
  MLAAttentionBytes r;
  double latents = 2 * sb * m.h;
  if (x.q_lora > 0) latents += 2 * sb * x.q_lora + (x.qk_layernorm ? 2 * sb * x.q_lora + 4 * sb : 0);
  latents += 2 * sb * (x.kv_lora + x.pos) + (x.qk_layernorm ? 2 * sb * x.kv_lora + 4 * sb : 0);
  r.latents = latents / rep;
  r.qkv = 2 * sb * a * (2 * (x.qk + x.pos) + x.v) / t;
  r.scores = 5 * a * m.s * m.s * m.b / t;
  r.context = 2 * sb * a * x.v / t;
  return r;
}

double megatron_activation_memory(const PaperShape& m) {
  const double sbh = m.sbh();
  double a = sbh * (18.0 + 4.0 * m.ffn / m.h) * m.L;
  a += 8.0 * m.s * m.b * m.p + sbh * m.p;  // int64 input ids and the embedding dropout mask
  a *= pipeline_factor(m);
  if (m.p == 1) a += sbh * 4.0 * (1.0 + m.v / m.h);  // output-layer input and fp32 logits
  return a / m.t;
}

double megatron_activation_memory_without_sp(const PaperShape& m) {
  const double sbh = m.sbh();
  double a = sbh * (10.0 + 24.0 / m.t) * m.L;
  a += 8.0 * m.s * m.b * m.p + sbh * m.p;
  a *= pipeline_factor(m);
  if (m.p == 1) a += 2.0 * (m.s * m.b * m.v / m.t + sbh);
  return a * 1.05;
}

WeightMemory megatron_weight_and_optimizer_memory(const PaperShape& m) {
  TORCH_CHECK(m.h > 0 && m.L > 0 && m.v > 0 && m.ffn > 0 && m.t >= 1 && m.p >= 1 && m.d >= 1,
              "actmem::megatron_weight_and_optimizer_memory: sizes must be positive, t, p, d >= 1");
  const double h = m.h, gated = m.swiglu ? 1.5 : 1.0, norm = m.rmsnorm ? 1.0 : 2.0;
  // Megatron's self_attn_term: 2h^2 (1 + G/a) (query projection a d = h here): linear_qkv's
  // h (a + 2G) d and linear_proj's h^2.
  const double groups = m.g > 0 ? m.g : m.a;
  double attention = 2.0 * h * h * (1.0 + groups / m.a);
  if (m.is_mla()) {
    const MLAPaperShape& x = m.mla;
    const double q = x.q_lora > 0 ? x.q_lora * (h + m.a * (x.qk + x.pos) + norm)
                                  : h * m.a * (x.qk + x.pos);
    attention = q + x.kv_lora * (h + m.a * (x.qk + x.v) + norm) + h * x.pos + m.a * x.v * h;
  }
  const double dense_mlp = 2.0 * h * m.ffn * gated, layernorm = 2.0 * h * norm;
  const double moe_layers = m.is_moe() ? m.moe.layers : 0.0, dense_layers = m.L - moe_layers;
  const MoEPaperShape& e = m.moe;
  const double shared = m.is_moe() ? 2.0 * h * e.shared_ffn * gated : 0.0;
  const double routed = m.is_moe() ? 2.0 * h * e.ffn * e.experts * gated : 0.0;
  const double active_routed = m.is_moe() ? 2.0 * h * e.ffn * e.topk * gated : 0.0;
  const double router = m.is_moe() ? h * e.experts : 0.0;
  const double gate = m.is_moe() && e.shared_ffn > 0 && e.shared_gate ? h : 0.0;
  const double embedding = h * m.v;
  const double tp_sharded = (attention + dense_mlp) * dense_layers + (attention + shared) * moe_layers;
  const double replicated =
      layernorm * dense_layers + (layernorm + router + gate) * moe_layers + norm * h;
  const double expert_sharded = routed * moe_layers;
  WeightMemory w;
  w.parameters = tp_sharded + replicated + expert_sharded + (m.untied ? 2.0 : 1.0) * embedding;
  w.active_parameters = w.parameters - (routed - active_routed) * moe_layers;
  const double etp = e.etp > 0 ? e.etp : m.t;
  double tp_on_rank = (tp_sharded / m.p + embedding) / m.t;
  if (m.untied && m.p == 1) tp_on_rank += embedding / m.t;
  const double replicated_on_rank = replicated / m.p;
  w.expert_parameters_on_rank = expert_sharded / m.p / (etp * e.ep);
  w.parameters_on_rank = tp_on_rank + replicated_on_rank + w.expert_parameters_on_rank;
  // The routed experts' data-parallel size: world / (etp e p), world = t d p.
  const double expert_dp = std::max(1.0, m.t * m.d / (etp * e.ep));
  auto optimizer = [&](double dp) { return m.distributed_optimizer ? 12.0 / dp : 12.0; };
  const double dense_on_rank = tp_on_rank + replicated_on_rank;
  w.weight_bytes = 2.0 * w.parameters_on_rank;
  w.gradient_bytes = 4.0 * w.parameters_on_rank;  // fp32 main grads, on every data-parallel rank
  w.optimizer_bytes = optimizer(m.d) * dense_on_rank + optimizer(expert_dp) * w.expert_parameters_on_rank;
  w.bytes_per_parameter = w.total() / w.parameters_on_rank;
  return w;
}

ParameterCount count_parameters(const TransformerConfig& c) {
  TORCH_CHECK(!c.multi_latent_attention,
              "actmem::count_parameters: multi-latent attention is "
              "counted by megatron_weight_and_optimizer_memory");
  const double t = static_cast<double>(c.tensor_model_parallel_size);
  const double e = static_cast<double>(c.expert_model_parallel_size);
  const int64_t h = c.hidden_size, bias = c.add_bias_linear ? 1 : 0;
  const int64_t norm = (c.use_rmsnorm() ? 1 : 2);  // weight (and bias) per feature
  // Per layer kind: {sharded over tensor ranks, replicated}.
  struct Part {
    int64_t sharded = 0, replicated = 0;
    int64_t total() const { return sharded + replicated; }
  };
  Part attention;
  {
    const int64_t a = c.num_attention_heads, d = c.kv_channels();
    const int64_t rows = (a * (c.attention_output_gate ? 2 : 1) + 2 * c.query_groups()) * d;
    attention.sharded = h * rows + bias * rows + a * d * h;
    attention.replicated = bias * h + (c.qk_layernorm ? 2 * d * norm : 0) + 2 * h * norm;
  }
  Part gdn;
  if (c.gated_delta_net()) {
    const int64_t qk = c.linear_num_key_heads * c.linear_key_head_dim;
    const int64_t vd = c.linear_num_value_heads * c.linear_value_head_dim;
    const int64_t Hv = c.linear_num_value_heads;
    gdn.sharded =
        h * (2 * qk + 2 * vd + 2 * Hv) + (2 * qk + vd) * c.linear_conv_kernel_dim + 2 * Hv + vd * h;
    gdn.replicated = c.linear_value_head_dim * norm + 2 * h * norm;
  }
  auto mlp = [&](int64_t f) {  // Megatron's MLP: fc1 column-parallel, fc2 row-parallel
    const int64_t fc1 = c.gated_linear_unit ? 2 * f : f;
    return Part{h * fc1 + bias * fc1 + f * h, bias * h};
  };
  const Part dense = mlp(c.ffn());
  Part moe_shared;     // router, shared experts and their gate
  int64_t expert = 0;  // one routed expert
  if (c.is_moe()) {
    const int64_t fm = c.moe_ffn(), fc1 = c.gated_linear_unit ? 2 * fm : fm;
    expert = h * fc1 + fm * h + bias * (fc1 + h);
    moe_shared.replicated = c.num_moe_experts * h + bias * c.num_moe_experts;
    if (c.moe_shared_expert_intermediate_size) {
      const Part se = mlp(*c.moe_shared_expert_intermediate_size);
      moe_shared.sharded += se.sharded;
      moe_shared.replicated += se.replicated + (c.moe_shared_expert_gate ? h : 0);
    }
  }
  const std::vector<bool> moe = c.moe_layers(), linear = c.gdn_layers();
  auto on_first_stage = [&c](int64_t i) {  // each of the first stage's model chunks
    for (int64_t k = 0; k < c.virtual_pipeline_size(); ++k) {
      if (c.model_chunk_layers(0, k).contains(i)) return true;
    }
    return false;
  };
  // A rank holds E/e routed experts, each split over the t expert-tensor ranks but for fc2's
  // bias (added after the reduction, replicated).
  const double expert_on_rank =
      static_cast<double>(c.num_moe_experts) / e *
      (static_cast<double>(expert - bias * h) / t + static_cast<double>(bias * h));
  ParameterCount n;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const Part& mixer = linear[static_cast<size_t>(i)] ? gdn : attention;
    const bool is_moe = moe[static_cast<size_t>(i)];
    const int64_t experts = is_moe ? c.num_moe_experts * expert : 0;
    const Part& ffn = is_moe ? moe_shared : dense;
    n.total += mixer.total() + ffn.total() + experts;
    n.active += mixer.total() + ffn.total() + (is_moe ? c.moe_router_topk * expert : 0);
    if (on_first_stage(i)) {
      n.experts_on_rank += is_moe ? expert_on_rank : 0.0;
      n.on_rank += static_cast<double>(mixer.sharded + ffn.sharded) / t +
                   static_cast<double>(mixer.replicated + ffn.replicated);
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
  return !c.gated_delta_net() &&
         (c.multi_latent_attention || (c.query_projection_size() == c.hidden_size &&
                                       !c.attention_output_gate && !c.qk_layernorm));
}

MoERouting balanced_moe_routing(const TransformerConfig& c) {
  MoERouting routing;
  if (!c.is_moe() || c.moe_pad_expert_input_to_capacity) return routing;
  const int64_t t = c.tensor_model_parallel_size, e = c.expert_model_parallel_size;
  const int64_t T = c.sequence_parallel ? c.seq_length * c.micro_batch_size / t
                                        : c.seq_length * c.micro_batch_size;
  const int64_t k = c.moe_router_topk, E = c.num_moe_experts;
  int64_t rows = (e * t * T * k + E - 1) / E;  // per local expert, rounded up
  if (c.moe_expert_capacity_factor) {  // each routing rank sends an expert at most its capacity
    rows = std::min(rows, e * t * moe_expert_capacity(T, k, E, *c.moe_expert_capacity_factor));
  }
  for (const bool is_moe : c.moe_layers()) {
    if (is_moe) routing.emplace_back(std::vector<int64_t>(static_cast<size_t>(E / e), rows), T * k);
  }
  return routing;
}

double offload_round_trip_seconds(double bytes, double gbps) {
  TORCH_CHECK(gbps > 0, "actmem::offload_round_trip_seconds: bandwidth must be positive, got ", gbps);
  return 2.0 * bytes / (gbps * 1e9);
}

namespace {
// Whether module `path` is `suffix` or ends with "." + suffix (decoder.layers.3.mlp.linear_fc1).
bool is_module(const std::string& path, const std::string& suffix) {
  return path.size() >= suffix.size() &&
         path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0 &&
         (path.size() == suffix.size() || path[path.size() - suffix.size() - 1] == '.');
}
}  // namespace

double korthikanti_module_bytes(const std::string& path, const TransformerConfig& c,
                                int64_t dtype_bytes) {
  auto ends_with = [&path](const char* suffix) { return is_module(path, suffix); };
  // The paper has no term for multi-latent attention's modules (paper_mla_attention_bytes does).
  if (c.multi_latent_attention && path.find("self_attention.") != std::string::npos) return -1.0;
  const double sbh = static_cast<double>(c.seq_length * c.micro_batch_size * c.hidden_size);
  const double as2b = static_cast<double>(c.num_attention_heads) * c.seq_length * c.seq_length *
                      c.micro_batch_size;
  const double k = static_cast<double>(dtype_bytes) / 2.0;  // 16-bit terms at this dtype
  const double ffn_ratio = static_cast<double>(c.ffn()) / static_cast<double>(c.hidden_size);
  // Table 2: terms inside the tensor-parallel region are divided by t; the replicated ones
  // (norms, the inputs of linear_qkv and linear_fc1, the residual dropout masks) only with SP.
  const double t = static_cast<double>(c.tensor_model_parallel_size);
  const double rep = c.sequence_parallel ? t : 1.0;
  if (ends_with("input_layernorm") || ends_with("pre_mlp_layernorm")) return 2 * sbh * k / rep;
  if (ends_with("self_attention.linear_qkv")) return 2 * sbh * k / rep;
  // Q and K 4sbh, V 2sbh; softmax output 2as^2b, its dropout mask as^2b, dropout output 2as^2b.
  if (ends_with("self_attention.core_attention")) return (6 * sbh * k + 4 * as2b * k + as2b) / t;
  if (ends_with("self_attention.linear_proj")) return 2 * sbh * k / t;
  if (ends_with("self_attn_bda") || ends_with("mlp_bda")) return sbh / rep;  // dropout mask
  if (ends_with("mlp.linear_fc1")) return 2 * sbh * k / rep;
  if (ends_with("mlp.activation_func") || ends_with("mlp.linear_fc2")) {
    return 2 * ffn_ratio * sbh * k / t;
  }
  return -1.0;
}

namespace {
// Per module, what a standard attention layer keeps (Note [What standard attention keeps]).
struct StandardAttentionBytes {
  int64_t q_layernorm = 0, k_layernorm = 0, core_qkv = 0, output_gate = 0, linear_proj = 0;
};
int64_t core_attention_qkv_bytes(const TransformerConfig& c, const LayerPlan& lp, int64_t e);
int64_t flash_output_and_logsumexp_bytes(const TransformerConfig& c, int64_t e);
StandardAttentionBytes standard_attention_bytes(const TransformerConfig& c, const LayerPlan& lp,
                                                int64_t e, bool cpu);
}  // namespace

ModuleExtra module_bytes_beyond_paper(const std::string& path, const TransformerConfig& c,
                                      bool cpu) {
  auto ends_with = [&path](const char* suffix) { return is_module(path, suffix); };
  const int64_t e = c.element_bytes(), up = e == 2 ? 4 : e;
  const int64_t t = c.tensor_model_parallel_size;
  const int64_t sb = c.sequence_parallel ? c.seq_length * c.micro_batch_size / t
                                         : c.seq_length * c.micro_batch_size;
  const int64_t sbh_t = c.seq_length * c.micro_batch_size * c.hidden_size / t;
  const int64_t sbf_t = c.seq_length * c.micro_batch_size * c.ffn() / t;
  const int64_t as2b_t =
      c.num_attention_heads * c.seq_length * c.seq_length * c.micro_batch_size / t;
  ModuleExtra x;
  auto add = [&x](int64_t bytes, const std::string& what) {
    x.bytes += bytes;
    x.what += (x.what.empty() ? "" : "; ") + what;
  };
  if (ends_with("input_layernorm") || ends_with("pre_mlp_layernorm")) {
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
  } else if (ends_with("self_attention.core_attention") && !c.multi_latent_attention) {
    // Note [What standard attention keeps]: the paper's 3 sbh for q, k and v, exactly with
    // grouped-query attention (q's copy or RoPE's output, k and v repeated to every head).
    const int64_t qkv = core_attention_qkv_bytes(c, LayerPlan{}, e) - 3 * sbh_t * e;
    if (qkv != 0) {
      std::string why;
      if (c.query_projection_size() != c.hidden_size)
        why = "heads a x d = " + std::to_string(c.query_projection_size()) + " wide, not h; ";
      if (c.attention_output_gate && !c.qk_layernorm && !c.model_rope())
        why += "linear_qkv's output holds the gates; ";
      if (c.qk_layernorm)
        why += "the q/k norms' outputs (their inputs on q_layernorm, k_layernorm); ";
      if (c.model_rope()) why += "RoPE's rotated q and k; ";
      if (c.flash_attention())
        why += "flash takes k and v at G heads, v a view of linear_qkv's output; ";
      add(qkv, why.empty() ? "q, k and v as the kernel keeps them" : why.substr(0, why.size() - 2));
    }
    if (c.flash_attention()) {
      // Note [The flash kernel's layout]: the output and the logsumexp; no s x s tensor.
      add(flash_output_and_logsumexp_bytes(c, e) - (2 * as2b_t * e + as2b_t),
          "flash: no s x s tensors (the paper's 5as^2b), its output and logsumexp 4asb instead");
    } else if (c.attention_dropout == 0.0) {
      add(-(as2b_t + as2b_t * e), "no attention dropout: no mask, no dropped probabilities");
    }
  } else if (ends_with("self_attention.linear_proj") && !c.multi_latent_attention) {
    const int64_t extra = standard_attention_bytes(c, LayerPlan{}, e, cpu).linear_proj - sbh_t * e;
    if (extra != 0) {
      add(extra, c.flash_attention() && !c.attention_output_gate
                     ? "flash: its input is the kernel's output, counted on core_attention"
                     : "its input is a x d wide, not h");
    }
  } else if (ends_with("mlp.activation_func")) {
    if (c.gated_linear_unit) add(2 * sbf_t * e, "SwiGLU: fc1's output is 2f wide, plus silu's output");
  } else if (ends_with("self_attn_bda") || ends_with("mlp_bda")) {
    if (c.hidden_dropout == 0.0) add(-sb * c.hidden_size, "no hidden dropout: no mask");
  }
  return x;
}

// ---- the exact predictor ----------------------------------------------------------------------

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
// RMSNorm's rstd are fp32, and so are LayerNorm's mean/rstd on CUDA — 2 bytes on CPU):
//   embedding            dropout mask sbh                           (if hidden_dropout > 0)
//   input_layernorm      input sbh·e + mean, rstd 2·sb·e (LayerNorm) | input + rstd sb·e (RMSNorm)
//   linear_qkv           its input (the norm output) sbh·e
//   core_attention       the qkv output 3sbh·e (q, k, v are views of it); RoPE adds rotated q, k
//                        2sbh·e; softmax output as²b·e; with attention dropout its mask as²b and
//                        the dropped probabilities as²b·e
//   linear_proj          the context sbh·e
//   self_attn_bda        dropout mask sbh                           (if hidden_dropout > 0)
//   pre_mlp_layernorm    as input_layernorm
//   linear_fc1           its input sbh·e
//   activation_func      GeLU: the fc1 output sbf·e; SwiGLU: the fc1 output 2sbf·e + silu out sbf·e
//   linear_fc2           the activation output sbf·e
//   mlp_bda              dropout mask sbh                           (if hidden_dropout > 0)
//   final_layernorm      as a layer norm;  output_layer: its input sbh·e
//   loss                 log-softmax output sbv·e, int64 targets 8sb (a copy when b, s > 1),
//                        total weight e
// plus the loss value itself (e), and one random-state snapshot per checkpoint.
//
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
// Note [What MLA saves] (T = s*b tokens, a heads, dq = qk_head_dim + qk_pos_emb_head_dim,
// dv = v_head_dim, rq = q_lora_rank, rkv = kv_lora_rank, dr = qk_pos_emb_head_dim; ledger of
// `actmem inspect --records`, Megatron's MLASelfAttention):
//   linear_q_down_proj   the input norm's output Th·e (linear_kv_down_proj without q_lora_rank)
//   q_layernorm          its input, the query latent T·rq·e, and its statistics (qk_layernorm)
//   kv_layernorm         its input, a view of the whole down-projection output T·(rkv+dr)·e,
//                        and its statistics (qk_layernorm)
//   linear_q_up_proj     its input T·rq·e (the normed latent, or the latent itself); none for
//                        linear_q_proj, which reads the norm output
//   linear_kv_up_proj    its input: the normed latent T·rkv·e, or without qk_layernorm a view
//                        of the down-projection output, T·(rkv+dr)·e
//   rotary_pos_emb       nothing (the tables are buffers)
//   core_attention       q, k, v after RoPE, T·a·(2dq+dv)·e, and the scores' tensors as for
//                        standard attention
//   linear_proj          the context T·a·dv·e
// mla_up_proj recompute: the checkpoint keeps the two up-projections' inputs (and the RoPE key
// part, a view of a kept storage) plus a snapshot, under the query up-projection; q, k, v are
// freed after core attention saved them.
namespace {
// MoE layer `moe_index`'s entry in `routing`, or null when it has none.
const MoELayerRouting* layer_routing(const MoERouting* routing, size_t moe_index) {
  if (routing == nullptr || moe_index >= routing->size() ||
      (*routing)[moe_index].expert_rows.empty()) {
    return nullptr;
  }
  return &(*routing)[moe_index];
}

// The tokens one rank's router sees: s*b, or s*b/t with sequence parallelism (which MoE under
// tensor parallelism requires).
int64_t router_tokens(const TransformerConfig& c) {
  const int64_t T = c.seq_length * c.micro_batch_size;
  return c.sequence_parallel ? T / c.tensor_model_parallel_size : T;
}
}  // namespace

int64_t moe_max_routed_rows(const TransformerConfig& c) {
  const int64_t T = router_tokens(c), E = c.num_moe_experts;
  const int64_t k = c.moe_router_topk;
  if (!c.moe_expert_capacity_factor) return T * k;
  const int64_t cap = std::min(moe_expert_capacity(T, k, E, *c.moe_expert_capacity_factor), T);
  return c.moe_pad_expert_input_to_capacity ? E * cap : std::min(T * k, E * cap);
}

int64_t moe_max_expert_rows(const TransformerConfig& c) {
  // This rank's L = E/e experts (its slice of them) compute the rows of the t x e ranks whose
  // routers send to them: every tensor rank's (the dispatchers gather over the expert tensor-
  // parallel group) of every expert rank.
  const int64_t e = c.expert_model_parallel_size, sources = e * c.tensor_model_parallel_size;
  if (sources == 1) return moe_max_routed_rows(c);
  const int64_t T = router_tokens(c), E = c.num_moe_experts, L = E / e;
  const int64_t k = c.moe_router_topk;
  const int64_t dropless = sources * T * std::min(k, L);
  if (!c.moe_expert_capacity_factor) return dropless;
  const int64_t cap = std::min(moe_expert_capacity(T, k, E, *c.moe_expert_capacity_factor), T);
  return c.moe_pad_expert_input_to_capacity ? L * sources * cap : std::min(dropless, L * sources * cap);
}

std::optional<int64_t> moe_expert_rows(const TransformerConfig& c, size_t moe_index,
                                       const MoERouting* routing) {
  if (const auto* r = layer_routing(routing, moe_index)) {
    return std::accumulate(r->expert_rows.begin(), r->expert_rows.end(), int64_t{0});
  }
  // Padded to capacity the count does not depend on the routing; dropless neither, unless
  // expert parallelism brings other ranks' tokens (tensor ranks bring all of theirs: each
  // routes every token to k of the E experts, all of them local).
  if (c.moe_pad_expert_input_to_capacity ||
      (!c.moe_expert_capacity_factor && c.expert_model_parallel_size == 1)) {
    return moe_max_expert_rows(c);
  }
  return std::nullopt;
}

namespace {
// What a norm over `rows` rows keeps besides its input: RMSNorm's rstd upcast, LayerNorm's mean
// and rstd (in the dtype on CPU, upcast on CUDA: `ln_stat`).
int64_t norm_statistics_bytes(const TransformerConfig& c, int64_t rows, int64_t up,
                              int64_t ln_stat) {
  return c.use_rmsnorm() ? rows * up : 2 * rows * ln_stat;
}

// Note [What standard attention keeps]
// Per rank: H = a/t query heads, G = G/t key/value groups, head dim d, so one head of the whole
// sequence is D = s b d elements. The ledger counts a storage once, on the first module that
// saves it, so the predictor follows the storages:
//   QKV   linear_qkv's output, (H + 2G) D (plus H D of gates with --attention-output-gate);
//         k and v are views of it; q is a view when each group has one query head or the rank
//         holds one group, else a copy (Megatron's reshape of the grouped layout) — the gate too.
//   q_layernorm / k_layernorm (--qk-layernorm) keep their input (q's view or copy, k's view),
//         their statistics over H T (G T) rows, and with --apply-layernorm-1p the [d] scale;
//         their outputs are new.
//   RoPE's outputs are new (partial RoPE too: the rotated part and the passed one concatenated).
//   core_attention keeps what reaches it: q and k as they came (after the norms and RoPE) and v
//         — the checkpoint (selective core_attn) and the flash kernel take them at G heads; the
//         unfused products read the keys and values repeated to every head (expand_kv_heads:
//         copies when G < H) and q through a [s, b H, d] reshape, itself a copy when q is a
//         view of a grouped QKV.
//   output_gate (--attention-output-gate) keeps the context and sigmoid(gate) in fp32 (upcast),
//         linear_proj the gated context; without the gate linear_proj keeps the context, a view
//         of the flash kernel's output (counted on core_attention) or a new tensor.

StandardAttentionBytes standard_attention_bytes(const TransformerConfig& c, const LayerPlan& lp,
                                                int64_t e, bool cpu) {
  const int64_t up = e == 2 ? 4 : e, ln_stat = cpu ? e : up;
  const int64_t t = c.tensor_model_parallel_size;
  const int64_t H = c.num_attention_heads / t, G = c.query_groups() / t, d = c.kv_channels();
  const int64_t T = c.seq_length * c.micro_batch_size, D = T * d;
  const bool grouped = G < H, gate = c.attention_output_gate, rope = c.model_rope();
  const bool recompute = lp.recomputes(RecomputeModule::kCoreAttn), flash = c.flash_attention();
  // Storages by name; saving one the first time adds its bytes to the module that saves it.
  std::vector<std::string> saved;
  auto save = [&saved](int64_t& module, const std::string& storage, int64_t bytes) {
    if (std::find(saved.begin(), saved.end(), storage) != saved.end()) return;
    saved.push_back(storage);
    module += bytes;
  };
  const int64_t qkv_bytes = ((gate ? 2 : 1) * H + 2 * G) * D * e;
  const bool q_view = !grouped || G == 1;
  const std::string q0 = q_view ? "qkv" : "q copy";
  StandardAttentionBytes x;
  auto save_q0 = [&](int64_t& module) { save(module, q0, q_view ? qkv_bytes : H * D * e); };
  std::string qn = q0, kn = "qkv";
  if (c.qk_layernorm) {
    const int64_t scale = c.layernorm_zero_centered_gamma ? d * e : 0;
    save_q0(x.q_layernorm);
    x.q_layernorm += norm_statistics_bytes(c, H * T, up, ln_stat) + scale;
    save(x.k_layernorm, "qkv", qkv_bytes);
    x.k_layernorm += norm_statistics_bytes(c, G * T, up, ln_stat) + scale;
    qn = "q normed";
    kn = "k normed";
  }
  const std::string qr = rope ? "q rotated" : qn, kr = rope ? "k rotated" : kn;
  auto save_named = [&](int64_t& module, const std::string& storage, int64_t heads) {
    if (storage == "qkv") {
      save(module, "qkv", qkv_bytes);
    } else if (storage == "q copy") {
      save_q0(module);
    } else {
      save(module, storage, heads * D * e);
    }
  };
  if (recompute || flash) {
    save_named(x.core_qkv, qr, H);
    save_named(x.core_qkv, kr, G);
    save(x.core_qkv, "qkv", qkv_bytes);  // v
  } else {
    // q through the [s, b H, d] reshape: a copy only of q's view into a grouped QKV.
    if (qr == "qkv" && grouped) {
      save(x.core_qkv, "q reshaped", H * D * e);
    } else {
      save_named(x.core_qkv, qr, H);
    }
    if (grouped) {
      save(x.core_qkv, "k repeated", H * D * e);
      save(x.core_qkv, "v repeated", H * D * e);
    } else {
      save_named(x.core_qkv, kr, H);
      save(x.core_qkv, "qkv", qkv_bytes);
    }
  }
  // The context [s, b, H d]: a view of the flash kernel's output (counted with it), else new.
  const int64_t context = flash && !recompute ? 0 : H * D * e;
  if (gate) {
    x.output_gate = context + H * D * up;
    x.linear_proj = H * D * e;
  } else {
    x.linear_proj = context;
  }
  return x;
}

int64_t core_attention_qkv_bytes(const TransformerConfig& c, const LayerPlan& lp, int64_t e) {
  return standard_attention_bytes(c, lp, e, true).core_qkv;
}

// What the flash kernel keeps beyond q, k and v, per rank: its output [b, a/t, s, d] (which
// linear_proj's input is a view of) and the logsumexp [b, a/t, s] in fp32 (the dtype at 64 bits).
int64_t flash_output_and_logsumexp_bytes(const TransformerConfig& c, int64_t e) {
  const int64_t t = c.tensor_model_parallel_size;
  const int64_t sbh_t = c.seq_length * c.micro_batch_size * c.query_projection_size() / t;
  const int64_t asb_t = c.num_attention_heads / t * c.seq_length * c.micro_batch_size;
  return sbh_t * e + asb_t * (e == 8 ? 8 : 4);
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
  c.validate_shape();
  // A pipeline stage (or one model chunk of it) counts its own layers; the embedding is the first
  // stage's (its first chunk's), the final norm, output layer and loss the last's (its last
  // chunk's).
  const TransformerConfig::StageLayers stage = c.model_chunk_layers(pipeline_stage, model_chunk);
  const bool first_stage = pipeline_stage == 0 && model_chunk == 0;
  const bool last_stage = pipeline_stage == c.pipeline_model_parallel_size - 1 &&
                          model_chunk == c.virtual_pipeline_size() - 1;
  TORCH_CHECK(plan.layers.size() == static_cast<size_t>(c.num_layers),
              "actmem::predict_activation_bytes: the plan has ", plan.layers.size(),
              " layers, the config ", c.num_layers);
  if (e == 0) e = c.element_bytes();
  TORCH_CHECK(e == 2 || e == 4 || e == 8, "actmem::predict_activation_bytes: dtype_bytes must be "
              "2, 4 or 8 (or 0 for the config's precision), got ", e);
  // Upcast values (Note [What this model saves]): fp32 at 16 bits, the dtype otherwise.
  const int64_t up = e == 2 ? 4 : e;
  // LayerNorm's mean and rstd: libtorch's CPU kernel keeps them in the input's type, the CUDA
  // kernel in fp32 at 16 bits (its accumulate type). RMSNorm (ours) keeps rstd upcast.
  const bool cpu = snapshots_on_device;
  const int64_t ln_stat = cpu ? e : up;
  const int64_t s = c.seq_length, b = c.micro_batch_size, h = c.hidden_size;
  const int64_t a = c.num_attention_heads, f = c.ffn(), v = c.vocab_size;
  // Per tensor-parallel rank: heads and MLP columns are split t ways; with sequence parallelism
  // the residual stream (norms, their inputs, dropout masks) holds s/t tokens (docs/parallelism.md).
  const int64_t t = c.tensor_model_parallel_size;
  const bool sp = c.sequence_parallel;
  const int64_t sbh_full = s * b * h;
  const int64_t sb = sp ? s * b / t : s * b;  // tokens on this rank in the residual stream
  const int64_t sbh = sb * h;
  const int64_t sbf = s * b * f / t, as2b = a * s * s * b / t;
  const bool hidden_drop = c.hidden_dropout > 0.0, attn_drop = c.attention_dropout > 0.0;
  const bool flash = c.flash_attention();
  const int64_t snapshot = checkpoint_snapshot_bytes(snapshots_on_device);
  const int64_t norm_stats = norm_statistics_bytes(c, sb, up, ln_stat);
  // --apply-layernorm-1p: each norm call keeps its scale 1 + weight, n elements (layers.cpp).
  const int64_t gamma1p = c.layernorm_zero_centered_gamma ? e : 0;

  PredictedBytes p;
  auto add = [&p](const std::string& module, int64_t bytes) {
    if (bytes == 0) return;
    auto it = std::find_if(p.by_module.begin(), p.by_module.end(),
                           [&](const auto& m) { return m.first == module; });
    if (it == p.by_module.end()) {
      p.by_module.emplace_back(module, bytes);
    } else {
      it->second += bytes;
    }
    p.total += bytes;
  };

  // Note [What an MoE layer saves]; norm_out is the pre-MLP norm's output as its first consumer
  // counts it.
  auto add_moe_layer = [&](const std::string& mlp, const LayerPlan& lp, int64_t norm_out,
                           size_t index) {
    if (lp.recomputes(RecomputeModule::kMoe)) {
      add(mlp, norm_out + snapshot);
      return;
    }
    const MoELayerRouting* lr = layer_routing(routing, index);
    const std::optional<int64_t> rows = moe_expert_rows(c, index, routing);
    TORCH_CHECK(rows.has_value(), "actmem::predict_activation_bytes: with a capacity factor and "
                "no padding the experts' rows depend on the routing; pass the router's counts "
                "(MoEStats::routing()) for MoE layer ", index);
    // T: the tokens this rank routes (s/t of the sequence with sequence parallelism); the
    // experts and the shared experts hold their 1/t column slices (expert tensor parallelism).
    const int64_t N = *rows, T = sb, E = c.num_moe_experts, k = c.moe_router_topk;
    const int64_t fm = c.moe_ffn() / t, fc1w = c.gated_linear_unit ? 2 * fm : fm;
    int64_t router_in = norm_out;
    if (c.moe_shared_expert_intermediate_size) {
      // A dense MLP on the tensor-parallel group: its activations cover all s*b tokens, fs/t
      // columns (with sequence parallelism fc1 keeps the s/t shard, the norm output).
      const int64_t fs = *c.moe_shared_expert_intermediate_size / t, Tf = s * b;
      const std::string se = mlp + ".shared_experts";
      if (lp.recomputes(RecomputeModule::kSharedExperts)) {
        add(se, norm_out + snapshot);
      } else {
        add(se + ".linear_fc1", norm_out);
        add(se + ".activation_func", (c.gated_linear_unit ? 3 : 1) * Tf * fs * e);
        add(se + ".linear_fc2", Tf * fs * e);
        if (c.moe_shared_expert_gate) add(se, T * e + T * h * e);
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
    add(mlp + ".router", router);
    // The permutation's indices: of the rows this rank routed with the all-to-all dispatcher
    // (the rows travel; their indices stay), of the rows its experts compute otherwise (the
    // all-gather dispatcher permutes the gathered tokens of its own experts).
    int64_t routed = N;
    if ((c.expert_model_parallel_size > 1 || t > 1) && c.moe_token_dispatcher_type == "alltoall") {
      routed = lr != nullptr && lr->dispatched_rows >= 0 ? lr->dispatched_rows : moe_max_routed_rows(c);
    }
    add(mlp + ".token_dispatcher", 2 * routed * 8);
    // What the experts keep for n of their rows (the probabilities apart).
    auto act_bytes = [&](int64_t n) {
      const int64_t mask = c.moe_expert_dropout > 0.0 ? n * fm : 0;
      return (c.gated_linear_unit ? 4 * n * fm * e : 2 * n * fm * e) + mask;
    };
    if (c.moe_grouped_gemm) {
      add(mlp + ".experts.linear_fc1", N * h * e);
      if (lp.recomputes(RecomputeModule::kMoeAct)) {
        add(mlp + ".experts.activation_func", N * fc1w * e + N * e + snapshot);
      } else {
        add(mlp + ".experts.activation_func", act_bytes(N) + N * e);
        add(mlp + ".experts.linear_fc2", N * fm * e);
      }
      return;
    }
    // SequentialMLP: the experts' inputs and probabilities are views of the permuted tensors,
    // counted where expert 0 first saves them; the rest is per expert, which takes the routing.
    const std::vector<int64_t>* counts = lr != nullptr ? &lr->expert_rows : nullptr;
    if (counts == nullptr) {
      add(mlp + ".experts.local_experts", N * h * e + act_bytes(N) + N * e + N * fm * e);
      return;
    }
    for (size_t j = 0; j < counts->size(); ++j) {
      const std::string ex = mlp + ".experts.local_experts." + std::to_string(j);
      const int64_t n = (*counts)[j];
      add(ex + ".linear_fc1", j == 0 ? N * h * e : 0);
      add(ex + ".activation_func", act_bytes(n) + (j == 0 ? N * e : 0));
      add(ex + ".linear_fc2", n * fm * e);
    }
  };
  // Note [What MLA saves]; tensor parallelism is refused with MLA, so every size is the full one.
  auto add_mla_attention = [&](const std::string& attn, const LayerPlan& lp, int64_t norm_out,
                               int64_t scores) {
    // Per rank (Note [MLA under tensor parallelism] in attention.cpp): the latents are
    // replicated over this rank's tokens Tr (s/t of them with sequence parallelism), the per-head
    // tensors cover the whole sequence T for the rank's a/t heads.
    const int64_t T = s * b, Tr = sb, dq = c.mla_q_head_dim(), dv = c.v_head_dim;
    const int64_t rkv = c.kv_lora_rank, dr = c.qk_pos_emb_head_dim;
    const int64_t heads = c.num_attention_heads / t;
    // The down projections' input (the input norm's output), counted where it is first saved.
    add(attn + (c.q_lora_rank ? ".linear_q_down_proj" : ".linear_kv_down_proj"), norm_out);
    int64_t q_in = 0;  // the query up-projection's input, when it is not the norm output
    if (c.q_lora_rank) {
      const int64_t rq = *c.q_lora_rank;
      if (c.qk_layernorm) add(attn + ".q_layernorm", Tr * rq * e + norm_stats + rq * gamma1p);
      q_in = Tr * rq * e;  // the latent (or its normed copy)
    }
    // Without kv_layernorm the up-projection reads a view of the whole down-projection output
    // [Tr, kv_lora_rank + pos], which then stays.
    int64_t kv_in = Tr * (rkv + dr) * e;
    if (c.qk_layernorm) {
      add(attn + ".kv_layernorm", kv_in + norm_stats + rkv * gamma1p);
      kv_in = Tr * rkv * e;
    }
    const std::string q_up = attn + (c.q_lora_rank ? ".linear_q_up_proj" : ".linear_q_proj");
    if (lp.recomputes(RecomputeModule::kMlaUpProj)) {
      // The checkpoint's inputs; under sequence parallelism k_pos is the gathered copy [T, pos].
      add(q_up, q_in + kv_in + (sp && t > 1 ? T * dr * e : 0) + snapshot);
    } else {
      add(q_up, q_in);
      add(attn + ".linear_kv_up_proj", kv_in);
    }
    // q, k, v after RoPE (freed by mla_up_proj recompute); the scores' tensors.
    add(attn + ".core_attention",
        (lp.recomputes(RecomputeModule::kMlaUpProj) ? 0 : T * heads * (2 * dq + dv) * e) + scores);
    add(attn + ".linear_proj", T * heads * dv * e);
  };
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
  auto add_gdn_attention = [&](const std::string& attn, const LayerPlan& lp, int64_t norm_out) {
    const int64_t T = s * b, Hk = c.linear_num_key_heads / t, Hv = c.linear_num_value_heads / t;
    const int64_t dk = c.linear_key_head_dim, dvh = c.linear_value_head_dim;
    const int64_t qk = Hk * dk, vd = Hv * dvh, C = 2 * qk + vd, K = c.linear_conv_kernel_dim;
    add(attn + ".in_proj", norm_out);
    add(attn + ".conv1d", T * C * e + b * C * (s + K - 1) * e);
    add(attn + ".prepare_input_for_gated_delta_rule",
        T * 2 * qk * e + T * 2 * Hk * up + 2 * T * Hv * up + 2 * Hv * e + T * Hv * e);
    add(attn + ".gated_delta_rule", (Hv > Hk ? 2 * T * Hv * dk * e : 0) + T * vd * e + T * Hv * up);
    if (lp.recomputes(RecomputeModule::kGdnNormOut)) {
      add(attn + ".out_norm", 2 * T * vd * e + snapshot);
      return;
    }
    const int64_t rows = T * Hv;
    const int64_t stats = norm_statistics_bytes(c, rows, up, ln_stat);
    add(attn + ".out_norm", 2 * T * vd * e + 2 * T * vd * up + stats + dvh * gamma1p);
    add(attn + ".out_proj", T * vd * e);
  };
  if (first_stage) add("embedding", hidden_drop ? sbh : 0);
  size_t moe_layers_before = 0;  // MoE layers before layer i, chunked or not
  for (int64_t i = stage.offset; i < stage.offset + stage.count; ++i) {
    const LayerPlan& lp = plan.layers[static_cast<size_t>(i)];
    const std::string layer = "decoder.layers." + std::to_string(i);
    const size_t moe_index = moe_layers_before;  // this layer's index in the routing
    if (lp.moe) ++moe_layers_before;
    if (lp.in_chunk()) {
      // Only the chunk's input (and its snapshot) is kept, attributed to the chunk's first layer.
      // With distribute_saved_activations it is this rank's 1/t chunk.
      if (lp.starts_chunk) {
        add(layer, (plan.distribute_saved_activations ? sbh_full / t : sbh) * e + snapshot);
      }
      continue;
    }
    // A norm keeps its input (the residual stream) either way; output-discarding recompute keeps
    // it through the checkpoint with a snapshot, instead of the norm statistics.
    const bool sel_norm = lp.recomputes(RecomputeModule::kLayernorm);
    const int64_t norm = sel_norm ? sbh * e + snapshot : sbh * e + norm_stats + h * gamma1p;
    const int64_t norm_out = sel_norm ? 0 : sbh * e;  // freed after its consumer saved it
    add(layer + ".input_layernorm", norm);
    const bool recompute_attn = lp.recomputes(RecomputeModule::kCoreAttn);
    const int64_t scores = recompute_attn ? snapshot
                           : flash        ? flash_output_and_logsumexp_bytes(c, e)
                                          : as2b * e + (attn_drop ? as2b + as2b * e : 0);
    if (lp.gdn) {
      add_gdn_attention(layer + ".self_attention", lp, norm_out);
    } else if (c.multi_latent_attention) {
      add_mla_attention(layer + ".self_attention", lp, norm_out, scores);
    } else {
      // Note [What standard attention keeps].
      const StandardAttentionBytes sa = standard_attention_bytes(c, lp, e, cpu);
      add(layer + ".self_attention.linear_qkv", norm_out);
      add(layer + ".self_attention.q_layernorm", sa.q_layernorm);
      add(layer + ".self_attention.k_layernorm", sa.k_layernorm);
      add(layer + ".self_attention.core_attention", sa.core_qkv + scores);
      add(layer + ".self_attention.output_gate", sa.output_gate);
      add(layer + ".self_attention.linear_proj", sa.linear_proj);
    }
    add(layer + ".self_attn_bda", hidden_drop ? sbh : 0);
    add(layer + ".pre_mlp_layernorm", norm);
    if (lp.moe) {
      add_moe_layer(layer + ".mlp", lp, norm_out, moe_index);
    } else if (lp.recomputes(RecomputeModule::kMlp)) {
      // The MLP checkpoint keeps its input (the norm output) and a snapshot.
      add(layer + ".mlp", (sel_norm ? 0 : sbh * e) + snapshot);
    } else {
      add(layer + ".mlp.linear_fc1", norm_out);
      add(layer + ".mlp.activation_func", c.gated_linear_unit ? 3 * sbf * e : sbf * e);
      add(layer + ".mlp.linear_fc2", sbf * e);
    }
    add(layer + ".mlp_bda", hidden_drop ? sbh : 0);
  }
  if (!last_stage) return p;
  add("decoder.final_layernorm", sbh * e + norm_stats + h * gamma1p);
  add("output_layer", sbh_full * e);  // the gathered [s, b, h] input of the replicated layer
  // The targets are labels.t() flattened: a copy, unless the transpose is already contiguous.
  // At 16 bits the loss runs on the upcast logits: fp32 log-softmax output and total weight.
  add("loss", s * b * v * up + (b > 1 && s > 1 ? 8 * s * b : 0) + up);
  add("loss value", up);
  return p;
}

// Note [Memory pre-check]
// The Trainer refuses a configuration whose step cannot fit before it allocates anything, so the
// bound must cover the whole peak of a step, for every strategy:
// - parameters, gradients and both AdamW moments (4 x parameters), plus the optimizer step's
//   temporaries (at most two of the largest parameter);
// - the activations the plain forward leaves for the backward (the exact predictor,
//   memory_model.h, for the config without recompute or offload: every strategy leaves less,
//   and a recomputed chunk is rebuilt from what the plain run would have kept);
// - the backward's transients on top of them: the gradient flowing through the op being
//   differentiated, its result and one temporary, each at most the largest single tensor of
//   the step (the logits [s, b, v], the scores [a/t, s, s, b], the MLP's [s, b, fc1/t]).
// Checked against the tracker's measured peak over a sweep of models and strategies
// (MemoryPreCheck.CountsEverythingTheRunAllocates in tests/test_robustness.cpp). The Trainer
// refuses a configuration above its device-memory limit before it allocates anything.
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
  TORCH_CHECK(microbatches_in_flight >= 1, "actmem::predict_step_peak_bound: at least one "
              "micro-batch in flight, got ", microbatches_in_flight);
  return predict_step_peak_bound(c, dtype_bytes, pipeline_stage, {microbatches_in_flight}, 2,
                                 optimizer_shards);
}

double predict_step_peak_bound(const TransformerConfig& c, int64_t dtype_bytes,
                               int64_t pipeline_stage,
                               const std::vector<int64_t>& in_flight_per_chunk,
                               int64_t boundary_tensors, int64_t optimizer_shards) {
  TORCH_CHECK(optimizer_shards >= 1, "actmem::predict_step_peak_bound: optimizer_shards must be "
              "at least 1, got ", optimizer_shards);
  TORCH_CHECK(static_cast<int64_t>(in_flight_per_chunk.size()) == c.virtual_pipeline_size(),
              "actmem::predict_step_peak_bound: one in-flight count per model chunk (",
              c.virtual_pipeline_size(), "), got ", in_flight_per_chunk.size());
  std::vector<TransformerConfig::StageLayers> chunks;
  int64_t layers = 0;
  for (int64_t k = 0; k < c.virtual_pipeline_size(); ++k) {
    chunks.push_back(c.model_chunk_layers(pipeline_stage, k));
    layers += chunks.back().count;
  }
  const bool first_stage = pipeline_stage == 0;
  const bool last_stage = pipeline_stage == c.pipeline_model_parallel_size - 1;
  const double h = static_cast<double>(c.hidden_size), f = static_cast<double>(c.ffn());
  const double L = static_cast<double>(layers), v = static_cast<double>(c.vocab_size);
  const double s = static_cast<double>(c.seq_length), b = static_cast<double>(c.micro_batch_size);
  const double a = static_cast<double>(c.num_attention_heads);
  const double fc1 = c.gated_linear_unit ? 2.0 * f : f;
  const double t = static_cast<double>(c.tensor_model_parallel_size);
  if (dtype_bytes == 0) dtype_bytes = c.element_bytes();
  const double e = static_cast<double>(dtype_bytes);
  // Per parameter: fp32 (or double) training keeps parameter, gradient and both AdamW moments
  // (4e). 16-bit training keeps the 16-bit parameter, fp32 main grad, main parameter and moments
  // (Megatron's 18 bytes) and, transiently, a 16-bit gradient before its hook adds it into the
  // main grad (2 more). The distributed optimizer keeps 1/d of the moments and main parameters,
  // and a rank's piece may hold more than 1/d of the real elements by the buffer's padding
  // (distributed_optimizer.h): under 64 elements per parameter tensor (at most 16 per layer
  // and 4 per routed expert; 8 outside the layers) and lcm(d, 128) per bucket (one per tensor at
  // most).
  const double d = static_cast<double>(optimizer_shards);
  const double state_bytes = e == 2.0 ? 12.0 : 2.0 * e;  // per element: moments (+ main param)
  const double per_param = e == 2.0 ? 8.0 + 12.0 / d : 2.0 * e + 2.0 * e / d;
  const double tensors =
      L * (16.0 + (c.is_moe() ? 4.0 * static_cast<double>(c.num_moe_experts) : 0.0)) + 8.0;
  const double padding =
      optimizer_shards > 1
          ? tensors * (64.0 + static_cast<double>(std::lcm(optimizer_shards, int64_t{128}))) *
                state_bytes
          : 0.0;
  // Per rank: the linear layers are split t ways, norms, embedding and output layer replicated.
  // Replicated per layer: two norms (weight and bias, 4h) and the row-parallel biases (2h); the
  // final norm (2h); the word embedding and an untied output layer (2vh, an upper bound).
  // Attention weights per layer: linear_qkv and linear_proj (4h^2), or MLA's projections.
  // Standard attention: linear_qkv h x (a (1 + gate) + 2G) d, linear_proj a d x h, the q/k norms.
  const double ad = static_cast<double>(c.query_projection_size());
  const double qkv_width = static_cast<double>(
      (c.num_attention_heads * (c.attention_output_gate ? 2 : 1) + 2 * c.query_groups()) *
      c.kv_channels());
  double attention = std::max(4.0 * h * h, h * qkv_width + ad * h + 4.0 * c.kv_channels());
  if (c.multi_latent_attention) {
    const double a_ = a, dq = static_cast<double>(c.mla_q_head_dim());
    const double dv = static_cast<double>(c.v_head_dim), rkv = static_cast<double>(c.kv_lora_rank);
    const double pos = static_cast<double>(c.qk_pos_emb_head_dim);
    const double q = c.q_lora_rank ? static_cast<double>(*c.q_lora_rank) * (h + a_ * dq + 2.0)
                                   : h * a_ * dq;
    attention = q + h * (rkv + pos) + rkv * a_ * (c.qk_head_dim + dv) + 2.0 * rkv + a_ * dv * h;
  }
  // A hybrid's GatedDeltaNet layers (docs/gdn.md): in_proj, conv1d, A_log, dt_bias, out_norm,
  // out_proj; every layer is counted at the larger of the two kinds (an upper bound).
  double gdn_in = 0.0, gdn_conv = 0.0;  // in_proj's output and conv1d's input widths (full)
  if (c.gated_delta_net()) {
    const double qk = static_cast<double>(c.linear_num_key_heads * c.linear_key_head_dim);
    const double vd = static_cast<double>(c.linear_num_value_heads * c.linear_value_head_dim);
    const double hv = static_cast<double>(c.linear_num_value_heads);
    const double dv = static_cast<double>(c.linear_value_head_dim);
    const double K = static_cast<double>(c.linear_conv_kernel_dim);
    gdn_in = 2.0 * qk + 2.0 * vd + 2.0 * hv;
    gdn_conv = 2.0 * qk + vd;
    attention = std::max(attention, h * gdn_in + gdn_conv * K + 2.0 * hv + 2.0 * dv + vd * h);
  }
  const double params = L * ((attention + h * fc1 + f * h + fc1 + 3.0 * h) / t + 6.0 * h) +
                        (first_stage ? v * h + static_cast<double>(c.max_positions()) * h : 0.0) +
                        (last_stage ? v * h + 2.0 * h : 0.0);
  double largest_param = std::max(first_stage || last_stage ? v * h : 0.0, h * fc1 / t) * e;
  double largest_tensor =
      std::max({last_stage ? s * b * v : 0.0, a * s * s * b / t, s * b * fc1 / t, s * b * h,
                s * b * qkv_width / t,
                // the output gate's fp32 sigmoid at 16 bits
                s * b * ad / t * (c.attention_output_gate && e == 2.0 ? 2.0 : 1.0)}) *
      e;
  if (c.gated_delta_net()) {  // in_proj's output [s, b, P/t], the convolution's [b, C/t, s + K - 1]
    largest_tensor =
        std::max({largest_tensor, s * b * gdn_in / t * e,
                  b * gdn_conv / t * (s + static_cast<double>(c.linear_conv_kernel_dim)) * e});
  }
  if (c.multi_latent_attention) {  // the kv up-projection's output [s, b, a (qk + v)] is widest
    const double widest = static_cast<double>(std::max(c.mla_q_head_dim(), c.qk_head_dim + c.v_head_dim));
    largest_tensor = std::max(largest_tensor, s * b * a * widest * e);
  }
  // MoE layers: their router, experts and shared experts on top of the dense MLP counted above
  // (an upper bound), and the experts' [N, fc1] rows at the most the routing can give them.
  MoERouting worst;
  double moe_params = 0.0;
  if (c.is_moe()) {
    const int64_t T = c.seq_length * c.micro_batch_size, E = c.num_moe_experts;
    const int64_t rows = moe_max_expert_rows(c);
    const double fm = static_cast<double>(c.moe_ffn()), fc1m = c.gated_linear_unit ? 2.0 * fm : fm;
    const double Ed = static_cast<double>(E);
    double per_layer = Ed * h + Ed + Ed * (h * fc1m + fc1m + fm * h + h);
    if (c.moe_shared_expert_intermediate_size) {
      const double fs = static_cast<double>(*c.moe_shared_expert_intermediate_size);
      per_layer += h * (c.gated_linear_unit ? 2.0 * fs : fs) + fs * h + h;
    }
    const std::vector<bool> moe = c.moe_layers();
    for (const auto& stage : chunks) {
      for (int64_t i = stage.offset; i < stage.offset + stage.count; ++i) {
        if (!moe[static_cast<size_t>(i)]) continue;
        moe_params += per_layer;
        worst.emplace_back(std::vector<int64_t>{rows}, moe_max_routed_rows(c));
      }
    }
    largest_param = std::max(largest_param, h * fc1m * e);
    largest_tensor = std::max({largest_tensor, static_cast<double>(rows) * std::max(fc1m, h) * e,
                               static_cast<double>(T) * Ed * 4.0});
  }
  // Sizes whose exact count would not fit the predictor's 64-bit integers cannot fit a device.
  if (largest_tensor * static_cast<double>(c.num_layers) * 64.0 > 0x1p62) {
    return std::numeric_limits<double>::infinity();
  }
  ActivationPlan keep_all = make_activation_plan(c);
  keep_all.granularity = RecomputeGranularity::kNone;
  keep_all.distribute_saved_activations = false;
  keep_all.chunks.clear();
  for (LayerPlan& lp : keep_all.layers) {
    const bool moe = lp.moe, gdn = lp.gdn;
    lp = LayerPlan{};
    lp.moe = moe;  // the layer's kinds stay: an MoE layer keeps what an MoE layer keeps
    lp.gdn = gdn;
  }
  // What crosses a stage boundary: [s, b, h] ([s/t, b, h] with sequence parallelism).
  const double boundary =
      c.pipeline_model_parallel_size > 1 ? s * b * h * e / (c.sequence_parallel ? t : 1.0) : 0.0;
  double activations = static_cast<double>(boundary_tensors) * boundary;
  for (int64_t k = 0; k < c.virtual_pipeline_size(); ++k) {
    activations += static_cast<double>(predict_activation_bytes(c, keep_all, dtype_bytes, true,
                                                                &worst, pipeline_stage, k)
                                           .total) *
                   static_cast<double>(in_flight_per_chunk[static_cast<size_t>(k)]);
  }
  // The logits' fp32 copy and its log-softmax at 16 bits are counted by the predictor (the
  // kept output) and by largest_tensor (the transient), at twice the 16-bit size.
  const double upcast = e == 2.0 ? 2.0 : 1.0;
  // A GatedDeltaNet layer's backward runs the chunked rule again under autograd (Note [One node
  // for the gated delta rule]): for the duration of one layer's backward its chunk
  // intermediates and their gradients exist, per (batch row, value head) and padded token at most
  // ~12 dk + 8 dv + 6 C + 8 compute-type elements each (the prepared inputs, the decay, system,
  // solution and within-chunk matrices, the chunk outputs and states), twice over.
  double gdn_backward = 0.0;
  if (c.gated_delta_net()) {
    const double C = 64.0, spad = std::ceil(s / C) * C, u = e == 2.0 ? 4.0 : e;
    const double dk = static_cast<double>(c.linear_key_head_dim);
    const double dv = static_cast<double>(c.linear_value_head_dim);
    const double hv = static_cast<double>(c.linear_num_value_heads) / t;
    gdn_backward = 2.0 * b * hv *
                   (spad * (12.0 * dk + 8.0 * dv + 6.0 * C + 8.0) + spad / C * 2.0 * dk * dv) * u;
  }
  return per_param * (params + moe_params) + padding + 2.0 * largest_param * upcast + activations +
         3.0 * largest_tensor * upcast + gdn_backward;
}

}  // namespace actmem
