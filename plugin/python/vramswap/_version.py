"""vramswap's version: the C library's (CMakeLists.txt's project VERSION, libvramswap.so.0);
tests/python/test_package.py checks that the two agree."""
__version__ = "0.1.0"
