// training_setup.cpp — the Trainer's set-up steps (training_setup.h).
#include "actmem/train/training_setup.h"

#include "actmem/base/report.h"
#include "actmem/data/gpt_dataset.h"
#include "actmem/memory/memory_model.h"
#include "actmem/memory/memory_tracker.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/model/model.h"
#include "actmem/parallel/pipeline.h"
#include "actmem/parallel/tensor_parallel.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

namespace actmem {

void check_batch_layout(const TransformerConfig& model, const TrainingConfig& training) {
  check_batch_layout(model, training, data_parallel_group().size);
}

void check_batch_layout(const TransformerConfig& model, const TrainingConfig& training, int64_t d) {
  check_batch_layout(model, training.global_batch(model.micro_batch_size, d), d);
}

void check_batch_layout(const TransformerConfig& model, int64_t gbs, int64_t d) {
  // Megatron's validate_args: each data-parallel rank runs whole micro-batches.
  const int64_t mbs = model.micro_batch_size;
  TORCH_CHECK(gbs % (mbs * d) == 0, "actmem::Trainer: global batch size (", gbs,
              ") is not divisible by micro batch size (", mbs, ") times data parallel size (", d,
              ")");
  if (model.virtual_pipeline_size() > 1) {
    // The interleaved schedule's rules on the micro-batches (Megatron checks them when the
    // schedule starts; here before anything is built).
    check_interleaved_microbatches(model.pipeline_model_parallel_size, gbs / (mbs * d),
                                   model.microbatch_group_size());
  }
}

namespace {
TrainingData load_indexed_datasets(const TransformerConfig& model, const TrainingConfig& c) {
  const int64_t d = data_parallel_group().size;
  const int64_t gbs = c.global_batch(model.micro_batch_size, d);
  const int64_t valid =
      c.eval_interval > 0 ? (c.train_iters / c.eval_interval + 1) * c.eval_iters * gbs : 0;
  // Megatron's train_valid_test_num_samples: --train-samples, else train_iters x global batch.
  // Under a schedule Megatron multiplies by its args.global_batch_size, one micro-batch per rank,
  // which leaves the dataset short of the steps' samples; here the samples the run's steps
  // consume (the last one may pass --train-samples).
  const GlobalBatchSchedule batches = c.batch_schedule(model, d);
  const int64_t train = batches.stepped() ? std::max(c.train_samples.value_or(0),
                                                     batches.samples_after(c.train_iters))
                                          : c.train_samples.value_or(c.train_iters * gbs);
  const std::vector<int64_t> sizes = {train, valid, 0};
  const uint32_t seed = static_cast<uint32_t>(model.seed);
  std::ostringstream source;
  GPTSplits splits;
  if (c.mock_data) {
    splits = build_mock_gpt_splits(c.tokenizer_vocab_size, c.eod_id, model.seq_length, seed, sizes,
                                   c.data_cache_path);
    source << "--mock-data (Megatron's MockGPTDataset, " << c.tokenizer_type << " vocabulary "
           << c.tokenizer_vocab_size << ", eod " << c.eod_id << ")";
  } else {
    const DataBlend blend = parse_data_path(c.data_paths);
    splits = build_gpt_splits(blend, c.split, model.seq_length, seed, sizes, c.data_cache_path);
    for (size_t i = 0; i < blend.prefixes.size(); ++i) {
      if (i) source << " + ";
      if (!blend.weights.empty()) source << blend.weights[i] << " x ";
      source << blend.prefixes[i];
    }
  }
  TrainingData data;
  Corpus& corpus = data.corpus;
  corpus.source = source.str();
  corpus.memory_mapped = !c.mock_data;  // a mock's tokens are computed when read
  corpus.documents = splits.documents;
  corpus.sequences = splits.sequences;
  corpus.bytes = splits.bytes;
  corpus.tokens = splits.tokens;
  corpus.train_samples = splits.train->size();
  corpus.valid_samples = splits.valid ? splits.valid->size() : 0;
  data.train = std::make_unique<DatasetBatches>(
      splits.train, model.seq_length, model.micro_batch_size, model.vocab_size, "training");
  if (splits.valid) {
    data.valid = std::make_unique<DatasetBatches>(
        splits.valid, model.seq_length, model.micro_batch_size, model.vocab_size, "validation");
  }
  return data;
}
}  // namespace

TrainingData load_training_data(const TransformerConfig& model, const TrainingConfig& training) {
  if (!training.data_paths.empty() || training.mock_data) {
    return load_indexed_datasets(model, training);
  }
  TORCH_CHECK(model.vocab_size >= ByteTokenizer::kVocabSize, "actmem::Trainer: vocab_size (",
              model.vocab_size, ") must be at least 256 for the byte-level tokenizer");
  TrainingData data;
  data.corpus = load_corpus(training.data_path, training.split, model.seq_length);
  data.train = std::make_unique<BatchSampler>(data.corpus.train, model.seq_length,
                                              model.micro_batch_size, model.seed);
  data.valid = std::make_unique<BatchSampler>(data.corpus.valid, model.seq_length,
                                              model.micro_batch_size, model.seed + 1);
  return data;
}

int64_t checked_device_memory_limit(const TransformerConfig& model, const TrainingConfig& training,
                                    const Corpus& corpus) {
  // The tensor-parallel ranks of one launch share this machine's memory, and the corpus held in
  // it (unless memory-mapped) is not available to them.
  const bool explicit_limit = training.device_memory_limit > 0;
  const int64_t limit = explicit_limit
                            ? training.device_memory_limit
                            : (physical_memory_bytes() - corpus.resident_bytes()) /
                                  (tensor_parallel_group().size * data_parallel_group().size *
                                   pipeline_parallel_group().size);
  // A pipeline stage: its own weights and the micro-batches 1F1B keeps in flight on it (under
  // the interleaved schedule, per model chunk, with the boundary tensors its queues hold).
  const TensorParallelGroup& pp = pipeline_parallel_group();
  // The most micro-batches a step runs (under a schedule, at its largest batch).
  const int64_t n_micro =
      std::max<int64_t>(training.batch_schedule(model, data_parallel_group().size).largest() /
                            (model.micro_batch_size * data_parallel_group().size),
                        1);
  int64_t in_flight = one_f_one_b_in_flight(pp.rank, pp.size, n_micro);
  // The distributed optimizer's state: 1/d of it (the experts' over their own, possibly
  // smaller, data-parallel group: the smaller size keeps the bound a bound).
  const int64_t shards =
      training.use_distributed_optimizer
          ? std::min(data_parallel_group().size, expert_data_parallel_group().size)
          : 1;
  double need = 0.0;
  if (const int64_t v = model.virtual_pipeline_size(); v > 1) {
    const PipelineMemory counts = pipeline_memory(
        interleaved_schedule(pp.rank, pp.size, v, n_micro, model.microbatch_group_size()), pp.rank,
        pp.size, std::vector<int64_t>(static_cast<size_t>(v), 0), 0);
    in_flight = 0;
    for (const int64_t n : counts.max_in_flight) in_flight += n;
    need = predict_step_peak_bound(model, 0, pp.rank, counts.max_in_flight,
                                   counts.max_boundary_tensors + 2, shards);
  } else {
    need = predict_step_peak_bound(model, 0, pp.rank, in_flight, shards);
  }
  TORCH_CHECK(need <= static_cast<double>(limit),
              "actmem::Trainer: this configuration needs "
              "about ",
              format_bytes(need),
              " of device memory (parameters, gradients, AdamW "
              "state",
              shards > 1 ? " (1/" + std::to_string(shards) + " of it)" : std::string(), " and ",
              in_flight == 1 ? std::string("one micro-batch")
                             : std::to_string(in_flight) +
                                   (model.virtual_pipeline_size() > 1 ? " model-chunk micro-batches"
                                                                      : " micro-batches") +
                                   " (pipeline stage " + std::to_string(pp.rank) + ")",
              " of activations at their peak) but the limit is ",
              format_bytes(static_cast<double>(limit)),
              explicit_limit ? std::string()
                             : " (physical memory less the corpus's " +
                                   format_bytes(static_cast<double>(corpus.resident_bytes())) + ")",
              "; reduce --num-layers, --hidden-size, --seq-length or --micro-batch-size");
  return limit;
}

ActivationPrediction::ActivationPrediction(const TransformerConfig& c, const GPTModel& model,
                                           bool on_cpu, bool partial)
    : config(c), cpu(on_cpu) {
  // With a capacity factor and no padding an MoE model's bytes depend on the routing: predicted
  // per step from the router's counts; otherwise once, here.
  routing_dependent = c.is_moe() && !moe_expert_rows(c, 0).has_value();
  const int64_t stage = pipeline_parallel_group().rank;
  if (!routing_dependent) {
    for (int64_t k = 0; k < model.num_model_chunks(); ++k) {
      chunk_bytes.push_back(
          predict_activation_bytes(c, model.plan(), c.element_bytes(), cpu, nullptr, stage, k)
              .total);
    }
  }
  if (partial) {
    TransformerConfig every = c;
    int64_t largest = 0;  // the model's largest chunk (make_activation_plan's bound on n)
    for (int64_t s = 0; s < c.pipeline_model_parallel_size; ++s) {
      for (int64_t k = 0; k < c.virtual_pipeline_size(); ++k) {
        largest = std::max(largest, c.model_chunk_layers(s, k).count);
      }
    }
    // The block method over all of a chunk's layers: what the model runs in every-layer mode.
    every.recompute_num_layers = largest;
    every_layer_plan = std::make_unique<ActivationPlan>(make_activation_plan(every));
    if (!routing_dependent) {
      for (int64_t k = 0; k < model.num_model_chunks(); ++k) {
        every_layer_chunk_bytes.push_back(predict_activation_bytes(c, *every_layer_plan,
                                                                   c.element_bytes(), cpu, nullptr,
                                                                   stage, k)
                                              .total);
      }
    }
  }
}

int64_t ActivationPrediction::chunk(const GPTModel& model, int64_t chunk, int64_t boundary_bytes,
                                    bool every_layer) const {
  // A micro-batch's bytes in a model chunk: its layers' bytes (the received input among them: the
  // first layer's norm keeps it, as it keeps the embedding's output on the first stage). With
  // distribute_saved_activations a checkpoint that starts the chunk keeps its 1/t shard of the
  // received input, and the input itself stays too (the schedule needs its gradient; Megatron's
  // CheckpointFunction swaps the tensor's storage for the shard instead, which this project does
  // not do).
  const ActivationPlan& plan = every_layer ? *every_layer_plan : model.plan();
  const bool kept_input =
      !model.chunk_pre_process(chunk) && plan.distribute_saved_activations &&
      plan.layers[static_cast<size_t>(model.stage_layers(chunk).offset)].starts_chunk;
  int64_t layers = 0;
  if (routing_dependent) {
    // The chunk's MoE layers as its latest forward routed them (the caller asks right after it).
    const TransformerConfig::StageLayers mine = model.stage_layers(chunk);
    MoERouting routing;
    for (const auto& l : model.moe_stats().layers) {
      if (mine.contains(l.layer_number - 1)) {
        routing.emplace_back(l.last_tokens_per_expert, l.last_dispatched_rows);
      }
    }
    layers = predict_activation_bytes(config, plan, config.element_bytes(), cpu, &routing,
                                      pipeline_parallel_group().rank, chunk)
                 .total;
  } else {
    layers = (every_layer ? every_layer_chunk_bytes : chunk_bytes).at(static_cast<size_t>(chunk));
  }
  return layers + (kept_input ? boundary_bytes : 0);
}

}  // namespace actmem
