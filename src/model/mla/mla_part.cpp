// mla_part.cpp — the contract of the mixer part "mla" (mla.h): multi-latent attention. What it
// saves for the backward (Note [What MLA saves]), its parameters, FLOPs and the memory
// pre-check's terms.
#include "actmem/model/mla/mla.h"

#include "actmem/base/report.h"
#include "actmem/model/part_estimate.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <iomanip>
#include <sstream>

namespace actmem {

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
MLAAttentionBytes paper_mla_attention_bytes(const PaperShape& m) {
  const MLAPaperShape& x = m.mla;
  TORCH_CHECK(x.kv_lora > 0 && x.qk > 0 && x.pos > 0 && x.v > 0 && x.q_lora >= 0,
              "actmem::paper_mla_attention_bytes: needs kv_lora, qk, pos, v > 0 and q_lora >= 0");
  const double sb = m.s * m.b, t = m.t, rep = m.sp ? t : 1.0, a = m.a;
  MLAAttentionBytes r;
  double latents = 2 * sb * m.h;
  if (x.q_lora > 0)
    latents += 2 * sb * x.q_lora + (x.qk_layernorm ? 2 * sb * x.q_lora + 4 * sb : 0);
  latents += 2 * sb * (x.kv_lora + x.pos) + (x.qk_layernorm ? 2 * sb * x.kv_lora + 4 * sb : 0);
  r.latents = latents / rep;
  r.qkv = 2 * sb * a * (2 * (x.qk + x.pos) + x.v) / t;
  r.scores = 5 * a * m.s * m.s * m.b / t;
  r.context = 2 * sb * a * x.v / t;
  return r;
}

namespace {
class MlaPart final : public LayerPart {
 public:
  const char* name() const override { return "mla"; }
  PartSlot slot() const override { return PartSlot::kMixer; }
  std::shared_ptr<PartModule> build(const TransformerConfig& config, const LayerPlan& plan, int64_t,
                                    at::ScalarType dtype) const override {
    return std::make_shared<MLASelfAttention>(config, plan, dtype);
  }
  /// MLA rotates its own decoupled part (Note [MLA's RoPE] in mla.cpp); Megatron's GPTModel
  /// builds no model-level RoPE for it.
  std::unique_ptr<RotaryEmbedding> rotary_tables(const TransformerConfig& config,
                                                 at::ScalarType dtype) const override {
    return std::make_unique<RotaryEmbedding>(RotaryEmbedding::for_mla(config, dtype));
  }
  /// The up-projected keys (qk_head_dim + qk_pos_emb_head_dim) and values (v_head_dim) of every
  /// head (KVCacheState).
  int64_t decode_state_bytes(const TransformerConfig& c, int64_t capacity,
                             int64_t element_bytes) const override {
    return capacity * c.num_attention_heads * (c.mla_q_head_dim() + c.v_head_dim) * element_bytes;
  }

  void saved_bytes(const SavedBytesContext& ctx) const override {
    // Per rank (Note [MLA under tensor parallelism] in mla.cpp): the latents are replicated over
    // this rank's tokens Tr (s/t of them with sequence parallelism), the per-head tensors cover
    // the whole sequence T for the rank's a/t heads.
    const TransformerConfig& c = ctx.config;
    const int64_t e = ctx.e, t = c.tensor_model_parallel_size;
    const int64_t T = c.seq_length * c.micro_batch_size, Tr = ctx.tokens;
    const int64_t dq = c.mla_q_head_dim(), dv = c.v_head_dim;
    const int64_t rkv = c.kv_lora_rank, dr = c.qk_pos_emb_head_dim;
    const int64_t heads = c.num_attention_heads / t;
    const int64_t norm_stats = ctx.norm_statistics(Tr);
    // The down projections' input (the input norm's output), counted where it is first saved.
    ctx.add(c.q_lora_rank ? "linear_q_down_proj" : "linear_kv_down_proj", ctx.input);
    int64_t q_in = 0;  // the query up-projection's input, when it is not the norm output
    if (c.q_lora_rank) {
      const int64_t rq = *c.q_lora_rank;
      if (c.qk_layernorm) ctx.add("q_layernorm", Tr * rq * e + norm_stats + ctx.norm_scale(rq));
      q_in = Tr * rq * e;  // the latent (or its normed copy)
    }
    // Without kv_layernorm the up-projection reads a view of the whole down-projection output
    // [Tr, kv_lora_rank + pos], which then stays.
    int64_t kv_in = Tr * (rkv + dr) * e;
    if (c.qk_layernorm) {
      ctx.add("kv_layernorm", kv_in + norm_stats + ctx.norm_scale(rkv));
      kv_in = Tr * rkv * e;
    }
    const std::string q_up = c.q_lora_rank ? "linear_q_up_proj" : "linear_q_proj";
    const bool recompute_up = ctx.plan.recomputes(RecomputeModule::kMlaUpProj);
    if (recompute_up) {
      // The checkpoint's inputs; under sequence parallelism k_pos is the gathered copy [T, pos].
      ctx.add(q_up, q_in + kv_in + (c.sequence_parallel && t > 1 ? T * dr * e : 0) + ctx.snapshot);
    } else {
      ctx.add(q_up, q_in);
      ctx.add("linear_kv_up_proj", kv_in);
    }
    // q, k, v after RoPE (freed by mla_up_proj recompute); the scores' tensors.
    ctx.add("core_attention",
            (recompute_up ? 0 : T * heads * (2 * dq + dv) * e) + core_attention_scores_bytes(ctx));
    ctx.add("linear_proj", T * heads * dv * e);
  }
  bool paper_describes(const TransformerConfig&) const override { return true; }
  PartParameters parameters(const TransformerConfig& c) const override {
    // The up projections and linear_proj split over the tensor ranks (their heads), the down
    // projections and the latent norms replicated (Note [MLA under tensor parallelism]).
    const int64_t h = c.hidden_size, a = c.num_attention_heads, bias = c.add_bias_linear ? 1 : 0;
    const int64_t norm = c.use_rmsnorm() ? 1 : 2, dq = c.mla_q_head_dim();
    const int64_t rkv = c.kv_lora_rank;
    PartParameters p;
    p.sharded = (c.q_lora_rank ? *c.q_lora_rank : h) * a * dq +
                rkv * a * (c.qk_head_dim + c.v_head_dim) + a * c.v_head_dim * h;
    p.replicated =
        (c.q_lora_rank ? h * *c.q_lora_rank : 0) + h * (rkv + c.qk_pos_emb_head_dim) + bias * h;
    if (c.qk_layernorm) p.replicated += (c.q_lora_rank ? *c.q_lora_rank * norm : 0) + rkv * norm;
    return p;
  }
  PartFlops megatron_flops(const TransformerConfig& c) const override {
    // transformer_flops' multi-latent attention terms.
    const double E = 3.0, F = 2.0, h = static_cast<double>(c.hidden_size);
    const double heads = static_cast<double>(c.num_attention_heads);
    const double qk = static_cast<double>(c.qk_head_dim),
                 pos = static_cast<double>(c.qk_pos_emb_head_dim);
    const double v = static_cast<double>(c.v_head_dim),
                 kv_lora = static_cast<double>(c.kv_lora_rank);
    const double q_term = c.q_lora_rank
                              ? static_cast<double>(*c.q_lora_rank) * (h + heads * (qk + pos) + 1.0)
                              : h * heads * (qk + pos);
    PartFlops f;
    f.per_token =
        E * F * (q_term + kv_lora * (h + heads * (qk + v) + 1.0) + h * pos + heads * v * h);
    f.per_token_position = E * F * (heads * (qk + pos) / 2.0 + heads * v / 2.0);
    return f;
  }
  PeakTerms peak_terms(const TransformerConfig& c, double e) const override {
    // Its projections (Megatron's counting, all split t ways as an upper bound) with the
    // column-parallel biases (3h); the kv up-projection's output [s, b, a (qk + v)] or the
    // queries, and the scores [a/t, s, s, b].
    const double h = static_cast<double>(c.hidden_size),
                 a = static_cast<double>(c.num_attention_heads);
    const double t = static_cast<double>(c.tensor_model_parallel_size);
    const double s = static_cast<double>(c.seq_length), b = static_cast<double>(c.micro_batch_size);
    const double dq = static_cast<double>(c.mla_q_head_dim()),
                 dv = static_cast<double>(c.v_head_dim);
    const double rkv = static_cast<double>(c.kv_lora_rank),
                 pos = static_cast<double>(c.qk_pos_emb_head_dim);
    const double q =
        c.q_lora_rank ? static_cast<double>(*c.q_lora_rank) * (h + a * dq + 2.0) : h * a * dq;
    PeakTerms p;
    p.parameters = (q + h * (rkv + pos) + rkv * a * (static_cast<double>(c.qk_head_dim) + dv) +
                    2.0 * rkv + a * dv * h + 3.0 * h) /
                   t;
    const double widest =
        static_cast<double>(std::max(c.mla_q_head_dim(), c.qk_head_dim + c.v_head_dim));
    p.largest_tensor = std::max(s * b * a * widest, a * s * s * b / t) * e;
    return p;
  }
  // Note [Analytic MLA]
  // The terms of paper_mla_attention_bytes() split as the modules save them: the down
  // projections' input is the input norm's output (layernorm drops it, qkv_linear moves it), the
  // latents beyond it stay under every selective set, mla_up_proj drops q, k, v (which the
  // core_attn group moves with the scores), linear_proj keeps the context (attn_proj). Its
  // forward: the down projections on every tensor-parallel rank (the duplicated linears, over
  // the sequence shard with SP), the up projections and heads split t ways, heads of
  // dq = qk + pos for q and k; the latent norms read and write their latents.
  AnalyticTerms analytic_terms(const PaperShape& m) const override {
    const MLAAttentionBytes mla = paper_mla_attention_bytes(m);
    const double sb = m.s * m.b, sbh = m.sbh(), t = m.t, r = m.sp ? m.t : 1.0, h = m.h;
    const MLAPaperShape& x = m.mla;
    AnalyticTerms a;
    const double input = 2 * sbh / r;
    a.tensors = {{input, {RecomputeModule::kLayernorm}, OffloadModule::kQkvLinear},
                 {mla.latents - input, {}, std::nullopt},
                 {mla.qkv, {RecomputeModule::kMlaUpProj}, OffloadModule::kCoreAttn},
                 {m.flash ? 4 * m.a * sb / t : mla.scores,
                  {RecomputeModule::kCoreAttn},
                  OffloadModule::kCoreAttn},
                 {mla.context, {}, OffloadModule::kAttnProj}};
    const double dq = x.qk + x.pos;
    const double down = 2 * sb * h * (x.q_lora + x.kv_lora + x.pos) / r;
    const double q_proj = x.q_lora > 0 ? 0.0 : 2 * sb * h * m.a * dq / t;
    const double up = ((x.q_lora > 0 ? 2 * sb * x.q_lora * m.a * dq : 0.0) +
                       2 * sb * x.kv_lora * m.a * (x.qk + x.v)) /
                      t;
    const double qk = 2 * m.b * m.s * m.s * m.a * dq / t;
    const double scores = qk + 2 * m.b * m.s * m.s * m.a * x.v / t;
    const double proj = 2 * sb * m.a * x.v * h / t;
    const double latent_norms =
        x.qk_layernorm ? 2 * (2 * sb * x.q_lora + 2 * sb * x.kv_lora) / r : 0.0;
    const double softmax_dropout = m.flash ? 0.0 : 9 * m.a * m.s * sb / t;
    a.work = {{down + q_proj + proj, latent_norms, {}},
              {up, 0.0, {RecomputeModule::kMlaUpProj}},
              {scores, softmax_dropout, {RecomputeModule::kCoreAttn}}};
    a.backward_extra_flops = m.flash ? qk : 0.0;
    return a;
  }
  /// Megatron's qkv_linear group spans the down and up projections and the latent norms.
  std::optional<OffloadModule> offload_group(const std::string& module) const override {
    if (module == "core_attention") return OffloadModule::kCoreAttn;
    if (module == "linear_proj") return OffloadModule::kAttnProj;
    if (module == "rotary_pos_emb") return std::nullopt;
    return OffloadModule::kQkvLinear;
  }
  // MLA replaces the paper's attention terms (q, k, v inputs and outputs, the scores, the
  // context: (10 sbh + 5as^2b)/t without recompute, 10 sbh/t with selective core_attn; without
  // sequence parallelism the qkv input's 2 sbh is replicated) by its own.
  LayerBytes paper_layer_bytes(const PaperShape& m, const LayerBytes& layer) const override {
    const MLAAttentionBytes mla = paper_mla_attention_bytes(m);
    const double sq = 5.0 * m.a * m.s * m.s * m.b / m.t;
    const double lin =
        m.sp || m.t == 1.0 ? 10.0 * m.sbh() / m.t : 2.0 * m.sbh() + 8.0 * m.sbh() / m.t;
    LayerBytes l = layer;
    l.none += mla.none() - (lin + sq);
    l.selective += mla.kept(true, false) - lin;
    l.s2_fraction = mla.scores / l.none;
    return l;
  }
  void paper_estimate(const PartEstimateContext& ctx, PartEstimate& out) const override {
    const PaperShape& m = ctx.m;
    const MLAAttentionBytes mla = paper_mla_attention_bytes(m);
    out.json = {
        {"q_lora_rank", m.mla.q_lora > 0 ? nlohmann::json(m.mla.q_lora) : nlohmann::json(nullptr)},
        {"kv_lora_rank", m.mla.kv_lora},
        {"qk_head_dim", m.mla.qk},
        {"qk_pos_emb_head_dim", m.mla.pos},
        {"v_head_dim", m.mla.v},
        {"qk_layernorm", m.mla.qk_layernorm},
        {"terms",
         {{"latents", mla.latents},
          {"qkv", mla.qkv},
          {"scores", mla.scores},
          {"context", mla.context}}},
        {"attention_bytes",
         {{"none", mla.none()},
          {"core_attn", mla.kept(true, false)},
          {"mla_up_proj", mla.kept(false, true)},
          {"core_attn_mla_up_proj", mla.kept(true, true)}}}};
    std::ostringstream os;
    os << "\nmulti-latent attention: q_lora_rank "
       << (m.mla.q_lora > 0 ? c10::str(static_cast<int64_t>(m.mla.q_lora)) : std::string("none"))
       << ", kv_lora_rank " << static_cast<int64_t>(m.mla.kv_lora) << ", head dims qk "
       << static_cast<int64_t>(m.mla.qk) << " + rope " << static_cast<int64_t>(m.mla.pos) << ", v "
       << static_cast<int64_t>(m.mla.v) << (m.mla.qk_layernorm ? ", latent norms" : "")
       << "\n  attention per layer: none " << format_bytes_3sig(mla.none()) << ", core_attn "
       << format_bytes_3sig(mla.kept(true, false)) << ", mla_up_proj "
       << format_bytes_3sig(mla.kept(false, true)) << ", both "
       << format_bytes_3sig(mla.kept(true, true)) << "\n  of which latents "
       << format_bytes_3sig(mla.latents) << ", q/k/v after RoPE " << format_bytes_3sig(mla.qkv)
       << ", scores " << format_bytes_3sig(mla.scores) << ", context "
       << format_bytes_3sig(mla.context)
       << "\n  the per-layer figures above use these attention terms\n";
    out.section = os.str();
  }
  std::vector<RecomputeModule> estimate_units(const TransformerConfig&) const override {
    return {RecomputeModule::kCoreAttn, RecomputeModule::kMlaUpProj};
  }
  std::string summary(const TransformerConfig& c, int64_t) const override {
    return "multi-latent attention (query rank " + std::to_string(c.q_lora_rank.value_or(0)) +
           ", key/value rank " + std::to_string(c.kv_lora_rank) + ")";
  }
};
}  // namespace

const LayerPart& mla_part() {
  static const MlaPart part;
  return part;
}

}  // namespace actmem
