#!/usr/bin/env node
// Encode throughput of the reference implementation (Hugging Face tokenizers, the Rust library through its
// Node binding) on one text, for bench/run_all.sh to set beside forge's BM_TokenizerEncodeKjv.
//   node bench_encode.js TOKENIZER_JSON TEXT_FILE [REPEATS]
// Prints one JSON line: MB/s of input text, encoded whole and line by line (best of REPEATS, after one untimed warm-up that fills the
// word cache, as forge's benchmark does) and the token count. Run with RAYON_NUM_THREADS=1: one encode
// call is single-threaded either way.
"use strict";

const fs = require("fs");
const { Tokenizer } = require("tokenizers");

(async () => {
  const [tokenizerPath, textPath, repeatsArg] = process.argv.slice(2);
  if (!tokenizerPath || !textPath) {
    console.error("usage: node bench_encode.js TOKENIZER_JSON TEXT_FILE [REPEATS]");
    process.exit(2);
  }
  const repeats = Number(repeatsArg || 5);
  const tokenizer = Tokenizer.fromFile(tokenizerPath);
  const text = fs.readFileSync(textPath, "utf8");
  const bytes = Buffer.byteLength(text, "utf8");
  let tokens = (await tokenizer.encode(text, null, { addSpecialTokens: false })).getIds().length;
  let best = Infinity;
  for (let i = 0; i < repeats; ++i) {
    const start = process.hrtime.bigint();
    const encoding = await tokenizer.encode(text, null, { addSpecialTokens: false });
    tokens = encoding.getLength();
    best = Math.min(best, Number(process.hrtime.bigint() - start) / 1e9);
  }
  // The usual way to tokenize a corpus: many short texts (here its lines) in one encodeBatch call, which
  // with RAYON_NUM_THREADS=1 runs on one thread. Long single texts are slower in the reference (it tracks
  // offsets and alignments for the whole text), so both figures are reported.
  const lines = text.split(/(?<=\n)/);
  await tokenizer.encodeBatch(lines, { addSpecialTokens: false });
  let bestLines = Infinity, lineTokens = 0;
  for (let i = 0; i < repeats; ++i) {
    const start = process.hrtime.bigint();
    const encodings = await tokenizer.encodeBatch(lines, { addSpecialTokens: false });
    bestLines = Math.min(bestLines, Number(process.hrtime.bigint() - start) / 1e9);
    lineTokens = encodings.reduce((n, e) => n + e.getLength(), 0);
  }
  console.log(JSON.stringify({ engine: "hf-tokenizers", version: require("tokenizers/package.json").version,
    bytes, tokens, seconds: best, mb_per_s: bytes / best / 1e6,
    lines: lines.length, line_tokens: lineTokens, lines_seconds: bestLines, lines_mb_per_s: bytes / bestLines / 1e6 }));
})();
