// checkpoint.cpp — Megatron's checkpoint layout: the directories and files of an iteration, what
// a Trainer writes into a checkpoint and restores from it, and the model a checkpoint describes.
// One file's bytes are checkpoint_file.cpp's, the save protocol's moves durable_write.cpp's.
#include "actmem/train/checkpoint.h"

#include "checkpoint_io.h"

#include "actmem/data/data.h"
#include "actmem/model/model.h"
#include "actmem/parallel/distributed_optimizer.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/rng.h"
#include "actmem/train/mixed_precision.h"
#include "actmem/train/optimizer.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/optim/adamw.h>

#include <nlohmann/json.hpp>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>

namespace actmem {

namespace {
// lr_warmup_steps as Megatron's state_dict holds it: samples, an int, or a float when
// --lr-warmup-fraction made it one.
c10::IValue warmup_steps_value(const LrScheduleSteps& steps) {
  const double w = steps.warmup;
  if (w == std::floor(w)) return c10::IValue(static_cast<int64_t>(w));
  return c10::IValue(w);
}
}  // namespace

namespace fs = std::filesystem;

namespace {
// A parameter's entry in the optimizer's state map: its TensorImpl's address.
void* state_key(const at::Tensor& p) {
  return p.unsafeGetTensorImpl();
}

c10::impl::GenericDict string_dict() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

at::Tensor host_copy(const at::Tensor& t) {
  return t.detach().to(at::kCPU).contiguous().clone();
}

const c10::IValue& entry(const c10::impl::GenericDict& d, const std::string& key,
                         const std::string& path) {
  const auto it = d.find(key);
  TORCH_CHECK(it != d.end(), "actmem::Trainer::load_checkpoint: ", path, " has no '", key,
              "' entry; it is not a checkpoint written by actmem or Megatron-LM");
  return it->value();
}

c10::impl::GenericDict dict_entry(const c10::impl::GenericDict& d, const std::string& key,
                                  const std::string& path) {
  const c10::IValue& v = entry(d, key, path);
  TORCH_CHECK(v.isGenericDict(), "actmem::Trainer::load_checkpoint: ", path, ": '", key,
              "' is not a dict");
  return v.toGenericDict();
}

// Whole tensors shaped like `full` from this rank's `pieces` of them and every other
// data-parallel rank's (OptimizerShards::all_gather).
std::vector<at::Tensor> unshard(const OptimizerShards& shards, const std::vector<at::Tensor>& full,
                                const std::vector<at::Tensor>& pieces) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> whole;
  for (const auto i : c10::irange(full.size())) {
    whole.push_back(at::zeros(full[i].sizes(), pieces[i].options()));
    shards.shard(whole.back(), i).copy_(pieces[i]);
  }
  shards.all_gather(whole);
  return whole;
}

// An AdamW's per-parameter moments (null where no step was taken yet).
struct AdamWMoments {
  std::vector<int64_t> step;  // -1: no state
  std::vector<at::Tensor> exp_avg, exp_avg_sq;
};

AdamWMoments adamw_moments(torch::optim::AdamW& opt, const std::vector<at::Tensor>& params) {
  AdamWMoments m;
  for (const auto& p : params) {
    const auto it = opt.state().find(state_key(p));
    const auto* s = it == opt.state().end()
                        ? nullptr
                        : &static_cast<const torch::optim::AdamWParamState&>(*it->second);
    m.step.push_back(s ? s->step() : -1);
    m.exp_avg.push_back(s ? s->exp_avg() : at::Tensor());
    m.exp_avg_sq.push_back(s ? s->exp_avg_sq() : at::Tensor());
  }
  return m;
}

// With the distributed optimizer the moments are this rank's pieces of the parameters whose
// shapes `full` gives: every rank's pieces are gathered into whole tensors, so that the
// checkpoint is the same as without it (a collective over the data-parallel ranks).
AdamWMoments unshard(const OptimizerShards& shards, const std::vector<at::Tensor>& full,
                     AdamWMoments m) {
  const bool any = std::any_of(m.step.begin(), m.step.end(), [](int64_t s) { return s >= 0; });
  if (!any) return m;  // no step taken yet, on any rank
  TORCH_CHECK(std::all_of(m.step.begin(), m.step.end(), [](int64_t s) { return s >= 0; }),
              "actmem::Trainer::save_checkpoint: the distributed optimizer has state for some "
              "parameters only");
  m.exp_avg = unshard(shards, full, m.exp_avg);
  m.exp_avg_sq = unshard(shards, full, m.exp_avg_sq);
  return m;
}

// An AdamW's per-parameter state as torch's Optimizer.state_dict() lays it out:
// {"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{..., "params": [0..n)}]}.
c10::impl::GenericDict adamw_state_dict(torch::optim::AdamW& opt, const AdamWMoments& m) {
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (const auto i : c10::irange(m.step.size())) {
    if (m.step[i] < 0) continue;
    auto d = string_dict();
    d.insert("step", m.step[i]);
    d.insert("exp_avg", host_copy(m.exp_avg[i]));
    d.insert("exp_avg_sq", host_copy(m.exp_avg_sq[i]));
    state.insert(static_cast<int64_t>(i), d);
  }
  const auto& o = static_cast<const torch::optim::AdamWOptions&>(opt.param_groups()[0].options());
  auto group = string_dict();
  group.insert("lr", o.lr());
  group.insert("betas", c10::List<double>({std::get<0>(o.betas()), std::get<1>(o.betas())}));
  group.insert("eps", o.eps());
  group.insert("weight_decay", o.weight_decay());
  group.insert("amsgrad", o.amsgrad());
  c10::List<int64_t> ids;
  for (const auto i : c10::irange(m.step.size())) ids.push_back(static_cast<int64_t>(i));
  group.insert("params", ids);
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);
  auto out = string_dict();
  out.insert("state", state);
  out.insert("param_groups", groups);
  return out;
}

// With the distributed optimizer (`shards`) `params` are this rank's pieces of the parameters
// whose shapes `full` gives; each takes its elements of the saved whole tensors.
void load_adamw_state(torch::optim::AdamW& opt, const std::vector<at::Tensor>& params,
                      const c10::impl::GenericDict& sd, const std::string& path,
                      const OptimizerShards* shards = nullptr,
                      const std::vector<at::Tensor>& full = {}) {
  const c10::IValue& state_v = entry(sd, "state", path);
  TORCH_CHECK(state_v.isGenericDict(), "actmem::Trainer::load_checkpoint: ", path,
              ": the optimizer state is not a dict");
  opt.state().clear();
  for (const auto& e : state_v.toGenericDict()) {
    TORCH_CHECK(e.key().isInt() && e.key().toInt() >= 0 &&
                    e.key().toInt() < static_cast<int64_t>(params.size()) &&
                    e.value().isGenericDict(),
                "actmem::Trainer::load_checkpoint: ", path, ": optimizer state entry ", e.key(),
                " does not belong to any of this model's ", params.size(), " parameters");
    const auto index = static_cast<size_t>(e.key().toInt());
    const at::Tensor& p = params[index];
    const at::IntArrayRef shape = shards ? full[index].sizes() : p.sizes();
    const auto d = e.value().toGenericDict();
    auto tensor = [&](const char* name) {
      const at::Tensor t = entry(d, name, path).toTensor();
      TORCH_CHECK(t.sizes() == shape && t.scalar_type() == p.scalar_type(),
                  "actmem::Trainer::load_checkpoint: ", path, ": optimizer ", name,
                  " of parameter ", e.key().toInt(), " is ", t.sizes(), " ", t.scalar_type(),
                  ", expected ", shape, " ", p.scalar_type());
      const at::Tensor here = t.to(p.device());
      return (shards ? shards->shard(here.contiguous(), index) : here).clone();
    };
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(entry(d, "step", path).toInt());
    s->exp_avg(tensor("exp_avg"));
    s->exp_avg_sq(tensor("exp_avg_sq"));
    opt.state()[state_key(p)] = std::move(s);
  }
}

// The fields of args a checkpoint must agree with this run on: the ones that decide the
// parameters' names, shapes and types, and the tensor-parallel layout.
constexpr const char* kShapeFields[] = {"num_layers",
                                        "hidden_size",
                                        "num_attention_heads",
                                        "ffn_hidden_size",
                                        "vocab_size",
                                        "normalization",
                                        "gated_linear_unit",
                                        "add_bias_linear",
                                        "position_embedding_type",
                                        "untie_embeddings_and_output_weights",
                                        "tensor_model_parallel_size",
                                        "precision"};

// "mp_rank_03", "mp_rank_03_001" (expert rank 1 or pipeline stage 1), "mp_rank_03_002_001"
// (stage 2, expert rank 1): Megatron's get_checkpoint_name.
std::string rank_dir_name(int64_t tp_rank, int64_t ep_rank = -1, int64_t pp_rank = -1) {
  std::ostringstream os;
  os << "mp_rank_" << std::setw(2) << std::setfill('0') << tp_rank;
  if (pp_rank >= 0) os << "_" << std::setw(3) << std::setfill('0') << pp_rank;
  if (ep_rank >= 0) os << "_" << std::setw(3) << std::setfill('0') << ep_rank;
  return os.str();
}

// This rank's expert-parallel rank for its file name: -1 without expert parallelism.
int64_t file_ep_rank() {
  return expert_parallel_group().size > 1 ? expert_parallel_group().rank : -1;
}

// This rank's pipeline stage for its file name: -1 without pipeline parallelism.
int64_t file_pp_rank() {
  return pipeline_parallel_group().size > 1 ? pipeline_parallel_group().rank : -1;
}

}  // namespace

std::string checkpoint_iteration_dir(const std::string& dir, int64_t iteration) {
  std::ostringstream os;
  os << "iter_" << std::setw(7) << std::setfill('0') << iteration;
  return (fs::path(dir) / os.str()).string();
}

std::string checkpoint_file(const std::string& dir, int64_t iteration, int64_t tp_rank,
                            int64_t ep_rank, int64_t pp_rank) {
  return (fs::path(checkpoint_iteration_dir(dir, iteration)) /
          rank_dir_name(tp_rank, ep_rank, pp_rank) / "model_optim_rng.pt")
      .string();
}

std::optional<int64_t> read_latest_checkpointed_iteration(const std::string& dir) {
  const fs::path path = fs::path(dir) / kLatestCheckpointFile;
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  TORCH_CHECK(text != "release", "actmem::read_latest_checkpointed_iteration: ", path.string(),
              " names a 'release' checkpoint (a converted model); actmem loads iteration "
              "checkpoints only");
  int64_t iteration = -1;
  const bool digits = !text.empty() && text.size() <= 18 &&
                      text.find_first_not_of("0123456789") == std::string::npos;
  if (digits) iteration = std::stoll(text);
  TORCH_CHECK(digits, "actmem::read_latest_checkpointed_iteration: ", path.string(),
              " should hold an iteration number, found '", text.substr(0, 40), "'");
  return iteration;
}

// ---- Trainer: what a checkpoint holds ----------------------------------------------------------

void load_model_state(GPTModel& model, const c10::impl::GenericDict& ckpt,
                      const std::string& path) {
  const c10::impl::GenericDict state = dict_entry(ckpt, "model", path);
  const auto named = model.named_parameters(/*recurse=*/true);
  for (const auto& e : state) {
    TORCH_CHECK(e.key().isString() && named.find(e.key().toStringRef()) != nullptr,
                "actmem::load_checkpoint: ", path,
                " has a parameter this model does not: ", e.key());
  }
  at::NoGradGuard no_grad;
  for (const auto& item : named) {
    const auto it = state.find(item.key());
    TORCH_CHECK(it != state.end() && it->value().isTensor(), "actmem::load_checkpoint: ", path,
                " has no tensor for parameter ", item.key());
    const at::Tensor t = it->value().toTensor();
    at::Tensor p = item.value();
    TORCH_CHECK(t.sizes() == p.sizes() && t.scalar_type() == p.scalar_type(),
                "actmem::load_checkpoint: ", item.key(), " is ", t.sizes(), " ", t.scalar_type(),
                " in ", path, " but ", p.sizes(), " ", p.scalar_type(), " in this model");
    p.copy_(t);
  }
  if (model.fp8() && ckpt.contains("fp8_scaling"))
    load_fp8_scaling_state(model, dict_entry(ckpt, "fp8_scaling", path), path);
}

TransformerConfig config_from_args(const nlohmann::json& a) {
  TransformerConfig c;
  // A field of the wrong JSON type (a damaged or hand-edited checkpoint) is a clear error naming
  // it, not nlohmann's type_error escaping the library's TORCH_CHECK contract.
  auto read = [&a](const char* key, auto& field) {
    try {
      field = a[key].get<std::decay_t<decltype(field)>>();
    } catch (const nlohmann::json::exception&) {
      const std::string value = a[key].dump();
      TORCH_CHECK(false, "actmem::config_from_args: the checkpoint's args field ", key, " is ",
                  value.size() > 64 ? value.substr(0, 64) + "..." : value,
                  ", not a value of the field's type");
    }
  };
  auto get = [&a, &read](const char* key, auto& field) {
    if (a.contains(key) && !a[key].is_null()) read(key, field);
  };
  auto get_opt = [&a, &read](const char* key, auto& field) {  // an optional field; null = unset
    if (a.contains(key) && !a[key].is_null()) {
      typename std::decay_t<decltype(field)>::value_type v{};
      read(key, v);
      field = v;
    }
  };
  get("num_layers", c.num_layers);
  get("hidden_size", c.hidden_size);
  get("num_attention_heads", c.num_attention_heads);
  get("num_query_groups", c.num_query_groups);
  if (c.num_query_groups == c.num_attention_heads) c.num_query_groups = 0;  // one per head
  get("ffn_hidden_size", c.ffn_hidden_size);
  get("seq_length", c.seq_length);
  get("max_position_embeddings", c.max_position_embeddings);
  get("vocab_size", c.vocab_size);
  get("attention_dropout", c.attention_dropout);
  get("hidden_dropout", c.hidden_dropout);
  get("normalization", c.normalization);
  get("layernorm_epsilon", c.layernorm_epsilon);
  get("gated_linear_unit", c.gated_linear_unit);
  get("add_bias_linear", c.add_bias_linear);
  get("position_embedding_type", c.position_embedding_type);
  get("rotary_base", c.rotary_base);
  get("rotary_percent", c.rotary_percent);
  get("apply_layernorm_1p", c.layernorm_zero_centered_gamma);
  get("qk_layernorm", c.qk_layernorm);
  get("attention_output_gate", c.attention_output_gate);
  std::optional<int64_t> kv_channels;
  get_opt("kv_channels", kv_channels);
  if (kv_channels && c.num_attention_heads > 0 &&
      *kv_channels * c.num_attention_heads != c.hidden_size) {
    c.kv_channels_arg = kv_channels;
  }
  get("untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights);
  get("init_method_std", c.init_method_std);
  get("seed", c.seed);
  get("bf16", c.bf16);
  get("fp16", c.fp16);
  get("attention_softmax_in_fp32", c.attention_softmax_in_fp32);
  quantization_from_json(a, c);
  get("tensor_model_parallel_size", c.tensor_model_parallel_size);
  get("multi_latent_attention", c.multi_latent_attention);
  if (c.multi_latent_attention) {
    get_opt("q_lora_rank", c.q_lora_rank);
    get("kv_lora_rank", c.kv_lora_rank);
    get("qk_head_dim", c.qk_head_dim);
    get("qk_pos_emb_head_dim", c.qk_pos_emb_head_dim);
    get("v_head_dim", c.v_head_dim);
    get("rope_type", c.rope_type);
    get("rotary_scaling_factor", c.rotary_scaling_factor);
    get("mscale", c.mscale);
    get("mscale_all_dim", c.mscale_all_dim);
  }
  get("num_moe_experts", c.num_moe_experts);
  if (c.is_moe()) {
    get("moe_router_topk", c.moe_router_topk);
    int64_t moe_ffn = 0;
    get("moe_ffn_hidden_size", moe_ffn);
    if (moe_ffn > 0) c.moe_ffn_hidden_size = moe_ffn;
    get("moe_layer_freq", c.moe_layer_freq);
    get("moe_router_score_function", c.moe_router_score_function);
    get("moe_router_pre_softmax", c.moe_router_pre_softmax);
    get("moe_router_dtype", c.moe_router_dtype);  // null: the model's type
    get_opt("moe_router_topk_scaling_factor", c.moe_router_topk_scaling_factor);
    get_opt("moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size);
    get("moe_shared_expert_gate", c.moe_shared_expert_gate);
    get_opt("moe_expert_capacity_factor", c.moe_expert_capacity_factor);
    get("moe_pad_expert_input_to_capacity", c.moe_pad_expert_input_to_capacity);
    get("moe_token_drop_policy", c.moe_token_drop_policy);
    get("moe_grouped_gemm", c.moe_grouped_gemm);
    get("moe_token_dispatcher_type", c.moe_token_dispatcher_type);
    get("expert_model_parallel_size", c.expert_model_parallel_size);
  }
  c.micro_batch_size = 1;
  return c;
}

LoadedModel load_model_for_inference(const std::string& dir) {
  const std::optional<int64_t> latest = read_latest_checkpointed_iteration(dir);
  TORCH_CHECK(latest.has_value(), "actmem::load_model_for_inference: ", dir, " has no ",
              kLatestCheckpointFile, " (train with --save ", dir, " first)");
  LoadedModel out;
  out.path = checkpoint_file(dir, *latest, 0);
  std::error_code ec;
  // mp_rank_00_000 is expert rank 0's file or stage 0's (Megatron's names): its args tell which;
  // mp_rank_00_000_000 is stage 0's and expert rank 0's.
  std::string split = checkpoint_file(dir, *latest, 0, 0);
  if (!fs::exists(split, ec)) split = checkpoint_file(dir, *latest, 0, 0, 0);
  if (!fs::exists(out.path, ec) && fs::exists(split, ec)) {
    const nlohmann::json args = ivalue_to_json(entry(read_checkpoint_file(split), "args", split));
    const bool pipeline = args.value("pipeline_model_parallel_size", int64_t{1}) > 1;
    const bool experts = args.value("expert_model_parallel_size", int64_t{1}) > 1;
    TORCH_CHECK(false, "actmem::load_model_for_inference: ", dir, " was saved with ",
                pipeline && experts ? "pipeline and expert parallelism (one file per stage and "
                                      "expert-parallel rank, "
                : pipeline          ? "pipeline parallelism (one file per stage, "
                                    : "expert parallelism (one file per expert-parallel rank, ",
                split, ", ...); inference loads a single-process checkpoint: train with ",
                pipeline && experts
                    ? "--pipeline-model-parallel-size 1 --expert-model-parallel-size 1"
                : pipeline ? "--pipeline-model-parallel-size 1"
                           : "--expert-model-parallel-size 1",
                " or load it under the same launch with --load");
  }
  const c10::impl::GenericDict ckpt = read_checkpoint_file(out.path);
  const nlohmann::json args = ivalue_to_json(entry(ckpt, "args", out.path));
  out.args_json = args.dump();
  out.iteration = entry(ckpt, "iteration", out.path).toInt();
  const TransformerConfig config = config_from_args(args);
  TORCH_CHECK(config.tensor_model_parallel_size == 1,
              "actmem::load_model_for_inference: ", out.path, " is one of ",
              config.tensor_model_parallel_size,
              " tensor-parallel shards; "
              "generation loads a checkpoint of tensor_model_parallel_size 1");
  config.validate_shape();
  out.model = std::make_shared<GPTModel>(config);
  load_model_state(*out.model, ckpt, out.path);
  out.model->eval();
  return out;
}

namespace {
int64_t consumed_samples(const TrainState& s) {
  return s.train_data.batches_drawn() * s.model_config.micro_batch_size;
}

// Every replica's random states, one list entry per expert-data-parallel rank (a collective).
c10::impl::GenericList replica_rng_states(const TrainState& s);

// The checkpoint file's dict; a collective over the data-parallel replicas, each calling it, only
// the writers (`write`) building the dict.
c10::impl::GenericDict checkpoint_state(const TrainState& s, bool write) {
  // The collectives first, on every replica (save_checkpoint): each replica's random streams, and
  // with the distributed optimizer every data-parallel rank's pieces of the optimizer state.
  const c10::impl::GenericList rng_list = replica_rng_states(s);
  MixedPrecisionOptimizer* mixed = s.optimizer.mixed();
  const OptimizerShards* shards = s.optimizer.shards();
  const std::vector<at::Tensor>& params = s.optimizer.params();
  torch::optim::AdamW& adamw = s.optimizer.adamw();
  AdamWMoments moments = adamw_moments(adamw, s.optimizer.adamw_params());
  std::vector<at::Tensor> mains;
  if (mixed) mains = mixed->main_params();
  if (shards) {
    moments = unshard(*shards, params, std::move(moments));
    if (mixed) mains = unshard(*shards, params, mains);
  }
  auto top = string_dict();
  if (!write) return top;
  nlohmann::json args = to_json(s.model_config);
  // Megatron's args are flat (args.fp8, args.fp8_recipe, ...).
  if (args.contains("quantization")) {
    for (const auto& [k, v] : args["quantization"].items()) args[k] = v;
    args.erase("quantization");
  }
  const nlohmann::json training = to_json(s.config);
  for (const auto& [k, v] : training.items()) args[k] = v;
  args["iteration"] = s.iteration;
  args["consumed_train_samples"] = consumed_samples(s);
  top.insert("args", json_to_ivalue(args));
  top.insert("checkpoint_version", kCheckpointVersion);
  top.insert("iteration", s.iteration);

  c10::impl::GenericDict model(c10::StringType::get(), c10::TensorType::get());
  for (const auto& item : s.model.named_parameters(/*recurse=*/true)) {
    model.insert(item.key(), host_copy(item.value()));
  }
  top.insert("model", model);
  if (s.model.fp8()) top.insert("fp8_scaling", fp8_scaling_state(s.model));

  if (mixed) {
    // Megatron's Float16OptimizerWithFloat16Params.state_dict().
    auto opt = string_dict();
    opt.insert("optimizer", adamw_state_dict(adamw, moments));
    if (const auto& scaler = mixed->scaler()) {
      auto gs = string_dict();
      gs.insert("scale", static_cast<double>(scaler->scale()));
      gs.insert("growth_tracker", scaler->growth_tracker());
      gs.insert("hysteresis_tracker", scaler->hysteresis_left());
      opt.insert("grad_scaler", gs);
    } else {
      opt.insert("grad_scaler", c10::IValue());
    }
    c10::List<at::Tensor> main_list;
    for (const auto& p : mains) main_list.push_back(host_copy(p));
    c10::impl::GenericList groups(c10::AnyType::get());
    groups.push_back(main_list);
    opt.insert("fp32_from_fp16_params", groups);
    top.insert("optimizer", opt);
  } else {
    top.insert("optimizer", adamw_state_dict(adamw, moments));
  }

  // Megatron's OptimizerParamScheduler.state_dict(): its steps count samples.
  const TrainingConfig& c = s.config;
  const LrScheduleSteps& steps = s.scheduler.steps();
  auto sched = string_dict();
  sched.insert("max_lr", c.lr);
  sched.insert("min_lr", c.min_lr);
  sched.insert("lr_warmup_steps", warmup_steps_value(steps));
  sched.insert("lr_decay_steps", steps.decay);
  sched.insert("lr_decay_style", c.lr_decay_style);
  sched.insert("num_steps", s.scheduler.num_samples());
  top.insert("opt_param_scheduler", sched);

  top.insert("rng_state", rng_list);
  return top;
}

c10::impl::GenericList replica_rng_states(const TrainState& s) {
  // Megatron's rng_state with data_parallel_random_init: one entry per data-parallel replica (of
  // the ranks that write this file: the expert-data-parallel group), since the replicas' streams
  // can differ: expert dropout draws per token routed to the rank's experts, and those counts
  // follow each replica's own data. Every state is gathered in one order on every replica.
  const TensorParallelGroup& replicas = expert_data_parallel_group();
  std::vector<std::pair<std::string, at::Tensor>> states = {{"torch_rng_state", s.rng_state[0]}};
  if (s.rng_state.size() > 1) states.emplace_back("cuda_rng_state", s.rng_state[1]);
  const auto streams = s.rng_tracker.get_states();  // a std::map: the same order everywhere
  for (const auto& [name, state] : streams) states.emplace_back(name, state);
  std::vector<at::Tensor> gathered;  // per state: [replicas, bytes] on the host
  for (const auto& [name, state] : states) {
    const at::Tensor bytes = state.to(at::kCPU).contiguous().view({1, -1});
    gathered.push_back(replicas.size == 1
                           ? bytes
                           : group_all_gather_dim0(replicas, bytes.to(s.device)).to(at::kCPU));
  }
  c10::impl::GenericList list(c10::AnyType::get());
  for (int r = 0; r < replicas.size; ++r) {
    auto rng = string_dict();
    size_t k = 0;
    rng.insert("torch_rng_state", gathered[k++][r].clone());
    if (s.rng_state.size() > 1) rng.insert("cuda_rng_state", gathered[k++][r].clone());
    c10::impl::GenericDict tracker(c10::StringType::get(), c10::TensorType::get());
    for (const auto& item : streams) tracker.insert(item.first, gathered[k++][r].clone());
    rng.insert("rng_tracker_states", tracker);
    list.push_back(rng);
  }
  return list;
}

void check_checkpoint_args(const TrainState& s, const nlohmann::json& args,
                           const std::string& path);
}  // namespace

std::string save_checkpoint(const std::string& dir, const TrainState& s) {
  TORCH_CHECK(!dir.empty(), "actmem::Trainer::save_checkpoint: empty directory");
  const auto& tp = tensor_parallel_group();
  const int64_t iteration = s.iteration;
  const at::Device& device = s.device;
  const std::string final_dir = checkpoint_iteration_dir(dir, iteration);
  // Data-parallel replicas hold the same weights, optimizer state and random states: the first
  // replica's tensor-parallel ranks write (as Megatron's data-parallel rank 0 does without the
  // distributed optimizer). With expert parallelism the replicas are those of the experts
  // (Megatron's expert_data_parallel_rank 0 writes): each expert-parallel rank writes its
  // experts, with the dense weights every such file has. The distributed optimizer's state is
  // first gathered from every data-parallel rank (a collective), so that the files are the same
  // as without it.
  const TensorParallelGroup& replicas = expert_data_parallel_group();
  const c10::impl::GenericDict state = checkpoint_state(s, /*write=*/replicas.rank == 0);
  const bool leader =
      tp.rank == 0 && expert_parallel_group().rank == 0 && pipeline_parallel_group().rank == 0;
  const std::string tmp_dir = final_dir + ".tmp";
  std::exception_ptr error;
  if (replicas.rank == 0) {
    try {
      on_all_ranks(device, "to prepare the checkpoint directory", [&] {
        if (!leader) return;
        std::error_code ec;
        fs::create_directories(dir, ec);
        TORCH_CHECK(!ec && fs::is_directory(dir),
                    "actmem::Trainer::save_checkpoint: cannot create "
                    "the directory ",
                    dir, ": ", ec.message());
        fs::remove_all(tmp_dir, ec);  // a crashed save's leftovers
        TORCH_CHECK(!ec, "actmem::Trainer::save_checkpoint: cannot remove ", tmp_dir, ": ",
                    ec.message());
        fs::create_directories(tmp_dir, ec);
        TORCH_CHECK(!ec, "actmem::Trainer::save_checkpoint: cannot create ", tmp_dir, ": ",
                    ec.message());
      });
      // Move 1: every rank's file, durable.
      on_all_ranks(device, "to write its file", [&] {
        const fs::path rank_dir =
            fs::path(tmp_dir) / rank_dir_name(tp.rank, file_ep_rank(), file_pp_rank());
        std::error_code ec;
        fs::create_directories(rank_dir, ec);
        TORCH_CHECK(!ec, "actmem::Trainer::save_checkpoint: cannot create ", rank_dir.string(),
                    ": ", ec.message());
        const std::vector<char> bytes = save_untagged(state);
        const std::string path = (rank_dir / "model_optim_rng.pt").string();
        write_durably(path, bytes.data(), bytes.size(), iteration);
        fsync_path(rank_dir.string(), true);
      });
      // Moves 2 and 3, on rank 0.
      on_all_ranks(device, "to publish the checkpoint", [&] {
        if (!leader) return;
        fsync_path(tmp_dir, true);
        maybe_fault("before-publish", iteration);
        publish_directory(tmp_dir, final_dir);
        fsync_path(dir, true);
        maybe_fault("before-latest", iteration);
        const std::string latest = (fs::path(dir) / kLatestCheckpointFile).string();
        const std::string text = std::to_string(iteration);
        write_durably(latest + ".tmp", text.data(), text.size());
        TORCH_CHECK(::rename((latest + ".tmp").c_str(), latest.c_str()) == 0,
                    "actmem::Trainer::save_checkpoint: cannot rename ", latest,
                    ".tmp: ", errno_text());
        fsync_path(dir, true);
      });
    } catch (...) {
      error = std::current_exception();
    }
  }
  // Megatron's save_checkpoint ends at a barrier: every replica returns once the checkpoint is
  // published (a load right after it finds it), or learns that its writer failed.
  if (replicas.size > 1) {
    const at::Tensor failed =
        at::full({1}, error ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat).device(device));
    const bool ok = group_all_reduce_sum(replicas, failed).item<float>() == 0.0f;
    if (error) std::rethrow_exception(error);
    TORCH_CHECK(ok, "actmem::Trainer::save_checkpoint: the data-parallel replica that writes ",
                final_dir, " failed (its error is in its output)");
  } else if (error) {
    std::rethrow_exception(error);
  }
  return final_dir;
}

namespace {
void check_checkpoint_args(const TrainState& s, const nlohmann::json& args,
                           const std::string& path) {
  const nlohmann::json mine = to_json(s.model_config);
  std::vector<std::string> fields(std::begin(kShapeFields), std::end(kShapeFields));
  if (s.model_config.learned_positions()) fields.emplace_back("max_position_embeddings");
  // MLA fields (checkpoints saved before MLA existed do not record them: standard attention).
  const bool ckpt_mla =
      args.contains("multi_latent_attention") && args["multi_latent_attention"].get<bool>();
  TORCH_CHECK(ckpt_mla == s.model_config.multi_latent_attention,
              "actmem::Trainer::load_checkpoint: "
              "the checkpoint has ",
              ckpt_mla ? "multi-latent" : "standard",
              " attention but this "
              "run has ",
              s.model_config.multi_latent_attention ? "multi-latent" : "standard", " attention (",
              path, ")");
  if (ckpt_mla) {
    for (const char* f :
         {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
          "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim"}) {
      fields.emplace_back(f);
    }
  }
  // Grouped-query attention (checkpoints saved before it existed do not record the groups: one
  // group per head).
  if (!s.model_config.multi_latent_attention) {
    const nlohmann::json ckpt_groups =
        args.contains("num_query_groups") && !args["num_query_groups"].is_null()
            ? args["num_query_groups"]
            : args["num_attention_heads"];
    TORCH_CHECK(ckpt_groups == mine["num_query_groups"],
                "actmem::Trainer::load_checkpoint: the "
                "checkpoint has num_query_groups = ",
                ckpt_groups.dump(),
                " but this run has "
                "num_query_groups = ",
                mine["num_query_groups"].dump(), " (", path, ")");
  }
  // MoE fields (checkpoints of dense models saved before MoE existed do not record them: null).
  const bool ckpt_moe = args.contains("num_moe_experts") && !args["num_moe_experts"].is_null();
  if (ckpt_moe || s.model_config.is_moe()) {
    TORCH_CHECK(ckpt_moe == s.model_config.is_moe(),
                "actmem::Trainer::load_checkpoint: the "
                "checkpoint has num_moe_experts = ",
                ckpt_moe ? args["num_moe_experts"].dump() : "null",
                " but this run has num_moe_experts = ", mine["num_moe_experts"].dump(), " (", path,
                ")");
    for (const char* f : {"num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq",
                          "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                          "moe_grouped_gemm", "expert_model_parallel_size"}) {
      fields.emplace_back(f);
    }
  }
  // Which layers a stage (and each of its model chunks) holds. A checkpoint from before pipeline
  // parallelism records none of these: it is a one-stage one.
  const auto ckpt_p = args.contains("pipeline_model_parallel_size")
                          ? args["pipeline_model_parallel_size"].get<int64_t>()
                          : int64_t{1};
  if (ckpt_p > 1 || s.model_config.pipeline_model_parallel_size > 1) {
    for (const char* f :
         {"pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
          "decoder_last_pipeline_num_layers", "virtual_pipeline_model_parallel_size"}) {
      fields.emplace_back(f);
    }
  }
  for (const auto& f : fields) {
    TORCH_CHECK(args.contains(f), "actmem::Trainer::load_checkpoint: ", path, " does not record ",
                f, " in its args; cannot tell whether it fits this model");
    TORCH_CHECK(args[f] == mine[f], "actmem::Trainer::load_checkpoint: the checkpoint has ", f,
                " = ", args[f].dump(), " but this run has ", f, " = ", mine[f].dump(), " (", path,
                "); a checkpoint loads only into the model shape, tensor-, pipeline- and "
                "expert-parallel layout and precision it was saved with");
  }
  // Fields that shape or name parameters, recorded since they existed: an older checkpoint
  // without one was saved with its default.
  const nlohmann::json defaults = {{"qk_layernorm", false},
                                   {"attention_output_gate", false},
                                   {"apply_layernorm_1p", false},
                                   {"rotary_percent", 1.0},
                                   {"kv_channels", nlohmann::json(nullptr)}};
  for (const auto& [f, fallback] : defaults.items()) {
    nlohmann::json theirs = args.contains(f) ? args[f] : fallback;
    if (f == "kv_channels" && !args.contains(f) && !mine[f].is_null() &&
        args.contains("hidden_size") && args.contains("num_attention_heads")) {
      theirs = args["hidden_size"].get<int64_t>() / args["num_attention_heads"].get<int64_t>();
    }
    TORCH_CHECK(theirs == mine[f], "actmem::Trainer::load_checkpoint: the checkpoint has ", f,
                " = ", theirs.dump(), " but this run has ", f, " = ", mine[f].dump(), " (", path,
                "); a checkpoint loads only into the model shape it was saved with");
  }
}

}  // namespace

namespace {
// Megatron's OptimizerParamScheduler.load_state_dict with _check_and_set.
void load_scheduler(const TrainState& s, const c10::impl::GenericDict& ckpt,
                    const std::string& path, const CheckpointLoadOptions& options) {
  const c10::impl::GenericDict sched = dict_entry(ckpt, "opt_param_scheduler", path);
  const LrScheduleSteps& steps = s.scheduler.steps();
  // Megatron's OptimizerParamScheduler._check_and_set: the run's values must match the
  // checkpoint's unless --override-opt_param-scheduler.
  auto text = [](const c10::IValue& v) {  // 0.003, not 0.0030000000000000001
    return v.isString() ? v.toStringRef() : ivalue_to_json(v).dump();
  };
  auto check = [&](const c10::IValue& mine, const char* key, const char* name, bool in_samples) {
    const c10::IValue& theirs = entry(sched, key, path);
    TORCH_CHECK(options.override_scheduler || mine == theirs,
                "OptimizerParamScheduler: class input value ", text(mine), " and checkpoint value ",
                text(theirs), " for ", name, " do not match",
                in_samples ? " (counted in samples: the global batches of those iterations)"
                           : std::string(),
                " (", path, "; pass --override-opt_param-scheduler to use this run's value)");
  };
  check(s.config.lr, "max_lr", "learning rate", false);
  check(s.config.min_lr, "min_lr", "minimum learning rate", false);
  check(warmup_steps_value(steps), "lr_warmup_steps", "warmup iterations", true);
  check(steps.decay, "lr_decay_steps", "total number of iterations", true);
  check(s.config.lr_decay_style, "lr_decay_style", "learning rate decay style", false);
  const int64_t num_steps = entry(sched, "num_steps", path).toInt();
  TORCH_CHECK(num_steps >= 0, "actmem::Trainer::load_checkpoint: ", path,
              ": the schedule is at sample ", num_steps, "; expected a count of samples, from 0");
  s.scheduler.set_num_samples(num_steps);
}

// The optimizer's state: AdamW's moments, and at 16 bits the fp32 main parameters and the loss
// scaler (Megatron's Float16OptimizerWithFloat16Params.load_state_dict).
void load_optimizer(const TrainState& s, const c10::impl::GenericDict& ckpt,
                    const std::string& path) {
  const c10::impl::GenericDict opt = dict_entry(ckpt, "optimizer", path);
  const OptimizerShards* shards = s.optimizer.shards();
  const std::vector<at::Tensor>& params = s.optimizer.params();
  if (MixedPrecisionOptimizer* mixed = s.optimizer.mixed()) {
    TORCH_CHECK(opt.contains("fp32_from_fp16_params"), "actmem::Trainer::load_checkpoint: ", path,
                " has no fp32 main parameters (saved by an fp32 run)");
    load_adamw_state(mixed->adamw(), mixed->main_params(), dict_entry(opt, "optimizer", path), path,
                     shards, params);
    const auto groups = entry(opt, "fp32_from_fp16_params", path).toListRef();
    TORCH_CHECK(groups.size() == 1 && groups[0].isList(),
                "actmem::Trainer::load_checkpoint: ", path,
                ": fp32_from_fp16_params should hold one parameter group");
    const auto mains = groups[0].toListRef();
    const auto& mine = mixed->main_params();
    TORCH_CHECK(mains.size() == mine.size(), "actmem::Trainer::load_checkpoint: ", path, " has ",
                mains.size(), " fp32 main parameters, this model ", mine.size());
    at::NoGradGuard no_grad;
    for (const auto i : c10::irange(mine.size())) {
      const at::Tensor t = mains[i].toTensor();
      TORCH_CHECK(t.sizes() == params[i].sizes() && t.scalar_type() == at::kFloat,
                  "actmem::Trainer::load_checkpoint: ", path, ": fp32 main parameter ", i, " is ",
                  t.sizes(), " ", t.scalar_type(), ", expected ", params[i].sizes(), " Float");
      mine[i].copy_(shards ? shards->shard(t.contiguous(), i) : t);
    }
    const c10::IValue& gs = entry(opt, "grad_scaler", path);
    if (auto& scaler = mixed->scaler(); scaler && gs.isGenericDict()) {
      const auto d = gs.toGenericDict();
      scaler->load_state(static_cast<float>(entry(d, "scale", path).toDouble()),
                         entry(d, "growth_tracker", path).toInt(),
                         entry(d, "hysteresis_tracker", path).toInt());
    }
  } else {
    TORCH_CHECK(!opt.contains("fp32_from_fp16_params"), "actmem::Trainer::load_checkpoint: ", path,
                " holds a 16-bit run's optimizer");
    load_adamw_state(s.optimizer.adamw(), s.optimizer.adamw_params(), opt, path, shards, params);
  }
}

// The random states: the default generators' and the tracker's named streams.
void load_rng(const TrainState& s, const c10::impl::GenericDict& ckpt, const std::string& path) {
  // One entry per replica of the saving run (replica_rng_states): this replica's when the run
  // has as many, else the first (another data-parallel size: the streams cannot continue as
  // they were anyway; a checkpoint of one replica has one).
  const auto list = entry(ckpt, "rng_state", path).toListRef();
  const auto replicas = static_cast<size_t>(expert_data_parallel_group().size);
  const size_t mine =
      list.size() == replicas ? static_cast<size_t>(expert_data_parallel_group().rank) : 0;
  TORCH_CHECK(
      !list.empty() && list[mine].isGenericDict(), "actmem::Trainer::load_checkpoint: ", path,
      ": rng_state should hold one dict per data-parallel replica, has ", list.size(), " entries");
  const auto rng = list[mine].toGenericDict();
  s.rng_state[0] = entry(rng, "torch_rng_state", path).toTensor().clone();
  if (s.rng_state.size() > 1) {
    TORCH_CHECK(rng.contains("cuda_rng_state"), "actmem::Trainer::load_checkpoint: ", path,
                " was saved without a device generator state (a CPU run); pass --no-load-rng");
    s.rng_state[1] = entry(rng, "cuda_rng_state", path).toTensor().clone();
  }
  std::map<std::string, at::Tensor> streams;
  for (const auto& e : dict_entry(rng, "rng_tracker_states", path)) {
    streams[e.key().toStringRef()] = e.value().toTensor().clone();
  }
  for (const auto& [name, state] : s.rng_tracker.get_states()) {
    TORCH_CHECK(streams.count(name), "actmem::Trainer::load_checkpoint: ", path,
                " has no state for the random stream ", name);
    (void)state;
  }
  s.rng_tracker.set_states(streams);
}
}  // namespace

std::optional<int64_t> load_checkpoint(const std::string& dir, const TrainState& s,
                                       const CheckpointLoadOptions& options) {
  const std::optional<int64_t> latest = read_latest_checkpointed_iteration(dir);
  if (!latest) return std::nullopt;
  const auto& tp = tensor_parallel_group();
  std::string path = checkpoint_file(dir, *latest, tp.rank, file_ep_rank(), file_pp_rank());
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    // Another tensor-, expert- or pipeline-parallel size names the mismatch; otherwise the file
    // is missing.
    for (const int64_t pp_rank : {int64_t{-1}, int64_t{0}}) {
      for (const int64_t ep_rank : {int64_t{-1}, int64_t{0}}) {
        const std::string first = checkpoint_file(dir, *latest, 0, ep_rank, pp_rank);
        if (fs::exists(first, ec)) {
          check_checkpoint_args(
              s, ivalue_to_json(entry(read_checkpoint_file(first), "args", first)), first);
        }
      }
    }
    TORCH_CHECK(false, "actmem::Trainer::load_checkpoint: ", dir, "/", kLatestCheckpointFile,
                " names iteration ", *latest, " but ", path, " does not exist");
  }
  const c10::impl::GenericDict ckpt = read_checkpoint_file(path);
  const nlohmann::json args = ivalue_to_json(entry(ckpt, "args", path));
  check_checkpoint_args(s, args, path);
  const c10::IValue& version = entry(ckpt, "checkpoint_version", path);
  TORCH_CHECK(version.isDouble() && version.toDouble() >= 3.0,
              "actmem::Trainer::load_checkpoint: ", path, " has checkpoint_version ", version,
              "; actmem reads version 3.0 and later");

  load_model_state(s.model, ckpt, path);

  const bool optimizer = options.optimizer && !options.finetune;
  if (options.finetune) {
    s.iteration = 0;
    s.scheduler.set_num_samples(0);
    s.train_data.seek(0);
  } else {
    s.iteration = entry(ckpt, "iteration", path).toInt();
    const int64_t consumed = args.value("consumed_train_samples", int64_t{-1});
    TORCH_CHECK(consumed >= 0 && consumed % s.model_config.micro_batch_size == 0,
                "actmem::Trainer::load_checkpoint: ", path, " records consumed_train_samples ",
                consumed, ", which is not a whole number of this run's micro-batches (",
                s.model_config.micro_batch_size, " samples)");
    s.train_data.seek(consumed / s.model_config.micro_batch_size);
  }

  if (optimizer) {
    load_scheduler(s, ckpt, path, options);
    load_optimizer(s, ckpt, path);
  } else {
    // Megatron's reload_model_params: the fp32 main parameters start from the loaded model.
    // Without the optimizer state the schedule starts again from its first step.
    s.scheduler.set_num_samples(0);
    if (MixedPrecisionOptimizer* mixed = s.optimizer.mixed()) {
      at::NoGradGuard no_grad;
      mixed->reload_main_params();
    }
  }

  if (options.rng && !options.finetune) load_rng(s, ckpt, path);
  return s.iteration;
}

}  // namespace actmem
