// bench_parallel.cpp — per-rank activation memory and step time of tensor and sequence
// parallelism on the 4x512 reference model, and of data parallelism with and without the
// overlapped bucketed gradient reduction and the distributed optimizer. Each configuration is a
// real run of `actmem launch --nproc-per-node N -- train ... --log-json FILE` (one process runs
// train directly); this program reads the JSON logs (rank 0 logs every rank's memory) and prints
// one table.
//
//   bench_parallel [--steps N] [--small] [--only SUBSTRING] [--json FILE]
//
// On this 2-core machine one process runs with 2 intra-op threads and two with 1 thread each, so
// step-time ratios compare the same cores; Gloo's loopback collectives are the overhead measured.
#include "bench_common.h"

#include "actmem/base/blas.h"
#include "actmem/train/trainer.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Case {
  std::string name;
  int t;
  std::string flags;
  int nproc = 0;  // 0: t (tensor parallelism only); otherwise t x d
};

struct Result {
  std::string name;
  int t = 1;
  std::vector<int64_t> act, act_peak, device_peak;
  int64_t predicted = 0;
  double step_s = 0.0;
  double loss = 0.0;
};

Result run_case(const Case& c, const std::string& model_flags, int steps) {
  std::ostringstream cmd;
  cmd << ACTMEM_BINARY << " ";
  const int nproc = c.nproc > 0 ? c.nproc : c.t;
  if (nproc > 1) cmd << "launch --nproc-per-node " << nproc << " -- ";
  cmd << "train " << model_flags << " --tensor-model-parallel-size " << c.t << " " << c.flags
      << " --threads " << (nproc > 1 ? 1 : 2) << " --train-iters " << steps
      << " --eval-interval 0 --log-interval 1000";
  Result r;
  r.name = c.name;
  r.t = c.t;
  std::vector<double> times;
  for (const auto& j : actmem::bench::run_train_logged("bench_parallel", cmd.str())) {
    if (j["iteration"].get<int64_t>() > 1) times.push_back(j["step_time_s"].get<double>());
    r.loss = j["loss"].get<double>();
    r.predicted = j["predicted_activation_bytes"].get<int64_t>();
    if (j.contains("activation_bytes_per_rank")) {
      r.act = j["activation_bytes_per_rank"].get<std::vector<int64_t>>();
      r.act_peak = j["activation_peak_bytes_per_rank"].get<std::vector<int64_t>>();
      r.device_peak = j["peak_device_bytes_per_rank"].get<std::vector<int64_t>>();
    } else {
      r.act = {j["activation_bytes"].get<int64_t>()};
      r.act_peak = {j["activation_peak_bytes"].get<int64_t>()};
      r.device_peak = {j["peak_device_bytes"].get<int64_t>()};
    }
  }
  TORCH_CHECK(!times.empty(), "bench_parallel: no timed steps (use --steps >= 2)");
  r.step_s = actmem::median(times);
  return r;
}

// "a / b" for two ranks, or "a" when they are equal or there is one.
std::string per_rank(const std::vector<int64_t>& v) {
  bool same = true;
  for (auto x : v) same = same && x == v[0];
  return same ? actmem::bench::mib(v[0]) : actmem::bench::mib_joined(v);
}

}  // namespace

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // as the actmem program (Note [Reproducible products])
  CLI::App app{"Per-rank activation memory and step time of tensor and sequence parallelism"};
  int steps = 3;
  bool small = false;
  std::string json_path, only;
  app.add_option("--only", only,
                 "Run only the configurations whose name contains SUBSTRING "
                 "(the first configuration always runs: the ratios' baseline)");
  app.add_option("--steps", steps, "Optimizer steps per configuration (the first is untimed)")
      ->capture_default_str();
  app.add_flag("--small", small, "A small model (a quick check)");
  app.add_option("--json", json_path, "Also write the results as JSON to FILE");
  CLI11_PARSE(app, argc, argv);
  try {
    actmem::TransformerConfig ref;
    actmem::bench::use_reference_model(ref);
    std::ostringstream m;
    if (small) {
      m << "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
           "--micro-batch-size 2";
    } else {
      m << "--num-layers " << ref.num_layers << " --hidden-size " << ref.hidden_size
        << " --num-attention-heads " << ref.num_attention_heads << " --ffn-hidden-size "
        << ref.ffn() << " --seq-length " << ref.seq_length << " --micro-batch-size "
        << ref.micro_batch_size;
    }
    const std::string full =
        "--recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1";
    const std::vector<Case> cases = {
        {"t=1", 1, ""},
        {"t=2", 2, ""},
        {"t=2 SP", 2, "--sequence-parallel"},
        {"t=1 selective core_attn", 1, "--recompute-activations"},
        {"t=2 selective core_attn", 2, "--recompute-activations"},
        {"t=2 SP selective core_attn", 2, "--sequence-parallel --recompute-activations"},
        {"t=1 full uniform 1", 1, full},
        {"t=2 full uniform 1", 2, full},
        {"t=2 full + distribute", 2, full + " --distribute-saved-activations"},
        {"t=2 SP full uniform 1", 2, "--sequence-parallel " + full},
        // Data parallelism, one micro-batch per rank: the whole backward is the last one.
        {"d=2", 1, "", 2},
        {"d=2 overlap, 1M buckets", 1, "--overlap-grad-reduce --ddp-bucket-size 1000000", 2},
        {"d=2 overlap, 4M buckets", 1, "--overlap-grad-reduce --ddp-bucket-size 4000000", 2},
        // The optimizer state sharded over the two ranks (AdamW's moments: 8 of the 16 bytes
        // per parameter that the weights, gradients and moments take in fp32).
        {"d=2 distributed optimizer", 1, "--use-distributed-optimizer", 2},
        {"d=2 dist. opt. + overlap 4M", 1,
         "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 4000000", 2},
    };
    std::vector<Result> results;
    for (const auto& c : cases) {
      if (!only.empty() && &c != &cases.front() && c.name.find(only) == std::string::npos) continue;
      std::cerr << "running " << c.name << " ..." << std::endl;
      results.push_back(run_case(c, m.str(), steps));
    }
    const double base_act = static_cast<double>(results[0].act[0]);
    const double base_time = results[0].step_s;
    std::cout << "model: " << m.str() << ", fp32, dropout 0.1/0.1, " << steps
              << " steps (median of steps 2..)\n\n"
              << std::left << std::setw(28) << "configuration" << std::right << std::setw(16)
              << "act/rank MiB" << std::setw(16) << "act peak MiB" << std::setw(16)
              << "device peak MiB" << std::setw(12) << "predicted" << std::setw(10) << "vs t=1"
              << std::setw(10) << "step s" << std::setw(10) << "time x"
              << "\n";
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : results) {
      std::cout << std::left << std::setw(28) << r.name << std::right << std::setw(16)
                << per_rank(r.act) << std::setw(16) << per_rank(r.act_peak) << std::setw(16)
                << per_rank(r.device_peak) << std::setw(12) << actmem::bench::mib(r.predicted)
                << std::setw(10) << std::fixed << std::setprecision(3) << r.act[0] / base_act
                << std::setw(10) << r.step_s << std::setw(10) << r.step_s / base_time << "\n";
      out.push_back({{"configuration", r.name},
                     {"tensor_model_parallel_size", r.t},
                     {"activation_bytes_per_rank", r.act},
                     {"activation_peak_bytes_per_rank", r.act_peak},
                     {"peak_device_bytes_per_rank", r.device_peak},
                     {"predicted_activation_bytes", r.predicted},
                     {"step_time_s", r.step_s},
                     {"step_time_ratio_vs_t1", r.step_s / base_time},
                     {"final_loss", r.loss}});
    }
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
    return 0;
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
}
