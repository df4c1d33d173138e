// VRAMSWAP_STATS_FILE must never destroy what the path names: the first version wrote a
// temporary file and renamed it over the path, which replaced a symbolic link, a FIFO and
// (run as root) a device node with a regular file (src/stats/stats_file.h).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "stats/stats_file.h"

namespace vramswap::stats {
namespace {

class StatsFile : public ::testing::Test {
 protected:
  void SetUp() override {
    char made[] = "/tmp/vramswap_stats_file_XXXXXX";
    ASSERT_NE(mkdtemp(made), nullptr);
    dir_ = made;
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }
  static std::string read(const std::string& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  static mode_t kind(const std::string& path) {
    struct stat st;
    return ::lstat(path.c_str(), &st) == 0 ? st.st_mode & S_IFMT : 0;
  }
  std::string dir_;
};

// Each process of a distributed run writes a file of its own: {pid} and {rank} (RANK, as
// torchrun sets it; 0 without one or when it is not a number) in the path.
TEST(StatsPath, PidAndRankPlaceholdersAreReplaced) {
  EXPECT_EQ("/tmp/stats-3-1234.json", expand_stats_path("/tmp/stats-{rank}-{pid}.json", 1234, "3"));
  EXPECT_EQ("/tmp/stats-0.json", expand_stats_path("/tmp/stats-{rank}.json", 1, nullptr));
  EXPECT_EQ("/tmp/stats-0.json", expand_stats_path("/tmp/stats-{rank}.json", 1, "three"));
  EXPECT_EQ("/tmp/{pid/{rank-{x}.json", expand_stats_path("/tmp/{pid/{rank-{x}.json", 7, "1"));
  EXPECT_EQ("/tmp/7{7}.json", expand_stats_path("/tmp/{pid}{{pid}}.json", 7, "1"));
  EXPECT_EQ("/tmp/plain.json", expand_stats_path("/tmp/plain.json", 7, "1"));
}

TEST_F(StatsFile, ARegularFileIsReplacedWholeAndNoTemporaryIsLeft) {
  const std::string path = dir_ + "/stats.json";
  std::ofstream(path) << "an older and longer document";
  EXPECT_EQ("", write_stats_file(path, "{\"a\":1}\n"));
  EXPECT_EQ("{\"a\":1}\n", read(path));
  EXPECT_EQ("", write_stats_file(dir_ + "/new.json", "{}\n")) << "a path that does not exist yet";
  EXPECT_EQ("{}\n", read(dir_ + "/new.json"));
  EXPECT_EQ(0, std::system(("test $(ls -A '" + dir_ + "' | wc -l) -eq 2").c_str())) << "a temporary file stayed";
}

TEST_F(StatsFile, ASymbolicLinkIsFollowedAndStaysALink) {
  const std::string target = dir_ + "/real.json";
  const std::string link = dir_ + "/stats.json";
  std::ofstream(target) << "old";
  ASSERT_EQ(0, ::symlink("real.json", link.c_str()));
  EXPECT_EQ("", write_stats_file(link, "{\"b\":2}\n"));
  EXPECT_EQ(S_IFLNK, kind(link)) << "the link was replaced by a file";
  EXPECT_EQ("{\"b\":2}\n", read(target));
  // A link to a file that does not exist yet creates it.
  const std::string dangling = dir_ + "/dangling.json";
  ASSERT_EQ(0, ::symlink("later.json", dangling.c_str()));
  EXPECT_EQ("", write_stats_file(dangling, "{}\n"));
  EXPECT_EQ(S_IFLNK, kind(dangling));
  EXPECT_EQ("{}\n", read(dir_ + "/later.json"));
}

// Another local user who can write the directory must not redirect the write. The first
// version wrote "<path>.tmp.<pid>" with O_CREAT|O_TRUNC: a symbolic link planted at that
// predictable name made it overwrite the link's target, and the stats path ended up as the
// link.
TEST_F(StatsFile, ALinkPlantedWhereTheTemporaryFileGoesRedirectsNothing) {
  const std::string victim = dir_ + "/victim";
  std::ofstream(victim) << "secret";
  ASSERT_EQ(0, ::chmod(victim.c_str(), 0600));
  const std::string path = dir_ + "/stats.json";
  for (const std::string& name : {path + ".tmp." + std::to_string(::getpid()), path + ".tmp"})
    ASSERT_EQ(0, ::symlink(victim.c_str(), name.c_str()));
  EXPECT_EQ("", write_stats_file(path, "{\"d\":4}\n"));
  EXPECT_EQ("secret", read(victim)) << "the planted link redirected the write";
  EXPECT_EQ(S_IFREG, kind(path)) << "the stats path is not a regular file";
  EXPECT_EQ("{\"d\":4}\n", read(path));
  struct stat st;
  ASSERT_EQ(0, ::stat(victim.c_str(), &st));
  EXPECT_EQ(0600u, st.st_mode & 07777);
}

// The path itself may be a link the user made (the test above this one), but a link that
// another user owns is refused, as the kernel's fs.protected_symlinks refuses one in a
// shared directory: vramswap resolves links itself, so the kernel's rule does not apply.
TEST_F(StatsFile, ALinkOwnedByAnotherUserIsNotFollowed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to give a link to another user";
  const std::string victim = dir_ + "/victim";
  std::ofstream(victim) << "secret";
  const std::string path = dir_ + "/stats.json";
  ASSERT_EQ(0, ::symlink(victim.c_str(), path.c_str()));
  ASSERT_EQ(0, ::lchown(path.c_str(), 65534, 65534));
  const std::string why = write_stats_file(path, "{}\n");
  EXPECT_NE(std::string::npos, why.find("owned by another user")) << why;
  EXPECT_EQ("secret", read(victim));
  EXPECT_EQ(S_IFLNK, kind(path));
  // One owned by root is followed.
  ASSERT_EQ(0, ::lchown(path.c_str(), 0, 0));
  EXPECT_EQ("", write_stats_file(path, "{}\n"));
  EXPECT_EQ("{}\n", read(victim));
}

TEST_F(StatsFile, AFifoIsWrittenInPlaceAndStaysAFifo) {
  const std::string fifo = dir_ + "/stats.fifo";
  ASSERT_EQ(0, ::mkfifo(fifo.c_str(), 0600));
  std::string got;
  std::thread reader([&] { got = read(fifo); });  // opening for reading waits for the writer
  // The writer opens without blocking, so it needs the reader to be there: retry until it is.
  std::string why = "not tried";
  for (int i = 0; i < 2000 && !why.empty(); ++i) {
    why = write_stats_file(fifo, "{\"c\":3}\n");
    if (!why.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ("", why);
  reader.join();
  EXPECT_EQ("{\"c\":3}\n", got);
  EXPECT_EQ(S_IFIFO, kind(fifo)) << "the FIFO was replaced by a file";
}

TEST_F(StatsFile, AFifoWithNoReaderIsAnErrorNotAHangAndStaysAFifo) {
  const std::string fifo = dir_ + "/stats.fifo";
  ASSERT_EQ(0, ::mkfifo(fifo.c_str(), 0600));
  const std::string why = write_stats_file(fifo, "{}\n");
  EXPECT_NE(std::string::npos, why.find("no reader")) << why;
  EXPECT_EQ(S_IFIFO, kind(fifo));
}

TEST_F(StatsFile, ADeviceIsWrittenInPlaceNeverReplaced) {
  struct stat st;
  if (::stat("/dev/full", &st) != 0 || !S_ISCHR(st.st_mode)) GTEST_SKIP() << "needs /dev/full";
  const std::string why = write_stats_file("/dev/full", "{}\n");  // every write fails: ENOSPC
  EXPECT_NE(std::string::npos, why.find("/dev/full")) << why;
  ASSERT_EQ(0, ::stat("/dev/full", &st));
  EXPECT_TRUE(S_ISCHR(st.st_mode)) << "/dev/full is no longer a device";
  EXPECT_EQ("", write_stats_file("/dev/null", "{}\n"));
  ASSERT_EQ(0, ::stat("/dev/null", &st));
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST_F(StatsFile, ADirectoryIsAnError) {
  const std::string why = write_stats_file(dir_, "{}\n");
  EXPECT_NE(std::string::npos, why.find("directory")) << why;
  EXPECT_EQ(S_IFDIR, kind(dir_));
}

}  // namespace
}  // namespace vramswap::stats
