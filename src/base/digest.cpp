// digest.cpp — Digest.
#include "actmem/base/digest.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <cstring>

namespace actmem {

namespace {
constexpr uint64_t kPrime = 0x9E3779B185EBCA87ull;
inline uint64_t rotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}
inline uint64_t mix(uint64_t lane, uint64_t word) {
  return rotl(lane ^ (word * kPrime), 31) * kPrime;
}
}  // namespace

void Digest::update(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  size_t i = 0;
  uint64_t w[4];
  for (; i + 32 <= bytes; i += 32) {
    std::memcpy(w, p + i, 32);
    lanes_[0] = mix(lanes_[0], w[0]);
    lanes_[1] = mix(lanes_[1], w[1]);
    lanes_[2] = mix(lanes_[2], w[2]);
    lanes_[3] = mix(lanes_[3], w[3]);
  }
  for (; i + 8 <= bytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    lanes_[0] = mix(lanes_[0], word);
  }
  if (i < bytes) {
    uint64_t tail = 0;
    std::memcpy(&tail, p + i, bytes - i);
    lanes_[1] = mix(lanes_[1], tail ^ (static_cast<uint64_t>(bytes - i) << 56));
  }
  length_ += bytes;
  lanes_[2] = mix(lanes_[2], length_);  // update boundaries matter
}

void Digest::update(const at::Tensor& tensor) {
  if (!tensor.defined()) {
    const uint64_t marker = 0xDEADBEEFCAFEF00Dull;
    update(&marker, sizeof(marker));
    return;
  }
  const at::Tensor t = tensor.detach().contiguous().cpu();
  const int64_t header[2] = {static_cast<int64_t>(t.scalar_type()), t.dim()};
  update(header, sizeof(header));
  update(t.sizes().data(), sizeof(int64_t) * t.sizes().size());
  update(t.data_ptr(), t.nbytes());
}

std::string Digest::hex() const {
  uint64_t a = splitmix64(lanes_[0] ^ rotl(lanes_[2], 17) ^ length_);
  uint64_t b = splitmix64(lanes_[1] ^ rotl(lanes_[3], 29) ^ a);
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(a),
                static_cast<unsigned long long>(b));
  return buf;
}

std::string grad_digest(const std::vector<at::Tensor>& params) {
  Digest d;
  for (const auto& p : params) d.update(p.grad());
  return d.hex();
}

std::string digest_of(const std::vector<at::Tensor>& tensors) {
  Digest d;
  for (const auto& t : tensors) d.update(t);
  return d.hex();
}

}  // namespace actmem
