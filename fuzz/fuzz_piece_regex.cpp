// fuzz_piece_regex.cpp — the pre-tokenizing pattern matcher (src/data/piece_regex.h): the input's
// first line is a pattern, the rest a text. A pattern it reads must cut any text into pieces
// that tile it exactly (with the gaps) and that are, without them, a subset of those pieces.
#include "fuzz_util.h"
#include "piece_regex.h"
#include "unicode_text.h"

#include <algorithm>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t newline = input.find('\n');
  if (newline == std::string::npos) return 0;
  try {
    const actmem::text::PieceRegex regex(input.substr(0, newline));
    std::vector<uint32_t> cps;
    for (const auto& c : actmem::text::decode_utf8(input.substr(newline + 1))) cps.push_back(c.cp);
    const auto tiles = regex.pieces(cps, /*with_gaps=*/true);
    size_t at = 0;
    for (const auto& [b, e] : tiles) {
      if (b != at || e <= b) std::abort();  // contiguous, non-empty
      at = e;
    }
    if (at != cps.size()) std::abort();  // everything covered
    for (const auto& piece : regex.pieces(cps, /*with_gaps=*/false)) {
      if (std::find(tiles.begin(), tiles.end(), piece) == tiles.end()) std::abort();
    }
    (void)regex.match_at(cps, 0);
  } catch (const c10::Error&) {
    // a clear refusal
  }
  return 0;
}
