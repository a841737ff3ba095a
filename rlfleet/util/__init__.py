"""Small shared helpers: process groups and /proc scans, ports, pinned binaries."""
