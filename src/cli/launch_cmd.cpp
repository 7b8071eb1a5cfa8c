// launch_cmd.cpp — `actmem launch` (start N workers of a subcommand) and `actmem dist-check`
// (each worker joins the process group and all-reduces its rank: a quick health check).
#include "actmem/distributed.h"
#include "actmem/train_options.h"
#include "commands.h"

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#if ACTMEM_TORCH_VERSION_AT_LEAST(2, 0)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include <chrono>
#include <iostream>
#include <memory>
#include <thread>

namespace actmem::cli {

namespace {
struct LaunchOptions {
  int nproc = 2;
  int master_port = 0;
  std::vector<std::string> command;
};

struct CheckOptions {
  int fail_rank = -1;
  int hang_rank = -1;
};

int run_check(const CheckOptions& o) {
  const DistEnv env = dist_env_from_environment();
  TORCH_CHECK(env.rank != o.fail_rank, "actmem dist-check: rank ", env.rank,
              " fails on purpose (--fail-rank)");
  if (env.rank == o.hang_rank) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // until the launcher stops us
  }
  auto pg = init_process_group(env);
  std::vector<at::Tensor> t = {at::full({4}, static_cast<double>(env.rank + 1), at::kDouble)};
  pg->allreduce(t)->wait();
  const double expected = env.world_size * (env.world_size + 1) / 2.0;
  TORCH_CHECK(at::all(t[0] == expected).item<bool>(), "actmem dist-check: all-reduce gave ",
              t[0][0].item<double>(), ", expected ", expected);
  if (env.rank == 0) {
    std::cout << "dist-check: all-reduce ok on " << env.world_size << " ranks (Gloo over "
              << env.master_addr << ":" << env.master_port << ")" << std::endl;
  }
  return 0;
}
}  // namespace

Runner add_launch_command(CLI::App& app) {
  auto o = std::make_shared<LaunchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "launch", "Start N worker processes of a subcommand: actmem launch --nproc-per-node N -- CMD");
  cmd->add_option("--nproc-per-node", o->nproc, "Worker processes")->capture_default_str();
  cmd->add_option("--master-port", o->master_port, "TCP port of the rendezvous (default: a free one)")
      ->check(integer_in_range(1, 65535));
  cmd->add_option("command", o->command, "The subcommand and its flags, after --")->required();
  return [o, cmd]() { return cmd->parsed() ? launch_workers(o->nproc, o->command, o->master_port) : -1; };
}

Runner add_dist_check_command(CLI::App& app) {
  auto o = std::make_shared<CheckOptions>();
  CLI::App* cmd = app.add_subcommand("dist-check", "Join the process group and all-reduce (use under launch)");
  cmd->add_option("--fail-rank", o->fail_rank, "Testing: this rank exits with an error");
  cmd->add_option("--hang-rank", o->hang_rank, "Testing: this rank never joins");
  return [o, cmd]() { return cmd->parsed() ? run_check(*o) : -1; };
}

}  // namespace actmem::cli
