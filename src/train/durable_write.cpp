// durable_write.cpp — the checkpoint save protocol's file-system moves (Note [Checkpoint
// protocol]): files written and synced, directories published atomically, the ranks agreeing on
// success; and the exit-signal handler that lets a run save before it stops (checkpoint.h).
#include "actmem/train/checkpoint.h"

#include "checkpoint_io.h"

#include "actmem/base/output_file.h"
#include "actmem/parallel/tensor_parallel.h"

#include <ATen/ATen.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace actmem {

namespace fs = std::filesystem;

// Note [Checkpoint protocol]
// A checkpoint is published in three moves, each atomic on a POSIX file system, so a crash at
// any instant leaves the directory loading the newest *complete* checkpoint:
//   1. every rank writes DIR/iter_N.tmp/mp_rank_RR/model_optim_rng.pt, then fsyncs the file and
//      its directory; the ranks agree that all succeeded (one all-reduce);
//   2. rank 0 renames iter_N.tmp to iter_N (exchanging the two atomically when iter_N exists,
//      e.g. a run resumed from N saving N again; the old one is removed afterwards) and fsyncs
//      DIR;
//   3. rank 0 writes latest_checkpointed_iteration.txt.tmp, fsyncs it and renames it over
//      latest_checkpointed_iteration.txt (last: the pointer moves only to a complete
//      checkpoint), then fsyncs DIR.
// Older checkpoints are never touched, so the previous one stays loadable until the new one is
// complete (Megatron keeps them all as well). A leftover iter_N.tmp from a crash is ignored by
// loads and removed by the next save of N. Tests kill the process between the moves
// (ACTMEM_CHECKPOINT_FAULT=STAGE[@ITER], STAGE one of mid-file, before-publish, before-latest:
// the process sends itself SIGKILL there).

std::string errno_text() {
  return std::strerror(errno);
}

// Test-only fault injection (Note [Checkpoint protocol]).
void maybe_fault(const char* stage, int64_t iteration) {
  const char* spec = std::getenv("ACTMEM_CHECKPOINT_FAULT");
  if (spec == nullptr) return;
  std::string s(spec);
  const auto at = s.find('@');
  if (s.substr(0, at) != stage) return;
  if (at != std::string::npos && std::to_string(iteration) != s.substr(at + 1)) return;
  std::raise(SIGKILL);
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  TORCH_CHECK(fd >= 0, "actmem::save_checkpoint: cannot open ", path,
              " to sync it: ", errno_text());
  const int rc = ::fsync(fd);
  const std::string err = rc != 0 ? errno_text() : std::string();
  ::close(fd);
  TORCH_CHECK(rc == 0, "actmem::save_checkpoint: fsync of ", path, " failed: ", err);
}

// Writes `size` bytes to `path` (created or truncated) and fsyncs it. `fault_iteration` >= 0
// arms the mid-file fault point, after the first half (Note [Checkpoint protocol]).
void write_durably(const std::string& path, const char* data, size_t size,
                   int64_t fault_iteration) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "actmem::save_checkpoint: cannot create ", path, ": ", errno_text());
  const size_t first = fault_iteration >= 0 ? size / 2 : size;
  int err = write_fully(fd, data, first);
  if (err == 0 && first < size) {
    ::fsync(fd);
    maybe_fault("mid-file", fault_iteration);
    err = write_fully(fd, data + first, size - first);
  }
  std::string what = err != 0 ? "write failed: " + std::string(std::strerror(err)) : "";
  if (what.empty() && ::fsync(fd) != 0) what = "fsync failed: " + errno_text();
  if (::close(fd) != 0 && what.empty()) what = "close failed: " + errno_text();
  TORCH_CHECK(what.empty(), "actmem::save_checkpoint: ", path, ": ", what,
              " (is the disk full? the previous checkpoint is untouched)");
}

// Whether every writing rank succeeded; the ranks call it together, so one rank's failure
// reaches the others instead of leaving them waiting in the next collective. The writers are one
// replica's tensor-, expert-parallel ranks and pipeline stages (Trainer::save_checkpoint).
bool all_ranks_ok(bool ok, const at::Device& device) {
  if (tensor_parallel_group().size == 1 && expert_parallel_group().size == 1 &&
      pipeline_parallel_group().size == 1) {
    return ok;
  }
  const at::Tensor failures =
      at::full({1}, ok ? 0.0f : 1.0f, at::TensorOptions().dtype(at::kFloat).device(device));
  return group_all_reduce_sum(
             pipeline_parallel_group(),
             group_all_reduce_sum(expert_parallel_group(), all_reduce_sum(failures)))
             .item<float>() == 0.0f;
}

// Publishes `tmp` as `final` atomically (Note [Checkpoint protocol], move 2).
void publish_directory(const std::string& tmp, const std::string& final) {
  std::error_code ec;
  if (!fs::exists(final, ec)) {
    TORCH_CHECK(::rename(tmp.c_str(), final.c_str()) == 0,
                "actmem::save_checkpoint: cannot "
                "rename ",
                tmp, " to ", final, ": ", errno_text());
    return;
  }
  // Exchange, then remove the old copy: iter_N names a complete checkpoint at every instant.
  const std::string old = final + ".old";
  fs::remove_all(old, ec);
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final.c_str(), RENAME_EXCHANGE) == 0) {
    fs::rename(tmp, old);  // tmp now holds the old checkpoint
    fs::remove_all(old, ec);
    return;
  }
#endif
  // A file system without the exchange: a short window in which only iter_N.old exists.
  fs::rename(final, old);
  fs::rename(tmp, final);
  fs::remove_all(old, ec);
}

// ---- ExitSignalHandler -------------------------------------------------------------------------

namespace {
std::atomic<int> g_exit_signal{0};
std::atomic<bool> g_handler_installed{false};
struct sigaction g_previous_term, g_previous_int;
extern "C" void record_exit_signal(int sig) {
  g_exit_signal.store(sig);
}
}  // namespace

ExitSignalHandler::ExitSignalHandler() {
  TORCH_CHECK(!g_handler_installed.exchange(true),
              "actmem::ExitSignalHandler: one is installed already");
  g_exit_signal.store(0);
  struct sigaction action {};
  action.sa_handler = record_exit_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESETHAND;  // a second signal takes the default action: exit now
  ::sigaction(SIGTERM, &action, &g_previous_term);
  ::sigaction(SIGINT, &action, &g_previous_int);
}

ExitSignalHandler::~ExitSignalHandler() {
  ::sigaction(SIGTERM, &g_previous_term, nullptr);
  ::sigaction(SIGINT, &g_previous_int, nullptr);
  g_handler_installed.store(false);
}

int ExitSignalHandler::received() const {
  return g_exit_signal.load();
}

}  // namespace actmem
