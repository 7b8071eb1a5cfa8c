// offload.cpp — copy engine, host pool and the activation offloader.
#include "actmem/offload.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

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

CopyStream::CopyStream(std::string name, double bytes_per_second)
    : name_(std::move(name)), bytes_per_second_(bytes_per_second) {
  TORCH_CHECK(bytes_per_second >= 0, "actmem::CopyStream: bandwidth must be >= 0, got ",
              bytes_per_second);
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
                                 std::function<void()> on_done) {
  TORCH_CHECK(dst.nbytes() == src.nbytes(), "actmem::CopyStream::copy_async: ", name_,
              ": destination has ", dst.nbytes(), " bytes, source ", src.nbytes());
  Job job{std::move(dst), std::move(src), CopyEvent(),
          after ? std::make_shared<CopyEvent>(*after) : nullptr, std::move(on_done)};
  CopyEvent event = job.event;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  return event;
}

void CopyStream::run() {
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
      job.dst.copy_(job.src);
      if (bytes_per_second_ > 0) {
        // Emulated link: the copy takes at least bytes / bandwidth.
        const auto due = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                                  static_cast<double>(job.src.nbytes()) / bytes_per_second_));
        std::this_thread::sleep_until(due);
      }
      busy_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
      if (job.on_done) job.on_done();
    } catch (...) {
      error = std::current_exception();
    }
    job.dst = at::Tensor();
    job.src = at::Tensor();  // release the source before signalling: its memory may be freed now
    job.event.mark_done(error);
  }
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
// copied once). Transitions, each checked under the entry's mutex:
//   resident   -> offloading  commit(): D2H copy queued; the copy job holds the device bytes
//   offloading -> offloaded   D2H worker, after the copy: the device bytes are dropped
//   offloading -> reloading   prefetch()/unpack() before the D2H finished: the H2D job waits the
//   offloaded  -> reloading   offload event first, so a reload never reads a half-written buffer
//   reloading  -> reloaded    H2D worker, after the copy: the host buffer returns to the pool
// An unpack in any other state than reloaded waits (offload_wait_s counts it).
struct ActivationOffloader::Entry {
  std::mutex mutex;
  State state = State::kResident;
  bool offload_finished = false;
  int64_t nbytes = 0;
  at::Tensor device;    // uint8 alias of the whole device storage while resident/offloading
  at::Tensor host;      // pool buffer while offloading..reloading
  at::Tensor reloaded;  // uint8 device buffer after the reload
  CopyEvent offloaded, reloaded_event;
  bool reload_queued = false;
};

struct ActivationOffloader::Group {
  std::vector<std::weak_ptr<Entry>> entries;  // handles (autograd's saved variables) own them
  std::map<const void*, std::weak_ptr<Entry>> by_storage;
  bool committed = false;
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

class OffloadedView final : public PackedTensor {
 public:
  OffloadedView(ActivationOffloader* owner, std::shared_ptr<ActivationOffloader::Entry> entry,
                const at::Tensor& t, std::function<void(ActivationOffloader::Entry&)> wait)
      : entry_(std::move(entry)),
        options_(t.options()),
        sizes_(t.sizes().vec()),
        strides_(t.strides().vec()),
        offset_(t.storage_offset()),
        wait_(std::move(wait)) {
    (void)owner;
  }
  at::Tensor unpack() override {
    wait_(*entry_);
    at::Tensor bytes;
    {
      std::lock_guard<std::mutex> lock(entry_->mutex);
      // An entry that was never offloaded (group not committed) still holds its device bytes.
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

ActivationOffloader::ActivationOffloader(int64_t min_elements, double bytes_per_second)
    : min_elements_(min_elements), d2h_("d2h", bytes_per_second), h2d_("h2d", bytes_per_second) {
  TORCH_CHECK(min_elements >= 0, "actmem::ActivationOffloader: min_offloaded_tensor_size must be "
              ">= 0, got ", min_elements);
}

ActivationOffloader::~ActivationOffloader() = default;

void ActivationOffloader::exclude(const at::Tensor& t) {
  if (t.defined() && t.has_storage()) excluded_.insert(t.storage().unsafeGetStorageImpl());
}

std::unique_ptr<ActivationOffloader::GroupScope> ActivationOffloader::group() {
  std::lock_guard<std::mutex> lock(mutex_);
  groups_.push_back(std::make_shared<Group>());
  return std::make_unique<GroupScope>(*this, static_cast<int>(groups_.size()) - 1);
}

ActivationOffloader::GroupScope::GroupScope(ActivationOffloader& owner, int index)
    : owner_(owner), index_(index), hooks_(owner) {
  owner_.current_ = index;
}

ActivationOffloader::GroupScope::~GroupScope() {
  owner_.current_ = -1;
  owner_.commit(index_);
}

std::shared_ptr<PackedTensor> ActivationOffloader::pack(const at::Tensor& t) {
  if (current_ < 0 || !t.defined() || !t.has_storage() || t.numel() < min_elements_) return nullptr;
  if (t.is_leaf() && t.requires_grad()) return nullptr;  // a parameter
  const void* key = t.storage().unsafeGetStorageImpl();
  if (excluded_.count(key) != 0) return nullptr;
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Group& g = *groups_[current_];
    auto it = g.by_storage.find(key);
    if (it != g.by_storage.end()) entry = it->second.lock();
    if (!entry) {
      entry = std::make_shared<Entry>();
      entry->nbytes = static_cast<int64_t>(t.storage().nbytes());
      entry->device = at::empty({0}, t.options().dtype(at::kByte))
                          .set_(t.storage(), 0, {entry->nbytes}, {1});
      g.by_storage[key] = entry;
      g.entries.push_back(entry);
    }
  }
  return std::make_shared<OffloadedView>(this, entry, t, [this](Entry& e) { wait_reloaded(e); });
}

void ActivationOffloader::commit(int index) {
  std::shared_ptr<Group> g;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    g = groups_.at(index);
    g->committed = true;
    g->by_storage.clear();  // a later group saving the same storage gets its own entry
  }
  for (const auto& weak : g->entries) {
    auto entry = weak.lock();
    if (!entry) continue;
    std::lock_guard<std::mutex> lock(entry->mutex);
    expect_state(entry->state, {State::kResident}, "offload");
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
    {
      std::lock_guard<std::mutex> l(mutex_);
      offloaded_bytes_ += entry->nbytes;
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
  if (!g->committed) return;
  for (const auto& weak : g->entries) {
    auto entry = weak.lock();
    if (!entry) continue;
    std::lock_guard<std::mutex> lock(entry->mutex);
    if (entry->reload_queued) continue;
    expect_state(entry->state, {State::kOffloading, State::kOffloaded}, "reload");
    entry->state = State::kReloading;
    entry->reload_queued = true;
    // The reload buffer is device memory, allocated here on the compute side.
    entry->reloaded = at::empty({entry->nbytes}, at::TensorOptions().dtype(at::kByte));
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
    });
  }
}

void ActivationOffloader::wait_reloaded(Entry& entry) {
  const auto t0 = Clock::now();
  CopyEvent event;
  {
    std::lock_guard<std::mutex> lock(entry.mutex);
    if (entry.state == State::kResident || entry.state == State::kReloaded) return;
  }
  // Not prefetched (or still in flight): make sure a reload is queued, then wait for it.
  bool queued;
  {
    std::lock_guard<std::mutex> lock(entry.mutex);
    queued = entry.reload_queued;
  }
  if (!queued) {
    // Find this entry's group and reload all of it (the rest is needed next anyway).
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
  {
    std::lock_guard<std::mutex> lock(entry.mutex);
    event = entry.reloaded_event;
  }
  event.wait();
  wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

void ActivationOffloader::begin_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  groups_.clear();
  offloaded_bytes_ = 0;
  wait_ns_ = 0;
  d2h_busy_at_step_ = d2h_.busy_seconds();
  h2d_busy_at_step_ = h2d_.busy_seconds();
  pool_.reset_peak();
}

void ActivationOffloader::begin_forward() {
  std::lock_guard<std::mutex> lock(mutex_);
  groups_.clear();
}

OffloadStats ActivationOffloader::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  OffloadStats s;
  s.offloaded_bytes = offloaded_bytes_;
  s.wait_s = wait_ns_.load() * 1e-9;
  s.d2h_busy_s = d2h_.busy_seconds() - d2h_busy_at_step_;
  s.h2d_busy_s = h2d_.busy_seconds() - h2d_busy_at_step_;
  return s;
}

}  // namespace actmem
