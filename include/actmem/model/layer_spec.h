// layer_spec.h — which kind of part fills each slot of each transformer layer: the one place
// that reads the model description's layer kinds (Megatron's get_gpt_layer_local_spec,
// get_gpt_decoder_block_spec with moe_layer_freq, and the hybrid pattern of
// experimental_attention_variant / linear_attention_freq).
#pragma once

#include "actmem/config/config.h"
#include "actmem/model/layer_part.h"

#include <array>
#include <string>
#include <vector>

namespace actmem {

/// A layer's slots: the mixer in "self_attention", the MLP in "mlp" (Note [A layer part owns its
/// contract] in layer_part.h). The norms and bias-dropout-adds around them are every layer's.
struct LayerSpec {
  const LayerPart* mixer = nullptr;
  const LayerPart* mlp = nullptr;
  std::array<const LayerPart*, 2> parts() const { return {mixer, mlp}; }
  /// The parts' names joined ("attention+mlp"): the layer's kind in tables and JSON.
  std::string name() const;
  bool operator==(const LayerSpec& o) const { return mixer == o.mixer && mlp == o.mlp; }
};

/// The spec of every layer of `config` (num_layers entries, in order).
std::vector<LayerSpec> layer_specs(const TransformerConfig& config);
/// The spec of layer `layer` (0-based).
LayerSpec layer_spec(const TransformerConfig& config, int64_t layer);

}  // namespace actmem
