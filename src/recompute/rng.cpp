// rng.cpp — RngStatesTracker, snapshots and forks.
#include "actmem/recompute/rng.h"

#include "actmem/base/compat.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <mutex>

namespace actmem {

namespace {
at::Tensor read_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();  // a fresh tensor: a deep copy
}
void write_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}
at::Tensor seeded_state(at::Generator gen, uint64_t seed) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto& g = gen;
  const at::Tensor ambient = g.get_state();
  g.set_current_seed(seed);
  at::Tensor state = g.get_state();
  g.set_state(ambient);
  return state;
}
std::map<std::string, at::Tensor> deep_copy(const std::map<std::string, at::Tensor>& in) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, state] : in) out.emplace(name, state.defined() ? state.clone() : state);
  return out;
}
bool cuda_in_use() {
  return compat::cuda_available();
}
}  // namespace

RngStatesTracker::RngStatesTracker() {
  reset();
}

void RngStatesTracker::reset() {
  TORCH_CHECK(current_ == kDefaultRng, "actmem::RngStatesTracker::reset: called inside fork('",
              current_, "'); leave the fork first");
  initialized_ = false;
  states_.clear();
  seeds_.clear();
  current_ = kDefaultRng;
}

at::Generator RngStatesTracker::generator() const {
  return device_.is_cpu() ? at::detail::getDefaultCPUGenerator()
                          : at::globalContext().defaultGenerator(device_);
}

std::map<std::string, at::Tensor> RngStatesTracker::get_states() const {
  return deep_copy(states_);
}

void RngStatesTracker::set_states(const std::map<std::string, at::Tensor>& states) {
  TORCH_CHECK(current_ == kDefaultRng || states.count(current_) != 0,
              "actmem::RngStatesTracker::set_states: the stream '", current_,
              "' of the enclosing fork is missing from the new states");
  initialized_ = true;
  states_ = deep_copy(states);
}

void RngStatesTracker::add(const std::string& name, uint64_t seed) {
  initialized_ = true;
  TORCH_CHECK(seeds_.count(seed) == 0, "actmem::RngStatesTracker::add: seed ", seed,
              " already exists");
  seeds_.insert(seed);  // before the name check, as Megatron does
  TORCH_CHECK(states_.count(name) == 0, "actmem::RngStatesTracker::add: rng state '", name,
              "' already exists");
  states_[name] = seeded_state(generator(), seed);
}

RngFork RngStatesTracker::fork(const std::string& name) {
  TORCH_CHECK(states_.count(name) != 0, "actmem::RngStatesTracker::fork: rng state '", name,
              "' is not added");
  return RngFork(this, name);
}

RngFork::RngFork(RngStatesTracker* tracker, std::string name)
    : tracker_(tracker), name_(std::move(name)), orig_name_(tracker->current_) {
  const at::Generator gen = tracker_->generator();
  orig_state_ = read_state(gen);
  // An outer fork's progress is persisted, so a nested fork of the same stream continues it.
  if (orig_name_ != kDefaultRng) tracker_->states_[orig_name_] = orig_state_;
  write_state(gen, tracker_->states_.at(name_));
  tracker_->current_ = name_;
}

RngFork::RngFork(RngFork&& other) noexcept
    : tracker_(other.tracker_),
      name_(std::move(other.name_)),
      orig_name_(std::move(other.orig_name_)),
      orig_state_(std::move(other.orig_state_)) {
  other.tracker_ = nullptr;
}

RngFork::~RngFork() {
  if (tracker_ == nullptr) return;
  try {
    // Guards nest lexically, so the current stream should be ours; a destructor must not throw,
    // so a violation (Megatron raises) is reported and the outer state restored regardless.
    if (tracker_->current_ != name_) {
      TORCH_WARN("actmem::RngFork: current state name ", tracker_->current_,
                 " is not the same as the desired state name ", name_);
    }
    const at::Generator gen = tracker_->generator();
    tracker_->states_[name_] = read_state(gen);
    // Reload the outer stream from the tracker: a nested fork of it may have advanced it.
    const auto outer_it = tracker_->states_.find(orig_name_);
    const at::Tensor outer = (orig_name_ != kDefaultRng && outer_it != tracker_->states_.end())
                                 ? outer_it->second
                                 : orig_state_;
    write_state(gen, outer);
  } catch (const std::exception& e) {
    TORCH_WARN("actmem::RngFork: could not restore the random state: ", e.what());
  }
  tracker_->current_ = orig_name_;
}

RngStatesTracker& get_rng_tracker() {
  static RngStatesTracker tracker;
  return tracker;
}

RngStatesTracker make_model_parallel_tracker(uint64_t seed, int64_t tp_rank, int64_t ep_rank,
                                             int64_t etp_rank, const c10::Device& device) {
  TORCH_CHECK(tp_rank >= 0 && ep_rank >= 0 && etp_rank >= 0,
              "actmem::model_parallel_manual_seed: ranks must be >= 0, got tp ", tp_rank, " ep ",
              ep_rank, " etp ", etp_rank);
  const uint64_t tp_seed = seed + 2718 + static_cast<uint64_t>(tp_rank);
  const uint64_t ep_seed =
      seed + 1024 + 100 * static_cast<uint64_t>(ep_rank) + static_cast<uint64_t>(etp_rank);
  RngStatesTracker tracker;
  tracker.set_device(device);
  // add() seeds a state from a fresh seed and leaves the device's generator as it was.
  tracker.add(kDataParallelRng, seed);
  tracker.add(kModelParallelRng, tp_seed);
  tracker.add(kExpertParallelRng, ep_seed);
  return tracker;
}

void model_parallel_manual_seed(uint64_t seed, int64_t tp_rank, int64_t ep_rank, int64_t etp_rank,
                                const c10::Device& device) {
  auto& tracker = get_rng_tracker();
  TORCH_CHECK(tracker.current_state_name() == kDefaultRng,
              "actmem::model_parallel_manual_seed: "
              "called inside fork('",
              tracker.current_state_name(), "'); leave the fork first");
  RngStatesTracker seeded = make_model_parallel_tracker(seed, tp_rank, ep_rank, etp_rank, device);
  tracker = std::move(seeded);
  at::manual_seed(seed);  // the default generators are the data-parallel stream
}

RngSnapshot get_all_rng_states() {
  RngSnapshot s;
  s.cpu = read_state(at::detail::getDefaultCPUGenerator());
  if (cuda_in_use()) {
    s.cuda = read_state(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA)));
  }
  auto& tracker = get_rng_tracker();
  s.tracker = tracker.get_states();
  // Inside fork(X) the live state of X is in the device generator, not yet in the tracker.
  if (tracker.current_state_name() != kDefaultRng) {
    s.tracker[tracker.current_state_name()] = read_state(
        tracker.device().is_cpu() ? at::detail::getDefaultCPUGenerator()
                                  : at::globalContext().defaultGenerator(tracker.device()));
  }
  return s;
}

void set_all_rng_states(const RngSnapshot& s) {
  write_state(at::detail::getDefaultCPUGenerator(), s.cpu);
  if (s.cuda.defined()) {
    write_state(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA)), s.cuda);
  }
  get_rng_tracker().set_states(s.tracker);
}

ForkRng::ForkRng() : saved_(get_all_rng_states()) {}

ForkRng::~ForkRng() {
  try {
    set_all_rng_states(saved_);
  } catch (const std::exception& e) {
    TORCH_WARN("actmem::ForkRng: could not restore the random state: ", e.what());
  }
}

}  // namespace actmem
