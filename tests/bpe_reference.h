// bpe_reference.h — reference tokenizations for the byte-level BPE tests, computed by the
// libraries Megatron's tokenizers run: Hugging Face's `tokenizers` (HuggingFaceTokenizer and its
// Split pre-tokenizer) and OpenAI's `tiktoken` (TikTokenizer); scripts/setup.sh installs both.
#pragma once

#include "actmem/data/data.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace actmem::testing {

// The Split patterns of published tokenizer.json files: Llama 3's, Qwen2/Qwen3's and
// DeepSeek-V2's (its digit, CJK and punctuation splits; its long letter class shortened).
inline const char* const kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline const char* const kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline const std::vector<std::string> kDeepSeekSplits = {
    R"([\r\n])",
    R"(\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-Ֆ]+)",
    R"(\s?[!-/:-~！-／：-～‘-‟　-。]+)",
    R"(\s+$)",
    R"([一-龥ࠀ-一가-퟿]+)",
    R"(\p{N}+)"};
inline const char* const kGpt2 =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Runs `script` (Python) with DIR as its argument; the tests' inputs and outputs are JSON files
// in DIR.
inline void run_reference_script(const std::string& dir, const std::string& name,
                                 const std::string& script) {
  std::ofstream(dir + "/" + name) << script;
  const std::string cmd = std::string(ACTMEM_PYTHON) + " " + dir + "/" + name + " " + dir;
  ASSERT_EQ(std::system(cmd.c_str()), 0)
      << cmd << " failed: the tests need Hugging Face's tokenizers and tiktoken (scripts/setup.sh "
      << "installs them)";
}

// The pieces Hugging Face's Split(Regex(p), "isolated") makes of each text, for each pattern
// of DIR/patterns.json and text of DIR/texts.json, into DIR/pieces.json ([pattern][text][piece]).
inline const char* kSplitScript = R"(
import json, sys
from tokenizers import pre_tokenizers, Regex
d = sys.argv[1]
patterns = json.load(open(d + '/patterns.json'))
texts = json.load(open(d + '/texts.json'))
out = [[[s for s, _ in pre_tokenizers.Split(Regex(p), 'isolated').pre_tokenize_str(t)]
        for t in texts] for p in patterns]
json.dump(out, open(d + '/pieces.json', 'w'))
)";

// Trains a byte-level BPE on DIR/corpus.txt and writes it two ways:
//  - DIR/<name>/tokenizer.json (+ tokenizer_config.json), a Hugging Face tokenizer whose
//    pre-tokenizer, post-processor and added tokens DIR/hf_spec.json chooses; DIR/hf_ids.json:
//    its encoding of each text (tokenizer(text).input_ids: the post-processor's ids included),
//    len(tokenizer) and the eos id;
//  - DIR/tiktoken.json, the same merges as Megatron's TikTokenizer vocabulary file (bytes by
//    rank), and DIR/tt_ids.json: tiktoken's Encoding.encode(text, allowed_special="all") of each
//    text, built as Megatron's TikTokenTokenizer builds it (specials first, ranks shifted by
//    their count), for patterns v1 and v2.
inline const char* kBpeScript = R"(
import base64, json, sys
from tokenizers import Tokenizer, Regex, models, normalizers, pre_tokenizers, processors, trainers, decoders
d = sys.argv[1]
spec = json.load(open(d + '/hf_spec.json'))
texts = json.load(open(d + '/texts.json'))

def build(s):
    tok = Tokenizer(models.BPE(ignore_merges=s.get('ignore_merges', False)))
    steps = [pre_tokenizers.Split(Regex(p), behavior='isolated') for p in s['splits']]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=s['add_prefix_space'],
                                          use_regex=s['use_regex']))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    if s.get('nfc'):
        tok.normalizer = normalizers.NFC()
    trainer = trainers.BpeTrainer(vocab_size=s['vocab'], min_frequency=2,
                                  special_tokens=s['specials'],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([d + '/corpus.txt'], trainer)
    if s.get('added'):
        tok.add_tokens(s['added'])
    if s.get('bos'):
        b = s['bos']
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=b + ' $A', pair=b + ' $A ' + b + ' $B',
                                          special_tokens=[(b, tok.token_to_id(b))])])
    return tok

for s in spec:
    tok = build(s)
    out = d + '/' + s['name']
    import os
    os.makedirs(out, exist_ok=True)
    tok.save(out + '/tokenizer.json')
    json.dump({'eos_token': s['eos'], 'tokenizer_class': 'PreTrainedTokenizerFast'},
              open(out + '/tokenizer_config.json', 'w'))
    json.dump({'ids': [tok.encode(t).ids for t in texts],
               'size': tok.get_vocab_size(with_added_tokens=True),
               'eos': tok.token_to_id(s['eos'])}, open(out + '/hf_ids.json', 'w'))

# tiktoken: the first tokenizer's merges as bytes by rank (the 256 bytes first).
tok = build(spec[0])
model = json.loads(tok.to_str())['model']
alphabet = pre_tokenizers.ByteLevel.alphabet()
byte_of = {}
n = 0
for b in range(256):  # GPT-2's bytes_to_unicode
    printable = (33 <= b <= 126) or (161 <= b <= 172) or (174 <= b <= 255)
    byte_of[chr(b) if printable else chr(256 + n)] = b
    if not printable:
        n += 1
def to_bytes(sym):
    return bytes(byte_of[c] for c in sym)
ranked = [bytes([b]) for b in range(256)]
seen = set(ranked)
for m in model['merges']:
    a, b = m.split(' ') if isinstance(m, str) else m
    x = to_bytes(a) + to_bytes(b)
    if x not in seen:
        seen.add(x)
        ranked.append(x)
json.dump([{'rank': i, 'token_bytes': base64.b64encode(x).decode(),
            'token_str': x.decode('utf-8', errors='replace')} for i, x in enumerate(ranked)],
          open(d + '/tiktoken.json', 'w'))

import tiktoken
patterns = json.load(open(d + '/tiktoken_patterns.json'))
num_special = 1000
names = ['<unk>', '<s>', '</s>', '<mask>', '<pad>', '<cls>', '<sep>']
names += ['<SPECIAL_%d>' % i for i in range(len(names), num_special)]
ranks = {x: i + num_special for i, x in enumerate(ranked)}
result = {'size': num_special + len(ranked)}
for key, pat in patterns.items():
    enc = tiktoken.Encoding(name='t', pat_str=pat, mergeable_ranks=ranks,
                            special_tokens={t: i for i, t in enumerate(names)})
    result[key] = [enc.encode(t, allowed_special='all') for t in texts]
json.dump(result, open(d + '/tt_ids.json', 'w'))
)";

// Python's unicodedata.normalize('NFC', t) of each text of DIR/nfc_in.json, and of every code
// point NFC can change (a canonical decomposition or a non-zero combining class) alone, after
// 'a', before U+0301 and before U+0323 U+0302 (reordering), into DIR/nfc_out.json.
inline const char* kNfcScript = R"(
import json, sys, unicodedata
d = sys.argv[1]
texts = json.load(open(d + '/nfc_in.json'))
for cp in range(0x110000):
    c = chr(cp)
    if 0xD800 <= cp <= 0xDFFF:
        continue
    dec = unicodedata.decomposition(c)
    if (dec and not dec.startswith('<')) or unicodedata.combining(c):
        texts += [c, 'a' + c, c + '\u0301', c + '\u0323\u0302']
json.dump({'in': texts, 'out': [unicodedata.normalize('NFC', t) for t in texts]},
          open(d + '/nfc_out.json', 'w'))
)";

// Writes DIR/corpus.txt and DIR/texts.json and trains the tokenizers of `spec` (kBpeScript).
inline void train_reference_tokenizers(const std::string& dir, const nlohmann::json& spec,
                                       const std::vector<std::string>& texts,
                                       const nlohmann::json& tiktoken_patterns) {
  std::ofstream(dir + "/corpus.txt") << actmem::builtin_corpus(200000);
  std::ofstream(dir + "/texts.json") << nlohmann::json(texts).dump();
  std::ofstream(dir + "/hf_spec.json") << spec.dump();
  std::ofstream(dir + "/tiktoken_patterns.json") << tiktoken_patterns.dump();
  run_reference_script(dir, "bpe.py", kBpeScript);
}

}  // namespace actmem::testing
