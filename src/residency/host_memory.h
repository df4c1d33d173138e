// How much host memory this process may use: the machine's physical memory, or its cgroup's
// memory limit when lower (v2 memory.max, the process's own cgroup first; v1
// memory.limit_in_bytes). The host tier's default limit is half of it (host_tier.h,
// default_host_limit_bytes): pinned memory beyond what the process may use invites the OOM
// killer.
//
// Thread safety: host_memory_bytes() reads /proc and /sys each call; the parser is pure.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace vramswap::residency {

// The memory the process may use: physical memory (sysconf), or the cgroup's limit
// (v2 memory.max, v1 memory.limit_in_bytes) when lower. Thread-safe.
uint64_t host_memory_bytes();

// The limit a cgroup memory file states ("max" or a byte count, with or without a
// newline); nullopt for "max" or anything that is not a number. Thread-safe: pure.
std::optional<uint64_t> parse_cgroup_memory_limit(std::string_view text);

}  // namespace vramswap::residency
