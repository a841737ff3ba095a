"""A Kubernetes cluster without Docker: control plane, PKI, pinned binaries and the node agent."""
