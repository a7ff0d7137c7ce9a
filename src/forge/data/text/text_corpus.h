// Plain-text corpora for byte-level training: the default corpus (the King James Bible, from Debian's
// bible-kjv package) and user text files, plus a deterministic train / held-out split.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace forge::data {

// The KJV text, one verse per line without its reference label. The first call runs
// `bible -f Gen1:1-Rev22:21`, strips the labels and caches the text in <cache_dir>/kjv.txt (written to a
// temporary file and renamed, so an interrupted run never leaves a truncated cache); later calls read
// the cache. Throws forge::Error if the `bible` program is missing or its output is unexpected.
std::string load_kjv_text(const std::filesystem::path& cache_dir);

// Turns `bible -f` output ("Ge1:1 In the beginning ...", one verse a line) into verse text with one
// newline after each verse. A label is [digit]letters digits:digits followed by spaces; a line without a
// label continues the previous verse (in case the program wraps long lines). Throws if no line carries a
// label, since then the input is not `bible -f` output.
std::string strip_verse_labels(std::string_view bible_output);

// The KJV's verses with their references, in canonical order, from `bible -f Gen1:1-Rev22:21` (not
// cached): book (its full name, "Genesis" ... "Revelation"), chapter, verse and text.
struct KjvVerse {
  std::string book;
  int chapter = 0, verse = 0;
  std::string text;
};
std::vector<KjvVerse> load_kjv_verses();

// A user corpus. Throws forge::Error naming the path if it is missing, unreadable or empty.
std::string load_text_file(const std::filesystem::path& path);

// "kjv" means load_kjv_text(cache_dir); anything else is a path for load_text_file.
std::string load_corpus(std::string_view corpus, const std::filesystem::path& cache_dir);

struct TextSplit {
  std::string train, heldout;
};

// Deterministic split into `parts` equal parts (cut at line starts), each of whose tails is held out: the
// held-out text is spread over the whole corpus, as a random document split would be, rather than being its
// last book. In each part the held-out tail starts at the first line start at or after
// end - floor(fraction * part size), so it is at most `fraction` of the part and begins on a fresh line; if
// no line starts there (the tail is inside the part's last line), it is the last line(s) from the line start
// before it; if the part is a single line, the cut is at that byte offset. parts = 1: the text's tail.
// train and heldout are the parts' pieces in order; together they hold every byte once. Throws if fraction
// is not in (0, 1), parts < 1, or either side would be empty.
TextSplit split_heldout(const std::string& text, double fraction, int64_t parts = 1);

}  // namespace forge::data
