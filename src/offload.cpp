// offload.cpp — copy engine, host pool and the activation offloader.
#include "actmem/offload.h"

#include "actmem/trace.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <c10/util/Exception.h>
#ifdef ACTMEM_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <chrono>
#include <cstdlib>
#include <random>

namespace actmem {

using Clock = std::chrono::steady_clock;

// ---- CopyEvent --------------------------------------------------------------------------------

CopyEvent::CopyEvent() : state_(std::make_shared<State>()) {}

void CopyEvent::wait() const {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->cv.wait(lock, [this] { return state_->done; });
  if (state_->error) std::rethrow_exception(state_->error);
}

bool CopyEvent::ready() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

void CopyEvent::mark_done(std::exception_ptr error) const {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->done = true;
    state_->error = std::move(error);
  }
  state_->cv.notify_all();
}

// ---- CopyStream -------------------------------------------------------------------------------

// Note [CUDA copy engine]
// On a CUDA device each CopyStream owns a CUDA stream from libtorch's pool. copy_async(), on the
// compute thread, records an event on the caller's current stream: everything queued so far
// (the kernels that produced a D2H source, or that last used the memory an H2D destination was
// just allocated from). The worker makes its copy stream wait for that event on the GPU, issues
// a non-blocking copy between device memory and a pinned host buffer, records a completion
// event and synchronizes it before running on_done and completing the job's CopyEvent. So a
// completed CopyEvent means the bytes have arrived, and the job's references (record_stream's
// role) are dropped only after the GPU finished with them: the caching allocator cannot hand the
// source's block to another kernel while the copy still reads it. The compute thread blocks in
// CopyEvent::wait() only where the CPU engine would (a reload not yet finished), and compute and
// copies overlap on the GPU otherwise. Reloads are the exception to the producer event: their
// buffer comes from the H2D stream's own pool (empty_for_copy) and is recorded as used by the
// compute stream, so a prefetch starts at once instead of behind the backward kernels already
// queued (which would serialise every reload with compute). Compiled only with ACTMEM_WITH_CUDA.
struct CopyStream::CudaState {
#ifdef ACTMEM_WITH_CUDA
  explicit CudaState(c10::DeviceIndex index)
      : stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)) {}
  c10::cuda::CUDAStream stream;
#endif
};

CopyStream::CopyStream(std::string name, double bytes_per_second, c10::Device device)
    : name_(std::move(name)), bytes_per_second_(bytes_per_second), device_(device) {
  TORCH_CHECK(bytes_per_second >= 0, "actmem::CopyStream: bandwidth must be >= 0, got ",
              bytes_per_second);
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "actmem::CopyStream: expected a cpu or cuda "
              "device, got ", device.str());
  if (device.is_cuda()) {
#ifdef ACTMEM_WITH_CUDA
    cuda_ = std::make_unique<CudaState>(device.has_index() ? device.index()
                                                           : c10::cuda::current_device());
#else
    TORCH_CHECK(false, "actmem::CopyStream: ", device.str(), " needs a build with CUDA "
                "(ACTMEM_CUDA=ON)");
#endif
  }
  worker_ = std::thread([this] { run(); });
}

CopyStream::~CopyStream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

CopyEvent CopyStream::copy_async(at::Tensor dst, at::Tensor src, const CopyEvent* after,
                                 std::function<void()> on_done, bool order_after_caller) {
  TORCH_CHECK(dst.nbytes() == src.nbytes(), "actmem::CopyStream::copy_async: ", name_,
              ": destination has ", dst.nbytes(), " bytes, source ", src.nbytes());
  Job job{std::move(dst), std::move(src), CopyEvent(),
          after ? std::make_shared<CopyEvent>(*after) : nullptr, std::move(on_done), nullptr};
#ifdef ACTMEM_WITH_CUDA
  if (cuda_ && order_after_caller) {
    // Note [CUDA copy engine]: order the copy after the caller's stream's work so far.
    auto ready = std::make_shared<at::cuda::CUDAEvent>();
    ready->record(c10::cuda::getCurrentCUDAStream(cuda_->stream.device_index()));
    job.producer_event = ready;
  }
#endif
  CopyEvent event = job.event;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  return event;
}

void CopyStream::run() {
#ifdef ACTMEM_WITH_CUDA
  if (cuda_) c10::cuda::set_device(cuda_->stream.device_index());  // this thread's device
#endif
  std::mt19937 rng(12345);
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop requested and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    std::exception_ptr error;
    try {
      if (job.after) job.after->wait();  // e.g. a reload waits for its offload (Megatron #7398)
      if (const int jitter = jitter_us_.load(); jitter > 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % jitter));
      }
      const auto t0 = Clock::now();
      copy(job);
      if (bytes_per_second_ > 0) {
        // Emulated link: the copy takes at least bytes / bandwidth.
        const auto due = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                                  static_cast<double>(job.src.nbytes()) / bytes_per_second_));
        std::this_thread::sleep_until(due);
      }
      const auto t1 = Clock::now();
      busy_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
      if (TraceRecorder* trace = active_trace()) {
        trace->span(name_, "copy " + std::to_string(job.src.nbytes()) + " B", t0, t1,
                    "{\"bytes\": " + std::to_string(job.src.nbytes()) + "}");
      }
      // Drop this job's references before on_done publishes completion: afterwards the compute
      // thread may free or re-point the source's storage, and must not race with our release.
      job.dst = at::Tensor();
      job.src = at::Tensor();
      if (job.on_done) job.on_done();
    } catch (...) {
      error = std::current_exception();
    }
    job.dst = at::Tensor();
    job.src = at::Tensor();
    job.event.mark_done(error);
  }
}

at::Tensor CopyStream::empty_for_copy(int64_t bytes, const c10::Device& device) {
  const auto options = at::TensorOptions().dtype(at::kByte).device(device);
#ifdef ACTMEM_WITH_CUDA
  if (cuda_ && device.is_cuda()) {
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(cuda_->stream.device_index());
    at::Tensor buffer;
    {
      c10::cuda::CUDAStreamGuard guard(cuda_->stream);  // the block belongs to this stream
      buffer = at::empty({bytes}, options);
    }
    // Freed later, the block waits for the caller's stream's work at that time.
    c10::cuda::CUDACachingAllocator::recordStream(buffer.storage().data_ptr(), caller);
    return buffer;
  }
#endif
  return at::empty({bytes}, options);
}

void CopyStream::copy(Job& job) {
#ifdef ACTMEM_WITH_CUDA
  if (cuda_) {
    c10::cuda::CUDAStreamGuard guard(cuda_->stream);
    if (job.producer_event) {
      static_cast<at::cuda::CUDAEvent*>(job.producer_event.get())->block(cuda_->stream);
    }
    job.dst.copy_(job.src, /*non_blocking=*/true);
    at::cuda::CUDAEvent done;
    done.record(cuda_->stream);
    done.synchronize();  // the worker waits for the GPU, the compute thread does not
    return;
  }
#endif
  job.dst.copy_(job.src);
}

// ---- HostPool ---------------------------------------------------------------------------------

HostPool::~HostPool() = default;

at::Tensor HostPool::acquire(int64_t bytes) {
  TORCH_CHECK(bytes > 0, "actmem::HostPool::acquire: expected a positive size, got ", bytes);
  at::Tensor buffer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& list = free_[bytes];
    if (!list.empty()) {
      buffer = std::move(list.back());
      list.pop_back();
    }
  }
  if (!buffer.defined() && pinned_) {
    // Page-locked host memory for DMA to and from a CUDA device (libtorch's pinned allocator).
    buffer = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::lock_guard<std::mutex> lock(mutex_);
    owned_.insert(buffer.data_ptr());
    allocated_ += bytes;
    ++allocations_;
  }
  if (!buffer.defined()) {
    // Host memory is not device memory: allocate it outside the tracked CPU allocator.
    void* p = nullptr;
    TORCH_CHECK(posix_memalign(&p, 64, static_cast<size_t>(bytes)) == 0 && p != nullptr,
                "actmem::HostPool: the system refused ", bytes, " bytes of host memory");
    buffer = at::from_blob(p, {bytes}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
    std::lock_guard<std::mutex> lock(mutex_);
    owned_.insert(buffer.data_ptr());
    allocated_ += bytes;
    ++allocations_;
  }
  const int64_t now = in_use_.fetch_add(bytes) + bytes;
  int64_t seen = peak_.load();
  while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
  }
  return buffer;
}

void HostPool::release(const at::Tensor& buffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(buffer.defined() && owned_.count(buffer.data_ptr()) != 0,
              "actmem::HostPool::release: the buffer does not belong to this pool");
  in_use_ -= static_cast<int64_t>(buffer.nbytes());
  free_[static_cast<int64_t>(buffer.nbytes())].push_back(buffer);
}

// ---- ActivationOffloader ----------------------------------------------------------------------

const char* to_string(ActivationOffloader::State s) {
  switch (s) {
    case ActivationOffloader::State::kResident: return "resident";
    case ActivationOffloader::State::kOffloading: return "offloading";
    case ActivationOffloader::State::kOffloaded: return "offloaded";
    case ActivationOffloader::State::kReloading: return "reloading";
    case ActivationOffloader::State::kReloaded: return "reloaded";
  }
  return "?";
}

// Note [Offload state machine]
// One Entry per device storage saved in a group (views of one storage share it, so a storage is
// copied once, and a storage saved again by a later group of the same forward reuses the entry).
// Transitions, each checked under the entry's mutex:
//   resident   -> offloading  commit(): D2H copy queued; the copy job holds the device bytes
//   offloading -> offloaded   D2H worker, after the copy: its reference to the device bytes is
//                             dropped; a forced tensor's storage is then freed by the compute
//                             thread at its next offload call, even if other references remain
//                             (the worker never touches a storage the compute thread may free)
//   offloading -> reloading   prefetch()/unpack() before the D2H finished: the H2D job waits the
//   offloaded  -> reloading   offload event first, so a reload never reads a half-written buffer
//                             (Megatron's race, Megatron-LM issue #7398, fixed)
//   reloading  -> reloaded    H2D worker, after the copy: the host buffer returns to the pool
// An unpack in any state other than resident or reloaded waits (offload_wait_s counts it).
struct ActivationOffloader::Entry {
  std::mutex mutex;
  State state = State::kResident;
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
};

struct ActivationOffloader::Group {
  std::string name;
  bool apply_margin = true;
  bool offload = true;
  bool committed = false;
  int64_t bytes = 0, tensors = 0;
  std::vector<std::weak_ptr<Entry>> entries;  // handles (autograd's saved variables) own them
};

namespace {

void expect_state(ActivationOffloader::State actual,
                  std::initializer_list<ActivationOffloader::State> allowed, const char* action) {
  for (auto s : allowed) {
    if (actual == s) return;
  }
  TORCH_CHECK(false, "actmem::ActivationOffloader: illegal transition: ", action, " from state ",
              to_string(actual));
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
      bytes = entry_->state == ActivationOffloader::State::kResident ? entry_->device
                                                                     : entry_->reloaded;
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

ActivationOffloader::ActivationOffloader(int64_t min_elements, double bytes_per_second,
                                         int max_inflight, c10::Device device)
    : min_elements_(min_elements),
      max_inflight_(max_inflight),
      device_(resolved(device)),
      pool_(/*pinned=*/device.is_cuda()),
      d2h_("d2h", bytes_per_second, device),
      h2d_("h2d", bytes_per_second, device) {
  TORCH_CHECK(min_elements >= 0, "actmem::ActivationOffloader: min_offloaded_tensor_size must be "
              ">= 0, got ", min_elements);
}

ActivationOffloader::~ActivationOffloader() = default;

void ActivationOffloader::exclude(const at::Tensor& t) { weakly_insert(excluded_, t); }

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

int ActivationOffloader::start_group(const std::string& name, bool apply_margin) {
  release_forced(/*wait=*/false);
  std::lock_guard<std::mutex> lock(mutex_);
  auto g = std::make_shared<Group>();
  g->name = name;
  g->apply_margin = apply_margin;
  const size_t index = groups_.size();
  // Warmup offloads everything; afterwards the decisions of the warmup step hold, by position.
  g->offload = warmup_ || index >= decisions_.size() || decisions_[index];
  groups_.push_back(std::move(g));
  return static_cast<int>(index);
}

ActivationOffloader::CaptureScope::CaptureScope(ActivationOffloader& owner, int index)
    : owner_(owner), previous_(owner.current_), hooks_(owner) {
  owner_.current_ = index;
}

ActivationOffloader::CaptureScope::~CaptureScope() { owner_.current_ = previous_; }

std::unique_ptr<ActivationOffloader::GroupScope> ActivationOffloader::group(const std::string& name) {
  return std::make_unique<GroupScope>(*this, start_group(name, /*apply_margin=*/false));
}

ActivationOffloader::GroupScope::GroupScope(ActivationOffloader& owner, int index)
    : owner_(owner), index_(index), capture_(owner, index) {}

ActivationOffloader::GroupScope::~GroupScope() {
  try {
    owner_.commit(index_);
  } catch (const std::exception& e) {
    TORCH_WARN("actmem::ActivationOffloader: commit failed: ", e.what());
  }
}

std::shared_ptr<PackedTensor> ActivationOffloader::pack(const at::Tensor& t) {
  if (current_ < 0 || !t.defined() || !t.has_storage()) return nullptr;
  if (t.is_leaf() && t.requires_grad()) return nullptr;  // a parameter
  if (t.device() != device_) return nullptr;  // e.g. a CPU tensor in CUDA training
  if (t.numel() < min_elements_) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (t.numel() > largest_kept_.numel) {
      largest_kept_ = {t.numel(), t.sizes().vec(), std::string(c10::toString(t.scalar_type())),
                       groups_.at(current_)->name};
    }
    return nullptr;
  }
  const void* key = t.storage().unsafeGetStorageImpl();
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (weakly_contains(excluded_, key) || weakly_contains(excluded_forward_, key)) return nullptr;
    auto it = by_storage_.find(key);
    if (it != by_storage_.end() && !it->second.first.expired()) entry = it->second.second.lock();
    if (!entry) {
      Group& g = *groups_.at(current_);
      if (!g.offload) return nullptr;  // kept on the device by the margin rule
      entry = std::make_shared<Entry>();
      entry->nbytes = static_cast<int64_t>(t.storage().nbytes());
      entry->where = t.device();
      entry->device = at::empty({0}, t.options().dtype(at::kByte))
                          .set_(t.storage(), 0, {entry->nbytes}, {1});
      by_storage_.insert_or_assign(
          key, std::make_pair(c10::weak_intrusive_ptr<c10::StorageImpl>(
                                  c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(
                                      t.storage().unsafeGetStorageImpl())),
                              std::weak_ptr<Entry>(entry)));
      g.entries.push_back(entry);
    }
  }
  return std::make_shared<OffloadedView>(entry, t, [this](Entry& e) { wait_reloaded(e); });
}

void ActivationOffloader::commit(int index, const std::vector<at::Tensor>& forced) {
  std::shared_ptr<Group> g;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    g = groups_.at(index);
    TORCH_CHECK(!g->committed, "actmem::ActivationOffloader::commit: group ", index, " (", g->name,
                ") committed twice");
    g->committed = true;
  }
  if (!g->offload) return;
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
    expect_state(entry->state, {State::kResident}, "offload");
    entry->force_release =
        forced_storages.count(entry->device.storage().unsafeGetStorageImpl()) != 0;
    if (entry->force_release) {
      entry->forced_storage = c10::weak_intrusive_ptr<c10::StorageImpl>(
          c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(
              entry->device.storage().unsafeGetStorageImpl()));
      std::lock_guard<std::mutex> l(mutex_);
      pending_release_.push_back(entry);
    }
    entry->host = pool_.acquire(entry->nbytes);
    entry->state = State::kOffloading;
    std::weak_ptr<Entry> back = entry;
    entry->offloaded = d2h_.copy_async(entry->host, entry->device, nullptr, [back] {
      if (auto e = back.lock()) {
        std::lock_guard<std::mutex> l(e->mutex);
        e->offload_finished = true;
        e->device = at::Tensor();  // the device copy is released: the point of offloading
        if (e->state == State::kOffloading) e->state = State::kOffloaded;
      }
    });
    last = entry->offloaded;
    any = true;
    std::lock_guard<std::mutex> l(mutex_);
    offloaded_bytes_ += entry->nbytes;
    if (warmup_) {
      g->bytes += entry->nbytes;
      ++g->tensors;
    }
  }
  if (any && max_inflight_ >= 0) {
    // Cap on offloads in flight per group name: compute waits for the oldest beyond it.
    std::deque<CopyEvent>* pending;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending = &inflight_[g->name];
      pending->push_back(last);
    }
    while (static_cast<int>(pending->size()) > max_inflight_) {
      const auto t0 = Clock::now();
      pending->front().wait();
      wait_ns_.fetch_add(
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
      pending->pop_front();
    }
  }
}

void ActivationOffloader::prefetch(int index) {
  std::shared_ptr<Group> g;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (index < 0 || index >= static_cast<int>(groups_.size())) return;
    g = groups_[index];
  }
  if (!g->committed || !g->offload) return;
  for (const auto& weak : g->entries) {
    auto entry = weak.lock();
    if (!entry) continue;
    std::lock_guard<std::mutex> lock(entry->mutex);
    if (entry->reload_queued) continue;
    expect_state(entry->state, {State::kOffloading, State::kOffloaded}, "reload");
    entry->state = State::kReloading;
    entry->reload_queued = true;
    // The reload buffer is device memory, allocated here on the compute side (on CUDA from the
    // H2D stream's pool and handed to the compute stream, Note [CUDA copy engine]).
    entry->reloaded = h2d_.empty_for_copy(entry->nbytes, entry->where);
    std::weak_ptr<Entry> back = entry;
    HostPool* pool = &pool_;
    entry->reloaded_event = h2d_.copy_async(entry->reloaded, entry->host, &entry->offloaded, [back, pool] {
      if (auto e = back.lock()) {
        std::lock_guard<std::mutex> l(e->mutex);
        TORCH_INTERNAL_ASSERT(e->offload_finished, "reload ran before its offload finished");
        pool->release(e->host);
        e->host = at::Tensor();
        e->state = State::kReloaded;
      }
    }, /*order_after_caller=*/false);  // its buffer is the H2D stream's own (empty_for_copy)
  }
}

void ActivationOffloader::wait_group(int index) {
  std::shared_ptr<Group> g;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (index < 0 || index >= static_cast<int>(groups_.size())) return;
    g = groups_[index];
  }
  if (!g->committed || !g->offload) return;
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
  wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

void ActivationOffloader::on_commit_backward(int index) {
  release_forced(/*wait=*/true);  // backward has begun: every forced release is due
  wait_group(index);
}

void ActivationOffloader::on_start_backward(int index) {
  // One group ahead: the closest earlier group that offloaded is the next one backward needs.
  int target = -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = std::min(index, static_cast<int>(groups_.size())) - 1; i >= 0 && target < 0; --i) {
      if (groups_[i]->committed && groups_[i]->offload && !groups_[i]->entries.empty()) target = i;
    }
  }
  if (target >= 0) prefetch(target);
}

void ActivationOffloader::wait_reloaded(Entry& entry) {
  {
    std::lock_guard<std::mutex> lock(entry.mutex);
    if (entry.state == State::kResident || entry.state == State::kReloaded) return;
  }
  const auto t0 = Clock::now();
  bool queued;
  {
    std::lock_guard<std::mutex> lock(entry.mutex);
    queued = entry.reload_queued;
  }
  if (!queued) {
    // Not prefetched: reload this entry's whole group (the rest is needed next anyway).
    int index = -1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 0; i < groups_.size() && index < 0; ++i) {
        for (const auto& w : groups_[i]->entries) {
          if (w.lock().get() == &entry) index = static_cast<int>(i);
        }
      }
    }
    TORCH_INTERNAL_ASSERT(index >= 0, "offloaded entry without a group");
    prefetch(index);
  }
  CopyEvent event;
  {
    std::lock_guard<std::mutex> lock(entry.mutex);
    event = entry.reloaded_event;
  }
  event.wait();
  wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

void ActivationOffloader::begin_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  offloaded_bytes_ = 0;
  largest_kept_ = {};
  wait_ns_ = 0;
  d2h_busy_at_step_ = d2h_.busy_seconds();
  h2d_busy_at_step_ = h2d_.busy_seconds();
  pool_.reset_peak();
}

void ActivationOffloader::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!warmup_) return;
  // Note [Offload margin]: for each group name, the group the backward reaches first (the last
  // one in forward order) would be reloaded as soon as it finished offloading: keep it on the
  // device (Megatron's post_warmup_callback). Decisions are fixed by forward position.
  warmup_ = false;
  decisions_.assign(groups_.size(), true);
  std::map<std::string, size_t> last;
  for (size_t i = 0; i < groups_.size(); ++i) {
    if (groups_[i]->apply_margin) last[groups_[i]->name] = i;
  }
  for (const auto& [name, i] : last) decisions_[i] = false;
  summary_.clear();
  for (size_t i = 0; i < groups_.size(); ++i) {
    if (!decisions_[i]) continue;
    const auto& g = *groups_[i];
    auto it = std::find_if(summary_.begin(), summary_.end(),
                           [&](const OffloadSummaryRow& r) { return r.name == g.name; });
    if (it == summary_.end()) {
      summary_.push_back({g.name, 0, 0});
      it = summary_.end() - 1;
    }
    it->bytes += g.bytes;
    it->tensors += g.tensors;
  }
}

void ActivationOffloader::begin_forward() {
  release_forced(/*wait=*/true);
  std::lock_guard<std::mutex> lock(mutex_);
  groups_.clear();
  by_storage_.clear();
  excluded_forward_.clear();
  inflight_.clear();
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

// ---- group start / commit as identity autograd functions --------------------------------------

namespace {
ActivationOffloader* offloader_of(torch::autograd::AutogradContext* ctx) {
  return reinterpret_cast<ActivationOffloader*>(ctx->saved_data.at("offloader").toInt());
}

struct GroupStartFunction : torch::autograd::Function<GroupStartFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t offloader, int64_t index) {
    ctx->saved_data["offloader"] = offloader;
    ctx->saved_data["index"] = index;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    offloader_of(ctx)->on_start_backward(static_cast<int>(ctx->saved_data.at("index").toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

struct GroupCommitFunction : torch::autograd::Function<GroupCommitFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y,
                            int64_t offloader, int64_t index, const std::vector<at::Tensor>& forced) {
    ctx->saved_data["offloader"] = offloader;
    ctx->saved_data["index"] = index;
    reinterpret_cast<ActivationOffloader*>(offloader)->commit(static_cast<int>(index), forced);
    return y.view_as(y);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    offloader_of(ctx)->on_commit_backward(static_cast<int>(ctx->saved_data.at("index").toInt()));
    return {grads[0], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor offload_group_start(ActivationOffloader& offloader, const at::Tensor& x, int index) {
  return GroupStartFunction::apply(x, reinterpret_cast<int64_t>(&offloader), index);
}

at::Tensor offload_group_commit(ActivationOffloader& offloader, const at::Tensor& y, int index,
                                const std::vector<at::Tensor>& forced) {
  return GroupCommitFunction::apply(y, reinterpret_cast<int64_t>(&offloader), index, forced);
}

}  // namespace actmem
