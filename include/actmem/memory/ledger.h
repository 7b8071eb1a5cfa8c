// ledger.h — the activation ledger: every tensor autograd saves for backward during a forward,
// attributed to the module that saved it (Megatron's module paths) and to the op, with storages
// counted once however many views save them and parameters excluded.
//
// The model marks where it is with ModuleScope (cheap when no ledger records); a LedgerScope
// records through the saved-tensor hook stack (saved_tensor_hooks.h) and names ops through a
// thread-local RecordFunction callback. Tensors saved while a checkpoint is replayed in backward
// are not activations of the forward and are not recorded.
#pragma once

#include "actmem/recompute/saved_tensor_hooks.h"

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace actmem {

/// Names the module whose code runs on this thread: ModuleScope("self_attention"), or with an
/// index ModuleScope("layers", 3) -> "layers.3". Paths join the open scopes with '.'.
class ModuleScope {
 public:
  explicit ModuleScope(const char* name, int64_t index = -1);
  ~ModuleScope();
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;
};
/// The current module path ("decoder.layers.0.self_attention.core_attention"), "" at top level.
std::string current_module_path();

/// One saved tensor.
struct SavedTensorRecord {
  std::string module;  // module path at save time
  std::string op;      // innermost op that saved it ("aten::bmm", "actmem::checkpoint")
  std::vector<int64_t> shape;
  std::string dtype;          // "Float", "Bool", ...
  int64_t storage_bytes = 0;  // bytes of the whole storage at the end of the forward
  bool counted = false;       // false when the storage was counted by an earlier record
  bool discarded = false;     // freed before the end of the forward (output-discarding recompute)
};

class ActivationLedger final : public SavedTensorHook {
 public:
  /// Storages of these tensors are never recorded (parameters, model buffers, the batch).
  void exclude(const at::Tensor& tensor);
  void exclude(const std::vector<at::Tensor>& tensors);
  /// Forgets the records and counted storages; keeps the exclusions.
  void clear();

  const std::vector<SavedTensorRecord>& records() const { return records_; }
  /// Bytes of distinct storages saved.
  int64_t total_bytes() const;
  /// Counted bytes per module path, in first-save order.
  std::vector<std::pair<std::string, int64_t>> bytes_by_module() const;

  std::shared_ptr<PackedTensor> pack(const at::Tensor& tensor) override;
  /// Re-reads every recorded storage's size: a storage freed since it was saved (output-
  /// discarding recompute) then counts 0 bytes. LedgerScope calls it when the forward ends.
  void finalize();

 private:
  std::vector<SavedTensorRecord> records_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages_;  // parallel to records_
  // Storages counted in this forward; weak, because an offloaded storage can be freed during the
  // forward and a new one allocated at its address.
  std::unordered_map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>> counted_;
  // Weak, so a freed excluded storage (last step's batch) cannot exclude a new one at its address.
  std::unordered_map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>> excluded_;
};

/// Records into `ledger` while alive (on this thread): pushes it on the saved-tensor hook stack
/// and tracks op names.
class LedgerScope {
 public:
  explicit LedgerScope(ActivationLedger& ledger);
  ~LedgerScope();
  LedgerScope(const LedgerScope&) = delete;
  LedgerScope& operator=(const LedgerScope&) = delete;

 private:
  ActivationLedger& ledger_;
  SavedTensorHooksGuard hooks_;
  uint64_t callback_;
};

}  // namespace actmem
