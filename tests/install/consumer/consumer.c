/* Allocates and frees through an installed libvramswap.so.0 and prints what its statistics
 * say, so that the test can check the library it ran is the one installed. Exit 0 when every
 * call did what the header promises. */
#include <stdio.h>
#include <string.h>
#include <vramswap/vramswap.h>

int main(void) {
  if (vramswap_configure("VRAMSWAP_LIMIT", "64MiB") != 0) {
    fprintf(stderr, "consumer: vramswap_configure refused VRAMSWAP_LIMIT=64MiB: %s\n", vramswap_last_error());
    return 1;
  }
  void* p = vramswap_malloc(1 << 20, 0, NULL);
  if (p == NULL) {
    fprintf(stderr, "consumer: vramswap_malloc(1 MiB) failed: %s\n", vramswap_last_error());
    return 1;
  }
  char stats[8192];
  size_t n = vramswap_stats_json(stats, sizeof stats);
  if (n == 0 || n >= sizeof stats || strstr(stats, "\"allocated_bytes\"") == NULL) {
    fprintf(stderr, "consumer: vramswap_stats_json gave %zu bytes without allocated_bytes\n", n);
    return 1;
  }
  vramswap_free(p, 1 << 20, 0, NULL);
  if (vramswap_last_error()[0] != '\0') {
    fprintf(stderr, "consumer: vramswap_free set an error: %s\n", vramswap_last_error());
    return 1;
  }
  /* A pointer vramswap never gave out is reported, not accepted. */
  static char foreign[64];
  vramswap_free(foreign, sizeof foreign, 0, NULL);
  if (vramswap_last_error()[0] == '\0') {
    fprintf(stderr, "consumer: vramswap_free accepted a foreign pointer\n");
    return 1;
  }
  printf("consumer: 1 MiB allocated and freed through vramswap\n");
  return 0;
}
