// bench_mla.cpp — what the multi-latent attention recompute and offload strategies cost and save.
//
// A 4-layer MLA model (DeepSeek-style: compressed queries, normed latents, RMSNorm, SwiGLU,
// YaRN); every strategy steps in one round-robin with the plain run, must stay bitwise equal to
// it at every step (the program fails otherwise), and is reported as step-time ratio and
// activation bytes against the plain run of the same process, with the exact predictor's bytes.
#include "actmem/base/blas.h"
#include "actmem/flags/train_options.h"
#include "actmem/memory/memory_model.h"
#include "bench_common.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

namespace {

using actmem::bench::Strategy;

std::vector<Strategy> strategies() {
  using actmem::bench::both;
  using actmem::bench::offload;
  using actmem::bench::selective;
  return {{"plain", [](actmem::TransformerConfig&) {}},
          {"recompute core_attn", selective({"core_attn"})},
          {"recompute mla_up_proj", selective({"mla_up_proj"})},
          {"recompute mla_up_proj core_attn", selective({"mla_up_proj", "core_attn"})},
          {"recompute layernorm mla_up_proj", selective({"layernorm", "mla_up_proj"})},
          {"offload qkv_linear", offload({"qkv_linear"})},
          {"offload core_attn attn_proj", offload({"core_attn", "attn_proj"})},
          {"offload qkv_linear+rec. mla_up_proj",
           both(offload({"qkv_linear"}), selective({"mla_up_proj"}))},
          {"offload core_attn+rec. mla_up_proj",
           both(offload({"core_attn", "attn_proj"}), selective({"mla_up_proj"}))}};
}

}  // namespace

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // as the actmem program (Note [Reproducible products])
  CLI::App app{"bench_mla: multi-latent attention recompute and offload strategies"};
  actmem::TrainOptions o;
  auto& m = o.model;
  m.num_layers = 4;
  m.hidden_size = 256;
  m.num_attention_heads = 8;
  m.ffn_hidden_size = 512;
  m.seq_length = 256;
  m.micro_batch_size = 4;
  m.multi_latent_attention = true;
  m.q_lora_rank = 96;
  m.kv_lora_rank = 64;
  m.qk_head_dim = 32;
  m.qk_pos_emb_head_dim = 16;
  m.v_head_dim = 32;
  m.qk_layernorm = true;
  m.rotary_scaling_factor = 4.0;
  o.normalization_flag = "RMSNorm";
  o.swiglu = true;
  o.use_rope = true;
  o.disable_bias_linear = true;
  m.min_offloaded_tensor_size = 65536;
  actmem::add_model_flags(app, o);
  int iters = 3, warmup = 1;
  std::string json_path;
  app.add_option("--iters", iters, "Timed steps per strategy")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--threads", o.threads, "Intra-op threads (default: one per core)");
  app.add_option("--json", json_path, "Also write the results to FILE");
  CLI11_PARSE(app, argc, argv);
  actmem::bench::print_blas();
  try {
    o.finalize();
    actmem::apply_thread_count(o.threads);
    const actmem::TransformerConfig base = o.model;
    const auto list = strategies();
    const actmem::bench::RoundRobin run =
        actmem::bench::step_round_robin("bench_mla", base, list, warmup, iters);
    std::cout << "MLA model: " << base.num_layers << " layers, h " << base.hidden_size << ", "
              << base.num_attention_heads << " heads, s " << base.seq_length << ", b "
              << base.micro_batch_size << ", q_lora_rank " << base.q_lora_rank.value_or(0)
              << ", kv_lora_rank " << base.kv_lora_rank << ", head dims qk " << base.qk_head_dim
              << " + rope " << base.qk_pos_emb_head_dim << ", v " << base.v_head_dim << ", "
              << base.precision() << "\n\n";
    nlohmann::json out = {{"model", actmem::to_json(base)},
                          {"plain_step_s", actmem::median(run.times[0])}};
    out["strategies"] = actmem::bench::print_strategy_table(std::cout, list, run);
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
  return 0;
}
