// memory_model.cpp — the paper's formulas and Megatron's theoretical terms (memory_model.h).
#include "actmem/memory/memory_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace actmem {

double paper_squared_term(const PaperShape& m) {
  return m.flash ? 4.0 * m.a / m.h : 5.0 * m.a * m.s / m.h;
}

namespace {

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
  TORCH_CHECK(c.fp8.empty() && c.fp4.empty(),
              "actmem: the paper's formulas (estimate, plan --preset) have no FP8/FP4 terms yet; "
              "train and inspect measure an FP8 run and predict it to the byte (docs/fp8.md)");
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
  const double sq = paper_squared_term(m);
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
    const double q =
        x.q_lora > 0 ? x.q_lora * (h + m.a * (x.qk + x.pos) + norm) : h * m.a * (x.qk + x.pos);
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
  const double tp_sharded =
      (attention + dense_mlp) * dense_layers + (attention + shared) * moe_layers;
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
  w.optimizer_bytes =
      optimizer(m.d) * dense_on_rank + optimizer(expert_dp) * w.expert_parameters_on_rank;
  w.bytes_per_parameter = w.total() / w.parameters_on_rank;
  return w;
}

double offload_round_trip_seconds(double bytes, double gbps) {
  TORCH_CHECK(gbps > 0, "actmem::offload_round_trip_seconds: bandwidth must be positive, got ",
              gbps);
  return 2.0 * bytes / (gbps * 1e9);
}

}  // namespace actmem
