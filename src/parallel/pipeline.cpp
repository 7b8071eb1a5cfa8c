// pipeline.cpp — point-to-point communication between pipeline stages and the 1F1B schedule.
#include "actmem/parallel/pipeline.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <deque>
#include <utility>

namespace actmem {

namespace {
// Activations travel towards the last stage with one tag, gradients towards the first with
// another, so the two directions between a pair of neighbours can never be matched crosswise.
constexpr int kForwardTag = 0;
constexpr int kBackwardTag = 1;
}  // namespace

PipelineP2P::PipelineP2P(const TensorParallelGroup& pipeline, std::vector<int64_t> shape,
                         at::TensorOptions options, bool ring)
    : group_(&pipeline), shape_(std::move(shape)), options_(options), ring_(ring) {
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
  const int rank = group_->rank, size = group_->size;
  // In a ring (the interleaved schedule) the last stage sends on to the first; with p = 2 the
  // previous and the next stage are one rank, kept apart by the two tags.
  const bool has_next = ring_ ? size > 1 : !is_last();
  const bool has_prev = ring_ ? size > 1 : !is_first();
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  if (send_next.defined() && has_next) {
    check(send_next, "an activation sent forward");
    buffers.push_back({send_next.contiguous()});
    works.push_back(group_->pg->send(buffers.back(), next, kForwardTag));
  }
  if (recv_prev && has_prev) {
    from_prev = at::empty(shape_, options_);
    buffers.push_back({from_prev});
    works.push_back(group_->pg->recv(buffers.back(), prev, kForwardTag));
  }
  if (send_prev.defined() && has_prev) {
    check(send_prev, "a gradient sent backward");
    buffers.push_back({send_prev.contiguous()});
    works.push_back(group_->pg->send(buffers.back(), prev, kBackwardTag));
  }
  if (recv_next && has_next) {
    from_next = at::empty(shape_, options_);
    buffers.push_back({from_next});
    works.push_back(group_->pg->recv(buffers.back(), next, kBackwardTag));
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
  TORCH_CHECK(num_microbatches >= 1,
              "actmem::run_one_f_one_b: needs at least one micro-batch, got ", num_microbatches);
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

std::vector<std::pair<int64_t, int64_t>> interleaved_schedule_table(int64_t num_microbatches,
                                                                    int64_t chunks, int64_t group) {
  TORCH_CHECK(num_microbatches >= 1 && chunks >= 1 && group >= 1,
              "actmem::interleaved_schedule_table: needs positive micro-batches, chunks and group "
              "size, got ",
              num_microbatches, ", ", chunks, ", ", group);
  std::vector<std::pair<int64_t, int64_t>> table;
  for (int64_t first = 0; first < num_microbatches; first += group) {
    // The last group takes every micro-batch left (Megatron's ">= num_microbatches" branch).
    const int64_t end = first + group >= num_microbatches ? num_microbatches : first + group;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      for (int64_t m = first; m < end; ++m) table.emplace_back(m, chunk);
    }
  }
  return table;
}

void check_interleaved_microbatches(int64_t stages, int64_t num_microbatches, int64_t group) {
  // Megatron's forward_backward_pipelining_with_interleaving, its ValueError and RuntimeError.
  TORCH_CHECK(group <= num_microbatches && group >= stages,
              "actmem: The number of contiguous "
              "micro-batches in a virtual pipeline stage should range in [PP=",
              stages, " , M=", num_microbatches, "] (got ", group, ")");
  const int64_t last_group = num_microbatches % group;
  TORCH_CHECK(!(last_group > 0 && last_group < stages),
              "actmem: The remainder of M (the total "
              "micro-batches) divided by N (number of contiguous micro-batches in a virtual "
              "pipeline stage) should be 0, or larger than or equal to the pipeline-parallel size, "
              "but it is ",
              last_group,
              ". Otherwise, it introduces dependency bubbles in the "
              "pipeline and reduces throughput. (M = ",
              num_microbatches, ", N = ", group, ")");
}

// Note [Interleaved 1F1B]
// Megatron's forward_backward_pipelining_with_interleaving (megatron/core/pipeline_parallel/
// schedules.py), its path without p2p overlap, written as a list of steps. Each rank holds v model
// chunks; the model is cut into p v pieces, chunk c of rank r being piece c p + r, so a micro-
// batch goes round the ring v times. Virtual micro-batch k (0 <= k < M v) runs the forward of
// table[k] and, later, a backward of the same micro-batch on the mirrored chunk. Rank r first
// runs W = 2 (p - r - 1) + (v - 1) N forwards (N = the group size), then M v - W times a forward
// and a backward, then W backwards; after every step one exchange sends what the step produced
// and receives what the next steps need: the input of the next forward, which on the first rank
// comes from the last rank's step p - 1 earlier (recv_tensor_from_previous_stage). Received
// tensors wait in a queue per chunk. The first rank holds more micro-batches than in 1F1B:
// Korthikanti et al. 2022 (sec. 4.2.3) count its activations as p (1 + (p - 1) / (p v)) stage-
// micro-batches.
std::vector<PipelineStep> interleaved_schedule(int64_t stage, int64_t stages, int64_t chunks,
                                               int64_t num_microbatches, int64_t group,
                                               bool forward_only) {
  TORCH_CHECK(stages >= 2 && stage >= 0 && stage < stages && chunks >= 1,
              "actmem::interleaved_schedule: stage ", stage, " of ", stages, " with ", chunks,
              " chunks: needs p >= 2 and 0 <= stage < p");
  check_interleaved_microbatches(stages, num_microbatches, group);
  const auto table = interleaved_schedule_table(num_microbatches, chunks, group);
  const int64_t p = stages, r = stage, v = chunks;
  const int64_t total = num_microbatches * chunks;
  int64_t warmup = forward_only ? total : (p - r - 1) * 2 + (v - 1) * group;
  const bool all_warmup = warmup >= total;
  if (all_warmup) warmup = total;
  const int64_t remaining = total - warmup;
  const bool first = r == 0, last = r == p - 1;

  auto chunk_of = [&](int64_t k, bool forward) {
    const int64_t c = table[static_cast<size_t>(k % total)].second;
    return forward ? c : v - 1 - c;
  };
  // Megatron's recv_tensor_from_previous_stage: whether the exchange after step k receives (for
  // the forward direction from the previous rank, for the backward from the next) and which
  // chunk's queue the tensor joins.
  auto receive_after = [&](int64_t k, bool forward) -> int64_t {
    const bool leading = forward ? first : last;
    const int64_t last_chunk = forward ? v - 1 : 0;
    bool recv = true;
    int64_t next;
    if (leading) {
      if (k < p - 1) {
        recv = false;
        next = chunk_of(k + 1, forward);
      } else {
        next = chunk_of(k - (p - 1), forward);
      }
      if (next == last_chunk) recv = false;
      next += forward ? 1 : -1;
    } else {
      next = chunk_of(k + 1, forward);
    }
    return recv ? next : -1;
  };
  std::vector<PipelineStep> steps;
  auto compute = [&](PipelineStep::Kind kind, int64_t k) {
    PipelineStep s;
    s.kind = kind;
    s.microbatch = table[static_cast<size_t>(k)].first;
    s.chunk = chunk_of(k, kind == PipelineStep::Kind::kForward);
    steps.push_back(s);
  };
  auto exchange = [&](bool send_next, bool send_prev, int64_t recv_prev, int64_t recv_next) {
    PipelineStep s;
    s.send_next = send_next;
    s.send_prev = send_prev;
    s.recv_prev_chunk = recv_prev;
    s.recv_next_chunk = recv_next;
    steps.push_back(s);
  };
  // The output of the last chunk on the last rank is the loss; the input gradient of chunk 0 on
  // the first rank goes nowhere.
  auto sends_output = [&](int64_t k) { return !(last && chunk_of(k, true) == v - 1); };
  auto sends_grad = [&](int64_t k) { return !(first && chunk_of(k, false) == 0); };

  exchange(false, false, first ? -1 : 0, -1);  // the first forward's input
  for (int64_t k = 0; k < warmup; ++k) {
    int64_t recv_prev = receive_after(k, true);
    if (k == total - 1) recv_prev = -1;
    compute(PipelineStep::Kind::kForward, k);
    if (k == warmup - 1 && !forward_only && !all_warmup) {
      // The last warmup exchange also receives the first backward's output gradient.
      exchange(sends_output(k), false, recv_prev, last ? -1 : v - 1);
    } else {
      exchange(sends_output(k), false, recv_prev, -1);
    }
  }
  for (int64_t k = 0; k < remaining; ++k) {
    const int64_t fk = k + warmup;
    compute(PipelineStep::Kind::kForward, fk);
    compute(PipelineStep::Kind::kBackward, k);
    int64_t recv_prev = receive_after(fk, true);
    const int64_t recv_next = receive_after(k, false);
    if (k == remaining - 1) recv_prev = -1;
    exchange(sends_output(fk), sends_grad(k), recv_prev, recv_next);
  }
  if (forward_only) return steps;
  if (all_warmup) exchange(false, false, -1, last ? -1 : v - 1);
  for (int64_t k = remaining; k < total; ++k) {
    int64_t recv_next = receive_after(k, false);
    if (k == total - 1) recv_next = -1;
    compute(PipelineStep::Kind::kBackward, k);
    exchange(false, sends_grad(k), -1, recv_next);
  }
  return steps;
}

std::vector<PipelineStep> pipeline_compute_order(int64_t stage, int64_t stages, int64_t chunks,
                                                 int64_t num_microbatches, int64_t group) {
  TORCH_CHECK(chunks >= 1 && num_microbatches >= 1 && stage >= 0 && stage < stages,
              "actmem::pipeline_compute_order: needs a stage in [0, ", stages,
              "), at least one "
              "model chunk and one micro-batch, got stage ",
              stage, ", ", chunks, " chunks, ", num_microbatches, " micro-batches");
  std::vector<PipelineStep> order;
  auto add = [&](PipelineStep::Kind kind, int64_t m, int64_t chunk) {
    PipelineStep s;
    s.kind = kind;
    s.microbatch = m;
    s.chunk = chunk;
    order.push_back(s);
  };
  if (chunks == 1) {
    // run_one_f_one_b: warmup forwards, then forward W + i and backward i, then the rest.
    const int64_t M = num_microbatches;
    const int64_t warmup = std::min<int64_t>(stages - stage - 1, M);
    for (int64_t m = 0; m < warmup; ++m) add(PipelineStep::Kind::kForward, m, 0);
    for (int64_t i = 0; i < M - warmup; ++i) {
      add(PipelineStep::Kind::kForward, warmup + i, 0);
      add(PipelineStep::Kind::kBackward, i, 0);
    }
    for (int64_t m = M - warmup; m < M; ++m) add(PipelineStep::Kind::kBackward, m, 0);
    return order;
  }
  for (const PipelineStep& s :
       interleaved_schedule(stage, stages, chunks, num_microbatches, group)) {
    if (s.kind != PipelineStep::Kind::kCommunicate) order.push_back(s);
  }
  return order;
}

PipelineMemory pipeline_memory(const std::vector<PipelineStep>& steps, int64_t stage,
                               int64_t stages, const std::vector<int64_t>& chunk_bytes,
                               int64_t boundary_bytes) {
  return pipeline_memory(
      steps, stage, stages, static_cast<int64_t>(chunk_bytes.size()),
      [&](int64_t chunk, int64_t) { return chunk_bytes[static_cast<size_t>(chunk)]; },
      boundary_bytes);
}

PipelineMemory pipeline_memory(const std::vector<PipelineStep>& steps, int64_t stage,
                               int64_t stages, int64_t chunks,
                               const std::function<int64_t(int64_t, int64_t)>& bytes,
                               int64_t boundary_bytes) {
  TORCH_CHECK(chunks >= 1, "actmem::pipeline_memory: at least one model chunk, got ", chunks);
  const int64_t v = chunks;
  PipelineMemory out;
  out.max_in_flight.assign(static_cast<size_t>(v), 0);
  std::vector<int64_t> in_flight(static_cast<size_t>(v), 0);
  int64_t held = 0;                   // the in-flight micro-batches' bytes
  int64_t queued = 0;                 // received inputs and gradients not yet consumed
  bool output = false, grad = false;  // produced, not yet sent
  for (const PipelineStep& s : steps) {
    const size_t c = static_cast<size_t>(std::max<int64_t>(s.chunk, 0));
    switch (s.kind) {
      case PipelineStep::Kind::kForward: {
        if (!(stage == 0 && s.chunk == 0)) --queued;  // the input joins the micro-batch's bytes
        ++in_flight[c];
        held += bytes(s.chunk, s.microbatch);
        output = !(stage == stages - 1 && s.chunk == v - 1);
        out.peak_at_forward_end =
            std::max(out.peak_at_forward_end, held + boundary_bytes * (queued + (output ? 1 : 0)));
        break;
      }
      case PipelineStep::Kind::kBackward:
        if (!(stage == stages - 1 && s.chunk == v - 1)) --queued;
        --in_flight[c];
        held -= bytes(s.chunk, s.microbatch);
        grad = !(stage == 0 && s.chunk == 0);
        break;
      case PipelineStep::Kind::kCommunicate:
        output = grad = false;
        queued += (s.recv_prev_chunk >= 0 ? 1 : 0) + (s.recv_next_chunk >= 0 ? 1 : 0);
        break;
    }
    for (size_t i = 0; i < in_flight.size(); ++i) {
      out.max_in_flight[i] = std::max(out.max_in_flight[i], in_flight[i]);
    }
    out.max_boundary_tensors =
        std::max(out.max_boundary_tensors, queued + (output ? 1 : 0) + (grad ? 1 : 0));
  }
  return out;
}

void run_interleaved_one_f_one_b(const PipelineP2P& p2p, int64_t chunks, int64_t num_microbatches,
                                 int64_t group, const ChunkForward& forward,
                                 const ChunkBackward& backward, bool forward_only) {
  const std::vector<PipelineStep> steps = interleaved_schedule(
      p2p.stage(), p2p.stages(), chunks, num_microbatches, group, forward_only);
  std::vector<std::deque<at::Tensor>> inputs(static_cast<size_t>(chunks));
  std::vector<std::deque<at::Tensor>> grads(static_cast<size_t>(chunks));
  auto pop = [](std::deque<at::Tensor>& q, const char* what, int64_t chunk) {
    TORCH_CHECK(!q.empty(), "actmem::run_interleaved_one_f_one_b: no ", what,
                " queued for model "
                "chunk ",
                chunk);
    at::Tensor x = std::move(q.front());
    q.pop_front();
    return x;
  };
  at::Tensor output, input_grad;
  for (const PipelineStep& s : steps) {
    const size_t c = static_cast<size_t>(std::max<int64_t>(s.chunk, 0));
    switch (s.kind) {
      case PipelineStep::Kind::kForward: {
        const at::Tensor input =
            p2p.is_first() && s.chunk == 0 ? at::Tensor() : pop(inputs[c], "input", s.chunk);
        output = forward(s.microbatch, s.chunk, input);
        break;
      }
      case PipelineStep::Kind::kBackward: {
        const at::Tensor grad = p2p.is_last() && s.chunk == chunks - 1
                                    ? at::Tensor()
                                    : pop(grads[c], "output gradient", s.chunk);
        input_grad = backward(s.microbatch, s.chunk, grad);
        break;
      }
      case PipelineStep::Kind::kCommunicate: {
        auto [from_prev, from_next] = p2p.communicate(
            s.send_next ? output : at::Tensor(), s.send_prev ? input_grad : at::Tensor(),
            s.recv_prev_chunk >= 0, s.recv_next_chunk >= 0);
        output = at::Tensor();  // sent: its memory goes before the next step
        input_grad = at::Tensor();
        if (s.recv_prev_chunk >= 0) {
          inputs[static_cast<size_t>(s.recv_prev_chunk)].push_back(std::move(from_prev));
        }
        if (s.recv_next_chunk >= 0) {
          grads[static_cast<size_t>(s.recv_next_chunk)].push_back(std::move(from_next));
        }
        break;
      }
    }
  }
}

}  // namespace actmem
