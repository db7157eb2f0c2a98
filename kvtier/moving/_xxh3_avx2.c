/* xxh3-64 compiled for AVX2, for kvtier.moving._movers.
 *
 * xxHash chooses its vector code when it is compiled, not when it runs: a default x86-64 build
 * gets SSE2, about 20 GB/s on one core here, where AVX2 hashes the same bytes at about 47 GB/s.
 * This unit compiles the same inline xxHash for AVX2 alone (GCC's target pragma also defines
 * __AVX2__, which is what xxHash reads); `_movers` calls it only where the CPU reports AVX2, so
 * the module still loads and hashes on any x86-64. Both give the same digest: xxh3 is one
 * function whatever the vector width (tests/test_movers.py holds the two to Python's xxhash).
 */
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#include <xxhash.h>

uint64_t kvtier_xxh3_avx2(const void *data, size_t length, uint64_t seed) {
    return XXH3_64bits_withSeed(data, length, seed);
}
#endif
