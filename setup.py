"""The one compiled part of kvtier: `kvtier._keytable` (see kvtier/_keytable.c). Everything else is in
pyproject.toml. Without a C compiler the build fails loudly rather than leave a slower index behind."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier._keytable", ["kvtier/_keytable.c"], extra_compile_args=["-O2", "-Wall", "-Werror"])])
