"""The dev cluster's kubelet stand-in: runs pods as local process groups."""
