"""An in-place rewrite of a checkpoint that sampling-based identities cannot see (KV tier tests)."""
from __future__ import annotations

import os
from pathlib import Path


def rewrite_in_place_keeping_size_mtime_and_ends(path: Path, donor: Path) -> None:
    """The next epoch overwrites the checkpoint in place: the bytes between the first and last MiB
    come from ``donor`` (same layout), and the modification time is put back."""
    st = path.stat()
    size, mib = st.st_size, 1 << 20
    assert donor.stat().st_size == size and size > 2 * mib + 4096
    middle = donor.read_bytes()[mib:size - mib]
    with open(path, "r+b") as f:
        f.seek(mib)
        f.write(middle)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
