// part_estimate.h — what `actmem estimate` prints about a layer part beyond the layers' totals
// (LayerPart::paper_estimate in layer_part.h): the part's own terms as a section of the table
// and the same under the part's name in the JSON.
#pragma once

#include "actmem/memory/memory_model.h"

#include <nlohmann/json.hpp>

#include <string>

namespace actmem {

/// What estimate knows of the part on the first pipeline stage (the paper path).
struct PartEstimateContext {
  const PaperShape& m;
  double layers_in_stage = 0;       // the first stage's layers with this part
  LayerBytes layer;                 // the first such layer's bytes (LayerPart::paper_layer_bytes)
  LayerBytes layer_with_paper_mlp;  // the same layer with the paper's dense MLP
  const WeightMemory* weights =
      nullptr;  // the rank's weights (megatron_weight_and_optimizer_memory)
};

struct PartEstimate {
  nlohmann::json json;  // under the part's name (null: nothing)
  std::string section;  // after the per-stage table, "" when nothing
  std::string weights;  // a line of the device-memory section, "" when nothing
};

}  // namespace actmem
