// checkpoint_file.cpp — one checkpoint file: pickled as Python's torch.load reads it (with
// weights_only), and read back with every length and tensor record checked before it is trusted
// (checkpoint.h: read_checkpoint_file, json_to_ivalue, ivalue_to_json).
#include "actmem/train/checkpoint.h"

#include "checkpoint_io.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>

namespace actmem {

namespace {
// Note [Checkpoints Python loads with weights_only]
// torch.load has defaulted to weights_only=True since PyTorch 2.6: the unpickler accepts only
// dicts, lists, tuples, primitives and tensors (torch._utils._rebuild_tensor_v2 and the storage
// types). torch::jit::pickle_save tags every dict and list with its element types through the
// GLOBAL torch.jit._pickle.restore_type_tag, which that unpickler refuses ("Unsupported global").
// It also writes a list of floats, ints, bools or tensors through
// torch.jit._pickle.build_doublelist (build_intlist, ...), equally refused. So the value is first
// rebuilt with generic lists (untyped()), then pickled as pickle_save does
// (torch/csrc/jit/serialization/pickle.cpp) with the Pickler's tag_aggregates off: the same zip
// container and tensor records, plain containers, which both Python's torch.load (either mode) and
// torch::jit::pickle_load read.
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

}  // namespace

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
//
// The memo: a PUT's index sizes the unpickler's memo table (Unpickler::setInput resizes it to the
// index + 1; an index of 2^32 - 1 asked for 22 GB, found by fuzzing). Python's pickler numbers its
// entries 0, 1, 2, ... (len(memo)); an index beyond the entries so far is refused, and a GET must
// name one of them.

// What follows an opcode.
enum class PickleArgument : uint8_t {
  kUnknown,  // not an opcode of the table
  kStop,
  kNone,
  kUint1,
  kUint2,
  kUint4,
  kUint8,
  kString1,
  kString4,
  kString4Signed,
  kString8,  // a length of n bytes, then the bytes
  kLine,
  kTwoLines,  // text up to a newline
  kPut1,
  kPut4,
  kMemoize,
  kGet1,
  kGet4,  // the memo
};

PickleArgument pickle_argument(uint8_t op) {
  using A = PickleArgument;
  switch (op) {
    case '.':
      return A::kStop;
    case 'q':
      return A::kPut1;
    case 'r':
      return A::kPut4;
    case 0x94:
      return A::kMemoize;
    case 'h':
      return A::kGet1;
    case 'j':
      return A::kGet4;
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
      return A::kNone;
    case 0x80:
    case 'K':
    case 0x82:
      return A::kUint1;
    case 'M':
    case 0x83:
      return A::kUint2;
    case 'J':
    case 0x84:
      return A::kUint4;
    case 'G':
    case 0x95:
      return A::kUint8;
    case 'U':
    case 'C':
    case 0x8c:
    case 0x8a:
      return A::kString1;
    case 'T':
    case 0x8b:
      return A::kString4Signed;  // BINSTRING and LONG4: signed lengths
    case 'B':
    case 'X':
      return A::kString4;
    case 0x8d:
    case 0x8e:
    case 0x96:
      return A::kString8;
    case 'I':
    case 'L':
    case 'F':
    case 'S':
    case 'V':
    case 'P':
      return A::kLine;
    case 'c':
    case 'i':
      return A::kTwoLines;
    default:
      return A::kUnknown;
  }
}

// Walks a pickle's opcodes with the bytes left after each (Note [Pickle lengths are checked
// before the unpickler reads them]).
class PickleWalk {
 public:
  PickleWalk(const char* data, size_t size, const std::string& path)
      : data_(data), size_(size), path_(path) {}
  void run() {
    using A = PickleArgument;
    while (at_ < size_) {
      const uint8_t op = static_cast<uint8_t>(data_[at_++]);
      switch (pickle_argument(op)) {
        case A::kStop:
          return;
        case A::kNone:
          break;
        case A::kUint1:
          uint(1);
          break;
        case A::kUint2:
          uint(2);
          break;
        case A::kUint4:
          uint(4);
          break;
        case A::kUint8:
          uint(8);
          break;
        case A::kString1:
          skip_string(1);
          break;
        case A::kString4:
          skip_string(4);
          break;
        case A::kString4Signed:
          TORCH_CHECK(skip_string(4) < (uint64_t{1} << 31), "actmem::read_checkpoint_file: ", path_,
                      " is damaged: its pickle states a negative length");
          break;
        case A::kString8:
          skip_string(8);
          break;
        case A::kLine:
          line();
          break;
        case A::kTwoLines:
          line();
          line();
          break;
        case A::kPut1:
          put(uint(1));
          break;
        case A::kPut4:
          put(uint(4));
          break;
        case A::kMemoize:
          ++memo_;
          break;
        case A::kGet1:
          get(uint(1));
          break;
        case A::kGet4:
          get(uint(4));
          break;
        case A::kUnknown:
          TORCH_CHECK(false, "actmem::read_checkpoint_file: ", path_, " is not a checkpoint: its ",
                      "pickle has opcode 0x", c10::str(std::hex, static_cast<int>(op)),
                      " at offset ", at_ - 1);
      }
    }
    TORCH_CHECK(false, "actmem::read_checkpoint_file: ", path_,
                " is damaged: its pickle has no STOP");
  }

 private:
  void need(uint64_t n, const char* what) const {
    TORCH_CHECK(n <= size_ - at_, "actmem::read_checkpoint_file: ", path_, " is damaged: its ",
                "pickle states ", what, " of ", n, " bytes at offset ", at_, " with ", size_ - at_,
                " bytes left");
  }
  uint64_t uint(size_t bytes) {
    need(bytes, "an argument");
    uint64_t v = 0;
    for (size_t i = 0; i < bytes; ++i) {
      v |= static_cast<uint64_t>(static_cast<uint8_t>(data_[at_ + i])) << (8 * i);
    }
    at_ += bytes;
    return v;
  }
  // A length of `bytes` bytes, then that many bytes: skipped once they are known to be there.
  uint64_t skip_string(size_t bytes) {
    const uint64_t n = uint(bytes);
    need(n, "a string");
    at_ += n;
    return n;
  }
  void put(uint64_t index) {
    TORCH_CHECK(index <= memo_, "actmem::read_checkpoint_file: ", path_,
                " is damaged: its pickle puts memo entry ", index, " after ", memo_,
                " entries (offset ", at_, ")");
    memo_ = std::max(memo_, index + 1);
  }
  void get(uint64_t index) const {
    TORCH_CHECK(index < memo_, "actmem::read_checkpoint_file: ", path_,
                " is damaged: its pickle reads memo entry ", index, " of ", memo_, " at offset ",
                at_);
  }
  void line() {
    const void* nl = std::memchr(data_ + at_, '\n', size_ - at_);
    TORCH_CHECK(nl != nullptr, "actmem::read_checkpoint_file: ", path_, " is damaged: its pickle ",
                "ends inside a text argument");
    at_ = static_cast<size_t>(static_cast<const char*>(nl) - data_) + 1;
  }
  const char* data_;
  size_t size_;
  const std::string& path_;
  size_t at_ = 0;
  uint64_t memo_ = 0;  // entries of the memo so far
};

// pickle_load of the file, with the records' sizes.
c10::IValue unpickle_checkpoint(const std::string& path, RecordSizes& records) {
  caffe2::serialize::PyTorchStreamReader reader(path);
  auto record = reader.getRecord("data.pkl");
  const at::DataPtr pickle = std::move(std::get<0>(record));
  const size_t pickle_size = std::get<1>(record);  // not a structured binding: lambdas capture it
  const char* data = static_cast<const char*>(pickle.get());
  PickleWalk(data, pickle_size, path).run();
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
  TORCH_CHECK(value.isGenericDict(), "actmem::read_checkpoint_file: ", path, " holds a ",
              value.tagKind(), ", not a checkpoint dict");
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
      c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
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

}  // namespace actmem
