// parallel_workers.h — the multi-process tests' two halves (Note [Ranks are the test binary]): the
// test side runs N ranks of a scenario under launch and reads back what each wrote; the rank side
// is the same test binary started with --rank, which runs the scenario a test file registered.
#pragma once

#include "actmem/parallel/tensor_parallel.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace actmem::testing {

/// What a rank was asked to run: its scenario's options, from the rank's command line
///   --rank SCENARIO OUT_DIR [--sp] [--no-dropout] [--only NAME] [--variant V] [--tp T] [--ep E]
///          [--pp P] [--vp V] [--layers L] [--first N] [--last N] [--die STAGE]
///          [--dispatcher D] [--bucket N] [--global-batch G] [--batch-schedule S]
/// (each scenario reads the ones it documents beside its registration).
struct RankOptions {
  std::string scenario, out_dir;
  bool sp = false, dropout = true;
  std::string only, variant = "base";
  int tp = 0, ep = 1, pp = 1;  // tp 0: every rank in one tensor-parallel group
  int64_t layers = 4, vp = 1;
  int die_stage = -1;
  std::optional<int64_t> first_layers, last_layers;
  int64_t global_batch = 0, bucket = 0;
  std::string dispatcher = "alltoall", batch_schedule;
  /// Parses argv[2...] (argv[1] is --rank); throws for an unknown flag.
  static RankOptions parse(int argc, char** argv);
};

/// A rank's body: what it measured, written to OUT_DIR/rank<R>.json under the scenario's name.
using RankScenario =
    std::function<nlohmann::json(const RankOptions& options, const TensorParallelGroup& group)>;

/// Registers `body` under `name` (at static initialisation: ACTMEM_RANK_SCENARIO); throws for a
/// name registered twice.
bool register_rank_scenario(const std::string& name, RankScenario body);

/// Registers a rank scenario beside the tests that run it.
#define ACTMEM_RANK_SCENARIO(name, body) \
  const bool actmem_rank_scenario_##name = ::actmem::testing::register_rank_scenario(#name, body)

/// Whether this process was started as a rank (argv[1] is --rank).
bool is_rank(int argc, char** argv);

/// The rank side: joins the process groups from the launcher's environment, runs the scenario
/// and writes its result; 0, or 1 with the error on stderr.
int run_rank(int argc, char** argv);

/// The test side: this test binary's path, which launch starts as each rank.
std::string test_binary();

/// Runs `nproc` ranks of scenario args[0] (with args[1...]); returns each rank's JSON (rank
/// order). Fails the test on error.
std::vector<nlohmann::json> run_workers(int nproc, std::vector<std::string> args);

}  // namespace actmem::testing
