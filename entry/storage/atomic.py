"""Files that are either whole or absent (temporary beside the target, fsync, rename, fsync the
folder): the run folder's writes. The one implementation is pipelines/atomic.py, which the data
writers below entry/ use too; these are its names."""

from pipelines.atomic import (NEARLY_FULL_BYTES, PART_SUFFIX, atomic_write, atomic_write_all, atomic_write_bytes,
                              atomic_write_json, current_umask, fsync_dir, no_space_error, publish, published_mode,
                              read_json, remove_leftovers)

__all__ = ["NEARLY_FULL_BYTES", "PART_SUFFIX", "atomic_write", "atomic_write_all", "atomic_write_bytes",
           "atomic_write_json", "current_umask", "fsync_dir", "no_space_error", "publish", "published_mode",
           "read_json", "remove_leftovers"]
