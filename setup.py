"""The compiled parts of kvtier: `kvtier._keytable` (see kvtier/_keytable.c), `kvtier._replay`
(kvtier/_replay.c) and `kvtier.moving._movers` (kvtier/moving/_movers.c, which needs xxHash's header, Debian's
libxxhash-dev: it is compiled in, so the module needs no xxHash library at run time; `_xxh3_avx2.c`
compiles it once more for AVX2, used where the CPU has it). Everything else is in pyproject.toml. Without a C compiler the build fails
loudly rather than leave a slower index behind.

`kvtier._replay` also gets `-ffp-contract=off`: its TTFT sums must round as Python's do, one
multiplication and one addition at a time, never fused into one FMA instruction.
"""

from setuptools import Extension, setup

FLAGS = ["-O2", "-Wall", "-Werror"]

setup(ext_modules=[
    Extension("kvtier._keytable", ["kvtier/_keytable.c"], extra_compile_args=FLAGS),
    Extension("kvtier._replay", ["kvtier/_replay.c"], extra_compile_args=[*FLAGS, "-ffp-contract=off"]),
    Extension("kvtier.moving._movers", ["kvtier/moving/_movers.c", "kvtier/moving/_xxh3_avx2.c"], extra_compile_args=[*FLAGS, "-pthread"], extra_link_args=["-pthread"]),
])
