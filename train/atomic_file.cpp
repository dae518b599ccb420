#include "train/atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "ringattn/error.hpp"

namespace ringattn::train {
namespace {

void fsync_path(const std::filesystem::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) {
    detail::fail_as(ErrorKind::io, "publish_file", "cannot open '", path.string(),
                    "' to sync it: ", std::strerror(errno));
  }
  const int status = ::fsync(fd);
  const int sync_errno = errno;
  ::close(fd);
  if (status != 0) {
    detail::fail_as(ErrorKind::io, "publish_file", "fsync of '", path.string(),
                    "' failed: ", std::strerror(sync_errno));
  }
}

}  // namespace

void publish_file(const std::filesystem::path& temporary,
                  const std::filesystem::path& destination) {
  fsync_path(temporary, O_RDONLY);
  std::error_code error;
  std::filesystem::rename(temporary, destination, error);
  if (error) {
    detail::fail_as(ErrorKind::io, "publish_file", "cannot rename '", temporary.string(), "' to '",
                    destination.string(), "': ", error.message());
  }
  const std::filesystem::path directory =
      destination.has_parent_path() ? destination.parent_path() : std::filesystem::path(".");
  fsync_path(directory, O_RDONLY | O_DIRECTORY);
}

}  // namespace ringattn::train
