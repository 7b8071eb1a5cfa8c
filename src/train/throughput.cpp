// throughput.cpp — Megatron's model FLOPs (throughput.h).
#include "actmem/train/throughput.h"

#include "actmem/model/layer_spec.h"

#include <c10/util/Exception.h>

namespace actmem {

double megatron_model_flops(const TransformerConfig& c, int64_t global_batch) {
  TORCH_CHECK(global_batch > 0, "actmem::megatron_model_flops: expected a positive batch, got ",
              global_batch);
  // transformer_flops, term for term (no multi-token prediction layers in actmem): each layer's
  // parts' terms (LayerPart::megatron_flops) and the logits.
  const double E = 3.0;  // forward and the backward's two GEMMs
  const double F = 2.0;  // a multiply-add is two operations
  const double h = static_cast<double>(c.hidden_size);
  const double s = static_cast<double>(c.seq_length);
  const double tokens = static_cast<double>(global_batch) * s;
  const double seqlen_squared_sum = static_cast<double>(global_batch) * s * s;
  double per_token = 0.0, per_token_position = 0.0;
  for (const LayerSpec& spec : layer_specs(c)) {
    for (const LayerPart* part : spec.parts()) {
      const PartFlops f = part->megatron_flops(c);
      per_token += f.per_token;
      per_token_position += f.per_token_position;
    }
  }
  return tokens * (per_token + E * F * h * static_cast<double>(c.vocab_size)) +
         seqlen_squared_sum * per_token_position;
}

}  // namespace actmem
