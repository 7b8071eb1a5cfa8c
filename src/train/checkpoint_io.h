// checkpoint_io.h — what checkpoint.cpp's save and load share with the file (checkpoint_file.cpp)
// and the file system (durable_write.cpp). Private to the train layer's checkpoint files.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace actmem {

/// The bytes of a checkpoint file holding `value`: pickle_save's zip container, its dicts and
/// lists untagged (Note [Checkpoints Python loads with weights_only] in checkpoint_file.cpp).
std::vector<char> save_untagged(const c10::IValue& value);

/// strerror(errno).
std::string errno_text();
/// Test-only fault injection: SIGKILL at `stage` of `iteration`'s save when
/// ACTMEM_CHECKPOINT_FAULT names it (Note [Checkpoint protocol] in durable_write.cpp).
void maybe_fault(const char* stage, int64_t iteration);
/// fsync of a file or a directory.
void fsync_path(const std::string& path, bool directory);
/// Writes `size` bytes to `path` (created or truncated) and fsyncs it. `fault_iteration` >= 0
/// arms the mid-file fault point, after the first half.
void write_durably(const std::string& path, const char* data, size_t size,
                   int64_t fault_iteration = -1);
/// Whether every writing rank succeeded; the ranks call it together, so one rank's failure
/// reaches the others instead of leaving them waiting in the next collective. The writers are
/// one replica's tensor-, expert-parallel ranks and pipeline stages (Trainer::save_checkpoint).
bool all_ranks_ok(bool ok, const at::Device& device);
/// Publishes directory `tmp` as `final` atomically (Note [Checkpoint protocol], move 2).
void publish_directory(const std::string& tmp, const std::string& final);

/// Runs `fn` on every rank, then agrees on success: rethrows a local error, or reports another
/// rank's.
template <typename Fn>
void on_all_ranks(const at::Device& device, const char* what, Fn&& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  const bool all_ok = all_ranks_ok(!error, device);
  if (error) std::rethrow_exception(error);
  TORCH_CHECK(all_ok,
              "actmem::Trainer::save_checkpoint: another tensor-, expert- or "
              "pipeline-parallel rank failed ",
              what,
              " (its error is in its output); nothing "
              "was published");
}

}  // namespace actmem
