// layer_spec.cpp — the spec function (layer_spec.h): the one place that reads which kind each
// layer's mixer and MLP are.
#include "actmem/model/layer_spec.h"

#include "actmem/model/attention/attention.h"
#include "actmem/model/gdn/gated_delta_net.h"
#include "actmem/model/mla/mla.h"
#include "actmem/model/mlp/mlp.h"
#include "actmem/model/moe/moe.h"

namespace actmem {

std::string LayerSpec::name() const {
  return std::string(mixer->name()) + "+" + mlp->name();
}

std::vector<LayerSpec> layer_specs(const TransformerConfig& config) {
  // Megatron's hybrid pattern (linear_attention_freq) picks the GatedDeltaNet layers, the others
  // take the model's attention; moe_layer_freq picks the MoE layers (get_gpt_decoder_block_spec).
  const std::vector<bool> moe = config.moe_layers(), linear = config.gdn_layers();
  const LayerPart& attention = config.multi_latent_attention ? mla_part() : attention_part();
  std::vector<LayerSpec> specs;
  for (size_t i = 0; i < moe.size(); ++i) {
    specs.push_back(
        {linear[i] ? &gated_delta_net_part() : &attention, moe[i] ? &moe_part() : &mlp_part()});
  }
  return specs;
}

LayerSpec layer_spec(const TransformerConfig& config, int64_t layer) {
  TORCH_CHECK(layer >= 0 && layer < config.num_layers, "actmem::layer_spec: layer ", layer,
              " outside 0..", config.num_layers - 1);
  return layer_specs(config)[static_cast<size_t>(layer)];
}

}  // namespace actmem
