// ledger.cpp — ModuleScope, ActivationLedger, LedgerScope.
#include "actmem/memory/ledger.h"

#include "actmem/recompute/recompute.h"

#include <ATen/record_function.h>
#include <c10/core/ScalarType.h>

#include <algorithm>

namespace actmem {

namespace {
struct Frame {
  const char* name;
  int64_t index;
};
thread_local std::vector<Frame> t_modules;
thread_local std::vector<const char*> t_ops;

std::unique_ptr<at::ObserverContext> on_op_enter(const at::RecordFunction& fn) {
  t_ops.push_back(fn.name());
  return nullptr;
}
void on_op_exit(const at::RecordFunction&, at::ObserverContext*) {
  if (!t_ops.empty()) t_ops.pop_back();
}
}  // namespace

ModuleScope::ModuleScope(const char* name, int64_t index) {
  t_modules.push_back({name, index});
}
ModuleScope::~ModuleScope() {
  t_modules.pop_back();
}

std::string current_module_path() {
  std::string path;
  for (const auto& f : t_modules) {
    if (!path.empty()) path += '.';
    path += f.name;
    if (f.index >= 0) {
      path += '.';
      path += std::to_string(f.index);
    }
  }
  return path;
}

void ActivationLedger::exclude(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return;
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  excluded_.insert_or_assign(impl, c10::weak_intrusive_ptr<c10::StorageImpl>(
                                       c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl)));
}

void ActivationLedger::exclude(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) exclude(t);
}

void ActivationLedger::clear() {
  records_.clear();
  storages_.clear();
  counted_.clear();
}

void ActivationLedger::finalize() {
  for (size_t i = 0; i < records_.size(); ++i) {
    const auto storage = storages_[i].lock();
    const int64_t now = storage ? static_cast<int64_t>(storage->nbytes()) : 0;
    if (now < records_[i].storage_bytes) {
      records_[i].discarded = true;
      records_[i].storage_bytes = now;
    }
  }
}

int64_t ActivationLedger::total_bytes() const {
  int64_t total = 0;
  for (const auto& r : records_) total += r.counted ? r.storage_bytes : 0;
  return total;
}

std::vector<std::pair<std::string, int64_t>> ActivationLedger::bytes_by_module() const {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& r : records_) {
    if (!r.counted) continue;
    auto it =
        std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == r.module; });
    if (it == out.end()) {
      out.emplace_back(r.module, r.storage_bytes);
    } else {
      it->second += r.storage_bytes;
    }
  }
  return out;
}

std::shared_ptr<PackedTensor> ActivationLedger::pack(const at::Tensor& t) {
  if (is_recomputing() || !t.defined() || !t.has_storage()) return nullptr;
  const void* storage = t.storage().unsafeGetStorageImpl();
  const auto ex = excluded_.find(storage);
  if (ex != excluded_.end() && !ex->second.expired()) return nullptr;
  if (t.is_leaf() && t.requires_grad()) return nullptr;  // a parameter not registered as excluded
  SavedTensorRecord r;
  r.module = current_module_path();
  r.op = t_ops.empty() ? "" : t_ops.back();
  r.shape = t.sizes().vec();
  r.dtype = c10::toString(t.scalar_type());
  r.storage_bytes = static_cast<int64_t>(t.storage().nbytes());
  const auto seen = counted_.find(storage);
  r.counted = seen == counted_.end() || seen->second.expired();
  if (r.counted) {
    counted_.insert_or_assign(storage, c10::weak_intrusive_ptr<c10::StorageImpl>(
                                           c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(
                                               t.storage().unsafeGetStorageImpl())));
  }
  records_.push_back(std::move(r));
  storages_.emplace_back(
      c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(t.storage().unsafeGetStorageImpl()));
  return nullptr;  // observe only: autograd keeps the tensor as it would without hooks
}

LedgerScope::LedgerScope(ActivationLedger& ledger)
    : ledger_(ledger),
      hooks_(ledger),
      callback_(at::addThreadLocalCallback(
          at::RecordFunctionCallback(&on_op_enter, &on_op_exit)
              .scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}))) {}

LedgerScope::~LedgerScope() {
  at::removeCallback(callback_);
  ledger_.finalize();
}

}  // namespace actmem
