// vramswap_stress: a shadow-model stress test of the real libvramswap.so on cudasim.
//
//   vramswap_stress --seed S [--seeds N] [--threads T] [--ops K] [--verify]
//                   [--faults SPEC|auto|all:pX] [--chaos] [--limit SIZE] [--keep-going] [--fork]
//                   [--verbose] [--trace] [--invariants-every N] [--known-bug NAME]...
//                   [--host-limit SIZE] [--disk]
//
// Each seed runs T threads of K random operations each (worker.h: what they do and what
// counts as a failure) under VRAMSWAP_LIMIT (32MiB by default, so that cold blocks are
// really evicted), then frees everything, empties vramswap's cache and checks that
// nothing leaked: vramswap's allocated, tagged, host and tracked counts are 0, and
// cudasim's device physical memory and pinned host memory are 0. With --faults, the rule
// list (cudasim's CUDASIM_FAIL syntax; "auto" draws one per seed; "all:pX" fails every
// function "auto" draws from with probability X) is set after the threads' setup and
// cleared before the cleanup. --seeds runs seeds S..S+N-1 one after another: in this
// process (the library and its limit stay, and a seed is judged by what it left itself), or
// with --fork each in a process of its own (a leak or a crash stays with its seed: what a
// campaign wants). --chaos sets CUDASIM_CHAOS=S before cudasim loads.
// --host-limit sets VRAMSWAP_HOST_LIMIT; --disk gives vramswap a disk tier in a directory
// the run makes for itself and removes at its end (with a small --host-limit, evicted
// blocks go on to the disk, and blocks larger than the pinned tier go there in chunks).
// --known-bug NAME tolerates the failures of a product bug not fixed yet (known_bugs.h).
// A failure prints the seed, the thread, the operation, the block and the command that
// reproduces it; the exit status is 0 when every seed passed, 1 when one failed, 2 for a
// usage or setup error.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "library.h"
#include "worker.h"

#ifndef CUDASIM_LIBRARY_DIR
#error "CUDASIM_LIBRARY_DIR must name the directory of cudasim's libraries"
#endif
#ifndef VRAMSWAP_LIBRARY_PATH
#error "VRAMSWAP_LIBRARY_PATH must name the built libvramswap.so"
#endif

namespace {

using stress::Options;

constexpr const char* kUsage =
    "usage: vramswap_stress --seed S [--seeds N] [--threads T] [--ops K] [--verify] [--faults SPEC|auto|all:pX]\n"
    "                       [--chaos] [--limit SIZE] [--invariants-every N] [--keep-going] [--fork]\n"
    "                       [--verbose] [--trace] [--known-bug NAME]... [--host-limit SIZE] [--disk]\n"
    "                       [--sim-dir DIR] [--library PATH]\n";

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "vramswap_stress: %s\n%s", why.c_str(), kUsage);
  std::exit(2);
}

uint64_t number(const char* flag, const char* text, uint64_t min, uint64_t max) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (!*text || *end || v < min || v > max)
    usage(std::string(flag) + " '" + text + "' is not an integer from " + std::to_string(min) + " to " +
          std::to_string(max));
  return v;
}

struct Parsed {
  Options options;
  bool keep_going = false;
  bool fork = false;  // each seed in a process of its own
};

Parsed parse(int argc, char** argv) {
  Parsed p;
  Options& o = p.options;
  o.sim_dir = CUDASIM_LIBRARY_DIR;
  o.library = VRAMSWAP_LIBRARY_PATH;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--seed") o.seed = number("--seed", value(), 0, UINT64_MAX / 2);
    else if (a == "--seeds") o.seeds = number("--seeds", value(), 1, 1000000);
    else if (a == "--threads") o.threads = int(number("--threads", value(), 1, 16));
    else if (a == "--ops") o.ops = int(number("--ops", value(), 0, 10000000));
    else if (a == "--verify") o.verify = true;
    else if (a == "--faults") {
      o.faults = value();
      std::string error;
      if (stress::fault_spec(o.faults, 0, &error).empty() && !error.empty()) usage("--faults " + error);
    } else if (a == "--chaos") o.chaos = true;
    else if (a == "--limit") o.limit = value();
    else if (a == "--host-limit") o.host_limit = value();
    else if (a == "--disk") o.disk = true;
    else if (a == "--invariants-every") o.invariants_every = int(number("--invariants-every", value(), 0, 1000000));
    else if (a == "--known-bug") {
      const char* name = value();
      if (!stress::find_known_bug(name))
        usage(std::string("--known-bug '") + name + "' is not a known bug; known: " + stress::known_bug_names());
      o.known_bugs.push_back(name);
    } else if (a == "--keep-going") p.keep_going = true;
    else if (a == "--fork") p.fork = true;
    else if (a == "--verbose") o.verbose = true;
    else if (a == "--trace") o.trace = true;
    else if (a == "--sim-dir") o.sim_dir = value();
    else if (a == "--library") o.library = value();
    else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else usage("unknown argument '" + a + "'");
  }
  return p;
}

// The command line that runs `seed` alone with these options. `alone`: the seed runs in a
// process of its own (the first seed, or --fork), where --chaos means CUDASIM_CHAOS=seed;
// a later seed of a --seeds run shares the first one's CUDASIM_CHAOS, and was preceded by
// the other seeds' work (which may matter: say so).
std::string reproduce(const Options& o, uint64_t seed, const std::string& spec, bool alone) {
  std::string c = "vramswap_stress --seed " + std::to_string(seed) + " --threads " + std::to_string(o.threads) +
                  " --ops " + std::to_string(o.ops) + " --limit " + o.limit;
  if (!o.host_limit.empty()) c += " --host-limit " + o.host_limit;
  if (o.disk) c += " --disk";
  if (o.verify) c += " --verify";
  if (!spec.empty()) c += " --faults '" + spec + "'";
  if (o.chaos && alone) c += " --chaos";
  if (o.invariants_every != Options().invariants_every)
    c += " --invariants-every " + std::to_string(o.invariants_every);
  for (const std::string& bug : o.known_bugs) c += " --known-bug " + bug;
  if (const char* chaos = std::getenv("CUDASIM_CHAOS"); chaos && !(o.chaos && alone))
    c = "CUDASIM_CHAOS=" + std::string(chaos) + " " + c;
  if (!alone)
    c += "  (or, with the seeds before it: vramswap_stress --seed " + std::to_string(o.seed) + " --seeds " +
         std::to_string(seed - o.seed + 1) + " ...)";
  return c;
}

// What a fatal signal prints: set at the start of each seed (no allocation in the handler).
char g_fatal_note[2048] = "vramswap_stress: fatal signal before the first seed\n";

void on_fatal_signal(int sig) {
  ssize_t ignored = write(STDERR_FILENO, g_fatal_note, std::strlen(g_fatal_note));
  (void)ignored;
  signal(sig, SIG_DFL);
  raise(sig);
}

// A count that must be 0 at the end of a seed: a failure when it is not. A seed is judged
// by what it added (`before`: the count when it started, 0 unless an earlier seed of the
// process leaked), so one leak is reported once, by the seed that made it.
void expect_nothing_left(const std::string& what, long long before, long long after, const std::string& where,
                         stress::Failures* failures) {
  if (after == 0 || after == before) return;
  std::string m =
      where + ": " + what + " is " + std::to_string(after) + " after everything was freed and the cache emptied";
  if (before != 0) m += " (" + std::to_string(before) + " when the seed started)";
  failures->add(m);
}

// --disk: the disk tier's directory, made by set_up and removed by remove_disk_dir (the
// tier's file is unlinked from the start, so the directory is empty by then).
std::string g_disk_dir;

void remove_disk_dir() {
  if (!g_disk_dir.empty() && rmdir(g_disk_dir.c_str()) != 0)
    std::fprintf(stderr, "vramswap_stress: cannot remove %s: %s\n", g_disk_dir.c_str(), std::strerror(errno));
  g_disk_dir.clear();
}

// Loads cudasim and libvramswap.so and configures vramswap; false (after saying why) on
// a setup error.
bool set_up(const Options& o, stress::Library* lib) {
  std::string error;
  if (!lib->load(o.sim_dir, o.library, &error)) {
    std::fprintf(stderr, "vramswap_stress: %s\n", error.c_str());
    return false;
  }
  // The engine's settings apply when the first pool is created: before any allocation.
  const char* log = std::getenv("VRAMSWAP_LOG");
  std::vector<std::pair<const char*, std::string>> settings = {
      {"VRAMSWAP_LIMIT", o.limit},
      {"VRAMSWAP_VERIFY", o.verify ? "1" : "0"},
      {"VRAMSWAP_MIN_OFFLOAD_BYTES", "64KiB"},
      // Refusals are expected here (out of memory, injected faults); the driver checks each.
      {"VRAMSWAP_LOG", log ? log : "off"},
  };
  if (!o.host_limit.empty()) settings.emplace_back("VRAMSWAP_HOST_LIMIT", o.host_limit);
  if (o.disk) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/vramswap-stress-disk-XXXXXX";
    if (!mkdtemp(pattern.data())) {
      std::fprintf(stderr, "vramswap_stress: cannot make a directory for the disk tier (%s): %s\n", pattern.c_str(),
                   std::strerror(errno));
      return false;
    }
    g_disk_dir = pattern;
    settings.emplace_back("VRAMSWAP_DISK_DIR", g_disk_dir);
  }
  for (const auto& [key, value] : settings)
    if (lib->configure(key, value.c_str()) != 0) {
      std::fprintf(stderr, "vramswap_stress: vramswap_configure(%s, %s): %s\n", key, value.c_str(), lib->last_error());
      remove_disk_dir();
      return false;
    }
  if (!lib->check_invariants)
    std::printf("vramswap_stress: this libvramswap.so has no vramswap_check_invariants; its checks are skipped\n");
  return true;
}

// Runs one seed in this process and prints its summary (and its failures); true when it
// passed.
bool run_one(const stress::Library& lib, const Options& o, uint64_t seed, bool alone) {
  std::string ignored;  // checked by parse()
  const std::string spec = stress::fault_spec(o.faults, seed, &ignored);
  const std::string repro = reproduce(o, seed, spec, alone);
  std::snprintf(g_fatal_note, sizeof g_fatal_note, "vramswap_stress: fatal signal in seed %llu; reproduce: %s\n",
                (unsigned long long)seed, repro.c_str());
  const std::string before = lib.stats();
  const uint64_t injected_before = lib.failures_injected();
  cudasim_counters sim_before{};
  lib.get_counters(0, &sim_before);
  const auto start = std::chrono::steady_clock::now();

  std::vector<const stress::KnownBug*> known;
  for (const std::string& name : o.known_bugs) known.push_back(stress::find_known_bug(name));
  stress::Failures failures(known, spec);
  stress::SeedStats stats;
  stress::run_seed(lib, o, seed, spec, &failures, &stats);

  // Nothing may be left: vramswap's counts, cudasim's device and pinned memory.
  const std::string where = "seed " + std::to_string(seed) + " at the end";
  if (lib.device_synchronize() != cudaSuccess)
    failures.add(where + ": cudaDeviceSynchronize failed: " + lib.error_name(lib.get_last_error()));
  lib.empty_cache();
  if (*lib.last_error()) failures.add(where + ": vramswap_empty_cache: " + lib.last_error());
  const std::string after = lib.stats();
  for (const char* key : {"allocated_bytes", "num_tracked_blocks", "tagged_bytes", "host_bytes", "evicted_bytes",
                          "in_flight_bytes"})
    expect_nothing_left(std::string("vramswap_stats_json's ") + key, stress::stat_number(before, key),
                        stress::stat_number(after, key), where, &failures);
  const long long verify_failures =
      stress::stat_number(after, "num_verify_failures") - stress::stat_number(before, "num_verify_failures");
  if (verify_failures != 0) failures.add(where + ": num_verify_failures grew by " + std::to_string(verify_failures));
  cudasim_counters c{};
  if (lib.get_counters(0, &c) != 0) {
    failures.add(where + ": cudasim_get_counters failed");
  } else {
    expect_nothing_left("device memory in use (cudasim physical_bytes)", (long long)sim_before.physical_bytes,
                        (long long)c.physical_bytes, where, &failures);
    expect_nothing_left("pinned host memory in use (cudasim pinned_bytes)", (long long)sim_before.pinned_bytes,
                        (long long)c.pinned_bytes, where, &failures);
  }
  if (lib.check_invariants && lib.check_invariants() != 0)
    failures.add(where + ": vramswap_check_invariants: " + lib.last_error());

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto delta = [&](const char* key) {
    return stress::stat_number(after, key) - stress::stat_number(before, key);
  };
  const std::vector<std::string> messages = failures.take();
  const std::vector<stress::Failures::Seen> seen = failures.known_seen();
  std::string verdict = messages.empty() ? "ok" : "FAILED";
  for (size_t i = 0; i < seen.size(); ++i)
    verdict += (i ? ", " : " (known bugs seen: ") + std::string(seen[i].bug->name) + " x" +
               std::to_string(seen[i].count) + (i + 1 == seen.size() ? ")" : "");
  const long long left = stress::stat_number(before, "allocated_bytes");
  if (left > 0 || sim_before.physical_bytes > 0)
    verdict += " (started with " + std::to_string(left) + " bytes allocated and " +
               std::to_string(sim_before.physical_bytes) + " bytes of device memory left by earlier seeds)";
  std::printf("seed %llu%s%s: %s in %.1f s: %llu ops, %llu reads (%.1f MiB checked), %llu packs, %llu cold, "
              "%llu unpacks, %llu releases, %llu frees, %llu out of memory, %llu refused, %llu stale probes, "
              "%llu keeps, %llu uses, %llu unkeeps, %llu reads of cold kept blocks, "
              "%lld evictions, %lld prefetches, %lld faults, %llu failures injected\n",
              (unsigned long long)seed, spec.empty() ? "" : " faults ", spec.c_str(), verdict.c_str(), seconds,
              (unsigned long long)stats.ops.load(), (unsigned long long)stats.reads.load(),
              double(stats.bytes_checked.load()) / (1 << 20), (unsigned long long)stats.packs.load(),
              (unsigned long long)stats.colds.load(), (unsigned long long)stats.unpacks.load(),
              (unsigned long long)stats.releases.load(), (unsigned long long)stats.frees.load(),
              (unsigned long long)stats.ooms.load(), (unsigned long long)stats.refused.load(),
              (unsigned long long)stats.stale_probes.load(), (unsigned long long)stats.keeps.load(),
              (unsigned long long)stats.uses.load(), (unsigned long long)stats.unkeeps.load(),
              (unsigned long long)stats.reads_while_kept.load(), delta("num_evictions"), delta("num_prefetches"),
              delta("num_faults"), (unsigned long long)(lib.failures_injected() - injected_before));
  for (const auto& k : seen) std::printf("known bug %s: %s\n", k.bug->name, k.first.c_str());
  std::fflush(stdout);
  if (messages.empty()) return true;
  for (const std::string& m : messages) std::fprintf(stderr, "FAILURE: %s\n", m.c_str());
  std::fprintf(stderr, "reproduce: %s\n", repro.c_str());
  std::fflush(stderr);
  return false;
}

// --fork: seed by seed, each in a new process (fresh libraries, a crash or a leak stays
// with its seed). The exit status of each child is its verdict.
int run_forked(const Parsed& parsed) {
  const Options& o = parsed.options;
  std::vector<std::string> failed;
  uint64_t ran = 0;
  for (uint64_t seed = o.seed; seed < o.seed + o.seeds; ++seed) {
    ++ran;
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("vramswap_stress: fork");
      return 2;
    }
    if (pid == 0) {
      if (o.chaos) setenv("CUDASIM_CHAOS", std::to_string(seed).c_str(), 1);
      stress::Library lib;
      if (!set_up(o, &lib)) _exit(2);
      const bool ok = run_one(lib, o, seed, true);
      remove_disk_dir();
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(ok ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    std::string what = std::to_string(seed);
    if (WIFSIGNALED(status)) {
      what += " (signal " + std::to_string(WTERMSIG(status)) + ")";
      std::printf("seed %llu: CRASHED with signal %d\n", (unsigned long long)seed, WTERMSIG(status));
    } else if (WEXITSTATUS(status) == 2) {
      return 2;
    }
    failed.push_back(what);
    if (!parsed.keep_going) break;
  }
  std::printf("vramswap_stress: %zu of %llu seeds failed", failed.size(), (unsigned long long)ran);
  for (size_t i = 0; i < failed.size(); ++i) std::printf("%s%s", i ? " " : ": ", failed[i].c_str());
  std::printf("\n");
  return failed.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Parsed parsed = parse(argc, argv);
  const Options& o = parsed.options;
  signal(SIGSEGV, on_fatal_signal);
  signal(SIGBUS, on_fatal_signal);
  signal(SIGABRT, on_fatal_signal);
  if (parsed.fork) return run_forked(parsed);

  if (o.chaos && !std::getenv("CUDASIM_CHAOS")) setenv("CUDASIM_CHAOS", std::to_string(o.seed).c_str(), 1);
  stress::Library lib;
  if (!set_up(o, &lib)) return 2;
  std::vector<uint64_t> failed;
  uint64_t ran = 0;
  for (uint64_t seed = o.seed; seed < o.seed + o.seeds; ++seed) {
    ++ran;
    if (run_one(lib, o, seed, seed == o.seed)) continue;
    failed.push_back(seed);
    if (!parsed.keep_going) break;
  }
  remove_disk_dir();
  if (o.seeds > 1) {
    std::printf("vramswap_stress: %zu of %llu seeds failed", failed.size(), (unsigned long long)ran);
    for (size_t i = 0; i < failed.size(); ++i) std::printf("%s%llu", i ? " " : ": ", (unsigned long long)failed[i]);
    std::printf("\n");
  }
  return failed.empty() ? 0 : 1;
}
