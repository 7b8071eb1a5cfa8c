// checkpoint.cpp — Megatron-layout checkpoints: the files, the save protocol, and what a Trainer
// writes into and restores from them.
#include "actmem/train/checkpoint.h"

#include "actmem/parallel/distributed_optimizer.h"

#include "actmem/train/mixed_precision.h"
#include "actmem/model/model.h"
#include "actmem/base/output_file.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/train/optimizer.h"
#include "actmem/data/data.h"
#include "actmem/recompute/rng.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <torch/optim/adamw.h>
#include <cmath>

#include <nlohmann/json.hpp>

#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace actmem {

namespace {
// lr_warmup_steps as Megatron's state_dict holds it: samples, an int, or a float when
// --lr-warmup-fraction made it one.
c10::IValue warmup_steps_value(const LrScheduleSteps& steps) {
  const double w = steps.warmup;
  if (w == std::floor(w)) return c10::IValue(static_cast<int64_t>(w));
  return c10::IValue(w);
}
}  // namespace

namespace fs = std::filesystem;

// Note [Checkpoint protocol]
// A checkpoint is published in three moves, each atomic on a POSIX file system, so a crash at
// any instant leaves the directory loading the newest *complete* checkpoint:
//   1. every rank writes DIR/iter_N.tmp/mp_rank_RR/model_optim_rng.pt, then fsyncs the file and
//      its directory; the ranks agree that all succeeded (one all-reduce);
//   2. rank 0 renames iter_N.tmp to iter_N (exchanging the two atomically when iter_N exists,
//      e.g. a run resumed from N saving N again; the old one is removed afterwards) and fsyncs
//      DIR;
//   3. rank 0 writes latest_checkpointed_iteration.txt.tmp, fsyncs it and renames it over
//      latest_checkpointed_iteration.txt (last: the pointer moves only to a complete
//      checkpoint), then fsyncs DIR.
// Older checkpoints are never touched, so the previous one stays loadable until the new one is
// complete (Megatron keeps them all as well). A leftover iter_N.tmp from a crash is ignored by
// loads and removed by the next save of N. Tests kill the process between the moves
// (ACTMEM_CHECKPOINT_FAULT=STAGE[@ITER], STAGE one of mid-file, before-publish, before-latest:
// the process sends itself SIGKILL there).

namespace {
// A parameter's entry in the optimizer's state map: its TensorImpl's address.
void* state_key(const at::Tensor& p) {
  return p.unsafeGetTensorImpl();
}

// Note [Checkpoints Python loads with weights_only]
// torch.load has defaulted to weights_only=True since PyTorch 2.6: the unpickler accepts only
// dicts, lists, tuples, primitives and tensors (torch._utils._rebuild_tensor_v2 and the storage
// types). torch::jit::pickle_save tags every dict and list with its element types through the
// GLOBAL torch.jit._pickle.restore_type_tag, which that unpickler refuses ("Unsupported global").
// It also writes a list of floats, ints, bools or tensors through torch.jit._pickle.build_doublelist
// (build_intlist, ...), equally refused. So the value is first rebuilt with generic lists
// (untyped()), then pickled as pickle_save does (torch/csrc/jit/serialization/pickle.cpp) with
// the Pickler's tag_aggregates off: the same zip container and tensor records, plain containers,
// which both Python's torch.load (either mode) and torch::jit::pickle_load read.
c10::IValue untyped(const c10::IValue& v) {
  if (v.isList()) {  // every list kind, specialized or generic
    c10::impl::GenericList out(c10::AnyType::get());
    for (const c10::IValue& e : v.toListRef()) out.push_back(untyped(e));
    return out;
  }
  if (v.isGenericDict()) {
    c10::impl::GenericDict out(c10::AnyType::get(), c10::AnyType::get());
    for (const auto& e : v.toGenericDict()) out.insert(e.key(), untyped(e.value()));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const c10::IValue& e : v.toTupleRef().elements()) elements.push_back(untyped(e));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return v;
}

std::vector<char> save_untagged(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&pickled](const char* data, size_t n) { pickled.insert(pickled.end(), data, data + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(untyped(value));
  pickler.stop();
  std::vector<char> container;
  container.reserve(pickled.size());
  {
    caffe2::serialize::PyTorchStreamWriter writer([&container](const void* data, size_t n) {
      const char* bytes = static_cast<const char*>(data);
      container.insert(container.end(), bytes, bytes + n);
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(),
                                       writer);
    writer.writeEndOfFile();
  }
  return container;
}

std::string errno_text() { return std::strerror(errno); }

// Test-only fault injection (Note [Checkpoint protocol]).
void maybe_fault(const char* stage, int64_t iteration) {
  const char* spec = std::getenv("ACTMEM_CHECKPOINT_FAULT");
  if (spec == nullptr) return;
  std::string s(spec);
  const auto at = s.find('@');
  if (s.substr(0, at) != stage) return;
  if (at != std::string::npos && std::to_string(iteration) != s.substr(at + 1)) return;
  std::raise(SIGKILL);
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  TORCH_CHECK(fd >= 0, "actmem::save_checkpoint: cannot open ", path, " to sync it: ", errno_text());
  const int rc = ::fsync(fd);
  const std::string err = rc != 0 ? errno_text() : std::string();
  ::close(fd);
  TORCH_CHECK(rc == 0, "actmem::save_checkpoint: fsync of ", path, " failed: ", err);
}

// Writes `size` bytes to `path` (created or truncated) and fsyncs it. `fault_iteration` >= 0
// arms the mid-file fault point, after the first half (Note [Checkpoint protocol]).
void write_durably(const std::string& path, const char* data, size_t size,
                   int64_t fault_iteration = -1) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "actmem::save_checkpoint: cannot create ", path, ": ", errno_text());
  const size_t first = fault_iteration >= 0 ? size / 2 : size;
  int err = write_fully(fd, data, first);
  if (err == 0 && first < size) {
    ::fsync(fd);
    maybe_fault("mid-file", fault_iteration);
    err = write_fully(fd, data + first, size - first);
  }
  std::string what = err != 0 ? "write failed: " + std::string(std::strerror(err)) : "";
  if (what.empty() && ::fsync(fd) != 0) what = "fsync failed: " + errno_text();
  if (::close(fd) != 0 && what.empty()) what = "close failed: " + errno_text();
  TORCH_CHECK(what.empty(), "actmem::save_checkpoint: ", path, ": ", what,
              " (is the disk full? the previous checkpoint is untouched)");
}

// Whether every writing rank succeeded; the ranks call it together, so one rank's failure
// reaches the others instead of leaving them waiting in the next collective. The writers are one
// replica's tensor-, expert-parallel ranks and pipeline stages (Trainer::save_checkpoint).
bool all_ranks_ok(bool ok, const at::Device& device) {
  if (tensor_parallel_group().size == 1 && expert_parallel_group().size == 1 &&
      pipeline_parallel_group().size == 1) {
    return ok;
  }
  const at::Tensor failures = at::full({1}, ok ? 0.0f : 1.0f,
                                       at::TensorOptions().dtype(at::kFloat).device(device));
  return group_all_reduce_sum(
             pipeline_parallel_group(),
             group_all_reduce_sum(expert_parallel_group(), all_reduce_sum(failures)))
             .item<float>() == 0.0f;
}

// Runs `fn` on every rank, then agrees on success: rethrows a local error, or reports another
// rank's.
template <typename Fn>
void on_all_ranks(const at::Device& device, const char* what, Fn&& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  const bool all_ok = all_ranks_ok(!error, device);
  if (error) std::rethrow_exception(error);
  TORCH_CHECK(all_ok, "actmem::Trainer::save_checkpoint: another tensor-, expert- or pipeline-parallel rank failed ",
              what, " (its error is in its output); nothing was published");
}

// Publishes `tmp` as `final` atomically (Note [Checkpoint protocol], move 2).
void publish_directory(const std::string& tmp, const std::string& final) {
  std::error_code ec;
  if (!fs::exists(final, ec)) {
    TORCH_CHECK(::rename(tmp.c_str(), final.c_str()) == 0, "actmem::save_checkpoint: cannot "
                "rename ", tmp, " to ", final, ": ", errno_text());
    return;
  }
  // Exchange, then remove the old copy: iter_N names a complete checkpoint at every instant.
  const std::string old = final + ".old";
  fs::remove_all(old, ec);
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final.c_str(), RENAME_EXCHANGE) == 0) {
    fs::rename(tmp, old);  // tmp now holds the old checkpoint
    fs::remove_all(old, ec);
    return;
  }
#endif
  // A file system without the exchange: a short window in which only iter_N.old exists.
  fs::rename(final, old);
  fs::rename(tmp, final);
  fs::remove_all(old, ec);
}

c10::impl::GenericDict string_dict() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

at::Tensor host_copy(const at::Tensor& t) { return t.detach().to(at::kCPU).contiguous().clone(); }

const c10::IValue& entry(const c10::impl::GenericDict& d, const std::string& key,
                         const std::string& path) {
  const auto it = d.find(key);
  TORCH_CHECK(it != d.end(), "actmem::Trainer::load_checkpoint: ", path, " has no '", key,
              "' entry; it is not a checkpoint written by actmem or Megatron-LM");
  return it->value();
}

c10::impl::GenericDict dict_entry(const c10::impl::GenericDict& d, const std::string& key,
                                  const std::string& path) {
  const c10::IValue& v = entry(d, key, path);
  TORCH_CHECK(v.isGenericDict(), "actmem::Trainer::load_checkpoint: ", path, ": '", key,
              "' is not a dict");
  return v.toGenericDict();
}

// Whole tensors shaped like `full` from this rank's `pieces` of them and every other
// data-parallel rank's (OptimizerShards::all_gather).
std::vector<at::Tensor> unshard(const OptimizerShards& shards, const std::vector<at::Tensor>& full,
                                const std::vector<at::Tensor>& pieces) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> whole;
  for (const auto i : c10::irange(full.size())) {
    whole.push_back(at::zeros(full[i].sizes(), pieces[i].options()));
    shards.shard(whole.back(), i).copy_(pieces[i]);
  }
  shards.all_gather(whole);
  return whole;
}

// An AdamW's per-parameter moments (null where no step was taken yet).
struct AdamWMoments {
  std::vector<int64_t> step;  // -1: no state
  std::vector<at::Tensor> exp_avg, exp_avg_sq;
};

AdamWMoments adamw_moments(torch::optim::AdamW& opt, const std::vector<at::Tensor>& params) {
  AdamWMoments m;
  for (const auto& p : params) {
    const auto it = opt.state().find(state_key(p));
    const auto* s = it == opt.state().end()
                        ? nullptr
                        : &static_cast<const torch::optim::AdamWParamState&>(*it->second);
    m.step.push_back(s ? s->step() : -1);
    m.exp_avg.push_back(s ? s->exp_avg() : at::Tensor());
    m.exp_avg_sq.push_back(s ? s->exp_avg_sq() : at::Tensor());
  }
  return m;
}

// With the distributed optimizer the moments are this rank's pieces of the parameters whose
// shapes `full` gives: every rank's pieces are gathered into whole tensors, so that the
// checkpoint is the same as without it (a collective over the data-parallel ranks).
AdamWMoments unshard(const OptimizerShards& shards, const std::vector<at::Tensor>& full,
                     AdamWMoments m) {
  const bool any = std::any_of(m.step.begin(), m.step.end(), [](int64_t s) { return s >= 0; });
  if (!any) return m;  // no step taken yet, on any rank
  TORCH_CHECK(std::all_of(m.step.begin(), m.step.end(), [](int64_t s) { return s >= 0; }),
              "actmem::Trainer::save_checkpoint: the distributed optimizer has state for some "
              "parameters only");
  m.exp_avg = unshard(shards, full, m.exp_avg);
  m.exp_avg_sq = unshard(shards, full, m.exp_avg_sq);
  return m;
}

// An AdamW's per-parameter state as torch's Optimizer.state_dict() lays it out:
// {"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{..., "params": [0..n)}]}.
c10::impl::GenericDict adamw_state_dict(torch::optim::AdamW& opt, const AdamWMoments& m) {
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (const auto i : c10::irange(m.step.size())) {
    if (m.step[i] < 0) continue;
    auto d = string_dict();
    d.insert("step", m.step[i]);
    d.insert("exp_avg", host_copy(m.exp_avg[i]));
    d.insert("exp_avg_sq", host_copy(m.exp_avg_sq[i]));
    state.insert(static_cast<int64_t>(i), d);
  }
  const auto& o = static_cast<const torch::optim::AdamWOptions&>(opt.param_groups()[0].options());
  auto group = string_dict();
  group.insert("lr", o.lr());
  group.insert("betas", c10::List<double>({std::get<0>(o.betas()), std::get<1>(o.betas())}));
  group.insert("eps", o.eps());
  group.insert("weight_decay", o.weight_decay());
  group.insert("amsgrad", o.amsgrad());
  c10::List<int64_t> ids;
  for (const auto i : c10::irange(m.step.size())) ids.push_back(static_cast<int64_t>(i));
  group.insert("params", ids);
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);
  auto out = string_dict();
  out.insert("state", state);
  out.insert("param_groups", groups);
  return out;
}

// With the distributed optimizer (`shards`) `params` are this rank's pieces of the parameters
// whose shapes `full` gives; each takes its elements of the saved whole tensors.
void load_adamw_state(torch::optim::AdamW& opt, const std::vector<at::Tensor>& params,
                      const c10::impl::GenericDict& sd, const std::string& path,
                      const OptimizerShards* shards = nullptr,
                      const std::vector<at::Tensor>& full = {}) {
  const c10::IValue& state_v = entry(sd, "state", path);
  TORCH_CHECK(state_v.isGenericDict(), "actmem::Trainer::load_checkpoint: ", path,
              ": the optimizer state is not a dict");
  opt.state().clear();
  for (const auto& e : state_v.toGenericDict()) {
    TORCH_CHECK(e.key().isInt() && e.key().toInt() >= 0 &&
                    e.key().toInt() < static_cast<int64_t>(params.size()) &&
                    e.value().isGenericDict(),
                "actmem::Trainer::load_checkpoint: ", path, ": optimizer state entry ",
                e.key(), " does not belong to any of this model's ", params.size(), " parameters");
    const auto index = static_cast<size_t>(e.key().toInt());
    const at::Tensor& p = params[index];
    const at::IntArrayRef shape = shards ? full[index].sizes() : p.sizes();
    const auto d = e.value().toGenericDict();
    auto tensor = [&](const char* name) {
      const at::Tensor t = entry(d, name, path).toTensor();
      TORCH_CHECK(t.sizes() == shape && t.scalar_type() == p.scalar_type(),
                  "actmem::Trainer::load_checkpoint: ", path, ": optimizer ", name, " of parameter ",
                  e.key().toInt(), " is ", t.sizes(), " ", t.scalar_type(), ", expected ",
                  shape, " ", p.scalar_type());
      const at::Tensor here = t.to(p.device());
      return (shards ? shards->shard(here.contiguous(), index) : here).clone();
    };
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(entry(d, "step", path).toInt());
    s->exp_avg(tensor("exp_avg"));
    s->exp_avg_sq(tensor("exp_avg_sq"));
    opt.state()[state_key(p)] = std::move(s);
  }
}

// The fields of args a checkpoint must agree with this run on: the ones that decide the
// parameters' names, shapes and types, and the tensor-parallel layout.
constexpr const char* kShapeFields[] = {
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
    "normalization", "gated_linear_unit", "add_bias_linear", "position_embedding_type",
    "untie_embeddings_and_output_weights", "tensor_model_parallel_size", "precision"};

// "mp_rank_03", "mp_rank_03_001" (expert rank 1 or pipeline stage 1), "mp_rank_03_002_001"
// (stage 2, expert rank 1): Megatron's get_checkpoint_name.
std::string rank_dir_name(int64_t tp_rank, int64_t ep_rank = -1, int64_t pp_rank = -1) {
  std::ostringstream os;
  os << "mp_rank_" << std::setw(2) << std::setfill('0') << tp_rank;
  if (pp_rank >= 0) os << "_" << std::setw(3) << std::setfill('0') << pp_rank;
  if (ep_rank >= 0) os << "_" << std::setw(3) << std::setfill('0') << ep_rank;
  return os.str();
}

// This rank's expert-parallel rank for its file name: -1 without expert parallelism.
int64_t file_ep_rank() {
  return expert_parallel_group().size > 1 ? expert_parallel_group().rank : -1;
}

// This rank's pipeline stage for its file name: -1 without pipeline parallelism.
int64_t file_pp_rank() {
  return pipeline_parallel_group().size > 1 ? pipeline_parallel_group().rank : -1;
}

}  // namespace

std::string checkpoint_iteration_dir(const std::string& dir, int64_t iteration) {
  std::ostringstream os;
  os << "iter_" << std::setw(7) << std::setfill('0') << iteration;
  return (fs::path(dir) / os.str()).string();
}

std::string checkpoint_file(const std::string& dir, int64_t iteration, int64_t tp_rank,
                            int64_t ep_rank, int64_t pp_rank) {
  return (fs::path(checkpoint_iteration_dir(dir, iteration)) /
          rank_dir_name(tp_rank, ep_rank, pp_rank) /
          "model_optim_rng.pt")
      .string();
}

std::optional<int64_t> read_latest_checkpointed_iteration(const std::string& dir) {
  const fs::path path = fs::path(dir) / kLatestCheckpointFile;
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  TORCH_CHECK(text != "release", "actmem::read_latest_checkpointed_iteration: ", path.string(),
              " names a 'release' checkpoint (a converted model); actmem loads iteration "
              "checkpoints only");
  int64_t iteration = -1;
  const bool digits = !text.empty() && text.size() <= 18 &&
                      text.find_first_not_of("0123456789") == std::string::npos;
  if (digits) iteration = std::stoll(text);
  TORCH_CHECK(digits, "actmem::read_latest_checkpointed_iteration: ", path.string(),
              " should hold an iteration number, found '", text.substr(0, 40), "'");
  return iteration;
}

namespace {
// Note [Tensor records cover their tensors]
// torch::jit::pickle_load builds each storage with the byte size the pickle states (numel x
// item size) over the record's buffer (archive/data/N) without comparing the two: a record cut
// short (a damaged or crafted file) gave a storage larger than its buffer, which loaded without
// complaint and trained on whatever lay beyond it. read_checkpoint_file unpickles as pickle_load
// does (readArchiveAndTensors in torch/csrc/jit/serialization/import_read.cpp) but remembers each
// record's buffer and size, then checks every tensor: its storage within its record, its view
// (offset, sizes, strides) within its storage.
using RecordSizes = std::map<const void*, size_t>;

void check_tensor_records(const c10::IValue& v, const RecordSizes& records, const std::string& path,
                          int depth = 0) {
  TORCH_CHECK(depth < 64, "actmem::read_checkpoint_file: ", path,
              " nests containers deeper than 64");
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || !t.has_storage()) return;
    const size_t storage_bytes = t.storage().nbytes();
    if (storage_bytes > 0) {
      const auto it = records.find(t.storage().data());
      TORCH_CHECK(it != records.end(), "actmem::read_checkpoint_file: ", path,
                  " holds a tensor whose storage is not one of its records");
      TORCH_CHECK(storage_bytes <= it->second, "actmem::read_checkpoint_file: ", path,
                  " is damaged: a tensor of shape ", t.sizes(), " (", t.scalar_type(), ") needs ",
                  storage_bytes, " bytes but its record holds ", it->second,
                  " (truncated or altered)");
    }
    int64_t needed = 0;  // bytes the view reaches: its offset and farthest element, inclusive
    if (t.numel() > 0) {
      int64_t last = t.storage_offset();
      for (int64_t d = 0; d < t.dim(); ++d) {
        TORCH_CHECK(t.stride(d) >= 0, "actmem::read_checkpoint_file: ", path,
                    " holds a tensor with a negative stride");
        last += (t.size(d) - 1) * t.stride(d);
      }
      needed = (last + 1) * static_cast<int64_t>(t.element_size());
    }
    TORCH_CHECK(t.storage_offset() >= 0 && needed <= static_cast<int64_t>(storage_bytes),
                "actmem::read_checkpoint_file: ", path, " is damaged: a tensor of shape ",
                t.sizes(), " reaches byte ", needed, " of its ", storage_bytes, "-byte storage");
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      check_tensor_records(e.key(), records, path, depth + 1);
      check_tensor_records(e.value(), records, path, depth + 1);
    }
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) check_tensor_records(e, records, path, depth + 1);
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) {
      check_tensor_records(e, records, path, depth + 1);
    }
  }
}

// Note [Pickle lengths are checked before the unpickler reads them]
// torch::jit::Unpickler reserves a string of the length a BINUNICODE/BINBYTES opcode states
// (readBytes) before it reads the bytes: a 67 KB checkpoint whose pickle states a 1.3 GB string
// allocated 1.3 GB (found by fuzz/fuzz_checkpoint.cpp), and a length of 2^63 would throw
// std::length_error or exhaust memory. The opcodes are walked here first (the pickle protocol's
// opcode table, Python's Lib/pickletools.py), each length compared with the bytes that remain;
// an opcode outside the table, or one of the text protocol's memo opcodes, is refused (torch.save
// writes protocol 2).
void check_pickle_lengths(const char* data, size_t size, const std::string& path) {
  size_t at = 0;
  auto need = [&](uint64_t n, const char* what) {
    TORCH_CHECK(n <= size - at, "actmem::read_checkpoint_file: ", path, " is damaged: its pickle ",
                "states ", what, " of ", n, " bytes at offset ", at, " with ", size - at,
                " bytes left");
  };
  auto uint = [&](size_t bytes) {
    need(bytes, "an argument");
    uint64_t v = 0;
    for (size_t i = 0; i < bytes; ++i)
      v |= static_cast<uint64_t>(static_cast<uint8_t>(data[at + i])) << (8 * i);
    at += bytes;
    return v;
  };
  // A length of `bytes` bytes, then that many bytes: skipped once they are known to be there.
  auto skip_string = [&](size_t bytes) {
    const uint64_t n = uint(bytes);
    need(n, "a string");
    at += n;
    return n;
  };
  uint64_t memo = 0;  // entries of the memo so far
  auto put = [&](uint64_t index) {
    TORCH_CHECK(index <= memo, "actmem::read_checkpoint_file: ", path,
                " is damaged: its pickle "
                "puts memo entry ",
                index, " after ", memo, " entries (offset ", at, ")");
    memo = std::max(memo, index + 1);
  };
  auto line = [&]() {
    const void* nl = std::memchr(data + at, '\n', size - at);
    TORCH_CHECK(nl != nullptr, "actmem::read_checkpoint_file: ", path, " is damaged: its pickle ",
                "ends inside a text argument");
    at = static_cast<size_t>(static_cast<const char*>(nl) - data) + 1;
  };
  while (at < size) {
    const uint8_t op = static_cast<uint8_t>(data[at++]);
    switch (op) {
      case '.':  // STOP
        return;
      // The memo: a PUT's index sizes the unpickler's memo table (Unpickler::setInput resizes it
      // to the index + 1; an index of 2^32 - 1 asked for 22 GB, found by fuzzing). Python's
      // pickler numbers its entries 0, 1, 2, ... (len(memo)); an index beyond the entries so far
      // is refused, and a GET must name one of them.
      case 'q':
      case 'r':
        put(uint(op == 'q' ? 1 : 4));
        break;
      case 0x94:  // MEMOIZE
        ++memo;
        break;
      case 'h':
      case 'j': {
        const uint64_t index = uint(op == 'h' ? 1 : 4);
        TORCH_CHECK(index < memo, "actmem::read_checkpoint_file: ", path,
                    " is damaged: its pickle "
                    "reads memo entry ",
                    index, " of ", memo, " at offset ", at);
        break;
      }
      case '(':
      case '0':
      case '1':
      case '2':
      case 'N':
      case 0x88:
      case 0x89:
      case '}':
      case ']':
      case ')':
      case 't':
      case 0x85:
      case 0x86:
      case 0x87:
      case 'a':
      case 'e':
      case 's':
      case 'u':
      case 'b':
      case 'R':
      case 0x81:
      case 0x92:
      case 0x8f:
      case 0x90:
      case 0x91:
      case 0x93:
      case 'Q':
      case 'l':
      case 'd':
      case 'o':
      case 0x97:
      case 0x98:
        break;  // no argument
      case 0x80:
      case 'K':
      case 0x82:
        uint(1);
        break;
      case 'M':
      case 0x83:
        uint(2);
        break;
      case 'J':
      case 0x84:
        uint(4);
        break;
      case 'G':
      case 0x95:
        uint(8);
        break;
      case 'U':
      case 'C':
      case 0x8c:
      case 0x8a:  // a length of one byte, then the bytes
        skip_string(1);
        break;
      case 'T':
      case 'B':
      case 'X':
      case 0x8b:  // four bytes of length (BINSTRING and LONG4 signed)
        TORCH_CHECK(skip_string(4) < (uint64_t{1} << 31) || op == 'B' || op == 'X',
                    "actmem::read_checkpoint_file: ", path,
                    " is damaged: its pickle states a negative length");
        break;
      case 0x8d:
      case 0x8e:
      case 0x96:  // eight bytes of length
        skip_string(8);
        break;
      case 'I':
      case 'L':
      case 'F':
      case 'S':
      case 'V':
      case 'P':
        line();
        break;
      case 'c':
      case 'i':
        line();
        line();
        break;
      default:
        TORCH_CHECK(false, "actmem::read_checkpoint_file: ", path, " is not a checkpoint: its ",
                    "pickle has opcode 0x", c10::str(std::hex, static_cast<int>(op)), " at offset ",
                    at - 1);
    }
  }
  TORCH_CHECK(false, "actmem::read_checkpoint_file: ", path, " is damaged: its pickle has no STOP");
}

// pickle_load of the file, with the records' sizes.
c10::IValue unpickle_checkpoint(const std::string& path, RecordSizes& records) {
  caffe2::serialize::PyTorchStreamReader reader(path);
  auto record = reader.getRecord("data.pkl");
  const at::DataPtr pickle = std::move(std::get<0>(record));
  const size_t pickle_size = std::get<1>(record);  // not a structured binding: lambdas capture it
  const char* data = static_cast<const char*>(pickle.get());
  check_pickle_lengths(data, pickle_size, path);
  size_t done = 0;
  auto read = [&](char* buffer, size_t len) -> size_t {
    if (done >= pickle_size) return 0;
    len = std::min(pickle_size - done, len);
    std::memcpy(buffer, data + done, len);
    done += len;
    return len;
  };
  auto read_record = [&](const std::string& name) {
    auto [ptr, size] = reader.getRecord("data/" + name);
    records[ptr.get()] = size;
    return std::move(ptr);
  };
  // On the CPU whatever device a tensor was saved from (map_location='cpu'): its storage stays
  // the record's buffer, which the checks compare.
  torch::jit::Unpickler unpickler(read, nullptr, nullptr, read_record, at::Device(at::kCPU));
  unpickler.set_version(reader.version());
  return unpickler.parse_ivalue();
}
}  // namespace

c10::impl::GenericDict read_checkpoint_file(const std::string& path) {
  {
    std::ifstream in(path, std::ios::binary);
    TORCH_CHECK(in, "actmem::read_checkpoint_file: cannot open ", path, ": ", errno_text());
  }
  std::error_code ec;
  const auto file_bytes = std::filesystem::file_size(path, ec);
  TORCH_CHECK(!ec, "actmem::read_checkpoint_file: ", path,
              " is not a readable file: ", ec.message());
  c10::IValue value;
  RecordSizes records;
  try {
    value = unpickle_checkpoint(path, records);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "actmem::read_checkpoint_file: ", path, " (", file_bytes,
                " bytes) is "
                "not a readable torch pickle (truncated or not a checkpoint): ",
                e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "actmem::read_checkpoint_file: ", path, " (", file_bytes,
                " bytes) is "
                "not a readable torch pickle (truncated or not a checkpoint): ",
                e.what());
  }
  TORCH_CHECK(value.isGenericDict(), "actmem::read_checkpoint_file: ", path,
              " holds a ", value.tagKind(), ", not a checkpoint dict");
  check_tensor_records(value, records, path);  // Note [Tensor records cover their tensors]
  return value.toGenericDict();
}

c10::IValue json_to_ivalue(const nlohmann::json& j) {
  using T = nlohmann::json::value_t;
  switch (j.type()) {
    case T::null:
      return c10::IValue();
    case T::boolean:
      return c10::IValue(j.get<bool>());
    case T::number_integer:
      return c10::IValue(j.get<int64_t>());
    case T::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      TORCH_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                  "actmem::json_to_ivalue: ", u, " does not fit a pickled int");
      return c10::IValue(static_cast<int64_t>(u));
    }
    case T::number_float:
      return c10::IValue(j.get<double>());
    case T::string:
      return c10::IValue(j.get<std::string>());
    case T::array: {
      c10::impl::GenericList list(c10::AnyType::get());
      for (const auto& v : j) list.push_back(json_to_ivalue(v));
      return list;
    }
    case T::object: {
      auto d = string_dict();
      for (const auto& [k, v] : j.items()) d.insert(k, json_to_ivalue(v));
      return d;
    }
    default:
      TORCH_CHECK(false, "actmem::json_to_ivalue: unsupported JSON value ", j.dump());
  }
}

nlohmann::json ivalue_to_json(const c10::IValue& v) {
  if (v.isNone()) return nullptr;
  if (v.isBool()) return v.toBool();
  if (v.isInt()) return v.toInt();
  if (v.isDouble()) return v.toDouble();
  if (v.isString()) return v.toStringRef();
  if (v.isList()) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& e : v.toListRef()) a.push_back(ivalue_to_json(e));
    return a;
  }
  if (v.isGenericDict()) {
    nlohmann::json o = nlohmann::json::object();
    for (const auto& e : v.toGenericDict()) {
      TORCH_CHECK(e.key().isString(), "actmem::ivalue_to_json: a dict key is not a string");
      o[e.key().toStringRef()] = ivalue_to_json(e.value());
    }
    return o;
  }
  TORCH_CHECK(false, "actmem::ivalue_to_json: cannot represent a ", v.tagKind(), " as JSON");
}

// ---- ExitSignalHandler -------------------------------------------------------------------------

namespace {
std::atomic<int> g_exit_signal{0};
std::atomic<bool> g_handler_installed{false};
struct sigaction g_previous_term, g_previous_int;
extern "C" void record_exit_signal(int sig) { g_exit_signal.store(sig); }
}  // namespace

ExitSignalHandler::ExitSignalHandler() {
  TORCH_CHECK(!g_handler_installed.exchange(true),
              "actmem::ExitSignalHandler: one is installed already");
  g_exit_signal.store(0);
  struct sigaction action {};
  action.sa_handler = record_exit_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESETHAND;  // a second signal takes the default action: exit now
  ::sigaction(SIGTERM, &action, &g_previous_term);
  ::sigaction(SIGINT, &action, &g_previous_int);
}

ExitSignalHandler::~ExitSignalHandler() {
  ::sigaction(SIGTERM, &g_previous_term, nullptr);
  ::sigaction(SIGINT, &g_previous_int, nullptr);
  g_handler_installed.store(false);
}

int ExitSignalHandler::received() const { return g_exit_signal.load(); }

// ---- Trainer: what a checkpoint holds ----------------------------------------------------------

void load_model_state(GPTModel& model, const c10::impl::GenericDict& ckpt, const std::string& path) {
  const c10::impl::GenericDict state = dict_entry(ckpt, "model", path);
  const auto named = model.named_parameters(/*recurse=*/true);
  for (const auto& e : state) {
    TORCH_CHECK(e.key().isString() && named.find(e.key().toStringRef()) != nullptr,
                "actmem::load_checkpoint: ", path, " has a parameter this model does not: ", e.key());
  }
  at::NoGradGuard no_grad;
  for (const auto& item : named) {
    const auto it = state.find(item.key());
    TORCH_CHECK(it != state.end() && it->value().isTensor(), "actmem::load_checkpoint: ", path,
                " has no tensor for parameter ", item.key());
    const at::Tensor t = it->value().toTensor();
    at::Tensor p = item.value();
    TORCH_CHECK(t.sizes() == p.sizes() && t.scalar_type() == p.scalar_type(),
                "actmem::load_checkpoint: ", item.key(), " is ", t.sizes(), " ", t.scalar_type(),
                " in ", path, " but ", p.sizes(), " ", p.scalar_type(), " in this model");
    p.copy_(t);
  }
}

TransformerConfig config_from_args(const nlohmann::json& a) {
  TransformerConfig c;
  // A field of the wrong JSON type (a damaged or hand-edited checkpoint) is a clear error naming
  // it, not nlohmann's type_error escaping the library's TORCH_CHECK contract.
  auto read = [&a](const char* key, auto& field) {
    try {
      field = a[key].get<std::decay_t<decltype(field)>>();
    } catch (const nlohmann::json::exception&) {
      const std::string value = a[key].dump();
      TORCH_CHECK(false, "actmem::config_from_args: the checkpoint's args field ", key, " is ",
                  value.size() > 64 ? value.substr(0, 64) + "..." : value,
                  ", not a value of the field's type");
    }
  };
  auto get = [&a, &read](const char* key, auto& field) {
    if (a.contains(key) && !a[key].is_null()) read(key, field);
  };
  auto get_opt = [&a, &read](const char* key, auto& field) {  // an optional field; null = unset
    if (a.contains(key) && !a[key].is_null()) {
      typename std::decay_t<decltype(field)>::value_type v{};
      read(key, v);
      field = v;
    }
  };
  get("num_layers", c.num_layers);
  get("hidden_size", c.hidden_size);
  get("num_attention_heads", c.num_attention_heads);
  get("num_query_groups", c.num_query_groups);
  if (c.num_query_groups == c.num_attention_heads) c.num_query_groups = 0;  // one per head
  get("ffn_hidden_size", c.ffn_hidden_size);
  get("seq_length", c.seq_length);
  get("max_position_embeddings", c.max_position_embeddings);
  get("vocab_size", c.vocab_size);
  get("attention_dropout", c.attention_dropout);
  get("hidden_dropout", c.hidden_dropout);
  get("normalization", c.normalization);
  get("layernorm_epsilon", c.layernorm_epsilon);
  get("gated_linear_unit", c.gated_linear_unit);
  get("add_bias_linear", c.add_bias_linear);
  get("position_embedding_type", c.position_embedding_type);
  get("rotary_base", c.rotary_base);
  get("rotary_percent", c.rotary_percent);
  get("apply_layernorm_1p", c.layernorm_zero_centered_gamma);
  get("qk_layernorm", c.qk_layernorm);
  get("attention_output_gate", c.attention_output_gate);
  std::optional<int64_t> kv_channels;
  get_opt("kv_channels", kv_channels);
  if (kv_channels && c.num_attention_heads > 0 &&
      *kv_channels * c.num_attention_heads != c.hidden_size) {
    c.kv_channels_arg = kv_channels;
  }
  get("untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights);
  get("init_method_std", c.init_method_std);
  get("seed", c.seed);
  get("bf16", c.bf16);
  get("fp16", c.fp16);
  get("attention_softmax_in_fp32", c.attention_softmax_in_fp32);
  get("tensor_model_parallel_size", c.tensor_model_parallel_size);
  get("multi_latent_attention", c.multi_latent_attention);
  if (c.multi_latent_attention) {
    get_opt("q_lora_rank", c.q_lora_rank);
    get("kv_lora_rank", c.kv_lora_rank);
    get("qk_head_dim", c.qk_head_dim);
    get("qk_pos_emb_head_dim", c.qk_pos_emb_head_dim);
    get("v_head_dim", c.v_head_dim);
    get("rope_type", c.rope_type);
    get("rotary_scaling_factor", c.rotary_scaling_factor);
    get("mscale", c.mscale);
    get("mscale_all_dim", c.mscale_all_dim);
  }
  get("num_moe_experts", c.num_moe_experts);
  if (c.is_moe()) {
    get("moe_router_topk", c.moe_router_topk);
    int64_t moe_ffn = 0;
    get("moe_ffn_hidden_size", moe_ffn);
    if (moe_ffn > 0) c.moe_ffn_hidden_size = moe_ffn;
    get("moe_layer_freq", c.moe_layer_freq);
    get("moe_router_score_function", c.moe_router_score_function);
    get("moe_router_pre_softmax", c.moe_router_pre_softmax);
    get("moe_router_dtype", c.moe_router_dtype);  // null: the model's type
    get_opt("moe_router_topk_scaling_factor", c.moe_router_topk_scaling_factor);
    get_opt("moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size);
    get("moe_shared_expert_gate", c.moe_shared_expert_gate);
    get_opt("moe_expert_capacity_factor", c.moe_expert_capacity_factor);
    get("moe_pad_expert_input_to_capacity", c.moe_pad_expert_input_to_capacity);
    get("moe_token_drop_policy", c.moe_token_drop_policy);
    get("moe_grouped_gemm", c.moe_grouped_gemm);
    get("moe_token_dispatcher_type", c.moe_token_dispatcher_type);
    get("expert_model_parallel_size", c.expert_model_parallel_size);
  }
  c.micro_batch_size = 1;
  return c;
}

LoadedModel load_model_for_inference(const std::string& dir) {
  const std::optional<int64_t> latest = read_latest_checkpointed_iteration(dir);
  TORCH_CHECK(latest.has_value(), "actmem::load_model_for_inference: ", dir, " has no ",
              kLatestCheckpointFile, " (train with --save ", dir, " first)");
  LoadedModel out;
  out.path = checkpoint_file(dir, *latest, 0);
  std::error_code ec;
  // mp_rank_00_000 is expert rank 0's file or stage 0's (Megatron's names): its args tell which;
  // mp_rank_00_000_000 is stage 0's and expert rank 0's.
  std::string split = checkpoint_file(dir, *latest, 0, 0);
  if (!fs::exists(split, ec)) split = checkpoint_file(dir, *latest, 0, 0, 0);
  if (!fs::exists(out.path, ec) && fs::exists(split, ec)) {
    const nlohmann::json args = ivalue_to_json(entry(read_checkpoint_file(split), "args", split));
    const bool pipeline = args.value("pipeline_model_parallel_size", int64_t{1}) > 1;
    const bool experts = args.value("expert_model_parallel_size", int64_t{1}) > 1;
    TORCH_CHECK(false, "actmem::load_model_for_inference: ", dir, " was saved with ",
                pipeline && experts ? "pipeline and expert parallelism (one file per stage and "
                                      "expert-parallel rank, "
                : pipeline          ? "pipeline parallelism (one file per stage, "
                                    : "expert parallelism (one file per expert-parallel rank, ",
                split, ", ...); inference loads a single-process checkpoint: train with ",
                pipeline && experts ? "--pipeline-model-parallel-size 1 --expert-model-parallel-size 1"
                : pipeline          ? "--pipeline-model-parallel-size 1"
                                    : "--expert-model-parallel-size 1",
                " or load it under the same launch with --load");
  }
  const c10::impl::GenericDict ckpt = read_checkpoint_file(out.path);
  const nlohmann::json args = ivalue_to_json(entry(ckpt, "args", out.path));
  out.args_json = args.dump();
  out.iteration = entry(ckpt, "iteration", out.path).toInt();
  const TransformerConfig config = config_from_args(args);
  TORCH_CHECK(config.tensor_model_parallel_size == 1, "actmem::load_model_for_inference: ", out.path,
              " is one of ", config.tensor_model_parallel_size, " tensor-parallel shards; "
              "generation loads a checkpoint of tensor_model_parallel_size 1");
  config.validate_shape();
  out.model = std::make_shared<GPTModel>(config);
  load_model_state(*out.model, ckpt, out.path);
  out.model->eval();
  return out;
}

namespace {
int64_t consumed_samples(const TrainState& s) {
  return s.train_data.batches_drawn() * s.model_config.micro_batch_size;
}

// Every replica's random states, one list entry per expert-data-parallel rank (a collective).
c10::impl::GenericList replica_rng_states(const TrainState& s);

// The checkpoint file's dict; a collective over the data-parallel replicas, each calling it, only
// the writers (`write`) building the dict.
c10::impl::GenericDict checkpoint_state(const TrainState& s, bool write) {
  // The collectives first, on every replica (save_checkpoint): each replica's random streams, and
  // with the distributed optimizer every data-parallel rank's pieces of the optimizer state.
  const c10::impl::GenericList rng_list = replica_rng_states(s);
  MixedPrecisionOptimizer* mixed = s.optimizer.mixed();
  const OptimizerShards* shards = s.optimizer.shards();
  const std::vector<at::Tensor>& params = s.optimizer.params();
  torch::optim::AdamW& adamw = s.optimizer.adamw();
  AdamWMoments moments = adamw_moments(adamw, s.optimizer.adamw_params());
  std::vector<at::Tensor> mains;
  if (mixed) mains = mixed->main_params();
  if (shards) {
    moments = unshard(*shards, params, std::move(moments));
    if (mixed) mains = unshard(*shards, params, mains);
  }
  auto top = string_dict();
  if (!write) return top;
  nlohmann::json args = to_json(s.model_config);
  const nlohmann::json training = to_json(s.config);
  for (const auto& [k, v] : training.items()) args[k] = v;
  args["iteration"] = s.iteration;
  args["consumed_train_samples"] = consumed_samples(s);
  top.insert("args", json_to_ivalue(args));
  top.insert("checkpoint_version", kCheckpointVersion);
  top.insert("iteration", s.iteration);

  c10::impl::GenericDict model(c10::StringType::get(), c10::TensorType::get());
  for (const auto& item : s.model.named_parameters(/*recurse=*/true)) {
    model.insert(item.key(), host_copy(item.value()));
  }
  top.insert("model", model);

  if (mixed) {
    // Megatron's Float16OptimizerWithFloat16Params.state_dict().
    auto opt = string_dict();
    opt.insert("optimizer", adamw_state_dict(adamw, moments));
    if (const auto& scaler = mixed->scaler()) {
      auto gs = string_dict();
      gs.insert("scale", static_cast<double>(scaler->scale()));
      gs.insert("growth_tracker", scaler->growth_tracker());
      gs.insert("hysteresis_tracker", scaler->hysteresis_left());
      opt.insert("grad_scaler", gs);
    } else {
      opt.insert("grad_scaler", c10::IValue());
    }
    c10::List<at::Tensor> main_list;
    for (const auto& p : mains) main_list.push_back(host_copy(p));
    c10::impl::GenericList groups(c10::AnyType::get());
    groups.push_back(main_list);
    opt.insert("fp32_from_fp16_params", groups);
    top.insert("optimizer", opt);
  } else {
    top.insert("optimizer", adamw_state_dict(adamw, moments));
  }

  // Megatron's OptimizerParamScheduler.state_dict(): its steps count samples.
  const TrainingConfig& c = s.config;
  const LrScheduleSteps& steps = s.scheduler.steps();
  auto sched = string_dict();
  sched.insert("max_lr", c.lr);
  sched.insert("min_lr", c.min_lr);
  sched.insert("lr_warmup_steps", warmup_steps_value(steps));
  sched.insert("lr_decay_steps", steps.decay);
  sched.insert("lr_decay_style", c.lr_decay_style);
  sched.insert("num_steps", s.scheduler.num_samples());
  top.insert("opt_param_scheduler", sched);

  top.insert("rng_state", rng_list);
  return top;
}

c10::impl::GenericList replica_rng_states(const TrainState& s) {
  // Megatron's rng_state with data_parallel_random_init: one entry per data-parallel replica (of
  // the ranks that write this file: the expert-data-parallel group), since the replicas' streams
  // can differ: expert dropout draws per token routed to the rank's experts, and those counts
  // follow each replica's own data. Every state is gathered in one order on every replica.
  const TensorParallelGroup& replicas = expert_data_parallel_group();
  std::vector<std::pair<std::string, at::Tensor>> states = {{"torch_rng_state", s.rng_state[0]}};
  if (s.rng_state.size() > 1) states.emplace_back("cuda_rng_state", s.rng_state[1]);
  const auto streams = s.rng_tracker.get_states();  // a std::map: the same order everywhere
  for (const auto& [name, state] : streams) states.emplace_back(name, state);
  std::vector<at::Tensor> gathered;  // per state: [replicas, bytes] on the host
  for (const auto& [name, state] : states) {
    const at::Tensor bytes = state.to(at::kCPU).contiguous().view({1, -1});
    gathered.push_back(replicas.size == 1
                           ? bytes
                           : group_all_gather_dim0(replicas, bytes.to(s.device)).to(at::kCPU));
  }
  c10::impl::GenericList list(c10::AnyType::get());
  for (int r = 0; r < replicas.size; ++r) {
    auto rng = string_dict();
    size_t k = 0;
    rng.insert("torch_rng_state", gathered[k++][r].clone());
    if (s.rng_state.size() > 1) rng.insert("cuda_rng_state", gathered[k++][r].clone());
    c10::impl::GenericDict tracker(c10::StringType::get(), c10::TensorType::get());
    for (const auto& item : streams) tracker.insert(item.first, gathered[k++][r].clone());
    rng.insert("rng_tracker_states", tracker);
    list.push_back(rng);
  }
  return list;
}

void check_checkpoint_args(const TrainState& s, const nlohmann::json& args, const std::string& path);
}  // namespace

std::string save_checkpoint(const std::string& dir, const TrainState& s) {
  TORCH_CHECK(!dir.empty(), "actmem::Trainer::save_checkpoint: empty directory");
  const auto& tp = tensor_parallel_group();
  const int64_t iteration = s.iteration;
  const at::Device& device = s.device;
  const std::string final_dir = checkpoint_iteration_dir(dir, iteration);
  // Data-parallel replicas hold the same weights, optimizer state and random states: the first
  // replica's tensor-parallel ranks write (as Megatron's data-parallel rank 0 does without the
  // distributed optimizer). With expert parallelism the replicas are those of the experts
  // (Megatron's expert_data_parallel_rank 0 writes): each expert-parallel rank writes its
  // experts, with the dense weights every such file has. The distributed optimizer's state is
  // first gathered from every data-parallel rank (a collective), so that the files are the same
  // as without it.
  const TensorParallelGroup& replicas = expert_data_parallel_group();
  const c10::impl::GenericDict state = checkpoint_state(s, /*write=*/replicas.rank == 0);
  const bool leader =
      tp.rank == 0 && expert_parallel_group().rank == 0 && pipeline_parallel_group().rank == 0;
  const std::string tmp_dir = final_dir + ".tmp";
  std::exception_ptr error;
  if (replicas.rank == 0) {
    try {
      on_all_ranks(device, "to prepare the checkpoint directory", [&] {
        if (!leader) return;
        std::error_code ec;
        fs::create_directories(dir, ec);
        TORCH_CHECK(!ec && fs::is_directory(dir), "actmem::Trainer::save_checkpoint: cannot create "
                    "the directory ", dir, ": ", ec.message());
        fs::remove_all(tmp_dir, ec);  // a crashed save's leftovers
        TORCH_CHECK(!ec, "actmem::Trainer::save_checkpoint: cannot remove ", tmp_dir, ": ",
                    ec.message());
        fs::create_directories(tmp_dir, ec);
        TORCH_CHECK(!ec, "actmem::Trainer::save_checkpoint: cannot create ", tmp_dir, ": ",
                    ec.message());
      });
      // Move 1: every rank's file, durable.
      on_all_ranks(device, "to write its file", [&] {
        const fs::path rank_dir =
            fs::path(tmp_dir) / rank_dir_name(tp.rank, file_ep_rank(), file_pp_rank());
        std::error_code ec;
        fs::create_directories(rank_dir, ec);
        TORCH_CHECK(!ec, "actmem::Trainer::save_checkpoint: cannot create ", rank_dir.string(), ": ",
                    ec.message());
        const std::vector<char> bytes = save_untagged(state);
        const std::string path = (rank_dir / "model_optim_rng.pt").string();
        write_durably(path, bytes.data(), bytes.size(), iteration);
        fsync_path(rank_dir.string(), true);
      });
      // Moves 2 and 3, on rank 0.
      on_all_ranks(device, "to publish the checkpoint", [&] {
        if (!leader) return;
        fsync_path(tmp_dir, true);
        maybe_fault("before-publish", iteration);
        publish_directory(tmp_dir, final_dir);
        fsync_path(dir, true);
        maybe_fault("before-latest", iteration);
        const std::string latest = (fs::path(dir) / kLatestCheckpointFile).string();
        const std::string text = std::to_string(iteration);
        write_durably(latest + ".tmp", text.data(), text.size());
        TORCH_CHECK(::rename((latest + ".tmp").c_str(), latest.c_str()) == 0,
                    "actmem::Trainer::save_checkpoint: cannot rename ", latest, ".tmp: ", errno_text());
        fsync_path(dir, true);
      });
    } catch (...) {
      error = std::current_exception();
    }
  }
  // Megatron's save_checkpoint ends at a barrier: every replica returns once the checkpoint is
  // published (a load right after it finds it), or learns that its writer failed.
  if (replicas.size > 1) {
    const at::Tensor failed = at::full({1}, error ? 1.0f : 0.0f,
                                       at::TensorOptions().dtype(at::kFloat).device(device));
    const bool ok = group_all_reduce_sum(replicas, failed).item<float>() == 0.0f;
    if (error) std::rethrow_exception(error);
    TORCH_CHECK(ok, "actmem::Trainer::save_checkpoint: the data-parallel replica that writes ",
                final_dir, " failed (its error is in its output)");
  } else if (error) {
    std::rethrow_exception(error);
  }
  return final_dir;
}

namespace {
void check_checkpoint_args(const TrainState& s, const nlohmann::json& args, const std::string& path) {
  const nlohmann::json mine = to_json(s.model_config);
  std::vector<std::string> fields(std::begin(kShapeFields), std::end(kShapeFields));
  if (s.model_config.learned_positions()) fields.emplace_back("max_position_embeddings");
  // MLA fields (checkpoints saved before MLA existed do not record them: standard attention).
  const bool ckpt_mla = args.contains("multi_latent_attention") && args["multi_latent_attention"].get<bool>();
  TORCH_CHECK(ckpt_mla == s.model_config.multi_latent_attention, "actmem::Trainer::load_checkpoint: "
              "the checkpoint has ", ckpt_mla ? "multi-latent" : "standard", " attention but this "
              "run has ", s.model_config.multi_latent_attention ? "multi-latent" : "standard",
              " attention (", path, ")");
  if (ckpt_mla) {
    for (const char* f :
         {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
          "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim"}) {
      fields.emplace_back(f);
    }
  }
  // Grouped-query attention (checkpoints saved before it existed do not record the groups: one
  // group per head).
  if (!s.model_config.multi_latent_attention) {
    const nlohmann::json ckpt_groups =
        args.contains("num_query_groups") && !args["num_query_groups"].is_null()
            ? args["num_query_groups"]
            : args["num_attention_heads"];
    TORCH_CHECK(ckpt_groups == mine["num_query_groups"],
                "actmem::Trainer::load_checkpoint: the "
                "checkpoint has num_query_groups = ",
                ckpt_groups.dump(),
                " but this run has "
                "num_query_groups = ",
                mine["num_query_groups"].dump(), " (", path, ")");
  }
  // MoE fields (checkpoints of dense models saved before MoE existed do not record them: null).
  const bool ckpt_moe = args.contains("num_moe_experts") && !args["num_moe_experts"].is_null();
  if (ckpt_moe || s.model_config.is_moe()) {
    TORCH_CHECK(ckpt_moe == s.model_config.is_moe(), "actmem::Trainer::load_checkpoint: the "
                "checkpoint has num_moe_experts = ", ckpt_moe ? args["num_moe_experts"].dump() : "null",
                " but this run has num_moe_experts = ", mine["num_moe_experts"].dump(), " (", path, ")");
    for (const char* f : {"num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq",
                          "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                          "moe_grouped_gemm", "expert_model_parallel_size"}) {
      fields.emplace_back(f);
    }
  }
  // Which layers a stage (and each of its model chunks) holds. A checkpoint from before pipeline
  // parallelism records none of these: it is a one-stage one.
  const auto ckpt_p = args.contains("pipeline_model_parallel_size")
                          ? args["pipeline_model_parallel_size"].get<int64_t>()
                          : int64_t{1};
  if (ckpt_p > 1 || s.model_config.pipeline_model_parallel_size > 1) {
    for (const char* f : {"pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                          "decoder_last_pipeline_num_layers", "virtual_pipeline_model_parallel_size"}) {
      fields.emplace_back(f);
    }
  }
  for (const auto& f : fields) {
    TORCH_CHECK(args.contains(f), "actmem::Trainer::load_checkpoint: ", path, " does not record ",
                f, " in its args; cannot tell whether it fits this model");
    TORCH_CHECK(args[f] == mine[f], "actmem::Trainer::load_checkpoint: the checkpoint has ", f,
                " = ", args[f].dump(), " but this run has ", f, " = ", mine[f].dump(), " (", path,
                "); a checkpoint loads only into the model shape, tensor-, pipeline- and "
                "expert-parallel layout and precision it was saved with");
  }
  // Fields that shape or name parameters, recorded since they existed: an older checkpoint
  // without one was saved with its default.
  const nlohmann::json defaults = {{"qk_layernorm", false},
                                   {"attention_output_gate", false},
                                   {"apply_layernorm_1p", false},
                                   {"rotary_percent", 1.0},
                                   {"kv_channels", nlohmann::json(nullptr)}};
  for (const auto& [f, fallback] : defaults.items()) {
    nlohmann::json theirs = args.contains(f) ? args[f] : fallback;
    if (f == "kv_channels" && !args.contains(f) && !mine[f].is_null() &&
        args.contains("hidden_size") && args.contains("num_attention_heads")) {
      theirs = args["hidden_size"].get<int64_t>() / args["num_attention_heads"].get<int64_t>();
    }
    TORCH_CHECK(theirs == mine[f], "actmem::Trainer::load_checkpoint: the checkpoint has ", f,
                " = ", theirs.dump(), " but this run has ", f, " = ", mine[f].dump(), " (", path,
                "); a checkpoint loads only into the model shape it was saved with");
  }
}

}  // namespace

namespace {
// Megatron's OptimizerParamScheduler.load_state_dict with _check_and_set.
void load_scheduler(const TrainState& s, const c10::impl::GenericDict& ckpt,
                    const std::string& path, const CheckpointLoadOptions& options) {
  const c10::impl::GenericDict sched = dict_entry(ckpt, "opt_param_scheduler", path);
  const LrScheduleSteps& steps = s.scheduler.steps();
  // Megatron's OptimizerParamScheduler._check_and_set: the run's values must match the
  // checkpoint's unless --override-opt_param-scheduler.
  auto text = [](const c10::IValue& v) {  // 0.003, not 0.0030000000000000001
    return v.isString() ? v.toStringRef() : ivalue_to_json(v).dump();
  };
  auto check = [&](const c10::IValue& mine, const char* key, const char* name,
                   bool in_samples) {
    const c10::IValue& theirs = entry(sched, key, path);
    TORCH_CHECK(options.override_scheduler || mine == theirs,
                "OptimizerParamScheduler: class input value ", text(mine), " and checkpoint value ",
                text(theirs), " for ", name, " do not match",
                in_samples ? " (counted in samples: the global batches of those iterations)"
                           : std::string(),
                " (", path, "; pass --override-opt_param-scheduler to use this run's value)");
  };
  check(s.config.lr, "max_lr", "learning rate", false);
  check(s.config.min_lr, "min_lr", "minimum learning rate", false);
  check(warmup_steps_value(steps), "lr_warmup_steps", "warmup iterations", true);
  check(steps.decay, "lr_decay_steps", "total number of iterations", true);
  check(s.config.lr_decay_style, "lr_decay_style", "learning rate decay style", false);
  const int64_t num_steps = entry(sched, "num_steps", path).toInt();
  TORCH_CHECK(num_steps >= 0, "actmem::Trainer::load_checkpoint: ", path,
              ": the schedule is at sample ", num_steps, "; expected a count of samples, from 0");
  s.scheduler.set_num_samples(num_steps);
}

// The optimizer's state: AdamW's moments, and at 16 bits the fp32 main parameters and the loss
// scaler (Megatron's Float16OptimizerWithFloat16Params.load_state_dict).
void load_optimizer(const TrainState& s, const c10::impl::GenericDict& ckpt,
                    const std::string& path) {
  const c10::impl::GenericDict opt = dict_entry(ckpt, "optimizer", path);
  const OptimizerShards* shards = s.optimizer.shards();
  const std::vector<at::Tensor>& params = s.optimizer.params();
  if (MixedPrecisionOptimizer* mixed = s.optimizer.mixed()) {
    TORCH_CHECK(opt.contains("fp32_from_fp16_params"), "actmem::Trainer::load_checkpoint: ", path,
                " has no fp32 main parameters (saved by an fp32 run)");
    load_adamw_state(mixed->adamw(), mixed->main_params(), dict_entry(opt, "optimizer", path),
                     path, shards, params);
    const auto groups = entry(opt, "fp32_from_fp16_params", path).toListRef();
    TORCH_CHECK(groups.size() == 1 && groups[0].isList(), "actmem::Trainer::load_checkpoint: ",
                path, ": fp32_from_fp16_params should hold one parameter group");
    const auto mains = groups[0].toListRef();
    const auto& mine = mixed->main_params();
    TORCH_CHECK(mains.size() == mine.size(), "actmem::Trainer::load_checkpoint: ", path, " has ",
                mains.size(), " fp32 main parameters, this model ", mine.size());
    at::NoGradGuard no_grad;
    for (const auto i : c10::irange(mine.size())) {
      const at::Tensor t = mains[i].toTensor();
      TORCH_CHECK(t.sizes() == params[i].sizes() && t.scalar_type() == at::kFloat,
                  "actmem::Trainer::load_checkpoint: ", path, ": fp32 main parameter ", i,
                  " is ", t.sizes(), " ", t.scalar_type(), ", expected ", params[i].sizes(),
                  " Float");
      mine[i].copy_(shards ? shards->shard(t.contiguous(), i) : t);
    }
    const c10::IValue& gs = entry(opt, "grad_scaler", path);
    if (auto& scaler = mixed->scaler(); scaler && gs.isGenericDict()) {
      const auto d = gs.toGenericDict();
      scaler->load_state(static_cast<float>(entry(d, "scale", path).toDouble()),
                         entry(d, "growth_tracker", path).toInt(),
                         entry(d, "hysteresis_tracker", path).toInt());
    }
  } else {
    TORCH_CHECK(!opt.contains("fp32_from_fp16_params"), "actmem::Trainer::load_checkpoint: ",
                path, " holds a 16-bit run's optimizer");
    load_adamw_state(s.optimizer.adamw(), s.optimizer.adamw_params(), opt, path, shards, params);
  }
}

// The random states: the default generators' and the tracker's named streams.
void load_rng(const TrainState& s, const c10::impl::GenericDict& ckpt, const std::string& path) {
  // One entry per replica of the saving run (replica_rng_states): this replica's when the run
  // has as many, else the first (another data-parallel size: the streams cannot continue as
  // they were anyway; a checkpoint of one replica has one).
  const auto list = entry(ckpt, "rng_state", path).toListRef();
  const auto replicas = static_cast<size_t>(expert_data_parallel_group().size);
  const size_t mine = list.size() == replicas ? static_cast<size_t>(expert_data_parallel_group().rank) : 0;
  TORCH_CHECK(!list.empty() && list[mine].isGenericDict(), "actmem::Trainer::load_checkpoint: ",
              path, ": rng_state should hold one dict per data-parallel replica, has ",
              list.size(), " entries");
  const auto rng = list[mine].toGenericDict();
  s.rng_state[0] = entry(rng, "torch_rng_state", path).toTensor().clone();
  if (s.rng_state.size() > 1) {
    TORCH_CHECK(rng.contains("cuda_rng_state"), "actmem::Trainer::load_checkpoint: ", path,
                " was saved without a device generator state (a CPU run); pass --no-load-rng");
    s.rng_state[1] = entry(rng, "cuda_rng_state", path).toTensor().clone();
  }
  std::map<std::string, at::Tensor> streams;
  for (const auto& e : dict_entry(rng, "rng_tracker_states", path)) {
    streams[e.key().toStringRef()] = e.value().toTensor().clone();
  }
  for (const auto& [name, state] : s.rng_tracker.get_states()) {
    TORCH_CHECK(streams.count(name), "actmem::Trainer::load_checkpoint: ", path,
                " has no state for the random stream ", name);
    (void)state;
  }
  s.rng_tracker.set_states(streams);
}
}  // namespace

std::optional<int64_t> load_checkpoint(const std::string& dir, const TrainState& s,
                                       const CheckpointLoadOptions& options) {
  const std::optional<int64_t> latest = read_latest_checkpointed_iteration(dir);
  if (!latest) return std::nullopt;
  const auto& tp = tensor_parallel_group();
  std::string path = checkpoint_file(dir, *latest, tp.rank, file_ep_rank(), file_pp_rank());
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    // Another tensor-, expert- or pipeline-parallel size names the mismatch; otherwise the file
    // is missing.
    for (const int64_t pp_rank : {int64_t{-1}, int64_t{0}}) {
      for (const int64_t ep_rank : {int64_t{-1}, int64_t{0}}) {
        const std::string first = checkpoint_file(dir, *latest, 0, ep_rank, pp_rank);
        if (fs::exists(first, ec)) {
          check_checkpoint_args(s, ivalue_to_json(entry(read_checkpoint_file(first), "args", first)),
                                first);
        }
      }
    }
    TORCH_CHECK(false, "actmem::Trainer::load_checkpoint: ", dir, "/", kLatestCheckpointFile,
                " names iteration ", *latest, " but ", path, " does not exist");
  }
  const c10::impl::GenericDict ckpt = read_checkpoint_file(path);
  const nlohmann::json args = ivalue_to_json(entry(ckpt, "args", path));
  check_checkpoint_args(s, args, path);
  const c10::IValue& version = entry(ckpt, "checkpoint_version", path);
  TORCH_CHECK(version.isDouble() && version.toDouble() >= 3.0, "actmem::Trainer::load_checkpoint: ",
              path, " has checkpoint_version ", version, "; actmem reads version 3.0 and later");

  load_model_state(s.model, ckpt, path);

  const bool optimizer = options.optimizer && !options.finetune;
  if (options.finetune) {
    s.iteration = 0;
    s.scheduler.set_num_samples(0);
    s.train_data.seek(0);
  } else {
    s.iteration = entry(ckpt, "iteration", path).toInt();
    const int64_t consumed = args.value("consumed_train_samples", int64_t{-1});
    TORCH_CHECK(consumed >= 0 && consumed % s.model_config.micro_batch_size == 0,
                "actmem::Trainer::load_checkpoint: ", path, " records consumed_train_samples ",
                consumed, ", which is not a whole number of this run's micro-batches (",
                s.model_config.micro_batch_size, " samples)");
    s.train_data.seek(consumed / s.model_config.micro_batch_size);
  }

  if (optimizer) {
    load_scheduler(s, ckpt, path, options);
    load_optimizer(s, ckpt, path);
  } else {
    // Megatron's reload_model_params: the fp32 main parameters start from the loaded model.
    // Without the optimizer state the schedule starts again from its first step.
    s.scheduler.set_num_samples(0);
    if (MixedPrecisionOptimizer* mixed = s.optimizer.mixed()) {
      at::NoGradGuard no_grad;
      mixed->reload_main_params();
    }
  }

  if (options.rng && !options.finetune) load_rng(s, ckpt, path);
  return s.iteration;
}

}  // namespace actmem
