// bench_common.h — what the benchmark programs share: the reference model they compare on and
// how they report an error.
#pragma once

#include "actmem/base/blas.h"
#include "actmem/base/report.h"
#include "actmem/config/config.h"
#include "actmem/train/step_rounds.h"
#include "actmem/train/trainer.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace actmem::bench {

/// The 4-layer model the benchmarks compare strategies on: hidden 512, 8 heads, ffn 2048,
/// sequence 512, micro-batch 4 (the other fields keep their defaults).
/// Sets `c`'s precision by the benchmarks' names: fp32, bf16, or bf16 with hybrid FP8 GEMMs
/// (docs/fp8.md) — fp8-delayed, fp8-delayed-max16 (a window of 16 and its maximum),
/// fp8-tensorwise.
inline void set_bench_precision(TransformerConfig& c, const std::string& precision) {
  c.bf16 = precision != "fp32";
  c.attention_softmax_in_fp32 = c.bf16;
  if (precision.rfind("fp8-", 0) != 0) return;
  c.fp8 = "hybrid";
  c.fp8_recipe = precision == "fp8-tensorwise" ? "tensorwise" : "delayed";
  if (precision == "fp8-delayed-max16") {
    c.fp8_amax_history_len = 16;
    c.fp8_amax_compute_algo = "max";
  }
}

inline void use_reference_model(TransformerConfig& c) {
  c.num_layers = 4;
  c.hidden_size = 512;
  c.num_attention_heads = 8;
  c.ffn_hidden_size = 2048;
  c.seq_length = 512;
  c.micro_batch_size = 4;
}

/// The BLAS and its threads (blas.h): a line on stderr at start-up, so every
/// benchmark's numbers say which library produced them.
inline void print_blas() {
  std::cerr << blas_report().summary() << std::endl;
}

/// A strategy the round-robin benchmarks compare: a name and its change to the base config.
struct Strategy {
  std::string name;
  std::function<void(TransformerConfig&)> apply;
};

/// Strategy changes the round-robin benchmarks combine: selective recompute of `modules`,
/// fine-grained offload of `modules`, and one change after another.
inline std::function<void(TransformerConfig&)> selective(std::vector<std::string> modules) {
  return [modules](TransformerConfig& c) {
    c.recompute_granularity = "selective";
    c.recompute_modules = modules;
  };
}
inline std::function<void(TransformerConfig&)> offload(std::vector<std::string> modules) {
  return [modules](TransformerConfig& c) {
    c.fine_grained_activation_offloading = true;
    c.offload_modules = modules;
  };
}
inline std::function<void(TransformerConfig&)> both(std::function<void(TransformerConfig&)> a,
                                                    std::function<void(TransformerConfig&)> b) {
  return [a, b](TransformerConfig& c) {
    a(c);
    b(c);
  };
}

/// What step_round_robin measured: per strategy its trainer, its timed step times and its last
/// step's stats.
struct RoundRobin {
  std::vector<std::unique_ptr<Trainer>> trainers;
  std::vector<std::vector<double>> times;
  std::vector<IterationStats> last;
};

/// Builds one trainer per strategy from `base` and steps them round-robin, in a new order every
/// round (run_shuffled_rounds, Note [Step round order] in step_rounds.h: drift of the machine hits
/// all alike, and no strategy always runs after the same one), for warmup + iters steps, timing
/// the last `iters`; throws unless every strategy's loss and gradient digest equal the first
/// one's (the plain run) at every step.
inline RoundRobin step_round_robin(const char* program, const TransformerConfig& base,
                                   const std::vector<Strategy>& strategies, int warmup, int iters) {
  TrainingConfig t;
  t.eval_interval = 0;
  t.train_iters = warmup + iters;
  RoundRobin r;
  std::vector<Trainer*> order;
  for (const auto& s : strategies) {
    TransformerConfig c = base;
    s.apply(c);
    r.trainers.push_back(std::make_unique<Trainer>(c, t));
    order.push_back(r.trainers.back().get());
  }
  r.times.resize(strategies.size());
  const size_t n = strategies.size();
  run_shuffled_rounds(
      order, warmup + iters, /*compute_digest=*/true,
      [&](int it, const std::vector<IterationStats>& st) {
        r.last = st;
        for (size_t i = 0; i < n; ++i) {
          if (it >= warmup) r.times[i].push_back(st[i].step_time_s);
          TORCH_CHECK(st[i].grad_digest == st[0].grad_digest && st[i].loss == st[0].loss, program,
                      ": ", strategies[i].name,
                      " is not bitwise equal to "
                      "the plain run at step ",
                      it + 1);
        }
        std::cerr << "step " << it + 1 << "/" << warmup + iters << " done for all strategies\n";
      });
  return r;
}

/// Prints a round-robin's table (median step time, its ratio to the plain run — the first
/// strategy —, activation bytes and their share of the plain run's, offloaded and predicted
/// bytes) and returns the same rows as JSON. Every row was checked bitwise equal to the plain
/// run by step_round_robin.
inline nlohmann::json print_strategy_table(std::ostream& os, const std::vector<Strategy>& list,
                                           const RoundRobin& run) {
  const double plain = median(run.times[0]);
  os << std::left << std::setw(38) << "strategy" << std::right << std::setw(9) << "step s"
     << std::setw(8) << "ratio" << std::setw(13) << "activations" << std::setw(10) << "vs plain"
     << std::setw(13) << "offloaded" << std::setw(12) << "predicted" << std::setw(8) << "exact\n";
  nlohmann::json rows = nlohmann::json::array();
  for (size_t i = 0; i < list.size(); ++i) {
    const double step = median(run.times[i]);
    const IterationStats& st = run.last[i];
    os << std::left << std::setw(38) << list[i].name << std::right << std::fixed << std::setw(9)
       << std::setprecision(3) << step << std::setw(8) << step / plain << std::setw(13)
       << format_bytes(static_cast<double>(st.activation_bytes)) << std::setw(9)
       << std::setprecision(1)
       << 100.0 * static_cast<double>(st.activation_bytes) /
              static_cast<double>(run.last[0].activation_bytes)
       << "%" << std::setw(13) << format_bytes(static_cast<double>(st.offloaded_bytes))
       << std::setw(12) << format_bytes(static_cast<double>(st.predicted_activation_bytes))
       << std::setw(7) << "yes"
       << "\n";
    rows.push_back({{"name", list[i].name},
                    {"step_time_s", step},
                    {"ratio", step / plain},
                    {"activation_bytes", st.activation_bytes},
                    {"predicted_activation_bytes", st.predicted_activation_bytes},
                    {"offloaded_bytes", st.offloaded_bytes},
                    {"bitwise_equal_to_plain", true}});
  }
  return rows;
}

/// Bytes in MiB with `digits` decimals, for the tables; several values joined by " / ".
inline std::string mib(int64_t bytes, int digits = 1) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << static_cast<double>(bytes) / 1048576.0;
  return os.str();
}
inline std::string mib_joined(const std::vector<int64_t>& values, int digits = 1) {
  std::string s;
  for (size_t i = 0; i < values.size(); ++i) s += (i ? " / " : "") + mib(values[i], digits);
  return s;
}

/// Runs `command` (an `actmem train` command line, under `actmem launch` or not) with its JSON log
/// in a temporary file and its output discarded; returns the log's iteration records (the
/// configuration record left out). `program` names the caller in the error a failed run raises.
inline std::vector<nlohmann::json> run_train_logged(const std::string& program,
                                                    const std::string& command) {
  const std::string log = "/tmp/" + program + "_" + std::to_string(::getpid()) + ".jsonl";
  const std::string full = command + " --log-json " + log + " > /dev/null";
  const int rc = std::system(full.c_str());
  TORCH_CHECK(rc == 0, program, ": `", full, "` failed with status ", rc);
  std::vector<nlohmann::json> records;
  std::ifstream f(log);
  std::string line;
  while (std::getline(f, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("iteration")) records.push_back(std::move(j));
  }
  std::remove(log.c_str());
  return records;
}

/// One line on stderr and exit status 1, as `actmem` does.
inline int report(const c10::Error& e) {
  std::cerr << "error: " << e.msg().substr(0, e.msg().find('\n')) << std::endl;
  return 1;
}

}  // namespace actmem::bench
