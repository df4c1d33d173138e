// One seed of the stress test: the threads' random programs and the shadow model. See
// worker.h for the protocol the programs keep and what counts as a failure.
#include "worker.h"

#include <algorithm>
#include <barrier>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <thread>

namespace stress {

bool Failures::tolerated(const std::string& message) {
  for (const KnownBug* bug : known_) {
    if (!bug->matches(message, spec_)) continue;
    for (Seen& s : seen_)
      if (s.bug == bug) {
        ++s.count;
        return true;
      }
    seen_.push_back({bug, 1, message});
    return true;
  }
  return false;
}

void Failures::add(const std::string& message) {
  std::lock_guard lock(mu_);
  if (tolerated(message)) return;
  messages_.push_back(message);
  stopping_.store(true, std::memory_order_relaxed);
}

void Failures::add_message_defect(const std::string& key, const std::string& message) {
  std::lock_guard lock(mu_);
  if (tolerated(message)) return;
  if (std::find(keys_.begin(), keys_.end(), key) != keys_.end()) return;
  keys_.push_back(key);
  messages_.push_back(message);
}

std::vector<std::string> Failures::take() {
  std::lock_guard lock(mu_);
  std::vector<std::string> out;
  out.swap(messages_);
  keys_.clear();
  stopping_.store(false, std::memory_order_relaxed);
  return out;
}

std::vector<Failures::Seen> Failures::known_seen() {
  std::lock_guard lock(mu_);
  return seen_;
}

namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
// VRAMSWAP_MIN_OFFLOAD_BYTES as main() configures it: blocks at least this large made in a
// scope are tagged.
// The default, 64 KiB: tagged blocks below half a granule share granules (placed for
// eviction, fetched and evicted a granule at a time), larger ones take granules of their own.
constexpr size_t kMinOffload = 64 * kKiB;
// Live blocks of all threads together (each thread at least 4): about 48 MiB with the sizes
// below, past the default 32 MiB limit, so cold blocks must be evicted for others to fit.
constexpr size_t kMaxBlocksInAll = 48;
// A host synchronization that an injected failure refused is tried this many times.
constexpr int kSyncTries = 64;
// Operations remembered per block, printed with a failure that names it.
constexpr size_t kHistory = 12;

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

// A message that reports a failed CUDA call names it: "<call>(<args>) failed: <code> ...".
// Returns "<word> failed: <code> ... at <file:line>" for the first code that follows a word
// that is not a call ("" when every code in the message follows its call): the key that
// reports each such place once.
std::string unnamed_cuda_call(const char* message) {
  const std::string m(message);
  for (const char* code : {" failed: cudaError", " failed: CUDA_ERROR_"}) {
    for (size_t at = m.find(code); at != std::string::npos; at = m.find(code, at + 1)) {
      if (at > 0 && m[at - 1] == ')') continue;
      const size_t space = at == 0 ? std::string::npos : m.rfind(' ', at - 1);
      const size_t start = space == std::string::npos ? 0 : space + 1;
      const size_t code_end = m.find(' ', at + 9);
      std::string key = m.substr(start, (code_end == std::string::npos ? m.size() : code_end) - start);
      if (const size_t where = m.find(" at ", at); where != std::string::npos)
        key += m.substr(where, m.find_first_of(";)", where) - where);
      return key;
    }
  }
  return "";
}

// Refusals a correct program must expect even with no fault injected: memory runs out.
bool out_of_memory_message(const char* message) {
  std::string m(message);
  std::transform(m.begin(), m.end(), m.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return m.find("out of memory") != std::string::npos || m.find("no device memory") != std::string::npos ||
         m.find("refused by the limit") != std::string::npos;
}

const char* stream_name(cudaStream_t s) {
  static thread_local char buf[32];
  if (s == nullptr) return "legacy";
  if (s == cudaStreamPerThread) return "per-thread";
  std::snprintf(buf, sizeof buf, "%p", static_cast<void*>(s));
  return buf;
}

// Address ranges of every live block of the seed (all threads): a block that overlaps
// another is a failure of the pool.
class LiveRanges {
 public:
  // The block's description that [p, p+n) overlaps, or "".
  std::string insert(const void* p, size_t n, const std::string& who) {
    std::lock_guard lock(mu_);
    const uintptr_t a = reinterpret_cast<uintptr_t>(p), b = a + n;
    auto next = ranges_.lower_bound(a);
    if (next != ranges_.end() && next->first < b) return next->second.second;
    if (next != ranges_.begin()) {
      auto prev = std::prev(next);
      if (prev->second.first > a) return prev->second.second;
    }
    ranges_[a] = {b, who};
    return "";
  }
  void erase(const void* p) {
    std::lock_guard lock(mu_);
    ranges_.erase(reinterpret_cast<uintptr_t>(p));
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, std::pair<uintptr_t, std::string>> ranges_;
};

// kKept: kept and in use (after vramswap_keep or vramswap_use); kKeptCold: kept, between uses.
enum class State { kPlain, kPacked, kCold, kUnpacked, kKept, kKeptCold };

const char* state_name(State s) {
  switch (s) {
    case State::kPlain: return "plain";
    case State::kPacked: return "packed";
    case State::kCold: return "cold";
    case State::kUnpacked: return "unpacked";
    case State::kKept: return "kept, in use";
    case State::kKeptCold: return "kept, cold";
  }
  return "?";
}

// What the program knows of one of its blocks, and what the block must hold.
struct Block {
  uint64_t id = 0;
  unsigned char* ptr = nullptr;
  size_t size = 0;
  cudaStream_t alloc_stream = nullptr;  // vramswap_malloc's and vramswap_free's stream
  cudaStream_t cur = nullptr;           // the stream its latest work is queued on
  std::vector<cudaStream_t> streams;    // streams other than alloc_stream it was used on
  std::vector<cudaStream_t> unrecorded; // of those, the ones record_stream refused
  bool expect_tagged = false;           // allocated in a scope, at least kMinOffload
  bool free_refused = false;            // vramswap_free failed and said the block stays
                                        // allocated: the program frees it again later
  bool allocated_under_faults = false;  // a tagged allocation may have fallen back then
  bool initialized = false;             // the whole block was written once: the shadow holds
  uint64_t handle = 0;
  int refs = 0;
  bool frozen = false;                  // kept frozen: never written again
  State state = State::kPlain;
  std::vector<unsigned char> shadow;    // what every byte must hold (once initialized)
  std::vector<std::string> history;     // its last kHistory operations, for a failure report
  bool trace = false;                   // --trace: print each operation as it is noted

  void note(const std::string& what) {
    if (history.size() == kHistory) history.erase(history.begin());
    history.push_back(what);
    if (trace) std::fprintf(stderr, "trace: thread %d block %llu %p: %s\n", int(id >> 32), (unsigned long long)id,
                            static_cast<void*>(ptr), what.c_str());
  }
};

struct Shared {
  const Library& lib;
  const Options& options;
  uint64_t seed;
  Failures* failures;
  SeedStats* stats;
  LiveRanges ranges;
  // True while the seed's fault rules are in force (its random phase); set by run_seed
  // between phases, when no worker runs.
  bool faults = false;
};

class Worker {
 public:
  Worker(Shared& shared, int index)
      : s_(shared), lib_(shared.lib), index_(index),
        rng_(splitmix(shared.seed * 0x1000193u + uint64_t(index) + 1)) {}

  void setup() {
    phase_ = "setup";
    lib_.set_device(0);
    for (int i = 0; i < 2; ++i) create_stream();
    if (rng_() % 2) op_scope();
    for (int i = 0; i < 4; ++i) {
      cudaEvent_t e = nullptr;
      if (lib_.event_create(&e, cudaEventDisableTiming) == cudaSuccess) events_.push_back(e);
      else cuda_failed("cudaEventCreateWithFlags", nullptr);
    }
  }

  void random_phase() {
    phase_ = "random";
    for (op_ = 0; op_ < s_.options.ops && !s_.failures->any(); ++op_) {
      s_.stats->ops.fetch_add(1, std::memory_order_relaxed);
      random_op();
      if (s_.options.invariants_every > 0 && (op_ + 1) % s_.options.invariants_every == 0) check_invariants();
    }
  }

  // Faults are off from here: everything must succeed. First the blocks nobody marked
  // cold, so that the cold ones, each fetched and freed in turn, fit.
  void cleanup_not_cold() {
    phase_ = "cleanup";
    op_ = 0;
    for (size_t i = blocks_.size(); i-- > 0;) {
      Block& b = *blocks_[i];
      if ((b.state == State::kCold || b.state == State::kKeptCold) && !b.free_refused) continue;
      ++op_;
      if (!b.free_refused) read(b, true, b.cur);
      while (!b.free_refused && b.refs > 0)
        if (!release(b)) break;
      free(i);
    }
  }

  void cleanup_cold() {
    phase_ = "cleanup";
    for (size_t i = blocks_.size(); i-- > 0;) {
      Block& b = *blocks_[i];
      ++op_;
      if (b.free_refused) {
        free(i);
        continue;
      }
      if (b.state == State::kKeptCold) {
        switch (rng_() % 3) {
          case 0:  // a last use
            if (use(b, b.cur)) read(b, true, b.cur);
            break;
          case 1:  // unkept: brought back before unkeep returns
            if (unkeep(b)) read(b, true, b.cur);
            break;
          default:  // freed while cold
            break;
        }
        free(i);
        continue;
      }
      switch (rng_() % 3) {
        case 0:  // backward: unpack, use, release
          if (unpack(b, b.cur)) {
            read(b, true, b.cur);
            while (b.refs > 0)
              if (!release(b)) break;
          }
          break;
        case 1:  // released without an unpack: brought back before release returns
          while (b.refs > 0)
            if (!release(b)) break;
          if (b.state == State::kPlain) read(b, true, b.cur);
          break;
        default:  // freed while cold: the host copy goes with it
          break;
      }
      free(i);
    }
  }

  void teardown() {
    phase_ = "teardown";
    while (scope_depth_ > 0) {
      lib_.scope_pop();
      --scope_depth_;
    }
    for (cudaStream_t st : owned_) {
      if (!sync(st)) continue;
      if (lib_.stream_destroy(st) != cudaSuccess) cuda_failed("cudaStreamDestroy", nullptr);
    }
    owned_.clear();
    for (cudaEvent_t e : events_)
      if (lib_.event_destroy(e) != cudaSuccess) cuda_failed("cudaEventDestroy", nullptr);
    events_.clear();
    sync(cudaStreamPerThread);  // the thread's own default stream: nothing of it left queued
  }

 private:
  // ---- Reporting -------------------------------------------------------------------------

  void fail(const Block* b, const std::string& what) {
    std::string m = format("seed %llu thread %d %s op %d: ", (unsigned long long)s_.seed, index_, phase_, op_) + what;
    if (b) {
      m += format("\n    block %llu: %p, %zu bytes, %s, handle 0x%llx refs %d, allocated on %s",
                  (unsigned long long)b->id, static_cast<void*>(b->ptr), b->size, state_name(b->state),
                  (unsigned long long)b->handle, b->refs, stream_name(b->alloc_stream));
      m += format(", latest work on %s, %s", stream_name(b->cur), b->expect_tagged ? "tagged" : "untagged");
      m += "\n    its last operations:";
      for (const std::string& h : b->history) m += "\n      " + h;
    }
    s_.failures->add(m);
  }

  // A CUDA call of the program failed: expected only under injected faults.
  void cuda_failed(const char* what, const Block* b, cudaError_t e = cudaSuccess) {
    if (e == cudaSuccess) e = lib_.get_last_error();
    else lib_.get_last_error();
    if (!s_.faults) fail(b, format("%s failed with %s, and no fault was injected", what, lib_.error_name(e)));
  }

  // A vramswap call returned failure: it must say why; with no fault injected, only
  // running out of memory may refuse it (when `oom_allowed`).
  void refused(const char* what, const Block* b, bool oom_allowed) {
    const char* error = lib_.last_error();
    s_.stats->refused.fetch_add(1, std::memory_order_relaxed);
    if (!*error) {
      fail(b, format("%s failed with no last error", what));
      return;
    }
    message_names_its_call(what, error);
    if (!s_.faults && !(oom_allowed && out_of_memory_message(error)))
      fail(b, format("%s failed with no fault injected: %s", what, error));
    else if (s_.options.verbose)
      std::fprintf(stderr, "vramswap_stress: seed %llu thread %d op %d: %s refused: %s\n",
                   (unsigned long long)s_.seed, index_, op_, what, error);
    lib_.get_last_error();  // vramswap's CUDA error, if any, is not the program's to see next
  }

  // A failure's message must name the CUDA call that failed (vramswap.h: the last error says
  // what failed and why).
  void message_names_its_call(const char* what, const char* error) {
    const std::string key = unnamed_cuda_call(error);
    if (key.empty()) return;
    s_.failures->add_message_defect(
        key, format("seed %llu thread %d %s op %d: %s failed with a last error that does not name the CUDA call "
                    "that failed (\"%s\"): %s",
                    (unsigned long long)s_.seed, index_, phase_, op_, what, key.c_str(), error));
  }

  // vramswap's calls that report through the last error alone: "" after success.
  void expect_no_error(const char* what, const Block* b) {
    const char* error = lib_.last_error();
    if (*error && !s_.faults) fail(b, format("%s set the last error: %s", what, error));
  }

  void check_invariants() {
    if (!lib_.check_invariants) return;
    s_.stats->invariant_checks.fetch_add(1, std::memory_order_relaxed);
    if (lib_.check_invariants() != 0) fail(nullptr, format("vramswap_check_invariants: %s", lib_.last_error()));
  }

  // ---- Streams and ordering ----------------------------------------------------------------

  void create_stream() {
    cudaStream_t st = nullptr;
    const unsigned flags = rng_() % 2 ? cudaStreamNonBlocking : cudaStreamDefault;
    if (const cudaError_t e = lib_.stream_create(&st, flags); e != cudaSuccess)
      cuda_failed("cudaStreamCreateWithFlags", nullptr, e);
    else
      owned_.push_back(st);
  }

  cudaStream_t pick_stream() {
    const size_t n = owned_.size() + 2;
    const size_t i = rng_() % n;
    if (i < owned_.size()) return owned_[i];
    return i == owned_.size() ? nullptr : cudaStreamPerThread;
  }

  // Waits on the host for `st`; false when every try was refused (only under faults).
  bool sync(cudaStream_t st) {
    for (int i = 0; i < kSyncTries; ++i) {
      const cudaError_t e = lib_.stream_synchronize(st);
      if (e == cudaSuccess) return true;
      cuda_failed("cudaStreamSynchronize", nullptr, e);
      if (!s_.faults) return false;
    }
    return false;
  }

  // Orders the work queued on `later` from now on after the work queued on `prior` so far.
  bool order_after(cudaStream_t later, cudaStream_t prior) {
    if (later == prior) return true;
    if (!events_.empty()) {
      cudaEvent_t e = events_[rng_() % events_.size()];
      cudaError_t r = lib_.event_record(e, prior);
      if (r == cudaSuccess) {
        r = lib_.stream_wait_event(later, e, 0);
        if (r == cudaSuccess) return true;
        cuda_failed("cudaStreamWaitEvent", nullptr, r);
      } else {
        cuda_failed("cudaEventRecord", nullptr, r);
      }
    }
    return sync(prior);  // what a program does when it cannot queue the wait
  }

  // Makes `st` the stream the block's next work goes to: ordered after its latest work, and
  // named to vramswap with record_stream when it is not the allocation stream.
  bool use_on(Block& b, cudaStream_t st) {
    if (!order_after(st, b.cur)) return false;
    name_stream(b, st);
    b.cur = st;
    return true;
  }

  // Names `st` to vramswap with record_stream the first time the block's work goes there,
  // unless it is the allocation stream.
  void name_stream(Block& b, cudaStream_t st) {
    if (st == b.alloc_stream || std::find(b.streams.begin(), b.streams.end(), st) != b.streams.end()) return;
    b.streams.push_back(st);
    lib_.record_stream(b.ptr, st);
    if (*lib_.last_error()) {
      expect_no_error("vramswap_record_stream", &b);
      b.unrecorded.push_back(st);  // the program synchronizes it before the free instead
    }
    b.note(format("op %d record_stream %s", op_, stream_name(st)));
  }

  cudaStream_t stream_for(Block& b) { return rng_() % 4 == 0 ? pick_stream() : b.cur; }

  // ---- The operations ----------------------------------------------------------------------

  template <typename Pred>
  Block* pick(Pred pred) {
    std::vector<Block*> c;
    for (auto& b : blocks_)
      if (pred(*b)) c.push_back(b.get());
    return c.empty() ? nullptr : c[rng_() % c.size()];
  }

  static bool usable(const Block& b) {
    return b.state != State::kCold && b.state != State::kKeptCold && !b.free_refused;
  }

  bool op_alloc() {
    if (blocks_.size() >= std::max<size_t>(4, kMaxBlocksInAll / size_t(s_.options.threads))) return false;
    size_t size;
    switch (rng_() % 3) {
      case 0: size = kMiB + rng_() % (3 * kMiB); break;                // large: tagged in a scope
      case 1: size = kMinOffload + rng_() % (kMiB - kMinOffload); break;  // small: tagged, sharing granules
      default: size = 1 + rng_() % (kMinOffload - 1); break;            // never tagged
    }
    const cudaStream_t st = pick_stream();
    s_.stats->allocs.fetch_add(1, std::memory_order_relaxed);
    void* p = lib_.malloc(size, 0, st);
    if (!p) {
      s_.stats->ooms.fetch_add(1, std::memory_order_relaxed);
      refused(format("vramswap_malloc(%zu, 0, %s)", size, stream_name(st)).c_str(), nullptr, true);
      return true;
    }
    expect_no_error("vramswap_malloc", nullptr);
    auto b = std::make_unique<Block>();
    b->id = (uint64_t(index_) << 32) | ++next_id_;
    b->trace = s_.options.trace;
    b->ptr = static_cast<unsigned char*>(p);
    b->size = size;
    b->alloc_stream = b->cur = st;
    b->expect_tagged = scope_depth_ > 0 && size >= kMinOffload;
    b->allocated_under_faults = s_.faults;
    b->shadow.assign(size, 0);
    b->note(format("op %d malloc on %s%s", op_, stream_name(st), scope_depth_ ? " in a scope" : ""));
    if (reinterpret_cast<uintptr_t>(p) % 512)
      fail(b.get(), "vramswap_malloc returned a block aligned to less than 512 bytes");
    const std::string who = format("block %llu of thread %d", (unsigned long long)b->id, index_);
    if (std::string other = s_.ranges.insert(p, size, who); !other.empty())
      fail(b.get(), "vramswap_malloc returned a block that overlaps the live " + other);
    blocks_.push_back(std::move(b));
    write(*blocks_.back(), blocks_.back()->cur);  // defines every byte
    return true;
  }

  // Writes a random range (every byte, while the block was never written whole).
  void write(Block& b, cudaStream_t st) {
    size_t off = 0, len = b.size;
    if (b.initialized && rng_() % 4) {
      off = rng_() % b.size;
      len = 1 + rng_() % std::min(b.size - off, 512 * kKiB);
    }
    const bool fill = !b.initialized || rng_() % 2;
    cudaError_t e;
    std::vector<unsigned char> data;
    unsigned char value = 0;
    if (fill) {
      value = static_cast<unsigned char>(rng_());
      e = lib_.memset_async(b.ptr + off, value, len, st);
    } else {
      data.resize(len);
      uint64_t x = rng_() | 1;
      for (size_t i = 0; i < len; ++i) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        data[i] = static_cast<unsigned char>(x);
      }
      // From pageable memory: the call returns once the source is staged.
      e = lib_.memcpy_async(b.ptr + off, data.data(), len, cudaMemcpyHostToDevice, st);
    }
    if (e != cudaSuccess) {
      cuda_failed(fill ? "cudaMemsetAsync" : "cudaMemcpyAsync", &b, e);
      b.note(format("op %d write [%zu, +%zu) on %s failed", op_, off, len, stream_name(st)));
      return;
    }
    if (fill) std::memset(b.shadow.data() + off, value, len);
    else std::memcpy(b.shadow.data() + off, data.data(), len);
    if (len == b.size) b.initialized = true;
    b.note(format("op %d %s [%zu, +%zu) on %s", op_, fill ? "memset" : "memcpy H2D", off, len, stream_name(st)));
  }

  bool op_write() {
    Block* b = pick([](const Block& x) { return usable(x) && !x.frozen; });
    if (!b) return false;
    if (use_on(*b, stream_for(*b))) write(*b, b->cur);
    return true;
  }

  // Reads a range (or the whole block) back on `st` and compares it with the shadow.
  void read(Block& b, bool whole, cudaStream_t st) {
    if (!b.initialized) return;
    if (!use_on(b, st)) return;
    size_t off = 0, len = b.size;
    if (!whole && rng_() % 4) {
      off = rng_() % b.size;
      len = 1 + rng_() % std::min(b.size - off, 1 * kMiB);
    }
    std::vector<unsigned char> out(len);
    for (size_t i = 0; i < len; ++i) out[i] = static_cast<unsigned char>(~b.shadow[off + i]);  // a copy that
                                                                                              // did nothing shows
    const cudaError_t e = lib_.memcpy_async(out.data(), b.ptr + off, len, cudaMemcpyDeviceToHost, st);
    if (e != cudaSuccess) {
      cuda_failed("cudaMemcpyAsync", &b, e);
      return;
    }
    if (!sync(st)) return;  // cannot know when the copy landed: nothing to compare
    s_.stats->reads.fetch_add(1, std::memory_order_relaxed);
    s_.stats->bytes_checked.fetch_add(len, std::memory_order_relaxed);
    b.note(format("op %d read [%zu, +%zu) on %s", op_, off, len, stream_name(st)));
    if (std::memcmp(out.data(), b.shadow.data() + off, len) == 0) return;
    size_t first = len, last = 0, count = 0;
    for (size_t i = 0; i < len; ++i)
      if (out[i] != b.shadow[off + i]) {
        first = std::min(first, i);
        last = i;
        ++count;
      }
    fail(&b, format("read back differs from the shadow at block offset %zu (expected 0x%02x, read 0x%02x): %zu of "
                    "%zu bytes read differ, in [%zu, %zu]",
                    off + first, b.shadow[off + first], out[first], count, len, off + first, off + last));
  }

  bool op_read() {
    Block* b = pick([](const Block& x) { return usable(x) && x.initialized; });
    if (!b) return false;
    read(*b, rng_() % 5 == 0, stream_for(*b));
    return true;
  }

  bool op_pack() {
    Block* b = pick([](const Block& x) {
      return !x.free_refused && (x.state == State::kPlain || (x.state == State::kPacked && x.refs < 3));
    });
    if (!b) return false;
    const uint64_t h = lib_.pack(b->ptr + rng_() % b->size, b->cur);
    if (h == 0) {
      if (*lib_.last_error()) {
        refused("vramswap_pack", b, false);
      } else if (b->expect_tagged && !b->allocated_under_faults) {
        fail(b, "vramswap_pack returned 0 for a block allocated in a scope");
      } else if (b->state == State::kPacked) {
        fail(b, "vramswap_pack returned 0 for a packed block");
      }
      return true;
    }
    s_.stats->packs.fetch_add(1, std::memory_order_relaxed);
    b->note(format("op %d pack -> 0x%llx", op_, (unsigned long long)h));
    if (!b->expect_tagged) fail(b, "vramswap_pack returned a handle for a block allocated outside any scope");
    if (b->state == State::kPacked && h != b->handle) {
      fail(b, format("packing again returned handle 0x%llx", (unsigned long long)h));
      return true;
    }
    b->handle = h;
    ++b->refs;
    b->state = State::kPacked;
    return true;
  }

  bool op_mark_cold() {
    Block* b = pick([](const Block& x) {
      return !x.free_refused && (x.state == State::kPacked || x.state == State::kUnpacked || x.state == State::kKept);
    });
    if (!b) return false;
    if (!use_on(*b, stream_for(*b))) return true;
    if (lib_.mark_cold(b->handle, b->cur) != 0) {
      refused("vramswap_mark_cold", b, false);
      b->note(format("op %d mark_cold on %s refused", op_, stream_name(b->cur)));
      return true;
    }
    expect_no_error("vramswap_mark_cold", b);
    s_.stats->colds.fetch_add(1, std::memory_order_relaxed);
    b->state = b->state == State::kKept ? State::kKeptCold : State::kCold;
    b->note(format("op %d mark_cold on %s", op_, stream_name(b->cur)));
    return true;
  }

  // A cold block's unpack relies on vramswap's promise (vramswap.h): its contents are valid
  // for work queued on `st` after the call, wherever it was written before mark_cold, so the
  // program orders nothing itself. A block packed but never cold has no cold mark to order
  // after: the program orders `st` after its latest work, as for any use.
  bool unpack(Block& b, cudaStream_t st) {
    const bool cold = b.state == State::kCold;
    if (cold) {
      name_stream(b, st);
    } else if (!use_on(b, st)) {
      return false;
    }
    if (lib_.unpack(b.handle, st) != 0) {
      refused("vramswap_unpack", &b, true);
      b.note(format("op %d unpack on %s refused", op_, stream_name(st)));
      return false;
    }
    expect_no_error("vramswap_unpack", &b);
    s_.stats->unpacks.fetch_add(1, std::memory_order_relaxed);
    b.state = State::kUnpacked;
    b.cur = st;
    b.note(format("op %d unpack on %s%s", op_, stream_name(st), cold ? " (ordered by vramswap)" : ""));
    return true;
  }

  bool op_unpack() {
    Block* b = pick([](const Block& x) {
      return !x.free_refused && (x.state == State::kCold || x.state == State::kPacked);
    });
    if (!b) return false;
    if (unpack(*b, stream_for(*b)) && rng_() % 2) read(*b, true, b->cur);
    return true;
  }

  bool release(Block& b) {
    const State before = b.state;
    if (lib_.release(b.handle) != 0) {
      refused("vramswap_release", &b, true);
      b.note(format("op %d release refused", op_));
      return false;
    }
    expect_no_error("vramswap_release", &b);
    s_.stats->releases.fetch_add(1, std::memory_order_relaxed);
    b.note(format("op %d release (%s, refs %d)", op_, state_name(before), b.refs));
    if (--b.refs == 0) {
      stale_.push_back(b.handle);
      b.handle = 0;
      b.state = State::kPlain;  // resident again (a cold block was brought back)
    }
    return true;
  }

  bool op_release() {
    Block* b = pick([](const Block& x) { return !x.free_refused && x.refs > 0; });
    if (!b) return false;
    const bool was_cold = b->state == State::kCold;
    if (release(*b) && was_cold && b->state == State::kPlain && rng_() % 2) read(*b, true, b->cur);
    return true;
  }

  // Frees blocks_[i] (in any state) and forgets it; or, when vramswap refuses and says the
  // block stays allocated, keeps it to free again later (and never touches it meanwhile).
  void free(size_t i) {
    Block& b = *blocks_[i];
    for (cudaStream_t st : b.unrecorded) sync(st);  // record_stream was refused: wait here instead
    s_.ranges.erase(b.ptr);  // before the free: once it returns, another thread may get the range
    lib_.free(b.ptr, b.size, 0, b.alloc_stream);
    if (const char* error = lib_.last_error(); *error) {
      s_.stats->refused.fetch_add(1, std::memory_order_relaxed);
      message_names_its_call("vramswap_free", error);
      if (!s_.faults) fail(&b, format("vramswap_free set the last error: %s", error));
      else if (s_.options.verbose)
        std::fprintf(stderr, "vramswap_stress: seed %llu thread %d op %d: vramswap_free refused: %s\n",
                     (unsigned long long)s_.seed, index_, op_, error);
      const bool stays = std::strstr(error, "stays allocated") != nullptr;
      lib_.get_last_error();
      if (stays) {
        b.free_refused = true;
        b.note(format("op %d free on %s refused: the block stays allocated", op_, stream_name(b.alloc_stream)));
        const std::string who = format("block %llu of thread %d", (unsigned long long)b.id, index_);
        if (std::string other = s_.ranges.insert(b.ptr, b.size, who); !other.empty())
          fail(&b, "a block whose free was refused now overlaps the live " + other);
        return;
      }
    }
    if (b.handle) stale_.push_back(b.handle);
    s_.stats->frees.fetch_add(1, std::memory_order_relaxed);
    b.note(format("op %d free (%s) on %s", op_, state_name(b.state), stream_name(b.alloc_stream)));
    blocks_.erase(blocks_.begin() + long(i));
  }

  // ---- Kept blocks ---------------------------------------------------------------------

  bool op_keep() {
    Block* b = pick([](const Block& x) { return !x.free_refused && x.state == State::kPlain && x.refs == 0; });
    if (!b) return false;
    const bool frozen = rng_() % 2;
    const uint64_t h = lib_.keep(b->ptr + rng_() % b->size, frozen);
    if (h == 0) {
      expect_no_error("vramswap_keep", b);
      if (b->expect_tagged && !b->allocated_under_faults) fail(b, "vramswap_keep returned 0 for a block allocated in a scope");
      return true;
    }
    s_.stats->keeps.fetch_add(1, std::memory_order_relaxed);
    b->note(format("op %d keep%s -> 0x%llx", op_, frozen ? " (frozen)" : "", (unsigned long long)h));
    if (!b->expect_tagged) fail(b, "vramswap_keep returned a handle for a block allocated outside any scope");
    b->handle = h;
    b->frozen = frozen;
    b->state = State::kKept;  // in use until its mark_cold
    return true;
  }

  // A use of a cold kept block on `st`: valid there after the call (vramswap orders `st`
  // after the cold mark, as for an unpack).
  bool use(Block& b, cudaStream_t st) {
    name_stream(b, st);
    const int lane = rng_() % 2 ? VRAMSWAP_USE_FORWARD : VRAMSWAP_USE_AFTER_BACKWARD;
    if (lib_.use(b.handle, st, lane) != 0) {
      refused("vramswap_use", &b, true);
      b.note(format("op %d use on %s refused", op_, stream_name(st)));
      return false;
    }
    expect_no_error("vramswap_use", &b);
    s_.stats->uses.fetch_add(1, std::memory_order_relaxed);
    b.state = State::kKept;
    b.cur = st;
    b.note(format("op %d use on %s", op_, stream_name(st)));
    return true;
  }

  bool op_use() {
    Block* b = pick([](const Block& x) { return !x.free_refused && x.state == State::kKeptCold; });
    if (!b) return false;
    if (use(*b, stream_for(*b)) && rng_() % 2) read(*b, rng_() % 2, b->cur);
    return true;
  }

  // Kept no more: a plain block again, brought back first when it was away.
  bool unkeep(Block& b) {
    if (lib_.unkeep(b.handle) != 0) {
      refused("vramswap_unkeep", &b, true);
      b.note(format("op %d unkeep refused", op_));
      return false;
    }
    expect_no_error("vramswap_unkeep", &b);
    s_.stats->unkeeps.fetch_add(1, std::memory_order_relaxed);
    b.note(format("op %d unkeep (%s)", op_, state_name(b.state)));
    stale_.push_back(b.handle);
    b.handle = 0;
    b.frozen = false;
    b.state = State::kPlain;
    return true;
  }

  bool op_unkeep() {
    Block* b = pick([](const Block& x) {
      return !x.free_refused && (x.state == State::kKept || x.state == State::kKeptCold);
    });
    if (!b) return false;
    const bool was_cold = b->state == State::kKeptCold;
    if (unkeep(*b) && was_cold && rng_() % 2) read(*b, true, b->cur);
    return true;
  }

  // A cold kept block read through its address, outside its uses (a checkpoint's read):
  // only where nothing can give it up under the read (see worker.h).
  bool op_read_kept_cold() {
    if (s_.options.threads != 1 || s_.faults || !host_vmm_) return false;
    Block* b = pick([](const Block& x) { return !x.free_refused && x.state == State::kKeptCold && x.initialized; });
    if (!b) return false;
    // A fetch ahead of its use may be in flight: the program's read is not ordered after it
    // (vramswap.h: a read outside the uses waits for the device first).
    if (lib_.device_synchronize() != cudaSuccess) {
      cuda_failed("cudaDeviceSynchronize", b);
      return true;
    }
    s_.stats->reads_while_kept.fetch_add(1, std::memory_order_relaxed);
    b->note(format("op %d read while kept and cold", op_));
    read(*b, rng_() % 2, stream_for(*b));
    return true;
  }

  bool op_free() {
    if (blocks_.empty()) return false;
    // Mostly blocks the program is done with; sometimes packed or cold ones (a graph that
    // is never run backward).
    size_t i = rng_() % blocks_.size();
    const Block& b = *blocks_[i];
    if (!b.free_refused && (b.refs > 0 || (b.expect_tagged && b.history.size() < 4)) && rng_() % 3) return false;
    free(i);
    return true;
  }

  // Mostly inside a scope (a forward), where large blocks are tagged.
  bool op_scope() {
    if (scope_depth_ < 2 && (scope_depth_ == 0 || rng_() % 4 == 0)) {
      lib_.scope_push();
      ++scope_depth_;
    } else if (scope_depth_ > 0) {
      lib_.scope_pop();
      expect_no_error("vramswap_scope_pop", nullptr);
      --scope_depth_;
    }
    return true;
  }

  bool op_stream() {
    if (owned_.size() < 3 && (owned_.empty() || rng_() % 2)) {
      create_stream();
      return true;
    }
    // A stream no live block names may go.
    for (size_t i = 0; i < owned_.size(); ++i) {
      const cudaStream_t st = owned_[i];
      bool named = false;
      for (auto& b : blocks_)
        named = named || b->alloc_stream == st || b->cur == st ||
                std::find(b->streams.begin(), b->streams.end(), st) != b->streams.end();
      if (named) continue;
      if (const cudaError_t e = lib_.stream_destroy(st); e != cudaSuccess) {
        cuda_failed("cudaStreamDestroy", nullptr, e);
        return true;
      }
      owned_.erase(owned_.begin() + long(i));
      return true;
    }
    return false;
  }

  bool op_prefetch() {
    Block* b = pick([](const Block& x) { return !x.free_refused && x.state == State::kCold; });
    if (!b) return false;
    if (lib_.prefetch(b->handle) != 0) {
      // Prefetch never evicts to make room: being refused is normal under pressure.
      if (!*lib_.last_error()) fail(b, "vramswap_prefetch failed with no last error");
      lib_.get_last_error();
    }
    b->note(format("op %d prefetch", op_));
    return true;
  }

  // A released or freed block's handle must be refused, with a message.
  bool op_stale() {
    if (stale_.empty()) return false;
    const uint64_t h = stale_[rng_() % stale_.size()];
    s_.stats->stale_probes.fetch_add(1, std::memory_order_relaxed);
    const char* what;
    int rc;
    switch (rng_() % 4) {
      case 0: what = "vramswap_unpack", rc = lib_.unpack(h, pick_stream()); break;
      case 1: what = "vramswap_mark_cold", rc = lib_.mark_cold(h, pick_stream()); break;
      case 2: what = "vramswap_release", rc = lib_.release(h); break;
      default: what = "vramswap_prefetch", rc = lib_.prefetch(h); break;
    }
    if (rc != -1 || !*lib_.last_error())
      fail(nullptr, format("%s(stale handle 0x%llx) returned %d with last error \"%s\"", what,
                           (unsigned long long)h, rc, lib_.last_error()));
    return true;
  }

  bool op_empty_cache() {
    lib_.empty_cache();
    expect_no_error("vramswap_empty_cache", nullptr);
    return true;
  }

  bool op_graph_begin() {
    lib_.graph_begin();
    return true;
  }

  void random_op() {
    struct Op {
      int weight;
      bool (Worker::*run)();
      const char* name;
    };
    static const Op kOps[] = {
        {18, &Worker::op_alloc, "alloc"},         {12, &Worker::op_write, "write"},
        {14, &Worker::op_read, "read"},           {16, &Worker::op_pack, "pack"},
        {16, &Worker::op_mark_cold, "mark_cold"}, {10, &Worker::op_unpack, "unpack"},
        {8, &Worker::op_release, "release"},      {8, &Worker::op_free, "free"},
        {4, &Worker::op_scope, "scope"},          {2, &Worker::op_stream, "stream"},
        {3, &Worker::op_prefetch, "prefetch"},    {2, &Worker::op_stale, "stale handle"},
        {1, &Worker::op_empty_cache, "empty_cache"}, {1, &Worker::op_graph_begin, "graph_begin"},
        {3, &Worker::op_keep, "keep"},            {6, &Worker::op_use, "use"},
        {2, &Worker::op_unkeep, "unkeep"},        {3, &Worker::op_read_kept_cold, "read kept cold"},
    };
    static const int kTotal = [] {
      int t = 0;
      for (const Op& o : kOps) t += o.weight;
      return t;
    }();
    for (int tries = 0; tries < 16; ++tries) {
      int r = int(rng_() % uint64_t(kTotal));
      const Op* op = kOps;
      while (r >= op->weight) r -= op++->weight;
      if (s_.options.trace) std::fprintf(stderr, "trace: thread %d op %d: %s\n", index_, op_, op->name);
      if ((this->*op->run)()) return;
    }
  }

  Shared& s_;
  const Library& lib_;
  const int index_;
  std::mt19937_64 rng_;
  const char* phase_ = "setup";
  int op_ = 0;
  uint64_t next_id_ = 0;
  int scope_depth_ = 0;
  std::vector<std::unique_ptr<Block>> blocks_;
  std::vector<cudaStream_t> owned_;
  std::vector<cudaEvent_t> events_;
  std::vector<uint64_t> stale_;
  const bool host_vmm_ = lib_.host_vmm();
};

// The functions vramswap calls (src/cuda) whose failure it must survive, for
// auto_fault_spec, with how rare a failure of each should be to let a seed still move.
struct Candidate {
  const char* name;
  double max_probability;
};
constexpr Candidate kCandidates[] = {
    {"cuMemCreate", 0.2},        {"cuMemMap", 0.1},          {"cuMemSetAccess", 0.1},
    {"cuMemUnmap", 0.05},        {"cuMemRelease", 0.05},     {"cudaHostAlloc", 0.3},
    {"cudaFreeHost", 0.1},       {"cudaMemcpyAsync", 0.03},  {"cudaEventRecord", 0.03},
    {"cudaEventQuery", 0.03},    {"cudaEventSynchronize", 0.03}, {"cudaStreamWaitEvent", 0.03},
    {"cudaStreamSynchronize", 0.03}, {"cudaDeviceSynchronize", 0.05}, {"cudaEventCreateWithFlags", 0.05},
    {"cudaStreamIsCapturing", 0.02}, {"cudaMemsetAsync", 0.03},
};

}  // namespace

std::string auto_fault_spec(uint64_t seed) {
  std::mt19937_64 rng(splitmix(seed ^ 0xfa17u));
  std::vector<size_t> order(std::size(kCandidates));
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  const size_t n = 2 + rng() % 5;
  std::string spec;
  for (size_t k = 0; k < n; ++k) {
    const Candidate& c = kCandidates[order[k]];
    // From a tenth of the maximum to the maximum, in three steps.
    const double p = c.max_probability / double(1u << (rng() % 3 * 2));
    char rule[96];
    std::snprintf(rule, sizeof rule, "%s%s:p%.4g", spec.empty() ? "" : ",", c.name, p);
    spec += rule;
  }
  return spec;
}

std::string fault_spec(const std::string& faults, uint64_t seed, std::string* error) {
  if (faults == "auto") return auto_fault_spec(seed);
  if (faults.rfind("all:", 0) != 0) return faults;
  const std::string p = faults.substr(4);
  char* end = nullptr;
  const double probability = p.size() > 1 && p[0] == 'p' ? std::strtod(p.c_str() + 1, &end) : -1;
  if (!end || *end || !(probability >= 0 && probability <= 1)) {
    *error = "'" + faults + "' is not all:pX with X a probability from 0 to 1";
    return "";
  }
  std::string spec;
  for (const Candidate& c : kCandidates) spec += (spec.empty() ? "" : ",") + std::string(c.name) + ":" + p;
  return spec;
}

void run_seed(const Library& lib, const Options& options, uint64_t seed, const std::string& spec, Failures* failures,
              SeedStats* stats) {
  Shared shared{lib, options, seed, failures, stats, {}};
  std::vector<std::unique_ptr<Worker>> workers;
  for (int t = 0; t < options.threads; ++t) workers.push_back(std::make_unique<Worker>(shared, t));
  // Phases: set up, (faults on) random programs, (faults off) cleanup of blocks not cold,
  // cleanup of cold ones, teardown. The main thread switches faults between phases.
  std::barrier sync_point(options.threads + 1);
  std::vector<std::thread> threads;
  for (int t = 0; t < options.threads; ++t)
    threads.emplace_back([&, t] {
      Worker& w = *workers[size_t(t)];
      w.setup();
      sync_point.arrive_and_wait();  // faults on
      sync_point.arrive_and_wait();
      w.random_phase();
      sync_point.arrive_and_wait();  // faults off
      sync_point.arrive_and_wait();
      w.cleanup_not_cold();
      sync_point.arrive_and_wait();
      w.cleanup_cold();
      w.teardown();
    });
  sync_point.arrive_and_wait();
  if (!spec.empty()) {
    if (lib.fail_configure(spec.c_str()) != 0) failures->add("cudasim_fail_configure refused: " + spec);
    shared.faults = true;
  }
  sync_point.arrive_and_wait();
  sync_point.arrive_and_wait();
  lib.fail_configure(nullptr);
  shared.faults = false;
  sync_point.arrive_and_wait();
  sync_point.arrive_and_wait();
  for (auto& t : threads) t.join();
}

}  // namespace stress
