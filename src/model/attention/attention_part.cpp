// attention_part.cpp — the contract of the mixer part "attention" (attention.h): standard and
// grouped-query attention with Qwen3-Next's output gate and q/k norms. What it saves for the
// backward (Note [What standard attention keeps]), Korthikanti's terms for its modules, its
// parameters, FLOPs and the memory pre-check's terms.
#include "actmem/model/attention/attention.h"

#include "actmem/model/activation_bytes.h"

#include <algorithm>
#include <string>
#include <vector>

namespace actmem {

namespace {
// Per module, what a standard attention layer keeps (Note [What standard attention keeps]).
struct StandardAttentionBytes {
  int64_t q_layernorm = 0, k_layernorm = 0, core_qkv = 0, output_gate = 0, linear_proj = 0;
};

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
    x.q_layernorm += (c.use_rmsnorm() ? H * T * up : 2 * H * T * ln_stat) + scale;
    save(x.k_layernorm, "qkv", qkv_bytes);
    x.k_layernorm += (c.use_rmsnorm() ? G * T * up : 2 * G * T * ln_stat) + scale;
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

// What the flash kernel keeps beyond q, k and v, per rank: its output [b, a/t, s, d] (which
// linear_proj's input is a view of) and the logsumexp [b, a/t, s] in fp32 (the dtype at 64 bits).
int64_t flash_output_and_logsumexp_bytes(const TransformerConfig& c, int64_t e) {
  const int64_t t = c.tensor_model_parallel_size;
  const int64_t sbh_t = c.seq_length * c.micro_batch_size * c.query_projection_size() / t;
  const int64_t asb_t = c.num_attention_heads / t * c.seq_length * c.micro_batch_size;
  return sbh_t * e + asb_t * (e == 8 ? 8 : 4);
}

// Korthikanti et al.'s attention terms (Table 2; 16-bit terms scaled to `dtype_bytes`, masks 1
// byte): linear_qkv's input 2sbh (replicated without SP), core_attention's q, k (4sbh) and v
// (2sbh), softmax output 2as^2b, its dropout mask as^2b and output 2as^2b, linear_proj's input
// 2sbh, all split t ways inside the tensor-parallel region.
ModuleTerms paper_attention_terms(const std::string& module, const TransformerConfig& c,
                                  int64_t dtype_bytes, bool cpu) {
  const double sbh = static_cast<double>(c.seq_length * c.micro_batch_size * c.hidden_size);
  const double as2b =
      static_cast<double>(c.num_attention_heads) * c.seq_length * c.seq_length * c.micro_batch_size;
  const double k = static_cast<double>(dtype_bytes) / 2.0;
  const double t = static_cast<double>(c.tensor_model_parallel_size);
  const double rep = c.sequence_parallel ? t : 1.0;
  const int64_t e = c.element_bytes();
  const int64_t tt = c.tensor_model_parallel_size;
  const int64_t sbh_t = c.seq_length * c.micro_batch_size * c.hidden_size / tt;
  const int64_t as2b_t =
      c.num_attention_heads * c.seq_length * c.seq_length * c.micro_batch_size / tt;
  ModuleTerms x;
  auto add = [&x](int64_t bytes, const std::string& what) {
    x.beyond += bytes;
    x.what += (x.what.empty() ? "" : "; ") + what;
  };
  if (module == "linear_qkv") {
    x.paper = 2 * sbh * k / rep;
  } else if (module == "core_attention") {
    x.paper = (6 * sbh * k + 4 * as2b * k + as2b) / t;
    // Note [What standard attention keeps]: the paper's 3 sbh for q, k and v, exactly with
    // grouped-query attention (q's copy or RoPE's output, k and v repeated to every head).
    const int64_t qkv = standard_attention_bytes(c, LayerPlan{}, e, true).core_qkv - 3 * sbh_t * e;
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
  } else if (module == "linear_proj") {
    x.paper = 2 * sbh * k / t;
    const int64_t extra = standard_attention_bytes(c, LayerPlan{}, e, cpu).linear_proj - sbh_t * e;
    if (extra != 0) {
      add(extra, c.flash_attention() && !c.attention_output_gate
                     ? "flash: its input is the kernel's output, counted on core_attention"
                     : "its input is a x d wide, not h");
    }
  }
  return x;
}

class AttentionPart final : public LayerPart {
 public:
  const char* name() const override { return "attention"; }
  PartSlot slot() const override { return PartSlot::kMixer; }
  std::shared_ptr<PartModule> build(const TransformerConfig& config, const LayerPlan& plan, int64_t,
                                    at::ScalarType dtype) const override {
    return std::make_shared<SelfAttention>(config, plan, dtype);
  }
  std::unique_ptr<RotaryEmbedding> rotary_tables(const TransformerConfig& config,
                                                 at::ScalarType dtype) const override {
    if (!config.use_rope()) return nullptr;
    return std::make_unique<RotaryEmbedding>(config, dtype);
  }
  /// Keys and values of G groups of kv_channels (KVCacheState).
  int64_t decode_state_bytes(const TransformerConfig& c, int64_t capacity,
                             int64_t element_bytes) const override {
    return capacity * c.query_groups() * 2 * c.kv_channels() * element_bytes;
  }

  void saved_bytes(const SavedBytesContext& ctx) const override {
    // Note [What standard attention keeps].
    const StandardAttentionBytes sa =
        standard_attention_bytes(ctx.config, ctx.plan, ctx.e, ctx.cpu);
    const AttentionFp8Inputs keep =
        attention_fp8_keeps_original(ctx.config.fp8_recipe == "delayed", ctx.plan);
    const int64_t context = ctx.config.seq_length * ctx.config.micro_batch_size *
                            ctx.config.query_projection_size() /
                            ctx.config.tensor_model_parallel_size;
    ctx.add("linear_qkv",
            ctx.gemm_input(ctx.tokens * ctx.config.hidden_size, ctx.input, keep.qkv_original));
    ctx.add("q_layernorm", sa.q_layernorm);
    ctx.add("k_layernorm", sa.k_layernorm);
    ctx.add("core_attention", sa.core_qkv + core_attention_scores_bytes(ctx));
    ctx.add("output_gate", sa.output_gate);
    ctx.add("linear_proj", ctx.gemm_input(context, sa.linear_proj, keep.proj_original));
  }
  ModuleTerms module_terms(const std::string& module, const TransformerConfig& config,
                           int64_t dtype_bytes, bool cpu) const override {
    return paper_attention_terms(module, config, dtype_bytes, cpu);
  }
  bool paper_describes(const TransformerConfig& c) const override {
    return c.query_projection_size() == c.hidden_size && !c.attention_output_gate &&
           !c.qk_layernorm;
  }
  PartParameters parameters(const TransformerConfig& c) const override {
    const int64_t h = c.hidden_size, bias = c.add_bias_linear ? 1 : 0;
    const int64_t norm = c.use_rmsnorm() ? 1 : 2;  // weight (and bias) per feature
    const int64_t a = c.num_attention_heads, d = c.kv_channels();
    const int64_t rows = (a * (c.attention_output_gate ? 2 : 1) + 2 * c.query_groups()) * d;
    PartParameters p;
    p.sharded = h * rows + bias * rows + a * d * h;
    p.replicated = bias * h + (c.qk_layernorm ? 2 * d * norm : 0);
    return p;
  }
  PartFlops megatron_flops(const TransformerConfig& c) const override {
    // transformer_flops' standard attention: 3 x 2 (forward and backward, a multiply-add is two
    // operations). Without --group-query-attention Megatron sets num_query_groups to the heads.
    const double E = 3.0, F = 2.0, h = static_cast<double>(c.hidden_size);
    const double heads = static_cast<double>(c.num_attention_heads);
    const double q = static_cast<double>(c.kv_channels()) * heads;
    const double kv = static_cast<double>(c.kv_channels() * c.query_groups());
    const double gate = c.attention_output_gate ? q : 0.0;
    PartFlops f;
    f.per_token = E * F * (h * (q + kv + kv + gate) + q * h);
    f.per_token_position = E * F * q / 2.0 * 2.0;  // half the causal scores; QK^T and x V
    return f;
  }
  PeakTerms peak_terms(const TransformerConfig& c, double e) const override {
    // linear_qkv h x (a (1 + gate) + 2G) d, linear_proj a d x h and the q/k norms, at least the
    // paper's 4h^2, with the column-parallel biases (3h), split t ways. Its largest tensors: the
    // scores [a/t, s, s, b], linear_qkv's output [s, b, qkv/t], and the context [s, b, a d / t]
    // (the output gate's fp32 sigmoid at 16 bits: twice that).
    const double h = static_cast<double>(c.hidden_size);
    const double t = static_cast<double>(c.tensor_model_parallel_size);
    const double s = static_cast<double>(c.seq_length), b = static_cast<double>(c.micro_batch_size);
    const double ad = static_cast<double>(c.query_projection_size());
    const double qkv = static_cast<double>(
        (c.num_attention_heads * (c.attention_output_gate ? 2 : 1) + 2 * c.query_groups()) *
        c.kv_channels());
    PeakTerms p;
    p.parameters =
        (std::max(4.0 * h * h, h * qkv + ad * h + 4.0 * static_cast<double>(c.kv_channels())) +
         3.0 * h) /
        t;
    p.largest_tensor =
        std::max({static_cast<double>(c.num_attention_heads) * s * s * b / t, s * b * qkv / t,
                  s * b * ad / t * (c.attention_output_gate && e == 2.0 ? 2.0 : 1.0)}) *
        e;
    return p;
  }
  // Note [Analytic attention]
  // The paper's terms (Korthikanti et al. 2022 §4.1) split as Megatron's modules save them, per
  // rank: linear_qkv's input 2sbh (replicated without SP; layernorm recompute drops it, the
  // qkv_linear group moves it), q, k, v 2sbh (1 + 2G/a) (grouped-query attention keeps k and v
  // at G heads), the scores 5as^2b (the flash kernel: its fp32 logsumexp 4asb; core_attn drops
  // them, the core_attn group moves them with q, k, v), linear_proj's input 2sbh (attn_proj),
  // all split t ways inside the tensor-parallel region. Its forward: linear_qkv
  // 2sbh^2 (1 + 2G/a)/t, the two s^2 GEMMs 4bs^2h/t, linear_proj 2sbh^2/t at the matmul rate; the
  // softmax and its dropout 9 bytes per score (2+2 softmax, 2+2+1 dropout) at the memory
  // bandwidth, none with the flash kernel, which keeps the scores on chip and computes Q K^T
  // again in its backward. For a model the paper does not describe (paper_describes() in
  // activation_bytes.h) from its configuration, with H = a heads of d = kv_channels and the
  // output gate: linear_qkv 2 T h (H (1 + gate) + 2G) d / t, the s^2 GEMMs 4 b s^2 H d / t,
  // linear_proj 2 T H d h / t; the q/k norms read and write q and k (8 T (H + G) d / t bytes),
  // the gate reads the context and the gate and writes the product with its fp32 sigmoid
  // (10 T H d / t); the softmax's dropout only when the attention dropout is on.
  AnalyticTerms analytic_terms(const PaperShape& m) const override {
    const double sb = m.s * m.b, sbh = m.sbh(), t = m.t, r = m.sp ? m.t : 1.0, h = m.h;
    const double groups = m.g > 0 ? m.g : m.a;
    AnalyticTerms x;
    x.tensors = {{2 * sbh / r, {RecomputeModule::kLayernorm}, OffloadModule::kQkvLinear},
                 {2 * sbh * (1 + 2 * groups / m.a) / t, {}, OffloadModule::kCoreAttn},
                 {(m.flash ? 4 * m.a * sb : 5 * m.a * m.s * sb) / t,
                  {RecomputeModule::kCoreAttn},
                  OffloadModule::kCoreAttn},
                 {2 * sbh / t, {}, OffloadModule::kAttnProj}};
    double qkv = 2 * sbh * h * (1 + 2 * groups / m.a) / t, proj = 2 * sbh * h / t;
    double scores = 4 * m.b * m.s * m.s * h / t;  // Q K^T and the scores times V
    double latent_norms = 0, softmax_bytes = 9;
    const TransformerConfig* c = m.config.get();
    if (c != nullptr && !actmem::paper_describes(*c)) {
      const double d = static_cast<double>(c->kv_channels());
      const double gate = c->attention_output_gate ? 1.0 : 0.0;
      qkv = 2 * sb * h * (m.a * (1 + gate) + 2 * groups) * d / t;
      proj = 2 * sb * m.a * d * h / t;
      scores = 4 * m.b * m.s * m.s * m.a * d / t;
      latent_norms = (c->qk_layernorm ? 8 * sb * (m.a + groups) * d / t : 0.0) +
                     (c->attention_output_gate ? 10 * sb * m.a * d / t : 0.0);
      softmax_bytes = c->attention_dropout > 0 ? 9 : 4;
    }
    const double softmax_dropout = m.flash ? 0.0 : softmax_bytes * m.a * m.s * sb / t;
    x.work = {{qkv + proj, latent_norms, {}},
              {scores, softmax_dropout, {RecomputeModule::kCoreAttn}}};
    x.backward_extra_flops = m.flash ? scores / 2 : 0.0;
    return x;
  }
  /// Megatron's qkv_linear group wraps linear_qkv and the q/k norms.
  std::optional<OffloadModule> offload_group(const std::string& module) const override {
    if (module == "linear_qkv" || module == "q_layernorm" || module == "k_layernorm") {
      return OffloadModule::kQkvLinear;
    }
    if (module == "core_attention") return OffloadModule::kCoreAttn;
    if (module == "linear_proj") return OffloadModule::kAttnProj;
    return std::nullopt;
  }
  std::vector<RecomputeModule> estimate_units(const TransformerConfig&) const override {
    return {RecomputeModule::kCoreAttn};
  }
  // Said only where the paper's terms do not describe it.
  std::string summary(const TransformerConfig& c, int64_t layers) const override {
    if (actmem::paper_describes(c)) return "";
    return std::to_string(layers) + " attention layers, heads of " +
           std::to_string(c.kv_channels()) + " (" + std::to_string(c.query_groups()) +
           " key/value groups" + (c.attention_output_gate ? ", output gate" : "") +
           (c.qk_layernorm ? ", q/k norms" : "") + ")";
  }
};
}  // namespace

int64_t core_attention_scores_bytes(const SavedBytesContext& ctx) {
  const TransformerConfig& c = ctx.config;
  const int64_t t = c.tensor_model_parallel_size;
  const int64_t as2b = c.num_attention_heads * c.seq_length * c.seq_length * c.micro_batch_size / t;
  if (ctx.plan.recomputes(RecomputeModule::kCoreAttn)) return ctx.snapshot;
  if (c.flash_attention()) return flash_output_and_logsumexp_bytes(c, ctx.e);
  return as2b * ctx.e + (c.attention_dropout > 0.0 ? as2b + as2b * ctx.e : 0);
}

const LayerPart& attention_part() {
  static const AttentionPart part;
  return part;
}

}  // namespace actmem
