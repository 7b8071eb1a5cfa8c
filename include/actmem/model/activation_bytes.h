// activation_bytes.h — the exact predictor: what this project's GPTModel keeps for the backward,
// per module, as the sum over each layer's parts (layer_part.h); the memory pre-check's upper
// bound of a step's peak; the parameters the model builds. The paper's and Megatron's formulas
// are in memory/memory_model.h.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/moe/moe_rows.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace actmem {

/// The parameters GPTModel builds for `config`, counted from the configuration alone (no tensor
/// is made): each layer's parts (LayerPart::parameters) and norms, the embeddings and the final
/// norm.
struct ParameterCount {
  int64_t total = 0;   // the whole model
  int64_t active = 0;  // top-k of the routed experts per MoE layer
  /// One rank of the first pipeline stage: tensor-parallel weights split t ways, routed experts
  /// over expert x tensor ranks, norms, routers and the shared experts' gate replicated.
  double on_rank = 0;
  double experts_on_rank = 0;  // of which routed experts
};
ParameterCount count_parameters(const TransformerConfig& config);

/// Weights, gradients and optimizer state on the first stage's most loaded rank from
/// count_parameters() at Megatron's bytes per parameter (2 + 4 + 12, the optimizer's 12 over the
/// data-parallel size `d` with the distributed optimizer; the routed experts over their own
/// data-parallel size d / EP): what megatron_weight_and_optimizer_memory() computes from the
/// paper's shape, for every model the configuration describes, its parts the paper has no terms
/// for included.
WeightMemory config_weight_and_optimizer_memory(const TransformerConfig& config, double d,
                                                bool distributed_optimizer);

/// Whether Korthikanti et al.'s per-layer formulas (and Megatron's theoretical_memory_usage.py)
/// describe `config`'s layers: every part of every layer does (LayerPart::paper_describes). For
/// the others estimate and the analytic planner take their terms from the exact predictor.
bool paper_describes(const TransformerConfig& config);

/// Korthikanti et al. §4.1's term for one module of a transformer layer (a ledger path
/// decoder.layers.i.<module>: input_layernorm, self_attn_bda, pre_mlp_layernorm, mlp_bda, and
/// the modules of the parts the paper describes — standard attention's linear_qkv,
/// core_attention, linear_proj, the dense MLP's linear_fc1, activation_func, linear_fc2), at
/// `dtype_bytes` per activation element (the paper's 16-bit terms scaled by dtype_bytes / 2;
/// dropout masks stay 1 byte), for the model's sizes without recompute. -1 for modules the
/// paper's per-layer formula has no term for.
double korthikanti_module_bytes(const std::string& module_path, const TransformerConfig& config,
                                int64_t dtype_bytes);

/// What this project's GPTModel keeps for a module beyond korthikanti_module_bytes() at the
/// config's precision, without recompute or offload, and why (docs/memory-model.md): the norms'
/// statistics, RoPE's rotated q and k, SwiGLU's second fc1 half and its SiLU output.
struct ModuleExtra {
  int64_t bytes = 0;
  std::string what;  // "" when nothing
};
ModuleExtra module_bytes_beyond_paper(const std::string& module_path,
                                      const TransformerConfig& config, bool cpu = true);

/// Exact activation bytes this project's GPTModel keeps from the end of a training forward to
/// its backward, per module, for `config` (including its recompute policy) at `dtype_bytes`
/// (2 = bf16/fp16, 4 = fp32, 8 = double; 0 = the config's precision, config.element_bytes()).
/// Derived from what libtorch's ops save (see docs/memory-model.md). At 16 bits the loss is
/// computed in fp32, and the norms' statistics are fp32 except libtorch's CPU LayerNorm, which
/// keeps its mean and rstd in the input's type.
struct PredictedBytes {
  std::vector<std::pair<std::string, int64_t>> by_module;  // module path -> bytes
  int64_t total = 0;
};
/// Bytes of the random-state snapshot each checkpoint in a Trainer keeps (CPU generator state and
/// the three tracker streams, 4 x 5056 bytes on CPU); 0 when snapshots are not on the device.
int64_t checkpoint_snapshot_bytes(bool snapshots_on_device = true);

/// On CUDA the checkpoints' random-state snapshots live in host memory and are not counted;
/// on CPU they are device bytes like everything else. Walks the activation plan the model
/// executes (Note [One plan] in activation_plan.h): for config's own plan, or for `plan`. Each
/// layer is the sum of its parts' saved bytes (LayerPart::saved_bytes) and of its norms and
/// bias-dropout-adds. An MoE layer's rows may depend on its routing (moe_rows.h): pass the
/// router's counts as `routing` where they do, or the prediction throws.
PredictedBytes predict_activation_bytes(const TransformerConfig& config, int64_t dtype_bytes = 0,
                                        bool snapshots_on_device = true,
                                        const MoERouting* routing = nullptr);
/// With pipeline parallelism, `pipeline_stage`'s bytes per micro-batch: its layers, the
/// embedding on the first stage, the head and loss on the last (what crosses the stage
/// boundaries is the schedule's: Note [Pipeline step] in schedules.cpp). Under the interleaved
/// schedule, model chunk `model_chunk`'s of that stage.
PredictedBytes predict_activation_bytes(const TransformerConfig& config, const ActivationPlan& plan,
                                        int64_t dtype_bytes = 0, bool snapshots_on_device = true,
                                        const MoERouting* routing = nullptr,
                                        int64_t pipeline_stage = 0, int64_t model_chunk = 0);
/// An upper bound of the device bytes one training step of `config` holds at its peak:
/// parameters, gradients and AdamW state (at 16 bits: 16-bit parameters and their transient
/// gradients, fp32 main parameters, main grads and moments), the activations of one micro-batch
/// and the transient buffers of its backward (Note [Memory pre-check] in activation_bytes.cpp).
/// +inf for sizes whose exact count would overflow. dtype_bytes 0 = the config's precision. With
/// pipeline parallelism, `pipeline_stage`'s: its layers' weights (the embedding on the first
/// stage, the output layer on the last) and `microbatches_in_flight` micro-batches of its
/// activations (1F1B: one_f_one_b_in_flight in pipeline.h) with the tensors crossing its
/// boundaries.
/// `optimizer_shards`: d with the distributed optimizer (its AdamW moments and fp32 main
/// parameters take 1/d of their bytes), else 1.
double predict_step_peak_bound(const TransformerConfig& config, int64_t dtype_bytes = 0,
                               int64_t pipeline_stage = 0, int64_t microbatches_in_flight = 1,
                               int64_t optimizer_shards = 1);
/// The same for a stage of v model chunks (the interleaved schedule): per chunk the most
/// micro-batches in flight at once, and the most tensors crossing a stage boundary the stage
/// holds at once beyond them (pipeline_memory in pipeline.h, plus the one being received and
/// the one being produced).
double predict_step_peak_bound(const TransformerConfig& config, int64_t dtype_bytes,
                               int64_t pipeline_stage,
                               const std::vector<int64_t>& in_flight_per_chunk,
                               int64_t boundary_tensors, int64_t optimizer_shards = 1);

}  // namespace actmem
