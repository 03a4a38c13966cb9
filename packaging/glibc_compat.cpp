// Local definitions of the few C library symbols that the wheel's libstdc++
// (linked statically) and the libstdc++ headers use but glibc 2.28 lacks. Linked
// into _ext only by the wheel build (KVSPLIT_OLDEST_GLIBC, which packaging/build_wheel.sh sets),
// where the link sees no newer glibc (packaging/glibc_stubs.py); hidden, so none
// is exported and no other library binds to them.
//
// Only C headers that declare none of these names: a libstdc++ header would
// declare __libc_single_threaded with default visibility, and <stdlib.h> of glibc
// 2.38 and later renames strtol to __isoc23_strtol.
#include <errno.h>
#include <stdint.h>
#include <sys/random.h>  // getrandom: glibc 2.25

#define KVSPLIT_LOCAL __attribute__((visibility("hidden")))

extern "C" {

// glibc 2.32. libstdc++ skips atomic reference counts while it is nonzero (one
// thread); zero says "maybe several threads", so atomics always: always right.
KVSPLIT_LOCAL char __libc_single_threaded = 0;

// glibc 2.36; libstdc++'s std::random_device("default") draws from it when the
// glibc it was built on has it. From the kernel as glibc does; getrandom fails
// only before Linux 3.17, where glibc's own arc4random aborts too.
KVSPLIT_LOCAL uint32_t arc4random(void) {
  uint32_t value;
  while (getrandom(&value, sizeof value, 0) != static_cast<ssize_t>(sizeof value)) {
    if (errno != EINTR) __builtin_trap();
  }
  return value;
}

// glibc 2.38 headers, for C++ (_GNU_SOURCE) always, call these C23 versions,
// which read a "0b" prefix as binary where the others stop at the "b". Each
// calls the C library's own function by its symbol name, past the headers'.
long kvsplit_strtol(const char*, char**, int) __asm__("strtol");
unsigned long kvsplit_strtoul(const char*, char**, int) __asm__("strtoul");
long long kvsplit_strtoll(const char*, char**, int) __asm__("strtoll");
unsigned long long kvsplit_strtoull(const char*, char**, int) __asm__("strtoull");
KVSPLIT_LOCAL long __isoc23_strtol(const char* s, char** end, int base) {
  return kvsplit_strtol(s, end, base);
}
KVSPLIT_LOCAL unsigned long __isoc23_strtoul(const char* s, char** end, int base) {
  return kvsplit_strtoul(s, end, base);
}
KVSPLIT_LOCAL long long __isoc23_strtoll(const char* s, char** end, int base) {
  return kvsplit_strtoll(s, end, base);
}
KVSPLIT_LOCAL unsigned long long __isoc23_strtoull(const char* s, char** end, int base) {
  return kvsplit_strtoull(s, end, base);
}

}  // extern "C"
