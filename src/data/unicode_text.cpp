// unicode_text.cpp — UTF-8 decoding and Unicode properties for the tokenizers (unicode_text.h).
#include "unicode_text.h"

#include <algorithm>
#include <array>
#include <iterator>
#include <unordered_map>

namespace actmem::text {
namespace {

struct CategoryRange {
  uint32_t first, last;
  Category category;
};
struct CombiningClassRange {
  uint32_t first, last;
  uint8_t ccc;
};
struct Decomposition {
  uint32_t cp, first, second;  // second 0: a singleton
  bool composes;               // a primary composite: NFC composes first + second back to cp
};
#include "unicode_classes.inc"

// Hangul syllables decompose and compose algorithmically (Unicode's chapter 3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;

uint8_t combining_class(uint32_t cp) {
  const auto it =
      std::upper_bound(std::begin(kCombiningClasses), std::end(kCombiningClasses), cp,
                       [](uint32_t c, const CombiningClassRange& r) { return c < r.first; });
  if (it == std::begin(kCombiningClasses) || cp > std::prev(it)->last) return 0;
  return std::prev(it)->ccc;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const auto it = std::lower_bound(std::begin(kDecompositions), std::end(kDecompositions), cp,
                                   [](const Decomposition& d, uint32_t c) { return d.cp < c; });
  if (it == std::end(kDecompositions) || it->cp != cp) {
    out.push_back(cp);
    return;
  }
  decompose(it->first, out);
  if (it->second != 0) decompose(it->second, out);
}

// The primary composite of a + b, or 0.
uint32_t compose(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  static const std::unordered_map<uint64_t, uint32_t> pairs = [] {
    std::unordered_map<uint64_t, uint32_t> m;
    for (const Decomposition& d : kDecompositions) {
      if (d.composes) m.emplace((uint64_t{d.first} << 32) | d.second, d.cp);
    }
    return m;
  }();
  const auto it = pairs.find((uint64_t{a} << 32) | b);
  return it == pairs.end() ? 0 : it->second;
}

// NFC of code points: canonical decomposition, canonical ordering, canonical composition.
std::vector<uint32_t> nfc_code_points(const std::vector<uint32_t>& in) {
  std::vector<uint32_t> d;
  d.reserve(in.size());
  for (const uint32_t cp : in) decompose(cp, d);
  // Stable sort of each run of non-starters by combining class.
  for (size_t i = 1; i < d.size(); ++i) {
    const uint8_t c = combining_class(d[i]);
    if (c == 0) continue;
    size_t j = i;
    while (j > 0 && combining_class(d[j - 1]) > c) {
      std::swap(d[j - 1], d[j]);
      --j;
    }
  }
  if (d.empty()) return d;
  std::vector<uint32_t> out;
  out.reserve(d.size());
  out.push_back(d[0]);
  size_t starter = 0;
  int last = combining_class(d[0]) == 0 ? 0 : 256;
  for (size_t i = 1; i < d.size(); ++i) {
    const uint32_t ch = d[i];
    const int c = combining_class(ch);
    const uint32_t composite = last == 256 ? 0 : compose(out[starter], ch);
    if (composite != 0 && (last < c || last == 0)) {
      out[starter] = composite;
      continue;
    }
    if (c == 0) starter = out.size();
    last = c;
    out.push_back(ch);
  }
  return out;
}

}  // namespace

std::string nfc(const std::string& s) {
  if (std::all_of(s.begin(), s.end(),
                  [](char c) { return static_cast<unsigned char>(c) < 0x80; })) {
    return s;  // ASCII is its own NFC
  }
  std::string out;
  std::vector<uint32_t> run;
  auto flush = [&] {
    for (const uint32_t cp : nfc_code_points(run)) append_utf8(out, cp);
    run.clear();
  };
  for (const Char& c : decode_utf8(s)) {
    if (c.cp == kNotUtf8) {
      flush();
      out.append(s, c.begin, c.end - c.begin);  // a byte that is not UTF-8 stays as it is
    } else {
      run.push_back(c.cp);
    }
  }
  flush();
  return out;
}

std::vector<Char> decode_utf8(const std::string& s) {
  std::vector<Char> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    const int n = b < 0x80           ? 1
                  : (b >> 5) == 0x6  ? 2
                  : (b >> 4) == 0xE  ? 3
                  : (b >> 3) == 0x1E ? 4
                                     : 0;
    uint32_t cp = n == 1 ? b : n == 2 ? (b & 0x1F) : n == 3 ? (b & 0x0F) : (b & 0x07);
    bool ok = n > 0 && i + static_cast<size_t>(n) <= s.size();
    for (int k = 1; ok && k < n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      ok = (c & 0xC0) == 0x80;
      cp = (cp << 6) | (c & 0x3F);
    }
    ok = ok && !(n == 2 && cp < 0x80) && !(n == 3 && cp < 0x800) && !(n == 4 && cp < 0x10000) &&
         !(cp >= 0xD800 && cp <= 0xDFFF) && cp <= 0x10FFFF;
    if (!ok) {
      out.push_back({kNotUtf8, i, i + 1});
      ++i;
      continue;
    }
    out.push_back({cp, i, i + static_cast<size_t>(n)});
    i += static_cast<size_t>(n);
  }
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

Category category(uint32_t cp) {
  // Latin-1 from a table: the pre-tokenizing patterns ask for every character.
  static const auto latin1 = [] {
    std::array<Category, 256> t{};
    for (uint32_t c = 0; c < 256; ++c) {
      const auto it =
          std::upper_bound(std::begin(kCategoryRanges), std::end(kCategoryRanges), c,
                           [](uint32_t x, const CategoryRange& r) { return x < r.first; });
      t[c] = it == std::begin(kCategoryRanges) || c > std::prev(it)->last ? Category::Cn
                                                                          : std::prev(it)->category;
    }
    return t;
  }();
  if (cp < 256) return latin1[cp];
  const auto it = std::upper_bound(std::begin(kCategoryRanges), std::end(kCategoryRanges), cp,
                                   [](uint32_t c, const CategoryRange& r) { return c < r.first; });
  if (it == std::begin(kCategoryRanges) || cp > std::prev(it)->last) return Category::Cn;
  return std::prev(it)->category;
}

bool category_group(const std::string& name, std::vector<Category>& out) {
  static const char* kNames[] = {"Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl",
                                 "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc",
                                 "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn"};
  out.clear();
  for (size_t k = 0; k < std::size(kNames); ++k) {
    const std::string n = kNames[k];
    if (n == name || (name.size() == 1 && n[0] == name[0])) out.push_back(static_cast<Category>(k));
  }
  return !out.empty();
}

bool is_white_space(uint32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

}  // namespace actmem::text
