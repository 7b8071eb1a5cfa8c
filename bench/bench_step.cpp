// bench_step.cpp — step time and tokens/s of the plain training step, for the default model and
// the 4-layer hidden-512 model the strategy benchmarks compare against.
//
// Reference: the same model in PyTorch eager on the same libtorch (bench/eager_step.py; run both
// with bench/compare_eager.sh). Validation: every step's loss must be finite. Timing: median of
// --iters steps after --warmup steps, measured by the Trainer around forward, backward and the
// optimizer step only.
#include "actmem/base/blas.h"
#include "actmem/flags/train_options.h"
#include "actmem/train/trainer.h"
#include "bench_common.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <optional>

namespace {

struct Preset {
  std::string name;
  actmem::TransformerConfig model;
};

std::vector<Preset> presets() {
  actmem::TransformerConfig small;  // the built-in default of `actmem train`
  actmem::TransformerConfig large;
  actmem::bench::use_reference_model(large);
  return {{"default", small}, {"4x512", large}};
}

}  // namespace

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // as the actmem program (Note [Reproducible products])
  CLI::App app{"bench_step: plain training-step time of actmem's GPT model"};
  std::string which = "all", json_path, precision = "fp32";
  int iters = 5, warmup = 2, threads = 0;
  app.add_option("--config", which, "default, 4x512 or all")->capture_default_str();
  app.add_option("--iters", iters, "Timed steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads (default: one per core)");
  app.add_option("--precision", precision,
                 "fp32, bf16, both (each model at fp32 then bf16, with the bf16/fp32 ratios), "
                 "or fp8 (bf16, then hybrid FP8 with delayed and with tensorwise scaling, with "
                 "the FP8/bf16 ratios; docs/fp8.md)")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16", "both", "fp8"}));
  app.add_option("--json", json_path, "Also write the results to FILE");
  CLI11_PARSE(app, argc, argv);
  actmem::bench::print_blas();

  try {
    const int n_threads = actmem::apply_thread_count(threads);
    nlohmann::json results = nlohmann::json::array();
    std::vector<std::string> precisions;
    if (precision == "fp32" || precision == "both") precisions.push_back("fp32");
    if (precision != "fp32") precisions.push_back("bf16");
    if (precision == "fp8") precisions.insert(precisions.end(), {"fp8-delayed", "fp8-tensorwise"});
    for (const auto& preset : presets()) {
      if (which != "all" && which != preset.name) continue;
      std::optional<nlohmann::json> fp32_result, bf16_result;
      for (const auto& prec : precisions) {
        actmem::TrainingConfig training;
        training.train_iters = warmup + iters;
        training.eval_interval = 0;
        actmem::TransformerConfig model = preset.model;
        actmem::bench::set_bench_precision(model, prec);
        actmem::Trainer trainer(model, training);
        std::vector<double> times;
        actmem::IterationStats last;
        for (int i = 0; i < warmup + iters; ++i) {
          last = trainer.train_step(/*compute_digest=*/false);
          TORCH_CHECK(std::isfinite(last.loss), "bench_step: non-finite loss at step ", i + 1);
          if (i >= warmup) times.push_back(last.step_time_s);
        }
        const auto& m = model;
        const double step = actmem::median(times);
        const double tokens = static_cast<double>(m.seq_length * m.micro_batch_size);
        nlohmann::json r = {{"config", preset.name},
                            {"precision", prec},
                            {"num_layers", m.num_layers},
                            {"hidden_size", m.hidden_size},
                            {"num_attention_heads", m.num_attention_heads},
                            {"ffn_hidden_size", m.ffn()},
                            {"seq_length", m.seq_length},
                            {"micro_batch_size", m.micro_batch_size},
                            {"threads", n_threads},
                            {"iters", iters},
                            {"step_time_s", step},
                            {"step_time_min_s", *std::min_element(times.begin(), times.end())},
                            {"tokens_per_s", tokens / step},
                            {"peak_device_bytes", last.peak_device_bytes},
                            {"activation_bytes", last.activation_bytes},
                            {"activation_peak_bytes", last.activation_peak_bytes},
                            {"blas", actmem::blas_report().to_json()}};
        std::cerr << preset.name << " " << prec << ": " << step * 1e3 << " ms/step, "
                  << tokens / step << " tokens/s, activations "
                  << actmem::format_bytes(last.activation_bytes) << ", peak "
                  << actmem::format_bytes(last.peak_device_bytes) << "\n";
        if (prec == "fp32") fp32_result = r;
        if (prec == "bf16" && fp32_result) {
          // Ratios against the fp32 run of the same model in this process.
          r["step_time_ratio_vs_fp32"] = step / (*fp32_result)["step_time_s"].get<double>();
          r["activation_bytes_ratio_vs_fp32"] = static_cast<double>(last.activation_bytes) /
                                                (*fp32_result)["activation_bytes"].get<double>();
          std::cerr << preset.name << " bf16/fp32: step time x"
                    << r["step_time_ratio_vs_fp32"].get<double>() << ", activations x"
                    << r["activation_bytes_ratio_vs_fp32"].get<double>() << "\n";
        }
        if (prec == "bf16") bf16_result = r;
        if (prec.rfind("fp8-", 0) == 0 && bf16_result) {
          // Ratios against the bf16 run of the same model in this process.
          r["step_time_ratio_vs_bf16"] = step / (*bf16_result)["step_time_s"].get<double>();
          r["activation_bytes_ratio_vs_bf16"] = static_cast<double>(last.activation_bytes) /
                                                (*bf16_result)["activation_bytes"].get<double>();
          std::cerr << preset.name << " " << prec << "/bf16: step time x"
                    << r["step_time_ratio_vs_bf16"].get<double>() << ", activations x"
                    << r["activation_bytes_ratio_vs_bf16"].get<double>() << "\n";
        }
        results.push_back(r);
      }
    }
    std::cout << results.dump(2) << std::endl;
    if (!json_path.empty()) std::ofstream(json_path) << results.dump(2) << "\n";
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
  return 0;
}
