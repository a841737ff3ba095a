"""Weight snapshots: the on-disk format and its validation, the writer, the scratch volume."""
