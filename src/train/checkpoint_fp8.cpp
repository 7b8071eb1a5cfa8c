// checkpoint_fp8.cpp — the FP8 scaling state in a checkpoint (checkpoint.h, docs/fp8.md).
#include "actmem/model/fp8.h"
#include "actmem/model/model.h"
#include "actmem/train/checkpoint.h"

namespace actmem {

namespace {
// Every FP8 GEMM of the model by its Linear's module name.
std::vector<std::pair<std::string, Fp8Gemm*>> named_gemms(const GPTModel& model) {
  std::vector<std::pair<std::string, Fp8Gemm*>> out;
  for (const auto& item : model.named_modules()) {
    if (const auto* linear = dynamic_cast<const Linear*>(item.value().get())) {
      if (linear->fp8) out.emplace_back(item.key(), linear->fp8.get());
    }
  }
  return out;
}
}  // namespace

c10::impl::GenericDict fp8_scaling_state(const GPTModel& model) {
  c10::impl::GenericDict out(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, gemm] : named_gemms(model)) out.insert(name, gemm->state().clone());
  return out;
}

void load_fp8_scaling_state(GPTModel& model, const c10::impl::GenericDict& state,
                            const std::string& path) {
  const auto gemms = named_gemms(model);
  TORCH_CHECK(static_cast<size_t>(state.size()) == gemms.size(), "actmem::load_checkpoint: ", path,
              " holds the FP8 scaling state of ", state.size(), " GEMMs, this model has ",
              gemms.size());
  for (const auto& [name, gemm] : gemms) {
    const auto it = state.find(name);
    TORCH_CHECK(it != state.end() && it->value().isTensor(), "actmem::load_checkpoint: ", path,
                " has no FP8 scaling state for ", name);
    gemm->set_state(it->value().toTensor());
  }
}

}  // namespace actmem
