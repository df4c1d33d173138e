// One seed of the stress test: several threads, each a random but correct program over
// the real libvramswap.so, checked against a shadow model of what every block must hold.
//
// Each thread owns its blocks (allocated, written, read, packed, marked cold, unpacked,
// released and freed by that thread alone) and a few streams it creates and destroys,
// beside the legacy and per-thread default streams; memory pressure, eviction, prefetch and
// the pool's reuse are shared by all threads. The program keeps the protocol a correct
// program keeps (DESIGN.md, "Residency and the tracker protocol"; vramswap.h):
//   * a block's data is read or written only while the program may touch it: before
//     mark_cold, or after an unpack on the stream it uses next, or after its last release;
//   * work on a stream other than the one the block's latest work is queued on is first
//     ordered after it (an event, or a host synchronization when an event call fails), and
//     a stream other than the block's allocation stream is named with record_stream (or
//     synchronized before the free, when record_stream fails);
//   * mark_cold is called on a stream ordered after the block's latest work; the unpack of a
//     cold block, on any stream, relies on vramswap to order that stream after the cold mark
//     (vramswap.h: the contents are valid for work queued on it after the call);
//   * a stream is destroyed only when no live block of the thread names it;
//   * a kept block (vramswap_keep, only of a block neither packed nor kept) is read and, when
//     not frozen, written only between vramswap_use and vramswap_mark_cold; between them
//     it is cold, and with one thread and no faults injected it is also read then, through
//     its address, after a device synchronization, as a checkpoint reads a weight (Note
//     [Kept blocks stay addressable]: where the driver has host VMM an evicted kept block's
//     address reaches its bytes; the synchronization lands a fetch ahead of use that may be
//     in flight; with several threads another thread's allocation may give it up under the
//     read).
// Every byte read back is compared with the shadow; a difference, a call that fails
// without a message, a stale handle that is accepted, a call that fails with no fault
// injected (other than out of memory), or a leak at the end of the seed is a failure.
// Under injected faults (cudasim_fail_configure after setup) a call may fail: the program
// does what a program would (the block stays as it was; it tries again later or frees
// it), and the shadow must still match wherever the program may read.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "known_bugs.h"
#include "library.h"

namespace stress {

struct Options {
  uint64_t seed = 1;
  uint64_t seeds = 1;          // seeds seed .. seed+seeds-1, one after another in this process
  int threads = 2;
  int ops = 300;               // random operations per thread per seed
  bool verify = false;         // VRAMSWAP_VERIFY=1
  std::string faults;          // a CUDASIM_FAIL rule list set after setup; "auto": one drawn per seed
  bool chaos = false;          // CUDASIM_CHAOS=<first seed>
  std::string limit = "32MiB"; // VRAMSWAP_LIMIT
  std::string host_limit;      // VRAMSWAP_HOST_LIMIT; empty: the library's default
  bool disk = false;           // a disk tier (VRAMSWAP_DISK_DIR) in a directory of the run's own
  int invariants_every = 16;   // vramswap_check_invariants every this many ops of a thread
  bool verbose = false;        // say why each call was refused
  bool trace = false;          // print every operation on every block
  std::string sim_dir;         // cudasim's libraries
  std::string library;         // libvramswap.so
  std::vector<std::string> known_bugs;  // --known-bug: failures of these bugs do not fail
};

// The failures of one seed, from any thread. A failure of the data or of the state stops
// the random programs at their next op (what follows it would only repeat it); a poor
// message does not, and is reported once per `key`. A failure that is one of the `known`
// bugs (known_bugs.h) the run tolerates is counted apart and stops nothing.
class Failures {
 public:
  Failures(std::vector<const KnownBug*> known, std::string spec) : known_(std::move(known)), spec_(std::move(spec)) {}
  void add(const std::string& message);
  void add_message_defect(const std::string& key, const std::string& message);
  bool any() const { return stopping_.load(std::memory_order_relaxed); }
  std::vector<std::string> take();
  // The known bugs seen: each one's name, how often, and its first failure message.
  struct Seen {
    const KnownBug* bug;
    int count;
    std::string first;
  };
  std::vector<Seen> known_seen();

 private:
  bool tolerated(const std::string& message);  // caller holds mu_

  const std::vector<const KnownBug*> known_;
  const std::string spec_;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::vector<std::string> messages_;
  std::vector<std::string> keys_;
  std::vector<Seen> seen_;
};

// What one seed did, for its summary line.
struct SeedStats {
  std::atomic<uint64_t> ops{0}, allocs{0}, ooms{0}, reads{0}, bytes_checked{0}, packs{0}, colds{0}, unpacks{0},
      releases{0}, frees{0}, refused{0}, stale_probes{0}, invariant_checks{0}, keeps{0}, uses{0}, unkeeps{0},
      reads_while_kept{0};
};

// The rule list "--faults auto" draws for `seed`: a few of the functions vramswap calls,
// each failing with a small probability.
std::string auto_fault_spec(uint64_t seed);

// The rule list of a seed for --faults `faults`: "auto" (auto_fault_spec), "all:pX" (every
// function auto draws from, each failing with probability X), or a rule list as it is. An
// "all:" value that is not "all:p" and a probability from 0 to 1 gives "" with *error set.
std::string fault_spec(const std::string& faults, uint64_t seed, std::string* error);

// Runs one seed: `spec` is the rule list for this seed ("" for none). Failures go to
// `failures`; counts to `stats`.
void run_seed(const Library& lib, const Options& options, uint64_t seed, const std::string& spec,
              Failures* failures, SeedStats* stats);

}  // namespace stress
