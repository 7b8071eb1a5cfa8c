// model.h — GPTModel in Megatron-LM's module structure, activations in [s, b, h] layout.
//
//   embedding (word + learned positions, or RoPE) -> dropout
//   decoder.layers[i]:  input_layernorm -> self_attention (linear_qkv -> core_attention ->
//                       linear_proj) -> bias-dropout-add -> pre_mlp_layernorm -> mlp (linear_fc1
//                       -> GeLU | SwiGLU -> linear_fc2) -> bias-dropout-add
//   decoder.final_layernorm -> output layer (tied to the word embedding by default) -> loss
//
// Core attention is the unfused form (QK^T, scale, causal mask, softmax, dropout, x V), so the
// [b, a, s, s] tensors exist and are saved for backward. Parameter names match Megatron's
// (decoder.layers.0.self_attention.linear_qkv.weight, ...). What each layer keeps, recomputes or
// offloads is decided by the model's ActivationPlan (activation_plan.h), built once from the
// config; the modules execute their LayerPlan through the mechanisms (recompute.h,
// activation_offloader.h) at the places Megatron calls them.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/model/attention/attention.h"
#include "actmem/model/layer_part.h"
#include "actmem/model/layer_spec.h"
#include "actmem/model/layers.h"
#include "actmem/model/moe/moe.h"

#include <torch/nn/module.h>

#include <atomic>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace actmem {

class ActivationOffloader;
class Fp8Registry;

/// A transformer layer built from its spec (layer_spec.h): input_layernorm -> the mixer part
/// (self_attention) -> bias-dropout-add -> pre_mlp_layernorm -> the MLP part (mlp) ->
/// bias-dropout-add, as Megatron's TransformerLayer from its TransformerLayerSubmodules.
class TransformerLayer : public torch::nn::Module {
 public:
  TransformerLayer(const TransformerConfig& config, const LayerSpec& spec, const LayerPlan& plan,
                   int64_t layer_number, at::ScalarType dtype);
  /// hidden: [s, b, h] -> [s, b, h]
  at::Tensor forward(const at::Tensor& hidden, const LayerContext& ctx);
  /// Generation: positions [offset, offset + n) of hidden [n, 1, h], the mixer's state
  /// (PartModule::make_decode_state) extended with them.
  at::Tensor decode(const at::Tensor& hidden, DecodeState* mixer_state, int64_t offset,
                    const LayerContext& ctx);
  /// Draws the parts' weights in the single-process order: the mixer's, then the MLP's.
  void init_weights(WeightInit& init);
  int64_t layer_number() const { return layer_number_; }  // 1-based, as in Megatron
  const LayerSpec& spec() const { return spec_; }

  /// The mixer's and the MLP's module as the kind's module class T, or null when the part is of
  /// another kind.
  template <class T>
  T* mixer_as() const {
    return dynamic_cast<T*>(self_attention.get());
  }
  template <class T>
  T* mlp_as() const {
    return dynamic_cast<T*>(mlp.get());
  }

  std::shared_ptr<Norm> input_layernorm;
  std::shared_ptr<PartModule> self_attention;  // the mixer part
  std::shared_ptr<Norm> pre_mlp_layernorm;
  std::shared_ptr<PartModule> mlp;  // the MLP part

 private:
  // Megatron's _forward_attention and _forward_mlp: norm, module, bias-dropout-add.
  at::Tensor forward_attention(const at::Tensor& hidden, const LayerContext& ctx);
  at::Tensor forward_mlp(const at::Tensor& hidden, const LayerContext& ctx);
  struct HalfLayer {
    std::shared_ptr<Norm> norm;
    std::shared_ptr<PartModule> part;
    OffloadModule group;  // the norm's fine-grained offload group
    const char* norm_name;
    const char* module_name;
    const char* bda_name;
  };
  at::Tensor norm_module_bda(const at::Tensor& hidden, const LayerContext& ctx,
                             const HalfLayer& half);
  LayerSpec spec_;
  int64_t layer_number_;
  double hidden_dropout_;
  LayerPlan plan_;
};

class TransformerBlock : public torch::nn::Module {
 public:
  /// The layers of `stage` (this pipeline stage's; all of them without pipeline parallelism)
  /// and, with post_process (the last stage), the final norm. `specs` and `plan` cover the whole
  /// model.
  TransformerBlock(const TransformerConfig& config, const std::vector<LayerSpec>& specs,
                   const ActivationPlan& plan, at::ScalarType dtype,
                   TransformerConfig::StageLayers stage, bool post_process);
  /// hidden: [s, b, h] -> [s, b, h], final-normed on the last stage. With full recompute
  /// (training only) the plan's chunks of this stage's layers run inside checkpoints
  /// (ActivationPlan::chunks).
  at::Tensor forward(const at::Tensor& hidden, const LayerContext& ctx);
  /// Training forwards from now on checkpoint every layer on its own (the block method with n =
  /// all of the block's layers) instead of the plan's chunks: the fully checkpointed micro-batches
  /// of --num-microbatches-with-partial-activation-checkpoints.
  void set_checkpoint_every_layer(bool on) { checkpoint_every_layer_ = on; }
  std::vector<std::shared_ptr<TransformerLayer>> layers;  // this stage's
  std::shared_ptr<Norm> final_layernorm;                  // null except on the last stage
  /// The model's FP8 state (fp8.h), or null: a training forward of the block is an FP8 region
  /// (Megatron's outer fp8 context around TransformerBlock.forward) whose end updates the
  /// delayed scales.
  std::shared_ptr<Fp8Registry> fp8;

 private:
  // Runs the global layers [start, end) of this stage.
  at::Tensor run_layers(at::Tensor hidden, int64_t start, int64_t end, const LayerContext& ctx);
  TransformerConfig config_;
  ActivationPlan plan_;
  int64_t offset_ = 0;  // the global index of layers[0]
  bool checkpoint_every_layer_ = false;
};

class GPTModel : public torch::nn::Module {
 public:
  /// Builds and initialises the model on CPU from config.seed (independent of the global RNG).
  /// dtype Undefined means the config's precision (params_dtype()); an fp32 config also accepts
  /// double (tests). A 16-bit model holds the fp32 model's initial values rounded.
  explicit GPTModel(const TransformerConfig& config,
                    at::ScalarType dtype = at::ScalarType::Undefined);
  /// The same with an explicit activation plan (check_activation_plan() must accept it): the
  /// model executes `plan` instead of the one its config's flags resolve to.
  GPTModel(const TransformerConfig& config, ActivationPlan plan,
           at::ScalarType dtype = at::ScalarType::Undefined);
  /// The parameters' type.
  at::ScalarType dtype() const { return dtype_; }

  /// tokens: [b, s] int64 -> logits [s, b, v] (the whole model: no pipeline parallelism)
  at::Tensor logits(const at::Tensor& tokens);
  /// Mean cross-entropy over all b*s positions. tokens, labels: [b, s] int64. The whole model.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& labels);
  /// This pipeline stage's forward: the first stage embeds `tokens`, the others take `input`
  /// (the previous stage's output, [s, b, h] or its [s/t, b, h] shard under sequence
  /// parallelism); the last stage returns the loss against `labels`, the others their output.
  /// Under the interleaved schedule `chunk` names the model chunk (virtual stage) to run: the
  /// embedding is chunk 0's on the first stage, the head the last chunk's on the last stage.
  at::Tensor forward_stage(const at::Tensor& tokens, const at::Tensor& labels,
                           const at::Tensor& input, int64_t chunk = 0);
  /// Pipeline stage of this model: the first holds the embedding (pre_process), the last the
  /// final norm, output layer and loss (post_process); both without pipeline parallelism.
  bool pre_process() const { return pre_process_; }
  bool post_process() const { return post_process_; }
  /// Whether model chunk `chunk` embeds the tokens / ends in the loss (Megatron's
  /// is_pipeline_first_stage / is_pipeline_last_stage with a vp_stage).
  bool chunk_pre_process(int64_t chunk) const { return pre_process_ && chunk == 0; }
  bool chunk_post_process(int64_t chunk) const {
    return post_process_ && chunk == num_model_chunks() - 1;
  }
  /// Model chunks on this rank: v under the interleaved schedule, else 1.
  int64_t num_model_chunks() const { return static_cast<int64_t>(chunks_.size()); }
  /// The transformer layers model chunk `chunk` holds (global offset and count); without
  /// interleaving chunk 0 is the whole stage.
  const TransformerConfig::StageLayers& stage_layers(int64_t chunk = 0) const {
    return chunks_.at(static_cast<size_t>(chunk));
  }
  /// Every transformer layer this rank holds, chunk by chunk.
  std::vector<std::shared_ptr<TransformerLayer>> all_layers() const;
  /// With tied embeddings: the word embedding on the first stage, the last stage's copy of it
  /// (output_layer.weight) on the last; undefined when untied or on a middle stage (Megatron's
  /// shared_embedding_or_output_weight).
  at::Tensor shared_embedding_or_output_weight() const;
  /// Moves parameters and buffers.
  void to_device(const at::Device& device);
  /// Offload for training forwards, as the plan says: layer-level or fine-grained groups.
  /// nullptr turns it off. Not owned; call its begin_forward() before each training forward.
  void set_activation_offloader(ActivationOffloader* offloader) { offloader_ = offloader; }

  const TransformerConfig& config() const { return config_; }
  /// What the MoE layers measured since its last reset() (empty for a dense model): the parts
  /// report into it (PartModule::bind_stats).
  /// The FP8 state of the model's GEMMs (fp8.h), or null without --fp8-format.
  const std::shared_ptr<Fp8Registry>& fp8() const { return fp8_; }
  MoEStats& moe_stats() { return moe_stats_; }
  const MoEStats& moe_stats() const { return moe_stats_; }
  /// The backward scale of the MoE auxiliary losses (Megatron's
  /// MoEAuxLossAutoScaler.set_loss_scale): the main loss's scale over the micro-batches.
  void set_moe_aux_loss_scale(double scale);
  /// TransformerBlock::set_checkpoint_every_layer for every model chunk of this stage.
  void set_checkpoint_every_layer(bool on);
  /// The loss forward returns: the mean over the micro-batch's tokens (default), or their sum
  /// (Megatron's --calculate-per-token-loss: loss_func's sum(losses * loss_mask)).
  void set_loss_sum(bool on) { loss_sum_ = on; }
  /// What every layer keeps, recomputes or offloads (Note [One plan] in activation_plan.h).
  const ActivationPlan& plan() const { return plan_; }
  /// The causal mask table shared by all layers ([1, 1, S, S] bool).
  const at::Tensor& attention_mask() const { return causal_mask_; }
  /// The rotary tables the layers' parts read (LayerPart::rotary_tables: standard attention's
  /// with --position-embedding-type rope, MLA's decoupled ones); null when none does.
  const RotaryEmbedding* rope() const { return rope_.get(); }
  /// Parameters in registration order (the order of grad digests).
  std::vector<at::Tensor> ordered_parameters() const;
  /// Per ordered parameter, how it is held across ranks (Note [Parameter attributes] in
  /// model.cpp): as its module declares it, tensor_parallel only with t > 1, sequence_parallel
  /// only with --sequence-parallel, expert_parallel below an Experts module. Throws for a
  /// parameter no module declares.
  std::vector<ParameterAttributes> parameter_attributes() const;
  int64_t num_parameters() const;

  // The first pipeline stage's (undefined on the others):
  at::Tensor word_embeddings;      // [v, h]
  at::Tensor position_embeddings;  // [max_pos, h] or undefined with RoPE
  // The last stage's: [v, h]; aliases word_embeddings unless untied or pipeline-parallel.
  at::Tensor output_weight;
  std::shared_ptr<TransformerBlock>
      decoder;  // model chunk 0's (the whole stage without interleaving)

 private:
  // The construction's steps, in the draws' order (Note [One sequence of draws] in
  // weight_init.h).
  void build_embedding(const at::Tensor& word, const at::Tensor& positions);
  void build_rotary_tables(const std::vector<LayerSpec>& specs);
  void init_layers(const std::vector<LayerSpec>& specs, WeightInit& init);
  void build_output_layer(const at::Tensor& word, WeightInit& init);
  /// tokens [b, s] -> embeddings [s, b, h], before dropout
  at::Tensor embed(const at::Tensor& tokens);
  // The three parts of a forward: embedding (with its dropout), the decoder's layers, the output
  // layer (logits).
  at::Tensor embedding_forward(const at::Tensor& tokens);
  at::Tensor decoder_forward(const at::Tensor& hidden, int64_t chunk);
  at::Tensor output_logits(at::Tensor hidden);
  // Throws unless this model is the whole model (no pipeline parallelism), naming `api`.
  void check_whole_model(const char* api) const;
  std::vector<TransformerConfig::StageLayers> chunks_;       // per model chunk
  std::vector<std::shared_ptr<TransformerBlock>> decoders_;  // per model chunk
  bool pre_process_ = true, post_process_ = true;
  bool loss_sum_ = false;
  TransformerConfig config_;
  ActivationPlan plan_;
  at::ScalarType dtype_ = at::kFloat;
  std::unique_ptr<RotaryEmbedding> rope_;
  at::Tensor causal_mask_;  // [1, 1, max_pos, max_pos], built once, moved with the model
  ActivationOffloader* offloader_ = nullptr;
  MoEStats moe_stats_;
  std::shared_ptr<Fp8Registry> fp8_;
};

}  // namespace actmem
