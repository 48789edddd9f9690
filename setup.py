"""Build hook for stoker's one optional C extension (everything else is in pyproject.toml).

``stoker.decode._jpegroi`` decodes a region of a JPEG through the system libjpeg-turbo
(``libjpeg62-turbo-dev`` on Debian/Ubuntu, ``libjpeg-turbo-devel`` on Fedora).  It is optional:
when the headers or a C compiler are missing the build skips it and stoker decodes whole images
with simplejpeg instead (same pixels, slower).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stoker.decode._jpegroi",
            ["src/stoker/decode/_jpegroi.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
