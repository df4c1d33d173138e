// TempDir: a fresh directory under TMPDIR for a test, removed (with the files left in it)
// when it goes. The disk tier's tests and the engine's disk tests share it.
//
// Thread safety: one test thread.
#ifndef VRAMSWAP_TESTS_RESIDENCY_TEMP_DIR_H
#define VRAMSWAP_TESTS_RESIDENCY_TEMP_DIR_H

#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace residency_test {

class TempDir {
 public:
  // `prefix`: the directory's name before the random part.
  explicit TempDir(const char* prefix = "vramswap-test") {
    std::string templ = base() + "/" + prefix + "-XXXXXX";
    path_ = ::mkdtemp(templ.data()) ? templ : "";
  }
  ~TempDir() { remove(); }
  // Removes the directory with the files left in it (once); false when that failed.
  bool remove() {
    if (path_.empty()) return true;
    for (const std::string& name : entries()) ::unlink((path_ + "/" + name).c_str());
    const bool removed = ::rmdir(path_.c_str()) == 0;
    path_.clear();
    return removed;
  }
  // How many directories made with `prefix` exist now.
  static size_t count(const char* prefix) {
    const std::string start = std::string(prefix) + "-";
    size_t n = 0;
    if (DIR* d = ::opendir(base().c_str())) {
      while (dirent* e = ::readdir(d)) n += std::strncmp(e->d_name, start.c_str(), start.size()) == 0;
      ::closedir(d);
    }
    return n;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // Empty when mkdtemp failed.
  const std::string& path() const { return path_; }
  // The names in it, "." and ".." left out.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    if (DIR* d = ::opendir(path_.c_str())) {
      while (dirent* e = ::readdir(d))
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.push_back(e->d_name);
      ::closedir(d);
    }
    return names;
  }

 private:
  static std::string base() {
    const char* dir = std::getenv("TMPDIR");
    return dir && *dir ? dir : "/tmp";
  }
  std::string path_;
};

}  // namespace residency_test

#endif  // VRAMSWAP_TESTS_RESIDENCY_TEMP_DIR_H
