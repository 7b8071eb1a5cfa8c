// fixtures.h — the small models and training settings the test files share, so that each file
// names the model it means instead of building its own config field by field.
#pragma once

#include "actmem/config/config.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace actmem::testing {

/// A config of the given shape; everything else keeps TransformerConfig's defaults (dropout 0.1,
/// LayerNorm, GeLU, learned positions, byte vocabulary). ffn 0 means 4h.
inline TransformerConfig shaped_model(int64_t layers, int64_t hidden, int64_t heads, int64_t ffn,
                                      int64_t seq, int64_t micro_batch) {
  TransformerConfig c;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.num_attention_heads = heads;
  c.ffn_hidden_size = ffn;
  c.seq_length = seq;
  c.micro_batch_size = micro_batch;
  return c;
}

/// 2 layers, h 64, 4 heads, s 32, b 4: trains visibly in a few dozen steps.
inline TransformerConfig tiny_model() {
  return shaped_model(2, 64, 4, 0, 32, 4);
}

/// 4 layers, h 32, ffn 48, s 24, b 2: enough layers for every recompute chunking.
inline TransformerConfig small_model() {
  return shaped_model(4, 32, 4, 48, 24, 2);
}

/// Makes `c` a 3:1 GatedDeltaNet hybrid (linear_attention_freq 4: layers 0-2 GatedDeltaNet, layer
/// 3 attention) with Qwen3-Next's ingredients: SwiGLU, RMSNorm, RoPE, 2 key heads of 8 serving 4
/// value heads of 6 (grouped), a kernel-4 convolution.
inline void make_gdn_hybrid(TransformerConfig& c) {
  c.gated_linear_unit = true;
  c.normalization = "RMSNorm";
  c.position_embedding_type = "rope";
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  c.experimental_attention_variant = "gdn";
  c.linear_attention_freq = "4";
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 4;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 6;
  c.linear_conv_kernel_dim = 4;
}

/// The precisions the exactness and memory suites run at: fp32, bf16 and fp16 (float16 has CPU
/// kernels in the PyTorch 2.x this project builds against).
inline const char* const kPrecisions[] = {"fp32", "bf16", "fp16"};
/// Sets config's precision by name, with the softmax in fp32 at 16 bits (Megatron's usual
/// --attention-softmax-in-fp32).
inline void set_precision(TransformerConfig& c, const std::string& precision) {
  c.bf16 = precision == "bf16";
  c.fp16 = precision == "fp16";
  c.attention_softmax_in_fp32 = c.bf16 || c.fp16;
}
/// The initial dynamic loss scale the fp16 suites start from: 2^12. Megatron's 2^32 overflows
/// float16 gradients on every step of a few-step test (each overflow only halves the scale), so a
/// suite that started there would compare skipped steps only; dynamic scaling itself (overflows,
/// hysteresis, growth) has its own tests in test_mixed_precision.cpp.
inline constexpr double kFp16TestLossScale = 4096.0;
/// set_precision, and for fp16 the training's initial loss scale kFp16TestLossScale.
inline void set_precision(TransformerConfig& c, TrainingConfig& t, const std::string& precision) {
  set_precision(c, precision);
  if (c.fp16) t.initial_loss_scale = kFp16TestLossScale;
}

/// small_model with s 32 and offload from 256 elements, so every group moves something.
inline TransformerConfig offload_model() {
  TransformerConfig c = shaped_model(4, 32, 4, 48, 32, 2);
  c.min_offloaded_tensor_size = 256;
  return c;
}

/// The recompute strategies the predictor and plan tests sweep: keep everything, each selective
/// module and all of them, full uniform and block.
inline const std::pair<const char*, void (*)(TransformerConfig&)> kRecomputePolicies[] = {
    {"plain", [](TransformerConfig&) {}},
    {"core_attn", [](TransformerConfig& c) { c.recompute_granularity = "selective"; }},
    {"mlp",
     [](TransformerConfig& c) {
       c.recompute_granularity = "selective";
       c.recompute_modules = std::vector<std::string>{"mlp"};
     }},
    {"layernorm",
     [](TransformerConfig& c) {
       c.recompute_granularity = "selective";
       c.recompute_modules = std::vector<std::string>{"layernorm"};
     }},
    {"all",
     [](TransformerConfig& c) {
       c.recompute_granularity = "selective";
       c.recompute_modules = std::vector<std::string>{"core_attn", "mlp", "layernorm"};
     }},
    {"uniform2",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "uniform";
       c.recompute_num_layers = 2;
     }},
    {"block1",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "block";
       c.recompute_num_layers = 1;
     }},
};

/// 40 steps of AdamW with a short warmup, no validation.
inline TrainingConfig tiny_training() {
  TrainingConfig t;
  t.train_iters = 40;
  t.lr = 3e-3;
  t.min_lr = 3e-4;
  t.lr_warmup_iters = 1;  // short: tests shorten train_iters to 2 (warmup must end before decay)
  t.eval_interval = 0;
  return t;
}

}  // namespace actmem::testing
