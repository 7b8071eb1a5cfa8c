// copy_engine.cpp — CopyEvent, CopyStream (CPU worker threads; CUDA streams) and HostPool.
#include "actmem/offload/copy_engine.h"

#include "actmem/base/trace.h"
#include "actmem/memory/memory_tracker.h"

#include <ATen/ATen.h>
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
  TORCH_CHECK(device.is_cpu() || device.is_cuda(),
              "actmem::CopyStream: expected a cpu or cuda "
              "device, got ",
              device.str());
  if (device.is_cuda()) {
#ifdef ACTMEM_WITH_CUDA
    cuda_ = std::make_unique<CudaState>(device.has_index() ? device.index()
                                                           : c10::cuda::current_device());
#else
    TORCH_CHECK(false, "actmem::CopyStream: ", device.str(),
                " needs a build with CUDA "
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
  Job job{std::move(dst),     std::move(src),
          CopyEvent(),        after ? std::make_shared<CopyEvent>(*after) : nullptr,
          std::move(on_done), nullptr};
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
        const auto due =
            t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
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
    const c10::cuda::CUDAStream caller =
        c10::cuda::getCurrentCUDAStream(cuda_->stream.device_index());
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

int64_t HostPool::size_class(int64_t bytes) {
  return actmem::size_class(bytes);
}

at::Tensor HostPool::acquire(int64_t bytes, bool size_classes) {
  TORCH_CHECK(bytes > 0, "actmem::HostPool::acquire: expected a positive size, got ", bytes);
  const int64_t capacity = size_classes ? size_class(bytes) : bytes;
  at::Tensor buffer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& list = free_[capacity];
    if (!list.empty()) {
      buffer = std::move(list.back());
      list.pop_back();
    }
  }
  if (!buffer.defined() && pinned_) {
    // Page-locked host memory for DMA to and from a CUDA device (libtorch's pinned allocator).
    buffer = at::empty({capacity}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::lock_guard<std::mutex> lock(mutex_);
    owned_.insert(buffer.data_ptr());
    allocated_ += capacity;
    ++allocations_;
  }
  if (!buffer.defined()) {
    // Host memory is not device memory: allocate it outside the tracked CPU allocator.
    void* p = nullptr;
    TORCH_CHECK(posix_memalign(&p, 64, static_cast<size_t>(capacity)) == 0 && p != nullptr,
                "actmem::HostPool: the system refused ", capacity, " bytes of host memory");
    buffer = at::from_blob(
        p, {capacity}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
    std::lock_guard<std::mutex> lock(mutex_);
    owned_.insert(buffer.data_ptr());
    allocated_ += capacity;
    ++allocations_;
  }
  const int64_t now = in_use_.fetch_add(capacity) + capacity;
  int64_t seen = peak_.load();
  while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
  }
  // The first `bytes` of the buffer (the whole of it without size classes).
  return capacity == bytes ? buffer : buffer.narrow(0, 0, bytes);
}

void HostPool::release(const at::Tensor& buffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(buffer.defined() && owned_.count(buffer.data_ptr()) != 0,
              "actmem::HostPool::release: the buffer does not belong to this pool");
  // The whole buffer goes back under its capacity (its storage's size), whatever view was used.
  const auto capacity = static_cast<int64_t>(buffer.storage().nbytes());
  in_use_ -= capacity;
  at::Tensor whole = buffer.numel() == capacity ? buffer : buffer.as_strided({capacity}, {1}, 0);
  free_[capacity].push_back(std::move(whole));
}

}  // namespace actmem
