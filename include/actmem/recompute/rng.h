// rng.h — named random-number streams (Megatron's CudaRNGStatesTracker), whole-state snapshots and
// the guards that make recompute replay exactly the random numbers of the forward pass.
//
// The tracker keeps generator states by name and swaps one into the compute device's default
// generator for the duration of a fork() (CPU here, the CUDA default generator on CUDA).
// Snapshots are deep copies: restoring one always restores the bytes taken, never a live handle
// (Megatron's graph-safe snapshots, _get_all_rng_states in megatron/core/tensor_parallel/random.py,
// were live generator handles until Megatron-LM PR #5841 cloned them; fixed here).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>

namespace actmem {

inline constexpr const char* kModelParallelRng = "model-parallel-rng";
inline constexpr const char* kExpertParallelRng = "expert-parallel-rng";
inline constexpr const char* kDataParallelRng = "data-parallel-rng";
inline constexpr const char* kDefaultRng = "default-rng";  // the untracked default generator

class RngFork;

/// Named generator states. Not thread-safe: one training thread uses it (as in Megatron).
class RngStatesTracker {
 public:
  RngStatesTracker();
  /// Forgets every state and seed; the current stream becomes "default-rng".
  void reset();
  bool is_initialized() const { return initialized_; }
  /// Whether stream `name` was added.
  bool has(const std::string& name) const { return states_.count(name) > 0; }
  /// Deep copies of every named state.
  std::map<std::string, at::Tensor> get_states() const;
  /// Adopts deep copies of `states` (no validation, as Megatron); marks the tracker initialised.
  void set_states(const std::map<std::string, at::Tensor>& states);
  /// Adds stream `name` in the state a fresh manual_seed(seed) gives. Throws when the seed was
  /// used before ("seed S already exists") or the name exists ("rng state N already exists");
  /// as in Megatron the seed is recorded before the name is checked.
  void add(const std::string& name, uint64_t seed);
  /// Swaps stream `name` into the device's default generator until the returned guard dies;
  /// progress is written back, and forks nest (an outer fork's progress is persisted first).
  /// Throws "rng state N is not added" for an unknown name.
  [[nodiscard]] RngFork fork(const std::string& name = kModelParallelRng);
  /// The stream a fork currently routes the default generator to ("default-rng" outside forks).
  const std::string& current_state_name() const { return current_; }
  /// Which device's default generator fork() swaps (CPU unless set, e.g. by
  /// model_parallel_manual_seed on CUDA).
  void set_device(const c10::Device& device) { device_ = device; }
  const c10::Device& device() const { return device_; }

 private:
  friend class RngFork;
  at::Generator generator() const;
  std::map<std::string, at::Tensor> states_;
  std::set<uint64_t> seeds_;
  std::string current_ = kDefaultRng;
  bool initialized_ = false;
  c10::Device device_{c10::kCPU};
};

/// RAII guard returned by RngStatesTracker::fork.
class RngFork {
 public:
  RngFork(RngFork&& other) noexcept;
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;
  RngFork& operator=(RngFork&&) = delete;
  ~RngFork();

 private:
  friend class RngStatesTracker;
  RngFork(RngStatesTracker* tracker, std::string name);
  RngStatesTracker* tracker_;
  std::string name_;
  std::string orig_name_;
  at::Tensor orig_state_;
};

/// The process-wide tracker (Megatron's get_cuda_rng_tracker()).
RngStatesTracker& get_rng_tracker();

/// A tracker holding Megatron's three streams for these ranks (below), built without touching
/// any global generator or the process-wide tracker (a Trainer keeps its own).
RngStatesTracker make_model_parallel_tracker(uint64_t seed, int64_t tp_rank = 0,
                                             int64_t ep_rank = 0, int64_t etp_rank = 0,
                                             const c10::Device& device = c10::kCPU);

/// Seeds the default generators with `seed` and registers Megatron's three streams:
/// data-parallel-rng = seed, model-parallel-rng = seed + 2718 + tp_rank,
/// expert-parallel-rng = seed + 1024 + 100 * ep_rank + etp_rank. Resets the tracker first.
void model_parallel_manual_seed(uint64_t seed, int64_t tp_rank = 0, int64_t ep_rank = 0,
                                int64_t etp_rank = 0, const c10::Device& device = c10::kCPU);

/// Every random state recompute must replay: the CPU default generator, the CUDA default
/// generator of the current device when CUDA is in use, and every tracker stream. Deep copies.
struct RngSnapshot {
  at::Tensor cpu;
  at::Tensor cuda;  // undefined without CUDA
  std::map<std::string, at::Tensor> tracker;
};
RngSnapshot get_all_rng_states();
void set_all_rng_states(const RngSnapshot& snapshot);

/// Snapshots every random state on construction and restores it on destruction, also when an
/// exception passes through (Megatron's _fork_rng).
class ForkRng {
 public:
  ForkRng();
  ~ForkRng();
  ForkRng(const ForkRng&) = delete;
  ForkRng& operator=(const ForkRng&) = delete;

 private:
  RngSnapshot saved_;
};

}  // namespace actmem
