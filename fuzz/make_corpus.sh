#!/usr/bin/env bash
# make_corpus.sh — the seed corpora of fuzz/corpus/ and the dictionaries of fuzz/dict/, from
# files the project itself writes (committed; run again when a format changes):
#   fuzz/make_corpus.sh [ACTMEM [FUZZ_BUILD]]   (defaults: build/actmem, build-fuzz)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
actmem="${1:-$root/build/actmem}"
fuzz_build="${2:-$root/build-fuzz}"
corpus="$root/fuzz/corpus"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# The seeds are made again; the inputs of past findings (regression-*) stay.
find "$corpus" -type f ! -name 'regression-*' -delete 2>/dev/null || true
rm -rf "$root/fuzz/dict"
mkdir -p "$corpus"/{indexed_dataset,checkpoint,npy_cache,latest,jsonl,argv} "$root/fuzz/dict"
mkdir -p "$corpus"/{sentencepiece_client,sentencepiece_serve,tokenizer_files,piece_regex}

# JSONL: what preprocess reads.
printf '%s\n' '{"text": "The quick brown fox jumps over the lazy dog."}' \
  '{"text": "A second document,\nwith a newline.", "id": 2}' '' '{"text": ""}' \
  >"$corpus/jsonl/documents"
printf '%s\n' '{"text": "\u00e9t\u00e9 \ud83d\ude00 \"quoted\" \\ back"}' >"$corpus/jsonl/escapes"

# .idx/.bin: preprocess's output of the documents, packed as fuzz_indexed_dataset reads it
# (u32 length of the .idx, the .idx, the .bin).
"$actmem" preprocess --input "$corpus/jsonl/documents" --output-prefix "$tmp/d" \
  --tokenizer-type ByteTokenizer --append-eod >/dev/null
pack() {
  python3 -c 'import struct, sys
idx = open(sys.argv[1], "rb").read(); b = open(sys.argv[2], "rb").read()
open(sys.argv[3], "wb").write(struct.pack("<I", len(idx)) + idx + b)' "$@"
}
pack "$tmp/d_text_document.idx" "$tmp/d_text_document.bin" "$corpus/indexed_dataset/documents"

# A checkpoint: one step of a 1-layer h 8 model (the smallest train writes).
"$actmem" train --num-layers 1 --hidden-size 8 --ffn-hidden-size 8 --num-attention-heads 2 \
  --seq-length 8 --micro-batch-size 1 --train-iters 1 --save "$tmp/ck" >/dev/null
cp "$tmp/ck/iter_0000001/mp_rank_00/model_optim_rng.pt" "$corpus/checkpoint/model_optim_rng.pt"
cp "$tmp/ck/latest_checkpointed_iteration.txt" "$corpus/latest/written"
printf 'release\n' >"$corpus/latest/release"
printf '0000000000000000042 \n' >"$corpus/latest/padded"

# The cached indices: the four files of the entry fuzz_npy_cache's dataset writes.
ACTMEM_FUZZ_WRITE_SEEDS="$corpus/npy_cache" "$fuzz_build/fuzz/fuzz_npy_cache" -runs=0 \
  >/dev/null 2>&1

# SentencePiece: a small model (identity normalization keeps it a few kB) for the helper's side,
# the requests the tokenizer makes (the model's sizes, an encoding, a decoding, an empty encoding,
# the decoding again: fuzz_sentencepiece_client's order) and the helper's real replies to them.
helper="$(dirname "$actmem")/actmem-sentencepiece"
python3 -c 'import random; random.seed(0); w = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "second", "document"]
print("\n".join(" ".join(random.choice(w) for _ in range(12)) for _ in range(300)))' >"$tmp/spm.txt"
"$helper" train --input="$tmp/spm.txt" --model_prefix="$tmp/spm" --vocab_size=40 \
  --normalization_rule_name=identity --minloglevel=2 >/dev/null 2>&1
cp "$tmp/spm.model" "$root/fuzz/sentencepiece.model"
python3 -c 'import struct, sys
text = b"The quick brown fox."
def E(t): return b"E" + struct.pack("<I", len(t)) + t
def D(ids): return b"D" + struct.pack("<I", len(ids)) + struct.pack("<%di" % len(ids), *ids)
open(sys.argv[1], "wb").write(b"I" + E(text) + D([1, 2, 3]) + E(b"") + D([1, 2, 3]))' \
  "$corpus/sentencepiece_serve/tokenizer_requests"
"$helper" serve "$root/fuzz/sentencepiece.model" <"$corpus/sentencepiece_serve/tokenizer_requests" \
  >"$corpus/sentencepiece_client/helper_replies"

# Command lines, one word per line.
printf 'train\n--num-layers\n2\n--hidden-size\n64\n--num-attention-heads\n4\n--recompute-granularity\nselective\n--recompute-modules\ncore_attn\nmlp\n' >"$corpus/argv/train"
printf 'train\n--fine-grained-activation-offloading\n--offload-modules\nattn_norm\n--swiglu\n--num-experts\n4\n--moe-router-topk\n2\n' >"$corpus/argv/offload_moe"
printf 'estimate\n--preset\nqwen3-next-80b-a3b\n--tensor-model-parallel-size\n2\n--sequence-parallel\n' >"$corpus/argv/estimate"
printf 'plan\n--preset\n7b\n--gpu\na100\n--memory-budget\n60GiB\n' >"$corpus/argv/plan"
printf 'launch\n--nproc-per-node\n2\n--\ntrain\n--train-iters\n3\n' >"$corpus/argv/launch"
printf 'preprocess\n--input\nx.jsonl\n--output-prefix\nout\n--vocab-size\n300\n' >"$corpus/argv/preprocess"
# Byte-level BPE files: a GPT-2-shaped and a Llama-3-shaped tokenizer.json (0 first) and the
# same merges as a TikTokenizer vocabulary (1 first), trained small by Hugging Face's tokenizers
# (scripts/setup.sh installs it in the venv); piece_regex: each published pattern, a line break,
# a text.
python="${ACTMEM_PYTHON:-/opt/actmem/venv/bin/python}"
"$python" - "$tmp" "$corpus" <<'PY'
import base64, json, sys
from tokenizers import Tokenizer, Regex, models, pre_tokenizers, processors, trainers
tmp, corpus = sys.argv[1], sys.argv[2]
text = "The quick brown fox jumps over the lazy dog. It's 12345 h\u00e9llo w\u00f6rld \u65e5\u672c.\n" * 50
open(tmp + "/c.txt", "w").write(text)
llama = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
def train(splits):
    tok = Tokenizer(models.BPE(ignore_merges=bool(splits)))
    steps = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not splits))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.train([tmp + "/c.txt"], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if splits:
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    return tok
for name, splits in (("gpt2", []), ("llama3", [llama])):
    open(corpus + "/tokenizer_files/" + name, "wb").write(b"\x00" + train(splits).to_str().encode())
merges = json.loads(train([]).to_str())["model"]["merges"]
byte_of, n = {}, 0
for b in range(256):
    printable = 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255
    byte_of[chr(b) if printable else chr(256 + n)] = b
    n += 0 if printable else 1
ranked = [bytes([b]) for b in range(256)]
for m in merges:
    a, b = m.split(" ") if isinstance(m, str) else m
    x = bytes(byte_of[c] for c in a + b)
    if x not in ranked:
        ranked.append(x)
vocab = [{"rank": i, "token_bytes": base64.b64encode(x).decode(), "token_str": x.decode("utf-8", "replace")}
         for i, x in enumerate(ranked)]
open(corpus + "/tokenizer_files/tiktoken", "wb").write(b"\x01" + json.dumps(vocab).encode())
gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
v2 = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
      r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
      r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
sample = "It's CamelCase 1234567 caf\u00e9 e\u0301 \u65e5\u672c a/b//\n\n  x \U0001F642  \n"
for name, p in (("gpt2", gpt2), ("llama3", llama), ("tiktoken_v2", v2),
                ("classes", r"\s?[A-Za-z\u00b5\u00c0-\u00d6]+|\d{2,3}?|(?:ab)+|\w+(?=\s)|[\^\-\]]+|x$")):
    open(corpus + "/piece_regex/" + name, "w").write(p + "\n" + sample)
PY

# Every flag of every command, for the argv target's dictionary.
for c in train estimate inspect compare plan launch dist-check preprocess generate; do
  "$actmem" "$c" --help 2>/dev/null || true
done | grep -oE -- '--[a-z0-9][a-z0-9-]+' | sort -u | sed 's/.*/"&"/' >"$root/fuzz/dict/argv.dict"
printf '%s\n' '"{"' '"}"' '":"' '"\"text\""' '"\\u"' '"["' '"]"' '"null"' '"true"' >"$root/fuzz/dict/jsonl.dict"
printf '%s\n' '"I"' '"E"' '"D"' '"\xff\xff\xff\xff"' >"$root/fuzz/dict/sentencepiece_serve.dict"
printf '%s\n' '"\xff\xff\xff\xff"' '"\x00\x00\x00\x00"' >"$root/fuzz/dict/sentencepiece_client.dict"
printf '%s\n' '"MMIDIDX\x00\x00"' '"\x01\x00\x00\x00\x00\x00\x00\x00"' >"$root/fuzz/dict/indexed_dataset.dict"
printf '%s\n' '"PK\x03\x04"' '"PK\x01\x02"' '"PK\x05\x06"' '"archive/data.pkl"' '"archive/data/0"' \
  '"torch._utils\x0a_rebuild_tensor_v2"' '"collections\x0aOrderedDict"' '"\x80\x02"' '"."' \
  >"$root/fuzz/dict/checkpoint.dict"
printf '%s\n' '"\"type\""' '"\"Split\""' '"\"ByteLevel\""' '"\"Sequence\""' '"\"Regex\""' \
  '"\"pretokenizers\""' '"\"BPE\""' '"\"merges\""' '"\"vocab\""' '"\"added_tokens\""' \
  '"\"TemplateProcessing\""' '"\"NFC\""' '"\"normalizer\""' '"\"rank\""' '"\"token_bytes\""' \
  '"\"token_str\""' '"\"ignore_merges\""' '"\"use_regex\""' >"$root/fuzz/dict/tokenizer_files.dict"
printf '%s\n' '"\\p{L}"' '"\\p{N}"' '"\\p{Lu}"' '"(?i:"' '"(?!"' '"(?="' '"(?:"' '"[^"' '"]+"' \
  '"{1,3}"' '"?+"' '"++"' '"\\s"' '"\\S"' '"\\d"' '"\\w"' '"|"' '"$"' >"$root/fuzz/dict/piece_regex.dict"
echo "make_corpus: $(find "$corpus" -type f | wc -l) seeds, $(wc -l <"$root/fuzz/dict/argv.dict") flags"
