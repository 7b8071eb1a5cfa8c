// grad_reducer.cpp — GradReducer: buckets, the hooks after the gradient accumulators, the
// asynchronous all-reduces (Note [Overlapped gradient reduction] in grad_reducer.h).
#include "actmem/parallel/grad_reducer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

namespace actmem {

namespace {
class GradReady : public torch::autograd::FunctionPostHook {
 public:
  explicit GradReady(std::function<void()> ready) : ready_(std::move(ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    ready_();
    return outputs;
  }

 private:
  std::function<void()> ready_;
};
}  // namespace

GradReducer::GradReducer(std::vector<Group> groups, int64_t bucket_size, double scale)
    : scale_(scale) {
  TORCH_CHECK(bucket_size > 0, "actmem::GradReducer: bucket_size must be positive, got ",
              bucket_size);
  for (auto& g : groups) {
    TORCH_CHECK(g.group != nullptr && g.params.size() == g.grads.size(),
                "actmem::GradReducer: each group needs a process group and one gradient per "
                "parameter");
    // Reverse order: backward's; a bucket closes at bucket_size elements or more.
    int64_t numel = 0;
    for (size_t k = g.params.size(); k-- > 0;) {
      if (buckets_.empty() || buckets_.back().group != g.group || numel >= bucket_size) {
        buckets_.push_back({});
        buckets_.back().group = g.group;
        numel = 0;
      }
      const size_t index = params_.size();
      params_.push_back(g.params[k]);
      grads_.push_back(g.grads[k]);
      bucket_of_.push_back(buckets_.size() - 1);
      buckets_.back().members.push_back(index);
      numel += g.params[k].numel();
    }
  }
  count_.assign(params_.size(), 0);
  golden_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].is_leaf() && params_[i].requires_grad(),
                "actmem::GradReducer: ", "expected leaf parameters that require grad");
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    acc->add_post_hook(std::make_unique<GradReady>([this, i] { on_grad_ready(i); }));
    accumulators_.push_back(std::move(acc));  // keeps the hooked accumulator alive
  }
}

GradReducer::~GradReducer() {
  // A step cut short (an exception) may leave collectives running: wait for them.
  for (auto& b : buckets_) {
    if (b.pending.pending()) {
      try {
        b.pending.wait();
      } catch (const std::exception& e) {
        TORCH_WARN("actmem::GradReducer: a gradient all-reduce failed: ", e.what());
      }
    }
  }
}

void GradReducer::set_last_microbatch(bool last) {
  std::lock_guard<std::mutex> lock(mutex_);
  last_microbatch_ = last;
}

void GradReducer::on_grad_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!last_microbatch_) return;
  ++count_[index];
  if (first_step_) return;  // counting only: Megatron's golden counts
  Bucket& b = buckets_[bucket_of_[index]];
  if (b.started) {
    late_ = true;  // its sum is already on the wire without this gradient
    return;
  }
  if (count_[index] == golden_[index] && ++b.ready == b.needed) {
    start(b);
    ++started_now_;
  }
}

void GradReducer::start(Bucket& b) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> flat;
  flat.reserve(b.members.size());
  for (const size_t i : b.members) flat.push_back(grads_[i].reshape({-1}));
  b.pending = start_group_all_reduce_sum(*b.group, at::cat(flat).mul_(scale_));
  b.started = true;
}

void GradReducer::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  at::NoGradGuard no_grad;
  if (first_step_) {
    golden_ = count_;
    first_step_ = false;
  }
  for (auto& b : buckets_) {
    if (!b.started) start(b);
  }
  for (auto& b : buckets_) {
    const at::Tensor reduced = b.pending.wait();
    int64_t offset = 0;
    for (const size_t i : b.members) {
      const int64_t n = grads_[i].numel();
      grads_[i].copy_(reduced.narrow(0, offset, n).view_as(grads_[i]));
      offset += n;
    }
  }
  const bool late = late_;
  late_ = false;
  started_in_backward_ = started_now_;
  started_now_ = 0;
  // Re-arm: what each bucket waits for is its parameters that became ready in the first step.
  std::fill(count_.begin(), count_.end(), 0);
  for (auto& b : buckets_) {
    b.started = false;
    b.ready = 0;
    b.needed = 0;
    for (const size_t i : b.members) b.needed += golden_[i] > 0 ? 1 : 0;
  }
  last_microbatch_ = true;
  TORCH_CHECK(!late,
              "actmem::GradReducer::finish: a parameter's gradient changed after its "
              "bucket's all-reduce had started (it became ready more often in this step's last "
              "backward than in the first step's); the data-parallel ranks' gradients may "
              "differ. Train without --overlap-grad-reduce for this model");
}

}  // namespace actmem
