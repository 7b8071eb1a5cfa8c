// hf_bpe.h — a GPT-2 byte-level BPE vocabulary made by Hugging Face's tokenizers (the package
// scripts/setup.sh installs for the tests), for the tests of GPT2BPETokenizer.
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

// Trains a byte-level BPE of `vocab` ids on the built-in corpus with Hugging Face's tokenizers
// (ByteLevelBPETokenizer: GPT-2's pattern and byte alphabet), saves DIR/vocab.json and
// DIR/merges.txt, and writes DIR/ids.json: its encoding of each text of DIR/texts.json.
inline void hugging_face_bpe(const std::string& dir, const std::vector<std::string>& texts,
                             int vocab) {
  {
    std::ofstream(dir + "/corpus.txt") << builtin_corpus(200000);
    std::ofstream(dir + "/texts.json") << nlohmann::json(texts).dump();
  }
  const std::string script =
      "import json, sys\n"
      "from tokenizers import ByteLevelBPETokenizer\n"
      "d = sys.argv[1]\n"
      "t = ByteLevelBPETokenizer()\n"
      "t.train([d + '/corpus.txt'], vocab_size=" +
      std::to_string(vocab) +
      ", min_frequency=2, special_tokens=['<|endoftext|>'], show_progress=False)\n"
      "t.save_model(d)\n"
      "t = ByteLevelBPETokenizer(d + '/vocab.json', d + '/merges.txt')\n"
      "t.add_special_tokens(['<|endoftext|>'])\n"
      "texts = json.load(open(d + '/texts.json'))\n"
      "json.dump({'ids': [t.encode(x).ids for x in texts], 'size': t.get_vocab_size(),\n"
      "           'eod': t.token_to_id('<|endoftext|>')}, open(d + '/ids.json', 'w'))\n";
  std::ofstream(dir + "/hf.py") << script;
  const std::string cmd = std::string(ACTMEM_PYTHON) + " " + dir + "/hf.py " + dir;
  ASSERT_EQ(std::system(cmd.c_str()), 0)
      << cmd << " failed: the tests need Hugging Face's tokenizers (scripts/setup.sh installs it)";
}

}  // namespace actmem::testing
