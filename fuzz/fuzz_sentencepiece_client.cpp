// fuzz_sentencepiece_client.cpp — actmem's side of the SentencePiece helper's pipe protocol:
// the input is everything "the helper" answers, and the client asks what the tokenizer asks
// (the model's sizes, an encoding, a decoding, an empty encoding). Every answer must be checked
// before it is used: a clear error, never an allocation sized by the answer, never an id
// outside the model.
#include "fuzz_util.h"
#include "sentencepiece_client.h"

#include <fcntl.h>
#include <unistd.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string replies = actmem::fuzz::scratch("replies");
  actmem::fuzz::write_file(replies, data, size);
  static const int requests = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  const int from_helper = ::open(replies.c_str(), O_RDONLY | O_CLOEXEC);
  if (requests < 0 || from_helper < 0) std::abort();
  actmem::spm::Client client(requests, from_helper);
  int32_t pieces = 0;
  try {
    const auto info = client.info("fuzz.model");
    pieces = info.pieces;
    if (pieces <= 0 || info.eos < -1 || info.eos >= pieces) std::abort();  // the client promises
  } catch (const c10::Error&) {
  }
  const std::string text = "The quick brown fox.";
  for (const std::string& t : {text, std::string()}) {
    try {
      const std::vector<int32_t> ids = client.encode(t, pieces > 0 ? pieces : 1000);
      for (const int32_t id : ids) {
        if (id < 0 || id >= (pieces > 0 ? pieces : 1000)) std::abort();
      }
    } catch (const c10::Error&) {
    }
    try {
      actmem::fuzz::touch(client.decode({1, 2, 3}).data(), 0);
    } catch (const c10::Error&) {
    }
  }
  ::close(from_helper);
  return 0;
}
