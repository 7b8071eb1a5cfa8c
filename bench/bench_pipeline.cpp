// bench_pipeline.cpp — step time, per-stage activation memory and the schedule's idle share of
// pipeline parallelism (1F1B and interleaved 1F1B) against one process, on a small model. Each
// configuration is a real run of `actmem launch --nproc-per-node p -- train
// --pipeline-model-parallel-size p ...
// --log-json FILE` (p = 1 runs train directly); this program reads the JSON logs (rank 0 logs
// every stage's memory and schedule) and prints one table.
//
//   bench_pipeline [--steps N] [--rounds R] [--micro-batches M] [--plot-dir DIR] [--json FILE]
//
// On this 2-core machine p = 1 runs with 2 intra-op threads and p = 2 with 1 thread per stage, so
// the step-time ratio compares the same cores; p = 4 puts four single-threaded stages on two
// cores (its time ratio measures oversubscription as much as the pipeline). The configurations
// run round-robin R times; each one's step time is the median over its rounds' steps 2...
#include "bench_common.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Case {
  std::string name;
  int p;
  std::string flags;
  int v = 1;  // model chunks per stage (the interleaved schedule)
};

struct Result {
  std::vector<double> step_times;        // every timed step of every round
  std::vector<int64_t> held, predicted;  // in flight per stage (last step)
  int64_t one_microbatch = 0;            // activation_bytes (the largest micro-batch)
  std::vector<double> idle;              // per stage: idle share of the last step's schedule
  double loss = 0.0;
};

void run_case(const Case& c, const std::string& model_flags, int steps, const std::string& plot,
              Result& r) {
  std::ostringstream cmd;
  cmd << ACTMEM_BINARY << " ";
  if (c.p > 1) cmd << "launch --nproc-per-node " << c.p << " -- ";
  cmd << "train " << model_flags << " --pipeline-model-parallel-size " << c.p << " " << c.flags
      << " --threads " << (c.p > 1 ? 1 : 2) << " --train-iters " << steps
      << " --eval-interval 0 --log-interval 1000";
  if (c.p > 1 && !plot.empty()) cmd << " --pipeline-plot " << plot;
  for (const auto& j : actmem::bench::run_train_logged("bench_pipeline", cmd.str())) {
    if (j["iteration"].get<int64_t>() > 1) r.step_times.push_back(j["step_time_s"].get<double>());
    r.loss = j["loss"].get<double>();
    r.one_microbatch = j["activation_bytes"].get<int64_t>();
    if (j.contains("inflight_activation_bytes_per_stage")) {
      r.held = j["inflight_activation_bytes_per_stage"].get<std::vector<int64_t>>();
      r.predicted = j["predicted_inflight_activation_bytes_per_stage"].get<std::vector<int64_t>>();
      r.idle.clear();
      double span = 0.0;
      for (const auto& stage : j["pipeline_schedule_per_stage"]) {
        for (const auto& e : stage) span = std::max(span, e["end_s"].get<double>());
      }
      for (const auto& stage : j["pipeline_schedule_per_stage"]) {
        double busy = 0.0;
        for (const auto& e : stage) busy += e["end_s"].get<double>() - e["start_s"].get<double>();
        r.idle.push_back(1.0 - busy / span);
      }
    } else {
      r.held = {j["inflight_activation_bytes"].get<int64_t>()};
      r.predicted = {j["predicted_inflight_activation_bytes"].get<int64_t>()};
      r.idle = {0.0};
    }
  }
  TORCH_CHECK(!r.step_times.empty(), "bench_pipeline: no timed steps (use --steps >= 2)");
}

}  // namespace

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // as the actmem program (Note [Reproducible products])
  CLI::App app{"Step time, per-stage activation memory and idle share of 1F1B pipelines"};
  int steps = 4, rounds = 2, micro = 8;
  std::string plot_dir, json_path;
  app.add_option("--steps", steps, "Optimizer steps per run (the first is untimed)")
      ->capture_default_str();
  app.add_option("--rounds", rounds, "Runs of every configuration, round-robin")
      ->capture_default_str();
  app.add_option("--micro-batches", micro, "Micro-batches per step (M)")->capture_default_str();
  app.add_option("--plot-dir", plot_dir,
                 "Write each pipeline's last schedule as DIR/pipeline-<name>.svg");
  app.add_option("--json", json_path, "Also write the results as JSON to FILE");
  CLI11_PARSE(app, argc, argv);
  try {
    TORCH_CHECK(steps >= 2 && rounds >= 1 && micro >= 1,
                "bench_pipeline: --steps >= 2, --rounds >= 1 and --micro-batches >= 1");
    const int b = 2;
    std::ostringstream m;
    m << "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
         "--micro-batch-size "
      << b << " --global-batch-size " << b * micro;
    const std::string full =
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1";
    const std::vector<Case> cases = {
        {"p=1", 1, ""},
        {"p=2", 2, ""},
        {"p=2 selective", 2, "--recompute-activations"},
        {"p=2 full uniform 1", 2, full},
        {"p=2 interleaved v=2", 2, "--num-virtual-stages-per-pipeline-rank 2", 2},
        {"p=4", 4, ""},
    };
    std::vector<Result> results(cases.size());
    for (int round = 0; round < rounds; ++round) {
      for (size_t i = 0; i < cases.size(); ++i) {
        std::cerr << "round " << round + 1 << "/" << rounds << ": " << cases[i].name << " ..."
                  << std::endl;
        std::string plot;
        if (!plot_dir.empty() && round == rounds - 1) {
          std::string name = cases[i].name;
          for (char& ch : name) ch = (ch == ' ' || ch == '=') ? '-' : ch;
          plot = plot_dir + "/pipeline-" + name + ".svg";
        }
        // Memory and schedule from the last round; step times from every round.
        Result r;
        run_case(cases[i], m.str(), steps, plot, r);
        r.step_times.insert(r.step_times.end(), results[i].step_times.begin(),
                            results[i].step_times.end());
        results[i] = std::move(r);
      }
    }
    std::cout << "model: " << m.str() << " (M = " << micro
              << " micro-batches), fp32, dropout 0.1/0.1; " << rounds << " round(s) of " << steps
              << " steps, step time = median of steps 2..\n"
                 "in flight: the most activation bytes a stage held at once (measured; = means "
                 "equal to the predictor); first/last: stage 0 over stage p-1 (Korthikanti et "
                 "al. 2022: p when stages hold equal layers); vs p=1: stage 0 over one process's "
                 "one micro-batch, against Korthikanti's first-stage factor (1 for 1F1B, "
                 "1 + (p-1)/(p v) interleaved); idle: the stages' mean share of the step without "
                 "work, against the bubble (p-1)/(M+p-1), interleaved (p-1)/v / (M+(p-1)/v)\n\n"
              << std::left << std::setw(20) << "configuration" << std::setw(30)
              << "in flight per stage MiB" << std::right << std::setw(4) << "" << std::setw(12)
              << "first/last" << std::setw(9) << "vs p=1" << std::setw(8) << "expect"
              << std::setw(8) << "idle" << std::setw(10) << "bubble" << std::setw(10) << "step ms"
              << std::setw(9) << "time x"
              << "\n";
    const double base_time = actmem::median(results[0].step_times);
    const double base_act = static_cast<double>(results[0].one_microbatch);
    nlohmann::json out = nlohmann::json::array();
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto& c = cases[i];
      const auto& r = results[i];
      const double t = actmem::median(r.step_times);
      double idle = 0.0;
      for (const double x : r.idle) idle += x / static_cast<double>(r.idle.size());
      // The bubble in units of a stage's micro-batch time: (p - 1) / v (Narayanan et al. 2021).
      const double idle_work = static_cast<double>(c.p - 1) / static_cast<double>(c.v);
      const double bubble = idle_work / (static_cast<double>(micro) + idle_work);
      const double korthikanti =
          c.v > 1 ? 1.0 + static_cast<double>(c.p - 1) / static_cast<double>(c.p * c.v) : 1.0;
      const double first_last =
          static_cast<double>(r.held.front()) / static_cast<double>(r.held.back());
      std::cout << std::left << std::setw(20) << c.name << std::setw(30)
                << actmem::bench::mib_joined(r.held, 2) << std::right << std::setw(4)
                << (r.held == r.predicted ? "=" : "!=") << std::fixed << std::setprecision(2)
                << std::setw(12) << first_last << std::setw(9)
                << static_cast<double>(r.held.front()) / base_act << std::setw(8) << korthikanti
                << std::setw(8) << idle << std::setw(10) << bubble << std::setprecision(1)
                << std::setw(10) << 1e3 * t << std::setprecision(2) << std::setw(9) << t / base_time
                << "\n";
      out.push_back(
          {{"configuration", c.name},
           {"pipeline_model_parallel_size", c.p},
           {"virtual_pipeline_model_parallel_size", c.v},
           {"first_stage_over_one_microbatch", static_cast<double>(r.held.front()) / base_act},
           {"korthikanti_first_stage_factor", korthikanti},
           {"micro_batches", micro},
           {"inflight_activation_bytes_per_stage", r.held},
           {"predicted_inflight_activation_bytes_per_stage", r.predicted},
           {"activation_bytes_one_microbatch", r.one_microbatch},
           {"first_over_last_stage", first_last},
           {"idle_share_per_stage", r.idle},
           {"bubble", bubble},
           {"step_time_s", t},
           {"step_time_ratio_vs_p1", t / base_time},
           {"final_loss", r.loss}});
    }
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
    return 0;
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
}
