// distributed.h — process groups from torchrun-style environment variables (c10d), and the
// multi-process launcher behind `actmem launch`.
//
// Workers find each other through a c10d TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 serves it)
// and talk through ProcessGroupGloo on CPU. Tensor and sequence parallelism build on this.
#pragma once

#include "actmem/base/compat.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>
#include <vector>

// The object collectives are called on: a c10d::Backend (ProcessGroupGloo, ProcessGroupNCCL).
namespace c10d {
class ProcessGroup;
class Backend;
class Store;
}  // namespace c10d

namespace actmem {

using CollectiveGroup = c10d::Backend;

/// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT as torchrun sets them.
struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool from_environment = false;  // false: no RANK/WORLD_SIZE set, a single process
  /// TORCHELASTIC_USE_AGENT_STORE=True (torchrun's variable): the launcher hosts the TCPStore at
  /// MASTER_ADDR:MASTER_PORT and every rank, rank 0 included, connects to it as a client.
  /// `actmem launch --nnodes N` (N > 1) sets it (Note [Launchers across nodes]).
  bool agent_store = false;
};

/// Megatron's default for --distributed-timeout-minutes: how long a collective (and the
/// rendezvous) waits for a peer before it fails.
constexpr std::chrono::milliseconds kDefaultDistributedTimeout = std::chrono::minutes(10);

/// --distributed-timeout-minutes as a duration: `minutes` must be positive and finite (Megatron
/// takes whole minutes; fractions are accepted so a test can wait seconds), at most a year.
std::chrono::milliseconds distributed_timeout_from_minutes(double minutes);

/// Reads the variables; throws a clear error for malformed or inconsistent values.
DistEnv dist_env_from_environment();

/// A process group over a TCPStore (rank 0 hosts it, or the launcher: DistEnv::agent_store): Gloo
/// for CPU tensors, NCCL for a CUDA `device` (builds with ACTMEM_WITH_NCCL; that device becomes the
/// current one). Throws on timeout, and for a CUDA device in a build without NCCL.
c10::intrusive_ptr<CollectiveGroup> init_process_group(
    const DistEnv& env, std::chrono::milliseconds timeout = kDefaultDistributedTimeout,
    const c10::Device& device = c10::kCPU);

/// The world's group and the store its ranks met on; subgroups rendezvous on the same store.
struct WorldGroup {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<CollectiveGroup> pg;
  int rank = 0, size = 1;
  c10::Device device = c10::kCPU;
  std::chrono::milliseconds timeout = kDefaultDistributedTimeout;
};
/// init_process_group, keeping the store for subgroups.
WorldGroup init_world_group(const DistEnv& env,
                            std::chrono::milliseconds timeout = kDefaultDistributedTimeout,
                            const c10::Device& device = c10::kCPU);
/// A process group over the global `ranks` (which must contain world.rank), met on the world's
/// store under `name` (unique per group: Megatron's "tp", "dp", ... with the group's index).
/// Every member must create it, in the same order relative to its other groups.
c10::intrusive_ptr<CollectiveGroup> new_subgroup(const WorldGroup& world,
                                                 const std::vector<int>& ranks,
                                                 const std::string& name);

/// Where this launcher's workers sit in a launch over several nodes (torchrun's --nnodes,
/// --node-rank, --master-addr): node R's local worker L is global rank R * nproc + L of a world
/// of nnodes * nproc, and all of them meet at master_addr, where node 0's launcher hosts the
/// store the launchers watch each other on and the workers meet (Note [Launchers across nodes]).
struct LaunchNodes {
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
};

/// The port a launch rendezvouses on: `master_port` when given (> 0); otherwise a free loopback
/// port for one node, torchrun's 29500 for several (every node must name the same one).
int launch_port(int master_port, const LaunchNodes& nodes);

/// Starts `nproc` copies of this program (argv = `args`) with torchrun's variables: RANK,
/// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, and
/// OMP_NUM_THREADS = this machine's cores / nproc (at least 1) unless it is set already;
/// forwards SIGINT and SIGTERM to them; when one exits non-zero (or dies), stops the others
/// (SIGTERM, then SIGKILL after `grace`) and returns that worker's exit code, after printing
/// "actmem launch: worker R failed ..." (R its global rank) on stderr; returns 0 when all
/// succeed. Workers die with the launcher (PR_SET_PDEATHSIG): no orphans. Over several nodes
/// the launchers tell each other: a failure on one node stops the workers of every node, each
/// launcher naming the first worker that failed (Note [Launchers across nodes]).
int launch_workers(int nproc, const std::vector<std::string>& args, int master_port,
                   std::chrono::milliseconds grace = std::chrono::seconds(5),
                   const LaunchNodes& nodes = {});

/// launch_workers for another program: starts `nproc` copies of `program` (a path) with
/// arguments `args` (argv[1...]) and the same environment, signal and failure handling.
int launch_program(int nproc, const std::string& program, const std::vector<std::string>& args,
                   int master_port, std::chrono::milliseconds grace = std::chrono::seconds(5),
                   const LaunchNodes& nodes = {});

/// A free TCP port on the loopback interface (for MASTER_PORT when none is given).
int free_loopback_port();

}  // namespace actmem
