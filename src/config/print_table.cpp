// vramswap_config_table: prints the README's configuration table, generated from the
// table in config.cpp, so that the README can be regenerated and checked.
//
//   vramswap_config_table              prints the table to stdout
//   vramswap_config_table --check F    exit 0 if file F contains the table verbatim, else 1
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "config.h"

int main(int argc, char** argv) {
  const std::string table = vramswap::config::markdown_table();
  if (argc == 1) {
    std::fputs(table.c_str(), stdout);
    return 0;
  }
  if (argc == 3 && std::string_view(argv[1]) == "--check") {
    std::ifstream in(argv[2]);
    if (!in) {
      std::fprintf(stderr, "vramswap_config_table: cannot read %s\n", argv[2]);
      return 2;
    }
    std::stringstream text;
    text << in.rdbuf();
    if (text.str().find(table) != std::string::npos) return 0;
    std::fprintf(stderr,
                 "vramswap_config_table: %s does not contain the current configuration table; "
                 "regenerate it with vramswap_config_table\n",
                 argv[2]);
    return 1;
  }
  std::fprintf(stderr, "usage: vramswap_config_table [--check FILE]\n");
  return 2;
}
