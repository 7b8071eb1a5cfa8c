// launch_cmd.cpp — `actmem launch` (start N workers of a subcommand) and `actmem dist-check`
// (each worker joins the process group and all-reduces its rank: a quick health check).
#include "actmem/flags/train_options.h"
#include "actmem/parallel/distributed.h"
#include "actmem/parallel/parallel_layout.h"
#include "commands.h"

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <iostream>
#include <memory>
#include <thread>

namespace actmem::cli {

namespace {
struct LaunchOptions {
  int nproc = 2;
  int master_port = 0;
  LaunchNodes nodes;
  std::vector<std::string> command;
};

struct CheckOptions {
  int fail_rank = -1;
  int hang_rank = -1;
  int tp = 1, pp = 1, ep = 1, etp = 0;  // the layout whose groups are checked
  double timeout_minutes = 10.0;
};

// Every group of the layout (Megatron's rank order, parallel_layout.h) that this rank belongs
// to is built on c10d and all-reduces the members' rank + 1: each member must get the sum over
// its group, so a wrong membership or a crossed rendezvous shows.
void check_groups(const WorldGroup& world, const ParallelLayout& l) {
  const std::vector<std::pair<const char*, const std::vector<std::vector<int>>*>> kinds = {
      {"tp", &l.tp_groups},
      {"dp", &l.dp_groups},
      {"pp", &l.pp_groups},
      {"tp-pp", &l.mp_groups},
      {"embedding", &l.embedding_groups},
      {"ep", &l.ep_groups},
      {"expert-tp", &l.etp_groups},
      {"expert-dp", &l.edp_groups}};
  for (const auto& [name, groups] : kinds) {
    const std::vector<int>& g = ParallelLayout::group_of(*groups, world.rank);
    auto pg = new_subgroup(
        world, g,
        std::string(name) + "/" + std::to_string(ParallelLayout::group_index(*groups, world.rank)));
    std::vector<at::Tensor> t = {at::full({4}, static_cast<double>(world.rank + 1), at::kDouble)};
    pg->allreduce(t)->wait();
    double expected = 0;
    for (int r : g) expected += r + 1;
    TORCH_CHECK(at::all(t[0] == expected).item<bool>(), "actmem dist-check: the ", name,
                " group of rank ", world.rank, " all-reduced to ", t[0][0].item<double>(),
                ", expected ", expected);
  }
}

int run_check(const CheckOptions& o) {
  const DistEnv env = dist_env_from_environment();
  TORCH_CHECK(env.rank != o.fail_rank, "actmem dist-check: rank ", env.rank,
              " fails on purpose (--fail-rank)");
  if (env.rank == o.hang_rank) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // until the launcher stops us
  }
  // The layout first: a size that does not divide the world is an error on every rank, before
  // anyone waits for a rendezvous.
  const ParallelLayout layout = ParallelLayout::make(env.world_size, o.tp, o.pp, o.ep, o.etp);
  const WorldGroup world =
      init_world_group(env, distributed_timeout_from_minutes(o.timeout_minutes));
  std::vector<at::Tensor> t = {at::full({4}, static_cast<double>(env.rank + 1), at::kDouble)};
  world.pg->allreduce(t)->wait();
  const double expected = env.world_size * (env.world_size + 1) / 2.0;
  TORCH_CHECK(at::all(t[0] == expected).item<bool>(), "actmem dist-check: all-reduce gave ",
              t[0][0].item<double>(), ", expected ", expected);
  if (env.world_size > 1) check_groups(world, layout);
  if (env.rank == 0) {
    std::cout << "dist-check: all-reduce ok on " << env.world_size << " ranks (Gloo over "
              << env.master_addr << ":" << env.master_port << ")\n"
              << "Megatron's groups for this layout, each all-reduced ok:\n"
              << layout.describe() << std::flush;
  }
  return 0;
}
}  // namespace

std::vector<std::string>& launch_worker_command() {
  static std::vector<std::string> words;
  return words;
}

Runner add_launch_command(CLI::App& app) {
  auto o = std::make_shared<LaunchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "launch",
      "Start N worker processes of a subcommand: actmem launch --nproc-per-node N "
      "[--nnodes M --node-rank R --master-addr A --master-port P] -- CMD (torchrun's "
      "underscore spellings and its form `... pretrain_gpt.py FLAGS` are accepted)");
  cmd->add_option("--nproc-per-node,--nproc_per_node", o->nproc, "Worker processes")
      ->capture_default_str();
  cmd->add_option("--nnodes", o->nodes.nnodes,
                  "Nodes (machines) of the launch, each running this "
                  "command with its --node-rank")
      ->capture_default_str()
      ->check(integer_in_range(1, 1 << 16));
  cmd->add_option("--node-rank,--node_rank", o->nodes.node_rank,
                  "This node's index, 0..nnodes-1 (node 0 hosts "
                  "the rendezvous)")
      ->capture_default_str()
      ->check(integer_in_range(0, (1 << 16) - 1));
  cmd->add_option("--master-addr,--master_addr", o->nodes.master_addr,
                  "Address of node 0, where every worker "
                  "meets")
      ->capture_default_str();
  cmd->add_option("--master-port,--master_port", o->master_port,
                  "TCP port of the rendezvous (default: a free "
                  "one on one node, 29500 across nodes)")
      ->check(integer_in_range(1, 65535));
  cmd->add_option("command", o->command, "The subcommand and its flags, after --");
  return [o, cmd]() {
    if (!cmd->parsed()) return -1;
    std::vector<std::string> command = o->command;
    command.insert(command.end(), launch_worker_command().begin(), launch_worker_command().end());
    TORCH_CHECK(!command.empty(),
                "actmem launch: give the command the workers run after --, "
                "e.g. actmem launch --nproc-per-node 2 -- train");
    return launch_workers(o->nproc, command, o->master_port, std::chrono::seconds(5), o->nodes);
  };
}

Runner add_dist_check_command(CLI::App& app) {
  auto o = std::make_shared<CheckOptions>();
  CLI::App* cmd =
      app.add_subcommand("dist-check", "Join the process group and all-reduce (use under launch)");
  cmd->add_option("--fail-rank", o->fail_rank, "Testing: this rank exits with an error");
  cmd->add_option("--hang-rank", o->hang_rank, "Testing: this rank never joins");
  cmd->add_option("--tensor-model-parallel-size", o->tp, "Check Megatron's groups for this t")
      ->check(integer_in_range(1, 1 << 20));
  cmd->add_option("--pipeline-model-parallel-size", o->pp, "... this p")
      ->check(integer_in_range(1, 1 << 20));
  cmd->add_option("--expert-model-parallel-size", o->ep, "... this e")
      ->check(integer_in_range(1, 1 << 20));
  cmd->add_option("--expert-tensor-parallel-size", o->etp, "... this expert t (default t)")
      ->check(integer_in_range(1, 1 << 20));
  add_distributed_timeout_flag(*cmd, o->timeout_minutes);
  return [o, cmd]() { return cmd->parsed() ? run_check(*o) : -1; };
}

}  // namespace actmem::cli
