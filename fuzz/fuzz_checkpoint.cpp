// fuzz_checkpoint.cpp — a checkpoint file (model_optim_rng.pt: the zip container, the pickle
// stream, the tensor records) through read_checkpoint_file, then what the loaders do with it:
// every tensor's bytes read from instrumented code, the args entry turned back into a model
// configuration (config_from_args, which validates it).
#include "actmem/config/config.h"
#include "actmem/train/checkpoint.h"
#include "fuzz_util.h"

#include <ATen/core/ivalue.h>

#include <nlohmann/json.hpp>

namespace {

void walk(const c10::IValue& v, int depth) {
  if (depth > 64) return;
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || !t.has_storage()) return;
    const c10::Storage& s = t.storage();
    if (s.data() != nullptr) actmem::fuzz::touch(s.data(), s.nbytes());
    if (t.numel() == 0) return;
    // The view's extent within its storage.
    int64_t last = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const char* base = static_cast<const char*>(s.data());
    if (base != nullptr) {
      actmem::fuzz::touch(base + t.storage_offset() * t.element_size(),
                          static_cast<size_t>((last - t.storage_offset() + 1) * t.element_size()));
    }
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      walk(e.key(), depth + 1);
      walk(e.value(), depth + 1);
    }
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) walk(e, depth + 1);
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) walk(e, depth + 1);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  actmem::fuzz::silence_warnings();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = actmem::fuzz::scratch("model_optim_rng.pt");
  actmem::fuzz::write_file(path, data, size);
  try {
    const c10::impl::GenericDict checkpoint = actmem::read_checkpoint_file(path);
    walk(c10::IValue(checkpoint), 0);
    const c10::IValue key("args");
    if (checkpoint.contains(key)) {
      const actmem::TransformerConfig config =
          actmem::config_from_args(actmem::ivalue_to_json(checkpoint.at(key)));
      (void)config;
    }
  } catch (const c10::Error&) {
    // a clear refusal
  }
  return 0;
}
