#include "forge/core/file_io.h"

#include <fstream>
#include <sstream>

#include "forge/core/error.h"

namespace forge {

std::string read_file(const std::filesystem::path& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open {} (no such file or not readable)", path.string(), what);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("{}: read error in {}", path.string(), what);
  return std::move(text).str();
}

}  // namespace forge
