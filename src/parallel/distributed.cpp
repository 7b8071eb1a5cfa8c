// distributed.cpp — environment parsing, process-group creation and the worker launcher.
#include "actmem/parallel/distributed.h"

#include "actmem/base/environment.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef ACTMEM_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

namespace actmem {

namespace {
int env_int(const char* name, int fallback, bool* found = nullptr) {
  const char* v = std::getenv(name);
  if (found) *found = v != nullptr;
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0' && x >= 0 && x <= 1 << 20, "actmem: environment variable ",
              name, "='", v, "' is not a non-negative integer");
  return static_cast<int>(x);
}
}  // namespace

DistEnv dist_env_from_environment() {
  DistEnv e;
  bool has_rank = false, has_world = false;
  e.rank = env_int("RANK", 0, &has_rank);
  e.world_size = env_int("WORLD_SIZE", 1, &has_world);
  TORCH_CHECK(has_rank == has_world, "actmem: RANK and WORLD_SIZE must be set together");
  e.from_environment = has_rank;
  e.local_rank = env_int("LOCAL_RANK", e.rank);
  e.master_port = env_int("MASTER_PORT", 29500);
  if (const char* a = std::getenv("MASTER_ADDR")) e.master_addr = a;
  if (const char* a = std::getenv("TORCHELASTIC_USE_AGENT_STORE")) {
    const std::string v = a;
    TORCH_CHECK(v == "True" || v == "False" || v == "1" || v == "0" || v.empty(),
                "actmem: environment variable TORCHELASTIC_USE_AGENT_STORE='", v,
                "' is not True or False");
    e.agent_store = v == "True" || v == "1";
  }
  TORCH_CHECK(e.world_size >= 1, "actmem: WORLD_SIZE must be at least 1, got ", e.world_size);
  TORCH_CHECK(e.rank < e.world_size, "actmem: RANK (", e.rank, ") must be below WORLD_SIZE (",
              e.world_size, ")");
  TORCH_CHECK(e.master_port > 0 && e.master_port < 65536,
              "actmem: MASTER_PORT must be a TCP port, "
              "got ",
              e.master_port);
  return e;
}

std::chrono::milliseconds distributed_timeout_from_minutes(double minutes) {
  TORCH_CHECK(std::isfinite(minutes) && minutes > 0 && minutes <= 366.0 * 24 * 60,
              "actmem: --distributed-timeout-minutes must be a positive number of minutes, at "
              "most a year, got ",
              minutes);
  return std::chrono::milliseconds(std::max<int64_t>(1, std::llround(minutes * 60000.0)));
}

namespace {
// Gloo for CPU tensors, NCCL for a CUDA device, over `store` as `rank` of `size`.
c10::intrusive_ptr<CollectiveGroup> make_group(const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int size,
                                               std::chrono::milliseconds timeout,
                                               const c10::Device& device) {
#ifdef ACTMEM_WITH_NCCL
  if (device.is_cuda()) {
    auto nccl_opts = c10d::ProcessGroupNCCL::Options::create();
    nccl_opts->timeout = timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, nccl_opts);
  }
#else
  (void)device;
#endif
  auto pg_opts = c10d::ProcessGroupGloo::Options::create(timeout);
  pg_opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, pg_opts);
}
}  // namespace

c10::intrusive_ptr<CollectiveGroup> init_process_group(const DistEnv& env,
                                                       std::chrono::milliseconds timeout,
                                                       const c10::Device& device) {
  return init_world_group(env, timeout, device).pg;
}

c10::intrusive_ptr<CollectiveGroup> new_subgroup(const WorldGroup& world,
                                                 const std::vector<int>& ranks,
                                                 const std::string& name) {
  const auto it = std::find(ranks.begin(), ranks.end(), world.rank);
  TORCH_CHECK(it != ranks.end(), "actmem::new_subgroup: rank ", world.rank, " is not in group ",
              name);
  TORCH_CHECK(world.store, "actmem::new_subgroup: the world group has no store (single process)");
  auto store = c10::make_intrusive<c10d::PrefixStore>("group/" + name, world.store);
  return make_group(store, static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()),
                    world.timeout, world.device);
}

WorldGroup init_world_group(const DistEnv& env, std::chrono::milliseconds timeout,
                            const c10::Device& device) {
  TORCH_CHECK(device.is_cpu() || device.is_cuda(),
              "actmem: process groups for cpu or cuda "
              "devices, got ",
              device.str());
#ifndef ACTMEM_WITH_NCCL
  TORCH_CHECK(device.is_cpu(), "actmem: collectives on ", device.str(),
              " need NCCL, and this "
              "build has none (a CUDA libtorch whose nccl.h CMake finds; docs/parallelism.md)");
#endif
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env.master_port);
  opts.isServer = env.rank == 0 && !env.agent_store;
  opts.numWorkers = static_cast<std::size_t>(env.world_size);
  opts.waitWorkers = true;
  opts.timeout = timeout;
  WorldGroup w;
  w.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
#ifdef ACTMEM_WITH_NCCL
  if (device.is_cuda() && device.has_index()) c10::cuda::set_device(device.index());
#endif
  w.rank = env.rank, w.size = env.world_size, w.device = device, w.timeout = timeout;
  w.pg = make_group(w.store, env.rank, env.world_size, timeout, device);
  return w;
}

namespace {
// Binds a loopback TCP socket to `port` (0: any) and returns the port bound, or -1.
int try_bind_loopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "actmem: cannot open a socket: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof(addr);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  close(fd);
  return ok ? ntohs(addr.sin_port) : -1;
}
}  // namespace

int free_loopback_port() {
  // Note [Rendezvous port]: the port is free now, but rank 0 binds it only after its process has
  // started. A port below the kernel's ephemeral range cannot be handed meanwhile to a socket the
  // kernel numbers itself (Gloo's connections, any client), so it is drawn from there first.
  int ephemeral_low = 32768;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d", &ephemeral_low) != 1) ephemeral_low = 32768;
    std::fclose(f);
  }
  const int high = std::min(ephemeral_low, 65536), low = std::max(10000, high - 12000);
  if (high - low >= 1000) {
    std::random_device rd;
    std::uniform_int_distribution<int> pick(low, high - 1);
    for (int attempt = 0; attempt < 64; ++attempt) {
      const int port = try_bind_loopback(pick(rd));
      if (port > 0) return port;
    }
  }
  const int port = try_bind_loopback(0);
  TORCH_CHECK(port > 0, "actmem: cannot find a free loopback port");
  return port;
}

namespace {
volatile sig_atomic_t g_forward_signal = 0;
void on_signal(int sig) {
  g_forward_signal = sig;
}
}  // namespace

int launch_workers(int nproc, const std::vector<std::string>& args, int master_port,
                   std::chrono::milliseconds grace, const LaunchNodes& nodes) {
  return launch_program(nproc, "/proc/self/exe", args, master_port, grace, nodes);
}

int launch_port(int master_port, const LaunchNodes& nodes) {
  TORCH_CHECK(master_port >= 0 && master_port < 65536,
              "actmem launch: --master-port must be a "
              "TCP port in 1..65535 (or 0 for a free one), got ",
              master_port);
  if (master_port > 0) return master_port;
  return nodes.nnodes > 1 ? 29500 : free_loopback_port();
}

namespace {
// Note [Worker stderr]
// Each worker's stderr is a pipe the launcher reads: complete lines are passed through to the
// launcher's stderr (lines of different workers never interleave mid-line), and each worker's
// first "error: ..." line is remembered with its arrival order. When workers fail, the one whose
// error arrived first is reported, with its message: when rank 0 fails, rank 1 often fails a
// moment later because its peer went away, and reporting rank 1 would point at the wrong cause.
struct WorkerOutput {
  int fd = -1;
  std::string partial;
  std::string first_error;
  int64_t error_order = -1;
};

void forward_lines(WorkerOutput& w, int64_t& order, bool at_eof) {
  size_t start = 0;
  for (size_t nl; (nl = w.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    const std::string line = w.partial.substr(start, nl - start);
    std::fprintf(stderr, "%s\n", line.c_str());
    if (w.error_order < 0 && line.rfind("error:", 0) == 0) {
      w.first_error = line;
      w.error_order = order++;
    }
  }
  w.partial.erase(0, start);
  if (at_eof && !w.partial.empty()) {
    w.partial += '\n';
    forward_lines(w, order, false);
  }
  std::fflush(stderr);
}

// Reads what the workers wrote so far (waiting up to timeout_ms for the first byte).
void pump_worker_output(std::vector<WorkerOutput>& out, int64_t& order, int timeout_ms) {
  std::vector<pollfd> fds;
  std::vector<size_t> index;
  for (size_t r = 0; r < out.size(); ++r) {
    if (out[r].fd >= 0) {
      fds.push_back({out[r].fd, POLLIN, 0});
      index.push_back(r);
    }
  }
  if (fds.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    return;
  }
  if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    WorkerOutput& w = out[index[i]];
    char buf[4096];
    for (;;) {
      const ssize_t n = ::read(w.fd, buf, sizeof(buf));
      if (n > 0) {
        w.partial.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      // Non-blocking: EAGAIN means everything written so far has been read.
      const bool eof = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
      if (eof) {
        ::close(w.fd);
        w.fd = -1;
      }
      forward_lines(w, order, eof);
      break;
    }
  }
}
// Note [Launchers across nodes]
// With --nnodes N > 1 every node runs its own launcher, and a worker's death is seen at once only
// by its own. The others' workers notice through their collectives: a killed peer closes its
// sockets (Gloo fails at once), but a hung one (stopped, deadlocked, its machine cut off) holds
// them until --distributed-timeout-minutes, and a launcher whose own workers hang would then
// wait for ever. So the launchers watch each other, as torchrun's agents do, on a TCPStore that
// node 0's launcher hosts at MASTER_ADDR:MASTER_PORT, the one port a multi-node job opens; the
// workers meet on the same store (TORCHELASTIC_USE_AGENT_STORE=True, torchrun's variable: every
// rank connects as a client), their keys apart from the launchers' "actmem-launch/" ones.
// - A launcher whose worker fails records it (compareSet: the first record wins) and names the
//   first failure of the whole job: its own, or "worker R (node K) failed first (...)" and its
//   own after it.
// - Every launcher polls the record every kPollInterval; on another node's failure it stops its
//   workers (SIGTERM, then SIGKILL after the grace) and exits 1, naming that failure.
// - A launcher that loses the store (node 0's launcher died, or its machine) stops its workers.
// - Each launcher marks itself done when its workers have ended; node 0 keeps the store up until
//   every node is done: at most the grace and kDoneSlack after a failure, and while their
//   heartbeats advance after a success (a node can still be writing its checkpoint shards).
class NodeLink {
 public:
  static constexpr auto kPollInterval = std::chrono::milliseconds(100);
  static constexpr auto kHeartbeatSilence = std::chrono::seconds(30);
  static constexpr auto kDoneSlack = std::chrono::seconds(10);

  NodeLink(const LaunchNodes& nodes, int port) : nodes_(nodes) {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(port);
    opts.isServer = nodes.node_rank == 0;
    opts.waitWorkers = false;
    opts.timeout = kDefaultDistributedTimeout;  // how long node K > 0 waits for node 0 to listen
    try {
      store_ = c10::make_intrusive<c10d::TCPStore>(nodes.master_addr, opts);
      store_->setTimeout(std::chrono::seconds(30));
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "actmem launch: node ", nodes.node_rank,
                  nodes.node_rank == 0 ? " cannot host the rendezvous at port "
                                       : " cannot reach node 0's launcher at ",
                  nodes.node_rank == 0 ? "" : nodes.master_addr + ":", port, ": ", first_line(e));
    }
  }

  // Records `failure` ("worker R on node K failed (...)...") unless a failure was recorded first;
  // returns the first one ("" when the store is gone).
  std::string record_failure(const std::string& failure) {
    try {
      const std::vector<uint8_t> want(failure.begin(), failure.end());
      const std::vector<uint8_t> first = store_->compareSet(kFailed, {}, want);
      return std::string(first.begin(), first.end());
    } catch (const std::exception&) {
      return "";
    }
  }

  // Called often: heartbeat, then what stops this node — another node's recorded failure, or the
  // store gone. Empty when nothing did.
  std::string poll() {
    const auto now = std::chrono::steady_clock::now();
    if (now < next_poll_) return "";
    next_poll_ = now + kPollInterval;
    try {
      store_->add(heartbeat_key(nodes_.node_rank), 1);
      if (!store_->check({kFailed})) return "";
      const std::vector<uint8_t> v = store_->get(kFailed);
      return std::string(v.begin(), v.end());
    } catch (const std::exception& e) {
      return "lost node 0's launcher (" + first_line(e) + ")";
    }
  }

  // This node's workers have all ended. Node 0 waits for the others (see the Note); returns the
  // failure another node recorded meanwhile, or "".
  std::string finish(bool failed) {
    try {
      store_->set(done_key(nodes_.node_rank), std::vector<uint8_t>{1});
    } catch (const std::exception&) {
      return "";
    }
    if (nodes_.node_rank != 0) return "";
    try {
      return wait_for_the_other_nodes(failed);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "actmem launch: %s\n", first_line(e).c_str());
      return "";
    }
  }

 private:
  std::string wait_for_the_other_nodes(bool failed) {
    const auto deadline = std::chrono::steady_clock::now() + kDoneSlack;
    std::vector<int64_t> beats(static_cast<size_t>(nodes_.nnodes), -1);
    std::vector<std::chrono::steady_clock::time_point> heard(static_cast<size_t>(nodes_.nnodes),
                                                             std::chrono::steady_clock::now());
    for (;;) {
      bool all_done = true;
      const auto now = std::chrono::steady_clock::now();
      for (int k = 1; k < nodes_.nnodes; ++k) {
        if (store_->check({done_key(k)})) continue;
        all_done = false;
        const int64_t beat = store_->add(heartbeat_key(k), 0);
        if (beat != beats[static_cast<size_t>(k)]) {
          beats[static_cast<size_t>(k)] = beat;
          heard[static_cast<size_t>(k)] = now;
        }
        const bool silent = now - heard[static_cast<size_t>(k)] > kHeartbeatSilence;
        if (silent || (failed && now > deadline)) {
          std::fprintf(stderr, "actmem launch: node %d's launcher %s; not waiting for it\n", k,
                       silent ? "stopped answering" : "did not end in time");
          return "";
        }
      }
      if (all_done) break;
      if (!failed && store_->check({kFailed})) {
        failed = true;  // another node failed after this one's workers succeeded
      }
      std::this_thread::sleep_for(kPollInterval);
    }
    if (!store_->check({kFailed})) return "";
    const std::vector<uint8_t> v = store_->get(kFailed);
    return std::string(v.begin(), v.end());
  }

  static constexpr const char* kFailed = "actmem-launch/failed";
  static std::string heartbeat_key(int node) {
    return "actmem-launch/heartbeat/" + std::to_string(node);
  }
  static std::string done_key(int node) { return "actmem-launch/done/" + std::to_string(node); }
  static std::string first_line(const std::exception& e) {
    const std::string what = e.what();
    return what.substr(0, what.find('\n'));
  }

  LaunchNodes nodes_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
  std::chrono::steady_clock::time_point next_poll_{};
};
}  // namespace

namespace {
// The state letter of /proc/PID/stat ('R' running, 'S' sleeping, 'T' stopped, 't' traced, 'D'
// in uninterruptible I/O, ...), or '?' when it cannot be read.
char process_state(pid_t pid) {
  std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return '?';
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');  // the command name may hold spaces and ')'
  return close != nullptr && close[1] == ' ' && close[2] != '\0' ? close[2] : '?';
}

// Refuses launch_program's arguments that cannot make a launch, before anything starts.
void check_launch_arguments(int nproc, const std::vector<std::string>& args,
                            const LaunchNodes& nodes) {
  TORCH_CHECK(nproc >= 1, "actmem launch: --nproc-per-node must be at least 1, got ", nproc);
  TORCH_CHECK(!args.empty(),
              "actmem launch: give the command after '--', e.g. "
              "actmem launch --nproc-per-node 2 -- train");
  TORCH_CHECK(nodes.nnodes >= 1, "actmem launch: --nnodes must be at least 1, got ", nodes.nnodes);
  TORCH_CHECK(nodes.node_rank >= 0 && nodes.node_rank < nodes.nnodes,
              "actmem launch: --node-rank "
              "must be in 0..",
              nodes.nnodes - 1, " for --nnodes ", nodes.nnodes, ", got ", nodes.node_rank);
  TORCH_CHECK(!nodes.master_addr.empty(), "actmem launch: --master-addr is empty");
}

// What launch_program starts this node's workers with, and names them by.
struct LaunchSpec {
  int nproc;
  const std::string& program;
  const std::vector<std::string>& args;
  const LaunchNodes& nodes;
  int port;
  std::string omp_threads;
  int first_rank;
  int world;
  pid_t launcher;
  NodeLink* link;  // Note [Launchers across nodes]; null on a single node
};

// The workers as the launcher watches them: pids, output, how each ended, the stopping state.
struct LaunchedWorkers {
  std::vector<pid_t> pids;
  std::vector<WorkerOutput> output;
  std::vector<bool> alive;
  std::vector<int> codes;
  int remaining = 0;
  int64_t order = 0;
  std::chrono::steady_clock::time_point kill_deadline{};
  bool stopping = false;
  int signals_seen = 0;
  int signal_result = 0;
};

// In worker r's forked child: sets its rank's environment and stderr, then runs the program.
[[noreturn]] void exec_launch_worker(const LaunchSpec& spec, int r, int stderr_fd) {
  prctl(PR_SET_PDEATHSIG, SIGTERM);          // die with the launcher: no orphans
  if (getppid() != spec.launcher) _exit(1);  // the launcher died before prctl took effect
  ::dup2(stderr_fd, STDERR_FILENO);          // Note [Worker stderr]
  setenv("RANK", std::to_string(spec.first_rank + r).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(spec.world).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(spec.nproc).c_str(), 1);
  setenv("GROUP_RANK", std::to_string(spec.nodes.node_rank).c_str(), 1);
  setenv("MASTER_ADDR", spec.nodes.master_addr.c_str(), 1);
  setenv("MASTER_PORT", std::to_string(spec.port).c_str(), 1);
  setenv("OMP_NUM_THREADS", spec.omp_threads.c_str(), /*overwrite=*/0);
  if (spec.link) setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  std::vector<char*> argv;
  std::string self = spec.program == "/proc/self/exe" ? "actmem" : spec.program;
  argv.push_back(self.data());
  std::vector<std::string> copy = spec.args;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  execv(spec.program.c_str(), argv.data());
  std::fprintf(stderr, "error: actmem launch: worker %d could not start: %s\n", r,
               std::strerror(errno));
  _exit(127);
}

// Forks and starts this node's workers, each one's stderr a pipe the launcher reads.
LaunchedWorkers launch_fork_workers(const LaunchSpec& spec) {
  const int nproc = spec.nproc;
  LaunchedWorkers w;
  w.output.resize(static_cast<size_t>(nproc));
  for (int r = 0; r < nproc; ++r) {
    int pipe_fds[2];
    TORCH_CHECK(::pipe2(pipe_fds, O_CLOEXEC) == 0,
                "actmem launch: pipe failed: ", std::strerror(errno));
    std::fflush(nullptr);
    const pid_t pid = fork();
    TORCH_CHECK(pid >= 0, "actmem launch: fork failed: ", std::strerror(errno));
    if (pid == 0) exec_launch_worker(spec, r, pipe_fds[1]);
    ::close(pipe_fds[1]);
    // Read without blocking, so one worker's open pipe never holds up the others' exits.
    ::fcntl(pipe_fds[0], F_SETFL, ::fcntl(pipe_fds[0], F_GETFL) | O_NONBLOCK);
    w.output[static_cast<size_t>(r)].fd = pipe_fds[0];
    w.pids.push_back(pid);
  }
  w.alive.assign(static_cast<size_t>(nproc), true);
  w.codes.assign(static_cast<size_t>(nproc), 0);
  w.remaining = nproc;
  return w;
}

// Before stopping them because another worker failed: a worker that cannot run (stopped by a
// signal or a debugger) is the likely cause of a collective's timeout elsewhere; say so.
void launch_name_stuck_workers(const LaunchSpec& spec, const LaunchedWorkers& w) {
  for (int r = 0; r < spec.nproc; ++r) {
    const char state = w.alive[r] ? process_state(w.pids[r]) : '?';
    if (state == 'T' || state == 't') {
      std::fprintf(stderr,
                   "actmem launch: worker %d%s was stopped (%s) when the failure came: "
                   "its peers' collectives waited for it\n",
                   spec.first_rank + r, spec.link ? " here" : "",
                   state == 'T' ? "SIGSTOP" : "held by a debugger");
    }
  }
}

// Sends `sig` to every worker still alive.
void launch_signal_workers(const LaunchSpec& spec, const LaunchedWorkers& w, int sig) {
  for (int r = 0; r < spec.nproc; ++r) {
    if (!w.alive[r]) continue;
    kill(w.pids[r], sig);
    // A stopped worker (SIGSTOP, a debugger let go) would hold the signal until the grace ends.
    if (sig != SIGKILL) kill(w.pids[r], SIGCONT);
  }
}

// After a failure: names the stuck workers, then stops the others (SIGKILL after the grace).
void launch_stop_after_failure(const LaunchSpec& spec, LaunchedWorkers& w,
                               std::chrono::milliseconds grace) {
  launch_name_stuck_workers(spec, w);
  std::fflush(stderr);
  launch_signal_workers(spec, w, SIGTERM);
  w.stopping = true;
  w.kill_deadline = std::chrono::steady_clock::now() + grace;
}

// Forwards the signal the launcher received to the workers (a second one kills them).
void launch_forward_signal(const LaunchSpec& spec, LaunchedWorkers& w) {
  // Note [Signals reach the workers]: a SIGTERM or SIGINT sent to the launcher is forwarded.
  // Workers that handle it (train --exit-signal-handler) finish their step and save; the
  // launcher waits for them up to kSignalGrace (a step and a save of a large model take time)
  // and exits 0 when they all did. A second signal kills them at once.
  constexpr auto kSignalGrace = std::chrono::minutes(5);
  const int sig = g_forward_signal;
  g_forward_signal = 0;
  launch_signal_workers(spec, w, ++w.signals_seen == 1 ? sig : SIGKILL);
  if (w.signal_result == 0) w.signal_result = 128 + sig;
  if (!w.stopping) w.kill_deadline = std::chrono::steady_clock::now() + kSignalGrace;
  w.stopping = true;
}

// Reads the workers' output so far; returns the worker whose error came first (else `r`).
int launch_first_error_worker(const LaunchSpec& spec, LaunchedWorkers& w, int r) {
  // Everything the workers wrote up to now, so the first error is known (Note [Worker
  // stderr]); the exited worker's pipe is at its end.
  for (int i = 0; i < 50 && w.output[r].fd >= 0; ++i) pump_worker_output(w.output, w.order, 10);
  pump_worker_output(w.output, w.order, 0);
  int first = r;
  for (int i = 0; i < spec.nproc; ++i) {
    const auto& out = w.output[i];
    if (out.error_order >= 0 &&
        (w.output[first].error_order < 0 || out.error_order < w.output[first].error_order)) {
      first = i;
    }
  }
  return first;
}

// Worker r failed: names the job's first failure, stops the rest, returns the exit code.
int launch_on_worker_failure(const LaunchSpec& spec, LaunchedWorkers& w, int r, int status,
                             int code, std::chrono::milliseconds grace) {
  const int first = launch_first_error_worker(spec, w, r);
  const int result = w.alive[first] ? code : w.codes[first];
  std::string why;
  if (w.alive[first]) {
    why = "reported an error";
  } else if (first == r && !WIFEXITED(status)) {
    why = "signal " + std::to_string(WTERMSIG(status));
  } else {
    why = "exit code " + std::to_string(w.codes[first]);
  }
  const std::string& line = w.output[first].first_error;  // "error: ..." or empty
  const size_t text = line.empty() ? std::string::npos : line.find_first_not_of(' ', 6);
  const std::string message = text == std::string::npos ? "" : line.substr(text);
  const std::string worker =
      "worker " + std::to_string(spec.first_rank + first) +
      (spec.link ? " on node " + std::to_string(spec.nodes.node_rank) : std::string());
  const std::string failure =
      worker + " failed (" + why + ")" + (message.empty() ? "" : ": " + message);
  const std::string first_failure = spec.link ? spec.link->record_failure(failure) : failure;
  if (first_failure.empty() || first_failure == failure) {
    std::fprintf(stderr, "actmem launch: %s; stopping the other %d%s\n", failure.c_str(),
                 w.remaining, spec.link ? " here and the other nodes' workers" : "");
  } else {
    // Another node's worker failed first: that is the cause to name.
    std::fprintf(stderr,
                 "actmem launch: %s first; then %s here (%s)%s%s; stopping the "
                 "other %d here\n",
                 first_failure.c_str(), worker.c_str(), why.c_str(), message.empty() ? "" : ": ",
                 message.c_str(), w.remaining);
  }
  launch_stop_after_failure(spec, w, grace);
  return result;
}

// Waits for the workers, stopping all after a failure; returns the failure's exit code, or 0.
int launch_supervise_workers(const LaunchSpec& spec, LaunchedWorkers& w,
                             std::chrono::milliseconds grace) {
  int result = 0;
  while (w.remaining > 0) {
    if (g_forward_signal != 0) launch_forward_signal(spec, w);
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      const int r = static_cast<int>(std::find(w.pids.begin(), w.pids.end(), pid) - w.pids.begin());
      if (r >= spec.nproc) continue;
      w.alive[r] = false;
      --w.remaining;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      w.codes[r] = code;
      if (code != 0 && !w.stopping) {
        result = launch_on_worker_failure(spec, w, r, status, code, grace);
      }
      continue;
    }
    if (w.stopping && std::chrono::steady_clock::now() > w.kill_deadline) {
      launch_signal_workers(spec, w, SIGKILL);
    }
    if (spec.link && !w.stopping) {
      const std::string remote = spec.link->poll();
      if (!remote.empty()) {
        std::fprintf(stderr, "actmem launch: %s; stopping the %d worker%s here\n", remote.c_str(),
                     w.remaining, w.remaining == 1 ? "" : "s");
        launch_stop_after_failure(spec, w, grace);
        result = 1;
      }
    }
    pump_worker_output(w.output, w.order, 20);
  }
  return result;
}
}  // namespace

int launch_program(int nproc, const std::string& program, const std::vector<std::string>& args,
                   int master_port, std::chrono::milliseconds grace, const LaunchNodes& nodes) {
  check_launch_arguments(nproc, args, nodes);
  const int port = launch_port(master_port, nodes);
  std::optional<NodeLink> link;  // Note [Launchers across nodes]
  if (nodes.nnodes > 1) link.emplace(nodes, port);
  // torchrun's default: one intra-op thread per core this launcher may use, split between its
  // workers, unless the user chose (each of N workers taking every core only slows the step).
  const std::string omp_threads = std::to_string(std::max(1, available_cores() / nproc));
  const int first_rank = nodes.node_rank * nproc, world = nodes.nnodes * nproc;
  const pid_t launcher = getpid();
  const LaunchSpec spec{.nproc = nproc,
                        .program = program,
                        .args = args,
                        .nodes = nodes,
                        .port = port,
                        .omp_threads = omp_threads,
                        .first_rank = first_rank,
                        .world = world,
                        .launcher = launcher,
                        .link = link ? &*link : nullptr};
  LaunchedWorkers workers = launch_fork_workers(spec);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {
  }, old_term{};
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);

  int result = launch_supervise_workers(spec, workers, grace);
  // The rest of what the workers wrote.
  while (std::any_of(workers.output.begin(), workers.output.end(),
                     [](const WorkerOutput& w) { return w.fd >= 0; })) {
    pump_worker_output(workers.output, workers.order, 100);
  }
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  if (link) {
    const std::string later = link->finish(result != 0 || workers.stopping);
    if (!later.empty() && result == 0) {
      std::fprintf(stderr, "actmem launch: %s (after this node's workers had finished)\n",
                   later.c_str());
      result = 1;
    }
  }
  // After a forwarded signal: success when every worker exited 0 (they handled it), else the
  // signal's status, as a shell reports a process it ended.
  const std::vector<int>& codes = workers.codes;
  if (result == 0 && workers.signal_result != 0 &&
      std::any_of(codes.begin(), codes.end(), [](int c) { return c != 0; })) {
    result = workers.signal_result;
  }
  return result;
}

}  // namespace actmem
