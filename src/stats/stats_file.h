// The statistics file (VRAMSWAP_STATS_FILE): writing a document to a path the user named,
// without destroying what is there.
//
// A regular file, or nothing yet, is replaced atomically: the document goes to a temporary
// file in the same directory, renamed over the path, so a reader never sees half a
// document. The temporary file cannot be redirected by another user who can write that
// directory: its name is random and it is created exclusively, never through a link. A
// symbolic link at the path is followed to what it names (the link stays a link) when this
// user or root owns it; another user's link is an error. Anything
// else the path already names (a FIFO, a character device, a socket) is written in place,
// opened without creating or truncating and without blocking (a FIFO with no reader is an
// error, not a hang): it is never replaced by a regular file. A directory is an error.
#pragma once

#include <string>

namespace vramswap::stats {

// The path VRAMSWAP_STATS_FILE names for this process: "{pid}" replaced by `pid`, "{rank}"
// by `rank` (the RANK variable torch.distributed's launchers set; "0" when it is unset or
// not a number), so that the processes of a distributed run write files of their own.
// Thread-safe: pure.
std::string expand_stats_path(const std::string& path, long pid, const char* rank);

// Writes `document` to `path` as above. Returns "" on success, else why not (the path and
// the system's reason). Thread-safe (no shared state; two writers of one path race as
// their renames do).
std::string write_stats_file(const std::string& path, const std::string& document);

}  // namespace vramswap::stats
