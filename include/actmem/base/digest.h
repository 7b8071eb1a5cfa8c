// digest.h — a fast hash of tensors' raw bytes, to compare runs for bitwise equality.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace actmem {

/// SplitMix64: a small, fast, well-mixed deterministic generator.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Incremental 128-bit hash over byte ranges (four 64-bit multiply-rotate lanes over 8-byte words,
/// then a SplitMix64 finaliser). Not cryptographic; equal input bytes give equal digests, and
/// the byte count and boundaries between updates are mixed in.
class Digest {
 public:
  void update(const void* data, size_t bytes);
  /// Hashes the tensor's bytes in logical (contiguous) order, plus its dtype and shape.
  /// An undefined tensor hashes as a marker, so a missing gradient changes the digest.
  void update(const at::Tensor& tensor);
  /// 32 hex characters.
  std::string hex() const;

 private:
  uint64_t lanes_[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                        0x082EFA98EC4E6C89ull};
  uint64_t length_ = 0;
};

/// Digest of the gradients of `params`, in order (undefined gradients included as markers).
std::string grad_digest(const std::vector<at::Tensor>& params);
/// Digest of `tensors` themselves, in order (a trainer's gradients() at any precision).
std::string digest_of(const std::vector<at::Tensor>& tensors);

}  // namespace actmem
