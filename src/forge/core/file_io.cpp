#include "forge/core/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <vector>

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

void fsync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes, std::string_view what) {
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  // POSIX calls rather than a stream: every short write and the fsync report errno (ENOSPC, EIO, ...).
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot write {} {}: {}", what, tmp.string(), std::strerror(errno));
  auto give_up = [&](const char* action) {
    const int error = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    fail("cannot {} {} {}: {}", action, what, tmp.string(), std::strerror(error));
  };
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) give_up("write");
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) give_up("fsync");
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    fail("cannot write {} {}: {}", what, tmp.string(), std::strerror(error));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    fail("cannot rename {} to {}: {}", tmp.string(), path.string(), std::strerror(error));
  }
  fsync_directory(path.parent_path());
}

nlohmann::json parse_json_strict(std::string_view text, std::string_view where) {
  // nlohmann keeps the last of duplicate keys; its callback sees every key first. keys[d] holds the keys
  // seen so far in the object open at depth d - 1 (restarted at each object_start), path[d] the current one.
  std::vector<std::set<std::string>> keys(1);
  std::vector<std::string> path(1);
  std::string duplicate;
  auto note = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (!duplicate.empty()) return true;
    const auto d = static_cast<size_t>(depth);
    if (event == nlohmann::json::parse_event_t::object_start) {
      if (keys.size() < d + 2) keys.resize(d + 2), path.resize(d + 2);
      keys[d + 1].clear();
    } else if (event == nlohmann::json::parse_event_t::array_start) {
      if (keys.size() < d + 2) keys.resize(d + 2), path.resize(d + 2);
      path[d + 1].clear();  // an array's elements have no key
    } else if (event == nlohmann::json::parse_event_t::key && parsed.is_string()) {
      if (keys.size() < d + 1) keys.resize(d + 1), path.resize(d + 1);
      const auto& key = parsed.get_ref<const std::string&>();
      path[d] = key;
      if (!keys[d].insert(key).second) {
        std::string name;
        for (size_t i = 1; i <= d; ++i)
          if (!path[i].empty()) name += (name.empty() ? "" : ".") + path[i];
        duplicate = name;
      }
    }
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.begin(), text.end(), note);
  } catch (const nlohmann::json::exception& e) {
    // e.what() is "[json.exception.parse_error.101] parse error at line 3, column 5: ..."; keep the part
    // after the bracketed id, which carries the line and column.
    std::string_view what = e.what();
    const size_t close = what.find("] ");
    fail("{}: invalid JSON: {}", where, close == std::string_view::npos ? what : what.substr(close + 2));
  }
  if (!duplicate.empty()) fail("{}: key '{}' appears twice", where, duplicate);
  return j;
}

}  // namespace forge
