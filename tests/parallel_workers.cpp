// parallel_workers.cpp — run_workers (parallel_workers.h).
#include "parallel_workers.h"

#include "actmem/parallel/distributed.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include <unistd.h>

namespace actmem::testing {

using nlohmann::json;

// Runs `nproc` worker ranks; returns each rank's JSON (rank order). Fails the test on error.
std::vector<json> run_workers(int nproc, std::vector<std::string> args) {
  static int counter = 0;
  const std::string dir =
      ::testing::TempDir() + "tp_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
  EXPECT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  std::vector<std::string> argv = {args.at(0), dir};
  argv.insert(argv.end(), args.begin() + 1, args.end());
  const int rc = launch_program(nproc, ACTMEM_TP_WORKER, argv, free_loopback_port());
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
