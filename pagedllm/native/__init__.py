"""The CPU C library: sources and the one shared header (``csrc/``), the build (``build.py``),
the ctypes bindings every component uses (``bindings.py``) and the checks that keep the two
sides in agreement (``abi.py``)."""
