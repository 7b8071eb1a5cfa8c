// pipeline.cpp — point-to-point communication between pipeline stages and the 1F1B schedule.
#include "actmem/pipeline.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#if ACTMEM_TORCH_VERSION_AT_LEAST(2, 0)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include <algorithm>
#include <utility>

namespace actmem {

namespace {
// Activations travel towards the last stage with one tag, gradients towards the first with
// another, so the two directions between a pair of neighbours can never be matched crosswise.
constexpr int kForwardTag = 0;
constexpr int kBackwardTag = 1;

// Gloo moves bytes; bfloat16 (which libtorch 1.13's Gloo refuses by type) travels as float16 of
// the same size (Note [bfloat16 on Gloo] in tensor_parallel.cpp).
at::Tensor wire(const at::Tensor& x) {
  return x.is_cpu() && x.scalar_type() == at::kBFloat16 ? x.view(at::kHalf) : x;
}
}  // namespace

PipelineP2P::PipelineP2P(const TensorParallelGroup& pipeline, std::vector<int64_t> shape,
                         at::TensorOptions options)
    : group_(&pipeline), shape_(std::move(shape)), options_(options) {
  TORCH_CHECK(group_->size == 1 || group_->pg, "actmem::PipelineP2P: a pipeline of ", group_->size,
              " stages needs a process group");
}

int64_t PipelineP2P::bytes() const {
  int64_t n = options_.dtype().itemsize();
  for (const int64_t d : shape_) n *= d;
  return n;
}

std::pair<at::Tensor, at::Tensor> PipelineP2P::communicate(const at::Tensor& send_next,
                                                           const at::Tensor& send_prev,
                                                           bool recv_prev, bool recv_next) const {
  RECORD_FUNCTION("actmem::pipeline_p2p", std::vector<c10::IValue>());
  at::Tensor from_prev, from_next;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  // Each op's tensor list must outlive its work; contiguous inputs (the schedule sends fresh
  // outputs and gradients, normally contiguous already).
  std::vector<std::vector<at::Tensor>> buffers;
  buffers.reserve(4);
  auto check = [this](const at::Tensor& x, const char* what) {
    TORCH_CHECK(x.sizes() == at::IntArrayRef(shape_) && x.scalar_type() == options_.dtype(),
                "actmem::PipelineP2P: ", what, " must be ", at::IntArrayRef(shape_), " ",
                options_.dtype(), " (the shape every stage boundary carries), got ", x.sizes(), " ",
                x.scalar_type());
  };
  const int rank = group_->rank;
  if (send_next.defined() && !is_last()) {
    check(send_next, "an activation sent forward");
    buffers.push_back({wire(send_next.contiguous())});
    works.push_back(group_->pg->send(buffers.back(), rank + 1, kForwardTag));
  }
  if (recv_prev && !is_first()) {
    from_prev = at::empty(shape_, options_);
    buffers.push_back({wire(from_prev)});
    works.push_back(group_->pg->recv(buffers.back(), rank - 1, kForwardTag));
  }
  if (send_prev.defined() && !is_first()) {
    check(send_prev, "a gradient sent backward");
    buffers.push_back({wire(send_prev.contiguous())});
    works.push_back(group_->pg->send(buffers.back(), rank - 1, kBackwardTag));
  }
  if (recv_next && !is_last()) {
    from_next = at::empty(shape_, options_);
    buffers.push_back({wire(from_next)});
    works.push_back(group_->pg->recv(buffers.back(), rank + 1, kBackwardTag));
  }
  for (auto& w : works) wait_and_release(std::move(w));
  return {from_prev, from_next};
}

int64_t one_f_one_b_in_flight(int64_t stage, int64_t stages, int64_t num_microbatches) {
  return std::min(stages - stage, num_microbatches);
}

// Note [1F1B]
// Megatron's forward_backward_pipelining_without_interleaving: stage r of p first runs
// W = min(p - r - 1, M) forwards (the warmup), so that by the time the last stage has its first
// loss every stage has work; then M - W times one forward followed by one backward (the oldest
// micro-batch's), exchanging the output and the next gradient in one communicate() call; then the
// W remaining backwards. Stage r holds at most min(p - r, M) micro-batches' activations at once:
// the first stage p of them (Korthikanti et al. 2022, sec. 4.2.3), the last one.
void run_one_f_one_b(const PipelineP2P& p2p, int64_t num_microbatches,
                     const PipelineForward& forward, const PipelineBackward& backward,
                     bool forward_only) {
  TORCH_CHECK(num_microbatches >= 1, "actmem::run_one_f_one_b: needs at least one micro-batch, got ",
              num_microbatches);
  if (forward_only) {
    for (int64_t m = 0; m < num_microbatches; ++m) {
      p2p.send_forward(forward(m, p2p.recv_forward()));
    }
    return;
  }
  const int64_t M = num_microbatches;
  const int64_t warmup = std::min<int64_t>(p2p.stages() - p2p.stage() - 1, M);
  const int64_t remaining = M - warmup;
  int64_t next_forward = 0, next_backward = 0;
  for (int64_t i = 0; i < warmup; ++i) {
    p2p.send_forward(forward(next_forward++, p2p.recv_forward()));
  }
  at::Tensor input;
  if (remaining > 0) input = p2p.recv_forward();
  for (int64_t i = 0; i < remaining; ++i) {
    at::Tensor output = forward(next_forward++, input);
    input = at::Tensor();
    at::Tensor output_grad = p2p.send_forward_recv_backward(output);
    output = at::Tensor();  // sent: its memory goes before the backward runs
    const at::Tensor input_grad = backward(next_backward++, output_grad);
    output_grad = at::Tensor();
    if (i == remaining - 1) {
      p2p.send_backward(input_grad);
    } else {
      input = p2p.send_backward_recv_forward(input_grad);
    }
  }
  for (int64_t i = 0; i < warmup; ++i) {
    p2p.send_backward(backward(next_backward++, p2p.recv_backward()));
  }
}

}  // namespace actmem
