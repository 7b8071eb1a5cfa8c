// activation_offloader.cpp — ActivationOffloader (entries and their state machine, groups, the
// saved-tensor hook), OffloadRegion and the group start/commit autograd functions.
#include "actmem/offload/activation_offloader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class_detail.h>
#ifdef ACTMEM_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <chrono>
#include <unordered_set>

namespace actmem {

using Clock = std::chrono::steady_clock;

namespace {
int64_t nanoseconds_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}
}  // namespace

const char* to_string(OffloadState s) {
  switch (s) {
    case OffloadState::kResident:
      return "resident";
    case OffloadState::kOffloading:
      return "offloading";
    case OffloadState::kOffloaded:
      return "offloaded";
    case OffloadState::kReloading:
      return "reloading";
    case OffloadState::kReloaded:
      return "reloaded";
  }
  return "?";
}

bool is_legal_transition(OffloadState from, OffloadState to) {
  for (const auto& [f, t] : kOffloadTransitions) {
    if (f == from && t == to) return true;
  }
  return false;
}

// Note [Offload state machine] (activation_offloader.h): the fields each state uses.
struct ActivationOffloader::Entry {
  std::mutex mutex;
  OffloadState state = OffloadState::kResident;
  bool offload_finished = false;
  bool force_release = false;
  c10::weak_intrusive_ptr<c10::StorageImpl> forced_storage{c10::intrusive_ptr<c10::StorageImpl>()};
  int64_t nbytes = 0;
  at::Tensor device;    // uint8 alias of the whole device storage while resident/offloading
  at::Tensor host;      // pool buffer while offloading..reloading
  at::Tensor reloaded;  // uint8 device buffer after the reload
  c10::Device where{c10::kCPU};  // the device the storage lives on
  CopyEvent offloaded, reloaded_event;
  bool reload_queued = false;
  int group = -1;  // the group that created it (a later group of the forward may share it)
};

struct ActivationOffloader::Group {
  GroupInfo info;
  int64_t bytes = 0, tensors = 0;             // what it offloaded in the warmup step
  std::vector<std::weak_ptr<Entry>> entries;  // handles (autograd's saved variables) own them
};

namespace {

// Moves an entry (its mutex held) to `to`, checked against kOffloadTransitions.
void transition(OffloadState& state, OffloadState to, const char* action) {
  TORCH_CHECK(is_legal_transition(state, to),
              "actmem::ActivationOffloader: illegal transition: ", action, " from state ",
              to_string(state), " to ", to_string(to));
  state = to;
}

bool weakly_contains(const std::map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>>& m,
                     const void* key) {
  const auto it = m.find(key);
  return it != m.end() && !it->second.expired();
}

void weakly_insert(std::map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>>& m,
                   const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return;
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  m.insert_or_assign(impl, c10::weak_intrusive_ptr<c10::StorageImpl>(
                               c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl)));
}

class OffloadedView final : public PackedTensor {
 public:
  OffloadedView(std::shared_ptr<ActivationOffloader::Entry> entry, const at::Tensor& t,
                std::function<void(ActivationOffloader::Entry&)> wait)
      : entry_(std::move(entry)),
        options_(t.options()),
        sizes_(t.sizes().vec()),
        strides_(t.strides().vec()),
        offset_(t.storage_offset()),
        wait_(std::move(wait)) {}
  at::Tensor unpack() override {
    wait_(*entry_);
    at::Tensor bytes;
    {
      std::lock_guard<std::mutex> lock(entry_->mutex);
      // An entry of a group that did not offload (or was not committed) is still resident.
      bytes = entry_->state == OffloadState::kResident ? entry_->device : entry_->reloaded;
    }
    TORCH_INTERNAL_ASSERT(bytes.defined(), "offloaded tensor has no device data after reload");
    return at::empty({0}, options_).set_(bytes.storage(), offset_, sizes_, strides_);
  }

 private:
  std::shared_ptr<ActivationOffloader::Entry> entry_;
  at::TensorOptions options_;
  std::vector<int64_t> sizes_, strides_;
  int64_t offset_;
  std::function<void(ActivationOffloader::Entry&)> wait_;
};

}  // namespace

namespace {
// A CUDA device without an index means the current one: offload compares devices exactly.
c10::Device resolved(const c10::Device& device) {
#ifdef ACTMEM_WITH_CUDA
  if (device.is_cuda() && !device.has_index()) {
    return c10::Device(c10::kCUDA, c10::cuda::current_device());
  }
#endif
  return device;
}
}  // namespace

// Note [Offloader handle]
// The group start and commit nodes of a graph live as long as the graph, which may outlive the
// offloader (a graph kept after the trainer is gone). They hold this handle in a capsule, not a
// raw pointer in an integer: the offloader clears it when it is destroyed, and a backward that
// reaches a node afterwards fails with a clear error instead of touching freed memory.
struct ActivationOffloader::Handle : torch::CustomClassHolder {
  std::atomic<ActivationOffloader*> owner{nullptr};
};

ActivationOffloader::ActivationOffloader(int64_t min_elements, double bytes_per_second,
                                         int max_inflight, c10::Device device)
    : min_elements_(min_elements),
      device_(resolved(device)),
      pool_(/*pinned=*/device.is_cuda()),
      d2h_("d2h", bytes_per_second, device),
      h2d_("h2d", bytes_per_second, device),
      schedule_(max_inflight),
      handle_(c10::make_intrusive<Handle>()) {
  TORCH_CHECK(min_elements >= 0,
              "actmem::ActivationOffloader: min_offloaded_tensor_size must be "
              ">= 0, got ",
              min_elements);
  handle_->owner = this;
}

ActivationOffloader::~ActivationOffloader() {
  handle_->owner = nullptr;
}

void ActivationOffloader::exclude(const at::Tensor& t) {
  weakly_insert(excluded_, t);
}

void ActivationOffloader::exclude_this_forward(const at::Tensor& t) {
  weakly_insert(excluded_forward_, t);
}

void ActivationOffloader::release_forced(bool wait) {
  // Compute thread only. A forced tensor's device bytes are freed once its copy has finished,
  // although forward code may still hold references: the caller promised nothing reads them
  // again before backward (which reads the reload).
  std::vector<std::shared_ptr<Entry>> pending;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending.swap(pending_release_);
  }
  std::vector<std::shared_ptr<Entry>> later;
  for (auto& e : pending) {
    if (wait) e->offloaded.wait();
    bool done;
    {
      std::lock_guard<std::mutex> lock(e->mutex);
      done = e->offload_finished;
    }
    if (!done) {
      later.push_back(std::move(e));
      continue;
    }
    if (auto impl = e->forced_storage.lock()) {
      impl->set_data_ptr_noswap(c10::DataPtr(nullptr, impl->device()));
      impl->set_nbytes(0);
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& e : later) pending_release_.push_back(std::move(e));
}

int ActivationOffloader::open_group(const std::string& name, GroupKind kind, bool offload,
                                    HostBuffers buffers) {
  release_forced(/*wait=*/false);
  std::lock_guard<std::mutex> lock(mutex_);
  if (forwards_.empty()) forwards_.push_back({});  // a forward nobody announced
  const ForwardInfo& forward = forwards_.back();
  auto g = std::make_shared<Group>();
  const size_t index = groups_.size();
  g->info.name = name;
  g->info.kind = kind;
  g->info.buffers = buffers;
  g->info.forward = static_cast<int>(forwards_.size()) - 1;
  g->info.offloads = schedule_.offloads(forward.chunk, index - forward.first_group, offload,
                                        forward.backward_follows);
  groups_.push_back(std::move(g));
  return static_cast<int>(index);
}

const GroupInfo* ActivationOffloader::group_info(int index) const {
  if (index < 0 || index >= static_cast<int>(groups_.size())) return nullptr;
  return &groups_[static_cast<size_t>(index)]->info;
}

std::shared_ptr<PackedTensor> ActivationOffloader::pack(const at::Tensor& t) {
  if (current_ < 0 || !t.defined() || !t.has_storage()) return nullptr;
  if (t.is_leaf() && t.requires_grad()) return nullptr;  // a parameter
  if (t.device() != device_) return nullptr;             // e.g. a CPU tensor in CUDA training
  const void* key = t.storage().unsafeGetStorageImpl();
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Group& g = *groups_.at(static_cast<size_t>(current_));
    // The size rule is the storage's, not the view's: entries are whole storages, and a view
    // kept beside an offloaded (and, when forced, freed) storage would read freed memory
    // (an MoE expert's row segment of the permuted tokens, say).
    const int64_t storage_elements =
        static_cast<int64_t>(t.storage().nbytes()) / static_cast<int64_t>(t.element_size());
    if (storage_elements < min_elements_) {
      if (g.info.offloads && storage_elements > largest_kept_.numel) {
        largest_kept_ = {storage_elements, t.sizes().vec(),
                         std::string(c10::toString(t.scalar_type())), g.info.name};
      }
      return nullptr;
    }
    if (weakly_contains(excluded_, key) || weakly_contains(excluded_forward_, key)) return nullptr;
    auto it = by_storage_.find(key);
    if (it != by_storage_.end() && !it->second.first.expired()) entry = it->second.second.lock();
    if (!entry) {
      if (!g.info.offloads) return nullptr;  // kept: the margin rule, or a layer that keeps
      entry = std::make_shared<Entry>();
      entry->nbytes = static_cast<int64_t>(t.storage().nbytes());
      entry->where = t.device();
      entry->group = current_;
      entry->device =
          at::empty({0}, t.options().dtype(at::kByte)).set_(t.storage(), 0, {entry->nbytes}, {1});
      by_storage_.insert_or_assign(
          key, std::make_pair(c10::weak_intrusive_ptr<c10::StorageImpl>(
                                  c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(
                                      t.storage().unsafeGetStorageImpl())),
                              std::weak_ptr<Entry>(entry)));
      g.entries.push_back(entry);
      g.info.has_entries = true;
    }
  }
  return std::make_shared<OffloadedView>(entry, t, [this](Entry& e) { wait_reloaded(e); });
}

void ActivationOffloader::commit(int index, const std::vector<at::Tensor>& forced) {
  std::shared_ptr<Group> g;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    g = groups_.at(static_cast<size_t>(index));
    TORCH_CHECK(!g->info.committed, "actmem::ActivationOffloader::commit: group ", index, " (",
                g->info.name, ") committed twice");
    g->info.committed = true;
  }
  if (!g->info.offloads) return;
  // A group whose sizes follow the step's data (the MoE groups follow the routing; Megatron gives
  // them fresh host buffers every step) reuses buffers by size class instead (docs/moe.md).
  const bool size_classes = size_classes_ && g->info.buffers == HostBuffers::kSizeClasses;
  std::unordered_set<const void*> forced_storages;
  for (const auto& t : forced) {
    if (t.defined() && t.has_storage()) forced_storages.insert(t.storage().unsafeGetStorageImpl());
  }
  CopyEvent last;
  bool any = false;
  for (const auto& weak : g->entries) {
    auto entry = weak.lock();
    if (!entry) continue;
    std::lock_guard<std::mutex> lock(entry->mutex);
    entry->force_release =
        forced_storages.count(entry->device.storage().unsafeGetStorageImpl()) != 0;
    if (entry->force_release) {
      entry->forced_storage = c10::weak_intrusive_ptr<c10::StorageImpl>(
          c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(
              entry->device.storage().unsafeGetStorageImpl()));
      std::lock_guard<std::mutex> l(mutex_);
      pending_release_.push_back(entry);
    }
    entry->host = pool_.acquire(entry->nbytes, size_classes);
    transition(entry->state, OffloadState::kOffloading, "offload");
    std::weak_ptr<Entry> back = entry;
    entry->offloaded = d2h_.copy_async(entry->host, entry->device, nullptr, [back] {
      if (auto e = back.lock()) {
        std::lock_guard<std::mutex> l(e->mutex);
        e->offload_finished = true;
        e->device = at::Tensor();  // the device copy is released: the point of offloading
        // A reload may already be queued (offloading -> reloading); it stays so.
        if (e->state == OffloadState::kOffloading) {
          transition(e->state, OffloadState::kOffloaded, "offload finished");
        }
      }
    });
    last = entry->offloaded;
    any = true;
    std::lock_guard<std::mutex> l(mutex_);
    offloaded_bytes_ += entry->nbytes;
    if (schedule_.in_warmup()) {
      g->bytes += entry->nbytes;
      ++g->tensors;
    }
  }
  if (!any) return;
  std::vector<CopyEvent> wait;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    wait = schedule_.admit(g->info.name, last);
  }
  for (const auto& event : wait) {  // the in-flight cap: compute waits for the oldest
    const auto t0 = Clock::now();
    event.wait();
    wait_ns_.fetch_add(nanoseconds_since(t0));
  }
}

std::shared_ptr<ActivationOffloader::Group> ActivationOffloader::offloaded_group(int index) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (index < 0 || index >= static_cast<int>(groups_.size())) return nullptr;
  const auto& g = groups_[static_cast<size_t>(index)];
  return g->info.committed && g->info.offloads ? g : nullptr;
}

void ActivationOffloader::prefetch(int index) {
  const std::shared_ptr<Group> g = offloaded_group(index);
  if (!g) return;
  for (const auto& weak : g->entries) {
    auto entry = weak.lock();
    if (!entry) continue;
    std::lock_guard<std::mutex> lock(entry->mutex);
    if (entry->reload_queued) continue;
    transition(entry->state, OffloadState::kReloading, "reload");
    entry->reload_queued = true;
    // The reload buffer is device memory, allocated here on the compute side (on CUDA from the
    // H2D stream's pool and handed to the compute stream, Note [CUDA copy engine]).
    entry->reloaded = h2d_.empty_for_copy(entry->nbytes, entry->where);
    std::weak_ptr<Entry> back = entry;
    HostPool* pool = &pool_;
    entry->reloaded_event = h2d_.copy_async(
        entry->reloaded, entry->host, &entry->offloaded,
        [back, pool] {
          if (auto e = back.lock()) {
            std::lock_guard<std::mutex> l(e->mutex);
            TORCH_INTERNAL_ASSERT(e->offload_finished, "reload ran before its offload finished");
            pool->release(e->host);
            e->host = at::Tensor();
            transition(e->state, OffloadState::kReloaded, "reload finished");
          }
        },
        /*order_after_caller=*/false);  // its buffer is the H2D stream's own (empty_for_copy)
  }
}

void ActivationOffloader::wait_group(int index) {
  const std::shared_ptr<Group> g = offloaded_group(index);
  if (!g) return;
  prefetch(index);
  const auto t0 = Clock::now();
  for (const auto& weak : g->entries) {
    auto entry = weak.lock();
    if (!entry) continue;
    CopyEvent ev;
    {
      std::lock_guard<std::mutex> lock(entry->mutex);
      ev = entry->reloaded_event;
    }
    ev.wait();
  }
  wait_ns_.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

void ActivationOffloader::on_commit_backward(int index) {
  release_forced(/*wait=*/true);  // backward has begun: every forced release is due
  int target;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    target = schedule_.prefetch_target(index, BackwardPoint::kCommit,
                                       [this](int i) { return group_info(i); });
  }
  if (target >= 0) prefetch(target);
  wait_group(index);
}

void ActivationOffloader::on_start_backward(int index) {
  int target;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    target = schedule_.prefetch_target(index, BackwardPoint::kStart,
                                       [this](int i) { return group_info(i); });
  }
  if (target >= 0) prefetch(target);
}

void ActivationOffloader::wait_reloaded(Entry& entry) {
  {
    std::lock_guard<std::mutex> lock(entry.mutex);
    if (entry.state == OffloadState::kResident || entry.state == OffloadState::kReloaded) return;
  }
  const auto t0 = Clock::now();
  bool queued;
  {
    std::lock_guard<std::mutex> lock(entry.mutex);
    queued = entry.reload_queued;
  }
  if (!queued) {
    // Not prefetched: reload this entry's whole group (the rest is needed next anyway).
    TORCH_INTERNAL_ASSERT(entry.group >= 0, "offloaded entry without a group");
    prefetch(entry.group);
  }
  CopyEvent event;
  {
    std::lock_guard<std::mutex> lock(entry.mutex);
    event = entry.reloaded_event;
  }
  event.wait();
  wait_ns_.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

void ActivationOffloader::begin_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  // The previous step's backwards are done: its groups and forwards go (entries live on in
  // whatever autograd still holds, which no step reaches again).
  groups_.clear();
  forwards_.clear();
  offloaded_bytes_ = 0;
  largest_kept_ = {};
  wait_ns_ = 0;
  d2h_busy_at_step_ = d2h_.busy_seconds();
  h2d_busy_at_step_ = h2d_.busy_seconds();
  pool_.reset_peak();
}

void ActivationOffloader::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!schedule_.in_warmup()) return;
  // Each model chunk's last forward of the step: one micro-batch's groups, chunk by chunk.
  std::map<int64_t, size_t> last;
  for (size_t f = 0; f < forwards_.size(); ++f) last[forwards_[f].chunk] = f;
  std::map<int64_t, std::vector<GroupInfo>> infos;
  for (const auto& [chunk, f] : last) {
    const auto [begin, end] = forward_groups(f);
    for (size_t i = begin; i < end; ++i) infos[chunk].push_back(groups_[i]->info);
  }
  schedule_.end_warmup(infos);  // Note [Offload warmup and margin]
  summary_.clear();
  for (const auto& [chunk, f] : last) {
    const auto [begin, end] = forward_groups(f);
    for (size_t i = begin; i < end; ++i) {
      const Group& g = *groups_[i];
      if (!schedule_.offloads(chunk, i - begin, g.info.offloads, forwards_[f].backward_follows)) {
        continue;
      }
      auto it = std::find_if(summary_.begin(), summary_.end(),
                             [&](const OffloadSummaryRow& r) { return r.name == g.info.name; });
      if (it == summary_.end()) {
        summary_.push_back({g.info.name, 0, 0});
        it = summary_.end() - 1;
      }
      it->bytes += g.bytes;
      it->tensors += g.tensors;
    }
  }
}

bool ActivationOffloader::in_warmup() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return schedule_.in_warmup();
}

int ActivationOffloader::begin_forward(int64_t chunk, bool backward_follows) {
  release_forced(/*wait=*/true);
  std::lock_guard<std::mutex> lock(mutex_);
  forwards_.push_back({chunk, backward_follows, groups_.size()});
  by_storage_.clear();
  excluded_forward_.clear();
  schedule_.begin_forward();
  return static_cast<int>(forwards_.size()) - 1;
}

std::pair<size_t, size_t> ActivationOffloader::forward_groups(size_t f) const {
  const size_t end = f + 1 < forwards_.size() ? forwards_[f + 1].first_group : groups_.size();
  return {forwards_[f].first_group, end};
}

void ActivationOffloader::prefetch_backward_start(int forward) {
  std::vector<int> targets;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(forward >= 0 && forward < static_cast<int>(forwards_.size()),
                "actmem::ActivationOffloader::prefetch_backward_start: no forward ", forward,
                " in this step (", forwards_.size(), " so far)");
    const auto [begin, end] = forward_groups(static_cast<size_t>(forward));
    // The backward's first reads: the last group of each kind that moved something.
    for (const GroupKind kind : {GroupKind::kModule, GroupKind::kLayer}) {
      for (size_t i = end; i-- > begin;) {
        const GroupInfo& g = groups_[i]->info;
        if (g.kind == kind && g.committed && g.offloads && g.has_entries) {
          targets.push_back(static_cast<int>(i));
          break;
        }
      }
    }
  }
  for (const int i : targets) prefetch(i);
}

void ActivationOffloader::wait_idle() {
  // An empty copy queued behind everything else completes when the stream has drained.
  const at::Tensor none = at::empty({0}, at::kByte);
  d2h_.copy_async(none, none).wait();
  h2d_.copy_async(none, none).wait();
  release_forced(/*wait=*/true);
}

ActivationOffloader::KeptTensor ActivationOffloader::largest_below_threshold() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return largest_kept_;
}

OffloadStats ActivationOffloader::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  OffloadStats s;
  s.offloaded_bytes = offloaded_bytes_;
  s.wait_s = static_cast<double>(wait_ns_.load()) * 1e-9;
  s.d2h_busy_s = d2h_.busy_seconds() - d2h_busy_at_step_;
  s.h2d_busy_s = h2d_.busy_seconds() - h2d_busy_at_step_;
  return s;
}

// ---- OffloadRegion and the group start / commit autograd functions ----------------------------

struct OffloadBackward {
  static ActivationOffloader& owner(torch::autograd::AutogradContext* ctx) {
    auto handle = c10::static_intrusive_pointer_cast<ActivationOffloader::Handle>(
        ctx->saved_data.at("offloader").toCapsule());
    ActivationOffloader* owner = handle->owner.load();
    TORCH_CHECK(owner != nullptr,
                "actmem::ActivationOffloader: the backward reached an offload "
                "group whose offloader was destroyed; keep the offloader alive until the "
                "backward of every forward it captured has run");
    return *owner;
  }
  static void commit_backward(torch::autograd::AutogradContext* ctx) {
    owner(ctx).on_commit_backward(static_cast<int>(ctx->saved_data.at("index").toInt()));
  }
  static void start_backward(torch::autograd::AutogradContext* ctx) {
    owner(ctx).on_start_backward(static_cast<int>(ctx->saved_data.at("index").toInt()));
  }
};

namespace {

// Identity on its input; its backward tells the offloader the group's backward begins (at the
// commit, Megatron's group commit: wait for the reload) or is done (at the start, Megatron's
// group start: prefetch the next group backward needs).
template <BackwardPoint kPoint>
struct GroupBoundaryFunction : torch::autograd::Function<GroupBoundaryFunction<kPoint>> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const c10::IValue& handle, int64_t index) {
    ctx->saved_data["offloader"] = handle;
    ctx->saved_data["index"] = index;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (kPoint == BackwardPoint::kCommit) {
      OffloadBackward::commit_backward(ctx);
    } else {
      OffloadBackward::start_backward(ctx);
    }
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};
using GroupStartFunction = GroupBoundaryFunction<BackwardPoint::kStart>;
using GroupCommitFunction = GroupBoundaryFunction<BackwardPoint::kCommit>;

}  // namespace

OffloadRegion::OffloadRegion(ActivationOffloader* offloader, std::string name, GroupKind kind,
                             bool offload, HostBuffers buffers)
    : offloader_(offloader) {
  if (offloader_ == nullptr || !at::GradMode::is_enabled()) {
    offloader_ = nullptr;
    return;
  }
  index_ = offloader_->open_group(name, kind, offload, buffers);
}

OffloadRegion::OffloadRegion(ActivationOffloader* offloader, OffloadModule group,
                             HostBuffers buffers)
    : OffloadRegion(offloader, to_string(group), GroupKind::kModule, true, buffers) {}

OffloadRegion::~OffloadRegion() {
  end_capture();
  if (offloader_ != nullptr && !committed_) {
    try {
      offloader_->commit(index_, {});
    } catch (const std::exception& e) {
      TORCH_WARN("actmem::OffloadRegion: commit failed: ", e.what());
    }
  }
}

at::Tensor OffloadRegion::enter(const at::Tensor& x) {
  if (offloader_ == nullptr) return x;
  TORCH_CHECK(!hooks_.has_value() && !committed_, "actmem::OffloadRegion::enter: called twice");
  const at::Tensor started =
      GroupStartFunction::apply(x, c10::IValue::make_capsule(offloader_->handle_), index_);
  previous_ = offloader_->current_;
  offloader_->current_ = index_;
  hooks_.emplace(*offloader_);
  return started;
}

void OffloadRegion::end_capture() {
  if (!hooks_.has_value()) return;
  hooks_.reset();
  offloader_->current_ = previous_;
}

at::Tensor OffloadRegion::commit(const at::Tensor& y, const std::vector<at::Tensor>& forced) {
  if (offloader_ == nullptr) return y;
  TORCH_CHECK(!committed_, "actmem::OffloadRegion::commit: called twice");
  end_capture();
  committed_ = true;
  offloader_->commit(index_, forced);
  return GroupCommitFunction::apply(y, c10::IValue::make_capsule(offloader_->handle_), index_);
}

}  // namespace actmem
