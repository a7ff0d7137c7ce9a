// Whole-file reads and durable writes with the project's error style: a missing or unreadable file is one
// forge::Error line "<path>: cannot open <what> (no such file or not readable)", a failed write names the
// file and the reason, and leaves nothing half-written behind.
#pragma once

#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

namespace forge {

// The bytes of the file. `what` names it for the message ("config file", "tokenizer file", ...).
std::string read_file(const std::filesystem::path& path, std::string_view what);

// Replaces `path` with `bytes` in one step: writes "<path>.tmp", checks every write, fsyncs it, renames it
// over `path` and fsyncs the directory. On any failure the temporary file is removed, `path` is left as it
// was, and the error names `what`, the file and the reason (a full disk: "No space left on device").
void write_file_atomically(const std::filesystem::path& path, std::string_view bytes, std::string_view what);

// fsync of a directory, so a rename or a new file inside it survives a power loss. Best effort: a file
// system that cannot sync directories is not an error.
void fsync_directory(const std::filesystem::path& dir);

// Parses JSON, refusing what nlohmann would accept silently: a key given twice in one object (the last
// would win). Errors are one line: "<where>: invalid JSON: ..." or "<where>: key 'a.b' appears twice".
nlohmann::json parse_json_strict(std::string_view text, std::string_view where);

}  // namespace forge
