#!/usr/bin/env node
// Encode throughput of the reference implementation (Hugging Face tokenizers, the Rust library through its
// Node binding) on one text, for bench/run_all.sh to set beside forge's BM_TokenizerEncodeKjv.
//   node bench_encode.js TOKENIZER_JSON TEXT_FILE [REPEATS]
// Prints one JSON line: MB/s of input text (best of REPEATS, after one untimed warm-up that fills the
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
  console.log(JSON.stringify({ engine: "hf-tokenizers", version: require("tokenizers/package.json").version,
    bytes, tokens, seconds: best, mb_per_s: bytes / best / 1e6 }));
})();
