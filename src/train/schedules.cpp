// schedules.cpp — the forward-backward schedules (schedules.h).
#include "actmem/train/schedules.h"

#include "actmem/model/model.h"
#include "actmem/parallel/grad_reducer.h"
#include "actmem/parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <deque>

namespace actmem {

double forward_backward_no_pipelining(const ScheduleSpec& spec,
                                      const std::function<MicroBatch()>& next_batch,
                                      ScheduleObserver& observer) {
  const int64_t n_micro = spec.num_microbatches;
  double loss_sum = 0.0;
  for (int64_t m = 0; m < n_micro; ++m) {
    const auto [tokens, labels] = next_batch();
    const Computation c{m, 0, nullptr};
    observer.before_forward(c, tokens, labels, /*received=*/false);
    at::Tensor loss = spec.model->forward(tokens, labels);
    if (n_micro > 1 && !spec.per_token_loss) loss = loss / static_cast<double>(n_micro);
    observer.after_forward(c, /*every_layer=*/false);
    // Megatron's no_sync for every micro-batch but the last.
    if (spec.grad_reducer != nullptr) spec.grad_reducer->set_last_microbatch(m == n_micro - 1);
    observer.before_backward(c);
    spec.backward_from_loss(loss);
    observer.after_backward(c);
    loss_sum += loss.item<double>();
  }
  return loss_sum;
}

// Note [Pipeline step]
// One stage's share of a step under the 1F1B schedule (Note [1F1B] in pipeline.cpp). Forward of
// micro-batch m: the input received from the previous stage becomes a leaf that requires grad;
// the stage's output is sent on and dropped, keeping only its gradient edge (Megatron's
// deallocate_output_tensor: the output's memory is freed once sent, and backward runs the
// autograd engine from the edge with the gradient the next stage returns). The last stage's
// output is its loss (divided by the micro-batch count), backward from it as without a pipeline.
// What a micro-batch holds from its forward to its backward is this stage's activations, the
// received input among them (the first layer's norm saves it); at the end of its forward, its
// output as well.
//
// Note [Partial activation checkpoints]
// Megatron's --num-microbatches-with-partial-activation-checkpoints N (schedules.py, after
// Korthikanti et al. 2022, appendix C): a stage keeps at most W = warmup + 1 forwards in flight
// (its max_outstanding_backprops); forward k (counted over the step, every model chunk) checks
// k % W >= N: false for the first N of each window, which run the configured plan (the block
// method's first recompute_num_layers layers checkpointed), true for the others, which
// checkpoint every layer. So at most N in-flight micro-batches keep the partial plan's bytes;
// the last stage (W = 1) runs every micro-batch partially. Megatron passes the flag to the
// model's forward step, which its mcore GPT ignores; here the model applies it
// (TransformerBlock::set_checkpoint_every_layer), bitwise like any recompute.
// W is read off the stage's own order: the forwards before its first backward are the warmup
// and one more (all of them when the schedule is all warmup, where k mod W is k either way).
double forward_backward_pipelining(const ScheduleSpec& spec, const PipelineP2P& p2p,
                                   const std::vector<MicroBatch>& batches,
                                   ScheduleObserver& observer) {
  const TensorParallelGroup& pp = pipeline_parallel_group();
  GPTModel& model = *spec.model;
  const int64_t n_micro = spec.num_microbatches;
  const int64_t chunks = model.num_model_chunks();
  struct InFlight {
    int64_t microbatch = 0;
    at::Tensor input;                   // the received input (a leaf), undefined on the first stage
    torch::autograd::Edge output_edge;  // where the output's gradient enters (not the last stage)
    at::Tensor loss;                    // the last stage's
  };
  std::vector<std::deque<InFlight>> in_flight(static_cast<size_t>(chunks));  // per model chunk
  // The schedule's computations in order: each callback checks it is the one expected and looks
  // at the next (Note [Offload under pipeline schedules] in activation_offloader.h).
  const std::vector<PipelineStep> order =
      pipeline_compute_order(pp.rank, pp.size, chunks, n_micro, spec.microbatch_group_size);
  const int64_t outstanding =
      std::find_if(order.begin(), order.end(),
                   [](const PipelineStep& s) { return s.kind == PipelineStep::Kind::kBackward; }) -
      order.begin();
  size_t computed = 0;
  auto advance = [&](PipelineStep::Kind kind, int64_t m, int64_t chunk) {
    TORCH_INTERNAL_ASSERT(computed < order.size() && order[computed].kind == kind &&
                              order[computed].microbatch == m && order[computed].chunk == chunk,
                          "the pipeline ran a computation out of pipeline_compute_order's order");
    ++computed;
    return Computation{m, chunk, computed < order.size() ? &order[computed] : nullptr};
  };
  double loss_sum = 0.0;
  int64_t forwards_run = 0;
  auto forward = [&](int64_t m, int64_t chunk, const at::Tensor& received) {
    const auto& [tokens, labels] = batches[static_cast<size_t>(m)];
    const Computation c = advance(PipelineStep::Kind::kForward, m, chunk);
    observer.before_forward(c, tokens, labels, received.defined());
    InFlight f;
    f.microbatch = m;
    if (received.defined()) {
      f.input = received;
      f.input.requires_grad_(true);
    }
    // Note [Partial activation checkpoints]
    const bool every_layer =
        spec.partial_checkpoints && forwards_run % outstanding >= *spec.partial_checkpoints;
    ++forwards_run;
    model.set_checkpoint_every_layer(every_layer);
    at::Tensor out = model.forward_stage(tokens, labels, f.input, chunk);
    model.set_checkpoint_every_layer(false);
    if (model.chunk_post_process(chunk)) {
      if (n_micro > 1 && !spec.per_token_loss) out = out / static_cast<double>(n_micro);
      loss_sum += out.item<double>();
      f.loss = out;
      out = at::Tensor();
    } else {
      f.output_edge = torch::autograd::impl::gradient_edge(out);
    }
    observer.after_forward(c, every_layer);
    in_flight[static_cast<size_t>(chunk)].push_back(std::move(f));
    return out;
  };
  auto backward = [&](int64_t m, int64_t chunk, const at::Tensor& output_grad) {
    std::deque<InFlight>& queue = in_flight[static_cast<size_t>(chunk)];
    InFlight f = std::move(queue.front());
    queue.pop_front();
    TORCH_INTERNAL_ASSERT(f.microbatch == m, "backward of micro-batch ", m, " found ",
                          f.microbatch);
    const Computation c = advance(PipelineStep::Kind::kBackward, m, chunk);
    observer.before_backward(c);
    // The chunk's last backward of the step reduces its gradients (Megatron's interleaved
    // schedule enables grad sync for each model chunk's last micro-batch).
    if (spec.grad_reducer != nullptr) spec.grad_reducer->set_last_microbatch(m == n_micro - 1);
    if (f.loss.defined()) {
      spec.backward_from_loss(f.loss);
    } else {
      torch::autograd::Engine::get_default_engine().execute(
          {f.output_edge}, {output_grad}, /*keep_graph=*/false, /*create_graph=*/false,
          /*accumulate_grad=*/true);
    }
    observer.after_backward(c);
    return f.input.defined() ? f.input.grad() : at::Tensor();
  };
  if (chunks > 1) {
    run_interleaved_one_f_one_b(p2p, chunks, n_micro, spec.microbatch_group_size, forward,
                                backward);
  } else {
    run_one_f_one_b(
        p2p, n_micro, [&](int64_t m, const at::Tensor& in) { return forward(m, 0, in); },
        [&](int64_t m, const at::Tensor& g) { return backward(m, 0, g); });
  }
  return loss_sum;
}

}  // namespace actmem
