// sentencepiece_serve.cpp — actmem::spm::Server (sentencepiece_serve.h).
#include "sentencepiece_serve.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace actmem::spm {

namespace {
// Requests are read in pieces of at most this many bytes, the buffer growing as they arrive, so
// a length field of 4 GiB followed by a few bytes allocates a chunk, not 4 GiB.
constexpr size_t kChunk = size_t{1} << 20;

bool read_exact(std::FILE* in, void* p, size_t n) {
  return std::fread(p, 1, n, in) == n;
}

// Appends exactly n bytes of `in` to `out` (false when the input ends first).
bool read_bytes(std::FILE* in, std::string& out, size_t n) {
  out.clear();
  while (out.size() < n) {
    const size_t start = out.size(), step = std::min(kChunk, n - start);
    out.resize(start + step);
    if (!read_exact(in, out.data() + start, step)) return false;
  }
  return true;
}

void put_u32(std::FILE* out, uint32_t v) {
  std::fwrite(&v, 1, 4, out);
}

void fail(std::FILE* out, const std::string& msg) {
  put_u32(out, 0xFFFFFFFFu);
  put_u32(out, static_cast<uint32_t>(msg.size()));
  std::fwrite(msg.data(), 1, msg.size(), out);
}
}  // namespace

Server::Server(const std::string& model_path)
    : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  const auto st = sp_->Load(model_path);
  if (!st.ok()) load_error_ = st.ToString();
}

Server::~Server() = default;

int Server::serve(std::FILE* in, std::FILE* out) {
  char op = 0;
  std::string bytes;
  while (read_exact(in, &op, 1)) {
    if (op != 'I' && op != 'E' && op != 'D') return 2;
    uint32_t n = 0;
    if (op != 'I' &&
        (!read_exact(in, &n, 4) || !read_bytes(in, bytes, op == 'E' ? n : 4 * size_t{n}))) {
      return 1;
    }
    if (!load_error_.empty()) {
      fail(out, load_error_);
    } else if (op == 'I') {
      const int32_t info[2] = {sp_->GetPieceSize(), sp_->eos_id()};
      std::fwrite(info, 1, sizeof(info), out);
    } else if (op == 'E') {
      std::vector<int> ids;
      const auto st = sp_->Encode(bytes, &ids);
      if (!st.ok()) {
        fail(out, st.ToString());
      } else {
        put_u32(out, static_cast<uint32_t>(ids.size()));
        std::fwrite(ids.data(), sizeof(int), ids.size(), out);
      }
    } else {
      std::vector<int> kept;
      for (uint32_t i = 0; i < n; ++i) {
        int32_t id = 0;
        std::copy_n(bytes.data() + 4 * size_t{i}, 4, reinterpret_cast<char*>(&id));
        if (id >= 0 && id < sp_->GetPieceSize() && !sp_->IsControl(id)) kept.push_back(id);
      }
      std::string text;
      const auto st = sp_->Decode(kept, &text);
      if (!st.ok()) {
        fail(out, st.ToString());
      } else {
        put_u32(out, static_cast<uint32_t>(text.size()));
        std::fwrite(text.data(), 1, text.size(), out);
      }
    }
    std::fflush(out);
  }
  return 0;
}

}  // namespace actmem::spm
