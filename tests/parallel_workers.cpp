// parallel_workers.cpp — run_workers and the rank side of the multi-process tests
// (parallel_workers.h).
#include "parallel_workers.h"

#include "actmem/parallel/distributed.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include <unistd.h>

namespace actmem::testing {

using nlohmann::json;

// Note [Ranks are the test binary]
// A multi-process test starts N copies of the test binary itself (launch, as `actmem launch`
// starts workers), each with --rank and a scenario's name: test_main.cpp hands such a process to
// run_rank() before GoogleTest sees it, and the rank runs the body its test file registered with
// ACTMEM_RANK_SCENARIO, beside the tests that read what it wrote. One binary, so a rank and its
// test are built from the same sources and cannot drift; the ranks keep the programs' settings
// (one intra-op thread each, N ranks sharing the machine's cores; reproducible BLAS) and run
// without the tracking allocator the test process installs, as the programs' workers do until
// their trainer starts.

namespace {
std::map<std::string, RankScenario>& scenarios() {
  static std::map<std::string, RankScenario> all;
  return all;
}
}  // namespace

RankOptions RankOptions::parse(int argc, char** argv) {
  TORCH_CHECK(argc >= 4, "usage: actmem_tests --rank SCENARIO OUT_DIR [options]");
  RankOptions o;
  o.scenario = argv[2];
  o.out_dir = argv[3];
  for (int i = 4; i < argc; ++i) {
    const std::string a = argv[i];
    const bool value = i + 1 < argc;
    if (a == "--sp") {
      o.sp = true;
    } else if (a == "--no-dropout") {
      o.dropout = false;
    } else if (a == "--only" && value) {
      o.only = argv[++i];
    } else if (a == "--variant" && value) {
      o.variant = argv[++i];
    } else if (a == "--tp" && value) {
      o.tp = std::stoi(argv[++i]);
    } else if (a == "--ep" && value) {
      o.ep = std::stoi(argv[++i]);
    } else if (a == "--pp" && value) {
      o.pp = std::stoi(argv[++i]);
    } else if (a == "--die" && value) {
      o.die_stage = std::stoi(argv[++i]);
    } else if (a == "--vp" && value) {
      o.vp = std::stoll(argv[++i]);
    } else if (a == "--layers" && value) {
      o.layers = std::stoll(argv[++i]);
    } else if (a == "--first" && value) {
      o.first_layers = std::stoll(argv[++i]);
    } else if (a == "--last" && value) {
      o.last_layers = std::stoll(argv[++i]);
    } else if (a == "--dispatcher" && value) {
      o.dispatcher = argv[++i];
    } else if (a == "--bucket" && value) {
      o.bucket = std::stoll(argv[++i]);
    } else if (a == "--global-batch" && value) {
      o.global_batch = std::stoll(argv[++i]);
    } else if (a == "--batch-schedule" && value) {
      o.batch_schedule = argv[++i];
    } else {
      TORCH_CHECK(false, "actmem_tests --rank: unknown argument ", a);
    }
  }
  return o;
}

bool register_rank_scenario(const std::string& name, RankScenario body) {
  TORCH_CHECK(scenarios().emplace(name, std::move(body)).second, "actmem_tests: rank scenario ",
              name, " registered twice");
  return true;
}

bool is_rank(int argc, char** argv) {
  return argc > 1 && std::string(argv[1]) == "--rank";
}

int run_rank(int argc, char** argv) {
  try {
    const RankOptions o = RankOptions::parse(argc, argv);
    const auto it = scenarios().find(o.scenario);
    TORCH_CHECK(it != scenarios().end(), "actmem_tests --rank: unknown scenario ", o.scenario);
    at::set_num_threads(1);  // N ranks share this machine's cores
    const DistEnv env = dist_env_from_environment();
    const auto& group = init_tensor_parallel_from_environment(env, c10::kCPU, o.tp, o.ep, o.pp);
    json result = {{"rank", group.rank}, {"world_size", group.size}};
    result[o.scenario] = it->second(o, group);
    std::ofstream f(o.out_dir + "/rank" + std::to_string(env.rank) + ".json");
    f << result.dump(1) << "\n";
    TORCH_CHECK(f.good(), "actmem_tests --rank: cannot write to ", o.out_dir);
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "actmem_tests --rank: " << e.what() << std::endl;
    return 1;
  }
}

std::string test_binary() {
  return std::filesystem::read_symlink("/proc/self/exe").string();
}

std::vector<json> run_workers(int nproc, std::vector<std::string> args) {
  static int counter = 0;
  const std::string dir =
      ::testing::TempDir() + "tp_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
  EXPECT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  std::vector<std::string> argv = {"--rank", args.at(0), dir};
  argv.insert(argv.end(), args.begin() + 1, args.end());
  const int rc = launch_program(nproc, test_binary(), argv, free_loopback_port());
  EXPECT_EQ(rc, 0) << "worker launch failed";
  std::vector<json> out;
  for (int r = 0; r < nproc; ++r) {
    std::ifstream f(dir + "/rank" + std::to_string(r) + ".json");
    if (!f.good()) {
      ADD_FAILURE() << "rank " << r << " wrote no result";
      return {};
    }
    out.push_back(json::parse(f));
  }
  return out;
}

}  // namespace actmem::testing
