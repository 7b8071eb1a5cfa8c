// inspect_cmd.cpp — `actmem inspect`: run one training step and print the activation ledger per
// module and layer, in bytes, in units of s·b·h (and a·s²·b for the s×s tensors), beside the
// matching Korthikanti Table 1 term at this run's dtype and the exact predictor.
#include "actmem/base/blas.h"
#include "actmem/base/environment.h"
#include "actmem/config/activation_plan.h"
#include "actmem/flags/train_options.h"
#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/parallel/distributed.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/train/trainer.h"
#include "commands.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <iomanip>
#include <iostream>
#include <map>
#include <memory>

namespace actmem::cli {

namespace {

struct InspectOptions {
  TrainOptions train;
  bool json = false;
  bool records = false;
  bool plan = false;
};

// One training step with the ledger on: what it saved, measured and predicted.
struct Inspection {
  std::unique_ptr<ActivationLedger> ledger = std::make_unique<ActivationLedger>();
  IterationStats stats;
  PredictedBytes predicted;
  bool cpu = true;
  int rank = 0;
};

Inspection inspect_one_step(const InspectOptions& o) {
  apply_thread_count(o.train.threads);
  TrainingConfig t = o.train.training;
  t.eval_interval = 0;
  const TransformerConfig& c = o.train.model;
  // Under `actmem launch` each rank measures its own activations; rank 0 prints.
  const DistEnv dist = dist_env_from_environment();
  t.device = device_for_rank(t.device, dist);
  // The launch is t x d ranks with expert parallelism carved out of d, as for train.
  const TensorParallelSession tp_session(
      dist, c10::Device(t.device), static_cast<int>(c.tensor_model_parallel_size),
      static_cast<int>(c.expert_model_parallel_size),
      static_cast<int>(c.pipeline_model_parallel_size),
      distributed_timeout_from_minutes(o.train.distributed_timeout_minutes));
  if (c.virtual_pipeline_size() > 1) {
    // The interleaved schedule needs at least one group of micro-batches (p by default); the
    // ledger records the first micro-batch's first chunk either way.
    t.global_batch_size =
        c.micro_batch_size * c.microbatch_group_size() * data_parallel_group().size;
    t.step_batch_size_schedule.clear();
  }
  Trainer trainer(c, t);
  Inspection in;
  trainer.set_ledger(in.ledger.get());
  in.stats = trainer.train_step(false);
  trainer.set_ledger(nullptr);
  in.cpu = c10::Device(t.device).is_cpu();
  const MoERouting routing = trainer.model().moe_stats().routing();
  in.predicted = predict_activation_bytes(c, 0, in.cpu, &routing);
  in.rank = dist.rank;
  return in;
}

// --json: the totals, the modules with the paper's terms, and every saved tensor.
void print_json(const TransformerConfig& c, const Inspection& in) {
  const ActivationLedger& ledger = *in.ledger;
  const int64_t e = c.element_bytes();
  const double sbh = static_cast<double>(c.seq_length * c.micro_batch_size * c.hidden_size);
  nlohmann::json j = {
      {"precision", c.precision()},           {"activation_bytes", in.stats.activation_bytes},
      {"ledger_bytes", ledger.total_bytes()}, {"predicted_bytes", in.predicted.total},
      {"modules", nlohmann::json::array()},   {"records", nlohmann::json::array()}};
  for (const auto& [module, bytes] : ledger.bytes_by_module()) {
    const double paper = korthikanti_module_bytes(module, c, e);
    j["modules"].push_back({{"module", module}, {"bytes", bytes}, {"sbh", bytes / sbh}});
    if (paper >= 0) {
      j["modules"].back()["korthikanti_bytes"] = paper;
      const ModuleExtra extra = module_bytes_beyond_paper(module, c, in.cpu);
      j["modules"].back()["beyond_paper_bytes"] = extra.bytes;
      j["modules"].back()["beyond_paper"] = extra.what;
    }
  }
  for (const auto& r : ledger.records()) {
    j["records"].push_back({{"module", r.module},
                            {"op", r.op},
                            {"shape", r.shape},
                            {"dtype", r.dtype},
                            {"storage_bytes", r.storage_bytes},
                            {"counted", r.counted}});
  }
  std::cout << j.dump(2) << std::endl;
}

// The table: each module's bytes in units of sbh and as^2b beside the paper's term.
void print_table(const InspectOptions& o, const TransformerConfig& c, const Inspection& in) {
  const ActivationLedger& ledger = *in.ledger;
  const IterationStats& st = in.stats;
  const PredictedBytes& predicted = in.predicted;
  const bool cpu = in.cpu;
  const int64_t e = c.element_bytes();
  const double sbh = static_cast<double>(c.seq_length * c.micro_batch_size * c.hidden_size);
  const double as2b =
      static_cast<double>(c.num_attention_heads * c.seq_length * c.seq_length * c.micro_batch_size);
  std::cout << "actmem inspect: activations saved by one forward (s=" << c.seq_length
            << " b=" << c.micro_batch_size << " h=" << c.hidden_size
            << " a=" << c.num_attention_heads << ", " << c.precision()
            << "; sbh = " << static_cast<int64_t>(sbh)
            << " elements, as^2b = " << static_cast<int64_t>(as2b) << ")\n"
            << "attention " << c.attention_summary() << "\n"
            << runtime_summary() << "\n"
            << blas_report().summary() << "\n\n";
  std::cout << std::left << std::setw(52) << "module" << std::right << std::setw(12) << "bytes"
            << std::setw(8) << "sbh" << std::setw(8) << "as2b" << std::setw(14) << "Korthikanti"
            << std::setw(10) << "beyond"
            << "  what\n";
  for (const auto& [module, bytes] : ledger.bytes_by_module()) {
    // The s x s share of this module: records of 3 or more dims whose last two are both s (the
    // scores [b, a, s, s] or [b a, s, s]; a 2-D [s b, width] matrix whose width happens to
    // equal s is not one).
    int64_t square = 0;
    for (const auto& r : ledger.records()) {
      if (r.counted && r.module == module && r.shape.size() >= 3 &&
          r.shape[r.shape.size() - 1] == c.seq_length &&
          r.shape[r.shape.size() - 2] == c.seq_length) {
        square += r.storage_bytes;
      }
    }
    const double paper = korthikanti_module_bytes(module, c, e);
    std::cout << std::left << std::setw(52) << module << std::right << std::setw(12) << bytes
              << std::fixed << std::setprecision(2) << std::setw(8) << (bytes - square) / sbh
              << std::setw(8) << square / as2b << std::setw(14)
              << (paper >= 0 ? std::to_string(static_cast<int64_t>(paper)) : std::string("-"));
    if (paper >= 0) {
      const ModuleExtra extra = module_bytes_beyond_paper(module, c, cpu);
      std::cout << std::setw(10) << extra.bytes << "  " << extra.what;
    }
    std::cout << "\n";
  }
  std::cout << "\n(sbh and as2b: units of s*b*h and a*s*s*b elements; Korthikanti: the paper's "
               "term for the module "
            << (e == 2 ? "(its own units: 16-bit values, 1-byte masks)"
                       : "at " + std::string(c.precision()) + " (16-bit terms scaled by " +
                             std::to_string(e / 2) + ", 1-byte masks)")
            << "; beyond: what this implementation keeps beyond the paper's term)\n"
            << "\nledger total " << ledger.total_bytes() << " B ("
            << format_bytes(ledger.total_bytes()) << "); tracker activation_bytes "
            << st.activation_bytes << " B; predicted " << predicted.total << " B\n";
  if (c.pipeline_model_parallel_size > 1) {
    // Rank 0 is the first stage: the table covers its layers and embedding (under the
    // interleaved schedule its first model chunk's: the ledger records that chunk's forward).
    const int64_t v = c.virtual_pipeline_size();
    std::cout << "pipeline stage 0 of " << c.pipeline_model_parallel_size;
    if (v > 1) {
      std::cout << " (the table: model chunk 0 of " << v << "); under interleaved 1F1B";
    } else {
      std::cout << ": the tracker also holds the output sent on to stage 1 ("
                << st.predicted_activation_bytes - predicted.total << " B); under 1F1B";
    }
    std::cout << " the stage held " << st.inflight_activation_bytes << " B at once (predicted "
              << st.predicted_inflight_activation_bytes << " B; docs/parallelism.md)\n";
  }
  if (o.records) {
    std::cout << "\nrecords:\n";
    for (const auto& r : ledger.records()) {
      std::cout << "  " << std::left << std::setw(52) << r.module << std::setw(34) << r.op << " [";
      for (size_t i = 0; i < r.shape.size(); ++i) std::cout << (i ? "," : "") << r.shape[i];
      std::cout << "] " << r.dtype << " " << r.storage_bytes << (r.counted ? "" : " (shared)")
                << "\n";
    }
  }
}

int run(InspectOptions& o) {
  o.train.finalize();
  if (o.plan) {
    // The activation plan alone (Note [One plan]): no step runs.
    const ActivationPlan plan = make_activation_plan(o.train.model);
    if (o.json) {
      std::cout << plan.to_json().dump(2) << std::endl;
    } else {
      std::cout << "actmem inspect --plan: " << o.train.model.num_layers << " layers\n";
      print_activation_plan(std::cout, plan);
    }
    return 0;
  }
  const Inspection in = inspect_one_step(o);
  if (in.rank != 0) return 0;  // under `actmem launch`, rank 0 prints
  if (o.json) {
    print_json(o.train.model, in);
  } else {
    print_table(o, o.train.model, in);
  }
  return 0;
}

}  // namespace

Runner add_inspect_command(CLI::App& app) {
  auto o = std::make_shared<InspectOptions>();
  CLI::App* cmd = app.add_subcommand("inspect", "Run one step and print the activation ledger");
  // What one measured step uses: the model, its recompute and offload, the data and the runtime
  // (no optimizer schedule, no logs: inspect runs one step and prints what it saved).
  add_flags(*cmd, o->train, kModelFlags | kDataFlags | kRuntimeFlags | kDistributedFlags);
  cmd->add_flag("--json", o->json, "print JSON instead of the table");
  cmd->add_flag("--records", o->records, "also list every saved tensor");
  cmd->add_flag("--plan", o->plan,
                "print the activation plan per layer (keep, recompute, offload) and stop");
  return [o, cmd]() { return cmd->parsed() ? run(*o) : -1; };
}

}  // namespace actmem::cli
