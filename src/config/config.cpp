// config.cpp — TransformerConfig and TrainingConfig: validation and JSON.
#include "actmem/config/config.h"

#include "actmem/config/activation_plan.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>
#include <utility>

namespace actmem {

namespace {
void check_positive(int64_t value, const char* name) {
  TORCH_CHECK(value > 0, "actmem::TransformerConfig: ", name, " must be positive, got ", value);
}
void check_dropout(double p, const char* name) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "actmem::TransformerConfig: ", name, " must be in [0, 1), got ",
              p);
}
}  // namespace

namespace {
// Megatron's moe_freq_type (megatron/training/arguments.py) then get_gpt_decoder_layer_specs
// (megatron/core/models/gpt/gpt_layer_specs.py): an integer N, or a Python list expression of
// 0/1 entries built from [...], +, * and parentheses ("([1]*3+[0]*1)*3"). Megatron evals the
// expression after checking its characters; this is a small evaluator for the same grammar:
//   expr := term ('+' term)* ; term := factor ('*' factor)* ; factor := list | int | '(' expr ')'
class PatternParser {
 public:
  explicit PatternParser(const std::string& text) : s_(text) {}
  std::vector<int64_t> parse() {
    Value v = expr();
    skip();
    check(pos_ == s_.size(), "unexpected '" + s_.substr(pos_, 1) + "'");
    check(v.is_list, "the pattern is a number, not a list");
    return v.list;
  }

 private:
  struct Value {
    bool is_list = false;
    std::vector<int64_t> list;
    int64_t number = 0;
  };
  void check(bool ok, const std::string& what) const {
    TORCH_CHECK(ok, "actmem::TransformerConfig: Invalid pattern: ", s_, " (", what, ")");
  }
  void skip() {
    while (pos_ < s_.size() && s_[pos_] == ' ') ++pos_;
  }
  bool eat(char c) {
    skip();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  int64_t number() {
    skip();
    const size_t start = pos_;
    while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
    check(pos_ > start, "expected a number at position " + std::to_string(start));
    check(pos_ - start <= 9, "number too large");
    return std::stoll(s_.substr(start, pos_ - start));
  }
  Value factor() {
    Value v;
    if (eat('(')) {
      v = expr();
      check(eat(')'), "missing ')'");
    } else if (eat('[')) {
      v.is_list = true;
      if (!eat(']')) {
        do v.list.push_back(number());
        while (eat(','));
        check(eat(']'), "missing ']'");
      }
    } else {
      v.number = number();
    }
    return v;
  }
  Value term() {
    Value v = factor();
    while (eat('*')) {
      Value r = factor();
      check(v.is_list != r.is_list, "'*' needs a list and a count");
      Value& list = v.is_list ? v : r;
      const int64_t n = v.is_list ? r.number : v.number;
      check(n <= 1 << 20 && static_cast<int64_t>(list.list.size()) * n <= 1 << 20, "too long");
      Value out;
      out.is_list = true;
      for (int64_t i = 0; i < n; ++i)
        out.list.insert(out.list.end(), list.list.begin(), list.list.end());
      v = std::move(out);
    }
    return v;
  }
  Value expr() {
    Value v = term();
    while (eat('+')) {
      Value r = term();
      check(v.is_list && r.is_list, "'+' joins two lists");
      v.list.insert(v.list.end(), r.list.begin(), r.list.end());
    }
    return v;
  }
  const std::string& s_;
  size_t pos_ = 0;
};
}  // namespace

int64_t moe_expert_capacity(int64_t tokens, int64_t topk, int64_t experts, double factor) {
  return static_cast<int64_t>(
      std::ceil(static_cast<double>(tokens * topk) / static_cast<double>(experts) * factor));
}

namespace {
// Megatron's pipeline split rules: the even split of validate_args (megatron/training/
// arguments.py), the uneven one of TransformerConfig.__post_init__ ("Uneven PP",
// megatron/core/transformer/transformer_config.py), with their messages.
void validate_pipeline(const TransformerConfig& c) {
  const char* api = "actmem::TransformerConfig: ";
  const int64_t p = c.pipeline_model_parallel_size;
  check_positive(p, "pipeline_model_parallel_size");
  const auto& first = c.decoder_first_pipeline_num_layers;
  const auto& last = c.decoder_last_pipeline_num_layers;
  const auto& per_vp = c.num_layers_per_virtual_pipeline_stage;
  const auto& vp = c.num_virtual_stages_per_pipeline_rank;
  TORCH_CHECK(!(per_vp && vp), api,
              "No more than one of the following arguments can be set at the "
              "same time: --num-layers-per-virtual-pipeline-stage, "
              "--num-virtual-stages-per-pipeline-rank (got ",
              *per_vp, " and ", vp.value_or(0), ")");
  if (per_vp || vp) {
    TORCH_CHECK(!per_vp || (!first && !last), api,
                "please use --num-virtual-stages-per-pipeline-"
                "rank to specify virtual pipeline parallel degree when enable uneven pipeline "
                "parallelism");
    TORCH_CHECK(first || last || c.num_layers % p == 0, api,
                "number of layers of the model must "
                "be divisible pipeline model parallel size (num_layers ",
                c.num_layers, ", pipeline size ", p, ")");
    const int64_t per_stage = c.num_layers / p;
    if (first || last) {
      // Uneven and interleaved (TransformerConfig.__post_init__'s "Uneven PP" with a virtual
      // size): the first and last stages' layers split into v chunks each; the middle stages'
      // checks follow below.
      TORCH_CHECK(*vp >= 1, api, "num_virtual_stages_per_pipeline_rank must be positive, got ",
                  *vp);
      TORCH_CHECK(!first || *first % *vp == 0, api, "number of layers at first stage: ", *first,
                  " must be divisible by virtual pipeline parallel degree ", *vp);
      TORCH_CHECK(!last || *last % *vp == 0, api, "number of layers at last stage: ", *last,
                  " must be divisible by virtual pipeline parallel degree ", *vp);
    } else if (per_vp) {
      TORCH_CHECK(*per_vp >= 1, api, "num_layers_per_virtual_pipeline_stage must be positive, got ",
                  *per_vp);
      TORCH_CHECK(per_stage % *per_vp == 0, api,
                  "number of layers per pipeline stage must be "
                  "divisible number of layers per virtual pipeline stage (",
                  per_stage,
                  " layers "
                  "per stage, ",
                  *per_vp, " per virtual stage)");
    } else {
      TORCH_CHECK(*vp >= 1, api, "num_virtual_stages_per_pipeline_rank must be positive, got ",
                  *vp);
      TORCH_CHECK(per_stage % *vp == 0, api, "the ", per_stage,
                  " layers of a pipeline stage cannot "
                  "be split into ",
                  *vp, " virtual stages of equal size");
    }
    // Megatron asserts p > 2 unless --overlap-p2p-comm: NCCL's batched send/recv between the same
    // two ranks (p = 2 makes the previous and the next stage one rank). Here every message is
    // posted on its own with a tag per direction, so p = 2 is safe (fixed); p = 1 has no pipeline.
    TORCH_CHECK(c.virtual_pipeline_size() == 1 || p > 1, api,
                "When interleaved schedule is used, "
                "pipeline-model-parallel size should be greater than 1");
  }
  if (const auto& g = c.microbatch_group_size_per_vp_stage) {
    TORCH_CHECK(c.virtual_pipeline_size() > 1, api,
                "microbatch_group_size_per_vp_stage applies "
                "to the interleaved schedule only (set --num-layers-per-virtual-pipeline-stage or "
                "--num-virtual-stages-per-pipeline-rank)");
    TORCH_CHECK(*g >= p, api,
                "The number of contiguous micro-batches in a virtual pipeline stage "
                "should range in [PP=",
                p, " , M]: got ", *g);
  }
  if (!first && !last) {
    TORCH_CHECK(c.num_layers % p == 0, api,
                "Number of layers should be divisible by the "
                "pipeline-model-parallel size (num_layers ",
                c.num_layers, ", pipeline size ", p, ")");
    return;
  }
  int64_t layers = c.num_layers, stages = p;
  if (first) {
    TORCH_CHECK(*first > 0, api, "num_layers_in_first_pipeline_stage must be larger than 0 (got ",
                *first, ")");
    layers -= *first;
    --stages;
  }
  if (last) {
    TORCH_CHECK(*last > 0, api, "num_layers_in_last_pipeline_stage must be larger than 0 (got ",
                *last, ")");
    layers -= *last;
    --stages;
  }
  // Megatron's "Mismatch" check; a negative remainder (more layers asked for than the model has)
  // is refused here too (Megatron would go on with a negative count).
  TORCH_CHECK(layers >= 0 && stages >= 0 && (layers != 0) == (stages != 0), api,
              "Mismatch: ", layers, " middle layers remaining but ", stages,
              " middle PP stages available "
              "(num_layers ",
              c.num_layers, ", pipeline size ", p, ")");
  TORCH_CHECK(stages == 0 || layers % stages == 0, api,
              "number of layers at middle stage: ", layers,
              " must be divisible by the middle pipeline model parallel size ", stages);
  if (vp) {
    TORCH_CHECK(stages == 0 || (layers / stages) % *vp == 0, api,
                "number of layers on each "
                "middle pipeline rank: ",
                layers / stages,
                " must be divisible by virtual pipeline "
                "parallel degree ",
                *vp);
  }
}
}  // namespace

int64_t TransformerConfig::rotary_dim() const {
  // Megatron's RotaryEmbedding: dim = kv_channels, then int(dim * rotary_percent) when < 1.
  const int64_t d = kv_channels();
  return rotary_percent < 1.0 ? static_cast<int64_t>(static_cast<double>(d) * rotary_percent) : d;
}

int64_t TransformerConfig::virtual_pipeline_size() const {
  if (num_virtual_stages_per_pipeline_rank) return *num_virtual_stages_per_pipeline_rank;
  if (num_layers_per_virtual_pipeline_stage && *num_layers_per_virtual_pipeline_stage > 0 &&
      pipeline_model_parallel_size > 0) {
    return num_layers / pipeline_model_parallel_size / *num_layers_per_virtual_pipeline_stage;
  }
  return 1;
}

int64_t TransformerConfig::microbatch_group_size() const {
  return microbatch_group_size_per_vp_stage.value_or(pipeline_model_parallel_size);
}

TransformerConfig::StageLayers TransformerConfig::model_chunk_layers(int64_t stage,
                                                                     int64_t chunk) const {
  const int64_t v = virtual_pipeline_size();
  TORCH_CHECK(chunk >= 0 && chunk < v, "actmem::TransformerConfig::model_chunk_layers: chunk ",
              chunk, " outside 0..", v - 1);
  if (v == 1) return pipeline_stage_layers(stage);
  const int64_t p = pipeline_model_parallel_size;
  TORCH_CHECK(stage >= 0 && stage < p, "actmem::TransformerConfig::model_chunk_layers: stage ",
              stage, " outside 0..", p - 1);
  const auto& first = decoder_first_pipeline_num_layers;
  const auto& last = decoder_last_pipeline_num_layers;
  if (!first && !last) {
    const int64_t n = num_layers / (p * v);
    return {chunk * (num_layers / v) + stage * n, n};
  }
  // Megatron's get_transformer_layer_offset with an uneven split and a vp_stage: chunk c of
  // every stage holds a 1/v share of that stage's layers, the chunks of one round (c) together
  // T = first/v + middle/v + last/v layers, stage r's at its place within the round.
  const int64_t middle_stages = p - (first ? 1 : 0) - (last ? 1 : 0);
  const int64_t first_chunk = first.value_or(0) / v, last_chunk = last.value_or(0) / v;
  const int64_t middle_chunk = (num_layers - first.value_or(0) - last.value_or(0)) / v;
  const int64_t round = first_chunk + middle_chunk + last_chunk;
  const int64_t per_middle = middle_stages > 0 ? middle_chunk / middle_stages : 0;
  if (first && stage == 0) return {chunk * round, first_chunk};
  if (last && stage == p - 1) return {chunk * round + first_chunk + middle_chunk, last_chunk};
  return {chunk * round + first_chunk + (stage - (first ? 1 : 0)) * per_middle, per_middle};
}

TransformerConfig::StageLayers TransformerConfig::pipeline_stage_layers(int64_t stage) const {
  const int64_t p = pipeline_model_parallel_size;
  TORCH_CHECK(virtual_pipeline_size() == 1,
              "actmem::TransformerConfig::pipeline_stage_layers: "
              "with virtual pipeline stages a rank's layers are not contiguous; use "
              "model_chunk_layers(stage, chunk)");
  TORCH_CHECK(stage >= 0 && stage < p, "actmem::TransformerConfig::pipeline_stage_layers: stage ",
              stage, " outside 0..", p - 1);
  const auto& first = decoder_first_pipeline_num_layers;
  const auto& last = decoder_last_pipeline_num_layers;
  if (!first && !last) return {stage * (num_layers / p), num_layers / p};
  // Megatron's get_transformer_layer_offset / get_num_layers_to_build for uneven splits.
  const int64_t middle_stages = p - (first ? 1 : 0) - (last ? 1 : 0);
  const int64_t middle_layers = num_layers - first.value_or(0) - last.value_or(0);
  const int64_t per_middle = middle_stages > 0 ? middle_layers / middle_stages : 0;
  if (first && stage == 0) return {0, *first};
  if (last && stage == p - 1) return {num_layers - *last, *last};
  const int64_t middle_index = stage - (first ? 1 : 0);
  return {first.value_or(0) + middle_index * per_middle, per_middle};
}

std::vector<bool> TransformerConfig::moe_layers() const {
  std::vector<bool> out(static_cast<size_t>(std::max<int64_t>(num_layers, 0)), false);
  if (!is_moe()) return out;
  const std::string& f = moe_layer_freq;
  const bool is_int = !f.empty() && std::all_of(f.begin(), f.end(), [](char ch) {
    return std::isdigit(static_cast<unsigned char>(ch));
  });
  if (is_int) {
    TORCH_CHECK(f.size() <= 9 && std::stoll(f) >= 1,
                "actmem::TransformerConfig: moe_layer_freq "
                "must be a positive integer or a list pattern, got ",
                f);
    const int64_t n = std::stoll(f);
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int64_t>(i) % n == 0;
    return out;
  }
  TORCH_CHECK(f.find('[') != std::string::npos &&
                  f.find_first_not_of("0123456789,[]()+* ") == std::string::npos,
              "actmem::TransformerConfig: Invalid pattern: ", f);
  const std::vector<int64_t> pattern = PatternParser(f).parse();
  TORCH_CHECK(static_cast<int64_t>(pattern.size()) == num_layers,
              "actmem::TransformerConfig: "
              "Invalid length of moe_layer_pattern: ",
              pattern.size(), ", expected ", num_layers, ", current moe layer pattern: ", f);
  for (size_t i = 0; i < pattern.size(); ++i) {
    TORCH_CHECK(pattern[i] == 0 || pattern[i] == 1,
                "actmem::TransformerConfig: Invalid layer "
                "pattern: ",
                f, " (entries must be 0 or 1)");
    out[i] = pattern[i] == 1;
  }
  return out;
}

// Megatron's get_linear_attention_pattern
// (megatron/core/models/gpt/experimental_attention_variant_module_specs.py): an integer N makes
// layer i standard attention when (i + 1) % N == 0 and GatedDeltaNet otherwise; a list is the
// pattern itself (1 = GDN).
std::vector<bool> TransformerConfig::gdn_layers() const {
  std::vector<bool> out(static_cast<size_t>(std::max<int64_t>(num_layers, 0)), false);
  if (!gated_delta_net()) return out;
  const std::string& f = linear_attention_freq;
  TORCH_CHECK(!f.empty(),
              "actmem::TransformerConfig: linear_attention_freq must be set for "
              "linear gdn.");
  const bool is_int = std::all_of(
      f.begin(), f.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); });
  if (is_int) {
    TORCH_CHECK(f.size() <= 9 && std::stoll(f) >= 1,
                "actmem::TransformerConfig: "
                "linear_attention_freq must be a positive integer or a list pattern, got ",
                f);
    const int64_t n = std::stoll(f);
    for (size_t i = 0; i < out.size(); ++i) out[i] = (static_cast<int64_t>(i) + 1) % n != 0;
    return out;
  }
  TORCH_CHECK(f.find('[') != std::string::npos &&
                  f.find_first_not_of("0123456789,[]()+* ") == std::string::npos,
              "actmem::TransformerConfig: Invalid linear_attention_freq: ", f);
  const std::vector<int64_t> pattern = PatternParser(f).parse();
  TORCH_CHECK(static_cast<int64_t>(pattern.size()) == num_layers,
              "actmem::TransformerConfig: "
              "Invalid length of linear_attention_pattern: ",
              pattern.size(), ", expected ", num_layers, ", current linear attention pattern: ", f);
  for (size_t i = 0; i < pattern.size(); ++i) {
    TORCH_CHECK(pattern[i] == 0 || pattern[i] == 1,
                "actmem::TransformerConfig: Invalid "
                "linear_attention_freq: ",
                f, " (entries must be 0 or 1)");
    out[i] = pattern[i] == 1;
  }
  return out;
}

namespace {
// Megatron's MoE rules (TransformerConfig.__post_init__ in
// megatron/core/transformer/transformer_config.py, validate_args in
// megatron/training/arguments.py and the runtime checks of megatron/core/transformer/moe/), with
// Megatron's messages; deliberate differences are marked "fixed" or "refused" (docs/moe.md).
void validate_moe(const TransformerConfig& c) {
  const char* api = "actmem::TransformerConfig: ";
  TORCH_CHECK(c.num_moe_experts >= 0, api, "num_moe_experts must be non-negative.");
  TORCH_CHECK(c.expert_model_parallel_size >= 1, api, "Expected non-negative expert parallel size");
  if (!c.is_moe()) {
    TORCH_CHECK(c.expert_model_parallel_size == 1, api,
                "num_moe_experts must be non None to use expert-parallel.");
    // Megatron only warns (and ignores it) when moe_layer_freq leaves dense layers; a dense model
    // has no MoE layer to size, so it is refused either way here (fixed).
    TORCH_CHECK(!c.moe_ffn_hidden_size, api,
                "moe_ffn_hidden_size is set but num_moe_experts is "
                "None. Please set num_moe_experts or remove moe_ffn_hidden_size.");
    TORCH_CHECK(!c.moe_shared_expert_intermediate_size && !c.moe_grouped_gemm &&
                    !c.moe_layer_recompute && c.moe_expert_dropout == 0.0 &&
                    !c.moe_expert_capacity_factor && !c.moe_pad_expert_input_to_capacity &&
                    !c.moe_z_loss_coeff && c.moe_aux_loss_coeff == 0.0,
                api, "MoE options need --num-experts (this model is dense)");
    return;
  }
  c.moe_layers();  // the pattern's own errors
  const int64_t E = c.num_moe_experts;
  TORCH_CHECK(c.moe_router_topk >= 1 && c.moe_router_topk <= E, api,
              "moe_router_topk must be "
              "between 1 and num_moe_experts (",
              E, "), got ", c.moe_router_topk);  // fixed
  TORCH_CHECK(!c.moe_ffn_hidden_size || *c.moe_ffn_hidden_size > 0, api,
              "moe_ffn_hidden_size must be positive, got ", c.moe_ffn_hidden_size.value_or(0));
  TORCH_CHECK(c.moe_router_score_function == "softmax" || c.moe_router_score_function == "sigmoid",
              api, "Invalid score_function: ", c.moe_router_score_function);
  TORCH_CHECK(
      c.moe_token_dispatcher_type == "allgather" || c.moe_token_dispatcher_type == "alltoall", api,
      "Unsupported token dispatcher type: ", c.moe_token_dispatcher_type);
  TORCH_CHECK(c.moe_token_drop_policy == "probs" || c.moe_token_drop_policy == "position", api,
              "Invalid drop_policy: ", c.moe_token_drop_policy);
  const std::string& lb = c.moe_router_load_balancing_type;
  TORCH_CHECK(lb == "aux_loss" || lb == "seq_aux_loss" || lb == "none", api,
              "moe_router_load_balancing_type ", lb,
              " is not implemented (aux_loss, seq_aux_loss or none)");
  TORCH_CHECK(c.moe_aux_loss_coeff >= 0.0 && std::isfinite(c.moe_aux_loss_coeff), api,
              "moe_aux_loss_coeff must be a finite number >= 0, got ", c.moe_aux_loss_coeff);
  TORCH_CHECK(
      !c.moe_z_loss_coeff || (*c.moe_z_loss_coeff >= 0.0 && std::isfinite(*c.moe_z_loss_coeff)),
      api, "moe_z_loss_coeff must be a finite number >= 0, got ", c.moe_z_loss_coeff.value_or(0));
  TORCH_CHECK(!(c.moe_router_topk == 1 && c.moe_router_score_function == "softmax" &&
                !c.moe_router_pre_softmax),
              api, "Please use --moe-router-pre-softmax when topk is 1.");
  TORCH_CHECK(
      !c.moe_router_topk_scaling_factor || (*c.moe_router_topk_scaling_factor > 0.0 &&
                                            std::isfinite(*c.moe_router_topk_scaling_factor)),
      api, "moe_router_topk_scaling_factor must be a positive number");
  if (c.moe_shared_expert_intermediate_size) {
    const int64_t v = *c.moe_shared_expert_intermediate_size;
    TORCH_CHECK(v > 0, api,
                "moe_shared_expert_intermediate_size must be num_shared_experts * "
                "ffn_size_of_each_shared_expert, but got ",
                v);
    // megatron/core/transformer/moe/shared_experts.py. Megatron's assert message loses its
    // second half to a line break ("bias is not supported in the shared experts, " and the
    // advice on the next line is a separate expression): actmem prints both halves.
    TORCH_CHECK(!c.add_bias_linear, api,
                "bias is not supported in the shared experts, please "
                "set '--disable-bias-linear' instead.");
    TORCH_CHECK(v % c.tensor_model_parallel_size == 0, api, "moe_shared_expert_intermediate_size (",
                v, ") must be divisible by tensor_model_parallel_size (",
                c.tensor_model_parallel_size, ")");
  } else {
    TORCH_CHECK(!c.moe_shared_expert_gate, api,
                "moe_shared_expert_gate needs shared experts "
                "(moe_shared_expert_intermediate_size)");
  }
  if (c.moe_expert_capacity_factor) {
    TORCH_CHECK(std::isfinite(*c.moe_expert_capacity_factor) && *c.moe_expert_capacity_factor > 0.0,
                api,
                "moe_expert_capacity_factor must be a positive number (unset for dropless "
                "routing), got ",
                *c.moe_expert_capacity_factor);
    TORCH_CHECK(lb == "aux_loss" || lb == "seq_aux_loss" || lb == "none", api,
                "moe_expert_capacity_factor only works with "
                "aux_loss, seq_aux_loss, global_aux_loss or none load balancing");
  }
  TORCH_CHECK(!c.moe_pad_expert_input_to_capacity || c.moe_expert_capacity_factor, api,
              "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity");
  TORCH_CHECK(c.moe_expert_dropout >= 0.0 && c.moe_expert_dropout < 1.0, api,
              "moe_expert_dropout must be in [0, 1), got ", c.moe_expert_dropout);
  // validate_args (megatron/training/arguments.py).
  TORCH_CHECK(E % c.expert_model_parallel_size == 0, api,
              "Number of experts should be a multiple of expert model parallel_size.");
  const int64_t t = c.tensor_model_parallel_size;
  if (t > 1) {
    // MoELayer.forward (megatron/core/transformer/moe/moe_layer.py) raises this when training;
    // refused up front here (Megatron's message, with the space its concatenation drops).
    TORCH_CHECK(c.sequence_parallel, api,
                "During training, performance may degrade if MoE and "
                "tensor parallelism are enabled without also enabling sequence parallelism.");
    // The experts are split over the expert tensor-parallel ranks (etp = t, Megatron's default).
    TORCH_CHECK(c.moe_ffn() % t == 0, api, "moe_ffn_hidden_size (", c.moe_ffn(),
                ") must be "
                "divisible by expert_tensor_parallel_size (",
                t, ")");
  }
}
// Megatron's MLA rules (MLATransformerConfig.__post_init__ in
// megatron/core/transformer/transformer_config.py, core_transformer_config_from_args in
// megatron/training/argument_utils.py), with its messages; the positivity checks are actmem's
// (Megatron builds the layers and fails later).
// Megatron's gated-delta-net rules (TransformerConfig.__post_init__ in
// megatron/core/transformer/transformer_config.py), its messages; context parallelism is not in
// actmem, so Megatron's t * cp is t here.
void validate_gdn(const TransformerConfig& c) {
  const char* api = "actmem::TransformerConfig: ";
  const std::string& v = c.experimental_attention_variant;
  TORCH_CHECK(v.empty() || c.gated_delta_net() || v == "gdn2" || v == "dsa", api,
              "experimental_attention_variant must be one of gdn, gdn2, dsa, gated_delta_net "
              "(Megatron's choices), got \"",
              v, "\"");
  TORCH_CHECK(v != "gdn2" && v != "dsa", api, "experimental_attention_variant ", v,
              " is not implemented in actmem (gdn is)");
  if (!c.gated_delta_net()) {
    // Megatron ignores them then; a user setting them expects linear-attention layers (fixed).
    TORCH_CHECK(c.linear_attention_freq.empty(), api,
                "linear_attention_freq needs "
                "--experimental-attention-variant gdn");
    return;
  }
  const std::pair<const char*, int64_t> sizes[] = {
      {"linear_conv_kernel_dim", c.linear_conv_kernel_dim},
      {"linear_key_head_dim", c.linear_key_head_dim},
      {"linear_value_head_dim", c.linear_value_head_dim},
      {"linear_num_key_heads", c.linear_num_key_heads},
      {"linear_num_value_heads", c.linear_num_value_heads},
  };
  for (const auto& [name, value] : sizes) {
    TORCH_CHECK(value >= 1, api, name, " must be set for gated delta net (positive), got ", value);
  }
  TORCH_CHECK(c.linear_num_value_heads % c.linear_num_key_heads == 0, api,
              "linear_num_value_heads (", c.linear_num_value_heads,
              ") must be a multiple of "
              "linear_num_key_heads (",
              c.linear_num_key_heads, ").");
  const int64_t t = c.tensor_model_parallel_size;
  TORCH_CHECK(c.linear_num_key_heads % t == 0, api,
              "self.linear_num_key_heads=", c.linear_num_key_heads,
              " must be a multiple of (self.tensor_model_parallel_size=", t,
              " * self.context_parallel_size=1).");
  TORCH_CHECK(c.linear_num_value_heads % t == 0, api,
              "self.linear_num_value_heads=", c.linear_num_value_heads,
              " must be a multiple of "
              "(self.tensor_model_parallel_size=",
              t, " * self.context_parallel_size=1).");
  // GatedDeltaNet's causal convolution and output gate use activation_func; Megatron's FLA
  // path (gdn.py) asserts it is silu, which actmem's models have with SwiGLU.
  TORCH_CHECK(c.gated_linear_unit, api,
              "the gated delta net's convolution and output gate "
              "run activation_func, which must be silu (Megatron's GatedDeltaNet asserts "
              "activation in ['silu', 'swish']): use --swiglu");
  TORCH_CHECK(!c.multi_latent_attention, api,
              "multi-latent attention with the gated delta net "
              "variant (MLA on the attention layers of a hybrid model) is not implemented");
  c.gdn_layers();  // the pattern's own errors
}

void validate_mla(const TransformerConfig& c) {
  const char* api = "actmem::TransformerConfig: ";
  const std::string rope = c.resolved_rope_type();
  TORCH_CHECK(rope == "rope" || rope == "yarn", api, "Unsupported RoPE type: ", rope,
              ", supported types are 'rope' and 'yarn'");
  if (!c.multi_latent_attention) {
    TORCH_CHECK(rope == "rope", api, "Common attention only support rope_type=\"rope\", but got ",
                rope, ".");
    TORCH_CHECK(!c.q_lora_rank, api, "q_lora_rank needs --multi-latent-attention");
    return;
  }
  // MultiLatentAttention.__init__ (megatron/core/transformer/multi_latent_attention.py).
  TORCH_CHECK(!c.attention_output_gate, api, "Output gate is not supported for MLA yet.");
  TORCH_CHECK(c.rotary_percent == 1.0, api, "--rotary-percent ", c.rotary_percent,
              " with "
              "multi-latent attention is not implemented (MLA rotates its qk_pos_emb_head_dim "
              "part whole)");
  TORCH_CHECK(!c.q_lora_rank || *c.q_lora_rank > 0, api, "q_lora_rank must be positive, got ",
              c.q_lora_rank.value_or(0));
  check_positive(c.kv_lora_rank, "kv_lora_rank");
  check_positive(c.qk_head_dim, "qk_head_dim");
  check_positive(c.qk_pos_emb_head_dim, "qk_pos_emb_head_dim");
  check_positive(c.v_head_dim, "v_head_dim");
  TORCH_CHECK(c.qk_pos_emb_head_dim % 2 == 0, api,
              "qk_pos_emb_head_dim must be even (RoPE "
              "rotates pairs), got ",
              c.qk_pos_emb_head_dim);
  TORCH_CHECK(std::isfinite(c.rotary_scaling_factor) && c.rotary_scaling_factor > 0.0, api,
              "rotary_scaling_factor must be a positive number, got ", c.rotary_scaling_factor);
  TORCH_CHECK(std::isfinite(c.mscale) && std::isfinite(c.mscale_all_dim), api,
              "mscale and mscale_all_dim must be finite, got ", c.mscale, " and ",
              c.mscale_all_dim);
}
}  // namespace

void TransformerConfig::validate() const {
  make_activation_plan(*this);
}

void TransformerConfig::validate_shape() const {
  check_positive(num_layers, "num_layers");
  check_positive(hidden_size, "hidden_size");
  check_positive(num_attention_heads, "num_attention_heads");
  // MLA sizes its heads with qk_head_dim, qk_pos_emb_head_dim and v_head_dim instead; with
  // --kv-channels the heads need not tile h (Megatron's arguments.py asserts the division only
  // when kv_channels is unset).
  TORCH_CHECK(!kv_channels_arg || *kv_channels_arg > 0,
              "actmem::TransformerConfig: kv_channels "
              "must be positive, got ",
              kv_channels_arg.value_or(0));
  TORCH_CHECK(multi_latent_attention || kv_channels_arg || hidden_size % num_attention_heads == 0,
              "actmem::TransformerConfig: num_attention_heads (", num_attention_heads,
              ") must divide hidden_size (", hidden_size,
              "), or give the head width with "
              "--kv-channels");
  TORCH_CHECK(ffn_hidden_size >= 0,
              "actmem::TransformerConfig: ffn_hidden_size must be positive "
              "(or 0 for 4 * hidden_size), got ",
              ffn_hidden_size);
  check_positive(seq_length, "seq_length");
  TORCH_CHECK(max_position_embeddings >= 0,
              "actmem::TransformerConfig: max_position_embeddings "
              "must be positive (or 0 for seq_length), got ",
              max_position_embeddings);
  TORCH_CHECK(max_positions() >= seq_length, "actmem::TransformerConfig: max_position_embeddings (",
              max_positions(), ") must be at least seq_length (", seq_length, ")");
  check_positive(micro_batch_size, "micro_batch_size");
  check_positive(vocab_size, "vocab_size");
  check_dropout(attention_dropout, "attention_dropout");
  check_dropout(hidden_dropout, "hidden_dropout");
  TORCH_CHECK(
      normalization == "LayerNorm" || normalization == "RMSNorm",
      "actmem::TransformerConfig: normalization must be \"LayerNorm\" or \"RMSNorm\", got \"",
      normalization, "\"");
  TORCH_CHECK(layernorm_epsilon > 0.0,
              "actmem::TransformerConfig: layernorm_epsilon must be "
              "positive, got ",
              layernorm_epsilon);
  TORCH_CHECK(position_embedding_type == "learned_absolute" || position_embedding_type == "rope" ||
                  position_embedding_type == "none",
              "actmem::TransformerConfig: position_embedding_type must be \"learned_absolute\", "
              "\"rope\" or \"none\", got \"",
              position_embedding_type, "\"");
  TORCH_CHECK(std::isfinite(rotary_percent) && rotary_percent > 0.0 && rotary_percent <= 1.0,
              "actmem::TransformerConfig: rotary_percent must be in (0, 1], got ", rotary_percent);
  TORCH_CHECK(rotary_percent == 1.0 || use_rope(), "actmem::TransformerConfig: --rotary-percent ",
              rotary_percent, " applies to rotary positions; add --position-embedding-type rope");
  TORCH_CHECK(!model_rope() || (rotary_dim() > 0 && rotary_dim() % 2 == 0),
              "actmem::TransformerConfig: rope needs an even head dimension (it rotates pairs "
              "of features): the rotated part of a head, int(kv_channels ",
              kv_channels(), " x rotary_percent ", rotary_percent, ") = ", rotary_dim(),
              ", must be even and positive");
  TORCH_CHECK(rotary_base > 0.0, "actmem::TransformerConfig: rotary_base must be positive, got ",
              rotary_base);
  TORCH_CHECK(init_method_std > 0.0,
              "actmem::TransformerConfig: init_method_std must be "
              "positive, got ",
              init_method_std);
  TORCH_CHECK(seed >= 1 && seed <= kMaxSeed, "actmem::TransformerConfig: seed must be in [1, ",
              kMaxSeed, "] (Megatron requires seed > 0), got ", seed);
  // Megatron's arguments.py: "assert not args.bf16" under fp16, and the converse.
  TORCH_CHECK(!(bf16 && fp16),
              "actmem::TransformerConfig: bf16 and fp16 are exclusive; choose "
              "one of --bf16 and --fp16");
  // Tensor and sequence parallelism (docs/parallelism.md): heads, the MLP's columns and, with
  // sequence parallelism, the sequence are split evenly across the t ranks.
  const int64_t t = tensor_model_parallel_size;
  check_positive(t, "tensor_model_parallel_size");
  TORCH_CHECK(num_attention_heads % t == 0, "actmem::TransformerConfig: num_attention_heads (",
              num_attention_heads, ") must be divisible by tensor_model_parallel_size (", t, ")");
  // Grouped-query attention: Megatron's TransformerConfig.__post_init__ (its message) and the
  // fused QKV layout (whole groups of num_attention_heads / num_query_groups query heads).
  const int64_t g = query_groups();
  TORCH_CHECK(g >= 1 && num_attention_heads % g == 0,
              "actmem::TransformerConfig: "
              "num_query_groups (",
              g, ") must divide num_attention_heads (", num_attention_heads, ")");
  TORCH_CHECK(g % t == 0 || t % g == 0, "actmem::TransformerConfig: num_query_groups (", g,
              ") must be a multiple or divisor of tensor_model_parallel_size (", t, ").");
  TORCH_CHECK(g % t == 0, "actmem::TransformerConfig: num_query_groups (", g,
              ") smaller than "
              "tensor_model_parallel_size (",
              t,
              ") is not implemented (Megatron all-gathers the "
              "fused QKV output then); give a multiple of the tensor-parallel size");
  TORCH_CHECK(!multi_latent_attention || num_query_groups == 0,
              "actmem::TransformerConfig: "
              "Group query attention is mutually exclusive with multi latent attention.");
  TORCH_CHECK(ffn() % t == 0, "actmem::TransformerConfig: ffn_hidden_size (", ffn(),
              ") must be divisible by tensor_model_parallel_size (", t, ")");
  validate_pipeline(*this);
  TORCH_CHECK(!sequence_parallel || t > 1,
              "actmem::TransformerConfig: "
              "sequence_parallel requires tensor_model_parallel_size > 1");
  TORCH_CHECK(!sequence_parallel || seq_length % t == 0,
              "actmem::TransformerConfig: "
              "sequence_parallel needs seq_length (",
              seq_length,
              ") divisible by "
              "tensor_model_parallel_size (",
              t, ")");
  validate_moe(*this);
  validate_mla(*this);
  validate_gdn(*this);
  validate_quantization();
  attention_choice();  // a backend this configuration cannot run is refused here
  // The recompute and offload rules live with the plan they decide (activation_plan.cpp).
}

const char* to_string(AttentionKernel kernel) {
  return kernel == AttentionKernel::kFlash ? "flash" : "unfused";
}

// Note [Attention backends]
// Megatron's --attention-backend picks among TransformerEngine's kernels (flash, fused = cuDNN,
// unfused), or the local (non-TE) spec, whose core attention is unfused too; auto lets TE choose
// flash, then fused, then unfused by what each supports. actmem's kernels are libtorch's: the
// unfused path (model/attention/attention.cpp: scores, mask, softmax, dropout and the product with
// V, each kept for backward as Korthikanti et al. count them) and scaled-dot-product attention's
// flash kernel (at::_scaled_dot_product_flash_attention_for_cpu): online softmax, backward
// recomputes the probabilities inside the kernel, so it keeps only q, k, v, its output and the
// logsumexp per row (4 a s b bytes in fp32) -- the paper's 5as^2b term is gone
// (docs/memory-model.md, "Attention backends"). That kernel has no attention dropout (it refuses
// dropout_p > 0) and needs one head dimension for q, k and v; it takes fewer key/value heads than
// query heads as they are (GQA without repeating K and V). So auto, Megatron's default and
// actmem's, runs flash when the attention dropout is 0 and the head dims agree, and the unfused
// path otherwise, saying why. fused (cuDNN) and CUDA's flash and memory-efficient SDPA kernels are
// not wired: no GPU has been lent to check them, so an explicit fused is refused and a CUDA run of
// flash is refused at the trainer.
TransformerConfig::AttentionChoice TransformerConfig::attention_choice() const {
  const std::string& b = attention_backend;
  TORCH_CHECK(b == "auto" || b == "flash" || b == "fused" || b == "unfused" || b == "local",
              "actmem::TransformerConfig: attention_backend must be one of flash, fused, unfused, "
              "local, auto (Megatron's AttnBackend), got \"",
              b, "\"");
  TORCH_CHECK(b != "fused",
              "actmem::TransformerConfig: attention_backend fused is TransformerEngine's "
              "cuDNN attention in Megatron; its counterpart here would be a CUDA kernel of "
              "scaled-dot-product attention, which actmem does not run yet (no GPU to check it "
              "on). Use flash (no s x s tensors kept) or unfused");
  if (b == "unfused" || b == "local") {
    return {AttentionKernel::kUnfused,
            b == "local" ? "requested (local: Megatron's non-TE spec, whose core attention is "
                           "unfused)"
                         : "requested"};
  }
  // What keeps the flash kernel out, if anything.
  std::string blocker;
  if (multi_latent_attention) {
    std::ostringstream os;
    os << "multi-latent attention runs on the unfused path only (its query/key head dim "
       << mla_q_head_dim() << " and value head dim " << v_head_dim
       << "; the flash kernel needs one head dim, and MLA is not wired to it)";
    blocker = os.str();
  } else if (attention_dropout > 0.0) {
    std::ostringstream os;
    os << "the flash kernel cannot drop attention probabilities (attention_dropout "
       << attention_dropout << ")";
    blocker = os.str();
  }
  if (b == "flash") {
    TORCH_CHECK(blocker.empty(), "actmem::TransformerConfig: attention_backend flash: ", blocker,
                blocker.rfind("the flash", 0) == 0 ? "; set --attention-dropout 0, or use "
                                                     "--attention-backend unfused or auto"
                                                   : "; use --attention-backend unfused or auto");
    return {AttentionKernel::kFlash, "requested"};
  }
  if (!blocker.empty()) return {AttentionKernel::kUnfused, "auto: unfused, because " + blocker};
  return {AttentionKernel::kFlash, "auto: flash, since the attention dropout is 0"};
}

std::string TransformerConfig::attention_summary() const {
  const AttentionChoice choice = attention_choice();
  return std::string(to_string(choice.kernel)) + " (" + choice.why + ")";
}

nlohmann::json to_json(const TransformerConfig& c) {
  nlohmann::json j = {
      {"num_layers", c.num_layers},
      {"hidden_size", c.hidden_size},
      {"num_attention_heads", c.num_attention_heads},
      {"group_query_attention", c.grouped_query_attention()},
      {"num_query_groups",
       c.multi_latent_attention ? nlohmann::json(nullptr) : nlohmann::json(c.query_groups())},
      {"ffn_hidden_size", c.ffn()},
      {"seq_length", c.seq_length},
      {"max_position_embeddings", c.max_positions()},
      {"micro_batch_size", c.micro_batch_size},
      {"vocab_size", c.vocab_size},
      {"attention_dropout", c.attention_dropout},
      {"hidden_dropout", c.hidden_dropout},
      {"attention_backend", c.attention_backend},
      {"attention_kernel", to_string(c.attention_kernel())},
      {"normalization", c.normalization},
      {"layernorm_epsilon", c.layernorm_epsilon},
      {"gated_linear_unit", c.gated_linear_unit},
      {"add_bias_linear", c.add_bias_linear},
      {"position_embedding_type", c.position_embedding_type},
      {"rotary_base", c.rotary_base},
      {"rotary_percent", c.rotary_percent},
      {"kv_channels",
       c.multi_latent_attention ? nlohmann::json(nullptr) : nlohmann::json(c.kv_channels())},
      {"apply_layernorm_1p", c.layernorm_zero_centered_gamma},
      {"qk_layernorm", c.qk_layernorm},
      {"attention_output_gate", c.attention_output_gate},
      {"untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights},
      {"init_method_std", c.init_method_std},
      {"seed", c.seed},
      {"precision", c.precision()},
      {"bf16", c.bf16},
      {"fp16", c.fp16},
      {"attention_softmax_in_fp32", c.attention_softmax_in_fp32},
      {"tensor_model_parallel_size", c.tensor_model_parallel_size},
      {"pipeline_model_parallel_size", c.pipeline_model_parallel_size},
      {"sequence_parallel", c.sequence_parallel},
      {"recompute_granularity", c.recompute_granularity.empty()
                                    ? nlohmann::json(nullptr)
                                    : nlohmann::json(c.recompute_granularity)},
      {"recompute_method",
       c.recompute_method.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.recompute_method)},
      {"recompute_num_layers",
       c.recompute_num_layers ? nlohmann::json(*c.recompute_num_layers) : nlohmann::json(nullptr)},
      {"recompute_modules", c.recompute_granularity == "selective"
                                ? make_activation_plan(c).to_json()["recompute_modules"]
                                : nlohmann::json(nullptr)},
      {"distribute_saved_activations", c.distribute_saved_activations},
      {"cpu_offloading_num_layers", c.cpu_offloading_num_layers},
      {"fine_grained_activation_offloading", c.fine_grained_activation_offloading},
      {"offload_modules", c.offload_modules},
      {"fine_grained_offloading_max_inflight_offloads",
       c.fine_grained_offloading_max_inflight_offloads},
      {"min_offloaded_tensor_size", c.min_offloaded_tensor_size},
      {"num_moe_experts", c.is_moe() ? nlohmann::json(c.num_moe_experts) : nlohmann::json(nullptr)},
  };
  auto opt = [](const auto& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  j["decoder_first_pipeline_num_layers"] = opt(c.decoder_first_pipeline_num_layers);
  j["decoder_last_pipeline_num_layers"] = opt(c.decoder_last_pipeline_num_layers);
  j["virtual_pipeline_model_parallel_size"] = c.virtual_pipeline_size() > 1
                                                  ? nlohmann::json(c.virtual_pipeline_size())
                                                  : nlohmann::json(nullptr);
  if (c.virtual_pipeline_size() > 1) {
    j["microbatch_group_size_per_vp_stage"] = c.microbatch_group_size();
  }
  j["experimental_attention_variant"] =
      c.gated_delta_net() ? nlohmann::json("gdn") : nlohmann::json(nullptr);
  if (c.gated_delta_net()) {
    j["linear_attention_freq"] = c.linear_attention_freq;
    j["linear_conv_kernel_dim"] = c.linear_conv_kernel_dim;
    j["linear_key_head_dim"] = c.linear_key_head_dim;
    j["linear_value_head_dim"] = c.linear_value_head_dim;
    j["linear_num_key_heads"] = c.linear_num_key_heads;
    j["linear_num_value_heads"] = c.linear_num_value_heads;
  }
  j["multi_latent_attention"] = c.multi_latent_attention;
  if (c.multi_latent_attention) {
    j["q_lora_rank"] = opt(c.q_lora_rank);
    j["kv_lora_rank"] = c.kv_lora_rank;
    j["qk_head_dim"] = c.qk_head_dim;
    j["qk_pos_emb_head_dim"] = c.qk_pos_emb_head_dim;
    j["v_head_dim"] = c.v_head_dim;
    j["rope_type"] = c.resolved_rope_type();
    j["rotary_scaling_factor"] = c.rotary_scaling_factor;
    j["mscale"] = c.mscale;
    j["mscale_all_dim"] = c.mscale_all_dim;
  }
  if (c.is_moe()) {
    j["moe_router_topk"] = c.moe_router_topk;
    j["moe_ffn_hidden_size"] = c.moe_ffn();
    j["moe_layer_freq"] = c.moe_layer_freq;
    j["moe_router_load_balancing_type"] = c.moe_router_load_balancing_type;
    j["moe_aux_loss_coeff"] = c.moe_aux_loss_coeff;
    j["moe_z_loss_coeff"] = opt(c.moe_z_loss_coeff);
    j["moe_router_score_function"] = c.moe_router_score_function;
    j["moe_router_pre_softmax"] = c.moe_router_pre_softmax;
    j["moe_router_dtype"] =
        c.moe_router_dtype.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.moe_router_dtype);
    j["moe_router_topk_scaling_factor"] = opt(c.moe_router_topk_scaling_factor);
    j["moe_shared_expert_intermediate_size"] = opt(c.moe_shared_expert_intermediate_size);
    j["moe_shared_expert_gate"] = c.moe_shared_expert_gate;
    j["moe_expert_capacity_factor"] = opt(c.moe_expert_capacity_factor);
    j["moe_pad_expert_input_to_capacity"] = c.moe_pad_expert_input_to_capacity;
    j["moe_token_drop_policy"] = c.moe_token_drop_policy;
    j["moe_grouped_gemm"] = c.moe_grouped_gemm;
    j["moe_token_dispatcher_type"] = c.moe_token_dispatcher_type;
    j["expert_model_parallel_size"] = c.expert_model_parallel_size;
    j["moe_expert_dropout"] = c.moe_expert_dropout;
  }
  if (!c.fp8.empty() || !c.fp4.empty()) j["quantization"] = quantization_json(c);
  return j;
}

}  // namespace actmem
