#!/usr/bin/env node
// Writes forge's tokenizer parity fixtures (tests/fixtures/tokenizer/) with the reference
// implementation: Hugging Face tokenizers, through its official Node binding (npm package "tokenizers",
// the Rust library compiled as a Node addon).
//
//   cd tests/reference/tokenizer && npm ci && node generate_fixtures.js ../../../build/bin/forge
//
// 1. Trains gpt2_style and llama3_style tokenizer.json files with forge on corpus.txt.
// 2. For every *.tokenizer.json fixture, writes <name>.expected.json: the reference's ids (with and
//    without special tokens) and decoded strings for a fixed list of texts plus seeded random ones,
//    and decodings of hand-picked id sequences (partial UTF-8 characters, special tokens).
// 3. Trains the reference's BpeTrainer (its defaults: vocabulary 30000, so it runs until no pair is
//    left) on corpus.txt with both split patterns: hf_trained_{gpt2,llama3}.tokenizer.json.
// 4. unicode_classes.json: the code points the reference's regular expressions take for \p{L}, \p{N}, \s.
"use strict";

const fs = require("fs");
const path = require("path");
const { execFileSync } = require("child_process");
const { Tokenizer } = require("tokenizers");

const FIXTURES = path.resolve(__dirname, "../../fixtures/tokenizer");
const REFERENCE = `tokenizers ${require("tokenizers/package.json").version} (npm; Hugging Face's Rust implementation)`;
const GPT2 = String.raw`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`;
const LLAMA3 = String.raw`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;

const forge = process.argv[2];
if (!forge) {
  console.error("usage: node generate_fixtures.js FORGE_BINARY");
  process.exit(2);
}

// JSON with one line per top-level key, and one line per element of top-level arrays.
function write(name, value) {
  const lines = Object.entries(value).map(([key, v]) =>
    Array.isArray(v) ? `${JSON.stringify(key)}: [\n${v.map((e) => "  " + JSON.stringify(e)).join(",\n")}\n]`
                     : `${JSON.stringify(key)}: ${JSON.stringify(v)}`);
  fs.writeFileSync(path.join(FIXTURES, name), "{\n" + lines.join(",\n") + "\n}\n");
  console.log("wrote", name);
}

// --- 1. forge-trained tokenizers -------------------------------------------------------------------
const corpus = path.join(FIXTURES, "corpus.txt");
function forgeTrain(name, args) {
  execFileSync(forge, ["tokenizer", "train", "--input", corpus, "--output", path.join(FIXTURES, name), ...args], {
    stdio: "inherit",
  });
}
forgeTrain("gpt2_style.tokenizer.json", ["--vocab-size", "1000", "--pattern", "gpt2", "--special-token", "<|endoftext|>"]);
forgeTrain("llama3_style.tokenizer.json", [
  "--vocab-size", "1000", "--pattern", "llama3", "--special-token", "<|begin_of_text|>",
  "--special-token", "<|end_of_text|>", "--bos-token", "<|begin_of_text|>",
]);

// --- 3. the reference's trainer ----------------------------------------------------------------------
function skeleton(preTokenizer) {
  return {
    version: "1.0", truncation: null, padding: null, added_tokens: [], normalizer: null,
    pre_tokenizer: preTokenizer, post_processor: null,
    decoder: { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: {
      type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: false, byte_fallback: false, ignore_merges: false, vocab: {}, merges: [],
    },
  };
}
const byteLevel = (useRegex) => ({ type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: useRegex });
for (const [name, preTokenizer] of [
  ["hf_trained_gpt2.tokenizer.json", byteLevel(true)],
  ["hf_trained_llama3.tokenizer.json", {
    type: "Sequence",
    pretokenizers: [{ type: "Split", pattern: { Regex: LLAMA3 }, behavior: "Isolated", invert: false }, byteLevel(false)],
  }],
]) {
  const t = Tokenizer.fromString(JSON.stringify(skeleton(preTokenizer)));
  t.train([corpus]);
  t.save(path.join(FIXTURES, name), false);
  console.log("wrote", name, "vocabulary", t.getVocabSize(true));
}

// --- 2. encode / decode expectations ------------------------------------------------------------------
const TEXTS = [
  "", " ", "a", "Hello world", "Hello, world!", "The quick brown fox jumps over the lazy dog.",
  "In the beginning God created the heaven and the earth.",
  "  leading spaces", "trailing spaces   ", "multiple    inner     spaces", "\ttabs\tand\t\ttabs",
  "line one\nline two\n\nline four", "windows\r\nline\r\nendings\r\n", "\n\n\n", " \n \n", "\r", "a\r\n\r\nb",
  "I'm", "YOU'LL", "She'S here", "they're", "We've", "it'd", "don't", "'s 't 're 've 'm 'll 'd",
  "'S 'T 'RE 'VE 'M 'LL 'D", "x'ſ long s", "rock'n'roll",
  "1", "12", "123", "1234", "12345678901234567890", "3.14159", "1,000,000", "year 2024!", "٣٤٥ ४२ ๓",
  "café naïve résumé Ünïcödé", "e\u0301 (e + combining acute)", "Straße", "ﬁ ligature",
  "中文字符", "日本語のテキスト、カタカナ", "한국어 텍스트", "北京是中国的首都，长城非常有名。",
  "مرحبا بالعالم", "שלום עולם", "Привет, мир!", "Ελληνικά",
  "👍", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷🇺🇸", "❤️", "🚀🚀🚀 launch", "a\u200db\u200cc",
  "nbsp\u00a0here", "nel\u0085here", "mongolian\u180eseparator", "line\u2028separator", "ideographic\u3000space",
  "en\u2002em\u2003space", "bom\ufeffhere", "\u0000null\u0001ctrl\u007f", "todhri \u{105c0}\u{105c1} garay \u{10d40}",
  "<|endoftext|>", "a<|endoftext|>b", "before <|endoftext|> after", "<|endoftext|><|endoftext|>",
  "<|begin_of_text|>Hello<|end_of_text|>", " <|begin_of_text|> spaced ", "<|endoftext", "<|end_of_text|",
  "<s>Hi</s>", "Hello <mask> world", "Hello   <mask>", "<mask><mask>", "[SEP]   next", "a [SEP]b",
  "<word> alone", "in<word>side", "<word>", "x <word>.", "ab", "cab", "abab", "<special token>", "é!", "café!",
  "🙂x", "a🙂x", "🙂x b", "the", "theme", "other the", "<|endoftext|>  spaced", "x  <|endoftext|>  y",
  "ab 12,x Qq. éz", "camelCaseWord and it's", "xxx", "qQq", "12.5,3!", "a, b. c! d? e",
  "abc ab a", "Hello the world <mask> ab 123,x Q", "ééé", "中中", "uNKNOWN Chars 123",
  "def square(x):\n    return x ** 2\n", "if (a && b) { return -1; } // comment", "https://example.org/path?q=1&r=2",
  "!!!???...", "....", "---===---", "a-b_c.d", "$100 @user #tag", "\"quoted\" 'single'",
  "pneumonoultramicroscopicsilicovolcanoconiosis", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
  "the".repeat(200), "ab".repeat(150), "x ".repeat(100), " ".repeat(300), "1".repeat(50),
  "And God said, Let there be light: and there was light.\nAnd God saw the light, that it was good.\n",
];

// Seeded random texts from a mix of scripts, spaces and special-token fragments.
function mulberry32(seed) {
  return function () {
    seed |= 0;
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const POOLS = [
  "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", "     ", "\n\r\t",
  "'.,!?;:-_()[]{}<>|/\\\"@#$%^&*+=~`", "éèêàçñüößøåÉ", "中文日本語한국어", "مرحبا שלום", "Привет",
  "\u0301\u200d\u00a0\u0085\u2028\u3000", "👍🏽🚀❤️🇫🇷",
];
const FRAGMENTS = ["<|endoftext|>", "<mask>", "[SEP]", "<word>", "ab", "the", "<s>", "'s", "'LL", "<|begin_of_text|>", "🙂x", "é!"];
const random = mulberry32(20240601);
for (let n = 0; n < 150; ++n) {
  const length = Math.floor(random() * 40);
  let text = "";
  for (let i = 0; i < length; ++i) {
    if (random() < 0.08) {
      text += FRAGMENTS[Math.floor(random() * FRAGMENTS.length)];
    } else {
      const pool = Array.from(POOLS[Math.floor(random() * POOLS.length)]);
      text += pool[Math.floor(random() * pool.length)];
    }
  }
  TEXTS.push(text);
}

// Byte-level form of one byte (GPT-2's table), to find the ids of single-byte tokens.
const BYTE_CHAR = (() => {
  const bs = [];
  for (let b = 33; b <= 126; ++b) bs.push(b);
  for (let b = 0xa1; b <= 0xac; ++b) bs.push(b);
  for (let b = 0xae; b <= 0xff; ++b) bs.push(b);
  const map = {};
  bs.forEach((b) => (map[b] = String.fromCodePoint(b)));
  let n = 0;
  for (let b = 0; b < 256; ++b) if (!(b in map)) map[b] = String.fromCodePoint(256 + n++);
  return map;
})();

async function expectations(name) {
  const file = path.join(FIXTURES, name);
  const t = Tokenizer.fromFile(file);
  const encode = [];
  for (const text of TEXTS) {
    const ids = (await t.encode(text, null, { addSpecialTokens: false })).getIds();
    const withSpecial = (await t.encode(text, null, { addSpecialTokens: true })).getIds();
    encode.push({
      text, ids, ids_with_special_tokens: withSpecial,
      decoded: await t.decode(withSpecial, false), decoded_skip_special: await t.decode(withSpecial, true),
    });
  }
  // Id sequences that cut characters apart or mix in special tokens.
  const decodeInputs = [];
  const byteIds = (bytes) => bytes.map((b) => t.tokenToId(BYTE_CHAR[b]));
  const bytesOf = (s) => Array.from(Buffer.from(s, "utf8"));
  for (const bytes of [[0xe2], [0xe2, 0x82], [0xe2, 0x82, 0xac], [0xe2, 0x41], [0xf0, 0x9f, 0x98], [0x80], [0xc0, 0xaf],
    [0xed, 0xa0, 0x80], [0xf4, 0x90, 0x80, 0x80], [0xff, 0x41, 0xfe], bytesOf("中").slice(1), bytesOf("👍").slice(0, 3).concat(bytesOf("a"))]) {
    const ids = byteIds(bytes);
    if (ids.every((id) => id !== null && id !== undefined)) decodeInputs.push(ids);
  }
  const vocab = t.getVocab(true);
  const specials = Object.keys(vocab).filter((k) => k.startsWith("<") && k.endsWith(">")).sort();
  const valid = (ids) => ids.every((id) => id !== null && id !== undefined);
  for (const s of specials) decodeInputs.push([vocab[s]]);
  for (const s of specials) if (valid(byteIds([0x41]))) decodeInputs.push([vocab[s], ...byteIds([0x41]), vocab[s]]);
  decodeInputs.push([]);
  const decode = [];
  for (const ids of decodeInputs) {
    decode.push({ ids, text: await t.decode(ids, false), text_skip_special: await t.decode(ids, true) });
  }
  write(name.replace(".tokenizer.json", ".expected.json"), {
    tokenizer: name, reference: REFERENCE, vocab_size: t.getVocabSize(true), encode, decode,
  });
}

// --- 4. character classes -----------------------------------------------------------------------------
function classes() {
  const all = [];
  for (let c = 1; c < 0x110000; ++c) if (c < 0xd800 || c > 0xdfff) all.push(c);
  const out = { reference: REFERENCE };
  for (const [key, pattern] of [["L", String.raw`\p{L}`], ["N", String.raw`\p{N}`], ["s", String.raw`\s`]]) {
    const json = skeleton({ type: "Split", pattern: { Regex: pattern }, behavior: "Removed", invert: false });
    const pre = Tokenizer.fromString(JSON.stringify(json)).getPreTokenizer();
    const matched = new Set(all);
    for (let i = 0; i < all.length; i += 4096) {
      for (const [piece] of pre.preTokenizeString(String.fromCodePoint(...all.slice(i, i + 4096))))
        for (const ch of piece) matched.delete(ch.codePointAt(0));
    }
    const ranges = [];
    for (const c of [...matched].sort((a, b) => a - b)) {
      if (ranges.length && ranges[ranges.length - 1][1] === c - 1) ranges[ranges.length - 1][1] = c;
      else ranges.push([c, c]);
    }
    out[key] = ranges;
  }
  write("unicode_classes.json", out);
}

(async () => {
  for (const name of fs.readdirSync(FIXTURES).filter((f) => f.endsWith(".tokenizer.json")).sort()) await expectations(name);
  classes();
})();
