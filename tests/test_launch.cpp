// test_launch.cpp — `actmem launch`: a two-process Gloo all-reduce on loopback, two launchers as
// two nodes, the workers' thread count, a failing worker fails the launch with its message, and
// no worker outlives the launcher (SIGTERM or SIGKILL).
#include <csignal>
#include "actmem/base/environment.h"
#include "actmem/parallel/distributed.h"
#include "actmem/parallel/pipeline.h"
#include "actmem/parallel/tensor_parallel.h"
#include "parallel_workers.h"
#include "test_util.h"

#include <dirent.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>
#include <thread>

namespace actmem {
namespace {

using actmem::testing::expect_error_containing;
using actmem::testing::run_actmem;

// The ranks these tests start (Note [Ranks are the test binary] in parallel_workers.cpp).
// A stage dying in the middle of the 1F1B schedule: the others are blocked in a send or receive
// to it, and only the launcher can stop them (Launch.AStageKilledMidScheduleStopsEveryWorker).
nlohmann::json run_pipeline_fault(int die_stage) {
  const actmem::TensorParallelGroup& pp = actmem::pipeline_parallel_group();
  const actmem::PipelineP2P p2p(pp, {4}, at::TensorOptions().dtype(at::kFloat));
  int64_t forwards = 0;
  actmem::run_one_f_one_b(
      p2p, 4,
      [&](int64_t m, const at::Tensor& input) {
        if (pp.rank == die_stage && m == 2) std::raise(SIGKILL);
        ++forwards;
        return input.defined() ? input + 1 : at::ones({4});
      },
      [&](int64_t, const at::Tensor& grad) { return grad.defined() ? grad * 2 : at::ones({4}); });
  return {{"forwards", forwards}};
}

// --rank pipeline_fault DIR --tp 1 --pp P --die STAGE: stage STAGE kills itself in the forward of
// micro-batch 2.
ACTMEM_RANK_SCENARIO(pipeline_fault,
                     [](const testing::RankOptions& o, const TensorParallelGroup& g) {
                       return run_pipeline_fault(o.die_stage);
                     });

// Processes whose environment holds ACTMEM_TEST_TAG=tag.
int processes_tagged(const std::string& tag) {
  int n = 0;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return -1;
  const std::string needle = "ACTMEM_TEST_TAG=" + tag;
  while (dirent* d = readdir(proc)) {
    if (d->d_name[0] < '0' || d->d_name[0] > '9') continue;
    std::ifstream env(std::string("/proc/") + d->d_name + "/environ", std::ios::binary);
    std::string all((std::istreambuf_iterator<char>(env)), std::istreambuf_iterator<char>());
    if (all.find(needle) != std::string::npos) ++n;
  }
  closedir(proc);
  return n;
}

std::string fresh_tag() {
  return std::to_string(std::random_device{}());
}

int wait_until_no_process(const std::string& tag, int seconds) {
  for (int i = 0; i < seconds * 10; ++i) {
    if (processes_tagged(tag) == 0) return 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return processes_tagged(tag);
}

TEST(Launch, TwoProcessAllReduceOverGloo) {
  const auto r = run_actmem("launch --nproc-per-node 2 -- dist-check");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("all-reduce ok on 2 ranks"), std::string::npos) << r.output;
}

TEST(Launch, TrainUnderLaunchLogsFromRankZeroOnly) {
  const std::string log = ::testing::TempDir() + "launch_train.jsonl";
  const auto r = run_actmem(
      "launch --nproc-per-node 2 -- train --tensor-model-parallel-size 2 "
      "--num-layers 1 --hidden-size 32 --num-attention-heads 2 "
      "--seq-length 16 --micro-batch-size 2 --threads 1 "
      "--train-iters 2 --eval-interval 0 --log-json " +
      log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  size_t headers = 0;
  for (size_t p = r.output.find("actmem train:"); p != std::string::npos;
       p = r.output.find("actmem train:", p + 1)) {
    ++headers;
  }
  EXPECT_EQ(headers, 1u) << r.output;
  // One writer: the configuration record, then two iterations.
  EXPECT_EQ(actmem::testing::read_json_log(log).iterations.size(), 2u);
}

TEST(Launch, AFailingWorkerFailsTheLaunchWithItsMessageAndLeavesNoProcess) {
  const std::string tag = fresh_tag();
  const auto r = run_actmem("launch --nproc-per-node 3 -- dist-check --fail-rank 1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.stderr_text.find("rank 1 fails on purpose"), std::string::npos) << r.stderr_text;
  EXPECT_NE(r.stderr_text.find("actmem launch: worker 1 failed (exit code 1)"), std::string::npos)
      << r.stderr_text;
  // With the environment tag: the whole tree is gone once launch returned.
  const std::string cmd = "ACTMEM_TEST_TAG=" + tag + " " + std::string(ACTMEM_BINARY) +
                          " launch --nproc-per-node 2 -- dist-check --fail-rank 0 2>/dev/null";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  EXPECT_EQ(processes_tagged(tag), 0);
}

TEST(Launch, ReportsTheWorkerWhoseErrorCameFirstNotTheFirstToExit) {
  // Rank 0 reports the root cause, then takes a while to exit (a slow teardown); rank 1 fails a
  // moment later because of it, and exits first. Note [Worker stderr] in distributed.cpp.
  const std::string script =
      "if [ \"$RANK\" = 0 ]; then echo 'error: the root cause' >&2; sleep 1.5; exit 3; "
      "else sleep 0.3; echo 'error: my peer went away' >&2; exit 4; fi";
  ::testing::internal::CaptureStderr();
  const int rc = launch_program(2, "/bin/sh", {"-c", script}, 0, std::chrono::seconds(5));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("actmem launch: worker 0 failed (reported an error): the root cause"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("worker 1 failed"), std::string::npos) << err;
  EXPECT_NE(rc, 0);
  // Each worker's lines pass through whole.
  EXPECT_NE(err.find("error: the root cause\n"), std::string::npos) << err;
  EXPECT_NE(err.find("error: my peer went away\n"), std::string::npos) << err;
}

TEST(Launch, SignalsReachTheWorkersAndKillingTheLauncherKillsThem) {
  for (const char* sig : {"TERM", "KILL"}) {
    const std::string tag = fresh_tag();
    // Rank 0 never joins, so rank 1 waits in the rendezvous: both are alive until stopped.
    const std::string cmd = "ACTMEM_TEST_TAG=" + tag + " " + std::string(ACTMEM_BINARY) +
                            " launch --nproc-per-node 2 -- dist-check --hang-rank 0 2>/dev/null & "
                            "pid=$!; sleep 1.5; kill -" +
                            sig + " $pid; wait $pid; exit $?";
    const int status = std::system(cmd.c_str());
    EXPECT_NE(status, 0) << sig;
    EXPECT_EQ(wait_until_no_process(tag, 10), 0)
        << "workers outlived the launcher after SIG" << sig;
  }
}

TEST(Launch, AStageKilledMidScheduleStopsEveryWorker) {
  // Stage 1 of a three-stage pipeline dies (SIGKILL, no message) in the forward of micro-batch 2
  // while its neighbours wait in a send or receive to it: the launcher names it and stops the
  // others at once (well before Gloo's 60 s timeout), and no worker is left behind.
  const std::string tag = fresh_tag();
  const std::string dir = ::testing::TempDir() + "pp_fault_" + tag;
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  ::setenv("ACTMEM_TEST_TAG", tag.c_str(), 1);
  ::testing::internal::CaptureStderr();
  const auto t0 = std::chrono::steady_clock::now();
  const int rc =
      launch_program(3, testing::test_binary(),
                     {"--rank", "pipeline_fault", dir, "--tp", "1", "--pp", "3", "--die", "1"},
                     free_loopback_port(), std::chrono::seconds(5));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string err = ::testing::internal::GetCapturedStderr();
  ::unsetenv("ACTMEM_TEST_TAG");
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.find("actmem launch: worker 1 failed (signal 9); stopping the other 2"),
            std::string::npos)
      << err;
  EXPECT_LT(seconds, 30.0) << err;
  EXPECT_EQ(wait_until_no_process(tag, 10), 0) << "a worker outlived the launch";
  std::ifstream none(dir + "/rank0.json");
  EXPECT_FALSE(none.good()) << "rank 0 finished a schedule its neighbour never ran";
}

TEST(Launch, TwoNodesOnLoopbackFormOneWorld) {
  // torchrun's multi-node flags: two launchers (two "nodes" on the loopback address), one worker
  // each, meet at node 0's port; the tensor-parallel group of the check spans both nodes, and
  // only global rank 0 (on node 0) reports.
  const std::string dir = actmem::testing::fresh_temp_dir("two_nodes");
  const std::string port = std::to_string(free_loopback_port());
  auto node = [&](int r) {
    return std::string(ACTMEM_BINARY) + " launch --nnodes 2 --node-rank " + std::to_string(r) +
           " --master-addr 127.0.0.1 --master-port " + port +
           " --nproc-per-node 1 -- dist-check --tensor-model-parallel-size 2 > " + dir + "/node" +
           std::to_string(r) + ".txt 2>&1; echo $? > " + dir + "/rc" + std::to_string(r);
  };
  ASSERT_EQ(std::system(("(" + node(1) + ") & " + node(0) + "; wait").c_str()), 0);
  auto read = [&](const std::string& name) {
    std::ifstream f(dir + "/" + name);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(read("rc0"), "0\n") << read("node0.txt");
  EXPECT_EQ(read("rc1"), "0\n") << read("node1.txt");
  EXPECT_NE(read("node0.txt").find("all-reduce ok on 2 ranks"), std::string::npos)
      << read("node0.txt");
  EXPECT_NE(read("node0.txt").find("tp        [[0, 1]]"), std::string::npos) << read("node0.txt");
  EXPECT_EQ(read("node1.txt").find("all-reduce ok"), std::string::npos) << read("node1.txt");
}

// Two launchers on the loopback address ("node 0" and "node 1", one worker each) training a
// data-parallel model and saving every other iteration, in the background; a fault is then
// injected into node 1's worker. Note [Launchers across nodes] in distributed.cpp.
class TwoNodeTraining {
 public:
  explicit TwoNodeTraining(const std::string& timeout_minutes)
      : tag_(fresh_tag()), dir_(actmem::testing::fresh_temp_dir("two_node_fault")) {
    const std::string port = std::to_string(free_loopback_port());
    auto node = [&](int r) {
      const std::string n = std::to_string(r);
      return "(ACTMEM_TEST_TAG=" + tag_ + " " + std::string(ACTMEM_BINARY) +
             " launch --nnodes 2 --node-rank " + n + " --master-addr 127.0.0.1 --master-port " +
             port + " --nproc-per-node 1 -- train " + kModel + " --train-iters 1000000 --save " +
             dir_ + "/ckpt --save-interval 2 --distributed-timeout-minutes " + timeout_minutes +
             " > " + dir_ + "/node" + n + ".txt 2>&1; echo $? > " + dir_ + "/rc" + n + ".tmp; mv " +
             dir_ + "/rc" + n + ".tmp " + dir_ + "/rc" + n + ") > /dev/null 2>&1 &";
    };
    EXPECT_EQ(std::system((node(1) + " " + node(0)).c_str()), 0);
  }
  ~TwoNodeTraining() {
    // Whatever the test found, nothing of the run survives it.
    for (pid_t pid : pids("")) {
      ::kill(pid, SIGKILL);
      ::kill(pid, SIGCONT);
    }
  }

  // The training model: two data-parallel ranks, one per node, small enough for 2 cores.
  static constexpr const char* kModel =
      "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
      "--micro-batch-size 2 --global-batch-size 4 --threads 1 --eval-interval 0 --log-interval "
      "1000";

  // Waits until the run has saved a checkpoint past iteration 2 (false after 120 s).
  bool wait_for_checkpoints() const {
    for (int i = 0; i < 1200; ++i) {
      std::ifstream latest(dir_ + "/ckpt/latest_checkpointed_iteration.txt");
      int64_t it = 0;
      if (latest >> it && it >= 4) return true;
      if (exited(0) || exited(1)) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }

  // The processes of this run whose environment also holds `entry` (e.g. "RANK=1": a worker).
  std::vector<pid_t> pids(const std::string& entry) const {
    std::vector<pid_t> found;
    DIR* proc = opendir("/proc");
    if (proc == nullptr) return found;
    const std::string tag = std::string("ACTMEM_TEST_TAG=") + tag_ + '\0';
    const std::string want = '\0' + entry + '\0';
    while (dirent* d = readdir(proc)) {
      if (d->d_name[0] < '0' || d->d_name[0] > '9') continue;
      std::ifstream env(std::string("/proc/") + d->d_name + "/environ", std::ios::binary);
      const std::string all = '\0' + std::string((std::istreambuf_iterator<char>(env)),
                                                 std::istreambuf_iterator<char>());
      if (all.find('\0' + tag) != std::string::npos &&
          (entry.empty() || all.find(want) != std::string::npos)) {
        found.push_back(static_cast<pid_t>(std::atoi(d->d_name)));
      }
    }
    closedir(proc);
    return found;
  }

  bool exited(int node) const { return std::ifstream(dir_ + "/rc" + std::to_string(node)).good(); }
  // Seconds until both launchers have exited (-1 after `limit` seconds).
  double wait_for_both(double limit) const {
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (exited(0) && exited(1)) return s;
      if (s > limit) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::string read(const std::string& name) const {
    std::ifstream f(dir_ + "/" + name);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  const std::string& tag() const { return tag_; }
  std::string checkpoints() const { return dir_ + "/ckpt"; }

 private:
  std::string tag_, dir_;
};

// The last checkpoint `latest` names loads: one process continues the run for one iteration.
void expect_last_checkpoint_loads(const TwoNodeTraining& run) {
  std::ifstream latest(run.checkpoints() + "/latest_checkpointed_iteration.txt");
  int64_t it = 0;
  ASSERT_TRUE(latest >> it) << "no latest_checkpointed_iteration.txt";
  const auto r =
      run_actmem(std::string("train ") + TwoNodeTraining::kModel + " --load " + run.checkpoints() +
                 " --override-opt_param-scheduler --train-iters " + std::to_string(it + 1));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("; continuing at iteration " + std::to_string(it + 1)), std::string::npos)
      << r.output;
}

TEST(Launch, TwoNodesAKilledWorkerEndsBothLaunchersNamingItAndTheCheckpointLoads) {
  // SIGKILL of node 1's worker mid-run: its sockets close, so node 0's worker fails at once in
  // its collective; node 1's launcher records the failure first, and both launchers name it.
  TwoNodeTraining run("10");
  ASSERT_TRUE(run.wait_for_checkpoints()) << run.read("node0.txt") << run.read("node1.txt");
  const std::vector<pid_t> worker = run.pids("RANK=1");
  ASSERT_EQ(worker.size(), 1u);
  ASSERT_EQ(::kill(worker[0], SIGKILL), 0);
  const double seconds = run.wait_for_both(60);
  const std::string node0 = run.read("node0.txt"), node1 = run.read("node1.txt");
  ASSERT_GE(seconds, 0) << "a launcher did not end\n" << node0 << node1;
  std::printf("both launchers ended %.2f s after the kill\n--- node 0:\n%s--- node 1:\n%s", seconds,
              node0.c_str(), node1.c_str());
  EXPECT_LT(seconds, 10.0);
  EXPECT_NE(run.read("rc0"), "0\n");
  EXPECT_EQ(run.read("rc1"), "137\n");  // the worker's status, as a shell reports a kill
  const std::string cause = "actmem launch: worker 1 on node 1 failed (signal 9)";
  EXPECT_NE(node1.find(cause + "; stopping the other 0 here and the other nodes' workers"),
            std::string::npos)
      << node1;
  EXPECT_NE(node0.find(cause), std::string::npos) << node0;
  EXPECT_EQ(wait_until_no_process(run.tag(), 10), 0) << "a process of the run is left";
  expect_last_checkpoint_loads(run);
}

TEST(Launch, TwoNodesAHungWorkerEndsEveryProcessAfterTheDistributedTimeout) {
  // SIGSTOP of node 1's worker: its sockets stay open, so node 0's worker waits in its
  // collective until --distributed-timeout-minutes (0.05: 3 s) and fails; node 0's launcher
  // records that, and node 1's launcher, told through the store, stops its hung worker.
  TwoNodeTraining run("0.05");
  ASSERT_TRUE(run.wait_for_checkpoints()) << run.read("node0.txt") << run.read("node1.txt");
  const std::vector<pid_t> worker = run.pids("RANK=1");
  ASSERT_EQ(worker.size(), 1u);
  ASSERT_EQ(::kill(worker[0], SIGSTOP), 0);
  const double seconds = run.wait_for_both(60);
  const std::string node0 = run.read("node0.txt"), node1 = run.read("node1.txt");
  ASSERT_GE(seconds, 0) << "a launcher did not end\n" << node0 << node1;
  std::printf("both launchers ended %.2f s after the stop\n--- node 0:\n%s--- node 1:\n%s", seconds,
              node0.c_str(), node1.c_str());
  EXPECT_GE(seconds, 2.5);               // not before the timeout
  EXPECT_LT(seconds, 3.0 + 5.0 + 10.0);  // the timeout, the launcher's grace, and slack
  EXPECT_NE(run.read("rc0"), "0\n");
  EXPECT_NE(run.read("rc1"), "0\n");
  const std::string cause = "actmem launch: worker 0 on node 0 failed (exit code 1)";
  EXPECT_NE(node0.find(cause), std::string::npos) << node0;
  EXPECT_NE(node1.find(cause.substr(15)), std::string::npos) << node1;
  EXPECT_NE(node1.find("; stopping the 1 worker here\nactmem launch: worker 1 here was stopped "
                       "(SIGSTOP) when the failure came"),
            std::string::npos)
      << node1;
  EXPECT_EQ(wait_until_no_process(run.tag(), 10), 0) << "a process of the run is left";
  expect_last_checkpoint_loads(run);
}

TEST(Launch, WorkersShareTheCoresUnlessOmpNumThreadsIsSet) {
  // Each of N workers gets OMP_NUM_THREADS = cores / N (at least 1), as torchrun sets it, and
  // train without --threads uses it; a value the user set is kept.
  const std::string train =
      "launch --nproc-per-node 2 -- train --tensor-model-parallel-size 2 "
      "--num-layers 1 --hidden-size 32 --num-attention-heads 2 "
      "--seq-length 16 --micro-batch-size 2 --train-iters 1 --eval-interval 0";
  const int expected = std::max(1, available_cores() / 2);
  unsetenv("OMP_NUM_THREADS");
  auto r = run_actmem(train);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("| " + std::to_string(expected) + " threads\n"), std::string::npos)
      << r.output;
  setenv("OMP_NUM_THREADS", "1", 1);
  r = run_actmem(train);
  unsetenv("OMP_NUM_THREADS");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("| 1 threads\n"), std::string::npos) << r.output;
  setenv("OMP_NUM_THREADS", "two", 1);
  r = run_actmem(
      "train --train-iters 1 --num-layers 1 --hidden-size 32 --num-attention-heads 2 "
      "--seq-length 16 --micro-batch-size 2 --eval-interval 0");
  unsetenv("OMP_NUM_THREADS");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("OMP_NUM_THREADS must be a positive integer (or unset), got 'two'"),
            std::string::npos)
      << r.output;
}

// The workers get each word after -- as given: a list-looking value ([0,1]) is not split at its
// commas on the way (CLI11 would), and a preset expands in each worker (train --preset: the
// published shape's flags, the sizes given replacing them).
TEST(Launch, PassesWordsAsGivenAndPresetsExpandInTheWorkers) {
  const std::string log = ::testing::TempDir() + "launch_words.jsonl";
  auto r = run_actmem(
      "launch --nproc-per-node 2 -- train --preset mixtral-8x7b --num-layers 2 "
      "--hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
      "--ffn-hidden-size 128 --num-experts 2 --moe-layer-freq '[0,1]' "
      "--seq-length 16 --micro-batch-size 2 --vocab-size 256 "
      "--tensor-model-parallel-size 2 --sequence-parallel --train-iters 1 "
      "--eval-interval 0 --threads 1 --log-json " +
      log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("4 heads in 2 query groups"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| MoE layers 1\n"), std::string::npos) << r.output;
  const auto parsed = actmem::testing::read_json_log(log);
  // From the preset: RMSNorm, SwiGLU, RoPE base 1e6, untied, no dropout (so flash), top-2.
  EXPECT_EQ(parsed.config["model"]["normalization"], "RMSNorm");
  EXPECT_EQ(parsed.config["model"]["rotary_base"], 1000000.0);
  EXPECT_EQ(parsed.config["model"]["moe_router_topk"], 2);
  EXPECT_EQ(parsed.config["model"]["attention_kernel"], "flash");
  r = run_actmem("train --preset no-such-model --train-iters 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("unknown preset 'no-such-model'"), std::string::npos)
      << r.stderr_text;
}

TEST(Launch, BadInputIsAClearError) {
  auto r = run_actmem("launch --nproc-per-node 0 -- dist-check");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("--nproc-per-node must be at least 1"), std::string::npos)
      << r.stderr_text;
  r = run_actmem("launch --nproc-per-node 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("command"), std::string::npos) << r.stderr_text;
  r = run_actmem("launch --nnodes 2 --node-rank 2 --nproc-per-node 1 -- dist-check");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("--node-rank must be in 0..1 for --nnodes 2, got 2"),
            std::string::npos)
      << r.stderr_text;
  // Megatron's --distributed-timeout-minutes: positive, finite, at most a year.
  for (const char* bad : {"0", "-1", "nan", "x"}) {
    r = run_actmem(std::string("train --train-iters 1 --distributed-timeout-minutes ") + bad);
    EXPECT_NE(r.exit_code, 0) << bad;
    EXPECT_NE(r.stderr_text.find("--distributed-timeout-minutes"), std::string::npos)
        << bad << ": " << r.stderr_text;
  }
  r = run_actmem("dist-check --distributed-timeout-minutes 1e9");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(
      r.stderr_text.find("--distributed-timeout-minutes must be a positive number of minutes, "
                         "at most a year, got 1e+09"),
      std::string::npos)
      << r.stderr_text;
  expect_error_containing([] { distributed_timeout_from_minutes(0.0); }, "positive number");
  EXPECT_EQ(distributed_timeout_from_minutes(0.05), std::chrono::milliseconds(3000));
  EXPECT_EQ(distributed_timeout_from_minutes(10), kDefaultDistributedTimeout);
  // A launcher on node 1 whose node 0 never listens: the join waits, then is a clear error
  // (here cut short: the launcher is stopped after a second, and nothing is left running).
  const std::string tag = fresh_tag();
  const std::string cmd = "ACTMEM_TEST_TAG=" + tag + " timeout 1 " + std::string(ACTMEM_BINARY) +
                          " launch --nnodes 2 --node-rank 1 --master-port " +
                          std::to_string(free_loopback_port()) +
                          " --nproc-per-node 1 -- dist-check > /dev/null 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  EXPECT_EQ(wait_until_no_process(tag, 10), 0);
}

TEST(DistEnv, ParsesAndValidatesTheVariables) {
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_PORT", "1234", 1);
  const DistEnv e = dist_env_from_environment();
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_port, 1234);
  EXPECT_TRUE(e.from_environment);
  setenv("RANK", "2", 1);
  expect_error_containing([] { dist_env_from_environment(); },
                          "RANK (2) must be below WORLD_SIZE (2)");
  setenv("RANK", "x", 1);
  expect_error_containing([] { dist_env_from_environment(); },
                          "RANK='x' is not a non-negative integer");
  setenv("RANK", "1", 1);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);  // torchrun's: the launcher hosts the store
  EXPECT_TRUE(dist_env_from_environment().agent_store);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "yes", 1);
  expect_error_containing([] { dist_env_from_environment(); },
                          "TORCHELASTIC_USE_AGENT_STORE='yes'");
  unsetenv("TORCHELASTIC_USE_AGENT_STORE");
  EXPECT_FALSE(dist_env_from_environment().agent_store);
  setenv("RANK", "0", 1);
  unsetenv("WORLD_SIZE");
  expect_error_containing([] { dist_env_from_environment(); },
                          "RANK and WORLD_SIZE must be set together");
  unsetenv("RANK");
  unsetenv("MASTER_PORT");
  EXPECT_FALSE(dist_env_from_environment().from_environment);
}

}  // namespace
}  // namespace actmem
