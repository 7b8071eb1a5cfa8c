// bench_moe.cpp — what the MoE recompute and offload strategies cost and save, and what the
// load-balancing loss does to the routing.
//
// Part 1: a 4-layer MoE model (8 experts, top-2, grouped experts, shared experts); every
// strategy steps in one round-robin with the plain run, must stay bitwise equal to it at every
// step (the program fails otherwise), and is reported as step-time ratio and activation bytes
// against the plain run of the same process.
// Part 2: the same model trained from the same initialisation with and without the Switch
// load-balancing loss; the busiest expert's share of the routed tokens over the mean, per step.
#include "actmem/base/blas.h"
#include "actmem/base/report.h"
#include "actmem/flags/train_options.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/train/trainer.h"
#include "bench_common.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>

namespace {

using actmem::bench::Strategy;

std::vector<Strategy> strategies() {
  using actmem::bench::both;
  using actmem::bench::offload;
  using actmem::bench::selective;
  return {{"plain", [](actmem::TransformerConfig&) {}},
          {"recompute moe", selective({"moe"})},
          {"recompute moe_act", selective({"moe_act"})},
          {"recompute shared_experts", selective({"shared_experts"})},
          {"recompute layernorm moe_act", selective({"layernorm", "moe_act"})},
          {"offload expert_fc1", offload({"expert_fc1"})},
          {"offload moe_act", offload({"moe_act"})},
          {"offload+recompute moe_act", both(offload({"moe_act"}), selective({"moe_act"}))},
          {"offload expert_fc1 moe_act", offload({"expert_fc1", "moe_act"})}};
}

}  // namespace

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // as the actmem program (Note [Reproducible products])
  CLI::App app{"bench_moe: MoE recompute and offload strategies, and load balancing"};
  actmem::TrainOptions o;
  auto& m = o.model;
  m.num_layers = 4;
  m.hidden_size = 256;
  m.num_attention_heads = 4;
  m.seq_length = 256;
  m.micro_batch_size = 4;
  m.num_moe_experts = 8;
  m.moe_router_topk = 2;
  m.moe_ffn_hidden_size = 512;
  m.moe_shared_expert_intermediate_size = 512;
  o.disable_bias_linear = true;  // shared experts have no bias (Megatron)
  m.moe_grouped_gemm = true;
  m.moe_aux_loss_coeff = 1e-2;
  m.moe_z_loss_coeff = 1e-3;
  m.min_offloaded_tensor_size = 65536;  // the experts' tensors here are ~0.5M elements
  actmem::add_model_flags(app, o);
  int iters = 3, warmup = 1, balance_steps = 150;
  std::string json_path;
  app.add_option("--iters", iters, "Timed steps per strategy")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--balance-steps", balance_steps,
                 "Part 2: training steps with and without the load-balancing loss (0 skips it)")
      ->capture_default_str();
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
        actmem::bench::step_round_robin("bench_moe", base, list, warmup, iters);
    nlohmann::json out = {{"model", actmem::to_json(base)},
                          {"plain_step_s", actmem::median(run.times[0])}};
    std::cout << "MoE model: " << base.num_layers << " layers, h " << base.hidden_size << ", s "
              << base.seq_length << ", b " << base.micro_batch_size << ", " << base.num_moe_experts
              << " experts top-" << base.moe_router_topk << " of ffn " << base.moe_ffn()
              << ", shared ffn " << base.moe_shared_expert_intermediate_size.value_or(0) << ", "
              << base.precision() << "\n\n";
    out["strategies"] = actmem::bench::print_strategy_table(std::cout, list, run);
    if (balance_steps > 0) {
      // Part 2: same seed and data, with and without the load-balancing loss.
      actmem::TrainingConfig tb;
      tb.eval_interval = 0;
      tb.train_iters = balance_steps;
      actmem::TransformerConfig with = base, without = base;
      without.moe_aux_loss_coeff = 0.0;
      actmem::Trainer a(with, tb), b(without, tb);
      std::cout << "\nload balancing over " << balance_steps
                << " steps (busiest expert's routed tokens / mean, worst layer; 1 = balanced)\n"
                << std::setw(8) << "step" << std::setw(18)
                << "aux coeff " + c10::str(with.moe_aux_loss_coeff) << std::setw(14)
                << "no aux loss" << std::setw(22) << "load_balancing_loss\n";
      nlohmann::json curve = nlohmann::json::array();
      double window_a = 0, window_b = 0;
      int n = 0;
      for (int step = 1; step <= balance_steps; ++step) {
        const auto sa = a.train_step(false), sb = b.train_step(false);
        window_a += sa.expert_load_imbalance;
        window_b += sb.expert_load_imbalance;
        ++n;
        curve.push_back({{"step", step},
                         {"with_aux", sa.expert_load_imbalance},
                         {"without_aux", sb.expert_load_imbalance},
                         {"load_balancing_loss", sa.load_balancing_loss.value_or(0.0)}});
        if (step % 25 == 0 || step == balance_steps) {
          std::cout << std::setw(8) << step << std::setw(18) << std::setprecision(3) << window_a / n
                    << std::setw(14) << window_b / n << std::setw(21)
                    << sa.load_balancing_loss.value_or(0.0) << "\n";
          window_a = window_b = 0;
          n = 0;
        }
      }
      out["load_balancing"] = curve;
    }
    {
      // Part 3: the host pool under capacity routing (rows per step follow the router):
      // exact-size buffers against size classes, same run, same steps.
      actmem::TransformerConfig c = base;
      c.moe_expert_capacity_factor = 1.0;
      c.fine_grained_activation_offloading = true;
      c.offload_modules = {"expert_fc1", "moe_act"};
      actmem::TrainingConfig tp;
      tp.eval_interval = 0;
      const int steps = 8;
      tp.train_iters = steps;
      actmem::Trainer exact(c, tp), classes(c, tp);
      exact.offloader()->set_size_classes(false);
      for (int i = 0; i < steps; ++i) {
        exact.train_step(false);
        classes.train_step(false);
      }
      auto& pe = exact.offloader()->pool();
      auto& pc = classes.offloader()->pool();
      std::cout << "\nhost pool, capacity factor 1.0, offload expert_fc1 moe_act, " << steps
                << " steps: exact sizes " << pe.allocations() << " allocations ("
                << actmem::format_bytes(static_cast<double>(pe.bytes_allocated()))
                << " held), size classes " << pc.allocations() << " allocations ("
                << actmem::format_bytes(static_cast<double>(pc.bytes_allocated())) << " held)\n";
      out["host_pool"] = nlohmann::json{{"steps", steps},
                                        {"exact_allocations", pe.allocations()},
                                        {"exact_bytes_held", pe.bytes_allocated()},
                                        {"size_class_allocations", pc.allocations()},
                                        {"size_class_bytes_held", pc.bytes_allocated()}};
    }
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
  return 0;
}
