// pipeline.h — pipeline parallelism's communication and schedules on c10d: point-to-point sends
// and receives of activations and their gradients between neighbouring stages (Megatron's
// megatron/core/pipeline_parallel/p2p_communication.py) and the 1F1B schedule
// (forward_backward_pipelining_without_interleaving in megatron/core/pipeline_parallel/
// schedules.py). The schedule knows nothing of models: it calls back for each micro-batch's
// forward and backward and moves what they return (docs/parallelism.md, "Pipeline parallelism").
#pragma once

#include "actmem/parallel/tensor_parallel.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace actmem {

/// Sends and receives between neighbouring stages of a pipeline group. Every tensor crossing a
/// stage boundary has the same shape and type (Megatron's tensor_shape: [s/t or s, b, h] in the
/// parameters' type), known up front, so receives need no size exchange.
class PipelineP2P {
 public:
  /// `pipeline` must outlive this object (the process-wide groups do).
  /// With `ring` (the interleaved schedule) the last stage's next stage is the first and the
  /// first stage's previous the last (Megatron's P2PCommunicator: next = (rank + 1) % p): model
  /// chunk c's output on the last rank is chunk c + 1's input on the first.
  PipelineP2P(const TensorParallelGroup& pipeline, std::vector<int64_t> shape,
              at::TensorOptions options, bool ring = false);
  int stage() const { return group_->rank; }
  int stages() const { return group_->size; }
  bool is_first() const { return group_->rank == 0; }
  bool is_last() const { return group_->rank == group_->size - 1; }
  /// Bytes of one tensor crossing a stage boundary.
  int64_t bytes() const;
  /// Megatron's _communicate: posts every requested send and receive at once, then waits for all
  /// of them (so two neighbours exchanging in both directions cannot deadlock). Sends to the
  /// next stage carry activations, sends to the previous one gradients. Returns (from previous,
  /// from next); undefined where nothing was asked or the neighbour does not exist.
  std::pair<at::Tensor, at::Tensor> communicate(const at::Tensor& send_next,
                                                const at::Tensor& send_prev, bool recv_prev,
                                                bool recv_next) const;
  at::Tensor recv_forward() const { return communicate({}, {}, true, false).first; }
  at::Tensor recv_backward() const { return communicate({}, {}, false, true).second; }
  void send_forward(const at::Tensor& x) const { communicate(x, {}, false, false); }
  void send_backward(const at::Tensor& g) const { communicate({}, g, false, false); }
  at::Tensor send_forward_recv_backward(const at::Tensor& x) const {
    return communicate(x, {}, false, true).second;
  }
  at::Tensor send_backward_recv_forward(const at::Tensor& g) const {
    return communicate({}, g, true, false).first;
  }

 private:
  const TensorParallelGroup* group_;  // the process-wide group (pipeline_parallel_group())
  std::vector<int64_t> shape_;
  at::TensorOptions options_;
  bool ring_ = false;
};

/// One micro-batch's forward on this stage: its input from the previous stage (undefined on the
/// first) -> what goes to the next stage (ignored on the last).
using PipelineForward = std::function<at::Tensor(int64_t microbatch, const at::Tensor& input)>;
/// One micro-batch's backward: the gradient of its output from the next stage (undefined on the
/// last) -> the gradient of its input for the previous stage (ignored on the first).
using PipelineBackward =
    std::function<at::Tensor(int64_t microbatch, const at::Tensor& output_grad)>;

/// The micro-batches in flight on `stage` of `stages` at the 1F1B peak: min(stages - stage,
/// micro-batches) (Megatron's num_warmup_microbatches + 1, Korthikanti et al. 2022 sec. 4.2.3).
int64_t one_f_one_b_in_flight(int64_t stage, int64_t stages, int64_t num_microbatches);

/// Megatron's 1F1B: warmup forwards (stages - stage - 1 of them), then one forward and one
/// backward alternating, then the remaining backwards; backwards run in micro-batch order.
/// With forward_only, every micro-batch's forward in order and no backward (validation).
void run_one_f_one_b(const PipelineP2P& p2p, int64_t num_microbatches,
                     const PipelineForward& forward, const PipelineBackward& backward,
                     bool forward_only = false);

/// One step of a stage's interleaved 1F1B schedule: a model chunk's forward or backward of a
/// micro-batch, or one exchange with the neighbouring stages.
struct PipelineStep {
  enum class Kind { kForward, kBackward, kCommunicate };
  Kind kind = Kind::kCommunicate;
  int64_t microbatch = -1, chunk = -1;  // kForward, kBackward
  // kCommunicate: send the latest forward's output to the next stage / the latest backward's
  // input gradient to the previous one, and receive from the previous (next) stage the input
  // (output gradient) model chunk recv_prev_chunk (recv_next_chunk) will consume; -1 = none.
  bool send_next = false, send_prev = false;
  int64_t recv_prev_chunk = -1, recv_next_chunk = -1;
};

/// The (micro-batch, model chunk) of each virtual micro-batch k of the interleaved schedule
/// (Megatron's get_schedule_table): groups of `group` micro-batches, chunk by chunk within a
/// group, the last group taking what remains. Forward k runs table[k]; backward k the same
/// micro-batch on chunk chunks - 1 - table[k].second.
std::vector<std::pair<int64_t, int64_t>> interleaved_schedule_table(int64_t num_microbatches,
                                                                    int64_t chunks, int64_t group);

/// Throws with Megatron's messages unless `group` micro-batches per virtual stage suit `stages`
/// and `num_microbatches` (p <= group <= M, and the last group either full or at least p).
void check_interleaved_microbatches(int64_t stages, int64_t num_microbatches, int64_t group);

/// Stage `stage`'s steps under Megatron's interleaved 1F1B (forward_backward_pipelining_with_
/// interleaving without p2p overlap): (p - stage - 1) * 2 + (chunks - 1) * group warmup
/// forwards (capped at M * chunks), then one forward and one backward per step, then the
/// remaining backwards; one exchange after each step. forward_only: every forward (validation).
std::vector<PipelineStep> interleaved_schedule(int64_t stage, int64_t stages, int64_t chunks,
                                               int64_t num_microbatches, int64_t group,
                                               bool forward_only = false);

/// Stage `stage`'s forwards and backwards in the order its schedule computes them, without the
/// exchanges: run_one_f_one_b's with one model chunk, interleaved_schedule's with several. What
/// comes next after each computation (the offloader's margin and prefetch, Note [Offload under
/// pipeline schedules] in activation_offloader.h).
std::vector<PipelineStep> pipeline_compute_order(int64_t stage, int64_t stages, int64_t chunks,
                                                 int64_t num_microbatches, int64_t group);
/// What a stage holds under a schedule of steps, counted from the bytes each model chunk's
/// micro-batch keeps (`chunk_bytes`, its received input among them) and the bytes of one tensor
/// crossing a stage boundary.
struct PipelineMemory {
  /// The most, at the end of a forward: every micro-batch in flight, the received inputs and
  /// gradients waiting in their queues, and the output about to be sent.
  int64_t peak_at_forward_end = 0;
  /// Per chunk, the most micro-batches in flight at once; the most boundary tensors held at once
  /// (queued, or produced and not yet sent).
  std::vector<int64_t> max_in_flight;
  int64_t max_boundary_tensors = 0;
};
PipelineMemory pipeline_memory(const std::vector<PipelineStep>& steps, int64_t stage,
                               int64_t stages, const std::vector<int64_t>& chunk_bytes,
                               int64_t boundary_bytes);
/// The same when a micro-batch's bytes depend on the micro-batch (an MoE layer's expert rows
/// follow its routing): `bytes(chunk, microbatch)` for each of `chunks` model chunks.
PipelineMemory pipeline_memory(const std::vector<PipelineStep>& steps, int64_t stage,
                               int64_t stages, int64_t chunks,
                               const std::function<int64_t(int64_t, int64_t)>& bytes,
                               int64_t boundary_bytes);

/// One micro-batch's forward / backward on model chunk `chunk` of this stage.
using ChunkForward =
    std::function<at::Tensor(int64_t microbatch, int64_t chunk, const at::Tensor& input)>;
using ChunkBackward =
    std::function<at::Tensor(int64_t microbatch, int64_t chunk, const at::Tensor& output_grad)>;

/// Runs interleaved_schedule() for this stage over `p2p` (a ring): received inputs and gradients
/// wait in one queue per chunk, each exchange posts all its sends and receives at once and waits
/// for them (PipelineP2P::communicate).
void run_interleaved_one_f_one_b(const PipelineP2P& p2p, int64_t chunks, int64_t num_microbatches,
                                 int64_t group, const ChunkForward& forward,
                                 const ChunkBackward& backward, bool forward_only = false);

}  // namespace actmem
