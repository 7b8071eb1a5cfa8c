// piece_regex.cpp — the pre-tokenizing patterns' regex subset (piece_regex.h).
#include "piece_regex.h"

#include "unicode_text.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>

namespace actmem::text {

namespace regex_detail {

// A member of a character class.
struct ClassItem {
  enum Kind { kRange, kCategories, kSpace, kDigit, kWord } kind = kRange;
  uint32_t lo = 0, hi = 0;  // kRange
  uint32_t categories = 0;  // kCategories: bit c for Category c
  bool negated = false;     // \P{..}, \S, \D, \W

  bool contains(uint32_t cp) const {
    bool in = false;
    switch (kind) {
      case kRange:
        in = cp >= lo && cp <= hi;
        break;
      case kCategories:
        in = cp != kNotUtf8 && (categories >> static_cast<unsigned>(category(cp)) & 1u) != 0;
        break;
      case kSpace:
        in = cp != kNotUtf8 && is_white_space(cp);
        break;
      case kDigit:
        in = cp != kNotUtf8 && category(cp) == Category::Nd;
        break;
      case kWord: {
        if (cp == kNotUtf8) break;
        const Category c = category(cp);
        // Oniguruma's Unicode \w (Hugging Face's Split): L, M, N, Pc.
        in = c <= Category::No || c == Category::Pc;
        break;
      }
    }
    return in != negated;
  }
};

// (?i) as the tokenizers' patterns use it: ASCII letters only. Oniguruma (Hugging Face's Split)
// does not fold U+017F (long s) onto 's', which Unicode's simple folding would; the Split test
// pins that.
uint32_t fold(uint32_t cp) {
  return cp >= 'A' && cp <= 'Z' ? cp + 32 : cp;
}

}  // namespace regex_detail
using regex_detail::ClassItem;
using regex_detail::fold;

struct PieceRegex::Node {
  enum Kind { kChar, kSet, kAny, kGroup, kLookahead, kStart, kEnd } kind = kChar;
  uint32_t cp = 0;
  bool icase = false;
  std::vector<ClassItem> set;                   // kSet: any item matches (then `negated` flips it)
  bool negated = false;                         // kSet: [^...]; kLookahead: (?!...)
  std::vector<std::vector<Node>> alternatives;  // kGroup, kLookahead
  int64_t min = 1, max = 1;                     // max < 0: unbounded
  enum Mode { kGreedy, kLazy, kPossessive } mode = kGreedy;

  std::array<uint64_t, 4> latin1{};  // kSet: matches() of U+0000..U+00FF, precomputed

  bool single() const { return kind == kChar || kind == kSet || kind == kAny; }
  // Fills `latin1` (the characters most text is made of) once the set is complete.
  void tabulate() {
    for (uint32_t c = 0; c < 256; ++c) {
      if (matches_slowly(c)) latin1[c >> 6] |= uint64_t{1} << (c & 63);
    }
  }
  bool matches(uint32_t c) const {
    if (kind == kSet && c < 256) return (latin1[c >> 6] >> (c & 63) & 1u) != 0;
    return matches_slowly(c);
  }
  bool matches_slowly(uint32_t c) const {
    switch (kind) {
      case kChar:
        return c == cp || (icase && c != kNotUtf8 && fold(c) == fold(cp));
      case kAny:
        return c != '\n';
      case kSet: {
        auto in = [this](uint32_t x) {
          return std::any_of(set.begin(), set.end(),
                             [x](const ClassItem& it) { return it.contains(x); });
        };
        bool hit = in(c);
        if (!hit && icase && c != kNotUtf8) {
          const uint32_t f = fold(c);
          hit = in(f) || (f >= 'a' && f <= 'z' && in(f - 32));
        }
        return hit != negated;
      }
      default:
        return false;
    }
  }
};

namespace {

using Node = PieceRegex::Node;
using Alternatives = std::vector<std::vector<Node>>;

// ---- parsing ----

class Parser {
 public:
  explicit Parser(const std::string& pattern) : pattern_(pattern) {
    for (const Char& c : decode_utf8(pattern)) {
      TORCH_CHECK(c.cp != kNotUtf8, "actmem: tokenizer pattern is not UTF-8: ", pattern_);
      p_.push_back(c.cp);
    }
  }
  Alternatives parse() {
    Alternatives a = alternation(false);
    TORCH_CHECK(at_end(), "actmem: tokenizer pattern ", pattern_, ": unbalanced ')' at ", i_);
    return a;
  }

 private:
  [[noreturn]] void unsupported(const std::string& what) const {
    TORCH_CHECK(false, "actmem: tokenizer pattern ", pattern_, ": ", what,
                " is not supported (docs/tokenizers.md lists the regex subset actmem reads)");
  }
  bool at_end() const { return i_ >= p_.size(); }
  uint32_t peek(size_t ahead = 0) const {
    return i_ + ahead < p_.size() ? p_[i_ + ahead] : 0xFFFFFFFFu;
  }
  uint32_t take() {
    TORCH_CHECK(!at_end(), "actmem: tokenizer pattern ", pattern_, " ends early");
    return p_[i_++];
  }

  Alternatives alternation(bool icase) {
    // Matching recurses once per node and group: bounded, so no pattern can exhaust the stack.
    TORCH_CHECK(++depth_ <= kMaxDepth, "actmem: tokenizer pattern ", pattern_.substr(0, 80),
                "... nests groups more than ", kMaxDepth, " deep");
    Alternatives out;
    out.push_back(sequence(icase));
    while (peek() == '|') {
      ++i_;
      out.push_back(sequence(icase));
    }
    --depth_;
    return out;
  }

  std::vector<Node> sequence(bool icase) {
    std::vector<Node> seq;
    while (!at_end() && peek() != '|' && peek() != ')') {
      TORCH_CHECK(++nodes_ <= kMaxNodes, "actmem: tokenizer pattern ", pattern_.substr(0, 80),
                  "... has more than ", kMaxNodes, " elements");
      Node n = atom(icase);
      quantifier(n);
      seq.push_back(std::move(n));
    }
    return seq;
  }

  Node atom(bool icase) {
    Node n;
    n.icase = icase;
    const uint32_t c = take();
    switch (c) {
      case '(': {
        bool inner_icase = icase;
        n.kind = Node::kGroup;
        if (peek() == '?') {
          ++i_;
          const uint32_t k = take();
          if (k == ':') {
          } else if (k == 'i' && peek() == ':') {
            ++i_;
            inner_icase = true;
          } else if (k == '=' || k == '!') {
            n.kind = Node::kLookahead;
            n.negated = k == '!';
          } else if (k == '<' && (peek() == '=' || peek() == '!')) {
            unsupported("lookbehind (?<...)");
          } else {
            unsupported("the group (?" + std::string(1, static_cast<char>(k)) + "...)");
          }
        }
        n.alternatives = alternation(inner_icase);
        TORCH_CHECK(!at_end() && take() == ')', "actmem: tokenizer pattern ", pattern_,
                    ": missing ')'");
        return n;
      }
      case '[':
        n.kind = Node::kSet;
        char_class(n);
        n.tabulate();
        return n;
      case '.':
        n.kind = Node::kAny;
        return n;
      case '^':
        n.kind = Node::kStart;
        return n;
      case '$':
        n.kind = Node::kEnd;
        return n;
      case '\\': {
        ClassItem item;
        uint32_t literal = 0;
        if (escape(item, literal)) {
          n.kind = Node::kSet;
          n.set.push_back(std::move(item));
          n.tabulate();
        } else {
          n.kind = Node::kChar;
          n.cp = literal;
        }
        return n;
      }
      case '*':
      case '+':
      case '?':
        unsupported("a quantifier with nothing to repeat");
      default:
        n.kind = Node::kChar;
        n.cp = c;
        return n;
    }
  }

  // After '\': a class (true, `item`) or one character (false, `literal`).
  bool escape(ClassItem& item, uint32_t& literal) {
    const uint32_t c = take();
    switch (c) {
      case 'p':
      case 'P': {
        std::string name;
        if (peek() == '{') {
          ++i_;
          while (!at_end() && peek() != '}') name.push_back(static_cast<char>(take()));
          TORCH_CHECK(take() == '}', "actmem: tokenizer pattern ", pattern_, ": missing '}'");
        } else {
          name.push_back(static_cast<char>(take()));
        }
        item.kind = ClassItem::kCategories;
        item.negated = c == 'P';
        std::vector<Category> group;
        if (!category_group(name, group)) {
          unsupported("\\p{" + name + "} (only general categories such as L, Lu, N, M)");
        }
        for (const Category g : group) item.categories |= 1u << static_cast<unsigned>(g);
        return true;
      }
      case 's':
      case 'S':
        item.kind = ClassItem::kSpace;
        item.negated = c == 'S';
        return true;
      case 'd':
      case 'D':
        item.kind = ClassItem::kDigit;
        item.negated = c == 'D';
        return true;
      case 'w':
      case 'W':
        item.kind = ClassItem::kWord;
        item.negated = c == 'W';
        return true;
      case 'r':
        literal = '\r';
        return false;
      case 'n':
        literal = '\n';
        return false;
      case 't':
        literal = '\t';
        return false;
      case 'f':
        literal = '\f';
        return false;
      case 'v':
        literal = 0x0B;
        return false;
      case 'x':
      case 'u': {
        std::string hex;
        if (c == 'x' && peek() == '{') {
          ++i_;
          while (!at_end() && peek() != '}') hex.push_back(static_cast<char>(take()));
          ++i_;
        } else {
          for (int k = 0; k < (c == 'x' ? 2 : 4); ++k) hex.push_back(static_cast<char>(take()));
        }
        TORCH_CHECK(!hex.empty() && hex.size() <= 6 &&
                        hex.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos,
                    "actmem: tokenizer pattern ", pattern_, ": bad \\", static_cast<char>(c),
                    " escape");
        literal = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
        return false;
      }
      default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) {
          unsupported(std::string("the escape \\") + static_cast<char>(c));
        }
        literal = c;  // an escaped punctuation character is itself
        return false;
    }
  }

  void char_class(Node& n) {
    if (peek() == '^') {
      ++i_;
      n.negated = true;
    }
    bool first = true;
    while (true) {
      TORCH_CHECK(!at_end(), "actmem: tokenizer pattern ", pattern_, ": missing ']'");
      uint32_t c = take();
      if (c == ']' && !first) return;
      first = false;
      if (c == '[') unsupported("a nested class or [:name:] inside [...]");
      if (c == '&' && peek() == '&') unsupported("class intersection &&");
      ClassItem item;
      if (c == '\\') {
        uint32_t literal = 0;
        if (escape(item, literal)) {
          n.set.push_back(std::move(item));
          continue;
        }
        c = literal;
      }
      uint32_t hi = c;
      if (peek() == '-' && peek(1) != ']' && peek(1) != 0xFFFFFFFFu) {
        ++i_;
        hi = take();
        if (hi == '\\') {
          ClassItem ignored;
          TORCH_CHECK(!escape(ignored, hi), "actmem: tokenizer pattern ", pattern_,
                      ": a range cannot end in a class");
        }
        TORCH_CHECK(hi >= c, "actmem: tokenizer pattern ", pattern_, ": range out of order");
      }
      item.kind = ClassItem::kRange;
      item.lo = c;
      item.hi = hi;
      n.set.push_back(std::move(item));
    }
  }

  void quantifier(Node& n) {
    int64_t lo = 1, hi = 1;
    const uint32_t c = peek();
    if (c == '?') {
      lo = 0;
    } else if (c == '*') {
      lo = 0;
      hi = -1;
    } else if (c == '+') {
      hi = -1;
    } else if (c == '{' && peek(1) >= '0' && peek(1) <= '9') {
      size_t j = i_ + 1;
      auto number = [&] {
        int64_t v = 0;
        while (j < p_.size() && p_[j] >= '0' && p_[j] <= '9' && v < 100000) {
          v = v * 10 + (p_[j++] - '0');
        }
        return v;
      };
      lo = hi = number();
      if (j < p_.size() && p_[j] == ',') {
        ++j;
        hi = (j < p_.size() && p_[j] >= '0' && p_[j] <= '9') ? number() : -1;
      }
      if (j >= p_.size() || p_[j] != '}') return;  // not a quantifier: a literal '{' follows
      TORCH_CHECK(hi < 0 || hi >= lo, "actmem: tokenizer pattern ", pattern_, ": {m,n} with n < m");
      i_ = j;  // at '}'
    } else {
      return;
    }
    ++i_;
    if (n.kind == Node::kLookahead || n.kind == Node::kStart || n.kind == Node::kEnd) {
      unsupported("a quantifier on a lookahead or an anchor");
    }
    n.min = lo;
    n.max = hi;
    if (peek() == '?') {
      ++i_;
      n.mode = Node::kLazy;
    } else if (peek() == '+') {
      ++i_;
      n.mode = Node::kPossessive;
    }
  }

  static constexpr int kMaxDepth = 32;
  static constexpr int kMaxNodes = 1024;
  std::string pattern_;
  std::vector<uint32_t> p_;
  size_t i_ = 0;
  int depth_ = 0, nodes_ = 0;
};

// ---- matching: backtracking with continuations ----

// A borrowed callable bool(size_t): where the rest of the pattern goes on from.
class Cont {
 public:
  template <class F>
  explicit Cont(const F& f)
      : obj_(&f), fn_([](const void* o, size_t p) { return (*static_cast<const F*>(o))(p); }) {}
  bool operator()(size_t p) const { return fn_(obj_, p); }

 private:
  const void* obj_;
  bool (*fn_)(const void*, size_t);
};

class Matcher {
 public:
  static constexpr int64_t kMaxGroupRepeats = 500;

  explicit Matcher(const std::vector<uint32_t>& s) : s_(s), n_(s.size()) {}

  // Starts a match attempt: the backtracking budget is per attempt, as Oniguruma's retry limit
  // and fancy-regex's backtrack limit are.
  void start() const { steps_ = 0; }

  bool alternatives(const Alternatives& a, size_t pos, const Cont& cont) const {
    for (const auto& seq : a) {
      if (sequence(seq, 0, pos, cont)) return true;
    }
    return false;
  }

 private:
  bool sequence(const std::vector<Node>& q, size_t k, size_t pos, const Cont& cont) const {
    TORCH_CHECK(++steps_ <= kMaxSteps, "actmem: a tokenizer pattern backtracks more than ",
                kMaxSteps,
                " steps at one position of this text (a nested quantifier such as "
                "(\\s*x|\\s)+ takes exponential time)");
    if (k == q.size()) return cont(pos);
    const Node& nd = q[k];
    const auto next_fn = [&](size_t p) { return sequence(q, k + 1, p, cont); };
    const Cont next(next_fn);
    switch (nd.kind) {
      case Node::kStart:
        return (pos == 0 || s_[pos - 1] == '\n') && next(pos);
      case Node::kEnd:
        return (pos == n_ || s_[pos] == '\n') && next(pos);
      case Node::kLookahead: {
        const auto any = [](size_t) { return true; };
        const bool found = alternatives(nd.alternatives, pos, Cont(any));
        return found != nd.negated && next(pos);
      }
      case Node::kGroup:
        if (nd.min == 1 && nd.max == 1) return alternatives(nd.alternatives, pos, next);
        return repeat(nd, 0, pos, next);
      default:
        break;
    }
    // One character at a time: the longest run, then back off as the mode says.
    const size_t room = n_ - pos;
    const size_t most = nd.max < 0 ? room : std::min(room, static_cast<size_t>(nd.max));
    size_t run = 0;
    while (run < most && nd.matches(s_[pos + run])) ++run;
    const auto least = static_cast<size_t>(nd.min);
    if (run < least) return false;
    switch (nd.mode) {
      case Node::kPossessive:
        return next(pos + run);
      case Node::kLazy:
        for (size_t j = least; j <= run; ++j) {
          if (next(pos + j)) return true;
        }
        return false;
      case Node::kGreedy:
        for (size_t j = run;; --j) {
          if (next(pos + j)) return true;
          if (j == least) return false;
        }
    }
    return false;
  }

  // A quantified group, `count` repetitions matched so far ending at `pos`.
  bool repeat(const Node& nd, int64_t count, size_t pos, const Cont& next) const {
    // Each repetition of a quantified group is a nested call: a bound keeps the stack safe
    // (the tokenizers' patterns quantify single characters and classes, which loop instead).
    TORCH_CHECK(count < kMaxGroupRepeats,
                "actmem: a tokenizer pattern's quantified group "
                "repeats more than ",
                kMaxGroupRepeats, " times in a row on this text");
    const bool may_more = nd.max < 0 || count < nd.max;
    const auto more_fn = [&](size_t e) { return e != pos && repeat(nd, count + 1, e, next); };
    const Cont more(more_fn);
    switch (nd.mode) {
      case Node::kGreedy:
        if (may_more && alternatives(nd.alternatives, pos, more)) return true;
        return count >= nd.min && next(pos);
      case Node::kLazy:
        if (count >= nd.min && next(pos)) return true;
        return may_more && alternatives(nd.alternatives, pos, more);
      case Node::kPossessive: {
        size_t p = pos;
        int64_t c = count;
        while (nd.max < 0 || c < nd.max) {
          size_t end = p;
          const auto take_fn = [&](size_t e) {
            end = e;
            return true;
          };
          if (!alternatives(nd.alternatives, p, Cont(take_fn)) || end == p) break;
          p = end;
          ++c;
        }
        return c >= nd.min && next(p);
      }
    }
    return false;
  }

  static constexpr int64_t kMaxSteps = 1000000;
  const std::vector<uint32_t>& s_;
  size_t n_;
  mutable int64_t steps_ = 0;
};

}  // namespace

PieceRegex::PieceRegex(const std::string& pattern)
    : pattern_(pattern), alternatives_(std::make_unique<Alternatives>(Parser(pattern).parse())) {}
PieceRegex::~PieceRegex() = default;
PieceRegex::PieceRegex(PieceRegex&&) noexcept = default;
PieceRegex& PieceRegex::operator=(PieceRegex&&) noexcept = default;

size_t PieceRegex::match_at(const std::vector<uint32_t>& cps, size_t pos) const {
  size_t end = std::string::npos;
  const auto done = [&end](size_t e) {
    end = e;
    return true;
  };
  const Matcher m(cps);
  m.start();
  m.alternatives(*alternatives_, pos, Cont(done));
  return end;
}

std::vector<std::pair<size_t, size_t>> PieceRegex::pieces(const std::vector<uint32_t>& cps,
                                                          bool with_gaps) const {
  std::vector<std::pair<size_t, size_t>> out;
  const Matcher m(cps);
  size_t gap = 0, pos = 0;
  while (pos < cps.size()) {
    size_t end = std::string::npos;
    const auto done = [&end](size_t e) {
      end = e;
      return true;
    };
    m.start();
    m.alternatives(*alternatives_, pos, Cont(done));
    if (end == std::string::npos || end == pos) {
      ++pos;
      continue;
    }
    if (with_gaps && gap < pos) out.emplace_back(gap, pos);
    out.emplace_back(pos, end);
    pos = gap = end;
  }
  if (with_gaps && gap < cps.size()) out.emplace_back(gap, cps.size());
  return out;
}

}  // namespace actmem::text
