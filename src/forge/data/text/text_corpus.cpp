#include "forge/data/text/text_corpus.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "forge/core/error.h"
#include "forge/core/file_io.h"

namespace forge::data {
namespace {

// The whole Bible, Genesis 1:1 to Revelation 22:21; -f turns pretty-printing off (one labelled verse a line).
constexpr const char* kBibleArguments = "-f Gen1:1-Rev22:21";

// Length of the "Ge1:1 " / "1Chr12:3 " label at the start of a line, spaces included; 0 if there is none.
size_t verse_label_length(std::string_view line) {
  size_t i = 0;
  auto digits = [&] {
    size_t start = i;
    while (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i]))) ++i;
    return i > start;
  };
  if (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i]))) ++i;  // "1Chr", "2Ki"
  size_t letters = i;
  while (i < line.size() && std::isalpha(static_cast<unsigned char>(line[i]))) ++i;
  if (i == letters) return 0;
  if (!digits()) return 0;
  if (i >= line.size() || line[i] != ':') return 0;
  ++i;
  if (!digits()) return 0;
  if (i < line.size() && line[i] != ' ' && line[i] != '\t') return 0;
  while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  return i;
}

std::filesystem::path find_on_path(std::string_view program) {
  const char* path = std::getenv("PATH");
  std::string_view dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  while (!dirs.empty()) {
    size_t colon = dirs.find(':');
    std::string_view dir = dirs.substr(0, colon);
    dirs = colon == std::string_view::npos ? std::string_view() : dirs.substr(colon + 1);
    if (dir.empty()) continue;
    std::filesystem::path candidate = std::filesystem::path(dir) / program;
    if (::access(candidate.c_str(), X_OK) == 0 && std::filesystem::is_regular_file(candidate))
      return candidate;
  }
  return {};
}

std::string run_bible_program() {
  std::filesystem::path bible = find_on_path("bible");
  if (bible.empty())
    fail(
        "default corpus 'kjv': the 'bible' program was not found on PATH; install bible-kjv "
        "(scripts/install-deps.sh) or set data.corpus to a text file");
  std::string command = fmt::format("'{}' {} 2>/dev/null", bible.string(), kBibleArguments);
  FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe) fail("default corpus 'kjv': cannot run '{}': {}", bible.string(), std::strerror(errno));
  std::string output;
  char buffer[1 << 16];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, got);
  int status = ::pclose(pipe);
  if (status != 0)
    fail("default corpus 'kjv': '{} {}' failed (exit status {})", bible.string(), kBibleArguments,
         WIFEXITED(status) ? WEXITSTATUS(status) : status);
  return output;
}

// Every rank of a job may fill the cache at once: each writes its own "<cache>.<pid>" (checked writes,
// fsync, removed on failure, so a full disk keeps no half-written temporary) and renames it into place; the
// copies are identical, so whichever rename lands last is as good as the first.
void write_cache(const std::filesystem::path& cache, std::string_view text) {
  std::filesystem::path own = cache;
  own += fmt::format(".{}", ::getpid());
  write_file_atomically(own, text, "corpus cache");
  std::error_code ec;
  std::filesystem::rename(own, cache, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(own, ignored);
    fail("{}: cannot move corpus cache into place: {}", cache.string(), ec.message());
  }
}

// Each verse of `bible -f` output, in order: its label ("Ge1:1") and its text, a wrapped continuation line
// rejoined with one space. Text before the first label (a banner) is dropped. Throws when no line carries
// a label, since then the input is not `bible -f` output.
template <typename OnVerse>
void for_each_verse(std::string_view output, OnVerse on_verse) {
  std::string_view label;
  std::string text;
  bool seen_label = false;
  while (!output.empty()) {
    size_t newline = output.find('\n');
    std::string_view line = output.substr(0, newline);
    output = newline == std::string_view::npos ? std::string_view() : output.substr(newline + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    while (!line.empty() && (line.back() == ' ' || line.back() == '\t')) line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t length = verse_label_length(line);
    if (length > 0) {
      if (seen_label) on_verse(label, std::move(text));
      seen_label = true;
      label = line.substr(0, line.find_first_of(" \t")), text = std::string(line.substr(length));
    } else if (seen_label) {
      while (line.front() == ' ' || line.front() == '\t') line.remove_prefix(1);
      text.append(1, ' ').append(line);
    }
  }
  if (!seen_label) fail("default corpus 'kjv': unexpected output from 'bible' (no verse labels found)");
  on_verse(label, std::move(text));
}

}  // namespace

std::string strip_verse_labels(std::string_view output) {
  std::string text;
  text.reserve(output.size());
  for_each_verse(output,
                 [&](std::string_view, const std::string& verse) { text.append(verse).push_back('\n'); });
  return text;
}

std::vector<KjvVerse> load_kjv_verses() {
  static const char* const kBooks[] = {"Genesis",
                                       "Exodus",
                                       "Leviticus",
                                       "Numbers",
                                       "Deuteronomy",
                                       "Joshua",
                                       "Judges",
                                       "Ruth",
                                       "1 Samuel",
                                       "2 Samuel",
                                       "1 Kings",
                                       "2 Kings",
                                       "1 Chronicles",
                                       "2 Chronicles",
                                       "Ezra",
                                       "Nehemiah",
                                       "Esther",
                                       "Job",
                                       "Psalms",
                                       "Proverbs",
                                       "Ecclesiastes",
                                       "Song of Solomon",
                                       "Isaiah",
                                       "Jeremiah",
                                       "Lamentations",
                                       "Ezekiel",
                                       "Daniel",
                                       "Hosea",
                                       "Joel",
                                       "Amos",
                                       "Obadiah",
                                       "Jonah",
                                       "Micah",
                                       "Nahum",
                                       "Habakkuk",
                                       "Zephaniah",
                                       "Haggai",
                                       "Zechariah",
                                       "Malachi",
                                       "Matthew",
                                       "Mark",
                                       "Luke",
                                       "John",
                                       "Acts",
                                       "Romans",
                                       "1 Corinthians",
                                       "2 Corinthians",
                                       "Galatians",
                                       "Ephesians",
                                       "Philippians",
                                       "Colossians",
                                       "1 Thessalonians",
                                       "2 Thessalonians",
                                       "1 Timothy",
                                       "2 Timothy",
                                       "Titus",
                                       "Philemon",
                                       "Hebrews",
                                       "James",
                                       "1 Peter",
                                       "2 Peter",
                                       "1 John",
                                       "2 John",
                                       "3 John",
                                       "Jude",
                                       "Revelation"};
  std::vector<KjvVerse> verses;
  std::string abbreviation;  // the current book's, as `bible` labels it ("Ge", "Exo", ...)
  int book = -1;
  for_each_verse(run_bible_program(), [&](std::string_view ref, std::string text) {
    const size_t colon = ref.find(':');
    size_t digits = colon;
    while (digits > 1 && std::isdigit(static_cast<unsigned char>(ref[digits - 1]))) --digits;
    const std::string name(ref.substr(0, digits));
    if (name != abbreviation) abbreviation = name, ++book;
    if (book >= 66) fail("default corpus 'kjv': more than 66 books in the output of 'bible'");
    KjvVerse v;
    v.book = kBooks[book];
    v.chapter = std::stoi(std::string(ref.substr(digits, colon - digits)));
    v.verse = std::stoi(std::string(ref.substr(colon + 1)));
    v.text = std::move(text);
    verses.push_back(std::move(v));
  });
  if (book != 65) fail("default corpus 'kjv': expected 66 books from 'bible', found {}", book + 1);
  return verses;
}

std::string load_kjv_text(const std::filesystem::path& cache_dir) {
  const std::filesystem::path cache = cache_dir / "kjv.txt";
  std::error_code ec;
  if (std::filesystem::is_regular_file(cache, ec) && std::filesystem::file_size(cache, ec) > 0)
    return read_file(cache, "text file");
  std::string text = strip_verse_labels(run_bible_program());
  std::filesystem::create_directories(cache_dir, ec);
  if (ec) fail("{}: cannot create corpus cache directory: {}", cache_dir.string(), ec.message());
  write_cache(cache, text);
  return text;
}

std::string load_text_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail("{}: corpus file not found", path.string());
  if (std::filesystem::is_directory(path, ec))
    fail("{}: corpus is a directory, expected a text file", path.string());
  std::string text = read_file(path, "text file");
  if (text.empty()) fail("{}: corpus file is empty", path.string());
  return text;
}

std::string load_corpus(std::string_view corpus, const std::filesystem::path& cache_dir) {
  if (corpus == "kjv") return load_kjv_text(cache_dir);
  return load_text_file(std::filesystem::path(corpus));
}

namespace {

// Where the held-out tail of text[begin, end) starts (see split_heldout).
size_t tail_cut(const std::string& text, size_t begin, size_t end, double fraction) {
  const auto heldout_bytes = static_cast<size_t>(fraction * static_cast<double>(end - begin));
  const size_t target = end - heldout_bytes;
  if (target <= begin || text[target - 1] == '\n') return target;
  const size_t next = text.find('\n', target);
  if (next != std::string::npos && next + 1 < end) return next + 1;
  const size_t previous = text.rfind('\n', target - 1);
  if (previous != std::string::npos && previous >= begin) return previous + 1;
  return target;
}

}  // namespace

TextSplit split_heldout(const std::string& text, double fraction, int64_t parts) {
  if (!(fraction > 0.0 && fraction < 1.0)) fail("held-out fraction must be in (0, 1), got {}", fraction);
  if (parts < 1) fail("held-out parts must be >= 1, got {}", parts);
  const size_t size = text.size();
  TextSplit split;
  size_t begin = 0;
  for (int64_t k = 0; k < parts && begin < size; ++k) {
    // The part ends at the first line start at or after its equal share (the last part at the end).
    size_t end = size;
    if (k + 1 < parts) {
      const size_t share = static_cast<size_t>(static_cast<double>(size) * static_cast<double>(k + 1) /
                                               static_cast<double>(parts));
      const size_t newline = share > begin ? text.find('\n', share - 1) : std::string::npos;
      end = newline == std::string::npos ? size : newline + 1;
      if (end <= begin) continue;
    }
    const size_t cut = tail_cut(text, begin, end, fraction);
    split.train.append(text, begin, cut - begin);
    split.heldout.append(text, cut, end - cut);
    begin = end;
  }
  if (split.train.empty() || split.heldout.empty())
    fail("held-out fraction {} of a {}-byte text{} leaves an empty train or held-out part", fraction, size,
         parts > 1 ? fmt::format(" in {} parts", parts) : "");
  return split;
}

}  // namespace forge::data
