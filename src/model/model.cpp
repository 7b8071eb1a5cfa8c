// model.cpp — TransformerLayer, TransformerBlock and GPTModel (model.h); the building blocks are
// in layers.cpp and the parts' folders (layer_part.h). Shapes: s = sequence, b = micro-batch, h =
// hidden, a = heads, d = head dim, f = ffn hidden, v = vocab.
#include "actmem/model/model.h"

#include "actmem/model/fp8.h"

#include "actmem/model/weight_init.h"

#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_tracker.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/recompute.h"
#include "actmem/recompute/rng.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <unordered_map>

namespace actmem {

namespace {

// A module whose only parameter is "weight", so names read embedding.word_embeddings.weight.
// Replicated on every tensor-parallel rank (the embeddings and the output layer are not
// vocabulary-parallel here).
class WeightHolder : public torch::nn::Module, public DeclaresParameters {
 public:
  explicit WeightHolder(at::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  std::optional<ParameterAttributes> parameter_attributes(const std::string& name) const override {
    if (name != "weight") return std::nullopt;
    return ParameterAttributes{};
  }
  at::Tensor weight;
};

}  // namespace

// ---- TransformerLayer -------------------------------------------------------------------------

TransformerLayer::TransformerLayer(const TransformerConfig& config, const LayerSpec& spec,
                                   const LayerPlan& plan, int64_t layer_number,
                                   at::ScalarType dtype)
    : spec_(spec),
      layer_number_(layer_number),
      hidden_dropout_(config.hidden_dropout),
      plan_(plan) {
  input_layernorm = register_module("input_layernorm", std::make_shared<Norm>(config, dtype));
  self_attention =
      register_module("self_attention", spec.mixer->build(config, plan, layer_number, dtype));
  pre_mlp_layernorm = register_module("pre_mlp_layernorm", std::make_shared<Norm>(config, dtype));
  mlp = register_module("mlp", spec.mlp->build(config, plan, layer_number, dtype));
}

void TransformerLayer::init_weights(WeightInit& init) {
  at::NoGradGuard no_grad;
  self_attention->init_weights(init);
  mlp->init_weights(init);
}

namespace {
// A layer's norm, plain or (selective "layernorm") output-discarding: its output is freed once
// its consumer has saved it, and recomputed from the gradient hook of the consumer's module
// output (Megatron's hook tensors: the attention output for input_layernorm, the MLP output for
// pre_mlp_layernorm), which finish() registers.
class LayerNormStep {
 public:
  LayerNormStep(std::shared_ptr<Norm> norm, bool discard, ActivationOffloader* offloader)
      : norm_(std::move(norm)), discard_(discard), offloader_(offloader) {}
  at::Tensor operator()(const at::Tensor& x) {
    if (!discard_) return norm_->forward(x);
    auto norm = norm_;
    const at::Tensor out = ckpt_.checkpoint(
        [norm](const TensorList& in) { return TensorList{norm->forward(in[0])}; }, {x})[0];
    // A norm output that output-discarding recompute frees is not worth a copy.
    if (offloader_ != nullptr) offloader_->exclude_this_forward(out);
    return out;
  }
  void finish(const at::Tensor& hook_tensor) {
    if (discard_) ckpt_.discard_output_and_register_recompute(hook_tensor);
  }

 private:
  std::shared_ptr<Norm> norm_;
  bool discard_;
  ActivationOffloader* offloader_;
  CheckpointWithoutOutput ckpt_;
};
}  // namespace

// One half of a layer, as Megatron's _forward_attention and _forward_mlp: a norm, its module and
// the bias-dropout-add. The attn_norm and mlp_norm offload groups start at the norm's input and
// commit after the bias-dropout-add (which reads the residual, the norm's input), then release
// the residual (Megatron's placement); they capture only what the norm saves.
at::Tensor TransformerLayer::norm_module_bda(const at::Tensor& hidden, const LayerContext& ctx,
                                             const HalfLayer& half) {
  const bool train = is_training();
  ActivationOffloader* off = train ? ctx.offloader : nullptr;
  OffloadRegion region(plan_.offloads(half.group) ? off : nullptr, half.group);
  LayerNormStep norm(half.norm, plan_.recomputes(RecomputeModule::kLayernorm) && train, off);
  at::Tensor ln;
  {
    ModuleScope scope(half.norm_name);
    ln = norm(region.enter(hidden));
    region.end_capture();
  }
  at::Tensor out, bias;
  {
    ModuleScope scope(half.module_name);
    std::tie(out, bias) = half.part->forward(ln, ctx);
  }
  norm.finish(out);
  ModuleScope scope(half.bda_name);
  return region.commit(bias_dropout_add(out, bias, hidden, hidden_dropout_, train), {hidden});
}

at::Tensor TransformerLayer::forward_attention(const at::Tensor& hidden, const LayerContext& ctx) {
  return norm_module_bda(hidden, ctx,
                         {input_layernorm, self_attention, OffloadModule::kAttnNorm,
                          "input_layernorm", "self_attention", "self_attn_bda"});
}

at::Tensor TransformerLayer::forward_mlp(const at::Tensor& hidden, const LayerContext& ctx) {
  return norm_module_bda(
      hidden, ctx,
      {pre_mlp_layernorm, mlp, OffloadModule::kMlpNorm, "pre_mlp_layernorm", "mlp", "mlp_bda"});
}

at::Tensor TransformerLayer::forward(const at::Tensor& hidden, const LayerContext& ctx) {
  forward_counters().layer.fetch_add(1, std::memory_order_relaxed);
  return forward_mlp(forward_attention(hidden, ctx), ctx);
}

at::Tensor TransformerLayer::decode(const at::Tensor& hidden_in, DecodeState* mixer_state,
                                    int64_t offset, const LayerContext& ctx) {
  at::Tensor hidden = hidden_in;
  auto [attn, attn_bias] =
      self_attention->decode(input_layernorm->forward(hidden), mixer_state, offset, ctx);
  hidden = hidden + (attn_bias.defined() ? attn + attn_bias : attn);
  auto [out, out_bias] = mlp->decode(pre_mlp_layernorm->forward(hidden), nullptr, offset, ctx);
  return hidden + (out_bias.defined() ? out + out_bias : out);
}

// ---- TransformerBlock -------------------------------------------------------------------------

namespace {
class LayerList : public torch::nn::Module {};

// Marks `label` on the active timeline when the gradient of `t` is computed.
void mark_on_backward(const at::Tensor& t, std::string label) {
  // Not inside a checkpoint's no-grad forward: the hook would sit on the checkpoint's input.
  if (active_timeline() == nullptr || !at::GradMode::is_enabled() || !t.requires_grad()) return;
  t.register_hook([label = std::move(label)](const at::Tensor&) { timeline_mark(label); });
}
}  // namespace

TransformerBlock::TransformerBlock(const TransformerConfig& config,
                                   const std::vector<LayerSpec>& specs, const ActivationPlan& plan,
                                   at::ScalarType dtype, TransformerConfig::StageLayers stage,
                                   bool post_process)
    : config_(config), plan_(plan), offset_(stage.offset) {
  // Registered as layers.0 .. layers.(count - 1) on every stage (Megatron's local numbering);
  // their layer_number is global (offset + i + 1).
  auto list = register_module("layers", std::make_shared<LayerList>());
  for (int64_t i = 0; i < stage.count; ++i) {
    const int64_t global = stage.offset + i;
    const auto g = static_cast<size_t>(global);
    layers.push_back(list->register_module(
        std::to_string(i),
        std::make_shared<TransformerLayer>(config, specs[g], plan.layers[g], global + 1, dtype)));
  }
  if (post_process) {
    final_layernorm = register_module("final_layernorm", std::make_shared<Norm>(config, dtype));
  }
}

at::Tensor TransformerBlock::run_layers(at::Tensor hidden, int64_t start, int64_t end,
                                        const LayerContext& ctx) {
  const std::string prefix = is_recomputing() ? "recompute layer " : "fwd layer ";
  ActivationOffloader* off = is_training() ? ctx.offloader : nullptr;
  // start and end are global layer indices (the plan's); layers[] holds this stage's.
  for (int64_t i = start; i < end; ++i) {
    const LayerPlan& lp = plan_.layers[static_cast<size_t>(i)];
    mark_on_backward(hidden, "bwd layer " + std::to_string(i));
    ModuleScope scope("layers", i);
    // Layer-level offload (Megatron's cpu_offloading_num_layers, which runs each layer in
    // Transformer Engine's CPU offload context; docs/offload.md): what each of the first K
    // layers saves goes to the host when its forward ends, and comes back one layer ahead of its
    // backward. Every layer opens a group, so the backward reaching layer K starts the reload
    // of layer K - 1 (OffloadSchedule's prefetch order).
    OffloadRegion region(lp.layer_group ? off : nullptr, "layer", GroupKind::kLayer,
                         lp.offload_layer);
    hidden =
        region.commit(layers[static_cast<size_t>(i - offset_)]->forward(region.enter(hidden), ctx));
    timeline_mark(prefix + std::to_string(i));
  }
  return hidden;
}

at::Tensor TransformerBlock::forward(const at::Tensor& hidden_in, const LayerContext& ctx) {
  at::Tensor hidden = hidden_in;
  // With sequence parallelism every layer works on this rank's tokens, so all of the block's
  // dropout draws from the model-parallel stream (Megatron's TransformerBlock.forward).
  const bool any_dropout = config_.hidden_dropout > 0.0 || config_.attention_dropout > 0.0;
  const std::optional<RngFork> sp_fork =
      config_.sequence_parallel && is_training() && any_dropout
          ? fork_model_parallel_rng(true, "actmem::TransformerBlock: sequence parallelism")
          : std::nullopt;
  const bool fp8_region = fp8 && is_training() && at::GradMode::is_enabled();
  if (fp8_region) fp8->begin_forward();
  const int64_t L = offset_ + static_cast<int64_t>(layers.size());  // one past this stage's last
  if ((plan_.full_recompute() || checkpoint_every_layer_) && is_training()) {
    // Megatron's checkpointed_forward: only each chunk's input is kept. The plan's chunks never
    // cross a stage boundary (check_activation_plan); this stage runs its own.
    std::vector<CheckpointChunk> every_layer;
    if (checkpoint_every_layer_) {
      for (int64_t i = offset_; i < L; ++i) every_layer.push_back({i, i + 1});
    }
    int64_t next = offset_;
    for (const auto& chunk : checkpoint_every_layer_ ? every_layer : plan_.chunks) {
      if (chunk.start < offset_ || chunk.start >= L) continue;
      hidden = run_layers(hidden, next, chunk.start, ctx);  // layers before a block chunk: plain
      ModuleScope scope("layers",
                        chunk.start);  // the chunk's saved input belongs to its first layer
      hidden = checkpoint(
          [this, start = chunk.start, end = chunk.end, ctx](const TensorList& in) {
            return TensorList{run_layers(in[0], start, end, ctx)};
          },
          plan_.distribute_saved_activations, {hidden})[0];
      next = chunk.end;
    }
    hidden = run_layers(hidden, next, L, ctx);
  } else {
    hidden = run_layers(hidden, offset_, L, ctx);
  }
  if (fp8_region) fp8->end_forward();
  if (!final_layernorm) return hidden;  // not the last pipeline stage
  mark_on_backward(hidden, "bwd head");
  ModuleScope scope("final_layernorm");
  return final_layernorm->forward(hidden);
}

// ---- GPTModel ---------------------------------------------------------------------------------

GPTModel::GPTModel(const TransformerConfig& config, at::ScalarType dtype)
    : GPTModel(config, make_activation_plan(config), dtype) {}  // validates the config

namespace {
// Throws unless this process's tensor, expert and pipeline groups are the config's layout.
void check_process_groups(const TransformerConfig& config) {
  const TensorParallelGroup& tp = tensor_parallel_group();
  TORCH_CHECK(tp.size == config.tensor_model_parallel_size,
              "actmem::GPTModel: "
              "tensor_model_parallel_size is ",
              config.tensor_model_parallel_size, " but this process ",
              "is in a tensor-parallel group of ", tp.size,
              tp.size == 1 ? " (run it under `actmem "
                             "launch --nproc-per-node " +
                                 std::to_string(config.tensor_model_parallel_size) + "`)"
                           : "");
  TORCH_CHECK(expert_parallel_group().size == config.expert_model_parallel_size,
              "actmem::GPTModel: expert_model_parallel_size is ", config.expert_model_parallel_size,
              " but this process is in an expert-parallel group of ", expert_parallel_group().size,
              expert_parallel_group().size == 1
                  ? " (run it under `actmem launch` with a multiple of "
                    "tensor x expert parallel sizes as the number of processes)"
                  : "");
  const TensorParallelGroup& pp = pipeline_parallel_group();
  TORCH_CHECK(
      pp.size == config.pipeline_model_parallel_size,
      "actmem::GPTModel: "
      "pipeline_model_parallel_size is ",
      config.pipeline_model_parallel_size,
      " but this "
      "process is in a pipeline of ",
      pp.size,
      pp.size == 1
          ? " (run it under `actmem launch` "
            "with a multiple of tensor x pipeline parallel sizes as the number of processes)"
          : "");
}
}  // namespace

GPTModel::GPTModel(const TransformerConfig& config, ActivationPlan plan, at::ScalarType requested)
    : config_(config), plan_(std::move(plan)) {
  // The plan replaces the config's recompute and offload flags, so only the shape is checked
  // here (a plan from make_activation_plan() was checked against the flags already).
  config_.validate_shape();
  check_activation_plan(config_, plan_);
  dtype_ = requested == at::ScalarType::Undefined ? params_dtype(config) : requested;
  TORCH_CHECK(
      dtype_ == params_dtype(config) || (dtype_ == at::kDouble && !is_16bit(params_dtype(config))),
      "actmem::GPTModel: the config's precision is ", config.precision(), " (parameters in ",
      params_dtype(config), ") but dtype ", dtype_,
      " was requested; "
      "double is accepted for an fp32 config only");
  check_process_groups(config);
  const TensorParallelGroup& pp = pipeline_parallel_group();
  for (int64_t chunk = 0; chunk < config.virtual_pipeline_size(); ++chunk) {
    chunks_.push_back(config.model_chunk_layers(pp.rank, chunk));
  }
  pre_process_ = pp.rank == 0;
  post_process_ = pp.rank == pp.size - 1;
  const std::vector<LayerSpec> specs = layer_specs(config);
  // Note [Pipeline stages draw the whole model]
  // Every stage draws every weight in the single-process order and keeps its own (the layers of
  // other stages are built, drawn and dropped one at a time), so a model split into p stages is
  // the same function for every p: runs compare across layouts and a stage's weights do not
  // depend on the split. (Megatron initialises each stage from seed + 100 * pipeline rank.)
  WeightInit init(config, dtype_);
  const at::Tensor word = init.normal({config.vocab_size, config.hidden_size}, init.std());
  const at::Tensor positions =
      config.learned_positions()
          ? init.normal({config.max_positions(), config.hidden_size}, init.std())
          : at::Tensor();
  if (pre_process_) build_embedding(word, positions);
  build_rotary_tables(specs);
  causal_mask_ = make_causal_mask(config.max_positions());
  // One TransformerBlock per model chunk (Megatron builds one model per virtual stage); the
  // final norm belongs to the last chunk of the last stage.
  for (size_t chunk = 0; chunk < chunks_.size(); ++chunk) {
    const bool last_chunk = chunk + 1 == chunks_.size();
    decoders_.push_back(register_module(
        chunk == 0 ? std::string("decoder") : "decoder_vp" + std::to_string(chunk),
        std::make_shared<TransformerBlock>(config, specs, plan_, dtype_, chunks_[chunk],
                                           post_process_ && last_chunk)));
  }
  decoder = decoders_.front();
  init_layers(specs, init);
  for (const auto& layer : all_layers()) {
    layer->self_attention->bind_stats(moe_stats_);
    layer->mlp->bind_stats(moe_stats_);
  }
  if (post_process_) build_output_layer(word, init);
  // FP8: every GEMM of the layers not kept in 16 bits (Note [FP8 as actmem runs it] in fp8.h).
  if (!config.fp8.empty()) {
    fp8_ = std::make_shared<Fp8Registry>(Fp8Recipe::from(config));
    for (const auto& layer : all_layers()) {
      if (!config.quantized_layer(layer->layer_number() - 1)) continue;
      layer->self_attention->use_fp8(fp8_);
      layer->mlp->use_fp8(fp8_);
    }
    for (const auto& block : decoders_) block->fp8 = fp8_;
  }
}

void GPTModel::build_embedding(const at::Tensor& word, const at::Tensor& positions) {
  auto embedding = register_module("embedding", std::make_shared<torch::nn::Module>());
  word_embeddings =
      embedding->register_module("word_embeddings", std::make_shared<WeightHolder>(word))->weight;
  if (positions.defined()) {
    position_embeddings =
        embedding->register_module("position_embeddings", std::make_shared<WeightHolder>(positions))
            ->weight;
  }
}

void GPTModel::build_rotary_tables(const std::vector<LayerSpec>& specs) {
  // The layers' mixers read one set of tables (MLA's decoupled ones, or standard attention's
  // with rope; Megatron's GPTModel builds none for MLA).
  for (const LayerSpec& spec : specs) {
    if (!rope_) rope_ = spec.mixer->rotary_tables(config_, dtype_);
  }
  if (!rope_) return;
  auto holder = register_module("rotary_pos_emb", std::make_shared<torch::nn::Module>());
  rope_->cos = holder->register_buffer("cos", rope_->cos);
  rope_->sin = holder->register_buffer("sin", rope_->sin);
}

void GPTModel::init_layers(const std::vector<LayerSpec>& specs, WeightInit& init) {
  // Every rank draws the full (t = 1) weights in the same order and keeps its slice (Note [One
  // sequence of draws] in weight_init.h).
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const auto mine =
        std::find_if(chunks_.begin(), chunks_.end(),
                     [i](const TransformerConfig::StageLayers& l) { return l.contains(i); });
    if (mine != chunks_.end()) {
      const auto& block = decoders_[static_cast<size_t>(mine - chunks_.begin())];
      block->layers[static_cast<size_t>(i - mine->offset)]->init_weights(init);
    } else {  // another stage's layer: drawn to keep the order, then dropped
      const auto g = static_cast<size_t>(i);
      TransformerLayer(config_, specs[g], plan_.layers[g], i + 1, dtype_).init_weights(init);
    }
  }
}

void GPTModel::build_output_layer(const at::Tensor& word, WeightInit& init) {
  const int64_t h = config_.hidden_size, v = config_.vocab_size;
  if (config_.untie_embeddings_and_output_weights) {
    output_weight = register_module("output_layer",
                                    std::make_shared<WeightHolder>(init.normal({v, h}, init.std())))
                        ->weight;
  } else if (pre_process_) {
    output_weight = word_embeddings;
  } else {
    // Megatron's LanguageModule on the last stage: its own copy of the tied weight, registered as
    // output_layer.weight, its gradient summed with the first stage's over the embedding group
    // so the two copies stay equal (Trainer, finalize_model_grads).
    output_weight = register_module("output_layer", std::make_shared<WeightHolder>(word))->weight;
  }
}

at::Tensor GPTModel::shared_embedding_or_output_weight() const {
  if (config_.untie_embeddings_and_output_weights) return {};
  return pre_process_ ? word_embeddings : output_weight;
}

void GPTModel::set_checkpoint_every_layer(bool on) {
  for (const auto& block : decoders_) block->set_checkpoint_every_layer(on);
}

void GPTModel::set_moe_aux_loss_scale(double scale) {
  for (const auto& layer : all_layers()) {
    layer->self_attention->set_aux_loss_scale(scale);
    layer->mlp->set_aux_loss_scale(scale);
  }
}

at::Tensor GPTModel::embed(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "actmem::GPTModel: expected tokens [b, s], got ", tokens.sizes());
  const int64_t s = tokens.size(1);
  TORCH_CHECK(s <= config_.max_positions(), "actmem::GPTModel: sequence of ", s,
              " tokens exceeds max_position_embeddings ", config_.max_positions());
  at::Tensor words = at::embedding(word_embeddings, tokens);  // [b, s, h]
  if (position_embeddings.defined()) {
    words = words + position_embeddings.narrow(0, 0, s);  // broadcast over b
  }
  return words.transpose(0, 1).contiguous();  // [s, b, h]
}

at::Tensor GPTModel::embedding_forward(const at::Tensor& tokens) {
  timeline_mark("fwd start");
  ModuleScope scope("embedding");
  at::Tensor hidden = embed(tokens);
  // Each rank keeps its s/t tokens (a copy, so the full embedding output is freed) and drops
  // them with its own stream, as Megatron's LanguageModelEmbedding does.
  if (config_.sequence_parallel) hidden = scatter_to_sequence_parallel_region(hidden);
  const std::optional<RngFork> fork =
      config_.sequence_parallel && is_training() && config_.hidden_dropout > 0.0
          ? fork_model_parallel_rng(true, "actmem::GPTModel: sequence parallelism")
          : std::nullopt;
  hidden = apply_dropout(hidden, config_.hidden_dropout, is_training());
  timeline_mark("fwd embedding");
  return hidden;
}

at::Tensor GPTModel::decoder_forward(const at::Tensor& hidden, int64_t chunk) {
  // Every chunk's layers under "decoder" in the ledger: their paths carry the global layer index.
  ModuleScope scope("decoder");
  return decoders_[static_cast<size_t>(chunk)]->forward(
      hidden, LayerContext{rope_.get(), causal_mask_, offloader_});
}

std::vector<std::shared_ptr<TransformerLayer>> GPTModel::all_layers() const {
  std::vector<std::shared_ptr<TransformerLayer>> out;
  for (const auto& block : decoders_)
    out.insert(out.end(), block->layers.begin(), block->layers.end());
  return out;
}

at::Tensor GPTModel::output_logits(at::Tensor hidden) {
  ModuleScope scope("output_layer");
  // The output layer is replicated (docs/parallelism.md): with sequence parallelism the shards
  // are gathered, and backward keeps this rank's slice of the (identical) full gradient.
  if (config_.sequence_parallel) hidden = gather_from_sequence_parallel_region(hidden, false);
  return at::matmul(hidden, output_weight.t());  // [s, b, v]
}

void GPTModel::check_whole_model(const char* api) const {
  TORCH_CHECK(pre_process_ && post_process_, api,
              ": needs the whole model; this is pipeline "
              "stage ",
              pipeline_parallel_group().rank, " of ", config_.pipeline_model_parallel_size,
              " (use forward_stage)");
}

at::Tensor GPTModel::logits(const at::Tensor& tokens) {
  check_whole_model("actmem::GPTModel::logits");
  return output_logits(decoder_forward(embedding_forward(tokens), 0));
}

at::Tensor GPTModel::forward(const at::Tensor& tokens, const at::Tensor& labels) {
  check_whole_model("actmem::GPTModel::forward");
  return forward_stage(tokens, labels, at::Tensor());
}

at::Tensor GPTModel::forward_stage(const at::Tensor& tokens, const at::Tensor& labels,
                                   const at::Tensor& input, int64_t chunk) {
  TORCH_CHECK(chunk >= 0 && chunk < num_model_chunks(),
              "actmem::GPTModel::forward_stage: model "
              "chunk ",
              chunk, " outside 0..", num_model_chunks() - 1);
  TORCH_CHECK(!(pre_process_ && post_process_) || labels.sizes() == tokens.sizes(),
              "actmem::GPTModel::forward: labels ", labels.sizes(), " must match tokens ",
              tokens.sizes());
  at::Tensor hidden;
  if (chunk_pre_process(chunk)) {
    hidden = embedding_forward(tokens);
  } else {
    TORCH_CHECK(input.defined(), "actmem::GPTModel::forward_stage: pipeline stage ",
                pipeline_parallel_group().rank, " (model chunk ", chunk,
                ") needs the previous "
                "stage's output as input");
    hidden = input;
  }
  hidden = decoder_forward(hidden, chunk);
  if (!chunk_post_process(chunk)) return hidden;
  const at::Tensor out = output_logits(hidden);
  const int64_t v = out.size(-1);
  ModuleScope scope("loss");
  // At 16 bits the loss is computed in fp32 (Megatron's vocab_parallel_cross_entropy of
  // output.float()): the cast keeps nothing, the log-softmax keeps its fp32 output.
  at::Tensor loss = at::cross_entropy_loss(
      out.reshape({-1, v}).to(compute_dtype(out.scalar_type())), labels.t().reshape({-1}),
      /*weight=*/{}, loss_sum_ ? at::Reduction::Sum : at::Reduction::Mean);
  timeline_mark("fwd loss");
  return loss;
}

void GPTModel::to_device(const at::Device& device) {
  to(device);  // parameters and buffers (the RoPE tables) move in place
  causal_mask_ = causal_mask_.to(device);
}

std::vector<at::Tensor> GPTModel::ordered_parameters() const {
  return parameters();
}

// Note [Parameter attributes]
// Which gradients are summed over which ranks, and which count once in the gradient norm, is a
// property of each parameter, recorded where the parameter is made: Megatron sets attributes on
// the parameter tensors (tensor_model_parallel, sequence_parallel, allreduce) and its DDP,
// finalize_model_grads and get_grad_norm_fp32 read them. Here every module that registers a
// parameter implements DeclaresParameters, and this function asks, for each parameter, its owner
// first and then the owner's ancestors (a module may register parameters on a plain child, as the
// MoE layer registers the shared experts' gate); a parameter nobody declares is refused, so a new
// module cannot silently get its gradients reduced as a replicated weight. actmem once found these
// by matching parameter names ("linear_qkv.", "layernorm.", ".mlp.experts."), which a module with
// another name would have escaped.
std::vector<ParameterAttributes> GPTModel::parameter_attributes() const {
  // The model itself as "" (include_self would need it held by a shared_ptr).
  std::unordered_map<std::string, const torch::nn::Module*> modules = {{"", this}};
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    modules[item.key()] = item.value().get();
  }
  std::vector<ParameterAttributes> out;
  for (const auto& item : named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    std::optional<ParameterAttributes> declared;
    bool expert = false;
    // From the owner (the name up to its last dot) to the model itself ("").
    for (size_t dot = name.rfind('.');; dot = name.rfind('.', dot - 1)) {
      const std::string owner = dot == std::string::npos ? std::string() : name.substr(0, dot);
      const torch::nn::Module* m = modules.at(owner);
      if (const auto* d = dynamic_cast<const DeclaresParameters*>(m); d != nullptr && !declared) {
        declared = d->parameter_attributes(dot == std::string::npos ? name : name.substr(dot + 1));
      }
      expert = expert || dynamic_cast<const Experts*>(m) != nullptr;
      if (dot == std::string::npos || dot == 0) break;
    }
    TORCH_CHECK(declared.has_value(),
                "actmem::GPTModel::parameter_attributes: no module declares "
                "how parameter ",
                name,
                " is held across ranks (implement DeclaresParameters in "
                "the module that registers it)");
    ParameterAttributes a = *declared;
    a.tensor_parallel = a.tensor_parallel && config_.tensor_model_parallel_size > 1;
    // Both kinds of partial gradient are summed over the tensor-parallel ranks (gradients.cpp).
    a.sequence_parallel = (a.sequence_parallel && config_.sequence_parallel) ||
                          (a.partial_over_heads && config_.tensor_model_parallel_size > 1);
    a.expert_parallel = expert;
    out.push_back(a);
  }
  return out;
}

int64_t GPTModel::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace actmem
