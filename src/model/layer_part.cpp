// layer_part.cpp — the defaults of a part's module and contract (layer_part.h).
#include "actmem/model/layer_part.h"

#include "actmem/model/attention/attention.h"
#include "actmem/model/fp8.h"
#include "actmem/model/layers.h"
#include "actmem/model/part_estimate.h"

namespace actmem {

std::unique_ptr<DecodeState> PartModule::make_decode_state(int64_t,
                                                           const at::TensorOptions&) const {
  return nullptr;
}

std::pair<at::Tensor, at::Tensor> PartModule::decode(const at::Tensor& x, DecodeState*, int64_t,
                                                     const LayerContext& ctx) {
  return forward(x, ctx);
}

void PartModule::use_fp8(const std::shared_ptr<Fp8Registry>& registry) {
  for (const auto& module : modules(/*include_self=*/false)) {
    if (auto* linear = dynamic_cast<Linear*>(module.get()))
      linear->fp8 = registry->add_gemm(registry);
  }
}

std::unique_ptr<RotaryEmbedding> LayerPart::rotary_tables(const TransformerConfig&,
                                                          at::ScalarType) const {
  return nullptr;
}

int64_t LayerPart::decode_state_bytes(const TransformerConfig&, int64_t, int64_t) const {
  return 0;
}

ModuleTerms LayerPart::module_terms(const std::string&, const TransformerConfig&, int64_t,
                                    bool) const {
  return {};
}

std::optional<OffloadModule> LayerPart::offload_group(const std::string&) const {
  return std::nullopt;
}

LayerBytes LayerPart::paper_layer_bytes(const PaperShape&, const LayerBytes& layer) const {
  return layer;
}

void LayerPart::paper_estimate(const PartEstimateContext&, PartEstimate&) const {}

std::vector<RecomputeModule> LayerPart::estimate_units(const TransformerConfig&) const {
  return {};
}

std::string LayerPart::summary(const TransformerConfig&, int64_t) const {
  return "";
}

}  // namespace actmem
