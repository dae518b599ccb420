// Publishing a file all at once: readers see either no file or the complete one, also after a
// crash or a power cut.
#pragma once

#include <filesystem>

namespace ringattn::train {

// Makes the finished file `temporary` appear as `destination` (same directory): fsync the file,
// rename it over `destination`, fsync the directory so the rename itself is on disk. Throws
// ringattn::Error (ErrorKind::io) naming the file and the system's error.
void publish_file(const std::filesystem::path& temporary, const std::filesystem::path& destination);

}  // namespace ringattn::train
