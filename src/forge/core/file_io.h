// Whole-file reads with the project's error style: a missing or unreadable file is one forge::Error line
// "<path>: cannot open <what> (no such file or not readable)".
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace forge {

// The bytes of the file. `what` names it for the message ("config file", "tokenizer file", ...).
std::string read_file(const std::filesystem::path& path, std::string_view what);

}  // namespace forge
