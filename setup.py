"""Build hook for the one optional compiled module, ``lmcache_core._speedups``.

Everything else about the distribution is in ``pyproject.toml``. The extension is
``optional``: where no C compiler is available the build goes on without it and the
pure-Python paths (identical results, slower) are used; ``lmcache-core --version`` says which.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmcache_core._speedups",
            sources=["lmcache_core/_speedups.c"],
            optional=True,
        )
    ]
)
